"""Stage 2: a MediaWiki XML dump (bz2 or plain, streamed) -> clean article text.

The XML is read with a streaming parser (`xml.etree.ElementTree.iterparse`, constant memory per
page). Pages outside the article namespace (ns 0) and redirects are skipped, and counted. Each article's
wikitext is cleaned by wikiextractor 3.1.0 used as a library (`Extractor.clean_text`): templates,
tables, references, file links, lists and markup are dropped; section headings are dropped too.

Output: `<output_dir>/part-NNNNN.txt`, `articles_per_part` articles each, one paragraph per line
and a blank line after each article. A dump is cut into chunks of whole units that the workers
read, parse and clean in parallel (`data/multistream.py`): the streams of a multistream dump
(`*-multistream.xml.bz2`, the form data.download fetches), the blocks of a single-stream one, or
byte ranges of plain XML. Only a bz2 dump of a single block (under 900 kB of XML) is read by one
process, whose parts are cleaned in parallel worker processes. At most `2 * workers` parts or
chunks are in flight, so memory stays bounded whatever the dump size; every form of a dump gives
the same parts.

    python -m data.extract --input enwiki-20261101-pages-articles.xml.bz2 --output_dir text/extracted

--input is a path or a file:// URL; an http(s) URL is refused (data.download or data.prepare downloads it).
"""

from __future__ import annotations

import argparse
import bz2
import collections
import dataclasses
import io
import json
import queue
import re
import shlex
import threading
import time
import unicodedata
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from tqdm import tqdm
from wikiextractor.extract import (
    EXT_LINK_URL_CLASS,
    Extractor,
    clean,
    compact,
    discardElements,
    dropNested,
    placeholder_tags,
    wgUrlProtocols,
)

from data import multistream, stage
from data.cli import HelpFormatter, add_workers_argument, plural
from data.download import download_again, is_http, local_path
from data.parallel import bounded_map
from data.stage import PipelineError

PART_GLOB = "part-*.txt"
# The create stage draws each random next sentence (NSP) from the other documents of A's part: a part of
# one article gives no negative pair, a part of two always the same one.
MIN_ARTICLES_PER_PART = 10
# The version of the text this stage writes. Bump it whenever its output for the same dump changes
# (another cleaning rule, part layout or chunk record): a finished extracted directory of another
# version is then refused, and an unfinished one started afresh, instead of being reused.
FORMAT_VERSION = 3


@dataclass(frozen=True)
class ExtractConfig:
    input: Path
    output_dir: Path
    workers: int = 1
    articles_per_part: int = 2000  # at least MIN_ARTICLES_PER_PART
    # Bytes of the file one worker task reads (of a bz2 dump, about 4.5x that of XML). Parts do
    # not depend on it; it only sets the parallel grain.
    chunk_bytes: int = 4 << 20


@dataclass(frozen=True)
class ExtractResult:
    articles: int  # with text once cleaned: the documents written
    parts: int
    text_bytes: int
    seconds: float
    # Every <page> of the dump, and those that are not articles.
    pages: int
    redirects: int
    other_namespaces: int
    empty: int  # articles that cleaning leaves without text
    no_namespace: int  # pages without <ns> in a dump whose <siteinfo> lists no namespaces
    other_models: int  # namespace-0 pages whose <model> is not wikitext (Lua, CSS, JSON)

    def line(self) -> str:
        """What the stage did, in one line."""
        return (f"{self.articles} articles of {self.pages} pages (not counted: {self.skipped_pages()}), "
                f"{plural(self.parts, 'part')}, {self.text_bytes / 1e6:.1f} MB of text")

    def skipped_pages(self) -> str:
        unknown = (f", {plural(self.no_namespace, 'page')} of unknown namespace (no <ns> element, and no "
                   "<namespaces> list in the dump's <siteinfo> to tell it from the title)" if self.no_namespace else "")
        models = (f", {plural(self.other_models, 'page')} of another content model than wikitext (such as Lua or CSS)"
                  if self.other_models else "")
        return (f"{plural(self.redirects, 'redirect')}, {plural(self.other_namespaces, 'page')} outside the article "
                f"namespace{unknown}{models}, {plural(self.empty, 'article')} empty once cleaned")


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


def _require_file(path: Path) -> None:
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "no such file"
        raise PipelineError(f"{path}: {what}; pass a MediaWiki XML dump (.xml or .xml.bz2) with --input")


def _dump_form(path: Path) -> str:
    """"bz2" or "xml", from the first bytes; anything else is refused."""
    _require_file(path)
    try:
        with path.open("rb") as f:
            head = f.read(3)
    except OSError as exc:
        raise stage.unreadable_input(path, exc, "--input") from exc
    if not head:
        raise PipelineError(f"{path} is empty (0 bytes), not a dump. {download_again(path)}")
    if head == b"BZh":
        return "bz2"
    if head[:1] in (b"<", b"\xef", b" ", b"\n", b"\r", b"\t"):
        return "xml"
    raise PipelineError(
        f"{path} is not a MediaWiki XML dump: it is neither bz2-compressed nor XML "
        "(expected e.g. enwiki-<date>-pages-articles.xml.bz2)"
    )


