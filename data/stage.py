"""Bookkeeping shared by every pipeline stage: atomic writes, a parameter record and a completion marker.

A stage directory holds `_PARAMS.json` (written when the stage starts) and `_COMPLETE.json`
(written last, atomically). A rerun with the same parameters skips a complete stage and, inside
an incomplete one, every part file that already exists (parts are themselves written to a
temporary name and renamed). A rerun with different parameters is refused rather than mixing
outputs made with two settings.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PARAMS_FILE = "_PARAMS.json"
COMPLETE_FILE = "_COMPLETE.json"


class PipelineError(RuntimeError):
    """Bad input or an inconsistent output directory; the message names the file and the fix."""


class StageConflict(PipelineError):
    """A stage directory that this run cannot use, made with other settings. `redo` lists what to delete
    to redo it: the directory first, then what was made from it when the caller knows (data.prepare does)."""

    def __init__(self, stage_dir: Path, problem: str, redo: list[Path] | None = None):
        self.stage_dir, self.problem, self.redo = stage_dir, problem, redo
        if redo:
            fix = f"delete {', '.join(map(str, redo))} to redo {'it' if len(redo) == 1 else 'them'}"
        else:
            fix = f"delete {stage_dir}, and any output made from it, to redo this stage"
        super().__init__(f"{problem}\nUse another output directory, or {fix}.")


def _tmp_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside `final`; on success rename it to `final`, on error remove it.

    Works for a file or a directory written at the temporary path.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(final)
    _remove(tmp)
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    if final.is_dir() and tmp.is_dir():
        # os.replace cannot replace a non-empty directory; the old copy is complete output from
        # the same parameters, so the new one is equal and the old one can go first.
        shutil.rmtree(final)
    os.replace(tmp, final)


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


def write_json_atomic(path: Path, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


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
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        what = f"{blocker} is a file, not a directory" if blocker else f"it cannot be a directory ({exc.strerror})"
        raise PipelineError(f"{name}: {what}; pass a directory path (it is created if missing)") from exc
    except OSError as exc:
        raise PipelineError(f"{name} cannot be created ({exc.strerror}); pass a directory you can write to") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise PipelineError(f"{name} is not writable; pass a directory you can write to")


def differences(then: Any, now: Any, upstream: tuple[str, ...] = ()) -> list[str]:
    """What differs between the parameters a stage directory was made with and this run's, one line
    per setting. A setting of an upstream directory (a `fingerprint`) is named through the chain of
    directories it reaches this one by ("its input tokens > sentences > extracted was remade: ...")."""

    def said(text: str) -> str:
        return f"its input {' > '.join(upstream)} was remade: {text}" if upstream else text

    if not (isinstance(then, dict) and isinstance(now, dict)):
        return [said(f"made with {_show(then)}, now {_show(now)}")]
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


def completed(stage_dir: Path, params: dict[str, Any]) -> dict[str, Any] | None:
    """The stored summary when `stage_dir` is complete for `params`, else None.

    Raises StageConflict when the directory holds output made with other parameters.
    """
    params = _normalise(params)
    for name in (COMPLETE_FILE, PARAMS_FILE):
        path = stage_dir / name
        if not path.is_file():
            continue
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise PipelineError(f"{path} is unreadable ({exc}); delete {stage_dir} to redo this stage") from exc
        if stored.get("params") != params:
            raise StageConflict(stage_dir, f"{stage_dir} holds output made with other settings:\n  "
                                           + "\n  ".join(differences(stored.get("params"), params)))
        if name == COMPLETE_FILE:
            return stored["summary"]
    return None


def begin(stage_dir: Path, params: dict[str, Any]) -> dict[str, Any] | None:
    """Start (or resume) a stage. Returns the stored summary if it is already complete."""
    summary = completed(stage_dir, params)
    if summary is not None:
        return summary
    make_dir(stage_dir)
    # Temporaries left by a killed run are incomplete by construction; their final names are
    # written again by this run.
    for leftover in sorted(stage_dir.rglob(".*.tmp-*")):
        _remove(leftover)
    if not (stage_dir / PARAMS_FILE).is_file():
        try:
            write_json_atomic(stage_dir / PARAMS_FILE, {"params": _normalise(params)})
        except OSError as exc:
            raise PipelineError(f"{stage_dir}: cannot write there ({exc.strerror}); pass a directory you can "
                                "write to") from exc
    return None


def finish(stage_dir: Path, params: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    write_json_atomic(stage_dir / COMPLETE_FILE, {"params": _normalise(params), "summary": summary})
    return summary


def cli_call(fn: Callable[[Any], Any], cfg: Any) -> Any:
    """Run a stage from its CLI: a PipelineError becomes a one-line message and exit status 1, Ctrl-C
    a line saying how to go on and exit status 130, instead of a traceback."""
    try:
        return fn(cfg)
    except PipelineError as exc:
        raise SystemExit(f"error: {exc}") from exc
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to continue where it stopped", file=sys.stderr)
        raise SystemExit(130) from None


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


def file_sha1(path: Path) -> str:
    """The sha1 of a small file read whole (a vocab); dumps are known by `file_identity`."""
    return hashlib.sha1(path.read_bytes()).hexdigest()


def fingerprint(stage_dir: Path) -> dict[str, Any]:
    """Identifies a complete upstream stage's output: the sha1 of its completion record (parameters and
    summary), with its parameters, so that a downstream stage refused for it can say which of them differ."""
    path = stage_dir / COMPLETE_FILE
    if not path.is_file():
        raise PipelineError(f"{stage_dir} is not complete (no {COMPLETE_FILE}); run the stage that writes it first")
    record = json.loads(path.read_text(encoding="utf-8"))
    record["summary"].pop("seconds", None)  # a redo with the same result has the same fingerprint
    return {"sha1": hashlib.sha1(json.dumps(record, sort_keys=True).encode()).hexdigest(), "params": record["params"]}
