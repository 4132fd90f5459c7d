"""data.lockfile: the one exclusive lock of the stage directories, the download and the training run, with
real processes contending for it."""

from __future__ import annotations

import errno
import fcntl
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from data import lockfile

# A process that takes the lock as data.lockfile does, says "held" (or "busy <record>"), and on "release" or
# "keep" from its stdin releases it, removing the file or keeping it, and says "released".
_HOLDER = """
import sys
from pathlib import Path
from data import lockfile
try:
    lock = lockfile.acquire(Path(sys.argv[1]))
except lockfile.Busy as exc:
    print("busy", exc.record, flush=True)
    sys.exit()
print("held", flush=True)
for line in sys.stdin:
    lock.release(remove=line == "release\\n")
    print("released", flush=True)
"""


def _holder(path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _tell(proc: subprocess.Popen, line: str | None) -> str:
    """Send `line` (none: close its stdin, so that it ends) and return what it answers."""
    if line is None:
        proc.stdin.close()
    else:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
    return proc.stdout.readline()


def _end(proc: subprocess.Popen) -> None:
    if proc.stdin and not proc.stdin.closed:
        proc.stdin.close()
    proc.wait(timeout=60)
    proc.stdout.close()


def _record(pid: int) -> str:
    return f"host {socket.gethostname()} pid {pid}"


def test_a_second_process_is_refused_while_one_holds_the_lock_and_names_it(tmp_path):
    path = tmp_path / "lock"
    a = _holder(path)
    try:
        assert a.stdout.readline() == "held\n"
        assert path.read_text() == _record(a.pid) + "\n"  # the holder's record
        with pytest.raises(lockfile.Busy) as exc:
            lockfile.acquire(path)
        assert (exc.value.record, exc.value.pid) == (_record(a.pid), a.pid)
        b = _holder(path)
        assert b.stdout.readline() == f"busy {_record(a.pid)}\n"
        _end(b)
        assert _tell(a, "release") == "released\n"
        assert not path.exists()  # removed before it was released
    finally:
        _end(a)
    lock = lockfile.acquire(path)  # free again
    assert path.read_text() == _record(os.getpid()) + "\n"
    lock.release()
    assert not path.exists()


def test_a_lock_released_with_its_file_kept_is_free_and_its_file_is_used_again(tmp_path):
    path = tmp_path / "lock"
    a = _holder(path)
    try:
        assert a.stdout.readline() == "held\n"
        assert _tell(a, "keep") == "released\n"
    finally:
        _end(a)
    assert path.read_text() == _record(a.pid) + "\n"  # kept, with the record of a holder that has gone
    lock = lockfile.acquire(path)
    assert path.read_text() == _record(os.getpid()) + "\n"  # the new holder's, not appended
    lock.release(remove=False)
    assert path.is_file() and lockfile.held(path) is None


def test_a_lock_is_released_when_its_holder_is_killed(tmp_path):
    path = tmp_path / "lock"
    a = _holder(path)
    try:
        assert a.stdout.readline() == "held\n"
        os.kill(a.pid, signal.SIGKILL)
        assert a.wait(timeout=60) == -signal.SIGKILL
    finally:
        _end(a)
    assert path.is_file()  # left by the killed holder
    lock = lockfile.acquire(path)
    lock.release()


def test_the_stale_file_of_a_killed_holder_is_removed_but_not_a_held_one(tmp_path):
    path = tmp_path / "lock"
    lockfile.remove_stale(path)  # none: nothing to do
    a = _holder(path)
    try:
        assert a.stdout.readline() == "held\n"
        lockfile.remove_stale(path)
        assert path.read_text() == _record(a.pid) + "\n"  # held by a: left for a to remove
        os.kill(a.pid, signal.SIGKILL)
        a.wait(timeout=60)
    finally:
        _end(a)
    lockfile.remove_stale(path)
    assert not path.exists()
    lock = lockfile.acquire(path)
    lockfile.remove_stale(path)  # held by this process: locking it again would succeed and drop the lock
    assert path.is_file()
    b = _holder(path)
    assert b.stdout.readline() == f"busy {_record(os.getpid())}\n"
    _end(b)
    lock.release()


def test_the_lock_holds_when_its_holder_removes_the_file_between_a_newcomers_open_and_lock(tmp_path, monkeypatch):
    """A opens and locks; B opens the same file; A finishes (removes the file, then unlocks); B locks
    the removed file. B must then lock the file at the path, so that C, who creates a new one, is refused."""
    path = tmp_path / "lock"
    a = _holder(path)
    assert a.stdout.readline() == "held\n"
    real_lockf, calls = fcntl.lockf, []

    def lockf_after_the_holder_finishes(fd, operation):
        if not calls:  # B (this process) has opened the file A holds: A finishes now
            assert _tell(a, "release") == "released\n"
        calls.append(os.fstat(fd).st_ino)
        return real_lockf(fd, operation)

    try:
        monkeypatch.setattr(fcntl, "lockf", lockf_after_the_holder_finishes)
        b = lockfile.acquire(path)
        monkeypatch.setattr(fcntl, "lockf", real_lockf)
    finally:
        _end(a)
    assert len(calls) == 2 and calls[1] == path.stat().st_ino  # the removed file, then the one at the path
    c = _holder(path)
    assert c.stdout.readline() == f"busy {_record(os.getpid())}\n"
    _end(c)
    b.release()
    assert not path.exists()


def test_a_forked_child_holds_no_lock_and_does_not_keep_its_parents(tmp_path):
    """The reason for POSIX locks over flock: a child forked while the lock is held (a stage's pool worker, a
    DataLoader worker) and alive after its parent released it does not keep it held."""
    path = tmp_path / "lock"
    lock = lockfile.acquire(path)
    context = multiprocessing.get_context("fork")
    ready, stop = context.Event(), context.Event()
    answers = context.Queue()

    def child():
        answers.put(lockfile.held(path) is None)  # the parent's lock, seen from the child
        try:
            lockfile.acquire(path)
            answers.put("acquired")
        except lockfile.Busy as exc:
            answers.put(exc.record)
        ready.set()
        stop.wait(60)

    worker = context.Process(target=child)
    worker.start()
    try:
        assert ready.wait(60)
        assert answers.get(timeout=10) is True
        assert answers.get(timeout=10) == _record(os.getpid())  # refused: another process holds it
        lock.release(remove=False)  # with the child alive, holding a copy of the descriptor
        a = _holder(path)
        assert a.stdout.readline() == "held\n"
        _end(a)
    finally:
        stop.set()
        worker.join(60)


def test_this_process_cannot_take_a_lock_it_holds_twice(tmp_path):
    """A second POSIX lock of the same file by the same process would succeed, and releasing either would
    drop both."""
    path = tmp_path / "lock"
    lock = lockfile.acquire(path)
    with pytest.raises(lockfile.Busy) as exc:
        lockfile.acquire(path)
    assert exc.value.pid == os.getpid()
    assert lockfile.held(path) is lock
    lock.release()
    assert lockfile.held(path) is None


def test_a_file_system_without_locks_is_its_own_error(tmp_path, monkeypatch):
    """Lustre mounted without -o flock answers ENOSYS; the stage refuses, the training run warns."""
    def no_locks(fd, operation):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    with pytest.raises(lockfile.NoLocks) as exc:
        lockfile.acquire(tmp_path / "lock")
    assert exc.value.errno == errno.ENOSYS and exc.value.filename == str(tmp_path / "lock")
    assert lockfile.held(tmp_path / "lock") is None


def test_the_stage_and_the_download_refuse_and_the_training_run_warns_without_locks(tmp_path, monkeypatch, capsys):
    from data import stage
    from data.download import DownloadConfig, download
    from run_pretraining import RUN_LOCK, _try_lock

    def no_locks(fd, operation):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    with pytest.raises(stage.PipelineError, match=rf"_LOCK cannot be locked \({os.strerror(errno.ENOSYS)}\); put "
                                                  "the output on a file system that supports POSIX locks"):
        stage.begin(tmp_path / "stage", {"input": "x"})
    # (locked before any request: the address takes no connection)
    with pytest.raises(stage.PipelineError, match=rf"\.dump\.xml\.bz2\.lock cannot be locked \({os.strerror(errno.ENOSYS)}\); "
                                                  "put the output on a file system that supports POSIX locks"):
        download(DownloadConfig("http://127.0.0.1:9/dump.xml.bz2", tmp_path / "download", retries=0))
    assert _try_lock(tmp_path / "run" / RUN_LOCK) == (None, None)
    assert capsys.readouterr().err == (f"warning: cannot lock {tmp_path / 'run' / RUN_LOCK} "
                                       f"({os.strerror(errno.ENOSYS)}); make sure no other run uses this "
                                       "--output_dir\n")


def test_the_training_runs_lock_keeps_its_file_and_names_its_holder(tmp_path):
    from run_pretraining import RUN_LOCK, _try_lock

    path = tmp_path / "run" / RUN_LOCK
    path.parent.mkdir()
    a = _holder(path)
    try:
        assert a.stdout.readline() == "held\n"
        assert _try_lock(path) == (None, f"--output_dir {path.parent} is in use by another run ({_record(a.pid)}, "
                                         f"holding {path}); wait for it to end, or pass another --output_dir")
    finally:
        _end(a)
    lock, error = _try_lock(path)
    assert error is None and lockfile.held(path) is lock
    lock.release(remove=False)
    assert path.read_text() == _record(os.getpid()) + "\n"


def test_the_record_replaces_a_longer_one_left_in_the_file(tmp_path):
    path = tmp_path / "lock"
    path.write_text(f"host {'a-very-long-host-name.' * 4} pid 4294967295 and more\n")
    lock = lockfile.acquire(path)
    assert path.read_text() == _record(os.getpid()) + "\n"
    lock.release()


def test_a_release_does_not_remove_another_holders_file_at_the_path(tmp_path):
    """The file was removed under the holder (by hand, say) and another process locked a new one there: the
    first holder's release leaves that one, whose lock still keeps a third process out."""
    path = tmp_path / "lock"
    lock = lockfile.acquire(path)
    path.unlink()
    b = _holder(path)
    try:
        assert b.stdout.readline() == "held\n"
        lock.release()
        assert path.read_text() == _record(b.pid) + "\n"
        c = _holder(path)
        assert c.stdout.readline() == f"busy {_record(b.pid)}\n"
        _end(c)
    finally:
        _end(b)


def test_a_stale_check_that_races_a_new_holder_leaves_its_file(tmp_path, monkeypatch):
    """remove_stale opens the file A holds; A finishes (removes it, unlocks) and B locks a new file at the path;
    remove_stale then locks the removed file, which is not the one at the path: B's is left."""
    path = tmp_path / "lock"
    a = _holder(path)
    assert a.stdout.readline() == "held\n"
    real_lockf, holders = fcntl.lockf, []

    def lockf_after_a_new_holder_took_the_path(fd, operation):
        assert _tell(a, "release") == "released\n"
        holders.append(_holder(path))
        assert holders[0].stdout.readline() == "held\n"
        return real_lockf(fd, operation)

    try:
        monkeypatch.setattr(fcntl, "lockf", lockf_after_a_new_holder_took_the_path)
        lockfile.remove_stale(path)
        monkeypatch.setattr(fcntl, "lockf", real_lockf)
        assert path.read_text() == _record(holders[0].pid) + "\n"
    finally:
        _end(a)
        for b in holders:
            _end(b)


def test_a_failed_record_write_names_the_file_and_leaves_the_lock_free(tmp_path, monkeypatch):
    path = tmp_path / "lock"

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as exc:
        lockfile.acquire(path)
    monkeypatch.undo()
    assert (exc.value.errno, exc.value.filename) == (errno.ENOSPC, str(path))
    assert lockfile.held(path) is None
    a = _holder(path)  # no descriptor of this process keeps it locked
    try:
        assert a.stdout.readline() == "held\n"
    finally:
        _end(a)



def test_the_training_runs_lock_that_cannot_be_taken_is_an_error_for_every_rank(tmp_path):
    """_try_lock runs on rank 0 alone, before the broadcast of its error: an OSError raised there (a directory
    at .run.lock, an unwritable --output_dir) left the other ranks waiting in the broadcast, and rank 0 with a
    traceback. It is returned as the error instead."""
    from run_pretraining import RUN_LOCK, _try_lock

    path = tmp_path / "run" / RUN_LOCK
    path.mkdir(parents=True)
    lock, error = _try_lock(path)
    assert lock is None and error == (f"cannot lock {path} ({os.strerror(errno.EISDIR)}); make --output_dir "
                                      f"{path.parent} writable (or free space there), or pass another --output_dir")


def test_a_newcomer_that_locks_while_the_holder_releases_keeps_the_file_at_the_path(tmp_path, monkeypatch):
    """The file is removed before its lock is given up: unlocked first, a newcomer could lock the file that is
    then removed, and a third process lock a new one at the path while the newcomer still held its own."""
    path = tmp_path / "lock"
    lock = lockfile.acquire(path)
    close, procs = os.close, []

    def close_then_a_newcomer_locks(fd):
        close(fd)
        if fd == lock.fd:
            monkeypatch.setattr(os, "close", close)  # once: the newcomer's pipes may reuse the number
            procs.append(_holder(path))
            assert procs[0].stdout.readline() == "held\n"

    monkeypatch.setattr(os, "close", close_then_a_newcomer_locks)
    try:
        lock.release()
        assert len(procs) == 1
        procs.append(_holder(path))
        assert procs[1].stdout.readline().startswith("busy ")  # the newcomer holds the file at the path
    finally:
        for proc in procs:
            _end(proc)


def test_a_lock_refused_with_eacces_is_busy(tmp_path, monkeypatch):
    """POSIX lets a held lock be answered with EACCES as well as EAGAIN (Linux answers EAGAIN)."""
    (tmp_path / "lock").write_text("host h pid 42\n")

    def held_elsewhere(fd, operation):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(fcntl, "lockf", held_elsewhere)
    with pytest.raises(lockfile.Busy) as exc:
        lockfile.acquire(tmp_path / "lock")
    assert exc.value.pid == 42
