"""The demo's generated dump: a real MediaWiki export that the pipeline's extractor cleans."""

from __future__ import annotations

import bz2
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from data.demo_dump import DumpStats, generate_demo_dump
from data.multistream import stream_offsets

NS = "{http://www.mediawiki.org/xml/export-0.10/}"


@pytest.fixture(scope="module")
def stats(tmp_path_factory) -> DumpStats:
    return generate_demo_dump(tmp_path_factory.mktemp("dump") / "demo.xml.bz2", articles=60, seed=7)


@pytest.fixture(scope="module")
def dump(stats: DumpStats) -> Path:
    return stats.path


def test_is_a_mediawiki_export_with_markup_redirects_and_other_namespaces(dump: Path, stats: DumpStats):
    raw = bz2.decompress(dump.read_bytes())
    root = ET.fromstring(raw)
    assert root.tag == f"{NS}mediawiki" and root.get("version") == "0.10"
    pages = root.findall(f"{NS}page")
    articles = [p for p in pages if p.findtext(f"{NS}ns") == "0" and p.find(f"{NS}redirect") is None]
    redirects = [p for p in pages if p.find(f"{NS}redirect") is not None]
    others = [p for p in pages if p.findtext(f"{NS}ns") != "0"]
    assert len(articles) == 60 and len(redirects) > 10 and len(others) >= 4
    # What the generator reports is what it wrote: a template and a category page every 25 articles.
    assert (stats.articles, stats.redirects, stats.other_namespace) == (len(articles), len(redirects), len(others))
    assert len(others) == 6 and stats.bytes_xml == len(raw) - raw.index(b"  <page>") - len(b"</mediawiki>\n")
    assert dump.stat().st_mode & 0o777 == 0o644  # an ordinary shared file, not mkstemp's 0600
    titles = [p.findtext(f"{NS}title") for p in pages]
    assert len(titles) == len(set(titles)), "page titles must be unique, as in a real dump"
    article_titles = {p.findtext(f"{NS}title") for p in articles}
    for page in redirects:  # every redirect points to an article that exists
        target = page.find(f"{NS}redirect").get("title")
        assert target in article_titles and target != page.findtext(f"{NS}title")
        assert page.findtext(f"{NS}revision/{NS}text").startswith(f"#REDIRECT [[{target}]]")
    wikitext = "\n".join(p.findtext(f"{NS}revision/{NS}text") for p in articles)
    for markup in ("{{Infobox", "{| class=\"wikitable\"", "<ref>", "{{cite book", "[[Category:", "[[File:",
                   "== History ==", "'''", "* [[", "|}"):
        assert markup in wikitext, f"the demo dump lacks {markup!r}, which extraction must strip"
    ids = [int(p.findtext(f"{NS}id")) for p in pages]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    # Laid out as Wikimedia's multistream files: the header, 100 pages per bz2 stream, the closing tag.
    offsets = stream_offsets(dump)
    streams = [bz2.decompress(dump.read_bytes()[a:b]) for a, b in zip(offsets, offsets[1:])]
    assert streams[0].lstrip().startswith(b"<mediawiki") and b"<page>" not in streams[0]
    assert [s.count(b"<page>") for s in streams[1:-1]] == [100] * (len(pages) // 100) + (
        [len(pages) % 100] if len(pages) % 100 else [])
    assert streams[-1] == b"</mediawiki>\n"


def test_deterministic_for_a_seed(dump: Path, tmp_path: Path):
    again = generate_demo_dump(tmp_path / "again.xml.bz2", articles=60, seed=7).path
    other = generate_demo_dump(tmp_path / "other.xml.bz2", articles=60, seed=8).path
    assert again.read_bytes() == dump.read_bytes()
    assert other.read_bytes() != dump.read_bytes()
    assert not list(tmp_path.glob(".*")), "no temporary file is left behind"


def test_the_pipeline_extractor_strips_everything(dump: Path):
    from data.extract import clean_article, iter_articles

    articles = list(iter_articles(dump))
    assert len(articles) == 60  # redirects and template/category pages skipped
    text = "\n".join(p for title, wikitext in articles for p in clean_article(title, wikitext))
    for leftover in ("{{", "}}", "[[", "]]", "<ref", "|}", "{|", "'''", "Category:", "File:", "thumb|"):
        assert leftover not in text, f"{leftover!r} survived extraction"
    assert "is a city in" in text and "was founded in" in text and "flows into the" in text
    assert len(text.split()) > 60 * 50


def test_every_kind_of_article_is_written_and_animals_fill_in_for_the_rivers_that_ran_out(dump: Path):
    """The kinds take turns (city, river, person, animal); 60 articles draw 20 cities but 5 rivers, so the 10
    river turns after those are animals."""
    root = ET.fromstring(bz2.decompress(dump.read_bytes()))
    boxes = {"{{Infobox settlement": "city", "{{Infobox river": "river", "{{Infobox person": "person",
             "{{Speciesbox": "animal"}
    kinds: dict[str, int] = {}
    for page in root.findall(f"{NS}page"):
        text = page.findtext(f"{NS}revision/{NS}text")
        if page.findtext(f"{NS}ns") == "0" and page.find(f"{NS}redirect") is None:
            kind = boxes[text.split("\n", 1)[0]]
            kinds[kind] = kinds.get(kind, 0) + 1
    assert kinds == {"city": 15, "river": 5, "person": 15, "animal": 25}


def test_the_temporary_file_is_beside_the_output_and_goes_on_a_failure(tmp_path: Path, monkeypatch):
    """Beside it, so that the final rename stays on one file system; a failed write leaves the old dump as it
    was and no temporary file."""
    import data.demo_dump as demo_dump

    output = tmp_path / "dumps" / "demo.xml.bz2"
    output.parent.mkdir()
    output.write_bytes(b"the dump of an earlier run")
    written_in = []

    def fail(f, header, pages, footer):
        written_in.append(Path(f.name).parent)
        f.write(header)
        next(iter(pages))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(demo_dump, "write_multistream", fail)
    with pytest.raises(OSError, match="No space left"):
        generate_demo_dump(output, articles=8)
    assert written_in == [output.parent]
    assert list(output.parent.iterdir()) == [output] and output.read_bytes() == b"the dump of an earlier run"


def test_rejects_too_few_articles(tmp_path: Path):
    with pytest.raises(ValueError, match="articles must be >= 4"):
        generate_demo_dump(tmp_path / "x.xml.bz2", articles=2)
