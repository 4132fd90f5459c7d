"""scripts/launch.sh: a real 2-node launch over 127.0.0.1, and the command each launcher mode builds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import communicate_all
from training.accelerator import free_port

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "scripts" / "launch.sh"
# The tiny model on the real-vocab shards, 2 ranks x micro batch 4, a checkpoint every 2 steps.
TINY = ["--preset", "demo", "--set", "model_config=configs/models/bert-tiny.json", "--set", "global_batch_size=8",
        "--set", "micro_batch_per_device=4", "--set", "max_steps=4", "--set", "num_steps_per_checkpoint=2"]


def _env(**extra: str) -> dict:
    """The launch's environment without the job schedulers' variables or the visible devices. (HOME stays: DeepSpeed
    keeps its compiled ops under it, unless TORCH_EXTENSIONS_DIR says; the env-file tests set their own.)"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "AWS_BATCH_", "BERT_LAUNCH_"))
           and k != "CUDA_VISIBLE_DEVICES"}
    return {**env, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", **extra}


def _launch(args: list[str], env: dict | None = None, script: Path = LAUNCH) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env or _env(),
                          cwd=ROOT, timeout=120)


def _command(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 0, proc.stderr
    import shlex

    return shlex.split(proc.stdout.strip().splitlines()[-1])


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def run_two_nodes(input_dir: Path, output_dir: Path) -> tuple[list[str], list[str]]:
    """Two node processes, one rank each, through launch.sh's torchrun mode; returns their logs."""
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        args = [*TINY, "--nodes", "2", "--devices_per_node", "1", "--launcher", "torchrun", "--node_rank", str(rank),
                "--master_addr", "127.0.0.1", "--master_port", port, "--input_dir", str(input_dir),
                "--output_dir", str(output_dir), "--", "--log_freq", "1", "--num_workers", "0"]
        procs.append(subprocess.Popen(["bash", str(LAUNCH), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=_env(), cwd=ROOT))
    logs = [out for out, _ in communicate_all(procs, timeout=400)]
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"node {rank} failed:\n{log[-4000:]}"
    return logs[0], logs[1]


def shared_two_node_run(tmp_path_factory, input_dir: Path) -> tuple[Path, tuple[str, str]]:
    """One 2-node run per test session, shared by this module and tests/test_export_hf.py."""
    base = tmp_path_factory.getbasetemp() / "two_node_run"
    logs_file = base / "logs.json"
    if not logs_file.is_file():
        logs = run_two_nodes(input_dir, base / "run")
        logs_file.write_text(json.dumps(logs))
    return base / "run", tuple(json.loads(logs_file.read_text()))


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory, phase1_shards) -> tuple[Path, tuple[str, str]]:
    return shared_two_node_run(tmp_path_factory, phase1_shards)


@pytest.mark.slow
def test_real_two_node_launch_both_ranks_train(two_node_run):
    out, (log0, log1) = two_node_run
    assert "[launch] torchrun: 2 node(s) x 1 device(s), node rank 0, master 127.0.0.1" in log0
    assert "[launch] torchrun: 2 node(s) x 1 device(s), node rank 1, master 127.0.0.1" in log1
    info = json.loads((out / "run_info.json").read_text())
    assert info["world_size"] == 2 and info["zero_stage"] == 1 and info["bf16"]
    assert (info["train_batch_size"], info["micro_batch"], info["gradient_accumulation_steps"]) == (8, 4, 1)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["consumed_samples"] for r in records] == [8, 16, 24, 32]  # 2 ranks x 4 sequences per step
    tag = (out / "checkpoints" / "latest").read_text().strip()
    assert tag == "step00000004"
    state = json.loads((out / "checkpoints" / tag / "run_state.json").read_text())
    assert state["world_size"] == 2
    # ZeRO-1: each rank saves its own optimizer partition, so both files prove both ranks trained.
    partitions = sorted(p.name for p in (out / "checkpoints" / tag).glob("*zero_pp_rank_*_optim_states.pt"))
    assert partitions == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                          "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    ds = json.loads((out / "launch" / "deepspeed_config.json").read_text())
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (8, 4, 1)


