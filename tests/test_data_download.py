"""data.download against a local HTTP server on 127.0.0.1 serving the real sample dump."""

from __future__ import annotations

import hashlib
import http.server
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from data.download import DownloadConfig, download, dump_url
from data.stage import PipelineError

DATE = "20241201"
NAME = f"enwiki-{DATE}-pages-articles.xml.bz2"


@dataclass
class Site:
    """What the server serves, and what it saw."""

    files: dict[str, bytes]
    cut_after: int = 0  # the next `cuts` dump responses stop after this many body bytes
    cuts: int = 0
    requests: list[tuple[str, str | None]] = field(default_factory=list)


def _handler(site: Site):
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            rng = self.headers.get("Range")
            site.requests.append((self.path, rng))
            body = site.files.get(self.path)
            if body is None:
                self.send_error(404)
                return
            start = int(rng.removeprefix("bytes=").split("-")[0]) if rng else 0
            if start >= len(body):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(body)}")
                self.end_headers()
                return
            self.send_response(206 if rng else 200)
            if rng:
                self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
            self.send_header("Content-Length", str(len(body) - start))
            self.end_headers()
            payload = body[start:]
            if site.cuts and self.path.endswith(".bz2"):
                site.cuts -= 1
                payload = payload[:site.cut_after]
                self.close_connection = True
            self.wfile.write(payload)

    return Handler


@pytest.fixture
def server(sample_dump) -> Iterator[tuple[str, Site]]:
    data = sample_dump.read_bytes()
    sha1 = hashlib.sha1(data).hexdigest()
    site = Site({
        f"/enwiki/{DATE}/{NAME}": data,
        f"/enwiki/{DATE}/enwiki-{DATE}-sha1sums.txt":
            f"{'0' * 40}  enwiki-{DATE}-stub-articles.xml.gz\n{sha1}  {NAME}\n".encode(),
    })
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(site))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", site
    finally:
        httpd.shutdown()
        httpd.server_close()


def _cfg(mirror: str, out: Path, **kw) -> DownloadConfig:
    return DownloadConfig(dump_url(mirror, DATE), out, backoff_s=0.01, timeout_s=10, **kw)


def test_interrupted_transfer_resumes_with_range_and_verifies(server, sample_dump, tmp_path):
    mirror, site = server
    site.cut_after, site.cuts = 400_000, 2
    path = download(_cfg(mirror, tmp_path, retries=3))
    assert path == tmp_path / NAME
    assert path.read_bytes() == sample_dump.read_bytes()
    assert not (tmp_path / f"{NAME}.part").exists()
    dump_requests = [r for p, r in site.requests if p.endswith(".bz2")]
    assert dump_requests == [None, "bytes=400000-", "bytes=800000-"]
    # A second call finds the verified file and downloads nothing.
    site.requests.clear()
    assert download(_cfg(mirror, tmp_path)) == path and site.requests == []


def test_partial_file_from_an_earlier_run_is_resumed(server, sample_dump, tmp_path):
    mirror, site = server
    data = sample_dump.read_bytes()
    (tmp_path / f"{NAME}.part").write_bytes(data[:123_456])
    assert download(_cfg(mirror, tmp_path)).read_bytes() == data
    assert [r for p, r in site.requests if p.endswith(".bz2")] == ["bytes=123456-"]


def test_too_many_interruptions_fail_clearly_and_keep_the_partial_file(server, tmp_path):
    mirror, site = server
    site.cut_after, site.cuts = 100_000, 5
    with pytest.raises(PipelineError, match="after 2 attempts.*rerun to resume from the 200000 bytes"):
        download(_cfg(mirror, tmp_path, retries=1))
    assert not (tmp_path / NAME).exists()
    assert (tmp_path / f"{NAME}.part").stat().st_size == 200_000


def test_404_is_a_clear_error_and_leaves_no_file(server, tmp_path):
    mirror, _ = server
    cfg = DownloadConfig(dump_url(mirror, "20000101"), tmp_path, backoff_s=0.01)
    with pytest.raises(PipelineError, match="HTTP 404, no such dump"):
        download(cfg)
    assert list(tmp_path.iterdir()) == []


def test_checksum_mismatch_fails_and_leaves_no_file(server, tmp_path):
    mirror, site = server
    sums = f"/enwiki/{DATE}/enwiki-{DATE}-sha1sums.txt"
    site.files[sums] = f"{'f' * 40}  {NAME}\n".encode()
    with pytest.raises(PipelineError, match="sha1 checksum mismatch"):
        download(_cfg(mirror, tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_md5sums_are_used_when_there_is_no_sha1sums_file(server, sample_dump, tmp_path):
    mirror, site = server
    del site.files[f"/enwiki/{DATE}/enwiki-{DATE}-sha1sums.txt"]
    site.files[f"/enwiki/{DATE}/enwiki-{DATE}-md5sums.txt"] = f"{'0' * 32}  {NAME}\n".encode()
    with pytest.raises(PipelineError, match="md5 checksum mismatch"):
        download(_cfg(mirror, tmp_path))
    site.files[f"/enwiki/{DATE}/enwiki-{DATE}-md5sums.txt"] = (
        f"{hashlib.md5(sample_dump.read_bytes()).hexdigest()}  {NAME}\n".encode())
    assert download(_cfg(mirror, tmp_path)).read_bytes() == sample_dump.read_bytes()


def test_dump_url_pins_a_date_and_rejects_a_bad_one():
    assert dump_url("https://dumps.wikimedia.org/", DATE) == (
        f"https://dumps.wikimedia.org/enwiki/{DATE}/enwiki-{DATE}-pages-articles.xml.bz2")
    with pytest.raises(PipelineError, match="not YYYYMMDD"):
        dump_url("https://dumps.wikimedia.org", "latest")
