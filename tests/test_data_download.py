"""data.download against a local HTTP server on 127.0.0.1 serving the real sample dump."""

from __future__ import annotations

import bz2
import email.utils
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data.download import DownloadConfig, download, dump_url
from data.download import main as download_main
from data.stage import PipelineError
from tests.conftest import LAST_MODIFIED, lock_held_elsewhere, record_fsyncs
from training.accelerator import free_port

DATE = "20241201"
NAME = f"enwiki-{DATE}-pages-articles-multistream.xml.bz2"
RECORD = f".{NAME}.download.json"  # the download record beside the dump


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


def test_too_many_interruptions_fail_clearly_and_keep_the_partial_file(wiki_mirror, multistream_sample, tmp_path):
    mirror, site = wiki_mirror
    (tmp_path / f"{NAME}.part").write_bytes(multistream_sample.read_bytes()[:200_000])
    site.cut_after, site.cuts = 0, 5  # connections that drop before any byte
    with pytest.raises(PipelineError, match="after 2 attempts in a row without progress.*rerun to resume from the "
                                            "200000 bytes"):
        download(_cfg(mirror, tmp_path, retries=1))
    assert not (tmp_path / NAME).exists()
    assert (tmp_path / f"{NAME}.part").stat().st_size == 200_000


def test_drops_after_progress_do_not_use_up_the_retries(wiki_mirror, multistream_sample, tmp_path):
    """Retries count attempts in a row without progress: a 20 GB transfer dropped now and then over
    hours must not stop after --retries drops in all."""
    mirror, site = wiki_mirror
    site.cut_after, site.cuts = 100_000, 5
    assert download(_cfg(mirror, tmp_path, retries=1)).read_bytes() == multistream_sample.read_bytes()
    assert [r for p, r in site.requests if p == _dump_path()] == [
        None, *(f"bytes={n}-" for n in range(100_000, 600_000, 100_000))]


# Run data.download, SIGKILLed at the fsync of the directory that follows the rename into place.
_KILLED_AFTER_THE_RENAME = """
import os, signal, stat, sys
from data import download
fsync = os.fsync
final = os.path.join(sys.argv[2], download.file_name(sys.argv[1]))
def killing_fsync(fd):  # the fsync of the directory that holds the renamed dump
    if stat.S_ISDIR(os.fstat(fd).st_mode) and os.path.isfile(final):
        os.kill(os.getpid(), signal.SIGKILL)
    fsync(fd)
os.fsync = killing_fsync  # the os module training.atomic calls too
download.main(["--url", sys.argv[1], "--output_dir", sys.argv[2]])
"""