def test_deepspeed_pdsh_mode_builds_hostfile_and_env(tmp_path: Path):
    out = tmp_path / "run"
    env = _env(HCCL_SOCKET_IFNAME="eth7", LD_LIBRARY_PATH="/opt/habanalabs/lib:/usr/lib/habanalabs",
               GC_KERNEL_PATH="/usr/lib/habanalabs/libtpc_kernels.so")
    env.pop("LD_PRELOAD", None)
    proc = _launch(["--preset", "bert-1.5b-phase1", "--nodes", "2", "--hosts", "gaudi-a,gaudi-b", "--input_dir",
                    str(tmp_path), "--output_dir", str(out), "--dry_run", "--", "--log_freq", "50"], env=env)
    cmd = _command(proc)
    assert cmd[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"]
    assert (_flag(cmd, "--num_nodes"), _flag(cmd, "--num_gpus"), _flag(cmd, "--master_addr")) == ("2", "8", "gaudi-a")
    assert _flag(cmd, "--master_port") == "29500"  # the documented default
    assert _flag(cmd, "--hostfile") == str(out / "launch" / "hostfile")
    assert (_flag(cmd, "--launcher"), _flag(cmd, "--ssh_port")) == ("pdsh", "3022")
    assert (out / "launch" / "hostfile").read_text() == "gaudi-a slots=8\ngaudi-b slots=8\n"
    env_file = (out / "launch" / "deepspeed_env").read_text().splitlines()
    assert "PT_HPU_LAZY_MODE=1" in env_file
    assert "HCCL_SOCKET_IFNAME=eth7" in env_file  # a site variable the user exported reaches the other nodes
    # what an ssh session into the image would lack: its search paths and Habana's runtime variables
    assert f"PATH={os.environ['PATH']}" in env_file
    assert "LD_LIBRARY_PATH=/opt/habanalabs/lib:/usr/lib/habanalabs" in env_file
    assert "GC_KERNEL_PATH=/usr/lib/habanalabs/libtpc_kernels.so" in env_file
    assert not any(line.startswith("LD_PRELOAD=") for line in env_file)  # not set here: not written
    assert "--force_multi" in cmd
    # the recipe cache: on local disk, one directory per user (another user's would not be writable)
    assert f"PT_HPU_RECIPE_CACHE_CONFIG=/tmp/bert_pretraining_recipe_cache_{os.getuid()},false,8192" in env_file
    script = cmd.index(str(ROOT / "run_pretraining.py"))
    run_args = cmd[script + 1:]
    assert _flag(run_args, "--input_dir") == str(tmp_path) and run_args[-2:] == ["--log_freq", "50"]
    assert _flag(run_args, "--learning_rate") == "0.0015" and _flag(run_args, "--poly_power") == "1.0"
    ds = json.loads(Path(_flag(run_args, "--deepspeed_config")).read_text())
    assert ds["gradient_accumulation_steps"] == 24  # 12288 / (32 x 16 devices)


def test_deepspeed_env_file_carries_the_variable_families_and_the_users_env_files(tmp_path: Path):
    """DeepSpeed forwards only NCCL*, PYTHON*, UCX*, MV2* and MLFLOW* itself, and reads ~/.deepspeed_env and
    ./.deepspeed_env only without DS_ENV_FILE: HCCL over libfabric's settings reached the first node's ranks only,
    and the env files Habana's README asks for were skipped. Their lines come after ours: the later value wins."""
    home, caller = tmp_path / "home", tmp_path / "caller"
    home.mkdir()
    caller.mkdir()
    (home / ".deepspeed_env").write_text("SITE_VAR=from home\n\nPT_HPU_LAZY_MODE=0\n")
    (caller / ".deepspeed_env").write_text("FI_PROVIDER=tcp")  # no final line break
    env = _env(HOME=str(home), HCCL_OVER_OFI="1", FI_PROVIDER="efa", PT_HPU_MAX_COMPOUND_OP_SIZE="4",
               GLOO_SOCKET_IFNAME="ens5", TORCH_NCCL_ASYNC_ERROR_HANDLING="1", UNRELATED_VAR="x")
    args = ["--preset", "bert-1.5b-phase1", "--nodes", "2", "--hosts", "a,b", "--input_dir", ".", "--output_dir",
            str(tmp_path / "run"), "--dry_run"]
    proc = subprocess.run(["bash", str(LAUNCH), *args], capture_output=True, text=True, env=env, cwd=caller,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "run" / "launch" / "deepspeed_env").read_text().splitlines()
    for line in ("HCCL_OVER_OFI=1", "FI_PROVIDER=efa", "PT_HPU_MAX_COMPOUND_OP_SIZE=4", "GLOO_SOCKET_IFNAME=ens5",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING=1", "PT_HPU_LAZY_MODE=1"):
        assert line in lines
    assert not any(line.startswith("UNRELATED_VAR=") for line in lines)
    assert lines[-3:] == ["SITE_VAR=from home", "PT_HPU_LAZY_MODE=0", "FI_PROVIDER=tcp"]  # DeepSpeed: the last wins
    # without HOME, ~ is the user's home from the password database, as DeepSpeed's expanduser takes it
    unset = {k: v for k, v in env.items() if k != "HOME"}
    proc = subprocess.run(["bash", str(LAUNCH), *args], capture_output=True, text=True, env=unset, cwd=caller,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    # a DS_ENV_FILE of the user's names the files DeepSpeed would read: ~/<name> and ./<name>
    (caller / "site.env").write_text("SITE_VAR=from site.env\n")
    proc = subprocess.run(["bash", str(LAUNCH), *args], capture_output=True, text=True,
                          env={**env, "DS_ENV_FILE": "site.env"}, cwd=caller, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "run" / "launch" / "deepspeed_env").read_text().splitlines()
    assert lines[-1] == "SITE_VAR=from site.env" and "FI_PROVIDER=tcp" not in lines
    # a line that is not NAME=VALUE (DeepSpeed would export a variable named 'export FOO'): its file and line
    (caller / ".deepspeed_env").write_text("FI_PROVIDER=tcp\nexport FOO=1\n")
    proc = subprocess.run(["bash", str(LAUNCH), *args], capture_output=True, text=True, env=env, cwd=caller,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().endswith(
        f"launch.sh: error: {caller / '.deepspeed_env'} line 2: 'export FOO=1' is not NAME=VALUE, the format of "
        "DeepSpeed's environment file")


def test_deepspeed_launcher_keeps_the_visible_cuda_devices(tmp_path: Path):
    """Given --num_gpus, DeepSpeed's runner drops CUDA_VISIBLE_DEVICES and numbers the devices from 0: on a shared
    machine the run landed on another user's devices. --include names the first D visible ones instead."""
    args = [*TINY, "--nodes", "1", "--devices_per_node", "2", "--input_dir", str(tmp_path), "--output_dir",
            str(tmp_path / "run"), "--dry_run"]
    for accelerator in ("cuda", None):  # DeepSpeed picks CUDA where DS_ACCELERATOR is unset and a GPU is there
        cuda = _env(CUDA_VISIBLE_DEVICES="4,6,7")
        cuda.pop("DS_ACCELERATOR") if accelerator is None else cuda.update(DS_ACCELERATOR=accelerator)
        cmd = _command(_launch(args, env=cuda))
        assert _flag(cmd, "--include") == "localhost:4,6" and "--num_gpus" not in cmd and "--num_nodes" not in cmd
    cmd = _command(_launch(args, env=_env(DS_ACCELERATOR="cuda")))
    assert (_flag(cmd, "--num_nodes"), _flag(cmd, "--num_gpus")) == ("1", "2") and "--include" not in cmd
    few = _launch(args, env=_env(DS_ACCELERATOR="cuda", CUDA_VISIBLE_DEVICES="3"))
    assert few.returncode == 2 and "CUDA_VISIBLE_DEVICES=3 makes 1 device(s) visible, fewer than the 2 devices per " \
                                   "node of this run; pass --devices_per_node 1" in few.stderr
    uuid = _launch(args, env=_env(DS_ACCELERATOR="cuda", CUDA_VISIBLE_DEVICES="GPU-5e8c,GPU-77a1"))
    assert uuid.returncode == 2 and "is not a list of device indices" in uuid.stderr and "torchrun" in uuid.stderr
    # CPU ranks are no devices: DeepSpeed's runner checks --include against its NUMA nodes ("No slot '1'")
    cmd = _command(_launch(args, env=_env(CUDA_VISIBLE_DEVICES="-1")))
    assert (_flag(cmd, "--num_nodes"), _flag(cmd, "--num_gpus")) == ("1", "2") and "--include" not in cmd


def test_one_node_of_a_hostfile_starts_on_that_host(tmp_path: Path):
    """With one active host, DeepSpeed's runner starts the ranks here, not over pdsh, while the master is that
    host's address: on any other machine the rendezvous waited for a host running nothing. --force_multi."""
    cmd = _command(_launch(["--preset", "bert-1.5b-phase1", "--nodes", "1", "--hosts", "gaudi-b", "--input_dir",
                            str(tmp_path), "--output_dir", str(tmp_path / "run"), "--dry_run"]))
    assert "--force_multi" in cmd and _flag(cmd, "--master_addr") == "gaudi-b"
    assert (_flag(cmd, "--num_nodes"), _flag(cmd, "--hostfile")) == ("1", str(tmp_path / "run" / "launch" / "hostfile"))


def test_deepspeed_launcher_refuses_paths_pdsh_would_split(tmp_path: Path):
    """pdsh's command line holds the checkout's path and the interpreter's unquoted (DeepSpeed quotes only the
    script's arguments): `cd /a b` failed on every node after the launch. Refused before it, naming torchrun."""
    # This interpreter under a path with a space, as sys.executable (which pdsh runs) gives it: a link to it in a
    # copy of its environment's layout (a wrapper script that execs it would give the original path).
    spaced = tmp_path / "py dir"
    (spaced / "bin").mkdir(parents=True)
    python = spaced / "bin" / "python"
    python.symlink_to(sys.executable)
    if (Path(sys.prefix) / "pyvenv.cfg").is_file():
        shutil.copy(Path(sys.prefix) / "pyvenv.cfg", spaced)
        (spaced / "lib").symlink_to(Path(sys.prefix) / "lib")
    args = ["--preset", "bert-1.5b-phase1", "--nodes", "2", "--hosts", "a,b", "--input_dir", str(tmp_path),
            "--output_dir", str(tmp_path / "run"), "--dry_run"]
    proc = _launch(args, env=_env(PYTHON=str(python)))
    assert proc.returncode == 2 and f"holding the path '{python}' unquoted" in proc.stderr
    assert "or use --launcher torchrun" in proc.stderr
    # the checkout itself, under a directory with a space
    checkout = tmp_path / "check out"
    (checkout / "scripts").mkdir(parents=True)
    for name in ("launch.sh", "hpu_env.sh"):
        (checkout / "scripts" / name).write_text((ROOT / "scripts" / name).read_text())
    for name in ("training", "configs", "data", "modeling.py"):
        (checkout / name).symlink_to(ROOT / name)
    proc = _launch(args, script=checkout / "scripts" / "launch.sh")
    assert proc.returncode == 2 and f"holding the path '{checkout}' unquoted" in proc.stderr
    # ... and reached through a symlink without a space: DeepSpeed's `cd` takes the resolved path
    (tmp_path / "link").symlink_to(checkout)
    proc = _launch(args, script=tmp_path / "link" / "scripts" / "launch.sh")
    assert proc.returncode == 2 and f"holding the path '{checkout}' unquoted" in proc.stderr
    # torchrun takes argument lists: the same paths are fine there
    _command(_launch(["--preset", "bert-1.5b-phase1", "--nodes", "2", "--launcher", "torchrun", "--node_rank", "0",
                      "--master_addr", "a", "--input_dir", str(tmp_path), "--output_dir", str(tmp_path / "run"),
                      "--dry_run"], env=_env(PYTHON=str(python))))


def _stand_in_python(tmp_path: Path, body: str) -> Path:
    """An interpreter (PYTHON) that runs the bash `body`, then this interpreter with its arguments."""
    stub = tmp_path / "python"
    stub.write_text(f'#!/usr/bin/env bash\n{body}\nexec {sys.executable} "$@"\n')
    stub.chmod(0o755)
    return stub


def test_deepspeed_launcher_starts_in_the_root_with_the_env_file_exported(tmp_path: Path):
    """Not a dry run: the interpreter is a stand-in that records what the launcher was started with. DeepSpeed's
    runner reads DS_ENV_FILE from its environment, so launch.sh must export it, not only set it; and it starts
    the remote ranks in its own working directory, which must be the project root wherever launch.sh is called."""
    record = tmp_path / "started.txt"
    stub = _stand_in_python(tmp_path, f'if [[ "$1 $2" != "-m training.presets" && "$1" != -c ]]; then\n'
                                      f'  printf "%s\\n" "DS_ENV_FILE=${{DS_ENV_FILE:-}}" "PWD=$PWD" "$@" > {record}; exit 0\nfi')
    out = tmp_path / "run"
    proc = subprocess.run(["bash", str(LAUNCH), "--preset", "bert-1.5b-phase1", "--nodes", "2", "--hosts",
                           "gaudi-a,gaudi-b", "--input_dir", ".", "--output_dir", "run"], capture_output=True, text=True,
                          env=_env(PYTHON=str(stub)), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    started = record.read_text().splitlines()
    assert started[:2] == [f"DS_ENV_FILE={out / 'launch' / 'deepspeed_env'}", f"PWD={ROOT}"]
    assert started[2:4] == ["-m", "deepspeed.launcher.runner"]


def test_hostfile_comments_and_blank_lines_are_skipped(tmp_path: Path):
    """The master is the first host the hostfile lists, not a comment above it; a path with a space stays one.
    The ports given reach DeepSpeed's launcher."""
    hostfile = tmp_path / "cluster hosts"
    hostfile.write_text("# the cluster\n\nnode-a slots=8\nnode-b slots=8\n")
    cmd = _command(_launch(["--preset", "bert-1.5b-phase1", "--nodes", "2", "--hostfile", str(hostfile),
                            "--master_port", "31337", "--ssh_port", "2222",
                            "--input_dir", str(tmp_path), "--output_dir", str(tmp_path / "run"), "--dry_run"]))
    assert (_flag(cmd, "--master_addr"), _flag(cmd, "--hostfile")) == ("node-a", str(hostfile))
    assert (_flag(cmd, "--master_port"), _flag(cmd, "--ssh_port")) == ("31337", "2222")


@pytest.mark.parametrize("extra, refused", [
    (["--max_steps", "5"], "--max_steps (change it with --set max_steps=<value>)"),
    (["--max_st=5"], "--max_steps (change it with --set max_steps=<value>)"),  # argparse's abbreviations count
    (["--log_freq", "5", "--config_file", "model.json"], "--config_file (change it with --set model_config=<file>)"),
    (["--deepspeed_config=ds.json"], "--deepspeed_config (change it with --set deepspeed_config=<file>)"),
    (["--output_dir", "elsewhere"], "--output_dir (give it as launch.sh's --output_dir)"),
])
def test_flags_after_the_separator_may_not_repeat_the_launchs(tmp_path: Path, extra: list[str], refused: str):
    """run_pretraining.py keeps the last of a repeated flag: '-- --max_steps 5' replaced the preset's 300 without
    the preset's checks, while the launch's summary line still showed the preset's values."""
    proc = _launch(["--preset", "demo", "--nodes", "1", "--input_dir", str(tmp_path), "--output_dir",
                    str(tmp_path / "run"), "--dry_run", "--", *extra])
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"error: the launch already gives run_pretraining.py {refused}: after '--', pass only flags the preset " \
           "does not set (--log_freq, --seed, ...)" in proc.stderr
    assert not (tmp_path / "run" / "launch" / "deepspeed_config.json").exists()  # refused before anything is written
    ambiguous = _launch(["--preset", "demo", "--nodes", "1", "--input_dir", str(tmp_path), "--output_dir",
                         str(tmp_path / "run"), "--dry_run", "--", "--l", "3"])
    assert "run_pretraining.py flags after '--': ambiguous option: --l could match --learning_rate, " \
           "--lr_decay_style" in ambiguous.stderr
    own = _command(_launch(["--preset", "demo", "--nodes", "1", "--input_dir", str(tmp_path), "--output_dir",
                            str(tmp_path / "run"), "--dry_run", "--", "--log_freq", "5", "--seed", "7"]))
    assert own[-4:] == ["--log_freq", "5", "--seed", "7"] and own.count("--max_steps") == 1


def test_a_preset_file_is_relative_to_the_callers_directory(tmp_path: Path):
    """launch.sh resolves the preset after its cd to the project root: 'my.json' was 'preset file not found'."""
    (tmp_path / "my.json").write_text((ROOT / "configs" / "presets" / "demo.json").read_text())
    for preset in ("my.json", "./my.json"):
        proc = subprocess.run(["bash", str(LAUNCH), "--preset", preset, "--nodes", "1", "--input_dir", ".",
                               "--output_dir", "run", "--dry_run"], capture_output=True, text=True, env=_env(),
                              cwd=tmp_path, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "[presets] demo: 1 node(s) x 2 devices" in proc.stderr


def test_config_paths_set_on_the_command_line_are_relative_to_the_callers_directory(tmp_path: Path):
    """`--set model_config=my_model.json` was looked up under the project root ('does not exist'), against the
    rule that launch.sh's relative paths are the caller's."""
    (tmp_path / "my_model.json").write_text((ROOT / "configs" / "models" / "bert-tiny.json").read_text())
    (tmp_path / "my_ds.json").write_text((ROOT / "configs" / "deepspeed" / "zero1-bf16.json").read_text())
    proc = subprocess.run(["bash", str(LAUNCH), "--preset", "demo", "--nodes", "1", "--input_dir", ".",
                           "--output_dir", "run", "--set", "model_config=my_model.json", "--set",
                           "deepspeed_config=./my_ds.json", "--dry_run"], capture_output=True, text=True, env=_env(),
                          cwd=tmp_path, timeout=120)
    cmd = _command(proc)
    assert _flag(cmd, "--config_file") == str(tmp_path / "my_model.json")


def test_default_interpreter_is_the_checkouts_venv(tmp_path: Path):
    """Without PYTHON, launch.sh runs the venv `make venv` made (as prepare_wikicorpus.sh does), not
    whatever python3 comes first on PATH, which need not have torch."""
    venv_python = ROOT / ".venv" / "bin" / "python"
    assert venv_python.exists(), "make test creates .venv"
    env = {k: v for k, v in _env().items() if k != "PYTHON"}
    cmd = _command(_launch(["--preset", "demo", "--nodes", "1", "--input_dir", str(tmp_path), "--output_dir", str(tmp_path / "run"),
                            "--dry_run"], env=env))
    assert cmd[0] == str(venv_python)


def test_run_n_nodes_wrappers(tmp_path: Path):
    hosts = ",".join(f"node{i}" for i in range(16))
    for nodes, accumulation, lr in ((1, 48, "0.0015"), (16, 3, "0.0015")):
        script = ROOT / "scripts" / (f"run_{nodes}node.sh" if nodes == 1 else f"run_{nodes}nodes.sh")
        out = tmp_path / f"n{nodes}"
        args = ["--preset", "bert-1.5b-phase1", "--input_dir", str(tmp_path), "--output_dir", str(out), "--dry_run"]
        if nodes > 1:
            args += ["--hosts", hosts]
        cmd = _command(_launch(args, script=script))
        assert (_flag(cmd, "--num_nodes"), _flag(cmd, "--num_gpus")) == (str(nodes), "8")
        assert _flag(cmd, "--learning_rate") == lr
        assert json.loads((out / "launch" / "deepspeed_config.json").read_text())["gradient_accumulation_steps"] \
            == accumulation
    proc = _launch(["--nodes", "4", "--preset", "bert-1.5b-phase1", "--input_dir", str(tmp_path), "--output_dir",
                    str(tmp_path / "x"), "--dry_run"], script=ROOT / "scripts" / "run_8nodes.sh")
    assert proc.returncode == 2 and "--nodes given twice" in proc.stderr


def test_wrappers_take_the_users_devices_per_node(tmp_path: Path):
    """run_<N>nodes.sh sets the node count only: devices per node are the preset's unless the user gives them,
    with --devices_per_node or --set devices_per_node (the same field); two different values are an error."""
    wrapper = ROOT / "scripts" / "run_8nodes.sh"
    base = ["--preset", "bert-1.5b-phase1", "--hosts", ",".join(f"node{i}" for i in range(8)), "--input_dir",
            str(tmp_path), "--dry_run"]
    for i, extra in enumerate((["--set", "devices_per_node=4"], ["--devices_per_node", "4"],
                               ["--devices_per_node", "4", "--set", "devices_per_node=4"])):
        out = tmp_path / f"run{i}"
        proc = _launch([*base, "--output_dir", str(out), *extra], script=wrapper)
        cmd = _command(proc)
        assert (_flag(cmd, "--num_nodes"), _flag(cmd, "--num_gpus")) == ("8", "4"), extra
        assert "8 node(s) x 4 device(s)" in proc.stderr
        assert (out / "launch" / "hostfile").read_text().splitlines() == [f"node{n} slots=4" for n in range(8)]
        ds = json.loads((out / "launch" / "deepspeed_config.json").read_text())
        assert ds["gradient_accumulation_steps"] == 12  # 12288 / (32 x 8 nodes x 4 devices)
    default = _command(_launch([*base, "--output_dir", str(tmp_path / "default")], script=wrapper))
    assert _flag(default, "--num_gpus") == "8"  # the preset's devices_per_node
    conflict = _launch([*base, "--output_dir", str(tmp_path / "x"), "--devices_per_node", "4", "--set",
                        "devices_per_node=2"], script=wrapper)
    assert conflict.returncode == 2
    assert "--devices_per_node 4 and --set devices_per_node=2 disagree; give one of them" in conflict.stderr


def test_aws_batch_mode_maps_the_job_variables(tmp_path: Path):
    common = ["--preset", "bert-1.5b-phase1", "--nodes", "4", "--launcher", "aws-batch", "--device_kind", "gaudi1",
              "--input_dir", str(tmp_path), "--output_dir", str(tmp_path / "run"), "--dry_run"]
    child = _env(AWS_BATCH_JOB_NUM_NODES="4", AWS_BATCH_JOB_NODE_INDEX="2", AWS_BATCH_JOB_MAIN_NODE_INDEX="0",
                 AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS="10.0.3.7")
    cmd = _command(_launch(common, env=child))
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert (_flag(cmd, "--nnodes"), _flag(cmd, "--node_rank"), _flag(cmd, "--master_addr")) == ("4", "2", "10.0.3.7")
    assert _flag(cmd, "--nproc_per_node") == "8"
    ds = json.loads((tmp_path / "run" / "launch" / "deepspeed_config.json").read_text())
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (16, 24)  # the blog's 384
    # The main node is not given its own address by Batch: it uses its first IP address.
    main = _env(AWS_BATCH_JOB_NUM_NODES="4", AWS_BATCH_JOB_NODE_INDEX="0", AWS_BATCH_JOB_MAIN_NODE_INDEX="0")
    cmd = _command(_launch(common, env=main))
    own = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()[0]
    assert (_flag(cmd, "--node_rank"), _flag(cmd, "--master_addr")) == ("0", own)
    # The job definition may make another node the main one (mainNode): that node, whatever its index, uses its
    # own address, and it is node rank 0, since torchrun's static rendezvous serves its store from node rank 0
    # at --master_addr. The other nodes are ranked after it, in index order.
    main3 = _env(AWS_BATCH_JOB_NUM_NODES="4", AWS_BATCH_JOB_NODE_INDEX="3", AWS_BATCH_JOB_MAIN_NODE_INDEX="3")
    cmd = _command(_launch(common, env=main3))
    assert (_flag(cmd, "--node_rank"), _flag(cmd, "--master_addr")) == ("0", own)
    ranks = []
    for index in (0, 1, 2):
        child3 = _env(AWS_BATCH_JOB_NUM_NODES="4", AWS_BATCH_JOB_NODE_INDEX=str(index),
                      AWS_BATCH_JOB_MAIN_NODE_INDEX="3", AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS="10.0.3.7")
        cmd = _command(_launch(common, env=child3))
        assert _flag(cmd, "--master_addr") == "10.0.3.7"
        ranks.append(_flag(cmd, "--node_rank"))
    assert ranks == ["1", "2", "3"]
    outside = _launch(common, env=_env(AWS_BATCH_JOB_NUM_NODES="4", AWS_BATCH_JOB_NODE_INDEX="4",
                                       AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS="10.0.3.7"))
    assert outside.returncode == 2 and outside.stderr.strip() == (
        "launch.sh: error: AWS_BATCH_JOB_NODE_INDEX is '4', not a node index in 0..3")
    wrong = _launch(common, env=_env(AWS_BATCH_JOB_NUM_NODES="2", AWS_BATCH_JOB_NODE_INDEX="1",
                                     AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS="10.0.3.7"))
    assert wrong.returncode == 2 and "--nodes is 4 but the aws-batch job has 2 nodes" in wrong.stderr
    missing = _launch(common)
    assert missing.returncode == 2 and missing.stderr.strip() == (
        "launch.sh: error: AWS_BATCH_JOB_NUM_NODES is not set: run this as a node of an AWS Batch multi-node parallel job")
    # A worker node whose job did not pass the main node's address is told which variable and how to go on.
    worker = _launch(common, env=_env(AWS_BATCH_JOB_NUM_NODES="4", AWS_BATCH_JOB_NODE_INDEX="2"))
    assert worker.returncode == 2 and worker.stderr.strip() == (
        "launch.sh: error: AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS is not set: Batch sets it on every node but "
        "the main one (AWS_BATCH_JOB_MAIN_NODE_INDEX=unset, this node is 2); or pass --master_addr")


def test_slurm_mode_starts_one_task_per_node_then_torchrun(tmp_path: Path):
    common = ["--preset", "bert-large-phase1", "--nodes", "2", "--launcher", "slurm", "--input_dir", str(tmp_path),
              "--output_dir", str(tmp_path / "run"), "--dry_run"]
    outer = _command(_launch(common, env=_env(SLURM_JOB_ID="77", SLURM_JOB_NUM_NODES="2", SLURM_JOB_CPUS_PER_NODE="96(x2)")))
    # All of the node's CPUs for its one task (srun does not inherit sbatch's --cpus-per-task since 22.05).
    assert outer[:6] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=96",
                         "--kill-on-bad-exit=1"]
    # The line that launches: the tasks' arguments without --dry_run (a pasted line had only dry-run on each node).
    assert outer[6:9] == ["env", "BERT_LAUNCH_SRUN_TASK=1", str(LAUNCH)] and outer[9:] == common[:-1]
    after = _command(_launch([*common, "--", "--seed", "7"], env=_env(SLURM_JOB_ID="77", SLURM_JOB_NUM_NODES="2", SLURM_JOB_CPUS_PER_NODE="96(x2)")))
    assert after[9:] == [*common[:-1], "--", "--seed", "7"]
    # salloc sets no SLURM_CPUS_ON_NODE; nodes of other sizes get the least count, which each of them has.
    mixed = _command(_launch(common, env=_env(SLURM_JOB_ID="77", SLURM_JOB_NUM_NODES="2", SLURM_JOB_CPUS_PER_NODE="64,36(x3)")))
    assert mixed[4] == "--cpus-per-task=36"
    no_cpus = _launch(common, env=_env(SLURM_JOB_ID="77", SLURM_JOB_NUM_NODES="2"))
    assert no_cpus.returncode == 2 and no_cpus.stderr.strip() == (
        "launch.sh: error: SLURM_JOB_CPUS_PER_NODE is not set: sbatch and salloc set it in an allocation")
    odd = _launch(common, env=_env(SLURM_JOB_ID="77", SLURM_JOB_NUM_NODES="2", SLURM_JOB_CPUS_PER_NODE="96(x2),lots"))
    assert odd.returncode == 2 and odd.stderr.strip() == (
        "launch.sh: error: SLURM_JOB_CPUS_PER_NODE is '96(x2),lots', not a list of CPU counts like 96(x2),64")
    # The preset is resolved before srun, as --dry_run's help says: a refused one had started a task per node,
    # each failing alike, and the dry run had exited 0 (found by an audit).
    assert json.loads((tmp_path / "run" / "launch" / "deepspeed_config.json").read_text())["train_batch_size"] == 65536
    for wrong, said in ((["--preset", "no-such-preset"], "error: unknown preset 'no-such-preset'"),
                        (["--", "--max_steps", "3"], "error: the launch already gives run_pretraining.py --max_steps")):
        args = [*common, *wrong] if wrong[0] == "--" else [*wrong, *common[2:]]
        refused = _launch(args, env=_env(SLURM_JOB_ID="77", SLURM_JOB_NUM_NODES="2", SLURM_JOB_CPUS_PER_NODE="96(x2)"))
        assert refused.returncode == 2 and said in refused.stderr and "srun" not in refused.stdout
    task = _env(SLURM_JOB_ID="77", BERT_LAUNCH_SRUN_TASK="1", SLURM_NODEID="1", SLURM_STEP_NUM_NODES="2")
    inner = _command(_launch([*common, "--master_addr", "node-a", "--master_port", "31337"], env=task))
    assert (_flag(inner, "--nnodes"), _flag(inner, "--node_rank"), _flag(inner, "--master_addr")) == ("2", "1", "node-a")
    assert _flag(inner, "--master_port") == "31337"
    outside = _launch(common)
    assert outside.returncode == 2 and "runs inside an allocation" in outside.stderr
    # Without --master_addr the master is the allocation's first host, as scontrol expands the node list. The
    # stand-in writes its hosts one at a time, as a long list reaches the pipe: launch.sh must read past the first
    # (under pipefail, `head -n 1` made the later write end launch.sh with SIGPIPE, status 141, and no message).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/usr/bin/env bash\n[[ "$*" == "show hostnames gpu[07-08]" ]] || exit 1\n'
                        'echo gpu07\nsleep 0.5\necho gpu08\n')
    scontrol.chmod(0o755)
    listed = _env(SLURM_JOB_ID="77", BERT_LAUNCH_SRUN_TASK="1", SLURM_NODEID="0", SLURM_STEP_NUM_NODES="2",
                  SLURM_STEP_NODELIST="gpu[07-08]", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    inner = _command(_launch(common, env=listed))
    assert (_flag(inner, "--node_rank"), _flag(inner, "--master_addr")) == ("0", "gpu07")
    # Without scontrol, or without the variables srun sets, the error names what is missing and the way out.
    no_scontrol = _env(SLURM_JOB_ID="77", BERT_LAUNCH_SRUN_TASK="1", SLURM_NODEID="0", SLURM_STEP_NUM_NODES="2",
                       SLURM_STEP_NODELIST="gpu[07-08]", PATH=f"{Path(sys.executable).parent}{os.pathsep}/usr/bin:/bin")
    result = _launch(common, env=no_scontrol)
    assert result.returncode == 2 and "scontrol is not on PATH" in result.stderr
    assert "the first host of the node list 'gpu[07-08]' cannot be found; pass --master_addr" in result.stderr
    no_rank = _launch(common, env=_env(SLURM_JOB_ID="77", BERT_LAUNCH_SRUN_TASK="1", SLURM_STEP_NUM_NODES="2"))
    assert no_rank.returncode == 2
    assert no_rank.stderr.strip() == "launch.sh: error: SLURM_NODEID is not set: srun sets it in each task"


def test_slurm_step_smaller_than_its_allocation(tmp_path: Path):
    """A 2-node step inside a 4-node allocation: each task reads the step's node count and node list (the job's
    had made every task die with '--nodes is 2 but the slurm job has 4 nodes', after a dry run that exited 0).
    An allocation smaller than --nodes is refused before srun."""
    common = ["--preset", "bert-large-phase1", "--nodes", "2", "--launcher", "slurm", "--input_dir", str(tmp_path),
              "--output_dir", str(tmp_path / "run"), "--dry_run"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/usr/bin/env bash\ncase "$*" in "show hostnames gpu[03-04]") echo gpu03; echo gpu04 ;;\n'
                        '"show hostnames gpu[01-04]") echo gpu01; echo gpu02; echo gpu03; echo gpu04 ;;\n'
                        '*) exit 1 ;; esac\n')
    scontrol.chmod(0o755)
    task = _env(SLURM_JOB_ID="77", BERT_LAUNCH_SRUN_TASK="1", SLURM_NODEID="1", SLURM_JOB_NUM_NODES="4",
                SLURM_JOB_NODELIST="gpu[01-04]", SLURM_STEP_NUM_NODES="2", SLURM_STEP_NODELIST="gpu[03-04]",
                PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    inner = _command(_launch(common, env=task))
    assert (_flag(inner, "--nnodes"), _flag(inner, "--node_rank"), _flag(inner, "--master_addr")) == ("2", "1", "gpu03")
    outer = _command(_launch(common, env=_env(SLURM_JOB_ID="77", SLURM_JOB_NUM_NODES="4",
                                              SLURM_JOB_CPUS_PER_NODE="96(x4)")))
    assert outer[:3] == ["srun", "--nodes=2", "--ntasks=2"]
    small = _launch(common, env=_env(SLURM_JOB_ID="77", SLURM_JOB_NUM_NODES="1", SLURM_JOB_CPUS_PER_NODE="96"))
    assert small.returncode == 2 and "srun" not in small.stdout
    assert small.stderr.strip() == ("launch.sh: error: --nodes is 2 but the slurm allocation has 1 node(s); "
                                    "allocate 2 (sbatch --nodes=2) or launch on at most 1")


def test_clear_errors(tmp_path: Path):
    base = ["--input_dir", str(tmp_path), "--output_dir", str(tmp_path / "run")]
    one_host = tmp_path / "one_host"
    one_host.write_text("a slots=2\n")
    cases = [
        (["--preset", "demo", "--nodes", "2", "--launcher", "torchrun", *base], "needs --node_rank"),
        (["--preset", "demo", "--nodes", "2", *base], "2 nodes need --master_addr, --hosts or --hostfile"),
        (["--preset", "demo", "--nodes", "2", "--devices_per_node", "1", "--master_addr", "a", *base],
         "on 2 nodes needs --hostfile or --hosts"),
        (["--preset", "bert-1.5b-phase1", "--nodes", "5", "--hosts", "a,b,c,d,e", *base], "not divisible"),
        (["--preset", "bert-large-phase2", "--nodes", "1", *base], "phase-2 recipe; pass the phase-1 output"),
        (["--preset", "demo", "--nodes", "1", "--input_dir", str(tmp_path / "nope"), "--output_dir", str(tmp_path)],
         "does not exist"),
        (["--preset", "demo", "--nodes", "1", "--launcher", "mpi", *base], "--launcher must be"),
        (["--preset", "demo", "--nodes", "1", "--max_steps", "3", *base], "unknown option '--max_steps'"),
        (["--preset", "demo", "--nodes", "2", "--hostfile", str(tmp_path / "hosts"), *base], "does not exist"),
        (["--preset", "demo", "--nodes", "2", "--hostfile", str(one_host), "--hosts", "a,b", *base],
         "give --hostfile or --hosts, not both"),
        (["--preset", "demo", "--nodes", "2", "--devices_per_node", "1", "--hostfile", str(one_host), *base],
         f"hostfile {one_host} lists 1 host(s), fewer than --nodes 2"),
        (["--preset", "demo", "--nodes", "2", "--launcher", "torchrun", "--node_rank", "2", "--master_addr", "a",
          *base], "node rank '2' is not in 0..1"),
        (["--preset", "demo", "--nodes", "1", "--launcher", "torchrun", "--ssh_port", "22", *base],
         "--ssh_port is for the deepspeed launcher"),
        (["--preset", "demo", "--nodes", "1", "--ssh_port", "22", *base],
         "--ssh_port is for pdsh, which the deepspeed launcher uses only with --hostfile or --hosts"),
        (["--preset", "demo", "--nodes", "1", "--node_rank", "0", *base], "--node_rank is for torchrun"),
        (["--preset", "demo", "--nodes", "1", "--master_port", "abc", *base],
         "--master_port must be a port number (1..65535), got 'abc'"),
        (["--preset", "demo", "--nodes", "1", "--master_port", "70000", *base],
         "--master_port must be a port number (1..65535), got '70000'"),
        (["--preset", "demo", "--nodes", "1", "--hosts", "a", "--ssh_port", "ssh", *base],
         "--ssh_port must be a port number (1..65535), got 'ssh'"),
        (["--preset", "demo", "--nodes", "1", "--launcher", "aws-batch", "--hosts", "a", *base],
         "--hostfile/--hosts are not used by the aws-batch launcher, which gets its nodes from the job"),
    ]
    for args, message in cases:
        proc = _launch([*args, "--dry_run"])
        assert proc.returncode != 0 and message in proc.stderr, (args, proc.stderr)
    # a file where a directory belongs: 'does not exist', a bash mkdir line, or accepted until the run started
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for args, message in [(["--input_dir", str(a_file), "--output_dir", str(tmp_path / "run")], "--input_dir"),
                          (["--input_dir", str(tmp_path), "--output_dir", str(a_file)], "--output_dir")]:
        proc = _launch(["--preset", "demo", "--nodes", "1", *args, "--dry_run"])
        assert proc.returncode == 2 and f"error: {message} {a_file} is a file, not a directory" in proc.stderr
    proc = _launch(["--preset", "bert-large-phase2", "--nodes", "1", *base, "--init_checkpoint",
                    str(tmp_path / "phase1"), "--dry_run"])
    assert proc.returncode == 2 and f"error: --init_checkpoint {tmp_path / 'phase1'} does not exist" in proc.stderr
    # an interpreter that does not exist was reported as "could not resolve preset 'demo'" under a bash error line
    proc = _launch(["--preset", "demo", "--nodes", "1", *base, "--dry_run"], env=_env(PYTHON=str(tmp_path / "py")))
    assert proc.returncode == 2 and proc.stderr == (f"launch.sh: error: the interpreter PYTHON={tmp_path / 'py'} is not "
                                                    "an executable; set PYTHON to one (e.g. .venv/bin/python)\n")


@pytest.mark.parametrize("lines, message", [
    ("a slots=8\nb:8\n", 'line 2: "b:8" is not "<host> slots=<devices>"'),
    ("a slots=eight\nb slots=8\n", 'line 1: "a slots=eight" is not "<host> slots=<devices>"'),
    ("# hosts\na slots=8\n  a slots=8\n", "line 3: host a is listed twice; list each host once"),
    ("a slots=8\nb slots=4\n", "line 2: host b has slots=4, fewer than the 8 devices per node of this run; "
                               "fix slots or pass --devices_per_node 4"),
])
def test_a_hostfile_deepspeed_would_refuse_or_overrun_is_refused(lines: str, message: str, tmp_path: Path):
    """DeepSpeed's runner stops on a bad line or a repeated host with a traceback, and starts --num_gpus ranks on
    every host whatever its slots say; the dry run printed a command that would do so (with 'b:8' as the master)."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text(lines)
    proc = _launch(["--preset", "bert-1.5b-phase1", "--nodes", "2", "--hostfile", str(hostfile), "--input_dir",
                    str(tmp_path), "--output_dir", str(tmp_path / "run"), "--dry_run"])
    assert proc.returncode == 2 and f"launch.sh: error: hostfile {hostfile} {message}" in proc.stderr, proc.stderr


def test_a_host_given_twice_in_hosts_is_refused(tmp_path: Path):
    proc = _launch(["--preset", "bert-1.5b-phase1", "--nodes", "2", "--hosts", "a,a", "--input_dir", str(tmp_path),
                    "--output_dir", str(tmp_path / "run"), "--dry_run"])
    assert proc.returncode == 2 and proc.stderr == "launch.sh: error: --hosts lists a twice; list each host once\n"
    # a hostfile that lists more hosts than --nodes, with more slots than devices, is fine: DeepSpeed takes the first
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=16\nb slots=8\nc slots=1\n")
    _command(_launch(["--preset", "bert-1.5b-phase1", "--nodes", "2", "--hostfile", str(hostfile), "--input_dir",
                      str(tmp_path), "--output_dir", str(tmp_path / "run"), "--dry_run"]))


def test_init_checkpoint_may_be_a_reference_ckpt_file(tmp_path: Path):
    """--init_checkpoint takes NVIDIA's/Habana's ckpt_<step>.pt itself (run_pretraining reads the file), not only
    a directory; launch.sh refused it as 'a file, not a directory'."""
    ckpt = tmp_path / "nvidia" / "ckpt_7038.pt"
    ckpt.parent.mkdir()
    ckpt.write_bytes(b"")
    proc = _launch(["--preset", "bert-large-phase2", "--nodes", "1", "--input_dir", str(tmp_path), "--output_dir",
                    str(tmp_path / "run"), "--init_checkpoint", str(ckpt), "--dry_run"])
    assert _flag(_command(proc), "--init_checkpoint") == str(ckpt)


def test_relative_paths_are_the_callers_though_launch_cds_to_the_root(tmp_path: Path):
    """launch.sh cds to the project root before it builds the command: a relative --input_dir, --init_checkpoint or
    --hostfile (run_16nodes.sh's usage line shows `--hostfile hostfile`) would then name a path under the root."""
    (tmp_path / "shards").mkdir()
    (tmp_path / "phase1").mkdir()
    (tmp_path / "hostfile").write_text("gaudi-a slots=8\ngaudi-b slots=8\n")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "run_2nodes.sh"), "--preset", "bert-large-phase2",
                           "--hostfile", "hostfile", "--input_dir", "shards", "--init_checkpoint", "phase1",
                           "--output_dir", "run", "--dry_run"], capture_output=True, text=True, env=_env(),
                          cwd=tmp_path, timeout=120)
    cmd = _command(proc)
    assert _flag(cmd, "--hostfile") == str(tmp_path / "hostfile") and _flag(cmd, "--master_addr") == "gaudi-a"
    run_args = cmd[cmd.index(str(ROOT / "run_pretraining.py")) + 1:]
    assert _flag(run_args, "--input_dir") == str(tmp_path / "shards")
    assert _flag(run_args, "--init_checkpoint") == str(tmp_path / "phase1")
    assert _flag(run_args, "--output_dir") == str(tmp_path / "run")
    assert (tmp_path / "run" / "launch" / "deepspeed_config.json").is_file()


def test_torchrun_starts_the_resolved_devices_per_node(tmp_path: Path):
    """--nproc_per_node is the run's devices per node (here 2, not the preset's 8): torchrun starts that many ranks,
    which the DeepSpeed config's accumulation was resolved for."""
    cmd = _command(_launch(["--preset", "bert-1.5b-phase1", "--nodes", "2", "--launcher", "torchrun", "--node_rank",
                            "1", "--master_addr", "node-a", "--set", "devices_per_node=2", "--input_dir",
                            str(tmp_path), "--output_dir", str(tmp_path / "run"), "--dry_run"]))
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert (_flag(cmd, "--nnodes"), _flag(cmd, "--nproc_per_node"), _flag(cmd, "--node_rank")) == ("2", "2", "1")
    ds = json.loads((tmp_path / "run" / "launch" / "deepspeed_config.json").read_text())
    assert ds["gradient_accumulation_steps"] == 96  # 12288 / (32 x 2 nodes x 2 devices)


def _env_file_lines(tmp_path: Path, env: dict, cwd: Path | None = None) -> list[str]:
    """The deepspeed launcher's environment file of a 2-host dry run."""
    proc = subprocess.run(["bash", str(LAUNCH), "--preset", "bert-1.5b-phase1", "--nodes", "2", "--hosts", "a,b",
                           "--input_dir", str(tmp_path), "--output_dir", str(tmp_path / "run"), "--dry_run"],
                          capture_output=True, text=True, env=env, cwd=cwd or ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return (tmp_path / "run" / "launch" / "deepspeed_env").read_text().splitlines()


def test_hpu_variables_the_user_exported_win_over_hpu_env_defaults(tmp_path: Path):
    """hpu_env.sh sets lazy mode and the recipe cache only where the user has not: an eager-mode run
    (PT_HPU_LAZY_MODE=0) or a cache on another local disk must reach every node as exported."""
    lines = _env_file_lines(tmp_path, _env(PT_HPU_LAZY_MODE="0",
                                           PT_HPU_RECIPE_CACHE_CONFIG="/scratch/cache,true,1024"))
    assert "PT_HPU_LAZY_MODE=0" in lines and "PT_HPU_LAZY_MODE=1" not in lines
    assert [line for line in lines if line.startswith("PT_HPU_RECIPE_CACHE_CONFIG=")] == \
        ["PT_HPU_RECIPE_CACHE_CONFIG=/scratch/cache,true,1024"]


def test_env_file_carries_habana_and_log_families_the_accelerator_and_console(tmp_path: Path):
    """Habana's module selection and its log levels, DeepSpeed's accelerator choice and Habana's console switch are
    read on every node; DeepSpeed forwards none of them itself."""
    lines = _env_file_lines(tmp_path, _env(HABANA_VISIBLE_MODULES="0,1", LOG_LEVEL_ALL="3", ENABLE_CONSOLE="true",
                                           DS_ACCELERATOR="hpu"))
    for line in ("HABANA_VISIBLE_MODULES=0,1", "LOG_LEVEL_ALL=3", "ENABLE_CONSOLE=true", "DS_ACCELERATOR=hpu"):
        assert lines.count(line) == 1, line


def test_an_absolute_ds_env_file_is_read_itself(tmp_path: Path):
    """DeepSpeed joins DS_ENV_FILE to ~ and to the working directory, and os.path.join keeps an absolute name as
    it is: that one file is read, and ./.deepspeed_env (not named) is not."""
    caller = tmp_path / "caller"
    caller.mkdir()
    (caller / ".deepspeed_env").write_text("SITE_VAR=from the default name\n")
    site = tmp_path / "site" / "cluster.env"
    site.parent.mkdir()
    site.write_text("SITE_VAR=from cluster.env\n")
    lines = _env_file_lines(tmp_path, _env(HOME=str(tmp_path / "home"), DS_ENV_FILE=str(site)), cwd=caller)
    assert lines[-1] == "SITE_VAR=from cluster.env" and "SITE_VAR=from the default name" not in lines


def test_a_forwarded_value_with_a_line_break_is_refused(tmp_path: Path):
    """DeepSpeed's environment file is one NAME=VALUE per line: a value with a line break would reach the other
    nodes cut, and its second line would be read as another variable."""
    proc = subprocess.run(["bash", str(LAUNCH), "--preset", "bert-1.5b-phase1", "--nodes", "2", "--hosts", "a,b",
                           "--input_dir", str(tmp_path), "--output_dir", str(tmp_path / "run"), "--dry_run"],
                          capture_output=True, text=True, env=_env(HCCL_SOCKET_IFNAME="eth0\nNCCL_DEBUG=INFO"),
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().endswith("launch.sh: error: HCCL_SOCKET_IFNAME holds a line break, which DeepSpeed's "
                                        "environment file cannot carry to the other nodes")
    assert not (tmp_path / "run" / "launch" / "deepspeed_env").exists()


def test_slurm_resolves_the_preset_in_the_project_root_from_any_directory(tmp_path: Path):
    """The outer step resolves the preset before launch.sh's cd to the root: `python -m training.presets` must run
    there, or an interpreter without this checkout installed (a container's) finds no `training` module."""
    record = tmp_path / "presets_cwd.txt"
    stub = _stand_in_python(tmp_path, f'[[ "$1 $2" != "-m training.presets" ]] || echo "$PWD" >> {record}')
    caller = tmp_path / "caller"
    caller.mkdir()
    proc = subprocess.run(["bash", str(LAUNCH), "--preset", "bert-large-phase1", "--nodes", "2", "--launcher", "slurm",
                           "--input_dir", ".", "--output_dir", "run", "--dry_run"], capture_output=True, text=True,
                          env=_env(PYTHON=str(stub), SLURM_JOB_ID="77", SLURM_JOB_NUM_NODES="2",
                                   SLURM_JOB_CPUS_PER_NODE="96(x2)"), cwd=caller, timeout=120)
    assert _command(proc)[0] == "srun"
    assert record.read_text().splitlines() == [str(ROOT)]
    assert (caller / "run" / "launch" / "deepspeed_config.json").is_file()
