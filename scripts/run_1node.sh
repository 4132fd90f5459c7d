#!/usr/bin/env bash
# Pretrain on 1 node: a thin wrapper over scripts/launch.sh (see its --help) that sets --nodes 1.
#   scripts/run_1node.sh --preset bert-1.5b-phase1 --input_dir /data/phase1 --output_dir /results/run
# Devices per node: the preset's (8 in every published recipe) unless you give --devices_per_node D or
# --set devices_per_node=D. Extra options (--launcher torchrun|slurm|aws-batch, --device_kind gaudi1,
# --set max_steps=..., -- <run flags>) are passed through.
exec "$(dirname "${BASH_SOURCE[0]}")/launch.sh" --nodes 1 "$@"
