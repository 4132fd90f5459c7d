"""Stage 1: download an English Wikipedia dump by dump date, resumable and checksum-verified.

    python -m data.download --dump_date 20261101 --output_dir text/download [--mirror URL]
    python -m data.download --url https://host/enwiki/20261101/enwiki-20261101-pages-articles.xml.bz2 ...

By date it fetches `<wiki>-<date>-pages-articles-multistream.xml.bz2`, which data.extract reads in parallel.

The default date is pinned (never the moving "latest", which is 404 while it is refreshed).
The file streams to `<name>.part`; an interrupted transfer resumes with an HTTP Range request,
with retries and exponential back-off. The result is checked against the dump's published
`<wiki>-<date>-sha1sums.txt` (or `-md5sums.txt`) and only then renamed to its final name.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from data.stage import PipelineError

DEFAULT_DUMP_DATE = "20261101"
DEFAULT_MIRROR = "https://dumps.wikimedia.org"
CHUNK = 1 << 20
_DUMP_NAME = re.compile(r"^(?P<wiki>[a-z_]+)-(?P<date>\d{8})-")


@dataclass(frozen=True)
class DownloadConfig:
    url: str
    output_dir: Path
    retries: int = 5
    backoff_s: float = 2.0
    timeout_s: float = 60.0
    verify: bool = True


def dump_url(mirror: str, date: str, wiki: str = "enwiki") -> str:
    """The URL of the date's pages-articles dump in its multistream form: the same XML as
    `pages-articles.xml.bz2`, as independent bz2 streams that data.extract reads in parallel."""
    if not re.fullmatch(r"\d{8}", date or ""):
        raise PipelineError(f"dump date {date!r} is not YYYYMMDD, e.g. {DEFAULT_DUMP_DATE}")
    return f"{mirror.rstrip('/')}/{wiki}/{date}/{wiki}-{date}-pages-articles-multistream.xml.bz2"


def _checksum_urls(url: str) -> list[tuple[str, str]]:
    base, name = url.rsplit("/", 1)
    m = _DUMP_NAME.match(name)
    if not m:
        return []
    prefix = f"{base}/{m['wiki']}-{m['date']}"
    return [(f"{prefix}-sha1sums.txt", "sha1"), (f"{prefix}-md5sums.txt", "md5")]


def published_checksum(url: str, timeout_s: float) -> tuple[str, str] | None:
    """(algorithm, hex digest) from the dump's checksum file, or None when none is published."""
    name = url.rsplit("/", 1)[1]
    for sums_url, algorithm in _checksum_urls(url):
        try:
            with urllib.request.urlopen(sums_url, timeout=timeout_s) as r:
                text = r.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                continue
            raise PipelineError(f"{sums_url}: HTTP {exc.code} while fetching the checksum file") from exc
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("*") == name:
                return algorithm, parts[0].lower()
        raise PipelineError(f"{sums_url} does not list {name}; check the dump date and file name")
    return None


def _fetch(url: str, part: Path, timeout_s: float, bar: tqdm) -> None:
    """Append the rest of `url` to `part` (Range from its current size). Raises on any failure."""
    have = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:
            return  # the part file already holds the whole file
        raise
    with response:
        if have and response.status != 206:
            have = 0  # the server ignored Range: start again
        total = response.headers.get("Content-Length")
        if total is not None:
            bar.total = have + int(total)
        bar.n = have
        bar.refresh()
        expected = have + int(total) if total is not None else None
        with part.open("r+b" if have else "wb") as f:
            f.seek(have)
            f.truncate()
            while chunk := response.read(CHUNK):
                f.write(chunk)
                bar.update(len(chunk))
            size = f.tell()
    if expected is not None and size != expected:
        raise http.client.IncompleteRead(b"", expected - size)


def _digest(path: Path, algorithm: str) -> str:
    h = hashlib.new(algorithm)
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def download(cfg: DownloadConfig) -> Path:
    """Download cfg.url into cfg.output_dir and return the final path (skipped if already done)."""
    name = cfg.url.rsplit("/", 1)[1]
    if not name:
        raise PipelineError(f"{cfg.url} does not name a file")
    final = cfg.output_dir / name
    if final.is_file():
        return final
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    part = cfg.output_dir / f"{name}.part"
    checksum = published_checksum(cfg.url, cfg.timeout_s) if cfg.verify else None
    if cfg.verify and checksum is None:
        print(f"download: no checksum file published beside {cfg.url}; the file is not verified")
    with tqdm(desc=f"download {name}", unit="B", unit_scale=True, dynamic_ncols=True) as bar:
        for attempt in range(cfg.retries + 1):
            try:
                _fetch(cfg.url, part, cfg.timeout_s, bar)
                break
            except urllib.error.HTTPError as exc:
                if exc.code in (404, 410):
                    raise PipelineError(
                        f"{cfg.url}: HTTP {exc.code}, no such dump. Check the date (dumps are kept a few "
                        "months; see https://dumps.wikimedia.org/enwiki/) or use another --mirror"
                    ) from exc
                if attempt == cfg.retries or exc.code < 500:
                    raise PipelineError(f"{cfg.url}: HTTP {exc.code} {exc.reason}") from exc
            except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as exc:
                if attempt == cfg.retries:
                    raise PipelineError(
                        f"{cfg.url}: download failed after {cfg.retries + 1} attempts ({exc}); "
                        f"rerun to resume from the {part.stat().st_size if part.exists() else 0} bytes in {part}"
                    ) from exc
            time.sleep(cfg.backoff_s * 2 ** attempt)
    if checksum is not None:
        algorithm, expected = checksum
        actual = _digest(part, algorithm)
        if actual != expected:
            part.unlink()
            raise PipelineError(
                f"{cfg.url}: {algorithm} checksum mismatch (got {actual}, published {expected}); "
                "the damaged download was deleted, rerun to fetch it again"
            )
    part.replace(final)
    return final


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--dump_date", default=DEFAULT_DUMP_DATE, help="YYYYMMDD (default: %(default)s)")
    src.add_argument("--url", help="download this URL instead of the dump for --dump_date")
    p.add_argument("--mirror", default=DEFAULT_MIRROR)
    p.add_argument("--output_dir", type=Path, required=True)
    p.add_argument("--retries", type=int, default=5)
    a = p.parse_args(argv)
    if a.url and a.mirror != DEFAULT_MIRROR:
        p.error("--mirror applies to --dump_date; with --url, put the mirror in the URL")
    url = a.url or dump_url(a.mirror, a.dump_date)
    try:
        path = download(DownloadConfig(url, a.output_dir, retries=a.retries))
    except PipelineError as exc:
        raise SystemExit(f"error: {exc}") from exc
    print(f"download: {path} ({path.stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