def check_dump(path: Path) -> None:
    """Refuse what cannot be a dump before any output directory is made, so that the refusal leaves nothing
    behind: no such file, a directory, an empty file, neither bz2 nor XML by its first bytes, and a start that
    is not a MediaWiki dump's (a bz2 file of something else, XML of another root, a damaged first bz2 block).
    It reads up to the root element; what follows is checked as the dump is read, where the extraction's
    readers name what they find (its <siteinfo>, a page by its title, a bz2 stream by its offset)."""
    for _ in _read_pages(path, root_only=True):
        pass


def _open_dump(path: Path):
    """Open a dump for binary reading, checking that it looks like one."""
    return _Prefetcher(bz2.open(path, "rb")) if _dump_form(path) == "bz2" else path.open("rb")


_NO_ELEMENTS = 3  # expat's XML_ERROR_NO_ELEMENTS: "no element found"


def iter_pages(path: Path) -> Iterator[tuple[str, tuple[str, str] | None]]:
    """Yield (kind, (title, wikitext) for an article, else None) for each <page>, streaming (`_page`)."""
    return _read_pages(path, root_only=False)


def _read_pages(path: Path, root_only: bool) -> Iterator[tuple[str, tuple[str, str] | None]]:
    """iter_pages; with root_only, nothing past the check of the root element is read or yielded."""
    root = None
    try:
        with _open_dump(path) as f:
            events = ET.iterparse(f, events=("start", "end"))
            _, root = next(events)
            if not root.tag.endswith("mediawiki"):
                raise PipelineError(
                    f"{path} is XML but not a MediaWiki dump: its root element is <{root.tag}>, "
                    "expected <mediawiki>"
                )
            if root_only:
                return
            namespaces = None
            for event, elem in events:
                tag = elem.tag.rsplit("}", 1)[-1]
                if event != "end" or tag not in ("siteinfo", "page"):
                    continue
                if tag == "siteinfo":
                    namespaces = _site_namespaces(elem)
                    continue
                yield _page(elem, namespaces)
                # Drop the finished page so memory does not grow with the dump.
                root.clear()
    except EOFError as exc:
        raise PipelineError(
            f"{path} is truncated: the bz2 stream ends before its end-of-stream marker. {download_again(path)}."
        ) from exc
    except OSError as exc:
        if exc.errno is not None:  # the file's or the disk's (bz2's own data errors have none)
            raise stage.unreadable_input(path, exc, "--input") from exc
        raise PipelineError(f"{path} is not a readable bz2 file ({exc}). {download_again(path)}") from exc
    except ET.ParseError as exc:
        if root is None and exc.code == _NO_ELEMENTS:  # nothing, or only white space, comments and <?xml ...?>
            raise PipelineError(f"{path} is empty: no XML element in it") from exc
        if exc.position == (1, 0):  # its very first character: no XML at all, not a damaged dump
            with _open_dump(path) as f:
                start = f.read(40).decode("utf-8", "replace")
            raise PipelineError(f"{path} is not a MediaWiki XML dump: its text starts {start!r}, not with an XML tag "
                                "(expected e.g. enwiki-<date>-pages-articles.xml.bz2)") from exc
        raise PipelineError(
            f"{path} is not well-formed MediaWiki XML ({exc}); the file is damaged or truncated. {download_again(path)}"
        ) from exc


def iter_articles(path: Path) -> Iterator[tuple[str, str]]:
    """Yield (title, wikitext) for each non-redirect page of namespace 0, streaming."""
    return (article for _, article in iter_pages(path) if article is not None)


# What a <page> is, for the counts of pages that are not articles.
ARTICLE, REDIRECT, OTHER_NAMESPACE, NO_NAMESPACE = "article", "redirect", "other_namespace", "no_namespace"
OTHER_MODEL = "other_model"
SKIPPED_KINDS = (REDIRECT, OTHER_NAMESPACE, NO_NAMESPACE, OTHER_MODEL)


def _site_namespaces(siteinfo: ET.Element) -> dict[str, str] | None:
    """{name: key} of the namespaces but 0 that a dump's <siteinfo> lists, or None when it lists none."""
    listed = siteinfo.findall("{*}namespaces/{*}namespace")
    return {ns.text: ns.get("key", "") for ns in listed if ns.text} if listed else None


def _page(page: ET.Element, namespaces: dict[str, str] | None) -> tuple[str, tuple[str, str] | None]:
    """(ARTICLE, (title, wikitext)) for a <page> of namespace 0 that is not a redirect, else (its kind, None).

    Dumps before export-0.6 have no <ns>: a title is then in the namespace its prefix names ("Talk:X"),
    as the dump's <siteinfo> lists them, else in namespace 0. A page of namespace 0 whose <model> is not
    wikitext (a Lua module, a style sheet, JSON data, moved there by mistake) is not an article either; dumps
    before export-0.8 have no <model>, and hold only wikitext.
    """
    title = page.findtext("{*}title") or ""
    ns = page.findtext("{*}ns")
    if ns is None and namespaces is not None:
        prefix, colon, _ = title.partition(":")
        ns = namespaces.get(prefix, "0") if colon else "0"
    if ns is None:
        return NO_NAMESPACE, None
    if ns != "0":
        return OTHER_NAMESPACE, None
    if page.find("{*}redirect") is not None:
        return REDIRECT, None
    if page.findtext("{*}revision/{*}model", "wikitext") != "wikitext":
        return OTHER_MODEL, None
    return ARTICLE, (title, page.findtext("{*}revision/{*}text") or "")


