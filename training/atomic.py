"""Write a file so that a reader sees the old content or the new one, never a part of it, also after a
power loss.

The content goes to a unique temporary name in the same directory (nodes sharing a file system may
write the same file at once), is fsynced, then renamed over the final name. The temporary file is
opened like any other file, so it gets the user's umask, not mkstemp's 0600.
"""

from __future__ import annotations

import errno
import glob
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename in it) to disk, where the file system can: some refuse to fsync a
    directory (EINVAL), as PostgreSQL's fsync_fname also allows."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_tree(path: Path) -> None:
    """Flush the file `path`, or every file and directory under the directory `path`, to disk."""
    if not path.is_dir():
        fsync_file(path)
        return
    for root, _, files in os.walk(path):
        for name in files:
            fsync_file(Path(root, name))
        fsync_dir(Path(root))


def atomic_write_text(path: Path, text: str) -> Path:
    def write(tmp: Path) -> None:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)

    return _write_atomically(Path(path), write)


def atomic_copy(source: Path, path: Path) -> Path:
    """Copy the file `source` to `path`, atomically as `atomic_write_text` writes."""
    return _write_atomically(Path(path), lambda tmp: shutil.copyfile(source, tmp))


def replace_dir(new: Path, old: Path) -> None:
    """Put directory `new` in the place of `old` (which may not exist), its files flushed to disk first. A
    kill between the two renames leaves the previous directory in `.<name>.old` and no `old`: the next call
    removes it after its own swap."""
    fsync_tree(new)
    trash = old.with_name(f".{old.name}.old")
    if old.exists():
        if trash.exists():
            shutil.rmtree(trash)
        os.replace(old, trash)
    os.replace(new, old)
    fsync_dir(old.parent)
    if trash.exists():
        shutil.rmtree(trash)


def _write_atomically(path: Path, write: Callable[[Path], None]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        write(tmp)
        fsync_file(tmp)
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
