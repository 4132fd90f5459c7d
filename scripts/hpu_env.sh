# shellcheck shell=bash
# Environment for Intel Gaudi (HPU) runs: the only place this project sets Habana variables.
# Sourced by scripts/launch.sh on every node; the deepspeed launcher's environment file carries every
# exported PT_HPU_*, HCCL_*, HABANA_* and LOG_LEVEL_* variable, and ENABLE_CONSOLE, to the other nodes.
# Each value can be overridden by exporting the variable before launching. These variables are read
# only by Habana's PyTorch bridge and HCCL, so they change nothing on CUDA or CPU.
# Reference: Habana's "Runtime Environment Variables" table, for the release in use: for 1.19,
# https://docs.habana.ai/en/v1.19.0/PyTorch/Reference/Runtime_Flags.html; current releases at
# https://docs.habana.ai/en/latest/PyTorch/Runtime_Flags.html (some defaults differ, PT_HPU_LAZY_MODE's among them).

# Execution mode. 1 = lazy mode: ops are accumulated into a graph that runs at each mark_step()
# (training/accelerator.py calls it after backward and after the optimizer step); this is how the
# reference BERT-1.5B recipe ran. 0 = eager mode, where training/accelerator.py compiles the model
# with torch.compile(backend="hpu_backend") instead. Set here because the bridge's default changed: 1 up to
# the 1.19 table, 0 in the current one. The bridge reads it when it loads (with torch 2.5 and later already
# at `import torch`, through PyTorch's device-extension autoload), so it is set before python starts.
export PT_HPU_LAZY_MODE="${PT_HPU_LAZY_MODE:-1}"

# Cache compiled graph recipes on local disk so that the 8 ranks of a node compile each graph once
# instead of 8 times. Format: <path>,<delete at start>,<max size MB>. Keep it on a local disk, never
# on NFS (Habana: the cache relies on file locks), hence /tmp rather than the home directory; one
# directory per user id, so that another user's cache on a shared node is neither unwritable nor reused.
export PT_HPU_RECIPE_CACHE_CONFIG="${PT_HPU_RECIPE_CACHE_CONFIG:-/tmp/bert_pretraining_recipe_cache_$(id -u),false,8192}"

# Not set here because they are site specific; export them yourself when they apply:
#   HCCL_SOCKET_IFNAME=<nic>   the host network interface(s) HCCL uses for scale-out over host NICs (e.g. eth0)
#   HABANA_VISIBLE_MODULES=0,1 restrict a node to some of its cards, by module ID; Habana supports 2- and
#                              4-card subsets ("0,1", "0,1,2,3", ...); pass --devices_per_node to match
#   LOG_LEVEL_ALL=3 ENABLE_CONSOLE=true   Habana software logs on the console when debugging
