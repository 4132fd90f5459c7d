"""Reading a multistream bz2 dump in parallel: where its streams start, and the pages of a run of them.

Wikimedia publishes every dump also as `<wiki>-<date>-pages-articles-multistream.xml.bz2`: the same
XML compressed as many independent bz2 streams (100 pages each). Each stream decompresses on its
own, so worker processes read different parts of the file at once; a single-stream dump can only
be decompressed from its start, one core's worth. Files recompressed with pbzip2 or lbzip2 are
multistream too, but their streams cut the XML anywhere, pages included. One rule covers both: a
chunk of streams owns the pages whose `<page>` tag starts inside it, and reads on into the
following streams to finish its last page.
"""

from __future__ import annotations

import bz2
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from data.stage import PipelineError

# Every bz2 stream starts "BZh" + block size digit, then its first block's magic (pi in BCD). Blocks
# inside a stream are bit-aligned, so a byte-aligned header + magic is a stream start; by chance
# these 10 bytes occur once in 2^80 positions.
_BLOCK_MAGIC = b"1AY&SY"
_SCAN_BLOCK = 64 << 20
# How many streams past its own a chunk may read to finish its last page (pbzip2 streams hold 900 kB
# of XML: 64 of them are far longer than any Wikipedia page).
MAX_LOOKAHEAD_STREAMS = 64
_PAGE, _END_PAGE = b"<page>", b"</page>"


def stream_offsets(path: Path, progress: Callable[[int], None] | None = None, block_size: int = _SCAN_BLOCK
                   ) -> list[int]:
    """Byte offsets where the bz2 streams of `path` start, followed by the file size (read in `block_size` blocks)."""
    offsets: list[int] = []
    with path.open("rb") as f:
        data = b""
        while block := f.read(block_size):
            data = data[-9:] + block  # a header cut by the read boundary is seen whole in the next pass
            base = f.tell() - len(data)
            i = data.find(_BLOCK_MAGIC, 4)
            while i != -1:
                if data[i - 4:i - 1] == b"BZh" and 0x31 <= data[i - 1] <= 0x39:
                    offset = base + i - 4
                    if not offsets or offset > offsets[-1]:
                        offsets.append(offset)
                i = data.find(_BLOCK_MAGIC, i + 1)
            if progress is not None:
                progress(len(block))
        size = f.tell()
    return offsets + [size]


def chunk_bounds(offsets: list[int], chunk_bytes: int) -> list[tuple[int, int]]:
    """Runs of consecutive streams, (first, end) stream indices, of at least `chunk_bytes` each (but the last)."""
    bounds, first = [], 0
    n = len(offsets) - 1
    for i in range(1, n + 1):
        if offsets[i] - offsets[first] >= chunk_bytes or i == n:
            bounds.append((first, i))
            first = i
    return bounds


def decompress_range(f, start: int, end: int, path: Path) -> bytes:
    f.seek(start)
    try:
        return bz2.decompress(f.read(end - start))
    except (OSError, EOFError, ValueError) as exc:
        raise PipelineError(
            f"{path}: the bz2 stream at byte {start} does not decompress ({exc}); the file is damaged or "
            "truncated: download it again (python -m data.download checks the checksum)"
        ) from exc


def tail_xml(path: Path, offsets: list[int], min_bytes: int = 64) -> bytes:
    """The decompressed XML of the last streams of `path`, at least `min_bytes` of it (or all there is): enough to
    hold the closing tag even when the last stream holds only a piece of it."""
    xml, last = b"", len(offsets) - 1
    with path.open("rb") as f:
        while last > 0 and len(xml) < min_bytes:
            xml = decompress_range(f, offsets[last - 1], offsets[last], path) + xml
            last -= 1
    return xml


def _may_start_page(tail: bytes) -> bool:
    """Whether `tail` ends with a proper prefix of "<page>" (a tag cut by a stream boundary)."""
    return any(tail.endswith(_PAGE[:k]) for k in range(1, len(_PAGE)))


def chunk_pages(path: Path, offsets: tuple[int, ...], own: int) -> Iterator[bytes]:
    """The `<page>...</page>` elements whose start tag lies in streams offsets[0:own].

    `offsets` holds the start of each stream of the chunk, then of up to MAX_LOOKAHEAD_STREAMS
    following streams, then the end of the last one (the next stream's start or the file size).
    """
    n = len(offsets) - 1
    with path.open("rb") as f:
        xml = decompress_range(f, offsets[0], offsets[own], path)
        owned, following = len(xml), own

        def read_on() -> bool:
            nonlocal xml, following
            if following >= n:
                return False
            xml += decompress_range(f, offsets[following], offsets[following + 1], path)
            following += 1
            return True

        if _may_start_page(xml[-len(_PAGE):]):
            read_on()
        pos = xml.find(_PAGE)
        while 0 <= pos < owned:
            end = xml.find(_END_PAGE, pos)
            while end == -1:
                if not read_on():
                    raise PipelineError(
                        f"{path}: the page starting in the bz2 stream at byte {offsets[0]} does not end within "
                        f"{MAX_LOOKAHEAD_STREAMS} further streams; the dump is truncated or not MediaWiki XML"
                    )
                end = xml.find(_END_PAGE, pos)
            end += len(_END_PAGE)
            yield xml[pos:end]
            pos = xml.find(_PAGE, end)


def write_multistream(f: BinaryIO, header: bytes, pages: Iterable[bytes], footer: bytes,
                      pages_per_stream: int = 100) -> None:
    """Write XML as Wikimedia lays out its multistream dumps: `header` (<mediawiki>, <siteinfo>) in a bz2
    stream of its own, then `pages_per_stream` whole pages per stream, then `footer` in a stream of its own."""
    f.write(bz2.compress(header))
    batch: list[bytes] = []
    for page in pages:
        batch.append(page)
        if len(batch) == pages_per_stream:
            f.write(bz2.compress(b"".join(batch)))
            batch = []
    if batch:
        f.write(bz2.compress(b"".join(batch)))
    f.write(bz2.compress(footer))


def split_pages(xml: bytes) -> tuple[bytes, list[bytes], bytes]:
    """A dump's whole XML as (header, pages, footer) for `write_multistream`: each page keeps its
    indentation and newline, so that header + pages + footer is `xml` again."""
    first, last = xml.index(b"  <page>"), xml.rindex(b"</mediawiki>")
    pages = re.findall(rb"  <page>.*?</page>\n", xml[first:last], flags=re.S)
    if b"".join(pages) != xml[first:last]:
        raise ValueError("the XML between the header and </mediawiki> is not a run of <page> elements")
    return xml[:first], pages, xml[last:]
