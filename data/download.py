"""Stage 1: download an English Wikipedia dump by dump date, resumable and checksum-verified.

    python -m data.download --dump_date 20261101 --output_dir text/download [--mirror URL]
    python -m data.download --url https://host/enwiki/20261101/enwiki-20261101-pages-articles.xml.bz2 ...

By date it fetches `<wiki>-<date>-pages-articles-multistream.xml.bz2`, which data.extract reads in parallel.

The default date is pinned (never the moving "latest", which is 404 while it is refreshed).
The file streams to `<name>.part`; an interrupted transfer resumes with an HTTP Range request,
with retries and exponential back-off. The result is checked against the dump's published
`<wiki>-<date>-sha1sums.txt` (or `-md5sums.txt`) and only then renamed to its final name, beside
its record `.<name>.download.json` (the URL, the size, the checksum): a rerun uses the file only for
the same URL.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import email.utils
import glob
import hashlib
import http.client
import json
import re
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from tqdm import tqdm

from data import lockfile
from data.cli import HelpFormatter, given_options, non_negative_int
from data.stage import PipelineError, cli_call, no_locks, remove_leftovers, write_json_atomic
from training.atomic import fsync_dir, fsync_file

DEFAULT_DUMP_DATE = "20261101"
DEFAULT_MIRROR = "https://dumps.wikimedia.org"
CHUNK = 1 << 20
_DUMP_NAME = re.compile(r"^(?P<wiki>[a-z_]+)-(?P<date>\d{8})-")
_ALGORITHMS = ("sha1", "md5")  # the checksum files a dump directory publishes, preferred first
T = TypeVar("T")


@dataclass(frozen=True)
class DownloadConfig:
    url: str
    output_dir: Path
    retries: int = 5
    backoff_s: float = 2.0
    timeout_s: float = 60.0
    verify: bool = True
    # The longest wait a server's Retry-After (on 408, 429 or 5xx) may impose before the next attempt.
    max_retry_after_s: float = 300.0
    # The longest back-off between two attempts: doubling from backoff_s would reach hours by the 12th.
    max_backoff_s: float = 300.0
    # How a wait between attempts is spent (tests record the waits instead of sleeping them).
    sleep: Callable[[float], None] = time.sleep


# 408 Request Timeout and 429 Too Many Requests are worth retrying, as are 5xx server errors.
_TRANSIENT_HTTP = (408, 429)
# ssl.SSLError: a TLS record broken mid-body (a dropped https connection), as ConnectionError is for http.
_NETWORK_ERRORS = (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError, ssl.SSLError)


class _RangeMismatch(Exception):
    """The server's Content-Range does not fit the .part file, which is emptied: the next attempt starts at 0."""


def dump_url(mirror: str, date: str, wiki: str = "enwiki") -> str:
    """The URL of the date's pages-articles dump in its multistream form: the same XML as
    `pages-articles.xml.bz2`, as independent bz2 streams that data.extract reads in parallel."""
    if not re.fullmatch(r"\d{8}", date or ""):
        raise PipelineError(f"dump date {date!r} is not YYYYMMDD, e.g. {DEFAULT_DUMP_DATE}")
    if not is_http(mirror):
        raise PipelineError(f"--mirror {mirror!r} is not an http(s) URL; pass one such as {DEFAULT_MIRROR}")
    return f"{mirror.rstrip('/')}/{wiki}/{date}/{wiki}-{date}-pages-articles-multistream.xml.bz2"


def file_name(url: str) -> str:
    """The file a URL names: the last segment of its path, without query or fragment, unquoted."""
    return urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])


def is_http(url: str) -> bool:
    """An http(s) URL, the scheme in any case."""
    return urllib.parse.urlsplit(url).scheme.lower() in ("http", "https")


def local_path(text: str) -> Path | None:
    """The local file that `text` names as a path or a file:// URL; None for a URL of another scheme. A file://
    URL of another host than this one is refused: its path would be read here, a file of the same name perhaps."""
    parts = urllib.parse.urlsplit(text)
    if parts.scheme.lower() == "file":
        if parts.netloc.lower() not in ("", "localhost"):
            raise PipelineError(f"--input {text}: this file:// URL names the host {parts.netloc!r}, and only this "
                                "machine's files are read; a file here is file:///<absolute path> (three slashes) "
                                "or its plain path; a file on another machine: mount it here and pass its path")
        return Path(urllib.request.url2pathname(parts.path))
    if parts.scheme and "://" in text:  # not a path, which may parse with a scheme too (C:\x, a:b.xml)
        return None
    return Path(text)


