"""data.download against a local HTTP server on 127.0.0.1 serving the real sample dump."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from data.download import DownloadConfig, download, dump_url
from data.stage import PipelineError

DATE = "20241201"
NAME = f"enwiki-{DATE}-pages-articles-multistream.xml.bz2"


def _cfg(mirror: str, out: Path, **kw) -> DownloadConfig:
    return DownloadConfig(dump_url(mirror, DATE), out, backoff_s=0.01, timeout_s=10, **kw)


def test_interrupted_transfer_resumes_with_range_and_verifies(wiki_mirror, multistream_sample, tmp_path):
    mirror, site = wiki_mirror
    site.cut_after, site.cuts = 400_000, 2
    path = download(_cfg(mirror, tmp_path, retries=3))
    assert path == tmp_path / NAME
    assert path.read_bytes() == multistream_sample.read_bytes()
    assert not (tmp_path / f"{NAME}.part").exists()
    dump_requests = [r for p, r in site.requests if p.endswith(".bz2")]
    assert dump_requests == [None, "bytes=400000-", "bytes=800000-"]
    # A second call finds the verified file and downloads nothing.
    site.requests.clear()
    assert download(_cfg(mirror, tmp_path)) == path and site.requests == []


def test_partial_file_from_an_earlier_run_is_resumed(wiki_mirror, multistream_sample, tmp_path):
    mirror, site = wiki_mirror
    data = multistream_sample.read_bytes()
    (tmp_path / f"{NAME}.part").write_bytes(data[:123_456])
    assert download(_cfg(mirror, tmp_path)).read_bytes() == data
    assert [r for p, r in site.requests if p.endswith(".bz2")] == ["bytes=123456-"]


def test_too_many_interruptions_fail_clearly_and_keep_the_partial_file(wiki_mirror, tmp_path):
    mirror, site = wiki_mirror
    site.cut_after, site.cuts = 100_000, 5
    with pytest.raises(PipelineError, match="after 2 attempts.*rerun to resume from the 200000 bytes"):
        download(_cfg(mirror, tmp_path, retries=1))
    assert not (tmp_path / NAME).exists()
    assert (tmp_path / f"{NAME}.part").stat().st_size == 200_000


def test_404_is_a_clear_error_and_leaves_no_file(wiki_mirror, tmp_path):
    mirror, _ = wiki_mirror
    cfg = DownloadConfig(dump_url(mirror, "20000101"), tmp_path, backoff_s=0.01)
    with pytest.raises(PipelineError, match="HTTP 404, no such dump"):
        download(cfg)
    assert list(tmp_path.iterdir()) == []


def test_checksum_mismatch_fails_and_leaves_no_file(wiki_mirror, tmp_path):
    mirror, site = wiki_mirror
    sums = f"/enwiki/{DATE}/enwiki-{DATE}-sha1sums.txt"
    site.files[sums] = f"{'f' * 40}  {NAME}\n".encode()
    with pytest.raises(PipelineError, match="sha1 checksum mismatch"):
        download(_cfg(mirror, tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_md5sums_are_used_when_there_is_no_sha1sums_file(wiki_mirror, multistream_sample, tmp_path):
    mirror, site = wiki_mirror
    del site.files[f"/enwiki/{DATE}/enwiki-{DATE}-sha1sums.txt"]
    site.files[f"/enwiki/{DATE}/enwiki-{DATE}-md5sums.txt"] = f"{'0' * 32}  {NAME}\n".encode()
    with pytest.raises(PipelineError, match="md5 checksum mismatch"):
        download(_cfg(mirror, tmp_path))
    site.files[f"/enwiki/{DATE}/enwiki-{DATE}-md5sums.txt"] = (
        f"{hashlib.md5(multistream_sample.read_bytes()).hexdigest()}  {NAME}\n".encode())
    assert download(_cfg(mirror, tmp_path)).read_bytes() == multistream_sample.read_bytes()


def test_dump_url_pins_a_date_and_rejects_a_bad_one():
    assert dump_url("https://dumps.wikimedia.org/", DATE) == (
        f"https://dumps.wikimedia.org/enwiki/{DATE}/{NAME}")
    with pytest.raises(PipelineError, match="not YYYYMMDD"):
        dump_url("https://dumps.wikimedia.org", "latest")
