"""bz2 dumps are read in parallel, by streams (multistream) or by blocks (single stream), and give
exactly the text of the dump's XML read serially."""

from __future__ import annotations

import bz2
import json
import re
from pathlib import Path

import pytest

from data import multistream
from data.extract import CHUNK_RECORD, ExtractConfig, _extract_serial, extract, list_parts
from data.stage import PipelineError


def _xml(sample_dump: Path) -> bytes:
    return bz2.decompress(sample_dump.read_bytes())


def cut_anywhere_multistream(xml: bytes, out: Path, stream_bytes: int) -> Path:
    """As pbzip2 or lbzip2 write them: fixed slices of the XML, each its own stream, cutting pages anywhere."""
    return cut_at_multistream(xml, out, list(range(stream_bytes, len(xml), stream_bytes)))


def cut_at_multistream(xml: bytes, out: Path, cuts: list[int]) -> Path:
    bounds = [0, *cuts, len(xml)]
    out.write_bytes(b"".join(bz2.compress(xml[a:b]) for a, b in zip(bounds, bounds[1:])))
    return out


@pytest.fixture(scope="module")
def serial_text(sample_dump, tmp_path_factory) -> Path:
    """The reference: the sample read by one process with a streaming XML parser (the serial reader)."""
    out = tmp_path_factory.mktemp("serial") / "extracted"
    out.mkdir()
    _extract_serial(ExtractConfig(sample_dump, out, workers=1, articles_per_part=40))
    return out


@pytest.fixture(scope="module")
def plain_sample(sample_dump, tmp_path_factory) -> Path:
    """The sample decompressed, as NVIDIA's and Habana's scripts leave a dump."""
    path = tmp_path_factory.mktemp("plain") / "enwiki-sample-pages-articles.xml"
    path.write_bytes(_xml(sample_dump))
    return path


def _parts(directory: Path) -> list[bytes]:
    return [p.read_bytes() for p in list_parts(directory)]


def test_stream_offsets_are_where_each_stream_starts(sample_dump, tmp_path):
    xml = _xml(sample_dump)
    path = cut_anywhere_multistream(xml, tmp_path / "cut.xml.bz2", 300_000)
    sizes = [len(bz2.compress(xml[i:i + 300_000])) for i in range(0, len(xml), 300_000)]
    expected = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    assert multistream.stream_offsets(path) == expected and len(expected) == 22
    assert multistream.stream_offsets(sample_dump) == [0, sample_dump.stat().st_size]
    assert multistream.chunk_bounds(expected, 1) == [(k, k + 1) for k in range(21)]
    assert multistream.chunk_bounds(expected, 10**9) == [(0, 21)]


def test_read_boundaries_do_not_hide_a_stream_header(multistream_sample):
    path = multistream_sample
    expected = multistream.stream_offsets(path)
    assert len(expected) == 6  # header, 100 + 100 + 6 pages, footer; then the file size
    # Blocks so small that every stream header straddles two reads, at every possible cut.
    for block_size in (7, 8, 9, 10, 11, 4096 + 3):
        assert multistream.stream_offsets(path, block_size=block_size) == expected


@pytest.mark.parametrize("layout", ["wikimedia", "cut_anywhere", "cut_tags"])
def test_multistream_dump_gives_the_single_stream_text(sample_dump, multistream_sample, serial_text, tmp_path,
                                                       layout):
    xml = _xml(sample_dump)
    if layout == "wikimedia":
        dump = multistream_sample
    elif layout == "cut_anywhere":
        dump = cut_anywhere_multistream(xml, tmp_path / "enwiki-x-pages-articles.xml.bz2", 97_001)
    else:
        # Streams that end inside a <page> or </page> tag, at every possible place in it.
        starts = [m.start() for m in re.finditer(rb"<page>", xml)][1::20]
        ends = [m.start() for m in re.finditer(rb"</page>", xml)][5::20]
        cuts = [p + 1 + k % 5 for k, p in enumerate(starts)] + [p + 1 + k % 6 for k, p in enumerate(ends)]
        dump = cut_at_multistream(xml, tmp_path / "cut-tags.xml.bz2", sorted(cuts))
    assert len(multistream.stream_offsets(dump)) > 3
    out = tmp_path / "extracted"
    result = extract(ExtractConfig(dump, out, workers=2, articles_per_part=40, chunk_bytes=60_000))
    assert _parts(out) == _parts(serial_text) and len(_parts(out)) == 3
    assert (result.articles, result.parts) == (105, 3)


