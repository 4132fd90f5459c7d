"""An ordered parallel map that never holds more than a fixed number of tasks in memory.

`multiprocessing.Pool.imap` drains its input iterator as fast as it can, so a generator over a
90 GB dump would be read into memory ahead of the workers. Here at most `2 * workers` tasks are
submitted at once; the producer waits for the oldest before it reads more input. When the number
of items is known (a list), no more workers are started than there are items.
"""

from __future__ import annotations

import collections
import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator, Sized
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

from data.stage import PipelineError

T = TypeVar("T")
R = TypeVar("R")


def bounded_map(fn: Callable[[T], R], items: Iterable[T], workers: int) -> Iterator[R]:
    """Yield fn(item) for each item, in input order. workers <= 1 runs in this process. A worker that dies (a
    signal: the out-of-memory killer, kill -9) is a PipelineError. Ctrl-C, or a caller that drops the generator,
    stops the workers at once; a task's error lets the tasks already handed to the workers end first."""
    if isinstance(items, Sized):
        workers = min(workers, len(items))  # with fork, every worker is started, busy or not
    if workers <= 1:
        for item in items:
            yield fn(item)
        return
    # fork: workers inherit the imported modules, so there is no per-worker start-up import cost.
    ctx = multiprocessing.get_context("fork")
    pending: collections.deque[Future[R]] = collections.deque()
    others = set(multiprocessing.active_children())
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_die_with, initargs=(os.getpid(),))
    try:
        # With fork, the first submit starts every worker. Do it before `items` is first read: a
        # producer may start threads (the dump read-ahead does), and forking while a thread holds
        # a lock can deadlock the child.
        pool.submit(os.getpid).result()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool as exc:
        raise PipelineError(
            "a worker process of this stage died (killed by a signal: the out-of-memory killer, or kill); rerun "
            "the same command to continue where it stopped, with fewer --workers if memory ran out") from exc
    except (KeyboardInterrupt, GeneratorExit):  # Ctrl-C here, or in the caller, which then drops this generator
        _stop_workers(others)
        raise
    finally:
        try:
            # After a task's error: the tasks handed to the workers end first (one that fails removes its temporary
            # files); a no-op for workers stopped above. The executor hands a worker's next task over while it runs
            # the last, so cancel_futures drops few: up to 2 x workers - 1 tasks may still run after the error.
            pool.shutdown(wait=True, cancel_futures=True)
        except KeyboardInterrupt:
            _stop_workers(others)
            raise


def _stop_workers(others: set) -> None:
    """Ctrl-C, or a caller that stopped reading: stop this process's workers (its children but `others`) at once.
    Their tasks write only temporary files, which the rerun removes; waited for, a second Ctrl-C hung the pool's
    shutdown until a third."""
    for worker in set(multiprocessing.active_children()) - others:
        worker.kill()


_PR_SET_PDEATHSIG = 1


def _die_with(parent: int) -> None:
    """Have this worker killed when `parent` dies. A parent killed alone (SIGKILL to its pid, the
    OOM killer) otherwise leaves its workers blocked on their queues for good, holding their memory.
    Ctrl-C is the parent's alone (it stops the workers): a terminal sends it to the whole process group,
    and a worker it interrupted while sending a result left the pool's pipe half-written, the parent
    waiting on it for good (found by an audit, twice in 230 tries)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)
