"""Bookkeeping shared by every pipeline stage: atomic writes, a parameter record, a completion record and a lock.

A stage directory holds `_PARAMS.json` (written when the stage starts) and `_COMPLETE.json`
(written last, atomically, with the size of every file the stage wrote). A rerun with the same
parameters skips a complete stage whose files still have those sizes and, inside an incomplete one,
every part file that already exists (parts are themselves written to a temporary name and renamed).
A complete stage made with other parameters is refused rather than mixing outputs made with two
settings; an incomplete one is started afresh, as its partial output cannot serve the new ones.
`_LOCK` is held by the run that writes the directory, so a second run at once is refused instead of
deleting the first one's work.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from data import lockfile
from data.cli import file_in_the_way
from training.atomic import fsync_dir, fsync_tree

PARAMS_FILE = "_PARAMS.json"
COMPLETE_FILE = "_COMPLETE.json"
LOCK_FILE = "_LOCK"
# The key of a stage's output-format version in its parameters (each stage's FORMAT_VERSION).
VERSION_KEY = "format_version"


class PipelineError(RuntimeError):
    """Bad input or an inconsistent output directory; the message names the file and the fix."""


class StageConflict(PipelineError):
    """A finished stage directory that this run cannot use: made with other settings or by another
    version of the stage, or its files changed since. `redo` lists what to delete to redo it: the
    directory first, then what was made from it when the caller knows (data.prepare does)."""

    def __init__(self, stage_dir: Path, problem: str, redo: list[Path] | None = None):
        self.stage_dir, self.problem, self.redo = stage_dir, problem, redo
        if redo:
            fix = f"delete {', '.join(map(str, redo))} to redo {'it' if len(redo) == 1 else 'them'}"
        else:
            fix = f"delete {stage_dir}, and any output made from it, to redo this stage"
        super().__init__(f"{problem}\nUse another output directory, or {fix}.")


def _tmp_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


def _is_temporary(relative: Path) -> bool:
    return any(part.startswith(".") and ".tmp-" in part for part in relative.parts)


# Files are written in pieces of 1 MiB. One write(2) of several MiB took up to 7x longer than the same bytes
# in pieces on the development machine (10 ms for 5.4 MB, 1.4 ms in pieces; np.save of 14.5 MB: 26 ms, 6 ms;
# docs/PERFORMANCE.md), and pieces cost nothing where writes are fast.
_WRITE_PIECE = 1 << 20


class PieceWriter:
    """A file object's write, in pieces; a write stopped short is continued, so that a full disk raises its
    OSError (ENOSPC) on the next piece."""

    def __init__(self, raw) -> None:
        self._raw = raw

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _WRITE_PIECE):
            piece = view[start:start + _WRITE_PIECE]
            while piece:
                piece = piece[self._raw.write(piece):]
        return len(view)


def write_file(path: Path, data) -> None:
    """Write bytes (or any buffer) to a new file at `path`."""
    with open(path, "wb", buffering=0) as raw:
        PieceWriter(raw).write(data)


def save_array(path: Path, array) -> None:
    """np.save(path, array), byte for byte, written in pieces."""
    with open(path, "wb", buffering=0) as raw:
        np.lib.format.write_array(PieceWriter(raw), np.asanyarray(array), allow_pickle=False)


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside `final`; on success flush it to disk and rename it to `final`, on error
    remove it.

    Works for a file or a directory written at the temporary path. The flush comes before the rename, so
    that after a power loss a name (and the sizes `_COMPLETE.json` records) never stands for bytes that
    were not written.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(final)
    _remove(tmp)
    try:
        yield tmp
        fsync_tree(tmp)
    except OSError as exc:
        _remove(tmp)
        # (a call on a file descriptor, such as os.stat(fd), names it by its number: no file)
        named = [Path(name) for name in (exc.filename, exc.filename2) if isinstance(name, (str, os.PathLike))]
        if named and not any(path == tmp or tmp in path.parents for path in named):
            raise
        # A failed write names no file (Path.write_bytes, h5py) or the temporary, which is gone: name
        # the file, whose disk may not be the output directory's (--text_dir on another one).
        raise OSError(exc.errno, exc.strerror or str(exc), str(final)) from exc
    except BaseException:
        _remove(tmp)
        raise
    if final.is_dir() and tmp.is_dir():
        # os.replace cannot replace a non-empty directory; the old copy is complete output from
        # the same parameters, so the new one is equal and the old one can go first.
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def remove_leftovers(final: Path) -> None:
    """Remove the temporaries of `final` that a killed run left: for a file outside any stage
    directory, whose leftovers `begin` never sees."""
    for leftover in sorted(final.parent.glob(f".{final.name}.tmp-*")):
        _remove(leftover)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def write_json_atomic(path: Path, obj: Any, compact: bool = False) -> None:
    """`compact`: one line, by json's C encoder (indenting takes its pure-Python one, 10x slower)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=None if compact else 2, sort_keys=True) + "\n", encoding="utf-8")


