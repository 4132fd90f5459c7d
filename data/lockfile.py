"""An exclusive lock file: one process at a time holds `path`, and a second is refused at once.

Used for a stage directory (`data.stage`), a download (`data.download`) and a training run's
--output_dir (`run_pretraining`). The file holds the holder's record, "host <name> pid <pid>".

POSIX record locks (`fcntl.lockf`), not `flock`. An flock belongs to the open file description, which
a forked child shares (as it does Linux's open-file-description locks, F_OFD_SETLK): a stage's pool
worker or a DataLoader worker forked while the lock is held keeps it held after its parent has
released it, or been killed, until that child ends too. A POSIX lock belongs to the process: the
kernel drops it when the process dies, and a forked child holds none. Its two pitfalls are handled
here: a second lock of the same file by the same process would succeed (so `acquire` refuses one
that this process holds, from the locks it keeps in `_held`), and closing any descriptor of the file
drops the process's lock on it (so the holder never opens the file again; it is read only by
processes that do not hold it). POSIX locks also work on NFS, where Linux emulates an flock with one.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import socket
from pathlib import Path


class Busy(Exception):
    """Another process holds the lock; `record` is what it wrote in the file ('' until it has)."""

    def __init__(self, record: str):
        super().__init__(record)
        self.record = record

    @property
    def pid(self) -> int | None:
        found = re.search(r"\bpid (\d+)", self.record)
        return int(found.group(1)) if found else None


class NoLocks(OSError):
    """The file system takes no POSIX locks (Lustre mounted without -o flock, NFS without a lock daemon)."""


class Held:
    """The lock on `path`, held through the open descriptor `fd` until `release`."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd, self.pid = path, fd, os.getpid()
        stat = os.fstat(fd)
        self.key = (stat.st_dev, stat.st_ino)

    def release(self, remove: bool = True) -> None:
        """Unlock, removing the file first if `remove`: a process that opened it before the removal
        and locks it after finds that it is gone (see `acquire`)."""
        _held.pop(self.key, None)
        if remove and _same_file(self.fd, self.path):
            self.path.unlink(missing_ok=True)  # else gone already, or another file now: not ours to remove
        os.close(self.fd)


_held: dict[tuple[int, int], Held] = {}  # this process's locks, by the device and inode of their file


def held(path: Path) -> Held | None:
    """The lock this process holds on `path`, if it does."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    lock = _held.get((stat.st_dev, stat.st_ino))
    return lock if lock is not None and lock.pid == os.getpid() else None  # not a forked child's copy


def acquire(path: Path) -> Held:
    """Lock `path` (created if missing) and write this process's record into it, or raise `Busy` at
    once when another process, or this one, holds it; `NoLocks` where the file system has none; and
    the OSError of the file's opening or of the record's write (which names `path`)."""
    if held(path):
        raise Busy(_record())
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                raise Busy(_read(path)) from exc
            raise NoLocks(exc.errno, exc.strerror, str(path)) from exc
        if _same_file(fd, path):
            break
        # The holder removed the file between our open and our lock: a newcomer may hold the new
        # file at that path by now, so lock that one.
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{_record()}\n".encode())
    except OSError as exc:  # a full disk: named, as the write's error names no file
        os.close(fd)
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    lock = Held(path, fd)
    _held[lock.key] = lock
    return lock


def remove_stale(path: Path) -> None:
    """Remove the lock file a killed holder left, unless a process holds it (its holder removes it)."""
    if held(path):
        return  # locking it again would succeed, and closing that descriptor drop this process's lock
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return  # none (the usual case), or not writable here
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if _same_file(fd, path):
            path.unlink(missing_ok=True)  # before the lock is released, as `release` does
    except OSError:
        pass  # held, or not removable here: left as it is
    finally:
        os.close(fd)


def _record() -> str:
    return f"host {socket.gethostname()} pid {os.getpid()}"


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False
