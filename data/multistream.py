"""Reading a dump in parallel: where its units start, and the pages of a run of them.

Wikimedia publishes every dump also as `<wiki>-<date>-pages-articles-multistream.xml.bz2`: the same
XML compressed as many independent bz2 streams (100 pages each). Each stream decompresses on its
own, so worker processes read different parts of the file at once. Files recompressed with pbzip2
or lbzip2 are multistream too, but their streams cut the XML anywhere, pages included.

A single-stream dump (`pages-articles.xml.bz2`, what NVIDIA's and Habana's scripts download) is one
stream of blocks, each of about 900 kB of XML and with its own CRC. Blocks start at any bit, not
at a byte, and only the stream has a header, so `block_offsets` finds them by their 48-bit magic
number and `decompress_block` gives each a header and an end-of-stream marker of its own: a single-
stream dump is read in parallel too, block by block.

A plain (decompressed) XML dump, as NVIDIA's and Habana's scripts leave it, is read by byte ranges
(`plain_offsets`).

One rule covers every layout: a chunk of units (streams, blocks or byte ranges) owns the pages
whose `<page>` tag starts inside it, and reads on into the following units to finish its last page.
A `<page>` tag never occurs inside a page's text, where XML escapes "<" as "&lt;".

`level` names the layout of a run of offsets: None for bz2 streams at byte offsets, the stream's
block-size digit (1-9) for bz2 blocks at bit offsets, PLAIN_XML for byte ranges of plain XML.
"""

from __future__ import annotations

import bz2
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from data.download import download_again
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


# ----------------------------------------------------------------------------- blocks of a single stream
_BLOCK_BITS = 0x314159265359  # _BLOCK_MAGIC as a 48-bit number: blocks start at any bit
_END_BITS = 0x177245385090  # the end-of-stream marker (sqrt(pi) in BCD), followed by the stream's CRC
_MASK48 = (1 << 48) - 1


def _bit_needles(magic: int) -> list[tuple[int, bytes, int]]:
    """For each bit shift s (the magic starting at bit s of a byte): the whole bytes it fixes, and
    where they start relative to the byte the magic starts in."""
    needles = []
    for shift in range(8):
        window = (magic << (8 - shift)).to_bytes(7, "big")  # the magic in 56 bits, from bit `shift`
        needles.append((shift, window[:6], 0) if shift == 0 else (shift, window[1:6], 1))
    return needles


_BLOCK_NEEDLES = _bit_needles(_BLOCK_BITS)


def _bits(data: bytes, bit: int, count: int) -> int:
    """`count` bits of `data` from bit offset `bit` (most significant bit first), as a number."""
    first, last = bit // 8, (bit + count + 7) // 8
    return (int.from_bytes(data[first:last], "big") >> ((last - first) * 8 - (bit - first * 8) - count)) & (
        (1 << count) - 1)


def stream_level(path: Path) -> int:
    """The block-size digit of the bz2 stream `path` starts with (blocks of at most 100 kB times it)."""
    with path.open("rb") as f:
        header = f.read(4)
    if header[:3] != b"BZh" or not 0x31 <= header[3] <= 0x39:
        raise PipelineError(f"{path} is not a bz2 file")
    return header[3] - 0x30


