"""Checkpoints: save, `latest`, keep-K, resume, change of world size.

Layout under `<output_dir>/checkpoints/`:
    step00000100/                    one DeepSpeed checkpoint (tag), written by every rank
        mp_rank_00_model_states.pt     module weights, lr scheduler, client state
        *zero_pp_rank_<r>_mp_rank_00_optim_states.pt   rank r's ZeRO optimizer partition
        run_state.json                 ours, written last: step, consumed samples, world size,
                                       size and CRC-32 of every file (the manifest)
    step00000100_universal/          made on demand when resuming on another world size, with a
                                       copy of the run_state.json it was converted from
    latest                           the tag to resume from; only ever names a complete tag

Save order: DeepSpeed writes the tag (`save_latest=False`), every rank reaches a barrier,
the ranks fsync the files and compute their CRC-32s, rank 0 checks that every rank's partition
is there, marks the tag `commit_pending`, writes run_state.json (the manifest), replaces `latest`
atomically, removes the mark, then deletes tags beyond the newest K. A crash before run_state.json
leaves `latest` naming the previous complete tag; a crash after it is finished by the next run
(`recover`). Anything that does not check out on load is a `CheckpointError`; a run never falls
back to a fresh start.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
import zipfile
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from training.atomic import atomic_write_text, remove_stale_temporaries
from training.schedule import ScheduleMismatchError

CHECKPOINTS = "checkpoints"
RUN_STATE = "run_state.json"
LATEST = "latest"
MODEL_STATES = "mp_rank_00_model_states.pt"
COMMIT_PENDING = "commit_pending"  # in a tag from just before its run_state.json until `latest` names it
UNIVERSAL_MANIFEST = "universal_files.json"  # in a universal copy: size and CRC-32 of each of its files
UNIVERSAL_SUFFIX = "_universal"
LATEST_UNIVERSAL = "latest_universal"  # DeepSpeed's pointer to the newest universal copy
SOURCE_RUN_STATE = "source_run_state.json"  # in a universal copy: the run_state.json it was made from
_TAG = re.compile(r"^step(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the path and what to do."""