def dump_source(text: str | Path) -> str | Path:
    """What `--input` names: an http(s) URL to download (the scheme in any case), or a local file, given
    as a path or a file:// URL."""
    if isinstance(text, Path):
        return text
    if is_http(text):
        return text
    path = local_path(text)
    if path is None:
        raise PipelineError(f"--input {text}: {urllib.parse.urlsplit(text).scheme}:// URLs are not downloaded; pass "
                            "an http(s):// URL, or fetch the file another way and pass its path")
    return path


def _checksum_urls(url: str) -> list[tuple[str, str]]:
    parts = urllib.parse.urlsplit(url)
    m = _DUMP_NAME.match(file_name(url))
    if not m:
        return []
    directory = parts.path.rsplit("/", 1)[0]
    return [(urllib.parse.urlunsplit((parts.scheme, parts.netloc, f"{directory}/{m['wiki']}-{m['date']}-"
                                      f"{algorithm}sums.txt", "", "")), algorithm) for algorithm in _ALGORITHMS]


def _is_transient(exc: Exception) -> bool:
    if isinstance(exc, urllib.error.HTTPError):
        return exc.code >= 500 or exc.code in _TRANSIENT_HTTP
    return isinstance(exc, (*_NETWORK_ERRORS, _RangeMismatch))


def _describe(exc: Exception) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    return str(exc) or type(exc).__name__


def _retry_after_s(exc: Exception | None) -> float | None:
    """The wait a 408, 429 or 5xx asks for in its Retry-After header (seconds or an HTTP date), if any."""
    value = exc.headers.get("Retry-After") if isinstance(exc, urllib.error.HTTPError) else None
    if not value:
        return None
    if value.strip().isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max((when - datetime.datetime.now(datetime.timezone.utc)).total_seconds(), 0.0)


def _wait_s(cfg: DownloadConfig, attempt: int, exc: Exception | None) -> float:
    """Exponential back-off (up to cfg.max_backoff_s), or the server's Retry-After when longer (up to
    cfg.max_retry_after_s)."""
    wait = min(cfg.backoff_s * 2 ** attempt, cfg.max_backoff_s)
    retry_after = _retry_after_s(exc)
    return wait if retry_after is None else max(wait, min(retry_after, cfg.max_retry_after_s))


@dataclass
class _Attempts:
    """Attempts in a row without progress, counted up to cfg.retries: an attempt that took the bytes on
    disk past the most they ever were starts the count and the back-off afresh, so a long transfer
    survives any number of spread-out drops, while a server that makes every resume start again from
    byte 0 does not keep the download going forever. One count serves every request of a download,
    the rounds that ask for the rest of a capped answer or probe the end of one without a length too:
    a count begun afresh each round never ran out."""

    most: int  # the most bytes ever on disk
    in_a_row: int = 0
    last: str = ""  # what the last attempt without progress met
    stalled_round: bool = False  # a round ended no further than an earlier one: a rerun would do the same

    def progressed(self, now: int) -> bool:
        if now <= self.most:
            return False
        self.most, self.in_a_row, self.last, self.stalled_round = now, 0, "", False
        return True

    def failed(self, cfg: DownloadConfig, url: str, what: str, hint: Callable[[], str],
               exc: Exception | None = None) -> None:
        """Count an attempt without progress and wait before the next one; a PipelineError once
        cfg.retries are spent."""
        self.last = what
        if self.in_a_row >= cfg.retries:
            raise PipelineError(f"{url}: failed after {self.in_a_row + 1} attempts in a row without progress "
                                f"(last: {what}); {hint()}") from exc
        cfg.sleep(_wait_s(cfg, self.in_a_row, exc))
        self.in_a_row += 1