# MediaWiki tags that wikiextractor 3.1.0 leaves in the text, by what Wikipedia shows of them.
# Shown as text: the tags go and their content stays, as wikiextractor does for <span>, <s>, <sup>
# (<onlyinclude> marks what a transclusion shows; the page itself shows its content).
_INLINE_TAGS = ("onlyinclude", "chem", "ce", "q", "ins", "del", "mark", "ruby", "rb", "rp", "rt", "rtc", "time",
                "data", "dfn", "samp", "bdo", "wbr", "h5", "h6", "meta", "link", "langconvert")
# Not prose (music notation, maps, graphs, page-status icons, audio buttons, editor data, code, galleries):
# dropped with their content, as wikiextractor does for <gallery>, <timeline>, <pre> and <source> (but it
# left the start tag of an unclosed one). Code blocks are dropped here, before wikiextractor drops templates:
# the braces of code ("int f() {{") were taken for a template, and wikiextractor's pattern for an unclosed
# <syntaxhighlight> backtracks for minutes.
_NON_PROSE_TAGS = ("score", "mapframe", "maplink", "graph", "indicator", "phonos", "templatedata", "charinsert",
                   "syntaxhighlight", "source", "pre", "gallery", "timeline", "imagemap")
# One pass for all of them (wikiextractor would make two regex passes per tag).
_INLINE = re.compile(rf"<(?:{'|'.join(_INLINE_TAGS)})\b[^>]*>|</\s*(?:{'|'.join(_INLINE_TAGS)})\s*>", re.I)
# A comment without its end hides the rest of the page, as MediaWiki shows it.
_COMMENT = re.compile(r"<!--.*?(?:-->|\Z)", re.S)
# "<name" that no ">" ends before the next "<" is not an HTML tag: written "&lt;", which Wikipedia shows the
# same ("a<b then c<d"). wikiextractor's tag patterns scan from each such "<" to the next ">" anywhere, which
# took minutes for a page of many. The start tag of a MediaWiki extension runs to the next ">" whatever it
# holds (`<ref name="a" <ref>` is one tag): the "<" inside it are written "&lt;" first.
_STRAY_TAG_OPEN = re.compile(r"<(?=/?[A-Za-z][^<>]*(?:<|\Z))")
_EXTENSION_TAGS = ("ref", "references", "nowiki", "pre", "gallery", "math", "chem", "ce", "score", "syntaxhighlight",
                   "source", "timeline", "poem", "templatedata", "templatestyles", "mapframe", "maplink", "graph",
                   "indicator", "imagemap", "inputbox", "categorytree", "hiero", "charinsert", "section", "phonos",
                   "langconvert", "includeonly", "noinclude", "onlyinclude")
_EXTENSION_START_WITH_LT = re.compile(rf"<(?:{'|'.join(_EXTENSION_TAGS)})\b[^<>]*<[^>]*(?:>|\Z)", re.I)
# <nowiki> shows its content as text: written as character references, which wikiextractor leaves alone and
# turns back into the characters, so that "<nowiki>{{</nowiki>" does not open a template that swallows the
# text up to a later "}}" and "<nowiki>[[x]]</nowiki>" stays "[[x]]", as Wikipedia shows them. Entities in it
# stay entities (MediaWiki decodes them there too), and an "&" that starts none is written "&#38;", so that it
# starts none with what follows the element ("<nowiki>&amp</nowiki>;" shows "&amp;"). An unclosed one shows as
# text, and its tag is dropped.
_NOWIKI_START = re.compile(r"<(nowiki)\b[^<>]*>", re.I)
_NOWIKI_LITERAL = re.compile(r"(&(?:#\d+|#[xX][0-9a-fA-F]+|\w+);)|[&<>\[\]{}|'=*#:;_~-]")
_NON_PROSE_START = re.compile(rf"<({'|'.join(_NON_PROSE_TAGS)})\b[^>]*>", re.I)
# The end tag of each element read by `_sub_elements`.
_END_TAGS = {name: re.compile(rf"</{name}\s*>", re.I) for name in ("nowiki", *_NON_PROSE_TAGS, *placeholder_tags)}
# wikiextractor drops the paired forms of these (or turns them into formula_N / codice_N) but
# leaves a self-closing one, such as <includeonly/>, in the text.
_EMPTY_ELEMENT = re.compile(rf"<(?:{'|'.join([*placeholder_tags, *discardElements])})\b[^>]*/\s*>", re.I)
_PLACEHOLDER_START = re.compile(rf"<({'|'.join(placeholder_tags)})\b[^>]*(?<!/)>", re.I)
# An external link's start ("[http://host/path "), and what ends its label: "]", or a line break or other
# control character, which leaves it unclosed. wikiextractor's pattern backtracks over the whole URL and
# the rest of the line for each unclosed one (minutes for a URL of 64 kB or a line of many).
_EXTERNAL_LINK_START = re.compile(rf"\[(?:{'|'.join(map(re.escape, wgUrlProtocols))}){EXT_LINK_URL_CLASS}+\s*",
                                  re.I)