def test_a_run_killed_after_its_rename_leaves_nothing_behind_after_the_rerun(wiki_mirror, multistream_sample,
                                                                               tmp_path):
    """Killed between the rename and the removal of its lock file, a run left `.<name>.lock` for good:
    the rerun found the dump and skipped the download, lock and all."""
    mirror, _ = wiki_mirror
    proc = subprocess.run([sys.executable, "-c", _KILLED_AFTER_THE_RENAME, dump_url(mirror, DATE), str(tmp_path)],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert (tmp_path / NAME).is_file() and (tmp_path / f".{NAME}.lock").is_file()
    assert download(_cfg(mirror, tmp_path)).read_bytes() == multistream_sample.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [RECORD, NAME]


def test_a_file_downloaded_from_another_url_is_not_used_in_its_place(wiki_mirror, multistream_sample, tmp_path,
                                                                     capsys):
    """The dump was found by its name alone: another URL of the same file name (another dump directory, a
    moving "latest" name) silently got the file downloaded before. Its record says where it came from."""
    mirror, site = wiki_mirror
    data = multistream_sample.read_bytes()
    path = download(_cfg(mirror, tmp_path))
    assert json.loads((tmp_path / RECORD).read_text(encoding="utf-8")) == {
        "url": dump_url(mirror, DATE), "size": len(data), "unverified": None,
        "checksum": {"algorithm": "sha1", "digest": hashlib.sha1(data).hexdigest()}}
    site.requests.clear()
    other = f"{mirror}/b{_dump_path()}"
    with pytest.raises(PipelineError, match=rf"^{re.escape(str(path))} was downloaded from "
                                            rf"{re.escape(dump_url(mirror, DATE))}, not from {re.escape(other)}: a file "
                                            r"of the same name from another URL is not used in its place\. Download "
                                            r"into another --output_dir \(data\.prepare: another --text_dir or "
                                            rf"--output_dir\), or delete {re.escape(str(path))} to download it from "
                                            rf"{re.escape(other)} \(a copy of it put there by hand: delete its record "
                                            rf"{re.escape(RECORD)} too\)$"):
        download(DownloadConfig(other, tmp_path, backoff_s=0.01))
    # The same URL: the file is used, nothing is fetched and nothing said.
    assert download(_cfg(mirror, tmp_path)).read_bytes() == data
    assert site.requests == [] and "download record" not in capsys.readouterr().out
    # A file whose size is not the one downloaded is refused.
    with path.open("ab") as f:
        f.write(b"appended")
    with pytest.raises(PipelineError, match=rf"^{re.escape(str(path))} is {len(data) + 8} bytes, but {len(data)} were "
                                            rf"downloaded from .*\(its record {re.escape(RECORD)} says so\): the file "
                                            r"changed or is damaged since\. Delete it and rerun to download it again$"):
        download(_cfg(mirror, tmp_path))
    assert site.requests == []
    # Deleted as the error says, the file is downloaded from the other URL: the old record goes with it (it had
    # stayed, and refused every later run of either URL).
    path.unlink()
    site.files[f"/b{_dump_path()}"] = other_data = bz2.compress(data[::-1])  # another file (a bz2 one)
    assert download(DownloadConfig(other, tmp_path, backoff_s=0.01)).read_bytes() == other_data
    assert json.loads((tmp_path / RECORD).read_text(encoding="utf-8"))["url"] == other


def test_a_file_downloaded_where_no_checksum_is_published_is_not_checked_again(wiki_mirror, multistream_sample,
                                                                              tmp_path, capsys):
    """Its record says no checksum file was published: a rerun asked the mirror for the lists again, said so on
    every rerun, and failed after minutes of retries where the network was gone."""
    mirror, site = wiki_mirror
    site.files.pop(_sums_path())
    assert download(_cfg(mirror, tmp_path)).read_bytes() == multistream_sample.read_bytes()
    assert json.loads((tmp_path / RECORD).read_text(encoding="utf-8"))["unverified"] == "no checksum file published"
    site.requests.clear()
    capsys.readouterr()
    assert download(_cfg(mirror, tmp_path, retries=0)).read_bytes() == multistream_sample.read_bytes()
    assert site.requests == [] and capsys.readouterr().out == ""


def test_an_error_page_sent_for_the_dump_never_gets_its_name(wiki_mirror, tmp_path):
    """A mirror that publishes no checksum list and answers 200 with an HTML page: the page was renamed into place as
    the dump, extraction refused it, and every rerun took it as downloaded (found by an audit)."""
    mirror, site = wiki_mirror
    site.files.pop(_sums_path())
    site.files[_dump_path()] = b"<!DOCTYPE html>\n<html><body>Service unavailable</body></html>\n"
    url = dump_url(mirror, DATE)
    for _ in range(2):  # and again: nothing was kept
        with pytest.raises(PipelineError, match=rf"^{re.escape(url)}: the server sent an HTML page that {NAME} cannot "
                                                r"hold \(it begins '<!DOCTYPE html>\\n<html><body>Service unavailable"
                                                r"</body></html'\), not the file; check the URL \(or --mirror\), "
                                                "then rerun$"):
            download(_cfg(mirror, tmp_path))
        assert list(tmp_path.iterdir()) == []


def test_a_finished_download_found_truncated_says_to_delete_it(wiki_mirror, multistream_sample, tmp_path):
    """A server whose Content-Length was short, with no checksum published: the file is whole as far as anything can
    tell, until extraction finds it cut. The advice had been to rerun data.download, which took the file as done."""
    from data.extract import ExtractConfig, extract

    mirror, site = wiki_mirror
    site.files.pop(_sums_path())
    site.files[_dump_path()] = multistream_sample.read_bytes()[:len(multistream_sample.read_bytes()) // 2]
    path = download(_cfg(mirror, tmp_path))
    with pytest.raises(PipelineError, match=rf"^{re.escape(str(path))}: .*truncated\. Delete it, then rerun to download "
                                            r"it again$"):
        extract(ExtractConfig(path, tmp_path / "extracted"))
    path.unlink()  # as it says: the record goes with it, and the file is downloaded again
    site.files[_dump_path()] = multistream_sample.read_bytes()
    assert download(_cfg(mirror, tmp_path)).read_bytes() == multistream_sample.read_bytes()


@pytest.mark.parametrize("published", [False, True])
def test_a_part_file_begun_from_another_url_is_resumed_only_where_a_checksum_checks_it(
        wiki_mirror, multistream_sample, sample_dump, tmp_path, capsys, published):
    """A .part of the same file name begun from another URL took this URL's tail after its bytes: without a
    checksum list and validators nothing noticed the spliced file. The part file's validators name its URL;
    where the other URL publishes a checksum (another mirror of the same dump), the resume is checked by it."""
    mirror, site = wiki_mirror
    site.validators = True  # ETag and Last-Modified: the first mirror's would be sent as If-Range
    other = f"{mirror}/b{_dump_path()}"
    other_data = multistream_sample.read_bytes() if published else sample_dump.read_bytes()
    site.files[f"/b{_dump_path()}"] = other_data
    if published:
        site.files[f"/b{_sums_path()}"] = site.files[_sums_path()]
    site.cut_after, site.cuts = 400_000, 1
    with pytest.raises(PipelineError, match="failed after 1 attempts in a row without progress"):
        download(_cfg(mirror, tmp_path, retries=0))
    assert (tmp_path / f"{NAME}.part").stat().st_size == 400_000
    site.requests.clear()
    capsys.readouterr()
    assert download(DownloadConfig(other, tmp_path, retries=0, timeout_s=10)).read_bytes() == other_data
    # from byte 0 at once, or resumed where the first mirror stopped, without the other server's If-Range
    assert [r for p, r in site.requests if p == f"/b{_dump_path()}"] == ["bytes=400000-" if published else None]
    assert site.if_ranges[-1] is None
    said = f"was begun from {dump_url(mirror, DATE)}, and no checksum is published" in capsys.readouterr().out
    assert said != published


def test_a_whole_part_file_on_a_server_without_lengths_ends_with_one_retry(wiki_mirror, multistream_sample,
                                                                         tmp_path):
    """A part file found whole (a run killed while hashing it), a server that sends no length and a 416 without
    Content-Range, no checksum: the part file is fetched again once, then its end is confirmed. The round that
    refetched it counted a second time against --retries 1, and every rerun failed alike."""
    mirror, site = wiki_mirror
    data = multistream_sample.read_bytes()
    site.files.pop(_sums_path())
    site.no_length, site.bare_416 = True, True
    (tmp_path / f"{NAME}.part").write_bytes(data)
    assert download(_cfg(mirror, tmp_path, retries=1)).read_bytes() == data
    assert [r for p, r in site.requests if p == _dump_path()] == [f"bytes={len(data)}-", None, f"bytes={len(data)}-"]


def test_a_download_made_with_no_verify_is_verified_by_a_rerun_without_it(wiki_mirror, multistream_sample, tmp_path,
                                                                          capsys):
    mirror, site = wiki_mirror
    data = multistream_sample.read_bytes()
    path = download(_cfg(mirror, tmp_path, verify=False))
    assert json.loads((tmp_path / RECORD).read_text(encoding="utf-8"))["unverified"] == "--no_verify"
    site.requests.clear()
    capsys.readouterr()
    assert download(_cfg(mirror, tmp_path)).read_bytes() == data
    assert [p for p, _ in site.requests] == [_sums_path()]  # the list, not the dump again
    assert f"download: {path}, downloaded without the check, matches its published sha1 now" in capsys.readouterr().out
    record = json.loads((tmp_path / RECORD).read_text(encoding="utf-8"))
    assert (record["unverified"], record["checksum"]) == (None, {"algorithm": "sha1",
                                                                 "digest": hashlib.sha1(data).hexdigest()})
    site.requests.clear()
    assert download(_cfg(mirror, tmp_path)).read_bytes() == data and site.requests == []  # verified once
    # A digest that does not match: an error naming the file, which is kept aside, not deleted.
    (tmp_path / NAME).unlink()
    download(_cfg(mirror, tmp_path, verify=False))
    site.files[_sums_path()] = f"{'f' * 40}  {NAME}\n".encode()
    aside = tmp_path / f"{NAME}.sha1-{hashlib.sha1(data).hexdigest()}"
    with pytest.raises(PipelineError, match=rf"^{re.escape(str(path))} \(downloaded from "
                                            rf"{re.escape(dump_url(mirror, DATE))} without the check\): sha1 checksum "
                                            rf"mismatch \(got .*, published f{{40}}\); the download is kept as "
                                            rf"{re.escape(str(aside))}\. Rerun to download it again$"):
        download(_cfg(mirror, tmp_path))
    assert sorted(tmp_path.iterdir()) == [aside] and aside.read_bytes() == data


def test_a_file_without_a_download_record_is_used_as_it_is_with_a_line_saying_so(wiki_mirror, multistream_sample,
                                                                                 tmp_path, capsys):
    """A dump copied in by hand, or downloaded by a version that wrote no record, is used unverified (not
    fetched again, not refused), and the run says so."""
    mirror, site = wiki_mirror
    (tmp_path / NAME).write_bytes(b"copied in by hand")
    assert download(_cfg(mirror, tmp_path)).read_bytes() == b"copied in by hand"
    assert site.requests == [] and sorted(p.name for p in tmp_path.iterdir()) == [NAME]
    assert capsys.readouterr().out == (f"download: {tmp_path / NAME} was found without a download record; it is used "
                                       "as it is, unverified (delete it to download it again with the check)\n")


def test_404_is_a_clear_error_and_leaves_no_file(wiki_mirror, tmp_path, capsys):
    mirror, _ = wiki_mirror
    cfg = DownloadConfig(dump_url(mirror, "20000101"), tmp_path, backoff_s=0.01)
    with pytest.raises(PipelineError, match="HTTP 404, no such dump"):
        download(cfg)
    assert list(tmp_path.iterdir()) == []
    assert "not verified" not in capsys.readouterr().out  # no notice about a file that does not exist


def test_a_second_download_into_the_same_place_is_refused_while_one_runs(wiki_mirror, multistream_sample, tmp_path):
    mirror, site = wiki_mirror
    # a lock file a running download holds
    with lock_held_elsewhere(tmp_path / f".{NAME}.lock"), pytest.raises(
            PipelineError, match=f"another download of {NAME} into {tmp_path} is running"):
        download(_cfg(mirror, tmp_path))
    assert site.requests == []
    assert download(_cfg(mirror, tmp_path)).read_bytes() == multistream_sample.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [RECORD, NAME]


def test_checksum_mismatch_fails_and_keeps_the_bytes_aside(wiki_mirror, multistream_sample, tmp_path):
    mirror, site = wiki_mirror
    data = multistream_sample.read_bytes()
    site.files[_sums_path()] = f"{'f' * 40}  {NAME}\n".encode()
    aside = tmp_path / f"{NAME}.sha1-{hashlib.sha1(data).hexdigest()}"
    with pytest.raises(PipelineError, match=rf"sha1 checksum mismatch .*kept as {re.escape(str(aside))}\. Rerun"):
        download(_cfg(mirror, tmp_path))
    assert list(tmp_path.iterdir()) == [aside] and aside.read_bytes() == data
    # The same bytes again: the mirror's file or checksum is wrong, which another download cannot mend.
    with pytest.raises(PipelineError, match="mismatch again, with the same bytes.*Try another --mirror"):
        download(_cfg(mirror, tmp_path))
    assert list(tmp_path.iterdir()) == [aside] and aside.read_bytes() == data
    site.files[_sums_path()] = f"{hashlib.sha1(data).hexdigest()}  {NAME}\n".encode()  # the mirror mends it
    assert download(_cfg(mirror, tmp_path)).read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == [RECORD, NAME]  # the bad copy went with the good one


def test_a_body_without_a_length_is_confirmed_whole_by_a_range_request(wiki_mirror, multistream_sample, tmp_path):
    """Without Content-Length a body ends when the connection closes, as a dropped one does: a truncated
    dump without a checksum file was renamed into place and never fetched again."""
    mirror, site = wiki_mirror
    data = multistream_sample.read_bytes()
    del site.files[_sums_path()]
    site.no_length, site.cut_after, site.cuts = True, 400_000, 1
    assert download(_cfg(mirror, tmp_path)).read_bytes() == data
    # dropped at 400,000; the rest (206, with the total in Content-Range); nothing is taken on trust
    assert [r for p, r in site.requests if p == _dump_path()] == [None, "bytes=400000-"]
    (tmp_path / NAME).unlink()
    site.requests.clear()
    assert download(_cfg(mirror, tmp_path)).read_bytes() == data
    assert [r for p, r in site.requests if p == _dump_path()] == [None, f"bytes={len(data)}-"]  # 416: the end


def test_a_resumed_answer_without_a_length_cut_short_is_resumed_again(wiki_mirror, multistream_sample, tmp_path):
    """A 206 without Content-Length ends when the connection closes: its Content-Range total says whether it
    ended at the file's end or was dropped (without a checksum, nothing else would tell)."""
    mirror, site = wiki_mirror
    data = multistream_sample.read_bytes()
    del site.files[_sums_path()]
    site.no_length, site.cut_after, site.cuts = True, 400_000, 2
    assert download(_cfg(mirror, tmp_path, retries=3)).read_bytes() == data
    assert [r for p, r in site.requests if p == _dump_path()] == [None, "bytes=400000-", "bytes=800000-"]


def test_the_dump_and_its_record_reach_the_disk_before_the_dump_gets_its_name(wiki_mirror, multistream_sample,
                                                                              tmp_path, monkeypatch):
    """After a power loss, the final name must not stand for bytes never written, and a final file must never be
    left without its record (it would be taken for one put there by hand, and used unverified)."""
    mirror, _ = wiki_mirror
    events = record_fsyncs(monkeypatch)
    path = download(_cfg(mirror, tmp_path))
    assert path.read_bytes() == multistream_sample.read_bytes()
    at = {event: i for i, event in enumerate(events)}  # the last index of each
    named = at[("replace", str(path))]
    assert at[("fsync", str(tmp_path / f"{NAME}.part"))] < named
    assert at[("replace", str(tmp_path / RECORD))] < named
    assert at[("fsync", str(tmp_path))] > named


def test_an_unconfirmable_end_without_a_checksum_is_an_error(wiki_mirror, multistream_sample, tmp_path):
    mirror, site = wiki_mirror
    data = multistream_sample.read_bytes()
    sums = site.files.pop(_sums_path())
    site.no_length, site.ignore_range, site.cut_after, site.cuts = True, True, 400_000, 1
    with pytest.raises(PipelineError, match=r"no length and ignores Range requests, and no checksum file is "
                                            r"published, so the 400000 bytes in .* may be a cut-off transfer"):
        download(_cfg(mirror, tmp_path))
    # The part file, and the validators of the server's file its bytes came from (none were sent here).
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{NAME}.part.validators", f"{NAME}.part"]
    site.files[_sums_path()] = sums  # with a checksum, the digest decides
    assert download(_cfg(mirror, tmp_path)).read_bytes() == data


def test_a_checksum_file_answered_403_says_how_to_download_without_the_check(wiki_mirror, multistream_sample,
                                                                             tmp_path, capsys):
    """S3-like mirrors answer 403, not 404, for a file they do not hold: the download stopped with no way past the
    check (DownloadConfig.verify had no flag). --no_verify downloads without fetching any checksum file."""
    mirror, site = wiki_mirror
    site.statuses[_sums_path()] = [403]
    with pytest.raises(SystemExit) as exc:
        download_main(["--url", dump_url(mirror, DATE), "--output_dir", str(tmp_path)])
    assert exc.value.code == (f"error: {mirror}{_sums_path()}: HTTP 403 Forbidden while fetching the checksum file; "
                              "a mirror that publishes no checksum file may answer 403 for it (S3 does for a missing "
                              "file): then --no_verify downloads without the check")
    assert list(tmp_path.iterdir()) == []
    site.requests.clear()
    site.statuses[_sums_path()] = [403]
    download_main(["--url", dump_url(mirror, DATE), "--output_dir", str(tmp_path), "--no_verify"])
    assert (tmp_path / NAME).read_bytes() == multistream_sample.read_bytes()
    assert [p for p, _ in site.requests] == [_dump_path()]  # no checksum file asked for
    out = capsys.readouterr().out
    assert f"download: {dump_url(mirror, DATE)} is not verified (--no_verify)" in out


def test_a_checksum_list_answered_403_falls_through_to_the_next_one(wiki_mirror, multistream_sample, tmp_path):
    """A 403 for sha1sums.txt (what an S3-like mirror answers for a file it does not hold) stopped the download
    at once, where md5sums.txt would have verified it; the error is for when no list can be read."""
    mirror, site = wiki_mirror
    data = multistream_sample.read_bytes()
    site.statuses[_sums_path()] = [403]
    site.files[_md5s_path()] = f"{hashlib.md5(data).hexdigest()}  {NAME}\n".encode()
    assert download(_cfg(mirror, tmp_path)).read_bytes() == data
    assert [p for p, _ in site.requests] == [_sums_path(), _md5s_path(), _dump_path()]
    record = json.loads((tmp_path / RECORD).read_text(encoding="utf-8"))
    assert record["checksum"] == {"algorithm": "md5", "digest": hashlib.md5(data).hexdigest()}
    # Both lists answered 403: the error names both, and --no_verify.
    (tmp_path / NAME).unlink()
    site.statuses[_sums_path()], site.statuses[_md5s_path()] = [403], [403]
    with pytest.raises(PipelineError, match=rf"^{re.escape(mirror + _sums_path())}: HTTP 403 Forbidden and "
                                            rf"{re.escape(mirror + _md5s_path())}: HTTP 403 Forbidden while fetching "
                                            r"the checksum files; a mirror that publishes no checksum file may answer "
                                            r"403 for them \(S3 does for a missing file\): then --no_verify downloads "
                                            "without the check$"):
        download(_cfg(mirror, tmp_path))
    # A list that was read and does not list the file is still an error of its own.
    site.statuses[_sums_path()] = [403]
    site.files[_md5s_path()] = f"{'0' * 32}  enwiki-{DATE}-stub-articles.xml.gz\n".encode()
    with pytest.raises(PipelineError, match=rf"^{re.escape(mirror + _md5s_path())} does not list {NAME} "
                                            rf"\({re.escape(mirror + _sums_path())}: HTTP 403 Forbidden\); check "):
        download(_cfg(mirror, tmp_path))
    assert not (tmp_path / NAME).exists()


def test_prepare_downloads_without_the_check_with_no_verify_and_refuses_it_for_a_local_dump(wiki_mirror, bert_vocab,
                                                                                             sample_dump, tmp_path,
                                                                                             capsys):
    from data.prepare import main as prepare_main

    mirror, site = wiki_mirror
    with pytest.raises(SystemExit) as exc:
        prepare_main(["--input", str(sample_dump), "--no_verify", "--output_dir", str(tmp_path / "o"),
                      "--vocab_file", str(bert_vocab)])
    assert exc.value.code == 2 and not (tmp_path / "o").exists()
    assert ("error: --no_verify applies to a dump this command downloads (--dump_date or an http(s) --input); a "
            "local --input is read as it is") in capsys.readouterr().err
    site.statuses[_sums_path()] = [403]
    prepare_main(["--dump_date", DATE, "--mirror", mirror, "--no_verify", "--output_dir", str(tmp_path / "o"),
                  "--vocab_file", str(bert_vocab), "--num_shards", "2", "--workers", "1"])
    assert (tmp_path / "o" / "text" / "download" / NAME).is_file()
    assert _sums_path() not in [p for p, _ in site.requests]
    assert sorted(p.name for p in (tmp_path / "o" / "hdf5" / "training").iterdir()) == [
        "wikicorpus_en_training_0.hdf5", "wikicorpus_en_training_1.hdf5"]
    # A rerun of the same command uses the download (its record names the same URL) and fetches nothing.
    argv = ["--input", dump_url(mirror, DATE), "--output_dir", str(tmp_path / "o"), "--vocab_file", str(bert_vocab),
            "--num_shards", "2", "--workers", "1"]
    site.requests.clear()
    capsys.readouterr()
    prepare_main([*argv, "--no_verify"])
    assert site.requests == []
    assert re.search(rf"^download: .*{NAME} \(0\.00 GB\), already complete$", capsys.readouterr().out, flags=re.M)
    site.statuses.clear()  # the mirror publishes its checksum list now
    prepare_main(argv)  # without --no_verify: the download is verified now, once
    prepare_main(argv)
    assert [p for p, _ in site.requests] == [_sums_path()]


def test_only_the_newest_mismatching_download_is_kept(wiki_mirror, multistream_sample, tmp_path):
    """Each kept copy is a whole dump (22 GB): a second mismatch with other bytes replaces the first."""
    mirror, site = wiki_mirror
    data = multistream_sample.read_bytes()
    site.files[_sums_path()] = f"{'f' * 40}  {NAME}\n".encode()
    with pytest.raises(PipelineError, match="sha1 checksum mismatch"):
        download(_cfg(mirror, tmp_path))
    other = data + b"trailing bytes"  # the mirror's file changed, its checksum file did not
    site.files[_dump_path()] = other
    newest = tmp_path / f"{NAME}.sha1-{hashlib.sha1(other).hexdigest()}"
    with pytest.raises(PipelineError, match=rf"sha1 checksum mismatch \(got .*kept as {re.escape(str(newest))}\. Rerun"):
        download(_cfg(mirror, tmp_path))
    assert list(tmp_path.iterdir()) == [newest] and newest.read_bytes() == other


def test_a_checksum_line_of_sha1sum_binary_mode_in_capitals_is_read(wiki_mirror, multistream_sample, tmp_path):
    """`sha1sum -b` marks the file name with "*"; some tools write the digest in capitals."""
    mirror, site = wiki_mirror
    data = multistream_sample.read_bytes()
    site.files[_sums_path()] = f"{hashlib.sha1(data).hexdigest().upper()} *{NAME}\n".encode()
    assert download(_cfg(mirror, tmp_path)).read_bytes() == data
    assert [p for p, _ in site.requests] == [_sums_path(), _dump_path()]


def test_410_gone_is_a_clear_error_too(wiki_mirror, tmp_path):
    mirror, site = wiki_mirror
    site.statuses[_dump_path()] = [410]
    with pytest.raises(PipelineError, match="HTTP 410, no such dump"):
        download(_cfg(mirror, tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_md5sums_are_used_when_there_is_no_sha1sums_file(wiki_mirror, multistream_sample, tmp_path):
    mirror, site = wiki_mirror
    del site.files[f"/enwiki/{DATE}/enwiki-{DATE}-sha1sums.txt"]
    site.files[_md5s_path()] = f"{'0' * 32}  {NAME}\n".encode()
    with pytest.raises(PipelineError, match="md5 checksum mismatch"):
        download(_cfg(mirror, tmp_path))
    site.files[_md5s_path()] = (
        f"{hashlib.md5(multistream_sample.read_bytes()).hexdigest()}  {NAME}\n".encode())
    assert download(_cfg(mirror, tmp_path)).read_bytes() == multistream_sample.read_bytes()


def test_a_good_download_removes_the_copies_kept_by_mismatches_of_either_checksum(wiki_mirror, multistream_sample,
                                                                                tmp_path):
    mirror, site = wiki_mirror
    data = multistream_sample.read_bytes()
    site.files[_sums_path()] = f"{'f' * 40}  {NAME}\n".encode()
    with pytest.raises(PipelineError, match="sha1 checksum mismatch"):
        download(_cfg(mirror, tmp_path))
    del site.files[_sums_path()]
    site.files[_md5s_path()] = f"{'0' * 32}  {NAME}\n".encode()
    with pytest.raises(PipelineError, match="md5 checksum mismatch"):
        download(_cfg(mirror, tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{NAME}.md5-{hashlib.md5(data).hexdigest()}",
                                                          f"{NAME}.sha1-{hashlib.sha1(data).hexdigest()}"]
    del site.files[_md5s_path()]  # now nothing is published: the download is taken unverified
    assert download(_cfg(mirror, tmp_path)).read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == [RECORD, NAME]


def test_dump_url_pins_a_date_and_rejects_a_bad_one():
    assert dump_url("https://dumps.wikimedia.org/", DATE) == (
        f"https://dumps.wikimedia.org/enwiki/{DATE}/{NAME}")
    with pytest.raises(PipelineError, match="not YYYYMMDD"):
        dump_url("https://dumps.wikimedia.org", "latest")


def _sums_path() -> str:
    return f"/enwiki/{DATE}/enwiki-{DATE}-sha1sums.txt"


def _md5s_path() -> str:
    return f"/enwiki/{DATE}/enwiki-{DATE}-md5sums.txt"


def _dump_path() -> str:
    return f"/enwiki/{DATE}/{NAME}"


def test_checksum_file_is_retried_after_a_transient_failure(wiki_mirror, multistream_sample, tmp_path):
    mirror, site = wiki_mirror
    site.statuses[_sums_path()] = [503]
    assert download(_cfg(mirror, tmp_path, retries=2)).read_bytes() == multistream_sample.read_bytes()
    assert [p for p, _ in site.requests] == [_sums_path(), _sums_path(), _dump_path()]


def test_unreachable_mirror_is_a_clear_error_naming_the_url(tmp_path):
    mirror = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connection refused
    sums_url = f"{mirror}{_sums_path()}"
    with pytest.raises(PipelineError, match=rf"{re.escape(sums_url)}: failed after 2 attempts in a row without progress \(last: .*refused"):
        download(_cfg(mirror, tmp_path, retries=1))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("code", [408, 429, 503])
def test_transient_http_errors_are_retried_honouring_retry_after(wiki_mirror, multistream_sample, tmp_path, code):
    mirror, site = wiki_mirror
    site.statuses[_dump_path()], site.retry_after = [code], "1"
    waits = []
    assert download(_cfg(mirror, tmp_path, retries=1, sleep=waits.append)).read_bytes() == (
        multistream_sample.read_bytes())
    assert waits == [1.0]  # the server's Retry-After, not the 0.01 s back-off
    assert [p for p, _ in site.requests].count(_dump_path()) == 2


def test_retry_after_as_an_http_date_is_honoured(wiki_mirror, multistream_sample, tmp_path):
    """Retry-After may be an HTTP date instead of seconds (RFC 9110 10.2.3)."""
    mirror, site = wiki_mirror
    site.statuses[_dump_path()] = [503]
    site.retry_after = email.utils.formatdate(time.time() + 2, usegmt=True)  # whole seconds: 1 to 2 s from now
    waits = []
    assert download(_cfg(mirror, tmp_path, retries=1, sleep=waits.append)).read_bytes() == (
        multistream_sample.read_bytes())
    assert len(waits) == 1 and 0.8 <= waits[0] <= 2.0  # not the 0.01 s back-off
    assert [p for p, _ in site.requests].count(_dump_path()) == 2


def test_retry_after_is_bounded_and_retries_run_out(wiki_mirror, tmp_path):
    mirror, site = wiki_mirror
    site.statuses[_dump_path()], site.retry_after = [429, 429, 429], "3600"
    waits = []
    with pytest.raises(PipelineError, match=r"failed after 3 attempts in a row without progress \(last: HTTP 429 .*; rerun to try again$"):
        download(_cfg(mirror, tmp_path, retries=2, max_retry_after_s=0.2, sleep=waits.append))
    assert waits == [0.2, 0.2]


def test_416_for_a_part_file_longer_than_the_dump_restarts_from_zero(wiki_mirror, multistream_sample, tmp_path):
    mirror, site = wiki_mirror
    data = multistream_sample.read_bytes()
    (tmp_path / f"{NAME}.part").write_bytes(data + b"stale bytes of another file")
    assert download(_cfg(mirror, tmp_path)).read_bytes() == data
    assert [r for p, r in site.requests if p == _dump_path()] == [f"bytes={len(data) + 27}-", None]


def test_206_from_another_offset_restarts_from_zero(wiki_mirror, multistream_sample, tmp_path):
    mirror, site = wiki_mirror
    data = multistream_sample.read_bytes()
    for have, served_from in ((300_000, 100_000), (100_000, 300_000)):  # overlapping, then leaving a gap
        (tmp_path / f"{NAME}.part").write_bytes(data[:have])
        site.range_starts, site.requests[:] = [served_from], []
        assert download(_cfg(mirror, tmp_path)).read_bytes() == data
        assert [r for p, r in site.requests if p == _dump_path()] == [f"bytes={have}-", None]
        (tmp_path / NAME).unlink()


def test_negative_retries_are_refused(wiki_mirror, tmp_path, capsys):
    mirror, site = wiki_mirror
    with pytest.raises(PipelineError, match="retries must be >= 0"):
        download(_cfg(mirror, tmp_path, retries=-1))
    # a timeout of 0 would make every socket non-blocking; a negative wait is no wait
    for bad, message in (({"timeout_s": 0, "backoff_s": 0.01}, "timeout_s must be > 0, got 0"),
                         ({"backoff_s": -1}, "backoff_s and max_retry_after_s must be >= 0, got -1 and 300.0")):
        with pytest.raises(PipelineError, match=re.escape(message)):
            download(DownloadConfig(dump_url(mirror, DATE), tmp_path, **bad))
    with pytest.raises(SystemExit) as exc:
        download_main(["--url", dump_url(mirror, DATE), "--output_dir", str(tmp_path), "--retries", "-1"])
    assert exc.value.code == 2 and "--retries: must be >= 0" in capsys.readouterr().err
    assert site.requests == [] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cli", ["download", "prepare"])
def test_a_mirror_beside_a_url_is_refused_even_the_default_one(cli, tmp_path, capsys):
    """--mirror set to its default value beside --url / --input did nothing and passed."""
    from data.download import DEFAULT_MIRROR
    from data.prepare import main as prepare_main

    main, source = (download_main, "--url") if cli == "download" else (prepare_main, "--input")
    with pytest.raises(SystemExit) as exc:
        main([source, "https://example.org/x.xml.bz2", "--mirror", DEFAULT_MIRROR, "--output_dir", str(tmp_path / "o")])
    assert exc.value.code == 2
    assert f"error: --mirror applies to --dump_date; with {source}, put the mirror in the URL\n" in \
        capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("cli", ["download", "prepare"])
def test_a_malformed_dump_date_is_a_one_line_error(cli, tmp_path):
    """Both command lines answer a bad --dump_date with their usual `error:` line (it was a traceback)."""
    from data.prepare import main as prepare_main

    main, extra = (download_main, []) if cli == "download" else (prepare_main, ["--vocab_file", "v.txt"])
    with pytest.raises(SystemExit) as exc:
        main(["--dump_date", "2026-11-01", "--output_dir", str(tmp_path / "out"), *extra])
    assert exc.value.code == "error: dump date '2026-11-01' is not YYYYMMDD, e.g. 20261101"
    assert not (tmp_path / "out").exists()


def test_a_server_that_restarts_every_resume_runs_out_of_retries(wiki_mirror, multistream_sample, tmp_path):
    """Each resume answered from byte 0 empties the part file, which the next attempt refills to where it
    was: that is no progress, so the retries run out (the download used to go on forever)."""
    mirror, site = wiki_mirror
    site.cut_after, site.cuts, site.range_starts = 100_000, 1000, [0] * 1000
    with pytest.raises(PipelineError, match="failed after 3 attempts in a row without progress"):
        download(_cfg(mirror, tmp_path, retries=2))
    # 100,000 bytes, then two retries that bring no byte past them: a resume answered from 0, a refill
    assert [r for p, r in site.requests if p == _dump_path()] == [None, "bytes=100000-", None]
    assert not (tmp_path / NAME).exists()


_CANNOT_RESUME = (r"the server's answers to a resume do not continue the file where .*\.part ends, so each round "
                  rf"fetched it again from byte 0, as a rerun would: this server cannot resume {re.escape(NAME)}\. "
                  "Fetch it another way or from another --mirror and pass its path to --input$")


@pytest.mark.parametrize("retries", [1, 2])
def test_a_server_that_answers_the_end_probe_without_content_range_runs_out_of_retries(multistream_sample, tmp_path,
                                                                                     retries):
    """A body without Content-Length, whose end is then probed with a Range request answered by a 206 without
    Content-Range: each round emptied the part file, fetched the whole file again without a length and began
    the retries afresh, so the download never ended."""
    import http.server
    import threading

    data, ranges = multistream_sample.read_bytes(), []

    class NoLengthNorContentRange(http.server.BaseHTTPRequestHandler):  # HTTP/1.0: each body ends with a close
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            if self.path != f"/{NAME}" or len(ranges) == 10:  # no checksum list; the 11th request: a code that
                self.send_error(404)  # fails the test, as the old code would have gone on for ever
                return
            ranges.append(self.headers.get("Range"))
            start = int(ranges[-1].removeprefix("bytes=").rstrip("-")) if ranges[-1] else 0
            self.send_response(206 if ranges[-1] else 200)
            self.end_headers()
            self.wfile.write(data[start:])

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NoLengthNorContentRange)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/{NAME}"
    try:
        with pytest.raises(PipelineError, match=rf"^{re.escape(url)}: failed after {retries + 1} attempts in a row "
                                                rf"without progress \(last: HTTP 206 with Content-Range None in answer "
                                                rf"to Range: bytes={len(data)}-; .* emptied .*\); {_CANNOT_RESUME}"):
            download(DownloadConfig(url, tmp_path, retries=retries, backoff_s=0.01, timeout_s=10))
    finally:
        server.shutdown()
        server.server_close()
    assert ranges == [None, f"bytes={len(data)}-"] * (retries + 1)  # each round empties the part file: one count
    assert not (tmp_path / NAME).exists()


def test_a_capped_server_whose_answers_all_start_at_byte_0_runs_out_of_retries(wiki_mirror, tmp_path):
    """A server that caps each answer at 300,000 bytes and starts every one at byte 0: each round emptied the
    part file and got the first 300,000 bytes again (a whole answer, with the retries begun afresh), for ever."""
    mirror, site = wiki_mirror
    # 20 such answers, then the usual ones: the old code got through them to the end instead of failing
    site.cap, site.range_starts = 300_000, [0] * 20
    waits = []
    with pytest.raises(PipelineError, match=r"failed after 2 attempts in a row without progress \(last: HTTP 206 with "
                                            r"Content-Range 'bytes 0-299999/\d+' in answer to Range: "
                                            rf"bytes=300000-; .* emptied .*\); {_CANNOT_RESUME}"):
        download(_cfg(mirror, tmp_path, retries=1, sleep=waits.append))
    # Each round that empties the part file counts once: the second such restart runs out.
    assert [r for p, r in site.requests if p == _dump_path()] == [None, "bytes=300000-", None, "bytes=300000-"]
    assert waits == [0.01]  # after the first emptied part file
    assert not (tmp_path / NAME).exists()


@pytest.mark.parametrize("honour_if_range", [True, False])
@pytest.mark.parametrize("published", [True, False])
def test_a_file_that_changed_on_the_server_is_downloaded_again_not_spliced(wiki_mirror, multistream_sample, tmp_path,
                                                                          honour_if_range, published):
    """A part file's bytes come from one version of the file: a resume after the file changed (another
    ETag, another size) starts again from byte 0, whether the server honours If-Range (a 200 with the new
    file) or not (a 206 whose validators differ). Without a published checksum nothing else would notice."""
    mirror, site = wiki_mirror
    site.validators, site.honour_if_range = True, honour_if_range
    old = multistream_sample.read_bytes()
    new = old[:250_000] + b"an edit" + old[250_000:]  # the same first 400,000 bytes would splice cleanly
    sums = _sums_path()
    if not published:
        del site.files[sums]
    site.cut_after, site.cuts = 400_000, 1
    with pytest.raises(PipelineError, match="rerun to resume from the 400000 bytes"):
        download(_cfg(mirror, tmp_path, retries=0))
    site.files[_dump_path()] = new
    if published:
        site.files[sums] = f"{hashlib.sha1(new).hexdigest()}  {NAME}\n".encode()
    site.requests.clear()
    site.if_ranges.clear()
    assert download(_cfg(mirror, tmp_path)).read_bytes() == new
    dump = [(r, i) for (p, r), i in zip(site.requests, site.if_ranges) if p == _dump_path()]
    etag = f'"{hashlib.sha1(old).hexdigest()}"'
    assert dump == ([("bytes=400000-", etag)] if honour_if_range else [("bytes=400000-", etag), (None, None)])
    assert sorted(p.name for p in tmp_path.iterdir()) == [RECORD, NAME]


def test_a_file_that_changed_size_on_a_server_without_validators_is_downloaded_again(wiki_mirror, multistream_sample,
                                                                                    tmp_path):
    """A server that sends neither ETag nor Last-Modified: the total in Content-Range is what tells that the file
    changed since the part file's bytes, and without a published checksum nothing else would."""
    mirror, site = wiki_mirror
    old = multistream_sample.read_bytes()
    new = old[:250_000] + b"an edit" + old[250_000:]
    del site.files[_sums_path()]
    site.cut_after, site.cuts = 400_000, 1
    with pytest.raises(PipelineError, match="rerun to resume from the 400000 bytes"):
        download(_cfg(mirror, tmp_path, retries=0))
    site.files[_dump_path()] = new
    site.requests.clear()
    assert download(_cfg(mirror, tmp_path)).read_bytes() == new
    assert [r for p, r in site.requests if p == _dump_path()] == ["bytes=400000-", None]


def test_a_weak_etag_is_not_sent_as_if_range_last_modified_is(wiki_mirror, multistream_sample, tmp_path):
    """If-Range takes a strong ETag only: a server compares a weak one as a mismatch and sends the whole file
    again (22 GB for a full dump). The part file's Last-Modified stands in."""
    mirror, site = wiki_mirror
    site.validators, site.weak_etag = True, True
    site.cut_after, site.cuts = 400_000, 1
    assert download(_cfg(mirror, tmp_path, retries=1)).read_bytes() == multistream_sample.read_bytes()
    dump = [(r, i) for (p, r), i in zip(site.requests, site.if_ranges) if p == _dump_path()]
    assert dump == [(None, None), ("bytes=400000-", LAST_MODIFIED)]


def test_a_206_to_a_request_without_range_is_followed_to_the_end(wiki_mirror, multistream_sample, tmp_path):
    """A server that answers every request with a 206 of at most 300,000 bytes, the first one too: the
    Content-Range total, not the Content-Length, is the file's size (it was taken as the whole file)."""
    mirror, site = wiki_mirror
    data = multistream_sample.read_bytes()
    del site.files[_sums_path()]
    site.cap = 300_000
    assert download(_cfg(mirror, tmp_path, retries=0)).read_bytes() == data
    assert [r for p, r in site.requests if p == _dump_path()] == [
        None, *(f"bytes={n}-" for n in range(300_000, len(data), 300_000))]


def test_a_416_without_content_range_lets_the_checksum_judge_a_whole_part_file(wiki_mirror, multistream_sample,
                                                                               tmp_path):
    """A run killed after the last byte (during the checksum pass) leaves a whole part file; a 416 that
    does not state the size must not throw it away (22 GB to fetch again) when a checksum can judge it."""
    mirror, site = wiki_mirror
    data = multistream_sample.read_bytes()
    site.bare_416 = True
    (tmp_path / f"{NAME}.part").write_bytes(data)
    assert download(_cfg(mirror, tmp_path)).read_bytes() == data
    assert [r for p, r in site.requests if p == _dump_path()] == [f"bytes={len(data)}-"]
    # Without a checksum, only a fresh download can tell.
    (tmp_path / NAME).rename(tmp_path / f"{NAME}.part")
    del site.files[_sums_path()]
    site.requests.clear()
    assert download(_cfg(mirror, tmp_path)).read_bytes() == data
    assert [r for p, r in site.requests if p == _dump_path()] == [f"bytes={len(data)}-", None]


def test_a_malformed_content_length_is_read_as_no_length(wiki_mirror, multistream_sample, tmp_path):
    mirror, site = wiki_mirror
    data = multistream_sample.read_bytes()
    site.bad_length = True
    assert download(_cfg(mirror, tmp_path, retries=0)).read_bytes() == data
    # The body ended without a length, so a Range request for what follows confirms the end (a 416).
    assert [r for p, r in site.requests if p == _dump_path()] == [None, f"bytes={len(data)}-"]


def test_the_back_off_is_capped(wiki_mirror, tmp_path):
    mirror, site = wiki_mirror
    site.statuses[_dump_path()] = [500] * 6
    waits = []
    with pytest.raises(PipelineError, match=r"failed after 6 attempts.*HTTP 500"):
        download(DownloadConfig(dump_url(mirror, DATE), tmp_path, retries=5, backoff_s=0.2, max_backoff_s=0.3,
                                sleep=waits.append))
    assert waits == [0.2, 0.3, 0.3, 0.3, 0.3]  # uncapped: 0.2, 0.4, 0.8, 1.6, 3.2


def test_disk_errors_are_one_line_errors_naming_the_path(wiki_mirror, tmp_path):
    mirror, site = wiki_mirror
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(PipelineError, match=rf"^{re.escape(str(blocker / 'out'))}: Not a directory while "
                                            rf"downloading {NAME}; fix it \(free space, permissions, the path\) "
                                            r"and rerun$"):
        download(_cfg(mirror, blocker / "out"))
    (tmp_path / f"{NAME}.part").write_bytes(b"x" * 1000)
    (tmp_path / f".{NAME}.lock").mkdir()  # where the lock file goes
    with pytest.raises(PipelineError, match=rf"\.lock: Is a directory while downloading .* and rerun: the 1000 "
                                            rf"bytes in {re.escape(str(tmp_path / NAME))}\.part are resumed$"):
        download(_cfg(mirror, tmp_path))
    assert site.requests == []


def test_a_checksum_list_that_omits_the_file_falls_back_to_the_other_list(wiki_mirror, multistream_sample,
                                                                          tmp_path):
    mirror, site = wiki_mirror
    data = multistream_sample.read_bytes()
    site.files[_sums_path()] = f"{'0' * 40}  enwiki-{DATE}-stub-articles.xml.gz\n".encode()
    site.files[_md5s_path()] = f"{'0' * 32}  {NAME}\n".encode()
    with pytest.raises(PipelineError, match="md5 checksum mismatch"):
        download(_cfg(mirror, tmp_path))
    del site.files[_md5s_path()]
    with pytest.raises(PipelineError, match=rf"{re.escape(mirror + _sums_path())} does not list {NAME}"):
        download(_cfg(mirror, tmp_path))
    site.files[_md5s_path()] = f"{hashlib.md5(data).hexdigest()}  {NAME}\n".encode()
    assert download(_cfg(mirror, tmp_path)).read_bytes() == data


def test_a_url_with_a_query_names_its_file_by_the_path(wiki_mirror, multistream_sample, tmp_path):
    mirror, site = wiki_mirror
    cfg = DownloadConfig(f"{dump_url(mirror, DATE)}?download=1#top", tmp_path, backoff_s=0.01)
    assert download(cfg) == tmp_path / NAME
    assert (tmp_path / NAME).read_bytes() == multistream_sample.read_bytes()
    assert [p for p, _ in site.requests] == [_sums_path(), f"{_dump_path()}?download=1"]  # verified by its sha1


def test_a_tls_error_mid_body_is_retried(multistream_sample, tmp_path, monkeypatch):
    """The default mirror is https: a TLS record broken in the middle of the body (ssl.SSLError, 'bad
    record mac') is a dropped connection like any other, and the download resumes after it."""
    import contextlib
    import shutil
    import socket
    import ssl
    import subprocess
    import threading

    openssl = shutil.which("openssl")
    assert openssl, "this test makes its certificate with the openssl command"
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the client trusts it
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    data, ranges = multistream_sample.read_bytes(), []

    def serve(conn: socket.socket) -> None:
        with context.wrap_socket(conn, server_side=True) as tls, tls.makefile("rb") as f:
            request = f.readline().decode().split()
            headers = [line.decode().strip() for line in iter(f.readline, b"\r\n")]
            if request[1] != f"/{NAME}":  # the checksum lists: none published here
                tls.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                return
            start = next((int(h.split("=")[1].rstrip("-")) for h in headers if h.lower().startswith("range:")), 0)
            ranges.append(start)
            status = f"206 Partial\r\nContent-Range: bytes {start}-{len(data) - 1}/{len(data)}" if start else "200 OK"
            tls.sendall(f"HTTP/1.1 {status}\r\nContent-Length: {len(data) - start}\r\nConnection: close\r\n\r\n"
                        .encode())
            if len(ranges) == 1:
                tls.sendall(data[:1_500_000])
                # A record the client cannot authenticate, written under the TLS layer.
                with socket.socket(fileno=os.dup(tls.fileno())) as raw:
                    raw.sendall(b"\x17\x03\x03\x00\x40" + b"\x00" * 64)
                return
            tls.sendall(data[start:])

    def serve_forever() -> None:
        with contextlib.suppress(OSError):  # the listener closes when the test ends
            while True:
                serve(listener.accept()[0])

    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=serve_forever, daemon=True).start()
    url = f"https://127.0.0.1:{listener.getsockname()[1]}/{NAME}"
    try:
        path = download(DownloadConfig(url, tmp_path / "out", backoff_s=0.01, timeout_s=10, retries=1))
    finally:
        listener.close()
    assert path.read_bytes() == data
    assert ranges[0] == 0 and 0 < ranges[1] <= 1_500_000  # resumed, not begun again


@pytest.mark.parametrize("argv, message", [
    # was a ValueError traceback ("unknown url type")
    (["--mirror", "dumps.example.org"], "--mirror 'dumps.example.org' is not an http(s) URL; pass one such as "
                                        "https://dumps.wikimedia.org"),
    # was "Name or service not known ... rerun to try again", which no rerun fixes
    (["--url", "ftp://dumps.example.org/a.xml.bz2"], "--url ftp://dumps.example.org/a.xml.bz2 is not an http(s) "
                                                     "URL; pass one, or fetch the file another way and give its "
                                                     "path to data.prepare --input"),
])
def test_download_refuses_a_url_or_mirror_that_is_not_http(argv, message, tmp_path):
    with pytest.raises(SystemExit) as exc:
        download_main([*argv, "--output_dir", str(tmp_path / "out"), "--retries", "0"])
    assert exc.value.code == f"error: {message}"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [
    # was "dumps.example.org/enwiki/...: no such file; pass a MediaWiki XML dump ... with --input"
    (["--dump_date", "20261101", "--mirror", "dumps.example.org"],
     "--mirror 'dumps.example.org' is not an http(s) URL; pass one such as https://dumps.wikimedia.org"),
    # was "ftp:/dumps.example.org/a.xml.bz2: no such file", the URL read as a path
    (["--input", "ftp://dumps.example.org/a.xml.bz2"], "--input ftp://dumps.example.org/a.xml.bz2: ftp:// URLs are "
                                                       "not downloaded; pass an http(s):// URL, or fetch the file "
                                                       "another way and pass its path"),
])
def test_prepare_refuses_an_input_or_mirror_url_that_is_not_http(argv, message, bert_vocab, tmp_path):
    from data.prepare import main as prepare_main

    with pytest.raises(SystemExit) as exc:
        prepare_main([*argv, "--output_dir", str(tmp_path / "out"), "--vocab_file", str(bert_vocab)])
    assert exc.value.code == f"error: {message}"
    assert not (tmp_path / "out").exists()


def test_input_names_a_url_in_any_case_or_a_local_file_as_a_path_or_a_file_url(tmp_path):
    from data.download import dump_source

    assert dump_source("HTTPS://dumps.example/x.xml.bz2") == "HTTPS://dumps.example/x.xml.bz2"
    assert dump_source("http://127.0.0.1:8000/a b.xml.bz2") == "http://127.0.0.1:8000/a b.xml.bz2"
    dump = tmp_path / "my dump.xml.bz2"
    assert dump_source(dump.as_uri()) == dump  # file:///.../my%20dump.xml.bz2
    assert dump_source(str(dump)) == dump and dump_source("relative.xml.bz2") == Path("relative.xml.bz2")
    assert dump_source(f"file://localhost{dump.as_uri()[7:]}") == dump
    # another host's file: the host was dropped and the path read on this machine
    for url in (f"file://server{dump.as_uri()[7:]}", "file://dump.xml.bz2"):
        with pytest.raises(PipelineError, match=f"^--input {re.escape(url)}: this file:// URL names the host "
                                                f"'{url[7:].split('/')[0]}', and only this machine's files are read; "
                                                r"a file here is file:///<absolute path> \(three slashes\) or its "
                                                "plain path; a file on another machine: mount it here and pass its path$"):
            dump_source(url)


def test_prepare_reads_a_file_url_input(bert_vocab, tmp_path):
    """It looked for a file named "file:/..." and said that no such file exists."""
    from data.prepare import main as prepare_main

    notes = tmp_path / "notes.xml.bz2"
    notes.write_text("not a dump")
    with pytest.raises(SystemExit) as exc:  # the file was found and read: it is not a dump
        prepare_main(["--input", notes.as_uri(), "--output_dir", str(tmp_path / "out"), "--vocab_file", str(bert_vocab)])
    assert str(exc.value.code).startswith(f"error: {notes} is not a MediaWiki XML dump: it is neither bz2")


def test_extract_alone_reads_a_file_url_input_and_refuses_one_to_download(tmp_path, capsys):
    """python -m data.extract took --input file:///... for the path "file:/..." and said "no such file", while
    data.prepare read it (docs/DATA.md: a path, "also as a file:// URL"). An http(s) URL is not downloaded by
    this stage: the error names the commands that do."""
    from data.extract import main as extract_main

    dump = tmp_path / "my dump.xml"
    dump.write_text("<mediawiki><page><title>Alpha</title><ns>0</ns><id>1</id><revision><id>1</id><text>The alpha "
                    "river flows north.</text></revision></page></mediawiki>\n", encoding="utf-8")
    extract_main(["--input", dump.as_uri(), "--output_dir", str(tmp_path / "extracted"), "--workers", "1"])
    assert capsys.readouterr().out.startswith("extract: 1 articles of 1 pages")
    assert (tmp_path / "extracted" / "part-00000.txt").read_text(encoding="utf-8") == "The alpha river flows north.\n\n"
    url = "https://dumps.example.org/enwiki/20261101/enwiki-20261101-pages-articles-multistream.xml.bz2"
    for given, message in [
        (url, f"--input {url}: data.extract reads a local dump, not an http(s) URL; download it with python -m "
              f"data.download --url {url} --output_dir DIR and pass the file it writes, or pass the URL to python -m "
              "data.prepare --input, which downloads it"),
        ("ftp://dumps.example.org/a.xml.bz2", "--input ftp://dumps.example.org/a.xml.bz2: ftp:// URLs are not read; "
                                              "fetch the dump another way and pass its path (or a file:// URL)")]:
        with pytest.raises(SystemExit) as exc:
            extract_main(["--input", given, "--output_dir", str(tmp_path / "refused")])
        assert exc.value.code == f"error: {message}"
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("cut_by", ["reset", "stall"])
def test_the_bytes_received_before_a_reset_or_a_stall_are_kept(wiki_mirror, multistream_sample, tmp_path, cut_by):
    """A read of up to 1 MiB that ends in a connection reset or a read timeout raised and lost the bytes it had
    already received: the part file stayed empty and the resume began at byte 0, so a link that drops every
    few hundred kB never got anywhere."""
    mirror, site = wiki_mirror
    site.cut_after, site.cuts, site.cut_by = 300_000, 1, cut_by
    cfg = DownloadConfig(dump_url(mirror, DATE), tmp_path, backoff_s=0.01, timeout_s=0.5, retries=1)
    start = time.monotonic()
    assert download(cfg).read_bytes() == multistream_sample.read_bytes()
    assert [r for p, r in site.requests if p == _dump_path()] == [None, "bytes=300000-"]
    assert time.monotonic() - start < 4  # a stall ends with the 0.5 s read timeout, not when the server ends it (5 s)


def _dump_status(status: str, files: dict | None = None) -> bytes:
    """A dumpstatus.json as dumps.wikimedia.org publishes it (version 0.8), trimmed to two jobs."""
    import json

    return json.dumps({"jobs": {
        "articlesdump": {"status": "done", "updated": "2024-12-03 10:00:00",
                         "files": {f"enwiki-{DATE}-pages-articles1.xml-p1p41242.bz2": {"size": 1}}},
        "articlesmultistreamdumprecombine": {"status": status, "updated": "2024-12-04 01:00:00",
                                             "files": files or {}}}, "version": "0.8"}).encode()


@pytest.mark.parametrize("verify", [True, False])
def test_a_dump_that_is_not_finished_says_so(wiki_mirror, tmp_path, verify):
    """The directory of a dump run in progress holds its finished files and checksum lists without the
    multistream file (written as .inprog until its job is done): the error said to check the date, or that
    no such dump exists, where dumpstatus.json says that it is not finished yet."""
    mirror, site = wiki_mirror
    del site.files[_dump_path()]
    site.files[_sums_path()] = f"{'0' * 40}  enwiki-{DATE}-pages-articles1.xml-p1p41242.bz2\n".encode()
    status = f"/enwiki/{DATE}/dumpstatus.json"
    site.files[status] = _dump_status("in-progress")
    with pytest.raises(PipelineError, match=rf"{'does not list' if verify else 'HTTP 404'}.*; "
                                            rf"{re.escape(mirror + status)} says that "
                                            r"articlesmultistreamdumprecombine, the job that writes "
                                            rf"{NAME}, is 'in-progress': the dump of {DATE} is not finished\. "
                                            r"Wait for it, or use an earlier dump date$"):
        download(_cfg(mirror, tmp_path, verify=verify))
    site.files[status] = _dump_status("failed")
    with pytest.raises(PipelineError, match=r"is 'failed' \(failed or skipped in this run\); use another dump "
                                            r"date$"):
        download(_cfg(mirror, tmp_path, verify=verify))
    site.files[status] = _dump_status("done", {NAME: {"size": 1}})  # done, yet missing: the usual words
    with pytest.raises(PipelineError, match="check the dump date and file name$" if verify else "no such dump"):
        download(_cfg(mirror, tmp_path, verify=verify))
    del site.files[status]  # a mirror that does not copy it
    with pytest.raises(PipelineError, match="check the dump date and file name$" if verify else "no such dump"):
        download(_cfg(mirror, tmp_path, verify=verify))
    assert list(tmp_path.iterdir()) == []


def test_a_mirror_that_redirects_to_another_host_is_followed_with_its_range(wiki_mirror, multistream_sample,
                                                                          tmp_path):
    """Mirrors (the Internet Archive, download pools) answer with a 302 to another host: the resume's Range
    and If-Range go with the redirected request, and the checksum list is the one beside the URL given."""
    import http.server
    import threading

    mirror, site = wiki_mirror
    site.validators, site.cut_after, site.cuts = True, 400_000, 1

    class Redirect(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(302)
            self.send_header("Location", f"{mirror}{self.path}")
            self.send_header("Content-Length", "0")
            self.end_headers()

    front = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=front.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        cfg = _cfg(f"http://127.0.0.1:{front.server_address[1]}", tmp_path, retries=1)
        assert download(cfg).read_bytes() == multistream_sample.read_bytes()
    finally:
        front.shutdown()
        front.server_close()
    etag = f'"{hashlib.sha1(multistream_sample.read_bytes()).hexdigest()}"'
    assert [(p, r, i) for (p, r), i in zip(site.requests, site.if_ranges)] == [
        (_sums_path(), None, None), (_dump_path(), None, None), (_dump_path(), "bytes=400000-", etag)]


def test_a_content_range_unit_in_capitals_is_read(wiki_mirror, multistream_sample, tmp_path):
    """Range units are case-insensitive (RFC 9110 14.1): `Bytes 400000-.../...` was taken for a range that
    does not fit, and each resume emptied the part file and began again from byte 0."""
    mirror, site = wiki_mirror
    site.range_unit, site.cut_after, site.cuts = "Bytes", 400_000, 1
    assert download(_cfg(mirror, tmp_path, retries=1)).read_bytes() == multistream_sample.read_bytes()
    assert [r for p, r in site.requests if p == _dump_path()] == [None, "bytes=400000-"]


@pytest.mark.parametrize("path", ["/enwiki/", "/enwiki/%2E%2E", "/enwiki/..%2F..%2Fescaped.xml.bz2"])
def test_a_url_that_names_no_file_is_refused(wiki_mirror, tmp_path, path):
    """The name is the URL's last path segment, unquoted. `%2E%2E` (..) was downloaded whole into `....part`,
    then failed to be renamed over the directory above (a disk error, "Device or resource busy"); `..%2F..%2Fx`
    pointed above --output_dir and failed on its lock file ("No such file or directory ... free space")."""
    mirror, site = wiki_mirror
    out = tmp_path / "a" / "b"
    with pytest.raises(PipelineError, match=rf"^{re.escape(mirror + path)} does not name a file: its path must end "
                                            r"in a file name such as enwiki-\d{8}-pages-articles-multistream"):
        download(DownloadConfig(f"{mirror}{path}", out, backoff_s=0.01))
    assert site.requests == [] and list(tmp_path.rglob("*")) == []
