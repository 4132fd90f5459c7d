#!/usr/bin/env bash
# Launch run_pretraining.py with a preset on 1..N nodes.
#
#   scripts/launch.sh --preset NAME --nodes N --input_dir DIR --output_dir DIR [options] [-- extra run_pretraining flags]
#
# Relative paths in the options (and in --set model_config=/deepspeed_config=) are relative to the directory
# launch.sh is called from. After '--' go run_pretraining.py flags the preset does not set (--log_freq, --seed,
# --num_workers, ...); one that it sets is refused, naming the --set field that changes it.
#
# Launchers (--launcher):
#   deepspeed  (default) Run once, on the first node. DeepSpeed's launcher starts every node over pdsh/ssh
#              (ssh port 3022 as in Habana's containers). Needs --hostfile, or --hosts to build one, except on
#              one node, which then runs here (on the first devices of CUDA_VISIBLE_DEVICES, when it is set).
#              <output_dir>/launch/deepspeed_env carries the environment to the nodes (write_env_file below).
#   torchrun   Run once per node with --node_rank 0..N-1; static rendezvous at --master_addr:--master_port.
#   slurm      Run once inside an sbatch allocation: starts one task per node with srun, each of which
#              runs torchrun with node rank SLURM_NODEID and the step's first host as master.
#   aws-batch  Run by every node of an AWS Batch multi-node parallel job: the node count and master address
#              come from AWS_BATCH_JOB_NUM_NODES and AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS (unset on the
#              main node, which uses its own address); the node rank is AWS_BATCH_JOB_NODE_INDEX counted from
#              the main node (AWS_BATCH_JOB_MAIN_NODE_INDEX), which torchrun's master, node rank 0, must be.
#
# Options:
#   --devices_per_node D   devices (ranks) per node; default: the preset's devices_per_node (8 in every
#                          published recipe); the same as --set devices_per_node=D (giving both with
#                          different values is an error)
#   --device_kind K        picks the preset's micro batch for a device kind (e.g. gaudi1 = 32 GB first-gen Gaudi)
#   --hostfile F           DeepSpeed/MPI-style hostfile ("host slots=8" per line)
#   --hosts h1,h2,...      build the hostfile from a host list (written to <output_dir>/launch/hostfile)
#   --node_rank R          this node's rank (torchrun)
#   --master_addr A        rendezvous host; default: the first host, or 127.0.0.1 on one node
#   --master_port P        rendezvous port; default 29500
#   --ssh_port P           sshd port of the other nodes (deepspeed launcher); default 3022
#   --init_checkpoint DIR  phase-1 output directory (or NVIDIA's/Habana's ckpt_<step>.pt), for phase-2 presets
#   --set FIELD=VALUE      override a preset field (max_steps, learning_rate, ...; see training/presets.py)
#   --dry_run              resolve the preset (writing <output_dir>/launch/) and print the command; start nothing
#                          (slurm: the srun line; each of its tasks builds its node's torchrun command)
# Environment: PYTHON (default: .venv/bin/python of this checkout if present, else python3) is the interpreter
# on every node; scripts/hpu_env.sh sets the HPU variables.
set -euo pipefail
# Empty arrays under `set -u` need bash 4.4 (2016); older ones stop with "unbound variable" mid-script.
if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 404)); then
    echo "launch.sh: error: needs bash 4.4 or later; this is bash $BASH_VERSION. Run it with a newer bash (the project's container has one)." >&2
    exit 2
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CALLER_DIR="$PWD"
USER_ENV_NAME="${DS_ENV_FILE:-.deepspeed_env}"  # launch.sh sets DS_ENV_FILE to its own file (write_env_file)
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x $ROOT/.venv/bin/python ]]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
ORIGINAL_ARGS=("$@")