_LINK_LABEL_END = re.compile(r"[\]\x00-\x08\x0a-\x1f]")
# Behaviour switches ("__NOTOC__"): wikiextractor knows only the English ones, and each wiki has its own
# ("__KEIN_INHALTSVERZEICHNIS__", "__БЕЗ_ОГЛАВЛЕНИЯ__", "__目次非表示__"). Candidates, not glued to a word;
# `_is_switch` decides (Python's \w leaves out the combining marks of scripts such as Devanagari).
_SWITCH_CANDIDATE = re.compile(r"(?<![^\W_])__([^\s_]\S*?)__(?![^\W_])")
# Upper-case and caseless letters, modifier letters, combining marks, decimal digits: no lower-case letter,
# so that "__init__" in prose stays.
_SWITCH_CATEGORIES = frozenset(("Lu", "Lo", "Lm", "Mn", "Mc", "Nd"))

# Line markers (Unicode noncharacters, removed from the input first). wikiextractor drops every
# cleaned line that starts with "*", "#" or ";" as a list item, so prose whose markup vanishes
# before such a character ("'''#1 Record''' is ...") was lost; lists are decided on the raw
# wikitext instead: each line is marked as prose or as a list item before cleaning.
_PROSE, _LIST = "\ufdd0", "\ufdd1"
# <math> and <code> elements go through wikiextractor as "\ufdd2<tag><id>\ufdd3" and are named formula_N /
# codice_N after it (`_name_placeholders`): its own loop makes a pass over the whole page per element
# (68 s for a 3.4 MB page of 100,000 formulas).
_OPEN_MARK, _CLOSE_MARK = "\ufdd2", "\ufdd3"
_PLACEHOLDER_MARK = re.compile(f"{_OPEN_MARK}([a-z]+)(\\d+){_CLOSE_MARK}")
# A "<" of <math> or <code> written as a character reference ("&lt;math&gt;" in the wikitext, or "<math>" in
# <nowiki>) is text: wikiextractor decodes it, takes it for an element and names it formula_N in a pass over
# the page per element (20,000 of them took 4.9 s, 40,000 9.3 s). It passes through as this mark instead, and
# is "<" again in the paragraph.
_LITERAL_LT = "\ufdd4"
_LT_OF_PLACEHOLDER = re.compile(rf"&(?:lt|LT|#0*60|#[xX]0*3[cC]);(?=\s*/?\s*(?i:{'|'.join(placeholder_tags)})\b)")
_MARKERS = (_PROSE, _LIST, _OPEN_MARK, _CLOSE_MARK, _LITERAL_LT)
# A character reference to a marker, which wikiextractor turns into the marker ("&#xFDD2;foo1&#xFDD3;" was a mark
# of no tag, a KeyError that ended the stage): dropped, as the markers themselves are.
_MARKER_REFERENCE = re.compile(rf"&#(?:{'|'.join(rf'0*{ord(m)}|x0*(?i:{ord(m):x})' for m in _MARKERS)});")
# A character reference MediaWiki does not decode, as its code point is no XML character (a UTF-16 surrogate:
# "&#xD834;&#xDD1E;" for one non-BMP character, NUL, a C0 control, beyond U+10FFFF): shown as the text it is.
# wikiextractor decoded it, and a lone surrogate could not be written (UnicodeEncodeError, the stage ended).
_NUMERIC_REFERENCE = re.compile(r"&#(?:x([0-9a-fA-F]+)|([0-9]+));")
_LIST_ITEM = re.compile(r":*[*#;]")  # "*", "#", ";", also nested under ":" indents (":*")
# A line that starts with 4 or more "=" is always a heading to wikiextractor, which drops it; from 7 on,
# dropped here, as its heading pattern backtracks over the run of "=" (hours for a line of a million).
_LONG_HEADING = "=" * 7


def _prepare_wikitext(wikitext: str) -> str:
    """The wikitext without the tags wikiextractor mishandles, each line marked as prose or list item."""
    text = wikitext
    for marker in _MARKERS:
        text = text.replace(marker, "")
    if "&#" in text:
        text = _MARKER_REFERENCE.sub("", text)
        text = _NUMERIC_REFERENCE.sub(_literal_if_undecoded, text)
    text = _COMMENT.sub("", text)  # first, so that no tag or line inside a comment is seen
    if "<" in text:
        text = _sub_elements(_NOWIKI_START, text, _nowiki_text)
        text = _EXTENSION_START_WITH_LT.sub(lambda m: m[0][0] + m[0][1:].replace("<", "&lt;"), text)
        text = _STRAY_TAG_OPEN.sub("&lt;", text)
    text = _sub_elements(_NON_PROSE_START, text, lambda tag, end: "")
    text = _INLINE.sub("", text)
    text = _EMPTY_ELEMENT.sub("", text)
    text = _empty_placeholders(text)
    if "__" in text:  # rare: the scan below tries every position
        text = _SWITCH_CANDIDATE.sub(lambda m: "" if _is_switch(m[1]) else m[0], text)
    if "{{" in text:
        # Templates first, as MediaWiki expands them before it reads links: a line break inside one in a
        # link's label ends neither the label nor the link. wikiextractor's own pass, run earlier.
        text = dropNested(text, r"{{", r"}}")
    text = _unclosed_external_links(text)
    if "&" in text:
        text = _LT_OF_PLACEHOLDER.sub(_LITERAL_LT, text)
    return "\n".join(_mark_line(line) for line in text.split("\n"))