def _normalise(params: dict[str, Any]) -> dict[str, Any]:
    # A JSON round trip so that tuples/lists and Paths compare equal to what was stored.
    return json.loads(json.dumps(params, sort_keys=True, default=str))


def make_dir(path: Path, flag: str | None = None) -> None:
    """Create the output directory `path` if it is missing, or say in a PipelineError naming it (and
    the flag that gave it) why it cannot be one."""
    name = f"{flag} {path}" if flag else str(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        blocker = file_in_the_way(path)
        what = f"{blocker} is a file, not a directory" if blocker else f"it cannot be a directory ({exc.strerror})"
        raise PipelineError(f"{name}: {what}; pass a directory path (it is created if missing)") from exc
    except OSError as exc:
        raise PipelineError(f"{name} cannot be created ({exc.strerror}); pass a directory you can write to") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise PipelineError(f"{name} is not writable; pass a directory you can write to")


def differences(then: Any, now: Any, upstream: tuple[str, ...] = ()) -> list[str]:
    """What differs between the parameters a stage directory was made with and this run's, one line
    per setting. A setting of an upstream directory (a `fingerprint`) is named through the chain of
    directories it reaches this one by ("its input tokens > sentences > extracted was remade: ...").
    Another output-format version is said alone: it explains the rest."""

    def said(text: str) -> str:
        return f"its input {' > '.join(upstream)} was remade: {text}" if upstream else text

    if not (isinstance(then, dict) and isinstance(now, dict)):
        return [said(f"made with {_show(then)}, now {_show(now)}")]
    if then.get(VERSION_KEY) != now.get(VERSION_KEY):
        made = then.get(VERSION_KEY, "from before format versions were recorded")
        return [said(f"made by another version of {'its' if upstream else 'this'} stage (output format {made}; "
                     f"this code writes format {now.get(VERSION_KEY)})")]
    lines = []
    then, now = _settings(then), _settings(now)
    for key in sorted(set(then) | set(now)):
        a, b = then.get(key), now.get(key)
        if a == b:
            continue
        if _is_upstream(a) and _is_upstream(b):
            lines += differences(a["params"], b["params"], (*upstream, key)) or [
                f"its input {' > '.join((*upstream, key))} was remade with the same settings, and holds other output"]
        else:
            lines.append(said(f"{key}: made with {_show(a)}, now {_show(b)}"))
    return lines


def _settings(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`params` with nested settings (not upstream directories) as dotted names: input.bytes."""
    flat = {}
    for key, value in params.items():
        if isinstance(value, dict) and not _is_upstream(value):
            flat.update(_settings(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _is_upstream(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"sha1", "params"}


def _show(value: Any) -> str:
    return "nothing" if value is None else json.dumps(value, sort_keys=True)


def _read_record(path: Path) -> dict[str, Any] | None:
    """A stage's JSON record, None when absent."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StageConflict(path.parent, f"{path} is unreadable ({exc})") from exc
    if not isinstance(record, dict):
        raise StageConflict(path.parent, f"{path} is not a record this pipeline writes")
    return record


def _file_sizes(stage_dir: Path) -> dict[str, int]:
    """The size of every file the stage wrote, by path relative to its directory."""
    sizes = {}
    for path in sorted(stage_dir.rglob("*")):
        relative = path.relative_to(stage_dir)
        if path.is_file() and not _is_temporary(relative) and relative.as_posix() not in (
                PARAMS_FILE, COMPLETE_FILE, LOCK_FILE):
            sizes[relative.as_posix()] = path.stat().st_size
    return sizes


def _check_files(stage_dir: Path, record: dict[str, Any]) -> None:
    """Refuse a finished stage whose files are missing or have other sizes than when it finished.

    Sizes only (a stat per file): a file cut short or replaced is found, one changed in place at the
    same size is not.
    """
    changed = []
    for name, size in record.get("files", {}).items():
        path = stage_dir / name
        try:
            now = path.stat().st_size
        except FileNotFoundError:
            changed.append(f"{path} is missing")
            continue
        except OSError as exc:
            changed.append(f"{path} cannot be read ({exc.strerror})")
            continue
        if now != size:
            changed.append(f"{path} is {now} bytes, not the {size} it had")
    if changed:
        more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
        raise StageConflict(stage_dir, f"{stage_dir} was finished, but its files changed since: "
                                       f"{'; '.join(changed[:3])}{more}")


def finished_record(stage_dir: Path) -> dict[str, Any]:
    """The completion record of a finished stage, whose files are checked first."""
    record = _read_record(stage_dir / COMPLETE_FILE)
    if record is None:
        raise PipelineError(f"{stage_dir} is not complete (no {COMPLETE_FILE}); run the stage that writes it first")
    _check_files(stage_dir, record)
    return record


def completed(stage_dir: Path, params: dict[str, Any]) -> dict[str, Any] | None:
    """The stored summary when `stage_dir` is complete for `params`, else None.

    Raises StageConflict when it is complete with other parameters, or its files changed since.
    """
    record = _read_record(stage_dir / COMPLETE_FILE)
    if record is None:
        return None
    params = _normalise(params)
    _check_own_directory(stage_dir, record.get("params"), params)
    if record.get("params") != params:
        raise StageConflict(stage_dir, f"{stage_dir} holds output made with other settings:\n  "
                                       + "\n  ".join(differences(record.get("params"), params)))
    _check_files(stage_dir, record)
    return record["summary"]


def _check_own_directory(stage_dir: Path, stored: Any, params: dict[str, Any]) -> None:
    """Refuse an output directory that another stage made (a stage's --input_dir given as its --output_dir,
    say): it would be refused as made with other settings, with the advice to delete it, or, unfinished,
    emptied."""
    made_by, writer = _made_by(stored), _made_by(params)
    if made_by and writer and made_by != writer:
        raise PipelineError(f"{stage_dir} holds the output of {made_by}, not of {writer}; pass {writer} another "
                            f"--output_dir (data.prepare writes it to {_INPUT_KEYS[writer][1]})")


def begin(stage_dir: Path, params: dict[str, Any]) -> dict[str, Any] | None:
    """Start (or resume) a stage. Returns the stored summary if it is already complete.

    Otherwise the directory is locked until `finish` (or until this process ends: a stage that fails
    keeps the lock, and a later `begin` of this process takes it back), and unfinished output made
    with other settings is discarded.
    """
    summary = completed(stage_dir, params)
    if summary is not None:
        # a run killed between writing _COMPLETE.json and releasing the lock left its file
        lockfile.remove_stale(stage_dir / LOCK_FILE)
        return summary
    make_dir(stage_dir)
    _lock(stage_dir)
    try:
        summary = completed(stage_dir, params)  # finished by the run that held the lock
        if summary is None:
            _start(stage_dir, _normalise(params))
    except BaseException:
        _release(stage_dir)
        raise
    if summary is not None:
        _release(stage_dir)
    return summary


def begun(stage_dir: Path) -> int | None:
    """When the run that began the stage directory's current output did so (None: not begun)."""
    try:
        return (_read_record(stage_dir / PARAMS_FILE) or {}).get("begun")
    except StageConflict:
        return None


def _start(stage_dir: Path, params: dict[str, Any]) -> None:
    params_path = stage_dir / PARAMS_FILE
    if params_path.is_file():
        try:
            stored = (_read_record(params_path) or {}).get("params")
            reasons = differences(stored, params)
        except StageConflict:
            stored, reasons = None, [f"its {PARAMS_FILE} is unreadable"]
        _check_own_directory(stage_dir, stored, params)
        if stored != params:
            # Its parts would mix with parts made with these settings, and a finished stage with them.
            print(f"{stage_dir}: discarding the unfinished output of an earlier run with other settings "
                  f"({'; '.join(reasons)}); it cannot serve these, so this stage starts afresh", flush=True)
            for entry in sorted(stage_dir.iterdir()):
                if entry.name != LOCK_FILE:
                    _remove(entry)
    else:
        foreign = sorted(p.name for p in stage_dir.iterdir()
                         if p.name != LOCK_FILE and not _is_temporary(p.relative_to(stage_dir)))
        if foreign:
            raise PipelineError(
                f"{stage_dir} holds files ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}) but no "
                f"{PARAMS_FILE}, so this stage did not make them; pass a new or empty directory")
    # Temporaries left by a killed run are incomplete by construction; their final names are
    # written again by this run.
    for leftover in sorted(stage_dir.rglob(".*.tmp-*")):
        _remove(leftover)
    if not params_path.is_file():
        # "begun" tells a run that resumed this directory from one that began it afresh.
        write_json_atomic(params_path, {"params": params, "begun": time.time_ns()})


def _lock(stage_dir: Path) -> None:
    """Lock `stage_dir` for this process (see `data.lockfile`), or refuse when another process holds it.
    `begin` and `finish` are separate calls: the lock stays held between them."""
    _release(stage_dir)  # a lock this process kept from a stage that failed
    path = stage_dir / LOCK_FILE
    try:
        lockfile.acquire(path)
    except lockfile.Busy as exc:
        holder = f"process {exc.pid}" if exc.pid else "a process that is starting"
        raise PipelineError(f"{stage_dir} is being written by another run ({holder}); wait for it to finish, "
                            "or stop it, then rerun") from exc
    except lockfile.NoLocks as exc:
        raise no_locks(path, exc) from exc
    except OSError as exc:
        if exc.errno in _DISK_FULL:
            raise  # named by cli_call's line for a full disk
        raise PipelineError(f"{stage_dir}: cannot write there ({exc.strerror}); pass a directory you can write "
                            "to") from exc


def no_locks(path: Path, exc: lockfile.NoLocks) -> PipelineError:
    return PipelineError(f"{path} cannot be locked ({exc.strerror}); put the output on a file system that "
                         "supports POSIX locks")


def _release(stage_dir: Path) -> None:
    """Release the lock this process holds on `stage_dir`, if it holds one. A finished stage needs no lock
    file, nor a directory this stage has not begun (one refused for holding files of its own): it is
    removed, before the lock is released (so a run that locks it meanwhile finds the stage finished, or
    locks anew)."""
    lock = lockfile.held(stage_dir / LOCK_FILE)
    if lock is not None:
        lock.release(remove=(stage_dir / COMPLETE_FILE).is_file() or not (stage_dir / PARAMS_FILE).is_file())


def finish(stage_dir: Path, params: dict[str, Any], summary: dict[str, Any],
           inputs: dict[str, str] | None = None) -> dict[str, Any]:
    """Record the stage as complete, with the size of each of its files; `inputs` names the files it
    was made from, for messages only (a moved input must not make the output another)."""
    record = {"params": _normalise(params), "summary": summary, "files": _file_sizes(stage_dir)}
    if inputs:
        record["inputs"] = inputs
    write_json_atomic(stage_dir / COMPLETE_FILE, record)
    _release(stage_dir)
    return summary


def cli_call(fn: Callable[[Any], Any], cfg: Any) -> Any:
    """Run a stage from its CLI: a PipelineError becomes a one-line message and exit status 1, Ctrl-C
    a line saying how to go on and exit status 130, and a disk error (`cfg.output_dir` full or not
    writable) a line naming the path, instead of a traceback."""
    try:
        return fn(cfg)
    except PipelineError as exc:
        raise SystemExit(f"error: {exc}") from exc
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to continue where it stopped", file=sys.stderr)
        raise SystemExit(130) from None
    except OSError as exc:
        raise SystemExit(disk_error(exc, getattr(cfg, "output_dir", None))) from exc


_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_DENIED = {errno.EACCES, errno.EPERM, errno.EROFS}


def disk_error(exc: OSError, output_dir: Path | None) -> str:
    """The line for a write that failed because the disk is full or not writable. Any other OSError is not the
    disk's state but a defect, whose traceback is needed: it is raised as it is (the input files' errors are
    PipelineErrors). Every file is written to a temporary name first, so the rerun goes on from the files
    written before it."""
    if exc.errno in _DISK_FULL:
        fix = "free space there"
    elif exc.errno in _DENIED:
        fix = "make it writable (or pass another output directory)"
    else:
        raise exc
    reason = os.strerror(exc.errno)  # errno's words, not h5py's message of many lines
    where = exc.filename2 or exc.filename or output_dir  # filename2: the destination of a copy or rename
    return f"error: {f'{where}: ' if where else ''}{reason}; {fix} and rerun the same command to continue where it stopped"


def unreadable_input(path: Path, exc: OSError, flag: str) -> PipelineError:
    """The error for an input file this process cannot read (its permissions, an I/O error): it names the
    file and the reason, where `disk_error` would have sent the user to the output directory."""
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    fix = ("make it readable by the user running this (e.g. chmod a+r), or pass a copy that is"
           if exc.errno in _DENIED else "check the file and the disk it is on, or pass a copy of it")
    return PipelineError(f"{flag} {path}: cannot read it ({reason}); {fix}")


def file_identity(path: Path, sample_bytes: int = 1 << 20) -> dict[str, Any]:
    """What identifies an input file for the skip logic: its name, size and the sha1 of its first and
    last `sample_bytes` (not its directory, so that a moved or copied output directory still resumes;
    not a hash of all of it, which would read a 22 GB dump on every rerun)."""
    size = path.stat().st_size
    digest = hashlib.sha1()
    with path.open("rb") as f:
        digest.update(f.read(sample_bytes))
        f.seek(max(size - sample_bytes, 0))
        digest.update(f.read(sample_bytes))
    return {"name": path.name, "bytes": size, "ends_sha1": digest.hexdigest()}


def read_utf8(path: Path, fix: str) -> tuple[str, int]:
    """A part's text and its size in bytes; text that is not UTF-8 is named with `fix`."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8"), len(data)
    except UnicodeDecodeError as exc:
        raise PipelineError(f"{path} is not UTF-8 text ({exc}); it was damaged after it was written: {fix}") from exc


def file_sha1(path: Path) -> str:
    """The sha1 of a small file read whole (a vocab); dumps are known by `file_identity`."""
    return hashlib.sha1(path.read_bytes()).hexdigest()


# The setting under which each stage records its input, which tells its output from another stage's, and
# where data.prepare puts that output.
_INPUT_KEYS = {
    "data.extract": ("input", "<text_dir>/extracted"),
    "data.segment": ("extracted", "<text_dir>/sentences"),
    "data.tokens": ("sentences", "<text_dir>/tokens_*"),
    "data.create": ("tokens", "<output_dir>/instances"),
    "data.shard": ("instances", "<output_dir>/hdf5"),
    "data.vocab": ("corpus", "<output_dir>/vocab_training"),
}


def require_input(input_dir: Path, flag: str, writer: str, incomplete: str) -> None:
    """Refuse a stage's input directory that does not exist or is a file, naming `flag` and what to pass, or that
    holds no complete output (`incomplete`: the line that says so and names `writer`, the stage that makes it)."""
    what = f"pass the directory {writer} wrote ({_INPUT_KEYS[writer][1]} of data.prepare)"
    if not input_dir.exists():
        raise PipelineError(f"{flag} {input_dir} does not exist; {what}")
    if not input_dir.is_dir():
        raise PipelineError(f"{flag} {input_dir} is a file, not a directory; {what}")
    if not (input_dir / COMPLETE_FILE).is_file():
        raise PipelineError(incomplete)


def _made_by(params: Any) -> str | None:
    """The stage whose parameters `params` are, by the key it records its input under (None: not known)."""
    if not isinstance(params, dict):
        return None
    return next((name for name, (key, _) in _INPUT_KEYS.items() if key in params), None)


def _check_writer(stage_dir: Path, params: dict[str, Any], writer: str) -> None:
    """Refuse the finished output of another stage than `writer` (the extracted text given for the sentences,
    say): its files may even parse, as both are text, and give nonsense."""
    made_by = _made_by(params)
    if made_by in (None, writer):
        return
    raise PipelineError(f"{stage_dir} was made by {made_by}, not by {writer}; pass the directory "
                        f"{writer} wrote ({_INPUT_KEYS[writer][1]} of data.prepare)")


def fingerprint(stage_dir: Path, version: int | None = None, record: dict[str, Any] | None = None,
                writer: str | None = None) -> dict[str, Any]:
    """Identifies a complete upstream stage's output: the sha1 of its parameters and summary, with its
    parameters, so that a downstream stage refused for it can say which of them differ. With `writer` (the
    upstream stage, "data.segment"), another stage's output is refused, and with `version` (the upstream
    stage's FORMAT_VERSION), output of another version of that stage. `record`: its `finished_record`, when
    the caller has read it already."""
    record = finished_record(stage_dir) if record is None else record
    if writer is not None:
        _check_writer(stage_dir, record["params"], writer)
    made = record["params"].get(VERSION_KEY)
    if version is not None and made != version:
        made_by = f"format {made}" if made is not None else "from before format versions were recorded"
        raise StageConflict(stage_dir, f"{stage_dir} was made by another version of the stage that writes it "
                                       f"(output {made_by}; this code reads format {version})")
    summary = {k: v for k, v in record["summary"].items() if k != "seconds"}  # a redo gives the same
    digest = hashlib.sha1(json.dumps({"params": record["params"], "summary": summary}, sort_keys=True).encode())
    return {"sha1": digest.hexdigest(), "params": record["params"]}
