"""Write a small file so that a reader sees the old content or the new one, never a part of it.

The text goes to a unique temporary name in the same directory (nodes sharing a file system may
write the same file at once), is fsynced, then renamed over the final name. The temporary file is
opened like any other file, so it gets the user's umask, not mkstemp's 0600.
"""

from __future__ import annotations

import glob
import os
import uuid
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise named(e, path) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def named(e: OSError, path: Path) -> OSError:
    """`e` with `path` as its file name when it has none: a write that fails on a full disk says only
    "[Errno 28] No space left on device"."""
    if e.filename is not None or e.errno is None:
        return e
    return OSError(e.errno, e.strerror, str(path))  # of the errno's subclass, as `e` was


def remove_stale_temporaries(path: Path) -> None:
    """Remove the temporary files of `path` that a killed `atomic_write_text` left. Only for a file
    that no other process can be writing at the same moment (one a single rank writes)."""
    path = Path(path)
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        tmp.unlink(missing_ok=True)