def _literal_if_undecoded(reference: re.Match) -> str:
    code = int(reference[1], 16) if reference[1] is not None else int(reference[2])
    decoded = (code in (0x9, 0xA, 0xD) or 0x20 <= code <= 0xD7FF or 0xE000 <= code <= 0xFFFD
               or 0x10000 <= code <= 0x10FFFF)
    return reference[0] if decoded else "&amp;" + reference[0][1:]


def _sub_elements(start: re.Pattern, text: str, replace: Callable[[re.Match, re.Match | None], str]) -> str:
    """The text with each element whose start tag `start` matches (group 1: the name) replaced by
    replace(start tag, end tag). As MediaWiki reads an extension tag, the content runs to the first end tag of
    the name, whatever it holds ("<math>a<math>b</math>" is one formula); a start tag that no end tag follows
    (and a self-closing one) is given with end tag None. Once a name has no end tag left, its later start tags
    are not scanned for one: one pass over the text, however many start tags are unclosed."""
    parts, done = [], 0
    unclosed: set[str] = set()  # names without an end tag after the current position
    while (tag := start.search(text, done)) is not None:
        end = None
        name = tag[1].lower()
        if not tag[0].endswith("/>") and name not in unclosed:
            end = _END_TAGS[name].search(text, tag.end())
            if end is None:
                unclosed.add(name)
        parts += [text[done:tag.start()], replace(tag, end)]
        done = tag.end() if end is None else end.end()
    return "".join(parts) + text[done:] if parts else text


def _nowiki_text(tag: re.Match, end: re.Match | None) -> str:
    """A <nowiki> element's content, each character wikitext would read written as a character reference; ""
    for <nowiki/>, and an unclosed start tag as it is."""
    if end is None:
        return "" if tag[0].endswith("/>") else tag[0]
    content = tag.string[tag.end():end.start()]
    return _NOWIKI_LITERAL.sub(lambda c: c[1] or f"&#{ord(c[0])};", content)


def _unclosed_external_links(text: str) -> str:
    """The text with the "[" of each external link that no "]" closes written "&#91;", which Wikipedia shows
    the same; one scan, however many there are."""
    parts, done = [], 0
    end, end_char = -1, ""  # the next "]" or control character after the last link start
    for start in _EXTERNAL_LINK_START.finditer(text):
        if end < start.end():
            found = _LINK_LABEL_END.search(text, start.end())
            end, end_char = (found.start(), found[0]) if found else (len(text), "")
        if end_char != "]":
            parts += [text[done:start.start()], "&#91;"]
            done = start.start() + 1
    return "".join(parts) + text[done:] if parts else text


def _is_switch(word: str) -> bool:
    """Whether the word between two double underscores names a behaviour switch: an upper-case word (letters
    of any script, digits, underscores; a script without case counts as upper case)."""
    categories = [unicodedata.category(c) for c in word if c != "_"]
    return set(categories) <= _SWITCH_CATEGORIES and bool({"Lu", "Lo"} & set(categories))


def _empty_placeholders(text: str) -> str:
    """<math> and <code> as marks (`_PLACEHOLDER_MARK`), to become formula_N / codice_N as wikiextractor names
    them; braces in a formula ("{{[H^+]^2} \\over ...}}") were taken for a template, which left "<math>" in the
    text. Equal elements get equal ids, as wikiextractor gives equal elements the same number."""
    ids: dict[str, int] = {}

    def marked(tag: re.Match, end: re.Match | None) -> str:
        if end is None:  # a start tag without its end tag: dropped
            return ""
        element = tag.string[tag.start():end.end()]
        return f"{_OPEN_MARK}{tag[1].lower()}{ids.setdefault(element, len(ids))}{_CLOSE_MARK}"

    return _sub_elements(_PLACEHOLDER_START, text, marked)


def _name_placeholders(text: str) -> str:
    """The marks of `_empty_placeholders` as wikiextractor names the elements, in one pass: formula_N (codice_N for
    <code>), N counting that tag's elements in the text, equal elements named as the first of them."""
    counts: dict[str, int] = {}
    numbers: dict[str, int] = {}

    def name(m: re.Match) -> str:
        prefix = placeholder_tags[m[1]]
        counts[prefix] = counts.get(prefix, 0) + 1
        return f"{prefix}_{numbers.setdefault(m[2], counts[prefix])}"

    return _PLACEHOLDER_MARK.sub(name, text)


def _mark_line(line: str) -> str:
    if _LIST_ITEM.match(line) or line.startswith(_LONG_HEADING):
        return _LIST + line
    # Left to wikiextractor: paragraph breaks, headings and ":" indents (kept as text, even when
    # what follows the ":" cleans to "#...").
    return line if not line or line[0] in "=:" else _PROSE + line


def _paragraph(line: str) -> str:
    """A line of wikiextractor's output as a paragraph, or "" when it is dropped."""
    if line.startswith(_LIST):
        return ""
    if line.startswith(_PROSE):
        line = line[1:]
        # compact() saw this line behind the marker: apply its rules for residues of tables and
        # templates and for lines of only dots, dashes or a parenthesis, all but the list rule.
        if (not line or line[0] in "{|" or line[-1] == "}" or (line[0] == "(" and line[-1] == ")")
                or not line.strip(".-")):
            return ""
    return " ".join(line.replace(_PROSE, "").replace(_LIST, "").replace(_LITERAL_LT, "<").split())


