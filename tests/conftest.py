"""Shared fixtures: the real inputs in ../shared/data and a distributed environment for in-process DeepSpeed."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import multiprocessing
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

# DeepSpeed picks the CPU accelerator here; say so, so it does not warn on every import.
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _shared_file(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: the tests read real inputs from ../shared/data beside the checkout")
    return path


@pytest.fixture(scope="session")
def sample_dump() -> Path:
    """A real, shortened English Wikipedia dump (206 pages)."""
    return _shared_file("enwiki-sample-pages-articles.xml.bz2")


@pytest.fixture(scope="session")
def bert_vocab() -> Path:
    """The standard 30,522-token BERT uncased vocabulary."""
    return _shared_file("bert-base-uncased-vocab.txt")


_HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.write(fd, sys.argv[2].encode())
print("held", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def lock_held_elsewhere(path: Path, record: str = "") -> Iterator[subprocess.Popen]:
    """`path` locked by another process, as data.lockfile locks it (a POSIX lock: one this process took
    would not keep this process out), with `record` written in it, while the block runs. The file stays."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(path), record], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
        holder.stdout.close()


# --- data pipeline fixtures (owned by the data pipeline; see docs/DATA.md) ---

@pytest.fixture(scope="session")
def phase1_shards(tmp_path_factory, sample_dump, bert_vocab) -> Path:
    """`python -m data.prepare` output on the real sample dump: seq 128, 20 predictions, static masks.

    <dir>/vocab.txt, <dir>/hdf5/training/wikicorpus_en_training_{0,1}.hdf5 and
    <dir>/hdf5/test/wikicorpus_en_test_0.hdf5. masked_lm_ids 0 marks padding slots.
    """
    from data.prepare import PrepareConfig, prepare

    out = tmp_path_factory.mktemp("phase1_shards")
    prepare(PrepareConfig(input=sample_dump, output_dir=out, vocab_file=bert_vocab, max_seq_length=128,
                          max_predictions_per_seq=20, dupe_factor=2, num_shards=2, num_test_shards=1,
                          seed=12345, workers=2, test_fraction=0.1, articles_per_part=40))
    return out


@pytest.fixture(scope="session")
def dynamic_shards(tmp_path_factory, phase1_shards, sample_dump, bert_vocab) -> Path:
    """As phase1_shards but without static masks (no masked_lm_* keys; attribute masking="dynamic").

    Reuses phase1_shards' extracted, segmented and tokenized text (the shared --text_dir).
    """
    from data.prepare import PrepareConfig, prepare

    out = tmp_path_factory.mktemp("dynamic_shards")
    prepare(PrepareConfig(input=sample_dump, output_dir=out, vocab_file=bert_vocab,
                          max_seq_length=128, max_predictions_per_seq=20, dupe_factor=2, num_shards=2,
                          num_test_shards=1, seed=12345, workers=2, test_fraction=0.1, articles_per_part=40,
                          static_masking=False, text_dir=phase1_shards / "text"))
    return out


@dataclass
class MirrorSite:
    """What the local dump mirror serves (path -> bytes), its fault injection, and the requests it saw."""

    files: dict[str, bytes]
    cut_after: int = 0  # the next `cuts` responses for a .bz2 file stop after this many body bytes
    cuts: int = 0
    cut_by: str = "close"  # how they stop: "close" the connection, "reset" it (RST), or "stall" (keep it open)
    statuses: dict[str, list[int]] = field(default_factory=dict)  # path -> statuses its next requests get, in turn
    retry_after: str | None = None  # the Retry-After header sent with those statuses
    range_starts: list[int] = field(default_factory=list)  # the next ranged answers start here, not where asked
    no_length: bool = False  # send no Content-Length: a body ends when the connection closes (HTTP/1.0)
    ignore_range: bool = False  # answer every request with 200 and the whole file
    validators: bool = False  # send ETag (the body's sha1) and Last-Modified, and honour If-Range
    weak_etag: bool = False  # the ETag is weak (W/"..."), which If-Range may not use: it never matches there
    honour_if_range: bool = True
    cap: int = 0  # answer every request for a .bz2 file, ranged or not, with a 206 of at most this many bytes
    bad_length: bool = False  # send "Content-Length: abc" (and end the body by closing the connection)
    bare_416: bool = False  # a 416 without Content-Range (which RFC 9110 only recommends)
    range_unit: str = "bytes"  # as Content-Range spells it (case-insensitive, RFC 9110 14.1)
    requests: list[tuple[str, str | None]] = field(default_factory=list)
    if_ranges: list[str | None] = field(default_factory=list)  # the If-Range header of each request


LAST_MODIFIED = "Sun, 01 Dec 2024 00:00:00 GMT"  # what the mirror sends with validators, whatever the file