@dataclass
class RunState:
    step: int  # optimizer steps completed in this phase
    consumed_samples: int  # stream positions consumed (see training/loader.py)
    world_size: int
    seed: int
    skipped_batches: int  # micro batches dropped for a non-finite loss
    identity: dict  # what a resume must not change (run_pretraining.run_identity): optimizer, batch, shards, model
    files: dict[str, dict]  # relative path -> {"size": bytes, "crc32": checksum}, every file of the tag
    previous: str | None = None  # the tag `latest` named when this one was saved
    # CRC-32 of that tag's run_state.json then: a tag saved again under the same name after a rewind is
    # another parent (None: no previous tag, or saved before it was recorded)
    previous_crc32: int | None = None
    # optimizer steps whose non-finite gradients DeepSpeed skipped. Absent before it was counted: a
    # checkpoint of those versions that passes the resume's schedule check had none.
    skipped_steps: int = 0


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def checkpoint_dir(output_dir: Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def is_tag_name(tag: str) -> bool:
    """A name of a directory beside `latest`: '..', '.' or a path would name the run's directory, the
    checkpoints directory itself or another run's."""
    return bool(tag) and "/" not in tag and os.sep not in tag and tag not in (".", "..")


def read_latest(ckpt_dir: Path) -> str | None:
    path = ckpt_dir / LATEST
    if not path.exists():
        return None
    tag = path.read_text().strip()
    if not tag:
        raise CheckpointError(f"{path} is empty; write the tag to resume from into it (e.g. step00000100)")
    if not is_tag_name(tag):
        raise CheckpointError(f"{path}: {tag!r} is not a tag name; " + pick_complete_tag(
            ckpt_dir, "write into it", "write the name of a tag directory beside it into it (e.g. step00000100)"))
    return tag


def complete_tags(ckpt_dir: Path) -> list[str]:
    """Tags with a run_state.json, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    tags = [p.name for p in ckpt_dir.iterdir() if _TAG.match(p.name) and (p / RUN_STATE).is_file()]
    return sorted(tags)


def pick_complete_tag(ckpt_dir: Path, do: str, otherwise: str) -> str:
    """The fix for a tag that cannot be used, for an error message: `do` (e.g. "pass --tag with") one of the
    complete tags of `ckpt_dir`, named; `otherwise` where none is complete."""
    tags = complete_tags(ckpt_dir)
    return f"{do} one of the complete tags: {', '.join(tags)}" if tags else otherwise


def missing_partitions(tag_dir: Path, world_size: int) -> list[str]:
    """What a save of `world_size` data-parallel ranks lacks in `tag_dir`: partitions by rank, the model states."""
    missing = []
    for rank in range(world_size):
        if not list(tag_dir.glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")):
            missing.append(f"optimizer partition of rank {rank}")
    if not (tag_dir / MODEL_STATES).is_file():
        missing.append(MODEL_STATES)
    return missing


def tag_files(tag_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(tag_dir)) for p in tag_dir.rglob("*") if p.is_file() and p.name != RUN_STATE)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def describe_files(tag_dir: Path, names: list[str]) -> dict[str, dict]:
    """fsync each file and record its size and CRC-32 (the ranks share this work in `save`)."""
    files = {}
    for name in names:
        path = tag_dir / name
        _fsync_file(path)
        files[name] = {"size": path.stat().st_size, "crc32": _crc32(path)}
    return files


def _state_crc32(tag_dir: Path) -> int | None:
    """CRC-32 of a tag's run_state.json; None where it has none."""
    try:
        return _crc32(tag_dir / RUN_STATE)
    except FileNotFoundError:
        return None


def _set_aside(ckpt_dir: Path, tag: str, suffix: str, why: str) -> Path:
    """Move a tag to `<tag>.<suffix>` (`-2`, `-3`, ... when taken), out of reach of keep-K pruning."""
    aside, n = ckpt_dir / f"{tag}.{suffix}", 1
    while aside.exists():
        n += 1
        aside = ckpt_dir / f"{tag}.{suffix}-{n}"
    os.replace(ckpt_dir / tag, aside)
    print(f"warning: {ckpt_dir / tag} {why}; moved to {aside}", file=sys.stderr)
    return aside


def commit(ckpt_dir: Path, tag: str, state_fields: dict, keep: int, files: dict[str, dict]) -> RunState:
    """Rank 0, after every rank saved `tag` and the files were described: verify, write the
    manifest, point `latest` at the tag, prune."""
    tag_dir = ckpt_dir / tag
    missing = missing_partitions(tag_dir, state_fields["world_size"])
    if missing:
        raise CheckpointError(f"{tag_dir}: DeepSpeed did not write {', '.join(missing)}; 'latest' was left "
                              "at the previous checkpoint")
    previous = read_latest(ckpt_dir)
    state = RunState(**state_fields, files=files, previous=previous,
                     previous_crc32=_state_crc32(ckpt_dir / previous) if previous else None)
    pending = tag_dir / COMMIT_PENDING
    pending.touch()
    atomic_write_text(tag_dir / RUN_STATE, json.dumps(asdict(state), indent=1) + "\n")
    atomic_write_text(ckpt_dir / LATEST, tag + "\n")
    pending.unlink()
    try:
        prune(ckpt_dir, keep)
    except OSError as e:  # the save is committed: only older checkpoints stay, which the next save prunes again
        print(f"warning: {tag_dir} is saved and '{LATEST}' names it, but removing older checkpoints failed ({e}); "
              f"they are kept until a later save removes them, or remove them by hand", file=sys.stderr)
    return state


def recover(ckpt_dir: Path) -> str | None:
    """Rank 0, before any rank looks for its checkpoint: finish the commit a kill interrupted.

    Killed after a tag's run_state.json and before `latest` names it, the tag is complete and
    still marked `commit_pending`, and `latest` names the tag it records as `previous` (the same
    one: its run_state.json has the CRC-32 recorded): it is committed now (it would otherwise be
    taken for a tag the user rewound past, or, for a run's first checkpoint, leave checkpoints
    without a `latest`). One whose files do not check out was never committed: it is set aside as
    `<tag>.damaged` and the run resumes from `latest`. A complete tag beyond `latest` without the
    mark was committed and later rewound past by the user, and one whose parent is not `latest`'s
    tag was saved before the user rewound: both are left to `make_room`. Killed after `latest`, the
    mark goes. Unfinished tags, the temporary directory of a killed universal conversion and the
    temporary files of `latest` and `latest_universal` go too. Complete tags are not pruned here,
    before the run has checked that the directory is its own: the next save prunes them. Returns
    the tag committed here, if any."""
    if not ckpt_dir.is_dir():
        return None
    for name in (LATEST, LATEST_UNIVERSAL):
        remove_stale_temporaries(ckpt_dir / name)
    latest = read_latest(ckpt_dir)
    committed = None
    for tag in complete_tags(ckpt_dir):
        pending = ckpt_dir / tag / COMMIT_PENDING
        if not pending.exists():
            continue
        if latest is not None and tag <= latest:
            pending.unlink()
            continue
        state = read_state(ckpt_dir / tag)
        if state.previous != latest or (state.previous_crc32 is not None
                                        and state.previous_crc32 != _state_crc32(ckpt_dir / latest)):
            continue
        try:
            verify_files(ckpt_dir / tag, state, checksum=list(state.files))
        except CheckpointError as e:
            _set_aside(ckpt_dir, tag, "damaged", f"was never committed and does not check out ({e})")
            continue
        atomic_write_text(ckpt_dir / LATEST, tag + "\n")
        pending.unlink()
        print(f"{ckpt_dir / tag} was saved whole but the run stopped before '{LATEST}' named it; it does now",
              file=sys.stderr)
        latest = committed = tag
    # A universal conversion killed midway (universal_tag converts again when it is needed).
    for path in ckpt_dir.glob(f".step*{UNIVERSAL_SUFFIX}.*"):
        if path.name.endswith(".tmp") and path.is_dir():
            shutil.rmtree(path)
        elif path.name.endswith(".failed"):
            path.unlink()
    for path in ckpt_dir.glob(f"..step*{UNIVERSAL_SUFFIX}.failed.*.tmp"):  # a failure mark's, cut short
        path.unlink()
    remove_unfinished(ckpt_dir)
    return committed


def resume_point(ckpt_dir: Path) -> tuple[str, RunState] | None:
    """Collective: rank 0 finishes an interrupted commit (`recover`) and finds the tag to resume from
    (`find_resume`); every rank gets its answer, or its error. Each rank reading `latest` itself could
    see an older one on a network file system that caches directory entries, just after rank 0 replaced
    it."""
    answer: list = [None]
    if dist.get_rank() == 0:
        try:
            recover(ckpt_dir)
            found = find_resume(ckpt_dir)
            answer[0] = ("ok", None if found is None else (found[0], asdict(found[1])))
        except (CheckpointError, OSError) as e:
            answer[0] = ("error", str(e))
    dist.broadcast_object_list(answer, src=0)
    kind, value = answer[0]
    if kind == "error":
        raise CheckpointError(value)
    return None if value is None else (value[0], RunState(**value[1]))


def _raise_rank0_error(error: str | None) -> None:
    """Collective: rank 0's error, if any, raised on every rank (raised on rank 0 alone, it would
    leave the others waiting in the next collective)."""
    errors = [error]
    dist.broadcast_object_list(errors, src=0)
    if errors[0]:
        raise CheckpointError(errors[0])


def prune(ckpt_dir: Path, keep: int) -> None:
    """Keep the newest `keep` complete tags up to `latest` (and `latest` itself); drop older tags,
    their universal copies, and unfinished tags left by a crash. Complete tags newer than `latest`
    (a timeline the user rewound from by editing `latest`) are left alone."""
    latest = read_latest(ckpt_dir)
    tags = [t for t in complete_tags(ckpt_dir) if latest is None or t <= latest]
    keep_set = set(tags[-keep:]) | ({latest} if latest else set())
    for path in ckpt_dir.iterdir():
        base = path.name.removesuffix(UNIVERSAL_SUFFIX)
        if _TAG.match(base) and path.is_dir() and base not in keep_set and latest is not None and base < latest:
            shutil.rmtree(path)
    remove_unfinished(ckpt_dir)


INCOMPLETE = "incomplete"  # `<tag>.incomplete[-n]`: a committed tag set aside for lack of its run_state.json


def is_set_aside_incomplete(tag: str) -> bool:
    return re.search(rf"\.{INCOMPLETE}(-\d+)?$", tag) is not None


def remove_unfinished(ckpt_dir: Path) -> None:
    """Drop tags without a run_state.json beyond `latest` (a save a crash cut short; never resumable) and their
    universal copies, and a `latest_universal` naming a copy that is gone. A tag up to `latest` was committed:
    one that lost its run_state.json (deleted by hand, or by a file system) still holds the weights and is set
    aside as `<tag>.incomplete`, where neither this nor pruning deletes it, once `latest` is pointed elsewhere."""
    complete = set(complete_tags(ckpt_dir))
    latest = read_latest(ckpt_dir)
    for path in sorted(ckpt_dir.iterdir()):
        base = path.name.removesuffix(UNIVERSAL_SUFFIX)
        if not (_TAG.match(base) and path.is_dir() and base not in complete):
            continue
        if latest is None or base > latest:
            shutil.rmtree(path)
        elif path.name == base:
            _set_aside(ckpt_dir, base, INCOMPLETE, f"was committed but has no {RUN_STATE}; its weights are kept")
    pointer = ckpt_dir / LATEST_UNIVERSAL
    if pointer.is_file():
        copy = pointer.read_text().strip()
        if not (is_tag_name(copy) and (ckpt_dir / copy).is_dir()):  # '', '.' or '..' would name a directory too
            pointer.unlink()


def make_room(ckpt_dir: Path, tag: str) -> None:
    """Before saving `tag`: crash debris of that name goes. Complete tags newer than `latest` up to
    `tag` (and `tag` itself) belong to a timeline the user rewound past by editing `latest`: each is
    kept as `<tag>.abandoned` (`.abandoned-2`, ... when a later rewind passes the same step again),
    out of reach of keep-K pruning, so no complete checkpoint is ever deleted here. Their universal
    copies go: they are derived from the old weights."""
    latest = read_latest(ckpt_dir)
    for old in complete_tags(ckpt_dir):
        if old == tag or (latest is not None and latest < old <= tag):
            shutil.rmtree(ckpt_dir / (old + UNIVERSAL_SUFFIX), ignore_errors=True)
            _set_aside(ckpt_dir, old, "abandoned", "belonged to a run rewound past it")
    shutil.rmtree(ckpt_dir / (tag + UNIVERSAL_SUFFIX), ignore_errors=True)
    if (ckpt_dir / tag).exists():
        shutil.rmtree(ckpt_dir / tag)


def _write_failure(tag_dir: Path, rank: int, e: BaseException) -> str:
    """What a rank reports when it could not write its part of `tag_dir`. torch.save reports a full disk
    as a RuntimeError without errno or path ("basic_ios::clear: iostream error", "unexpected pos ..."),
    so the free space is looked up and told."""
    space = _free_space(tag_dir.parent)
    free = f"{space} free there" if space else "free space unknown"
    return f"rank {rank} could not write checkpoint {tag_dir} ({type(e).__name__}: {e}; {free})"


def _free_space(directory: Path) -> str | None:
    """The free space on `directory`'s file system ("12.5 MiB"), None where it cannot be looked up."""
    try:
        return f"{shutil.disk_usage(directory).free / 2**20:.1f} MiB"
    except OSError:
        return None


def _save_failed(ckpt_dir: Path, error: str) -> str:
    """`error` of a failed write of a save, with what to do (every rank sees `latest`: see "Storage" in
    docs/TRAINING.md)."""
    try:
        latest = read_latest(ckpt_dir)
    except (CheckpointError, OSError):
        latest = None
    resumes = f"it resumes from {latest}" if latest else "it starts again, as there is no checkpoint yet"
    return (f"{error}. '{LATEST}' was left as it was; if the disk is full, free space there (a save needs room for "
            f"one checkpoint more than --keep_checkpoints keeps) and rerun the same command: {resumes}")


def save(engine, ckpt_dir: Path, step: int, consumed_samples: int, seed: int, skipped: tuple[int, int],
         identity: dict, keep: int) -> str:
    """Collective: every rank calls it. `skipped`: the run's (skipped_batches, skipped_steps). Returns the tag.

    A write that fails on any rank (a full disk, an unwritable directory) is raised on every rank as one
    CheckpointError, after every rank has left DeepSpeed's collectives: raised on that rank alone, it
    would leave the others waiting in the next collective. The unfinished tag is removed (it would
    hold on to the space) and `latest` keeps naming the previous checkpoint."""
    tag = tag_for(step)
    tag_dir = ckpt_dir / tag
    rank = dist.get_rank()
    error = None
    if rank == 0:
        try:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            make_room(ckpt_dir, tag)
        except OSError as e:
            error = _save_failed(ckpt_dir, _write_failure(tag_dir, rank, e))
    _raise_rank0_error(error)
    # The universal-checkpoint info lets ds_to_universal convert this tag for another world size.
    client_state = {"universal_checkpoint_info": {"universal_checkpoint_version": 0.4}}
    failure = None
    try:
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    except dist.DistError:
        raise  # a rank that is gone: no collective can report it (gloo says so with a plain RuntimeError,
        # taken below for a write failure; the barrier there then fails at once, as the peer is gone)
    except (OSError, RuntimeError) as e:
        failure = _save_failed(ckpt_dir, _write_failure(tag_dir, rank, e))
        # DeepSpeed 0.19.8 writes its files after its last collective but one: this is the barrier that
        # save_checkpoint ends with, in which the ranks whose writes went through are waiting.
        dist.barrier()
    dist.barrier()
    world = dist.get_world_size()
    described: list[dict | str | None] = [None] * world
    mine: dict | str
    if failure is not None:
        mine = failure
    else:
        try:
            mine = describe_files(tag_dir, tag_files(tag_dir)[rank::world])
        except OSError as e:  # sent to rank 0 rather than raised here, which would leave the others waiting
            mine = f"rank {rank} could not read back {tag_dir}: {e}; 'latest' was left at the previous checkpoint"
    dist.all_gather_object(described, mine)
    error = next((part for part in described if isinstance(part, str)), None)
    if rank == 0 and error is None:
        try:
            files = {k: v for part in described for k, v in part.items()}
            commit(ckpt_dir, tag, {"step": step, "consumed_samples": consumed_samples, "world_size": world,
                                   "seed": seed, "skipped_batches": skipped[0], "skipped_steps": skipped[1],
                                   "identity": identity},
                   keep, dict(sorted(files.items())))
        except CheckpointError as e:
            error = str(e)  # says what is wrong and that 'latest' was left as it was
        except OSError as e:
            error = _save_failed(ckpt_dir, _write_failure(tag_dir, rank, e))
    if rank == 0 and error is not None and not (tag_dir / RUN_STATE).is_file():
        shutil.rmtree(tag_dir, ignore_errors=True)  # unfinished: it would hold on to the space until the rerun
    _raise_rank0_error(error)
    return tag


def find_resume(ckpt_dir: Path) -> tuple[str, RunState] | None:
    """The tag and state to resume from, None for a fresh run; CheckpointError for anything broken."""
    latest = read_latest(ckpt_dir)
    if latest is None:
        tags = complete_tags(ckpt_dir)
        if tags:
            raise CheckpointError(f"{ckpt_dir} holds checkpoints ({', '.join(tags)}) but no '{LATEST}' file. "
                                  f"Write the tag to resume from into {ckpt_dir / LATEST}, or use a new --output_dir")
        return None
    tag_dir = ckpt_dir / latest
    if not (tag_dir / RUN_STATE).is_file():
        fix = pick_complete_tag(ckpt_dir, "Point 'latest' at",
                                f"No tag there is complete (none has a {RUN_STATE}), so there is nothing to start "
                                f"from: use another run's directory, or remove {ckpt_dir / LATEST} to train this one "
                                "from scratch")
        kept = sorted(ckpt_dir.glob(f"{glob.escape(latest)}.{INCOMPLETE}*"))
        aside = (f" Its files are kept in {kept[-1]}: with its {RUN_STATE} put back, rename it to {latest} to resume "
                 "from it." if kept else "")
        raise CheckpointError(f"{ckpt_dir / LATEST} names {latest!r} but {tag_dir / RUN_STATE} does not exist: the "
                              f"checkpoint is incomplete or was deleted.{aside} {fix}")
    state = read_state(tag_dir)
    verify_files(tag_dir, state)
    return latest, state


def read_state(tag_dir: Path) -> RunState:
    state_file = tag_dir / RUN_STATE
    try:
        data = json.loads(state_file.read_text())
        error = None if isinstance(data, dict) else f"a JSON {type(data).__name__}, not an object"
    except json.JSONDecodeError as e:
        error = str(e)
    if error is not None:
        raise CheckpointError(f"{state_file} is corrupt ({error}); point {tag_dir.parent / LATEST} at an older tag")
    fields = {f.name for f in dataclasses.fields(RunState)}
    required = {f.name for f in dataclasses.fields(RunState)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing, unknown = sorted(required - set(data)), sorted(set(data) - fields)
    if missing or unknown:
        # Every tag of a run is written by the same code: an older tag would not help.
        raise CheckpointError(f"{state_file} was written by another version of run_pretraining.py (fields missing: "
                              f"{', '.join(missing) or 'none'}; unknown: {', '.join(unknown) or 'none'}); resume the "
                              "run with the version that wrote it")
    problem = _field_problem(data)
    if problem is not None:
        raise CheckpointError(f"{state_file}: {problem}; the file was altered. Point {tag_dir.parent / LATEST} at "
                              "an older tag")
    return RunState(**data)


def _field_problem(data: dict) -> str | None:
    """What is wrong with the types of a run_state.json's fields, None if nothing."""
    def whole(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    for name in ("step", "consumed_samples", "world_size", "seed", "skipped_batches", "skipped_steps"):
        if name in data and not whole(data[name]):
            return f"field '{name}' is {data[name]!r}, not a whole number >= 0"
    if not isinstance(data["identity"], dict):
        return f"field 'identity' is {data['identity']!r}, not an object"
    files = data["files"]
    if not (isinstance(files, dict) and all(isinstance(f, dict) and whole(f.get("size")) and whole(f.get("crc32"))
                                            for f in files.values())):
        return "field 'files' is not an object of {\"size\": bytes, \"crc32\": checksum} per file"
    if data.get("previous") is not None and not isinstance(data["previous"], str):
        return f"field 'previous' is {data['previous']!r}, not a tag name"
    if data.get("previous_crc32") is not None and not whole(data["previous_crc32"]):
        return f"field 'previous_crc32' is {data['previous_crc32']!r}, not a checksum"
    return None


def verify_files(tag_dir: Path, state: RunState, checksum: list[str] | None = None) -> None:
    """Every file present with its saved size; the files named in `checksum` also with their CRC."""
    for name, saved in state.files.items():
        path = tag_dir / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing from checkpoint {tag_dir}; point 'latest' at an older tag")
        if path.stat().st_size != saved["size"]:
            raise CheckpointError(f"{path} has {path.stat().st_size} bytes but was saved with {saved['size']}: "
                                  f"the checkpoint is corrupt. Point {tag_dir.parent / LATEST} at an older tag")
        if checksum is not None and name in checksum and _crc32(path) != saved["crc32"]:
            raise CheckpointError(f"{path}: CRC-32 differs from the one saved: the checkpoint is corrupt. "
                                  f"Point {tag_dir.parent / LATEST} at an older tag")


def verify_checksums(ckpt_dir: Path, tag: str, state: RunState, module_only: bool = False) -> None:
    """Collective: the ranks share the CRC checks of the tag's files (with `module_only`, of the model
    states alone: the optimizer partitions are not read); any mismatch fails every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names = [MODEL_STATES] if module_only else list(state.files)
    error = None
    try:
        verify_files(ckpt_dir / tag, state, checksum=names[rank::world])
    except CheckpointError as e:
        error = str(e)
    errors: list[str | None] = [None] * world
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


# torch.load raises these on truncated or overwritten files.
LOAD_ERRORS = (RuntimeError, OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, KeyError, ValueError)


def load(engine, ckpt_dir: Path, tag: str, module_only: bool = False) -> dict:
    """Restore module, optimizer partitions and lr schedule of `tag` into the engine (only the module
    with `module_only`, which any world size can read). Returns the DeepSpeed config the checkpoint was
    saved with (DeepSpeed keeps it in the model states; empty if absent)."""
    try:
        path, client_state = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_module_only=module_only)
    except ScheduleMismatchError:
        raise  # flags that differ from the checkpoint's: its message names them; the files are fine
    except LOAD_ERRORS as e:
        # The resume checked every file's size and CRC-32 first (and the model config and precision):
        # what fails here is rarely damage.
        raise CheckpointError(f"{ckpt_dir / tag}: DeepSpeed cannot load the checkpoint ({type(e).__name__}: {e}). "
                              "Its files passed their size and CRC-32 checks, so this is rarely damage: resume with "
                              "the DeepSpeed version, DeepSpeed JSON and model config it was saved with, or point "
                              "'latest' at another tag") from e
    if path is None:
        raise CheckpointError(f"{ckpt_dir / tag}: DeepSpeed found no checkpoint to load")
    saved = (client_state or {}).get("ds_config")
    return saved if isinstance(saved, dict) else {}


def _universal_damage(target: Path) -> str | None:
    """What is wrong with a universal copy's files against its manifest, None if nothing."""
    try:
        files = json.loads((target / UNIVERSAL_MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        return f"its {UNIVERSAL_MANIFEST} cannot be read: {e}"
    for name, saved in files.items():
        path = target / name
        try:
            if path.stat().st_size != saved["size"] or _crc32(path) != saved["crc32"]:
                return f"{path} differs from the size or CRC-32 recorded when it was made"
        except OSError as e:
            return f"{path}: {e}"
    return None


def universal_tag(ckpt_dir: Path, tag: str, poll_seconds: float = 2.0) -> str:
    """Collective: convert `tag` to DeepSpeed's universal format once (rank 0), return its tag.

    A universal copy is reused only if it was made from this very tag (its copy of the tag's
    run_state.json is identical), never one left by a timeline that was rewound past `tag`, and only
    if every file has the size and CRC-32 recorded when it was made (otherwise it is made again).
    Converting a large model can outlast the process group's timeout, so the other ranks wait
    for the outcome on the checkpoint filesystem (shared by all nodes), not in a collective.
    """
    target = ckpt_dir / (tag + UNIVERSAL_SUFFIX)
    source = (ckpt_dir / tag / RUN_STATE).read_bytes()
    failed = ckpt_dir / f".{target.name}.failed"

    def ready() -> bool:
        try:
            return (target / SOURCE_RUN_STATE).read_bytes() == source and (target / MODEL_STATES).is_file()
        except OSError:  # absent, or being replaced by rank 0
            return False

    rank = dist.get_rank()
    if rank == 0:
        failed.unlink(missing_ok=True)
        if ready():
            problem = _universal_damage(target)
            if problem is not None:
                print(f"warning: {target} does not check out ({problem}); converting {tag} again", file=sys.stderr)
                shutil.rmtree(target)
    dist.barrier()  # no rank can see the outcome of an earlier attempt
    if rank == 0 and not ready():
        shutil.rmtree(target, ignore_errors=True)
        tmp = ckpt_dir / f".{target.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
               str(ckpt_dir / tag), "--output_folder", str(tmp), "--num_extract_workers", "1",
               "--num_merge_workers", "1"]
        print(f"converting {ckpt_dir / tag} for another world size: {' '.join(cmd)}", file=sys.stderr)
        result = subprocess.run(cmd, capture_output=True, text=True)
        problem = None
        if result.returncode != 0:
            problem = (f"converting {ckpt_dir / tag} to a universal checkpoint failed ({' '.join(cmd)}):\n"
                       f"{result.stdout[-2000:]}{result.stderr[-2000:]}")
        else:
            try:
                files = describe_files(tmp, tag_files(tmp))
                atomic_write_text(tmp / UNIVERSAL_MANIFEST, json.dumps(files, indent=1) + "\n")
                (tmp / SOURCE_RUN_STATE).write_bytes(source)
                os.replace(tmp, target)
                # ds_to_universal pointed it at the temporary name
                atomic_write_text(ckpt_dir / LATEST_UNIVERSAL, target.name)
            except OSError as e:
                problem = f"{' '.join(cmd)} converted {ckpt_dir / tag}, but putting it in place failed: {e}"
            else:
                if not ready():
                    problem = f"{' '.join(cmd)} wrote no {MODEL_STATES} into {target}"
        if problem is not None:
            free = _free_space(ckpt_dir) or "unknown"
            # A conversion cut short by a full disk holds the space the mark needs (without the mark, the
            # other ranks would wait for good); the next attempt converts again.
            shutil.rmtree(tmp, ignore_errors=True)
            atomic_write_text(failed, f"{problem}\n({free} was free in {ckpt_dir} when it stopped: if the disk "
                                      "is full, free space there and rerun the same command)")
    while rank != 0 and not (ready() or failed.is_file()):
        time.sleep(poll_seconds)
    dist.barrier()
    if failed.is_file():
        raise CheckpointError(failed.read_text())
    return target.name
