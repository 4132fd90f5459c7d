"""Stage 2: a MediaWiki XML dump (bz2 or plain, streamed) -> clean article text.

The XML is read with a streaming parser (`xml.etree.ElementTree.iterparse`, constant memory per
page). Pages outside the article namespace (ns 0) and redirects are skipped. Each article's
wikitext is cleaned by wikiextractor 3.1.0 used as a library (`Extractor.clean_text`): templates,
tables, references, file links, lists and markup are dropped; section headings are dropped too.

Output: `<output_dir>/part-NNNNN.txt`, `articles_per_part` articles each, one paragraph per line
and a blank line after each article. Parts are cleaned in parallel worker processes, at most
`2 * workers` parts in flight, so memory stays bounded whatever the dump size.

    python -m data.extract --input enwiki-20261101-pages-articles.xml.bz2 --output_dir text/extracted
"""

from __future__ import annotations

import argparse
import bz2
import io
import os
import queue
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from tqdm import tqdm
from wikiextractor.extract import Extractor

from data import stage
from data.parallel import bounded_map
from data.stage import PipelineError

PART_GLOB = "part-*.txt"


@dataclass(frozen=True)
class ExtractConfig:
    input: Path
    output_dir: Path
    workers: int = 1
    articles_per_part: int = 2000


@dataclass(frozen=True)
class ExtractResult:
    articles: int
    parts: int
    text_bytes: int
    seconds: float


class _Prefetcher(io.RawIOBase):
    """Reads a stream ahead in a background thread, a bounded number of chunks ahead.

    bz2 decompression releases the GIL, so with this the decompression of the next megabytes
    runs while the XML parser works on the current ones, instead of one after the other.
    """

    def __init__(self, source, chunk: int = 1 << 20, depth: int = 8):
        super().__init__()
        self._source = source
        self._queue: queue.Queue[bytes | BaseException] = queue.Queue(depth)
        self._stop = threading.Event()
        self._buffer = memoryview(b"")
        self._eof = False
        self._thread = threading.Thread(target=self._run, args=(chunk,), daemon=True)
        self._thread.start()

    def _put(self, item: bytes | BaseException) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _run(self, chunk: int) -> None:
        try:
            while not self._stop.is_set():
                data = self._source.read(chunk)
                self._put(data)
                if not data:
                    return
        except (OSError, EOFError, ValueError, MemoryError) as exc:  # the reader raises it
            self._put(exc)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if not self._buffer and not self._eof:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
            self._eof = not item
            self._buffer = memoryview(item)
        n = min(len(b), len(self._buffer))
        b[:n] = self._buffer[:n]
        self._buffer = self._buffer[n:]
        return n

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._source.close()
        super().close()


def _open_dump(path: Path):
    """Open a dump for binary reading, checking that it looks like one."""
    if not path.is_file():
        raise PipelineError(f"{path}: no such file; pass a MediaWiki XML dump (.xml or .xml.bz2) with --input")
    with path.open("rb") as f:
        head = f.read(3)
    if head == b"BZh":
        return _Prefetcher(bz2.open(path, "rb"))
    if head[:1] in (b"<", b"\xef", b" ", b"\n", b"\r", b"\t"):
        return path.open("rb")
    raise PipelineError(
        f"{path} is not a MediaWiki XML dump: it is neither bz2-compressed nor XML "
        "(expected e.g. enwiki-<date>-pages-articles.xml.bz2)"
    )


def iter_articles(path: Path) -> Iterator[tuple[str, str]]:
    """Yield (title, wikitext) for each non-redirect page of namespace 0, streaming."""
    try:
        with _open_dump(path) as f:
            events = ET.iterparse(f, events=("start", "end"))
            _, root = next(events)
            if not root.tag.endswith("mediawiki"):
                raise PipelineError(
                    f"{path} is XML but not a MediaWiki dump: its root element is <{root.tag}>, "
                    "expected <mediawiki>"
                )
            for event, elem in events:
                if event != "end" or elem.tag.rsplit("}", 1)[-1] != "page":
                    continue
                if elem.findtext("{*}ns") == "0" and elem.find("{*}redirect") is None:
                    yield elem.findtext("{*}title") or "", elem.findtext("{*}revision/{*}text") or ""
                # Drop the finished page so memory does not grow with the dump.
                root.clear()
    except EOFError as exc:
        raise PipelineError(
            f"{path} is truncated: the bz2 stream ends before its end-of-stream marker. "
            "Download it again (python -m data.download resumes and checks the checksum)."
        ) from exc
    except OSError as exc:
        raise PipelineError(f"{path} is not a readable bz2 file ({exc}); download it again") from exc
    except ET.ParseError as exc:
        raise PipelineError(
            f"{path} is not well-formed MediaWiki XML ({exc}); the file is damaged or truncated"
        ) from exc
    except StopIteration as exc:
        raise PipelineError(f"{path} is empty: no XML in it") from exc