def block_offsets(path: Path, progress: Callable[[int], None] | None = None, block_size: int = _SCAN_BLOCK
                  ) -> list[int]:
    """Bit offsets where the blocks of the single bz2 stream in `path` start, followed by the bit
    offset of its end-of-stream marker.

    By chance the block magic occurs inside compressed data about once in 2^48 bit positions (a
    few times in 10^4 full dumps; 20 times fewer once the header field after it is checked). The
    stream's CRC, a fold of the block CRCs in order, tells: when it does not add up, the one
    candidate whose removal makes it add up is dropped.
    """
    level = stream_level(path)
    max_orig_ptr = level * 100_000
    starts: list[int] = []
    crcs: list[int] = []
    with path.open("rb") as f:
        data = b""
        while block := f.read(block_size):
            keep = min(len(data), 14)  # a magic and the header fields after it (105 bits) seen whole
            data = data[len(data) - keep:] + block
            base_bit = (f.tell() - len(data)) * 8
            found = []
            for shift, needle, lead in _BLOCK_NEEDLES:
                i = data.find(needle)
                while i != -1:
                    bit = (i - lead) * 8 + shift
                    if bit >= 0 and (bit + 105 + 7) // 8 <= len(data) and _bits(data, bit, 48) == _BLOCK_BITS:
                        found.append(bit)
                    i = data.find(needle, i + 1)
            for bit in sorted(found):
                # origPtr, 24 bits after the CRC and the 'randomised' bit, indexes into the block.
                if base_bit + bit > (starts[-1] if starts else -1) and _bits(data, bit + 81, 24) < max_orig_ptr:
                    starts.append(base_bit + bit)
                    crcs.append(_bits(data, bit + 48, 32))
            if progress is not None:
                progress(len(block))
        size = f.tell()
        f.seek(max(size - 11, 0))
        tail = f.read()
    # The end marker, the stream CRC and 0-7 padding bits end the file.
    tail_bits = int.from_bytes(tail, "big")
    ends = [pad for pad in range(8) if len(tail) == 11 and (tail_bits >> (pad + 32)) & _MASK48 == _END_BITS]
    if not ends:
        raise PipelineError(
            f"{path} is truncated: its bz2 stream does not end with an end-of-stream marker (or bytes follow it). "
            f"{download_again(path)}."
        )
    end = size * 8 - ends[0] - 80
    stream_crc = (tail_bits >> ends[0]) & 0xFFFFFFFF
    while starts and starts[-1] >= end:  # a chance match in the trailer
        starts.pop(), crcs.pop()
    if not starts:
        return [end]  # an empty stream
    if starts[0] != 32:
        raise PipelineError(f"{path}: no bz2 block follows its stream header; the file is damaged. "
                            f"{download_again(path)}")
    false = _false_block_start(crcs, stream_crc, path)
    if false is not None:
        del starts[false], crcs[false]
    return starts + [end]


def _rotl(value: int, count: int) -> int:
    count %= 32
    return ((value << count) | (value >> (32 - count))) & 0xFFFFFFFF


def _false_block_start(crcs: list[int], stream_crc: int, path: Path) -> int | None:
    """None if the block CRCs fold into the stream CRC; else the one index whose removal makes them."""
    n = len(crcs)
    prefix = [0] * (n + 1)  # prefix[k]: the fold of crcs[:k]
    for k, crc in enumerate(crcs):
        prefix[k + 1] = _rotl(prefix[k], 1) ^ crc
    if prefix[n] == stream_crc:
        return None
    suffix = 0  # the fold of crcs[j + 1:], started from 0
    candidates = []
    for j in range(n - 1, -1, -1):
        if _rotl(prefix[j], n - 1 - j) ^ suffix == stream_crc:
            candidates.append(j)
        suffix ^= _rotl(crcs[j], n - 1 - j)
    if len(candidates) != 1 or candidates[0] == 0:
        raise PipelineError(f"{path}: its bz2 block checksums do not add up to the stream's: the file is damaged. "
                            f"{download_again(path)}.")
    return candidates[0]