def _mirror_handler(site: MirrorSite):
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            rng = self.headers.get("Range")
            site.requests.append((self.path, rng))
            site.if_ranges.append(self.headers.get("If-Range"))
            path = self.path.split("?")[0]  # a query does not name another file
            body = site.files.get(path)
            if body is None:
                self.send_error(404)
                return
            etag = f'{"W/" if site.weak_etag else ""}"{hashlib.sha1(body).hexdigest()}"'
            if_range = self.headers.get("If-Range")
            # If-Range holds for the strong ETag of this body, or its Last-Modified date (RFC 9110 13.1.5)
            current = if_range is None or if_range == LAST_MODIFIED or (if_range == etag and not site.weak_etag)
            if rng and site.validators and site.honour_if_range and not current:
                rng = None  # the file changed since the client's bytes: it gets the whole file
            if site.statuses.get(path):
                self.send_response(site.statuses[path].pop(0))
                if site.retry_after is not None:
                    self.send_header("Retry-After", site.retry_after)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if site.ignore_range:
                rng = None
            start = int(rng.removeprefix("bytes=").split("-")[0]) if rng else 0
            if rng and site.range_starts:
                start = site.range_starts.pop(0)
            if start >= len(body):
                self.send_response(416)
                if not site.bare_416:
                    self.send_header("Content-Range", f"{site.range_unit} */{len(body)}")
                self.end_headers()
                return
            stop = min(len(body), start + site.cap) if site.cap and path.endswith(".bz2") else len(body)
            self.send_response(206 if rng or stop < len(body) else 200)
            if rng or stop < len(body):
                self.send_header("Content-Range", f"{site.range_unit} {start}-{stop - 1}/{len(body)}")
            if site.validators:
                self.send_header("ETag", etag)
                self.send_header("Last-Modified", LAST_MODIFIED)
            if site.bad_length:
                self.send_header("Content-Length", "abc")
                self.close_connection = True
            elif not site.no_length:
                self.send_header("Content-Length", str(stop - start))
            self.end_headers()
            payload = body[start:stop]
            if site.cuts and path.endswith(".bz2"):
                site.cuts -= 1
                payload = payload[:site.cut_after]
                self.close_connection = True
                if site.cut_by != "close":
                    self.wfile.write(payload)
                    time.sleep(0.2 if site.cut_by == "reset" else 5)  # a stall outlasts the client's timeout
                    if site.cut_by == "reset":  # closed with a zero linger: a RST, not a FIN
                        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        self.rfile.close()
                        self.connection.close()
                    return
            self.wfile.write(payload)

    return Handler


MIRROR_DUMP_DATE = "20241201"


def _multistream(sample_dump: Path, out: Path, pages_per_stream: int) -> Path:
    import bz2

    from data.multistream import split_pages, write_multistream

    xml = bz2.decompress(sample_dump.read_bytes())
    header, pages, footer = split_pages(xml)
    with out.open("wb") as f:
        write_multistream(f, header, pages, footer, pages_per_stream)
    assert bz2.decompress(out.read_bytes()) == xml
    return out


@pytest.fixture(scope="session")
def multistream_sample(sample_dump, tmp_path_factory) -> Path:
    """The sample dump's XML laid out as Wikimedia's pages-articles-multistream files are (bz2 streams
    of 100 pages, the header and the closing tag in streams of their own)."""
    out = tmp_path_factory.mktemp("multistream") / "enwiki-sample-pages-articles-multistream.xml.bz2"
    return _multistream(sample_dump, out, 100)


@pytest.fixture
def make_multistream(sample_dump, tmp_path):
    """make_multistream(pages_per_stream) -> the sample in that multistream layout."""
    return lambda pages_per_stream: _multistream(sample_dump, tmp_path / f"ms-{pages_per_stream}.xml.bz2",
                                                 pages_per_stream)


@pytest.fixture
def wiki_mirror(sample_dump, multistream_sample):
    """A dumps.wikimedia.org look-alike on 127.0.0.1 (HTTP Range supported) serving the real sample dump as
    /enwiki/20241201/enwiki-20241201-pages-articles.xml.bz2 and in its multistream form as
    .../enwiki-20241201-pages-articles-multistream.xml.bz2, with their enwiki-20241201-sha1sums.txt.
    Yields (base URL, MirrorSite)."""
    prefix = f"/enwiki/{MIRROR_DUMP_DATE}/enwiki-{MIRROR_DUMP_DATE}"
    files = {f"{prefix}-pages-articles.xml.bz2": sample_dump.read_bytes(),
             f"{prefix}-pages-articles-multistream.xml.bz2": multistream_sample.read_bytes()}
    sums = [f"{'0' * 40}  enwiki-{MIRROR_DUMP_DATE}-stub-articles.xml.gz"]
    sums += [f"{hashlib.sha1(data).hexdigest()}  {path.rsplit('/', 1)[1]}" for path, data in files.items()]
    site = MirrorSite({**files, f"{prefix}-sha1sums.txt": ("\n".join(sums) + "\n").encode()})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _mirror_handler(site))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", site
    finally:
        httpd.shutdown()
        httpd.server_close()


def to_reference_format(src: Path, dst: Path) -> None:
    """NVIDIA/Habana-style shard: the same keys in int64, no file attributes (so the loader checks the
    vocabulary as rows are read)."""
    import h5py

    with h5py.File(src, "r") as fin, h5py.File(dst, "w") as fout:
        for key in fin:
            fout.create_dataset(key, data=fin[key][()].astype("int64"))


def communicate_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr) once it has ended; every process is killed if one does not end in time (a
    rank that waits for a failed peer would otherwise outlive the test)."""
    try:
        return [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()  # a no-op for a process that has ended


def drain(loader) -> None:
    """Iterate a DataLoader to its end, as training does (training.loader.batches_of)."""
    from training.loader import batches_of

    for _ in batches_of(loader):
        pass


def no_workers_left() -> None:
    """The loaders' workers have stopped (multiprocessing's children of this process)."""
    assert multiprocessing.active_children() == []


def record_fsyncs(monkeypatch) -> list[tuple[str, str]]:
    """Record ("fsync", path) for every os.fsync and ("replace", destination) for every os.replace, in order
    (paths of descriptors through /proc: Linux)."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def clear_rendezvous(monkeypatch) -> None:
    """Unset the launch variables for one test. setenv first, so that monkeypatch removes what the code under
    test sets: delenv of an unset variable records nothing to undo, and the values leaked into the session."""
    from training.accelerator import RENDEZVOUS_VARIABLES

    for name in RENDEZVOUS_VARIABLES:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