def clean_article(title: str, wikitext: str) -> list[str]:
    """The article's paragraphs as plain text, without headings, lists, tables or markup."""
    extractor = Extractor("0", "0", "", title, [])
    # wikiextractor works on the dump's escaped text (it unescapes after stripping markup);
    # iterparse has already unescaped it, so escape it back to keep its order of operations.
    lines = extractor.clean_text(escape(wikitext), mark_headers=True, expand_templates=False, html_safe=False)
    paragraphs = []
    for line in lines:
        line = " ".join(line.split())
        if line and not line.startswith("#"):
            paragraphs.append(line)
    return paragraphs


def _write_part(task: tuple[Path, list[tuple[str, str]]]) -> tuple[int, int]:
    """Clean one batch of articles into one part file. Returns (articles written, bytes)."""
    path, articles = task
    docs = []
    for title, wikitext in articles:
        paragraphs = clean_article(title, wikitext)
        if paragraphs:
            docs.append("\n".join(paragraphs) + "\n\n")
    data = "".join(docs).encode("utf-8")
    with stage.atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return len(docs), len(data)


def _count_part(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    return data.count(b"\n\n"), len(data)


def part_path(output_dir: Path, index: int) -> Path:
    return output_dir / f"part-{index:05d}.txt"


def list_parts(stage_dir: Path) -> list[Path]:
    return sorted(stage_dir.glob(PART_GLOB))


def extract(cfg: ExtractConfig) -> ExtractResult:
    if cfg.articles_per_part < 1:
        raise PipelineError(f"articles_per_part must be >= 1, got {cfg.articles_per_part}")
    if not cfg.input.is_file():
        raise PipelineError(f"{cfg.input}: no such file; pass a MediaWiki XML dump (.xml or .xml.bz2) with --input")
    params = {"input": stage.file_identity(cfg.input), "articles_per_part": cfg.articles_per_part}
    done = stage.begin(cfg.output_dir, params)
    if done is not None:
        return ExtractResult(**done)
    start = time.perf_counter()

    def batches() -> Iterator[tuple[Path, list[tuple[str, str]]] | Path]:
        batch: list[tuple[str, str]] = []
        index = 0
        for article in iter_articles(cfg.input):
            batch.append(article)
            if len(batch) == cfg.articles_per_part:
                yield _task(index, batch)
                batch, index = [], index + 1
        if batch:
            yield _task(index, batch)

    def _task(index: int, batch: list[tuple[str, str]]):
        path = part_path(cfg.output_dir, index)
        # A part left by an interrupted run is complete (it was renamed into place): reuse it.
        return path if path.is_file() else (path, batch)

    articles = text_bytes = parts = 0
    with tqdm(desc="extract", unit=" articles", dynamic_ncols=True) as bar:
        for n, nbytes in bounded_map(_part_or_count, batches(), cfg.workers):
            articles += n
            text_bytes += nbytes
            parts += 1
            bar.update(n)
    if articles == 0:
        raise PipelineError(f"{cfg.input}: the dump holds no articles (namespace 0, not redirects, with text)")
    summary = {"articles": articles, "parts": parts, "text_bytes": text_bytes,
               "seconds": round(time.perf_counter() - start, 3)}
    return ExtractResult(**stage.finish(cfg.output_dir, params, summary))


def _part_or_count(task: tuple[Path, list[tuple[str, str]]] | Path) -> tuple[int, int]:
    return _count_part(task) if isinstance(task, Path) else _write_part(task)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", type=Path, required=True, help="MediaWiki XML dump, .xml or .xml.bz2")
    p.add_argument("--output_dir", type=Path, required=True)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--articles_per_part", type=int, default=2000)
    a = p.parse_args(argv)
    r = stage.cli_call(extract, ExtractConfig(a.input, a.output_dir, a.workers, a.articles_per_part))
    print(f"extract: {r.articles} articles, {r.parts} parts, {r.text_bytes / 1e6:.1f} MB of text, {r.seconds:.1f} s")


if __name__ == "__main__":
    main()