def decompress_block(f, start: int, end: int, level: int, path: Path) -> bytes:
    """The XML of the bz2 block in bits [start, end) of `f`, made a stream of its own: a stream
    header, the block, an end-of-stream marker and, as the stream CRC, the block's own CRC."""
    first, last = start // 8, (end + 7) // 8
    f.seek(first)
    raw = f.read(last - first)
    n = end - start
    try:
        if len(raw) != last - first or n <= 80:
            raise EOFError(f"{n} bits")
        block = _bits(raw, start - first * 8, n)
        crc = (block >> (n - 80)) & 0xFFFFFFFF  # the block CRC follows the 48-bit magic
        pad = -(n + 80) % 8
        stream = ((block << 80) | (_END_BITS << 32) | crc) << pad
        return bz2.decompress(b"BZh%d" % level + stream.to_bytes((n + 80 + pad) // 8, "big"))
    except (OSError, EOFError, ValueError) as exc:
        raise PipelineError(
            f"{path}: the bz2 block at byte {first} (bit {start % 8}) does not decompress ({exc}); the file is "
            f"damaged or truncated. {download_again(path)}"
        ) from exc


# ----------------------------------------------------------------------------- plain XML
PLAIN_XML = 0  # the `level` of byte ranges of an uncompressed file (bz2 levels are 1-9)
PLAIN_UNIT_BYTES = 1 << 18  # fine enough to balance workers; MAX_LOOKAHEAD_STREAMS of them are 16 MiB


def plain_offsets(size: int, unit_bytes: int = PLAIN_UNIT_BYTES) -> list[int]:
    """Byte ranges of `unit_bytes` that a plain XML file of `size` bytes is read by: their starts, then `size`."""
    return list(range(0, size, unit_bytes)) + [size]


def unit_bits(level: int | None) -> int:
    """How many offset units make a byte: stream and plain offsets count bytes, block offsets bits."""
    return 1 if level is None or level == PLAIN_XML else 8


def unit_name(level: int | None) -> str:
    return "bz2 stream" if level is None else "byte range" if level == PLAIN_XML else "bz2 block"


def decompress_units(f, offsets: Sequence[int], first: int, end: int, level: int | None, path: Path) -> bytes:
    """The XML of units first..end-1: streams at byte `offsets` (level None), blocks at bit offsets, or byte
    ranges of plain XML (PLAIN_XML)."""
    if level is None:
        return decompress_range(f, offsets[first], offsets[end], path)
    if level == PLAIN_XML:
        f.seek(offsets[first])
        data = f.read(offsets[end] - offsets[first])
        if len(data) != offsets[end] - offsets[first]:
            raise PipelineError(f"{path} ends before byte {offsets[end]}, where it went on when extraction began: "
                                "it changed since; extract it again")
        return data
    return b"".join(decompress_block(f, offsets[k], offsets[k + 1], level, path) for k in range(first, end))


# ----------------------------------------------------------------------------- chunks of units
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
            f"truncated. {download_again(path)}"
        ) from exc


def tail_xml(path: Path, offsets: list[int], min_bytes: int = 64, level: int | None = None) -> bytes:
    """The decompressed XML of the last units of `path`, at least `min_bytes` of it (or all there is): enough to
    hold the closing tag even when the last unit holds only a piece of it."""
    xml, last = b"", len(offsets) - 1
    with path.open("rb") as f:
        while last > 0 and len(xml) < min_bytes:
            xml = decompress_units(f, offsets, last - 1, last, level, path) + xml
            last -= 1
    return xml


def _may_start_page(tail: bytes) -> bool:
    """Whether `tail` ends with a proper prefix of "<page>" (a tag cut by a stream boundary)."""
    return any(tail.endswith(_PAGE[:k]) for k in range(1, len(_PAGE)))


def chunk_pages(path: Path, offsets: tuple[int, ...], own: int, level: int | None = None) -> Iterator[bytes]:
    """The `<page>...</page>` elements whose start tag lies in units offsets[0:own].

    `offsets` holds the start of each unit of the chunk, then of up to MAX_LOOKAHEAD_STREAMS
    following units, then the end of the last one, in the layout `level` names (module docstring).
    """
    n = len(offsets) - 1
    with path.open("rb") as f:
        xml = decompress_units(f, offsets, 0, own, level, path)
        owned, following = len(xml), own

        def read_on() -> bool:
            nonlocal xml, following
            if following >= n:
                return False
            xml += decompress_units(f, offsets, following, following + 1, level, path)
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
                        f"{path}: the page starting in the {unit_name(level)}s from byte "
                        f"{offsets[0] // unit_bits(level)} does not end within the {len(xml) - pos:,} bytes of XML "
                        f"from its <page> tag ({MAX_LOOKAHEAD_STREAMS} further {unit_name(level)}s); MediaWiki "
                        "holds a page's text under 2 MiB, so the dump is truncated or not MediaWiki XML"
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