def clean_article(title: str, wikitext: str) -> list[str]:
    """The article's paragraphs as plain text, without headings, lists, tables or markup."""
    extractor = Extractor("0", "0", "", title, [], keepSections=False)
    # wikiextractor works on the dump's escaped text (it unescapes after stripping markup);
    # iterparse has already unescaped it, so escape it back to keep its order of operations.
    # clean_text() is clean() then compact(): the elements are named between the two, in the text compact()
    # has not cut yet, so that they are counted as wikiextractor counts them.
    text = clean(extractor, escape(_prepare_wikitext(wikitext)), expand_templates=False, html_safe=False)
    lines = compact(_name_placeholders(text), extractor=extractor)
    return [paragraph for paragraph in map(_paragraph, lines) if paragraph]


def _document(title: str, wikitext: str) -> str:
    """An article as it is written into a part: its paragraphs and a blank line, or "" when none are left."""
    paragraphs = clean_article(title, wikitext)
    return "\n".join(paragraphs) + "\n\n" if paragraphs else ""


def _write_docs(path: Path, docs: list[str]) -> tuple[int, int]:
    """Write one part file. Returns (documents written, bytes)."""
    data = "".join(docs).encode("utf-8")
    with stage.atomic_path(path) as tmp:
        stage.write_file(tmp, data)
    return sum(1 for d in docs if d), len(data)


def _write_part(task: tuple[Path, list[tuple[str, str]]]) -> tuple[int, int]:
    """Clean one batch of articles into one part file. Returns (articles written, bytes)."""
    path, articles = task
    return _write_docs(path, [_document(title, wikitext) for title, wikitext in articles])