def _rerun_without_the_last_part(cfg: ExtractConfig, monkeypatch) -> list[int]:
    """Extract again as if killed before the last part was written; return where each chunk read starts."""
    (cfg.output_dir / "_COMPLETE.json").unlink()
    list_parts(cfg.output_dir)[-1].unlink()
    read: list[int] = []
    real = multistream.chunk_pages

    def counting(path, offsets, own, level):
        read.append(offsets[0])
        return real(path, offsets, own, level)

    monkeypatch.setattr(multistream, "chunk_pages", counting)
    extract(cfg)
    return read


def _units_holding_articles_from(out: Path, offsets: list[int], article: int) -> list[int]:
    """The first offsets of the chunks (one unit each) that hold articles from `article` on, by the
    chunk record of the run that wrote `out`."""
    counts = json.loads((out / CHUNK_RECORD).read_text())["articles"]
    first = [sum(counts[:k]) for k in range(len(counts))]
    return [offsets[k] for k, (a, n) in enumerate(zip(first, counts)) if n and a + n > article]


def test_resume_reads_only_chunks_whose_parts_are_missing(make_multistream, serial_text, tmp_path, monkeypatch):
    dump = make_multistream(10)
    out = tmp_path / "extracted"
    cfg = ExtractConfig(dump, out, workers=1, articles_per_part=40, chunk_bytes=1)  # a chunk per stream
    extract(cfg)
    chunk_articles = json.loads((out / CHUNK_RECORD).read_text())["articles"]
    assert sum(chunk_articles) == 106 and len(chunk_articles) == 23
    # Articles 80..105 are the last part's: only the chunks holding them are read again.
    needed = _units_holding_articles_from(out, multistream.stream_offsets(dump), 80)
    read = _rerun_without_the_last_part(cfg, monkeypatch)
    assert _parts(out) == _parts(serial_text)
    assert read == needed and 0 < len(read) < 10


def test_truncated_multistream_dump_is_named(multistream_sample, tmp_path):
    dump = multistream_sample
    truncated = tmp_path / "truncated.xml.bz2"
    truncated.write_bytes(dump.read_bytes()[:-5000])
    with pytest.raises(PipelineError, match=f"{re.escape(str(truncated))}: the bz2 stream at byte \\d+ does not"):
        extract(ExtractConfig(truncated, tmp_path / "out", chunk_bytes=100_000))
    assert not (tmp_path / "out" / "_COMPLETE.json").exists()


@pytest.mark.parametrize("streams_dropped", [1, 2])
def test_multistream_dump_cut_at_a_stream_boundary_is_named(multistream_sample, tmp_path, streams_dropped):
    # Each remaining stream decompresses: only the missing </mediawiki> (and pages) tell.
    offsets = multistream.stream_offsets(multistream_sample)
    truncated = tmp_path / "truncated.xml.bz2"
    truncated.write_bytes(multistream_sample.read_bytes()[:offsets[-1 - streams_dropped]])
    with pytest.raises(PipelineError, match=f"{re.escape(str(truncated))} is truncated: its last bz2 stream does not "
                                            "end with </mediawiki>.*Download or copy it again"):
        extract(ExtractConfig(truncated, tmp_path / "out"))
    assert list_parts(tmp_path / "out") == []