def _retrying(cfg: DownloadConfig, url: str, fetch: Callable[[], T], rerun_hint: Callable[[], str],
              progress: Callable[[], int] = lambda: 0, attempts: _Attempts | None = None) -> T:
    """fetch(), tried again after a transient failure (network error, 408, 429, 5xx, a range mismatch)
    while `attempts` (by default a count of its own) allows, `progress()` being the bytes on disk. Any
    other error is raised as it is; running out of retries is a PipelineError."""
    if attempts is None:
        attempts = _Attempts(progress())
    while True:
        try:
            return fetch()
        except (*_NETWORK_ERRORS, _RangeMismatch) as exc:
            if not _is_transient(exc):
                raise
            attempts.progressed(progress())
            if not isinstance(exc, _RangeMismatch):  # the network failed, not the server's resume
                attempts.stalled_round = False
            attempts.failed(cfg, url, _describe(exc), rerun_hint, exc)


def _read_text(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read().decode("utf-8", "replace")


# The jobs of a dump run that write a file (dumpstatus.json's keys): the recombined file of a wiki dumped in
# parts (enwiki), or the only one of a smaller wiki.
_WRITER_JOBS = {"pages-articles-multistream.xml.bz2": ("articlesmultistreamdumprecombine", "articlesmultistreamdump"),
                "pages-articles.xml.bz2": ("articlesdumprecombine", "articlesdump")}


def _unfinished(url: str, timeout_s: float) -> str | None:
    """Why url's file is not published yet, from the dumpstatus.json beside it: the job that writes it is
    not done (waiting, in progress, failed). None when that file says nothing of the kind or cannot be read
    (a mirror may not copy it): this only words an error better."""
    parts = urllib.parse.urlsplit(url)
    status_url = urllib.parse.urlunsplit((parts.scheme, parts.netloc,
                                          f"{parts.path.rsplit('/', 1)[0]}/dumpstatus.json", "", ""))
    name = file_name(url)
    m = _DUMP_NAME.match(name)
    try:
        jobs = json.loads(_read_text(status_url, timeout_s))["jobs"]
        listed = [job for job, info in jobs.items() if name in (info.get("files") or {})]
        job = (listed or [job for job in _WRITER_JOBS.get(name[m.end():] if m else "", ()) if job in jobs]
               or [None])[0]
        status = jobs[job]["status"] if job else "done"
    except (OSError, http.client.HTTPException, ValueError, LookupError, TypeError, AttributeError):
        return None  # any network error (OSError covers URLError and SSLError), or not the JSON expected
    if status == "done":
        return None
    said = f"{status_url} says that {job}, the job that writes {name}, is {status!r}"
    if status in ("waiting", "in-progress"):
        return (f"{said}: the dump of {m['date'] if m else 'that date'} is not finished. Wait for it, or use an "
                "earlier dump date")
    return f"{said} (failed or skipped in this run); use another dump date"


def published_checksum(cfg: DownloadConfig) -> tuple[str, str] | None:
    """(algorithm, hex digest) of cfg.url from the dump's checksum file, or None when none is published.
    The checksum file is fetched with the same retries as the dump. A list answered 401 or 403 is passed
    over as a missing one is (S3 answers 403 for a missing file): an error only when no list was read."""
    name = file_name(cfg.url)
    unlisted, forbidden = [], []
    for sums_url, algorithm in _checksum_urls(cfg.url):
        try:
            text = _retrying(cfg, sums_url, lambda u=sums_url: _read_text(u, cfg.timeout_s),
                             lambda: "check the network and the mirror, then rerun")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                continue
            if exc.code in (401, 403):
                forbidden.append((sums_url, exc))
                continue
            raise PipelineError(f"{sums_url}: HTTP {exc.code} {exc.reason} while fetching the checksum file") from exc
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("*") == name:
                return algorithm, parts[0].lower()
        unlisted.append(sums_url)
    refused = " and ".join(f"{url}: HTTP {exc.code} {exc.reason}" for url, exc in forbidden)
    if unlisted:
        why = _unfinished(cfg.url, cfg.timeout_s) or "check the dump date and file name"
        raise PipelineError(f"{' and '.join(unlisted)} {'do' if len(unlisted) > 1 else 'does'} not list {name}"
                            f"{f' ({refused})' if refused else ''}; {why}")
    if forbidden:
        many = len(forbidden) > 1
        raise PipelineError(f"{refused} while fetching the checksum file{'s' if many else ''}; a mirror that "
                            f"publishes no checksum file may answer 403 for {'them' if many else 'it'} (S3 does "
                            "for a missing file): then --no_verify downloads without the check") from forbidden[-1][1]
    return None


def _content_range(header: str | None) -> tuple[int | None, int | None]:
    """(first byte, total size) of a Content-Range header: `bytes 100-199/200` or, on a 416, `bytes */200`;
    None for what it does not state (total `*`) or for a missing or malformed header."""
    m = re.fullmatch(r"\s*bytes\s+(?:(\d+)-\d+|\*)/(\d+|\*)\s*", header or "", re.IGNORECASE)  # RFC 9110 14.1
    if not m:
        return None, None
    return (int(m[1]) if m[1] else None), (int(m[2]) if m[2] != "*" else None)


def _validator_path(part: Path) -> Path:
    return part.with_name(f".{part.name}.validators")


def _restart(part: Path, why: str) -> _RangeMismatch:
    part.unlink(missing_ok=True)
    _validator_path(part).unlink(missing_ok=True)
    return _RangeMismatch(f"{why}; {part} was emptied to download from byte 0")


def _content_length(headers) -> int | None:
    """Content-Length, or None when missing or malformed (the body then ends when the connection closes)."""
    value = (headers.get("Content-Length") or "").strip()
    return int(value) if value.isdigit() else None


def _validators(headers, total: int | None) -> dict:
    """What identifies the version of the file a response comes from: its ETag, Last-Modified and size."""
    return {"etag": headers.get("ETag"), "last_modified": headers.get("Last-Modified"), "total": total}


def _changed(recorded: dict, now: dict) -> str | None:
    """How the file on the server differs from the one the part file's bytes came from, if it does."""
    for key in ("etag", "last_modified", "total"):
        if recorded.get(key) is not None and now.get(key) is not None and recorded[key] != now[key]:
            return f"{key.replace('_', '-')} was {recorded[key]!r} when the part file was begun, now {now[key]!r}"
    return None


def _read_validators(part: Path) -> dict:
    """The validators recorded for the part file's bytes; {} for none (a part file of an older version)."""
    try:
        recorded = json.loads(_validator_path(part).read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def _write_validators(part: Path, validators: dict) -> None:
    path = _validator_path(part)
    remove_leftovers(path)  # of a killed run: the lock is held, so no other writes it now
    write_json_atomic(path, validators, compact=True)


def _if_range(recorded: dict) -> dict[str, str]:
    """An If-Range header, so that a server whose file changed sends it whole (200) instead of its tail.
    A weak ETag is not allowed there; Last-Modified then stands in."""
    etag = recorded.get("etag")
    if etag and not etag.startswith("W/"):
        return {"If-Range": etag}
    return {"If-Range": recorded["last_modified"]} if recorded.get("last_modified") else {}


# What a transfer tells of the part file: it holds the whole file (the length was known, or a Range
# request for the bytes after it found none); the body ended but no length was given; or the end
# cannot be confirmed (the server ignores Range requests, or answers 416 without the size).
COMPLETE, LENGTH_UNKNOWN, UNCONFIRMED = "complete", "length unknown", "unconfirmed"
MORE = "more"  # the answer was whole but for a part of the file only: ask for the rest


def _fetch(url: str, part: Path, timeout_s: float, bar: tqdm, after_unknown_end: bool = False,
           checksum_known: bool = False) -> str:
    """Append the rest of `url` to `part` (Range from its current size) and say what is known of the
    result. `after_unknown_end`: the previous transfer ended without a length, and this request only
    asks whether bytes follow. `checksum_known`: a published digest will judge an unconfirmed end.
    The part file's validators (ETag, Last-Modified, size) are kept beside it: a resume never appends
    the bytes of a changed file to those of the old one. Raises on any failure."""
    have = part.stat().st_size if part.exists() else 0
    recorded = _read_validators(part) if have else {}
    if recorded.get("url") not in (None, url):
        # Begun from another URL (another mirror of the same dump, most often). With a published checksum the
        # resume is checked whole, and the other server's validators mean nothing here (If-Range would send the
        # file again); without one, a splice of two files would go unnoticed.
        if not checksum_known:
            bar.write(f"download: {part} was begun from {recorded['url']}, and no checksum is published to check "
                      "a resume from another URL: downloading it again from byte 0")
            part.unlink()
            _validator_path(part).unlink(missing_ok=True)
            have = 0
        recorded = {}
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-", **_if_range(recorded)} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        if exc.code != 416 or not have:
            raise
        _, total = _content_range(exc.headers.get("Content-Range"))
        if total == have or (total is None and (after_unknown_end or checksum_known)):
            # Nothing lies past the bytes the part file holds; without the size, the checksum decides.
            return COMPLETE if total == have or after_unknown_end else UNCONFIRMED
        raise _restart(part, f"HTTP 416 with Content-Range {exc.headers.get('Content-Range')!r} while the part "
                             f"file holds {have} bytes") from exc
    with response:
        total = None  # the whole file's size, when the response states it
        length = _content_length(response.headers)
        if response.status == 206:
            header = response.headers.get("Content-Range")
            first, total = _content_range(header)
            if first != have:
                raise _restart(part, f"HTTP 206 with Content-Range {header!r} in answer to "
                                     f"{f'Range: bytes={have}-' if have else 'a request without Range'}")
        elif have and after_unknown_end:
            return UNCONFIRMED  # it would send the whole file again, which says nothing of the end
        elif have:
            # The whole file (200): the server ignores Range, or If-Range found that the file changed.
            change = _changed(recorded, _validators(response.headers, length))
            if change:
                bar.write(f"download: {url} changed on the server ({change}); downloading it again from byte 0")
            have = 0
        end = None if length is None else have + length  # where this body ends
        if response.status == 200:
            total = end
        now = _validators(response.headers, total)
        if have:
            change = _changed(recorded, now)
            if change:
                raise _restart(part, f"the file on the server changed ({change})")
        if not have or not recorded:
            _write_validators(part, {**now, "url": url})
        bar.total = total
        bar.n = have
        bar.refresh()
        with part.open("r+b" if have else "wb") as f:
            f.seek(have)
            f.truncate()
            # read1: what one receive brings. read() gathers CHUNK bytes over many receives and loses them
            # all when a reset or a read timeout ends it, so a resume would begin before them.
            while chunk := response.read1(CHUNK):
                f.write(chunk)
                bar.update(len(chunk))
            size = f.tell()
    if end is not None and size != end:
        raise http.client.IncompleteRead(b"", end - size)
    if total is not None and size < total and end is not None and size > have:
        return MORE  # a whole answer for part of the file: some servers cap each answer
    if total is None:
        # A body without a length ends when the connection closes, which a dropped connection does too.
        return UNCONFIRMED if after_unknown_end and size == have else LENGTH_UNKNOWN
    if size != total:
        raise http.client.IncompleteRead(b"", total - size)
    return COMPLETE


def _digest(path: Path, algorithm: str) -> str:
    h = hashlib.new(algorithm)
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _check_config(cfg: DownloadConfig) -> None:
    if cfg.retries < 0:
        raise PipelineError(f"retries must be >= 0 (0: a single attempt), got {cfg.retries}")
    if cfg.backoff_s < 0 or cfg.max_retry_after_s < 0:
        raise PipelineError(f"backoff_s and max_retry_after_s must be >= 0, got {cfg.backoff_s} and "
                            f"{cfg.max_retry_after_s}")
    if cfg.timeout_s <= 0:
        raise PipelineError(f"timeout_s must be > 0, got {cfg.timeout_s}")
    if not is_http(cfg.url):
        raise PipelineError(f"--url {cfg.url} is not an http(s) URL; pass one, or fetch the file another way "
                            "and give its path to data.prepare --input")


def _download_part(cfg: DownloadConfig, part: Path, checksum_known: bool) -> bool:
    """Fetch cfg.url into `part`, resuming and retrying; a 404 or 410 is a PipelineError at once.
    Returns whether `part` is known to hold the whole file (False: only a checksum can tell)."""

    def size() -> int:
        return part.stat().st_size if part.exists() else 0

    name = file_name(cfg.url)
    attempts = _Attempts(size())

    def resume_hint() -> str:
        if attempts.stalled_round:
            return (f"the server's answers to a resume do not continue the file where {part} ends, so each round "
                    f"fetched it again from byte 0, as a rerun would: this server cannot resume {name}. Fetch it "
                    "another way or from another --mirror and pass its path to --input")
        return f"rerun to resume from the {size()} bytes in {part}" if size() else "rerun to try again"

    with tqdm(desc=f"download {name}", unit="B", unit_scale=True, dynamic_ncols=True) as bar:
        try:
            state = None  # a part file left by an earlier run is resumed, never taken as ended
            while state != COMPLETE:
                after_unknown_end = state == LENGTH_UNKNOWN
                counted = attempts.in_a_row
                state = _retrying(cfg, cfg.url,
                                  lambda end=after_unknown_end: _fetch(cfg.url, part, cfg.timeout_s, bar, end,
                                                                       checksum_known),
                                  resume_hint, size, attempts)
                if state == UNCONFIRMED:
                    return False
                if state != COMPLETE and not attempts.progressed(size()):
                    attempts.stalled_round = True
                    # A round that already counted a failed attempt (the restart that emptied the part file) is
                    # not counted twice: a part file found whole, refetched once without a length, then ends.
                    if attempts.in_a_row == counted:
                        attempts.failed(cfg, cfg.url, attempts.last or f"a round that ended at byte {size()}, no "
                                        f"further than the {attempts.most} bytes held before", resume_hint)
            return True
        except urllib.error.HTTPError as exc:
            if exc.code in (404, 410):
                why = _unfinished(cfg.url, cfg.timeout_s)
                if why:
                    raise PipelineError(f"{cfg.url}: HTTP {exc.code}; {why}") from exc
                raise PipelineError(
                    f"{cfg.url}: HTTP {exc.code}, no such dump. Check the date (dumps are kept a few "
                    "months; see https://dumps.wikimedia.org/enwiki/) or use another --mirror"
                ) from exc
            raise PipelineError(f"{cfg.url}: HTTP {exc.code} {exc.reason}") from exc


def download(cfg: DownloadConfig) -> Path:
    """Download cfg.url into cfg.output_dir and return the final path; a file already there is checked
    against its download record instead (see _use_existing)."""
    _check_config(cfg)
    name = file_name(cfg.url)
    if name in ("", ".", "..") or "/" in name or "\0" in name:  # %2F unquoted would lead out of output_dir
        raise PipelineError(f"{cfg.url} does not name a file: its path must end in a file name such as "
                            f"{file_name(dump_url(DEFAULT_MIRROR, DEFAULT_DUMP_DATE))}")
    final = cfg.output_dir / name
    part = cfg.output_dir / f"{name}.part"
    try:
        lock = cfg.output_dir / f".{name}.lock"
        busy = f"another download of {name} into {cfg.output_dir}"
        downloaded = False
        if not final.is_file():
            cfg.output_dir.mkdir(parents=True, exist_ok=True)
            with _exclusive(lock, busy):
                if not final.is_file():  # else finished by the run that held the lock
                    # The record of a file deleted, or put aside by a mismatch, would be taken for this one's.
                    _record_path(final).unlink(missing_ok=True)
                    _download_verified(cfg, part, final)
                    downloaded = True
        if not downloaded:
            # A run killed after its rename left its lock file and the part file's validators.
            _validator_path(part).unlink(missing_ok=True)
            lockfile.remove_stale(lock)
            _use_existing(cfg, final, lock, busy)
        for algorithm in _ALGORITHMS:  # copies kept by earlier mismatches: the verified file replaces them
            for old in cfg.output_dir.glob(f"{glob.escape(name)}.{algorithm}-*"):
                old.unlink(missing_ok=True)
    except OSError as exc:
        if isinstance(exc, urllib.error.URLError):
            raise
        # The network's OSErrors are retried or worded where they occur; this is the disk's.
        where = exc.filename or part
        kept = f": the {part.stat().st_size} bytes in {part} are resumed" if part.is_file() else ""
        raise PipelineError(f"{where}: {exc.strerror or exc} while downloading {name}; fix it (free space, "
                            f"permissions, the path) and rerun{kept}") from exc
    return final


def _download_verified(cfg: DownloadConfig, part: Path, final: Path) -> None:
    checksum = published_checksum(cfg) if cfg.verify else None
    whole = _download_part(cfg, part, checksum is not None)
    if checksum is None:
        if not whole:
            raise PipelineError(
                f"{cfg.url}: the server sent no length and ignores Range requests, and no checksum file is "
                f"published, so the {part.stat().st_size} bytes in {part} may be a cut-off transfer. Fetch "
                "the file another way (or from another --mirror) and pass its path to --input")
        print(f"download: no checksum file published beside {cfg.url}; the file is not verified" if cfg.verify
              else f"download: {cfg.url} is not verified (--no_verify)")
    else:
        _verify(cfg, part, *checksum)
    _check_content(cfg.url, part)
    fsync_file(part)  # the bytes are on disk before the name says the file is whole
    # The record before the rename: a final file without one would be taken for a file put there by hand.
    _write_record(final, cfg.url, part.stat().st_size, checksum, _unverified(cfg, checksum))
    part.replace(final)
    _validator_path(part).unlink(missing_ok=True)
    fsync_dir(final.parent)


def _check_content(url: str, part: Path) -> None:
    """Refuse bytes that are not what the name says (an error page a mirror sends with status 200, which no
    checksum catches where none is published), before they get the final name, which a rerun would take."""
    with part.open("rb") as f:
        head = f.read(512)
    name = file_name(url)
    page = head.lstrip().lower().startswith((b"<!doctype html", b"<html"))
    if (name.endswith(".bz2") and not head.startswith(b"BZh")) or (name.endswith(".xml") and page):
        part.unlink()
        _validator_path(part).unlink(missing_ok=True)
        shown = head[:60].decode("utf-8", "replace")
        raise PipelineError(f"{url}: the server sent {'an HTML page' if page else 'bytes'} that {name} cannot hold "
                            f"(it begins {shown!r}), not the file; check the URL (or --mirror), then rerun")


def download_again(path: Path) -> str:
    """How to replace a dump that turned out truncated or damaged."""
    if _record_path(path).is_file():  # data.download would take the finished file as it is (its record goes with it)
        return "Delete it, then rerun to download it again"
    return "Download or copy it again (python -m data.download resumes a download and checks the checksum)"


def _record_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.download.json")


def _unverified(cfg: DownloadConfig, checksum: tuple[str, str] | None) -> str | None:
    """Why a download is not verified, for its record; None when it is."""
    if checksum is not None:
        return None
    return "no checksum file published" if cfg.verify else "--no_verify"


def _write_record(final: Path, url: str, size: int, checksum: tuple[str, str] | None,
                  unverified: str | None) -> None:
    """Record beside `final` the URL it comes from, its size, and its checksum or why it has none."""
    remove_leftovers(_record_path(final))  # of a killed run: the lock is held, so no other writes it now
    write_json_atomic(_record_path(final), {
        "url": url, "size": size, "unverified": unverified,
        "checksum": None if checksum is None else {"algorithm": checksum[0], "digest": checksum[1]}})


def _read_record(final: Path) -> dict | None:
    """The download record of `final`; None when it has none."""
    path = _record_path(final)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except ValueError:  # a UnicodeDecodeError too
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("url"), str) or not isinstance(
            record.get("size"), int):
        raise PipelineError(f"{path} is not a download record (no URL and size can be read from it): delete it "
                            f"and {final} to download the file again, or delete only {path.name} to use {final.name} "
                            "as it is, unverified")
    return record


def _use_existing(cfg: DownloadConfig, final: Path, lock: Path, busy: str) -> None:
    """Check `final`, already downloaded, against its record: the file of another URL, or one whose size
    changed since, is refused, and one downloaded with --no_verify is verified now when cfg.verify. A file
    without a record (put there by hand, or downloaded by an older version) is used as it is."""
    record = _read_record(final)
    if record is None:
        print(f"download: {final} was found without a download record; it is used as it is, unverified (delete "
              "it to download it again with the check)")
        return
    if record["url"] != cfg.url:
        raise PipelineError(
            f"{final} was downloaded from {record['url']}, not from {cfg.url}: a file of the same name from another "
            "URL is not used in its place. Download into another --output_dir (data.prepare: another --text_dir or "
            f"--output_dir), or delete {final} to download it from {cfg.url} (a copy of it put there by hand: delete "
            f"its record {_record_path(final).name} too)")
    size = final.stat().st_size
    if size != record["size"]:
        raise PipelineError(
            f"{final} is {size} bytes, but {record['size']} were downloaded from {cfg.url} (its record "
            f"{_record_path(final).name} says so): the file changed or is damaged since. Delete it and rerun to "
            "download it again")
    # Only a file downloaded with --no_verify is checked now: where no checksum file was published, asking the
    # mirror again on every rerun would make a finished download need the network.
    if not cfg.verify or record.get("unverified") != "--no_verify":
        return
    with _exclusive(lock, busy):
        checksum = published_checksum(cfg)
        if checksum is None:
            print(f"download: no checksum file published beside {cfg.url}; {final} is not verified")
        else:
            try:
                _verify(cfg, final, *checksum, subject=f"{final} (downloaded from {cfg.url} without the check)")
            except PipelineError:
                _record_path(final).unlink(missing_ok=True)  # the file was put aside
                raise
            print(f"download: {final}, downloaded without the check, matches its published {checksum[0]} now")
        _write_record(final, cfg.url, size, checksum, _unverified(cfg, checksum))


def _verify(cfg: DownloadConfig, path: Path, algorithm: str, expected: str, subject: str | None = None) -> None:
    """Compare `path` (the part file, or a final file downloaded unverified) with its published digest. A
    mismatching download is kept aside, named by its digest, not deleted: a second download with the same
    digest shows that the mirror's file or its checksum file is wrong, not the transfer. `subject` begins
    the error (default: the URL)."""
    actual = _digest(path, algorithm)
    name = file_name(cfg.url)
    aside = path.with_name(f"{name}.{algorithm}-{actual}")
    if actual == expected:
        return
    subject = subject or cfg.url
    again = aside.exists()
    for old in path.parent.glob(f"{glob.escape(name)}.{algorithm}-*"):
        if old != aside:
            old.unlink()  # an earlier mismatching copy: only the newest is kept
    path.replace(aside)
    _validator_path(path.with_name(f"{name}.part")).unlink(missing_ok=True)
    if again:
        raise PipelineError(
            f"{subject}: {algorithm} checksum mismatch again, with the same bytes as the previous download "
            f"(got {actual}, published {expected}): the mirror's file or its checksum file is wrong, not the "
            f"transfer. Try another --mirror. The bytes are kept as {aside}; rename it to {name} only if you "
            "trust them")
    raise PipelineError(
        f"{subject}: {algorithm} checksum mismatch (got {actual}, published {expected}); the download is "
        f"kept as {aside}. Rerun to download it again")


@contextlib.contextmanager
def _exclusive(lock_path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on `lock_path` (removed afterwards), or fail at once naming `what` runs."""
    try:
        lock = lockfile.acquire(lock_path)
    except lockfile.Busy as exc:
        raise PipelineError(f"{what} is running; wait for it to finish or stop it") from exc
    except lockfile.NoLocks as exc:
        raise no_locks(lock_path, exc) from exc
    try:
        yield
    finally:
        lock.release()


def add_no_verify_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no_verify", action="store_true",
                        help="download without the check against the dump's published checksum file, for a mirror "
                             "that publishes none and answers 403 for it; the file is then not verified")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--dump_date", default=DEFAULT_DUMP_DATE, help="YYYYMMDD (default: %(default)s)")
    src.add_argument("--url", help="download this URL instead of the dump for --dump_date")
    p.add_argument("--mirror", default=DEFAULT_MIRROR,
                   help="dump mirror used with --dump_date (default: %(default)s)")
    p.add_argument("--output_dir", type=Path, required=True, help="where the dump is written")
    p.add_argument("--retries", type=non_negative_int, default=5,
                   help="retries in a row after a network error, 408, 429 or 5xx (an attempt that gets further "
                        "into the file starts the count again); 0: a single attempt (default: %(default)s)")
    add_no_verify_argument(p)
    a = p.parse_args(argv)
    if a.url and "mirror" in given_options(p, argv):
        p.error("--mirror applies to --dump_date; with --url, put the mirror in the URL")
    path = cli_call(lambda args: download(DownloadConfig(args.url or dump_url(args.mirror, args.dump_date),
                                                        args.output_dir, retries=args.retries,
                                                        verify=not args.no_verify)), a)
    print(f"download: {path} ({path.stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