def _count_part(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    return data.count(b"\n\n"), len(data)


def part_path(output_dir: Path, index: int) -> Path:
    return output_dir / f"part-{index:05d}.txt"


def list_parts(stage_dir: Path) -> list[Path]:
    return sorted(stage_dir.glob(PART_GLOB))


def check_articles_per_part(articles_per_part: int) -> None:
    if articles_per_part < MIN_ARTICLES_PER_PART:
        raise PipelineError(
            f"--articles_per_part {articles_per_part} is below {MIN_ARTICLES_PER_PART}: the create stage draws each "
            "random next sentence (NSP) from the other documents of the same part, so parts that small give few or no "
            "negative pairs; keep the default 2000")


def extract(cfg: ExtractConfig) -> ExtractResult:
    check_articles_per_part(cfg.articles_per_part)
    if cfg.workers < 1:
        raise PipelineError(f"workers must be >= 1, got {cfg.workers}")
    check_dump(cfg.input)
    if cfg.chunk_bytes < 1:
        raise PipelineError(f"chunk_bytes must be >= 1, got {cfg.chunk_bytes}")
    params = {stage.VERSION_KEY: FORMAT_VERSION, "input": stage.file_identity(cfg.input),
              "articles_per_part": cfg.articles_per_part}
    done = stage.begin(cfg.output_dir, params)
    if done is not None:
        return ExtractResult(**done)
    start = time.perf_counter()
    layout = _units(cfg.input)
    done_now = _extract_chunks(cfg, *layout) if layout is not None else _extract_serial(cfg)
    result = ExtractResult(
        articles=done_now.documents, parts=done_now.parts, text_bytes=done_now.text_bytes,
        seconds=round(time.perf_counter() - start, 3), pages=sum(done_now.pages.values()),
        redirects=done_now.pages[REDIRECT], other_namespaces=done_now.pages[OTHER_NAMESPACE],
        empty=done_now.pages[ARTICLE] - done_now.documents, no_namespace=done_now.pages[NO_NAMESPACE],
        other_models=done_now.pages[OTHER_MODEL])
    if result.articles == 0:
        found = (f"of its {plural(result.pages, 'page')}, {result.skipped_pages()}" if result.pages
                 else "it has no <page> element")
        raise PipelineError(f"{cfg.input}: the dump holds no articles (namespace 0, not redirects, with text): {found}")
    return ExtractResult(**stage.finish(cfg.output_dir, params, dataclasses.asdict(result)))


@dataclass(frozen=True)
class _Extracted:
    documents: int  # articles with text
    parts: int
    text_bytes: int
    pages: collections.Counter[str]  # every page of the dump by kind (`_page`), articles with text or not


def _extract_serial(cfg: ExtractConfig) -> _Extracted:
    """One reader parses the dump (a bz2 dump of a single block; the benchmark's reference for any
    dump); workers clean batches of articles into parts."""
    pages: collections.Counter[str] = collections.Counter({kind: 0 for kind in (ARTICLE, *SKIPPED_KINDS)})

    def batches() -> Iterator[tuple[Path, list[tuple[str, str]]] | Path]:
        batch: list[tuple[str, str]] = []
        index = 0
        for kind, article in iter_pages(cfg.input):
            pages[kind] += 1
            if article is None:
                continue
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
    return _Extracted(articles, parts, text_bytes, pages)


def _part_or_count(task: tuple[Path, list[tuple[str, str]]] | Path) -> tuple[int, int]:
    return _count_part(task) if isinstance(task, Path) else _write_part(task)


# ----------------------------------------------------------------------------- dumps read in parallel

CHUNK_RECORD = "_chunk_articles.json"


def _units(path: Path) -> tuple[list[int], int | None] | None:
    """The units a dump is read in parallel by (check_dump has checked its root), as (offsets, level)
    (`data/multistream.py`): the streams of a multistream dump, the blocks of a single-stream one,
    byte ranges of plain XML. None for a bz2 dump of one block, read by one process."""
    if _dump_form(path) == "xml":
        offsets, level = multistream.plain_offsets(path.stat().st_size), multistream.PLAIN_XML
    else:
        offsets, level = _bz2_units(path)
        if len(offsets) <= 2:
            return None
    unit = multistream.unit_name(level)
    # A multistream file cut at a stream boundary decompresses without error: only the closing tag tells.
    if not multistream.tail_xml(path, offsets, level=level).rstrip().endswith(b"</mediawiki>"):
        raise PipelineError(
            f"{path} is truncated: its last {unit} does not end with </mediawiki>, so the pages after it are "
            f"missing. {download_again(path)}."
        )
    return offsets, level


def _bz2_units(path: Path) -> tuple[list[int], int | None]:
    """Byte offsets of the streams of a multistream dump (level None), else bit offsets of the blocks
    of its single stream (level: the block-size digit)."""
    size = path.stat().st_size
    with tqdm(desc="find bz2 streams", total=size, unit="B", unit_scale=True, dynamic_ncols=True) as bar:
        offsets = multistream.stream_offsets(path, bar.update)
    if len(offsets) > 2:
        return offsets, None
    level = multistream.stream_level(path)
    with tqdm(desc="find bz2 blocks", total=size, unit="B", unit_scale=True, dynamic_ncols=True) as bar:
        return multistream.block_offsets(path, bar.update), level


@dataclass(frozen=True)
class _Chunk:
    path: Path
    offsets: tuple[int, ...]  # its units' starts, then up to MAX_LOOKAHEAD_STREAMS more, then their end
    own: int  # how many of those units are its own
    level: int | None  # the units' layout (data/multistream.py): bz2 streams, bz2 blocks or plain XML
    namespaces: dict[str, str] | None  # the dump's, for pages without <ns> (`_page`)


@dataclass(frozen=True)
class _ChunkText:
    docs: list[str]  # the document of every article whose page starts in the chunk, in dump order ("" if empty)
    skipped: list[int]  # its pages of each of SKIPPED_KINDS


_TITLE = re.compile(rb"<title>([^<]{1,300})</title>")  # to name a page that does not parse


def _clean_chunk(chunk: _Chunk) -> _ChunkText:
    docs = []
    skipped = dict.fromkeys(SKIPPED_KINDS, 0)
    for page in multistream.chunk_pages(chunk.path, chunk.offsets, chunk.own, chunk.level):
        try:
            kind, article = _page(ET.fromstring(page), chunk.namespaces)
        except ET.ParseError as exc:
            start = chunk.offsets[0] // multistream.unit_bits(chunk.level)
            title = _TITLE.search(page)
            which = f"the page {title[1].decode('utf-8', 'replace')!r}" if title else "a page"
            raise PipelineError(f"{chunk.path}: {which} in the {multistream.unit_name(chunk.level)}s from byte {start} "
                                f"is not well-formed XML ({exc}, counted from its <page> tag); the file is damaged "
                                "or truncated") from exc
        if article is None:
            skipped[kind] += 1
        else:
            docs.append(_document(*article))
    return _ChunkText(docs, list(skipped.values()))


class _PartWriter:
    """Cuts the dump's articles, in order, into parts of `articles_per_part` and writes each part not on disk yet.

    The parts are the same as the serial path's, whatever the chunking, so a multistream dump and
    its single-stream twin give identical text.
    """

    def __init__(self, output_dir: Path, articles_per_part: int):
        self.output_dir, self.per_part = output_dir, articles_per_part
        self.next_article = 0
        self.buffer: list[str] = []
        self.documents = self.parts = self.text_bytes = 0

    def part_exists(self, first_article: int, count: int) -> bool:
        """Whether every part holding articles first_article .. first_article + count - 1 is on disk."""
        last_part = (first_article + count - 1) // self.per_part
        return all(part_path(self.output_dir, p).is_file() for p in range(first_article // self.per_part, last_part + 1))

    def add(self, docs: list[str] | None, count: int) -> None:
        """The next `count` articles' documents, or None for articles whose parts are all on disk."""
        for k in range(count):
            if docs is not None:
                self.buffer.append(docs[k])
            self.next_article += 1
            if self.next_article % self.per_part == 0:
                self._flush()

    def close(self) -> None:
        if self.next_article % self.per_part:
            self._flush()

    def _flush(self) -> None:
        path = part_path(self.output_dir, (self.next_article - 1) // self.per_part)
        # A part on disk is complete (written whole, then renamed); a buffer for it may be partial.
        n, nbytes = _count_part(path) if path.is_file() else _write_docs(path, self.buffer)
        self.documents, self.text_bytes, self.parts = self.documents + n, self.text_bytes + nbytes, self.parts + 1
        self.buffer = []


def _extract_chunks(cfg: ExtractConfig, offsets: list[int], level: int | None) -> _Extracted:
    """Workers read, parse and clean runs of units (`_units`); the articles are cut into parts
    in order.

    Resuming: `_chunk_articles.json` records how many articles each chunk held, and how many pages of
    each of SKIPPED_KINDS; a chunk whose articles all lie in parts already on disk is not read again.
    """
    bits = multistream.unit_bits(level)
    # A small dump is cut into 2 chunks per worker at least, so that every worker has work.
    chunk_bytes = min(cfg.chunk_bytes, max(1, offsets[-1] // bits // (2 * cfg.workers)))
    bounds = multistream.chunk_bounds(offsets, chunk_bytes * bits)
    record_path = cfg.output_dir / CHUNK_RECORD
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    usable = record.get("chunk_bytes") == chunk_bytes
    known: list[int] = record["articles"] if usable else []
    counts, skipped = list(known), list(record["skipped"] if usable else [])
    writer = _PartWriter(cfg.output_dir, cfg.articles_per_part)
    namespaces = _head_namespaces(cfg.input, offsets, level)

    def tasks() -> Iterator[_Chunk | int]:
        first_article = 0
        for index, (first, end) in enumerate(bounds):
            if index < len(known) and (known[index] == 0 or writer.part_exists(first_article, known[index])):
                yield known[index]  # nothing to read: only the article count moves on
            else:
                stop = min(end + multistream.MAX_LOOKAHEAD_STREAMS, len(offsets) - 1)
                yield _Chunk(cfg.input, tuple(offsets[first:stop + 1]), end - first, level, namespaces)
            if index < len(known):
                first_article += known[index]

    with tqdm(desc="extract", total=offsets[-1] // bits, unit="B", unit_scale=True, dynamic_ncols=True) as bar:
        # tasks() is a generator: bounded_map cannot count it, and with fork every worker starts.
        workers = min(cfg.workers, len(bounds))
        for index, result in enumerate(bounded_map(_clean_chunk_or_skip, tasks(), workers)):
            if isinstance(result, int):
                writer.add(None, result)
            else:
                if index < len(known) and known[index] != len(result.docs):
                    raise PipelineError(
                        f"{cfg.input} is not the file an earlier run read into {cfg.output_dir} (a chunk now holds "
                        f"{len(result.docs)} articles, then {known[index]}); delete {cfg.output_dir} to extract it "
                        "again")
                writer.add(result.docs, len(result.docs))
                if index >= len(counts):
                    counts.append(len(result.docs))
                    skipped.append(result.skipped)
                    # Rewritten after every chunk (thousands for a full dump), so compact.
                    stage.write_json_atomic(record_path, {"chunk_bytes": chunk_bytes, "articles": counts,
                                                          "skipped": skipped}, compact=True)
            first, end = bounds[index]
            bar.update(offsets[end] // bits - offsets[first] // bits)
    writer.close()
    pages = collections.Counter({ARTICLE: writer.next_article})
    pages.update({kind: sum(chunk[k] for chunk in skipped) for k, kind in enumerate(SKIPPED_KINDS)})
    return _Extracted(writer.documents, writer.parts, writer.text_bytes, pages)


_SITEINFO = re.compile(rb"<siteinfo>.*?</siteinfo>", re.S)


def _head_namespaces(path: Path, offsets: list[int], level: int | None) -> dict[str, str] | None:
    """The namespaces the dump's <siteinfo> lists (`_site_namespaces`), read from its first units."""
    head = b""
    with path.open("rb") as f:
        for unit in range(min(len(offsets) - 1, multistream.MAX_LOOKAHEAD_STREAMS)):
            head += multistream.decompress_units(f, offsets, unit, unit + 1, level, path)
            if b"</siteinfo>" in head or b"<page>" in head:
                break
    siteinfo = _SITEINFO.search(head.split(b"<page>", 1)[0])
    if not siteinfo:
        return None
    try:
        return _site_namespaces(ET.fromstring(siteinfo[0]))
    except ET.ParseError as exc:
        raise PipelineError(f"{path} is not well-formed MediaWiki XML: its <siteinfo> does not parse ({exc})") from exc


def _clean_chunk_or_skip(task: _Chunk | int) -> _ChunkText | int:
    return task if isinstance(task, int) else _clean_chunk(task)


def dump_path(text: str) -> Path:
    """The dump that data.extract's --input names: a path or a file:// URL, as data.prepare takes a local one.
    A URL to download is refused, naming the commands that download it."""
    path = local_path(text)
    if path is not None:
        return path
    if is_http(text):
        raise PipelineError(f"--input {text}: data.extract reads a local dump, not an http(s) URL; download it "
                            f"with python -m data.download --url {shlex.quote(text)} --output_dir DIR and pass the "
                            "file it writes, or pass the URL to python -m data.prepare --input, which downloads it")
    raise PipelineError(f"--input {text}: {urllib.parse.urlsplit(text).scheme}:// URLs are not read; fetch the dump "
                        "another way and pass its path (or a file:// URL)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--input", required=True,
                   help="MediaWiki XML dump, .xml or .xml.bz2: a path or a file:// URL (data.download fetches an "
                        "http(s) one)")
    p.add_argument("--output_dir", type=Path, required=True, help="the articles directory")
    add_workers_argument(p)
    p.add_argument("--articles_per_part", type=int, default=2000,
                   help="articles per part file (the parallel work unit of the stages after this one); the create "
                        f"stage draws NSP's random next document from the same part, so at least {MIN_ARTICLES_PER_PART}")
    a = p.parse_args(argv)
    r = stage.cli_call(lambda args: extract(ExtractConfig(dump_path(args.input), args.output_dir, args.workers,
                                                          args.articles_per_part)), a)
    print(f"extract: {r.line()}, {r.seconds:.1f} s")


if __name__ == "__main__":
    main()