die() { echo "launch.sh: error: $*" >&2; exit 2; }
# The value of a variable the job scheduler sets, or a clear error (inside $(...) the exit ends the script via set -e).
job_var() { [[ -n "${!1:-}" ]] || die "$1 is not set: $2"; printf '%s' "${!1}"; }
abspath() { realpath -m -- "$1"; }
least_cpus_per_node() {  # "96(x2),64" -> 64
  local least="" part count
  IFS=, read -ra parts <<< "$1"
  for part in "${parts[@]}"; do
    count="${part%%(*}"
    [[ "$count" =~ ^[1-9][0-9]*$ ]] || die "SLURM_JOB_CPUS_PER_NODE is '$1', not a list of CPU counts like 96(x2),64"
    if [[ -z "$least" || "$count" -lt "$least" ]]; then least="$count"; fi
  done
  printf '%s' "$least"
}
command -v "$PYTHON" >/dev/null || die "the interpreter PYTHON=$PYTHON is not an executable; set PYTHON to one (e.g. .venv/bin/python)"

PRESET="" NODES="" DEVICES="" DEVICE_KIND="default" LAUNCHER="deepspeed" HOSTFILE="" HOSTS="" NODE_RANK=""
MASTER_ADDR_ARG="" MASTER_PORT_ARG="29500" SSH_PORT="" INPUT_DIR="" OUTPUT_DIR="" INIT_CHECKPOINT="" DRY_RUN=0
OVERRIDES=() EXTRA=()
need() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --preset)  # a name in configs/presets/, or a file relative to the caller's directory
      need "$@"; PRESET="$2"; [[ "$PRESET" != *.json && "$PRESET" != */* ]] || PRESET="$(abspath "$PRESET")"; shift 2 ;;
    --nodes|--devices_per_node)
      need "$@"
      var="$([[ "$1" == --nodes ]] && echo NODES || echo DEVICES)"
      if [[ -n "${!var}" ]]; then
        [[ "$1" == --devices_per_node ]] || die "--nodes given twice (run_<N>nodes.sh sets --nodes; call scripts/launch.sh for another node count)"
        die "--devices_per_node given twice"
      fi
      printf -v "$var" '%s' "$2"; shift 2 ;;
    --device_kind) need "$@"; DEVICE_KIND="$2"; shift 2 ;;
    --launcher) need "$@"; LAUNCHER="$2"; shift 2 ;;
    --hostfile) need "$@"; HOSTFILE="$(abspath "$2")"; shift 2 ;;
    --hosts) need "$@"; HOSTS="$2"; shift 2 ;;
    --node_rank) need "$@"; NODE_RANK="$2"; shift 2 ;;
    --master_addr) need "$@"; MASTER_ADDR_ARG="$2"; shift 2 ;;
    --master_port) need "$@"; MASTER_PORT_ARG="$2"; shift 2 ;;
    --ssh_port) need "$@"; SSH_PORT="$2"; shift 2 ;;
    --input_dir) need "$@"; INPUT_DIR="$(abspath "$2")"; shift 2 ;;
    --output_dir) need "$@"; OUTPUT_DIR="$(abspath "$2")"; shift 2 ;;
    --init_checkpoint) need "$@"; INIT_CHECKPOINT="$(abspath "$2")"; shift 2 ;;
    --set)
      need "$@"
      case "$2" in
        model_config=*|deepspeed_config=*) OVERRIDES+=(--set "${2%%=*}=$(abspath "${2#*=}")") ;;
        *) OVERRIDES+=(--set "$2") ;;
      esac
      shift 2 ;;
    --dry_run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown option '$1' (flags for run_pretraining.py go after '--'; see --help)" ;;
  esac
done

[[ -n "$PRESET" ]] || die "--preset is required (see configs/presets/)"
[[ "$NODES" =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive integer, got '${NODES}'"
[[ -n "$INPUT_DIR" ]] || die "--input_dir is required (the directory holding the HDF5 shards)"
[[ -n "$OUTPUT_DIR" ]] || die "--output_dir is required"
need_dir() { [[ -d "$2" ]] || die "$1 $2 $([[ -e "$2" ]] && echo "is a file, not a directory" || echo "does not exist")"; }
need_dir --input_dir "$INPUT_DIR"
# a phase-1 --output_dir or Hugging Face directory, or NVIDIA's/Habana's ckpt_<step>.pt (a file)
[[ -z "$INIT_CHECKPOINT" || -e "$INIT_CHECKPOINT" ]] || die "--init_checkpoint $INIT_CHECKPOINT does not exist"
[[ ! -e "$OUTPUT_DIR" || -d "$OUTPUT_DIR" ]] || die "--output_dir $OUTPUT_DIR is a file, not a directory"
[[ -z "$DEVICES" || "$DEVICES" =~ ^[1-9][0-9]*$ ]] || die "--devices_per_node must be a positive integer"
check_port() { [[ "$2" =~ ^[1-9][0-9]{0,4}$ && "$2" -le 65535 ]] || die "$1 must be a port number (1..65535), got '$2'"; }
check_port --master_port "$MASTER_PORT_ARG"
[[ -z "$SSH_PORT" ]] || check_port --ssh_port "$SSH_PORT"
[[ -z "$HOSTFILE" || -z "$HOSTS" ]] || die "give --hostfile or --hosts, not both"
repeated="$(tr ',' '\n' <<<"$HOSTS" | awk 'NF && seen[$1]++ {print $1; exit}')"
[[ -z "$repeated" ]] || die "--hosts lists $repeated twice; list each host once"
[[ -z "$HOSTFILE" || -f "$HOSTFILE" ]] || die "hostfile $HOSTFILE does not exist"

LAUNCH_DIR="$OUTPUT_DIR/launch"
mkdir -p "$LAUNCH_DIR"

# shellcheck source=scripts/hpu_env.sh
source "$ROOT/scripts/hpu_env.sh"

# The preset, resolved for this cluster (writing $LAUNCH_DIR/deepspeed_config.json), as shell assignments of
# DEVICES_PER_NODE and RUN_ARGS; a refused preset, override or run flag ends the launch with its message.
resolve_preset() {
  local resolve=("$PYTHON" -m training.presets resolve --preset "$PRESET" --num_nodes "$NODES"
                 --device_kind "$DEVICE_KIND" --deepspeed_config_out "$LAUNCH_DIR/deepspeed_config.json"
                 --format shell "${OVERRIDES[@]}")
  [[ -z "$DEVICES" ]] || resolve+=(--devices_per_node "$DEVICES")
  [[ -z "$INIT_CHECKPOINT" ]] || resolve+=(--init_checkpoint "$INIT_CHECKPOINT")
  resolve+=(-- "${EXTRA[@]}")  # refused where they repeat a flag the launch gives (training/presets.py)
  (cd "$ROOT" && "${resolve[@]}") || die "could not resolve preset '$PRESET' (message above)"
}

# ---- the cluster shape, from the launcher's environment --------------------------------------------------
first_host() {  # the first host of the hostfile or host list, if any
  if [[ -n "$HOSTS" ]]; then echo "${HOSTS%%,*}"
  elif [[ -n "$HOSTFILE" ]]; then awk '!/^[[:space:]]*(#|$)/ {print $1; exit}' "$HOSTFILE"
  fi
}
# DeepSpeed's runner fails on a bad line or a repeated host with a traceback, and starts --num_gpus ranks on a
# host whatever its slots say: checked here, with the line and the fix. Prints the first problem, if any.
hostfile_problem() {
  awk -v file="$HOSTFILE" -v nodes="$NODES" -v devices="$DEVICES" '
    /^[[:space:]]*(#|$)/ { next }
    { sub(/^[[:space:]]+/, ""); hosts++ }
    !/^[^[:space:]]+[[:space:]]+slots=[0-9]+/ {
      printf "hostfile %s line %d: \"%s\" is not \"<host> slots=<devices>\"\n", file, NR, $0; exit }
    seen[$1]++ { printf "hostfile %s line %d: host %s is listed twice; list each host once\n", file, NR, $1; exit }
    hosts <= nodes && substr($2, 7) + 0 < devices {
      printf "hostfile %s line %d: host %s has %s, fewer than the %d devices per node of this run; " \
             "fix slots or pass --devices_per_node %d\n", file, NR, $1, $2, devices, substr($2, 7); exit }' "$HOSTFILE"
}
# DeepSpeed's environment file for pdsh (DS_ENV_FILE): the variables every node's ranks need, as set here.
# An ssh session does not get a container's ENV (Docker gives it to the container's processes, not to sshd's
# sessions), so the search paths and the runtime variables Habana's images set are carried too; every node
# runs the same image or install, as the interpreter path already assumes. DeepSpeed itself forwards only
# NCCL*, PYTHON*, UCX*, MV2* and MLFLOW* variables, so the families of Habana's bridge and HCCL, libfabric
# (HCCL and NCCL over OFI/EFA), gloo and torch's NCCL are carried whole. Then the lines of the user's
# ~/.deepspeed_env and ./.deepspeed_env (the directory launch.sh is called from; both named by the user's
# DS_ENV_FILE, if set), which DeepSpeed would read in place of this file; as there, the later value wins.
FORWARDED_FAMILIES='^(PT_HPU_|HCCL_|HABANA_|FI_|GLOO_|NCCL_|TORCH_NCCL_|LOG_LEVEL_)'
IMAGE_ENV_VARS=(PATH LD_LIBRARY_PATH LD_PRELOAD GC_KERNEL_PATH HABANA_SCAL_BIN_PATH HABANA_PLUGINS_LIB_PATH
                HABANA_LOGS RDMA_CORE_ROOT RDMA_CORE_LIB)
write_env_file() {
  local out="$1" var line n user_file user_files family=() written=" " seen=" "
  mapfile -t family < <(compgen -e | grep -E "$FORWARDED_FAMILIES" || true)
  : >"$out.tmp.$$"
  for var in PYTHONPATH DS_ACCELERATOR ENABLE_CONSOLE "${IMAGE_ENV_VARS[@]}" "${family[@]}"; do
    [[ -n "${!var:-}" && "$written" != *" $var "* ]] || continue
    [[ "${!var}" != *$'\n'* ]] || die "$var holds a line break, which DeepSpeed's environment file cannot carry to the other nodes"
    written+="$var "
    printf '%s=%s\n' "$var" "${!var}" >>"$out.tmp.$$"
  done
  # DeepSpeed joins its name to ~ and . (an absolute name stays itself); ~ works where HOME is unset, as there
  if [[ "$USER_ENV_NAME" == /* ]]; then user_files=("$USER_ENV_NAME")
  else user_files=(~/"$USER_ENV_NAME" "$CALLER_DIR/$USER_ENV_NAME"); fi
  for user_file in "${user_files[@]}"; do
    [[ -f "$user_file" ]] || continue
    user_file="$(realpath -- "$user_file")"
    [[ "$seen" != *" $user_file "* ]] || continue
    seen+="$user_file "
    n=0
    while IFS= read -r line || [[ -n "$line" ]]; do
      n=$((n + 1))
      [[ -n "${line//[[:space:]]/}" ]] || continue  # DeepSpeed fails on a blank line; it means nothing
      # (DeepSpeed takes what is left of the first '=' as the name: 'export A=1' would export 'export A')
      [[ "$line" =~ ^[[:space:]]*[A-Za-z_][A-Za-z0-9_]*= ]] \
        || die "$user_file line $n: '$line' is not NAME=VALUE, the format of DeepSpeed's environment file"
      printf '%s\n' "$line" >>"$out.tmp.$$"
    done <"$user_file"
  done
  mv "$out.tmp.$$" "$out"
}
NNODES="$NODES"
# Options that a launcher would not use are errors, never silently ignored.
[[ -z "$SSH_PORT" || "$LAUNCHER" == deepspeed ]] || die "--ssh_port is for the deepspeed launcher (pdsh), not $LAUNCHER"
[[ -z "$SSH_PORT" || -n "$HOSTFILE$HOSTS" ]] \
  || die "--ssh_port is for pdsh, which the deepspeed launcher uses only with --hostfile or --hosts"
SSH_PORT="${SSH_PORT:-3022}"
[[ -z "$NODE_RANK" || "$LAUNCHER" == torchrun ]] \
  || die "--node_rank is for torchrun; the $LAUNCHER launcher ranks the nodes itself"
[[ -z "$HOSTFILE$HOSTS" || "$LAUNCHER" == deepspeed || "$LAUNCHER" == torchrun ]] \
  || die "--hostfile/--hosts are not used by the $LAUNCHER launcher, which gets its nodes from the job"
case "$LAUNCHER" in
  deepspeed) ;;
  torchrun)
    if [[ "$NODES" -gt 1 && -z "$NODE_RANK" ]]; then die "torchrun on $NODES nodes needs --node_rank (0..$((NODES - 1))) on each node"; fi
    NODE_RANK="${NODE_RANK:-0}" ;;
  slurm)
    if [[ -z "${BERT_LAUNCH_SRUN_TASK:-}" ]]; then
      [[ -n "${SLURM_JOB_ID:-}" ]] || die "--launcher slurm runs inside an allocation (sbatch or salloc); SLURM_JOB_ID is not set"
      # A step of fewer nodes than the allocation is fine (its tasks read the step's variables below).
      job_nodes="$(job_var SLURM_JOB_NUM_NODES "sbatch and salloc set it in an allocation")"
      [[ "$job_nodes" =~ ^[1-9][0-9]*$ && "$job_nodes" -ge "$NODES" ]] \
        || die "--nodes is $NODES but the slurm allocation has $job_nodes node(s); allocate $NODES (sbatch --nodes=$NODES) or launch on at most $job_nodes"
      # The node's one task gets all of the job's CPUs there: srun takes no --cpus-per-task from sbatch or
      # salloc since Slurm 22.05, and a task of one CPU, where Slurm binds tasks to their CPUs, would run the
      # node's every rank and loader worker on that one core. SLURM_JOB_CPUS_PER_NODE ("96(x2),64"; sbatch
      # and salloc set it) gives the least node's count, which every node has.
      cpus="$(job_var SLURM_JOB_CPUS_PER_NODE "sbatch and salloc set it in an allocation")"
      cpus="$(least_cpus_per_node "$cpus")"
      # Refused here, once, rather than in every srun task (each task resolves it again for its node).
      resolve_preset >/dev/null
      # The tasks get this command's arguments, less a --dry_run: the printed srun line is the one that launches.
      task_args=() separator=0
      for arg in "${ORIGINAL_ARGS[@]}"; do
        [[ "$arg" == -- ]] && separator=1
        [[ "$separator" == 0 && "$arg" == --dry_run ]] || task_args+=("$arg")
      done
      CMD=(srun --nodes="$NODES" --ntasks="$NODES" --ntasks-per-node=1 --cpus-per-task="$cpus" --kill-on-bad-exit=1
           env BERT_LAUNCH_SRUN_TASK=1 "$ROOT/scripts/launch.sh" "${task_args[@]}")
      if [[ "$DRY_RUN" == 1 ]]; then printf '%q ' "${CMD[@]}"; echo; exit 0; fi
      exec "${CMD[@]}"
    fi
    # The step's, not the job's: srun's step may hold fewer nodes than the allocation.
    NNODES="$(job_var SLURM_STEP_NUM_NODES "srun sets it in each task")"
    NODE_RANK="$(job_var SLURM_NODEID "srun sets it in each task")"
    if [[ -z "$MASTER_ADDR_ARG" ]]; then
      nodelist="$(job_var SLURM_STEP_NODELIST "the master is the step's first host; pass --master_addr")"
      command -v scontrol >/dev/null \
        || die "scontrol is not on PATH on $(hostname), so the first host of the node list '$nodelist' cannot be found; pass --master_addr"
      # awk reads the whole list: `head -n 1` would exit early, and under pipefail a later write of
      # scontrol's (SIGPIPE, status 141) would end launch.sh without a message.
      MASTER_ADDR_ARG="$(scontrol show hostnames "$nodelist" | awk 'NR == 1')"
      [[ -n "$MASTER_ADDR_ARG" ]] || die "'scontrol show hostnames $nodelist' printed no host; pass --master_addr"
    fi ;;
  aws-batch)
    batch_job="run this as a node of an AWS Batch multi-node parallel job"
    NNODES="$(job_var AWS_BATCH_JOB_NUM_NODES "$batch_job")"
    node_index="$(job_var AWS_BATCH_JOB_NODE_INDEX "$batch_job")"
    main_index="${AWS_BATCH_JOB_MAIN_NODE_INDEX:-0}"
    [[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || die "AWS_BATCH_JOB_NUM_NODES is '$NNODES', not a node count"
    for index in AWS_BATCH_JOB_NODE_INDEX="$node_index" AWS_BATCH_JOB_MAIN_NODE_INDEX="$main_index"; do
      [[ "${index#*=}" =~ ^[0-9]+$ && "${index#*=}" -lt "$NNODES" ]] \
        || die "${index%%=*} is '${index#*=}', not a node index in 0..$((NNODES - 1))"
    done
    # torchrun's static rendezvous serves its store from node rank 0 at --master_addr, the main node's
    # address: so the main node is rank 0, whatever index the job definition gave it (mainNode).
    NODE_RANK=$(( (node_index - main_index + NNODES) % NNODES ))
    if [[ -z "$MASTER_ADDR_ARG" ]]; then
      if [[ "$node_index" == "$main_index" ]]; then
        MASTER_ADDR_ARG="$(hostname -I | awk '{print $1}')"  # Batch does not give the main node its own address
        [[ -n "$MASTER_ADDR_ARG" ]] || die "cannot tell this main node's IP address ('hostname -I' is empty); pass --master_addr"
      else
        MASTER_ADDR_ARG="$(job_var AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS \
          "Batch sets it on every node but the main one (AWS_BATCH_JOB_MAIN_NODE_INDEX=${AWS_BATCH_JOB_MAIN_NODE_INDEX:-unset}, this node is $node_index); or pass --master_addr")"
      fi
    fi ;;
  *) die "--launcher must be deepspeed, torchrun, slurm or aws-batch, got '$LAUNCHER'" ;;
esac
[[ "$NNODES" == "$NODES" ]] || die "--nodes is $NODES but the $LAUNCHER job has $NNODES nodes"
[[ "$NODE_RANK" == "" || ( "$NODE_RANK" =~ ^[0-9]+$ && "$NODE_RANK" -lt "$NODES" ) ]] \
  || die "node rank '$NODE_RANK' is not in 0..$((NODES - 1))"
MASTER_ADDR_ARG="${MASTER_ADDR_ARG:-$(first_host)}"
if [[ -z "$MASTER_ADDR_ARG" ]]; then
  [[ "$NODES" == 1 ]] || die "$NODES nodes need --master_addr, --hosts or --hostfile"
  MASTER_ADDR_ARG="127.0.0.1"
fi

cd "$ROOT"  # the deepspeed launcher starts remote ranks in the same directory, so it must be the project root

# ---- the preset, resolved for this cluster ----------------------------------------------------------------
RESOLVED="$(resolve_preset)"
DEVICES_PER_NODE="" RUN_ARGS=()
eval "$RESOLVED"  # sets DEVICES_PER_NODE and RUN_ARGS, shell-quoted by training/presets.py
DEVICES="$DEVICES_PER_NODE"

SCRIPT=("$ROOT/run_pretraining.py" --input_dir "$INPUT_DIR" --output_dir "$OUTPUT_DIR" "${RUN_ARGS[@]}" "${EXTRA[@]}")

# ---- the command ------------------------------------------------------------------------------------------
case "$LAUNCHER" in
  deepspeed)
    DS=("$PYTHON" -m deepspeed.launcher.runner --master_addr "$MASTER_ADDR_ARG" --master_port "$MASTER_PORT_ARG")
    if [[ -n "$HOSTS" ]]; then
      HOSTFILE="$LAUNCH_DIR/hostfile"
      tr ',' '\n' <<<"$HOSTS" | awk -v slots="$DEVICES" 'NF {print $1 " slots=" slots}' >"$HOSTFILE.tmp.$$"
      mv "$HOSTFILE.tmp.$$" "$HOSTFILE"
    fi
    if [[ -n "$HOSTFILE" ]]; then
      problem="$(hostfile_problem)"
      [[ -z "$problem" ]] || die "$problem"
      listed="$(awk '!/^[[:space:]]*(#|$)/' "$HOSTFILE" | wc -l)"
      [[ "$listed" -ge "$NODES" ]] || die "hostfile $HOSTFILE lists $listed host(s), fewer than --nodes $NODES"
      # pdsh runs `cd <cwd>; <sys.executable> -u -m deepspeed.launcher.launch ... <root>/run_pretraining.py ...`
      # in a shell on each node (cwd as os.path.abspath gives it: symlinks resolved), and DeepSpeed quotes only
      # the arguments after the script: a space in any of these paths splits it there.
      interpreter="$("$PYTHON" -c 'import sys; print(sys.executable)')" \
        || die "the interpreter PYTHON=$PYTHON does not run; set PYTHON to one (e.g. .venv/bin/python)"
      for path in "$ROOT" "$(pwd -P)" "$interpreter"; do
        [[ "$path" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]] || die "the deepspeed launcher starts each node with a shell command" \
          "holding the path '$path' unquoted, and it has a character a shell would split or expand; move the checkout" \
          "or the interpreter (PYTHON) to a plain path, or use --launcher torchrun"
      done
      write_env_file "$LAUNCH_DIR/deepspeed_env"
      export DS_ENV_FILE="$LAUNCH_DIR/deepspeed_env"
      # --force_multi: one node of the hostfile is still started over pdsh, on that host; DeepSpeed would
      # otherwise start one host's ranks here, with the master at that host.
      DS+=(--num_nodes "$NODES" --num_gpus "$DEVICES" --hostfile "$HOSTFILE" --launcher pdsh --ssh_port "$SSH_PORT"
           --force_multi)
    elif [[ "$NODES" -gt 1 ]]; then
      die "the deepspeed launcher on $NODES nodes needs --hostfile or --hosts"
    elif [[ -n "${CUDA_VISIBLE_DEVICES:-}" && "${DS_ACCELERATOR:-cuda}" == cuda ]]; then
      # Given --num_gpus, DeepSpeed's runner drops CUDA_VISIBLE_DEVICES and numbers the devices from 0 (a shared
      # machine's other devices); --include keeps the run on the first D visible ones, as --num_gpus D takes the
      # first D of all. (Other accelerators: CPU ranks are no devices, and DeepSpeed's runner checks --include
      # against its NUMA nodes.)
      IFS=, read -ra visible <<<"$CUDA_VISIBLE_DEVICES"
      for id in "${visible[@]}"; do
        [[ "$id" =~ ^[0-9]+$ ]] || die "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES is not a list of device" \
          "indices, which the deepspeed launcher needs; give indices (nvidia-smi -L lists them) or use --launcher torchrun"
      done
      [[ "${#visible[@]}" -ge "$DEVICES" ]] || die "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES makes" \
        "${#visible[@]} device(s) visible, fewer than the $DEVICES devices per node of this run; pass" \
        "--devices_per_node ${#visible[@]} or make more devices visible"
      DS+=(--include "localhost:$(IFS=,; echo "${visible[*]:0:DEVICES}")")
    else
      DS+=(--num_nodes 1 --num_gpus "$DEVICES")
    fi
    CMD=("${DS[@]}" "${SCRIPT[@]}") ;;
  *)
    CMD=("$PYTHON" -m torch.distributed.run --nnodes "$NODES" --nproc_per_node "$DEVICES" --node_rank "$NODE_RANK"
         --master_addr "$MASTER_ADDR_ARG" --master_port "$MASTER_PORT_ARG" "${SCRIPT[@]}") ;;
esac

echo "[launch] $LAUNCHER: $NODES node(s) x $DEVICES device(s)${NODE_RANK:+, node rank $NODE_RANK}, master $MASTER_ADDR_ARG:$MASTER_PORT_ARG" >&2
if [[ "$DRY_RUN" == 1 ]]; then printf '%q ' "${CMD[@]}"; echo; exit 0; fi
exec "${CMD[@]}"