def test_closing_tag_cut_across_the_last_streams_is_complete(sample_dump, serial_text, tmp_path):
    xml = _xml(sample_dump)
    dump = cut_at_multistream(xml, tmp_path / "cut-end.xml.bz2", [len(xml) // 2, len(xml) - 5])
    extract(ExtractConfig(dump, tmp_path / "out", articles_per_part=40))
    assert _parts(tmp_path / "out") == _parts(serial_text)


def test_multistream_file_that_is_not_mediawiki_is_refused(tmp_path):
    path = tmp_path / "feed.xml.bz2"
    path.write_bytes(bz2.compress(b"<rss><channel>") + bz2.compress(b"</channel></rss>"))
    with pytest.raises(PipelineError, match=f"^{re.escape(str(path))} is XML but not a MediaWiki dump: its root "
                                            "element is <rss>, expected <mediawiki>$"):
        extract(ExtractConfig(path, tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # refused before the stage begins


# ----------------------------------------------------------------------------- single-stream dumps, by blocks
def _block_crcs(path: Path, offsets: list[int]) -> tuple[list[int], int]:
    """The CRC after each block magic, and the stream CRC after the end-of-stream marker."""
    data = path.read_bytes()
    crcs = [multistream._bits(data, bit + 48, 32) for bit in offsets[:-1]]
    return crcs, multistream._bits(data, offsets[-1] + 48, 32)


def test_block_offsets_are_where_each_block_starts(sample_dump):
    offsets = multistream.block_offsets(sample_dump)
    # bzip2 -9 cuts the sample's 6.1 MB of XML into blocks of about 900 kB: 7 of them, then the end marker.
    assert len(offsets) == 8 and offsets[0] == 32 and offsets[-1] < sample_dump.stat().st_size * 8
    assert sorted(offsets) == offsets and any(bit % 8 for bit in offsets)  # blocks start at any bit
    with sample_dump.open("rb") as f:
        pieces = [multistream.decompress_units(f, offsets, k, k + 1, 9, sample_dump) for k in range(7)]
    assert b"".join(pieces) == _xml(sample_dump)
    # Reads so small that every magic and its header fields straddle two or more of them.
    for block_size in (7, 13, 14, 15, 4096 + 3):
        assert multistream.block_offsets(sample_dump, block_size=block_size) == offsets


@pytest.mark.parametrize("workers, chunk_bytes", [(1, 1), (2, 300_000), (2, 4 << 20)])
def test_single_stream_dump_read_by_blocks_gives_the_serial_text(sample_dump, serial_text, tmp_path, workers,
                                                                 chunk_bytes):
    out = tmp_path / "extracted"
    result = extract(ExtractConfig(sample_dump, out, workers=workers, articles_per_part=40, chunk_bytes=chunk_bytes))
    assert _parts(out) == _parts(serial_text) and (result.articles, result.parts) == (105, 3)
    # Every chunk of blocks was read by a worker: the record holds one article count per chunk.
    counts = json.loads((out / CHUNK_RECORD).read_text())["articles"]
    assert sum(counts) == 106 and len(counts) == (7 if chunk_bytes == 1 else 4)  # 2 chunks per worker at least


def test_a_chance_block_magic_is_found_out_by_the_stream_crc(sample_dump):
    """The 48-bit block magic occurs inside compressed data once in 2^48 bit positions: the candidate
    whose removal makes the block CRCs fold into the stream CRC is the false one."""
    crcs, stream_crc = _block_crcs(sample_dump, multistream.block_offsets(sample_dump))
    assert multistream._false_block_start(crcs, stream_crc, sample_dump) is None
    for index in range(1, len(crcs) + 1):
        with_false = [*crcs[:index], 0x9E3779B9, *crcs[index:]]
        assert multistream._false_block_start(with_false, stream_crc, sample_dump) == index
    with pytest.raises(PipelineError, match="block checksums do not add up to the stream's: the file is damaged"):
        multistream._false_block_start([crcs[0], 1, *crcs[1:], 2], stream_crc, sample_dump)


def test_no_workers_is_refused(sample_dump, tmp_path):
    with pytest.raises(PipelineError, match="workers must be >= 1, got 0"):
        extract(ExtractConfig(sample_dump, tmp_path / "out", workers=0))


def test_damaged_single_stream_dump_names_the_block(sample_dump, tmp_path):
    data = bytearray(sample_dump.read_bytes())
    data[1_000_000] ^= 0xFF
    damaged = tmp_path / "damaged.xml.bz2"
    damaged.write_bytes(bytes(data))
    with pytest.raises(PipelineError, match=rf"{re.escape(str(damaged))}: the bz2 block at byte \d+ \(bit \d\) does "
                                            "not decompress .*damaged or truncated"):
        extract(ExtractConfig(damaged, tmp_path / "out", workers=2))
    assert not (tmp_path / "out" / "_COMPLETE.json").exists()


def test_single_stream_resume_reads_only_the_blocks_of_missing_parts(sample_dump, serial_text, tmp_path,
                                                                     monkeypatch):
    out = tmp_path / "extracted"
    cfg = ExtractConfig(sample_dump, out, workers=1, articles_per_part=40, chunk_bytes=1)  # a chunk per block
    extract(cfg)
    needed = _units_holding_articles_from(out, multistream.block_offsets(sample_dump), 80)
    read = _rerun_without_the_last_part(cfg, monkeypatch)
    assert _parts(out) == _parts(serial_text)
    assert read == needed and 0 < len(read) < 7  # the sample's 7 blocks hold 8, 20, 11, 22, 22, 14, 9 articles


# ----------------------------------------------------------------------------- plain XML, by byte ranges
@pytest.mark.parametrize("unit_bytes, chunk_bytes", [(16_384, 1), (65_536, 300_000), (1 << 20, 1 << 20)])
def test_byte_ranges_own_each_page_once(plain_sample, unit_bytes, chunk_bytes):
    """Ranges cut pages anywhere (tags included); each page comes whole from the chunk its <page> starts in."""
    xml = plain_sample.read_bytes()
    offsets = multistream.plain_offsets(len(xml), unit_bytes)
    assert offsets[0] == 0 and offsets[-1] == len(xml) and len(offsets) == -(-len(xml) // unit_bytes) + 1
    pages = []
    for first, end in multistream.chunk_bounds(offsets, chunk_bytes):
        stop = min(end + multistream.MAX_LOOKAHEAD_STREAMS, len(offsets) - 1)
        pages += multistream.chunk_pages(plain_sample, tuple(offsets[first:stop + 1]), end - first,
                                         multistream.PLAIN_XML)
    expected = [page.strip() for page in multistream.split_pages(xml)[1]]
    assert pages == expected and len(pages) == 206


@pytest.mark.parametrize("cut", range(7))
def test_a_page_tag_cut_by_a_range_boundary_belongs_to_the_range_it_starts_in(plain_sample, cut):
    """A boundary `cut` bytes into the 100th page's "<page>": from 1 to 5 the tag starts in the first range, which
    reads on to see the whole tag; at 0 it starts the second range (and 6 is just past the tag)."""
    xml = plain_sample.read_bytes()
    expected = [page.strip() for page in multistream.split_pages(xml)[1]]
    start = xml.index(expected[99])
    offsets = (0, start + cut, len(xml))
    first = list(multistream.chunk_pages(plain_sample, offsets, 1, multistream.PLAIN_XML))
    second = list(multistream.chunk_pages(plain_sample, offsets[1:], 1, multistream.PLAIN_XML))
    assert len(first) == (99 if cut == 0 else 100) and first + second == expected


@pytest.mark.parametrize("workers, chunk_bytes, chunks", [(1, 1, 24), (2, 300_000, 12), (2, 4 << 20, 4)])
def test_plain_xml_read_by_byte_ranges_gives_the_serial_text(plain_sample, serial_text, tmp_path, workers,
                                                             chunk_bytes, chunks):
    out = tmp_path / "extracted"
    result = extract(ExtractConfig(plain_sample, out, workers=workers, articles_per_part=40, chunk_bytes=chunk_bytes))
    assert _parts(out) == _parts(serial_text) and (result.articles, result.parts) == (105, 3)
    counts = json.loads((out / CHUNK_RECORD).read_text())["articles"]
    # 6.1 MB in 24 ranges of 256 KiB: a chunk per range, chunks of 2 ranges, or 2 chunks per worker
    assert sum(counts) == 106 and len(counts) == chunks


def test_plain_xml_with_a_long_prolog_is_read(plain_sample, serial_text, tmp_path):
    """Its root was looked for in the first 64 KiB: a comment longer than that before <mediawiki> was refused as
    "its root element is <?>"."""
    long = tmp_path / "long-prolog.xml"
    long.write_bytes(b'<?xml version="1.0"?>\n<!-- ' + b"x" * 70_000 + b" -->\n" + plain_sample.read_bytes())
    result = extract(ExtractConfig(long, tmp_path / "extracted", workers=2, articles_per_part=40))
    assert _parts(tmp_path / "extracted") == _parts(serial_text) and result.articles == 105


def test_plain_xml_resume_reads_only_the_ranges_of_missing_parts(plain_sample, serial_text, tmp_path, monkeypatch):
    out = tmp_path / "extracted"
    cfg = ExtractConfig(plain_sample, out, workers=1, articles_per_part=40, chunk_bytes=1)  # a chunk per range
    extract(cfg)
    needed = _units_holding_articles_from(out, multistream.plain_offsets(plain_sample.stat().st_size), 80)
    read = _rerun_without_the_last_part(cfg, monkeypatch)
    assert _parts(out) == _parts(serial_text)
    assert read == needed and 0 < len(read) < 24


def test_damaged_or_truncated_plain_xml_is_named(plain_sample, tmp_path):
    xml = plain_sample.read_bytes()
    truncated = tmp_path / "truncated.xml"
    truncated.write_bytes(xml[:4_000_000])
    with pytest.raises(PipelineError, match=f"{re.escape(str(truncated))} is truncated: its last byte range does not "
                                            "end with </mediawiki>"):
        extract(ExtractConfig(truncated, tmp_path / "a", workers=2))
    assert list_parts(tmp_path / "a") == []
    damaged = tmp_path / "damaged.xml"
    cut = xml.index(b"</title>", 3_000_000)
    damaged.write_bytes(xml[:cut] + xml[cut + 3:])
    with pytest.raises(PipelineError, match=rf"{re.escape(str(damaged))}: a page in the byte ranges from byte \d+ is "
                                            "not well-formed XML .*damaged or truncated"):
        extract(ExtractConfig(damaged, tmp_path / "b", workers=2))
    assert not (tmp_path / "b" / "_COMPLETE.json").exists()
    commented = tmp_path / "commented.xml"
    commented.write_bytes(b'<?xml version="1.0"?>\n<!-- <mediawiki> -->\n<feed>' + xml[xml.index(b"<siteinfo>"):])
    with pytest.raises(PipelineError, match="XML but not a MediaWiki dump: its root element is <feed>"):
        extract(ExtractConfig(commented, tmp_path / "c"))
    # An entity XML does not define in <siteinfo>: the workers' reader named it with a ParseError traceback.
    bad_site = tmp_path / "bad-siteinfo.xml"
    bad_site.write_bytes(xml.replace(b"<sitename>", b"<sitename>&nbsp;", 1))
    with pytest.raises(PipelineError, match=rf"^{re.escape(str(bad_site))} is not well-formed MediaWiki XML: its "
                                            r"<siteinfo> does not parse \(undefined entity"):
        extract(ExtractConfig(bad_site, tmp_path / "d", workers=2))



def test_plain_xml_cut_short_after_its_ranges_were_laid_out_is_named(plain_sample, tmp_path):
    """The byte ranges follow from the file's size when extraction begins; a file that shrinks afterwards (a copy
    still being written) is named, not read as a short last range."""
    xml = plain_sample.read_bytes()
    offsets = multistream.plain_offsets(len(xml))
    cut = tmp_path / "cut.xml"
    cut.write_bytes(xml[:offsets[-2] + 10])
    with cut.open("rb") as f:
        assert multistream.decompress_units(f, offsets, 0, 1, multistream.PLAIN_XML, cut) == xml[:offsets[1]]
        with pytest.raises(PipelineError, match=rf"^{re.escape(str(cut))} ends before byte {len(xml)}, where it went "
                                                "on when extraction began: it changed since; extract it again$"):
            multistream.decompress_units(f, offsets, len(offsets) - 2, len(offsets) - 1, multistream.PLAIN_XML, cut)


# ----------------------------------------------------------------------------- pages that are not articles
def _expected_page_counts(xml: bytes) -> tuple[int, int, int]:
    """(pages, redirects in namespace 0, pages of other namespaces), read with plain regexes."""
    pages = re.findall(rb"<page>(.*?)</page>", xml, flags=re.S)
    namespaces = [re.search(rb"<ns>(\d+)</ns>", page)[1] for page in pages]
    redirects = sum(ns == b"0" and b"<redirect" in page for ns, page in zip(namespaces, pages))
    return len(pages), redirects, sum(ns != b"0" for ns in namespaces)


@pytest.mark.parametrize("form, workers, chunk_bytes", [("single-stream", 1, 1), ("single-stream", 2, 4 << 20),
                                                        ("multistream", 2, 60_000), ("plain", 1, 1),
                                                        ("plain", 2, 300_000)])
def test_pages_that_are_not_articles_are_counted_alike_by_every_reader(sample_dump, multistream_sample, plain_sample,
                                                                       tmp_path, form, workers, chunk_bytes):
    """"articles" were the documents written, with nothing said of the dump's other pages."""
    dump = {"single-stream": sample_dump, "multistream": multistream_sample, "plain": plain_sample}[form]
    pages, redirects, other = _expected_page_counts(_xml(sample_dump))
    assert (pages, redirects, other) == (206, 99, 1)
    cfg = ExtractConfig(dump, tmp_path / "extracted", workers=workers, articles_per_part=40, chunk_bytes=chunk_bytes)
    result = extract(cfg)
    # 106 pages are articles; "List of anthropologists", all lists and headings, has no text once cleaned.
    expected = (105, pages, redirects, other, 1)
    assert (result.articles, result.pages, result.redirects, result.other_namespaces, result.empty) == expected
    assert result.line().startswith("105 articles of 206 pages (not counted: 99 redirects, 1 page outside the "
                                    "article namespace, 1 article empty once cleaned), 3 parts, 2.6 MB of text")
    # Resumed without the last part: the chunks not read again count from the chunk record.
    (cfg.output_dir / "_COMPLETE.json").unlink()
    list_parts(cfg.output_dir)[-1].unlink()
    resumed = extract(cfg)
    assert (resumed.articles, resumed.pages, resumed.redirects, resumed.other_namespaces, resumed.empty) == expected

    serial = _extract_serial(ExtractConfig(dump, tmp_path / "serial", workers=workers, articles_per_part=40))
    assert serial.documents == 105 and dict(serial.pages) == {"article": 106, "redirect": 99, "other_namespace": 1,
                                                              "no_namespace": 0, "other_model": 0}


def _export_04(xml: bytes) -> bytes:
    """The dump as MediaWiki's export-0.4 and 0.5 wrote it: no <ns> element (0.6 added it), and a
    redirect flag without its target."""
    xml = re.sub(rb"\n\s*<ns>\d+</ns>", b"", xml.replace(b"export-0.10", b"export-0.4"))
    return re.sub(rb'<redirect title="[^"]*" />', b"<redirect />", xml.replace(b'version="0.10"', b'version="0.4"'))


@pytest.mark.parametrize("form", ["plain", "multistream", "one reader"])
def test_a_dump_without_ns_elements_takes_namespaces_from_the_title_prefixes(sample_dump, serial_text, tmp_path,
                                                                            form):
    """Every page of an export-0.4 dump counted as outside namespace 0: "holds no articles", no reason given."""
    xml = _export_04(_xml(sample_dump))
    assert b"<ns>" not in xml and b"<namespace key=\"4\" case=\"first-letter\">Wikipedia</namespace>" in xml
    dump = tmp_path / ("old.xml" if form == "plain" else "old.xml.bz2")
    if form == "plain":
        dump.write_bytes(xml)
    else:
        header, pages, footer = multistream.split_pages(xml)
        with dump.open("wb") as f:
            multistream.write_multistream(f, header, pages, footer, 50)
    out = tmp_path / "extracted"
    if form == "one reader":
        out.mkdir()
        done = _extract_serial(ExtractConfig(dump, out, workers=2, articles_per_part=40))
        assert dict(done.pages) == {"article": 106, "redirect": 99, "other_namespace": 1, "no_namespace": 0, "other_model": 0}
    else:
        result = extract(ExtractConfig(dump, out, workers=2, articles_per_part=40, chunk_bytes=100_000))
        assert (result.articles, result.redirects, result.other_namespaces, result.no_namespace) == (105, 99, 1, 0)
    assert _parts(out) == _parts(serial_text)  # "Wikipedia:..." is left out by its prefix, as by its <ns>

    # Without the <siteinfo> that lists the namespaces, no page's namespace is known: the error says so.
    bare = tmp_path / "bare.xml"
    bare.write_bytes(re.sub(rb"<siteinfo>.*?</siteinfo>", b"", xml, flags=re.S))
    with pytest.raises(PipelineError, match=r"holds no articles .*: of its 206 pages, 0 redirects, 0 pages outside "
                                            r"the article namespace, 206 pages of unknown namespace \(no <ns> element, "
                                            r"and no <namespaces> list in the dump's <siteinfo>"):
        extract(ExtractConfig(bare, tmp_path / "bare", workers=2))


def test_a_page_that_does_not_end_within_the_look_ahead_says_how_far_it_was_read(tmp_path):
    """A page is read on for at most MAX_LOOKAHEAD_STREAMS units past its chunk; one that ends in the last of them
    is whole, one that ends later is refused with how many bytes were read (the old line said "64 further units",
    which gave no size to compare with MediaWiki's 2 MiB)."""
    unit, n = 10, multistream.MAX_LOOKAHEAD_STREAMS
    offsets = tuple(range(0, (n + 2) * unit, unit))  # one unit of the chunk's own, n to read on, and the end
    fits = tmp_path / "fits.xml"
    fits.write_bytes((b"<page>" + b"x" * ((n + 1) * unit - 13) + b"</page>").ljust((n + 1) * unit))
    assert [len(p) for p in multistream.chunk_pages(fits, offsets, 1, multistream.PLAIN_XML)] == [(n + 1) * unit]
    long = tmp_path / "long.xml"
    long.write_bytes(b"<x/>" + b"<page>" + b"x" * ((n + 1) * unit + 100) + b"</page>")  # read from its <page>
    with pytest.raises(PipelineError, match=rf"^{re.escape(str(long))}: the page starting in the byte ranges from "
                                            rf"byte 0 does not end within the {(n + 1) * unit - 4:,} bytes of XML from its "
                                            rf"<page> tag \({n} further byte ranges\); MediaWiki holds a page's text "
                                            "under 2 MiB, so the dump is truncated or not MediaWiki XML$"):
        list(multistream.chunk_pages(long, offsets, 1, multistream.PLAIN_XML))
