"""A small, real MediaWiki XML dump for the demo, generated from a fictional world.

The demo must run with no network and no outside data, yet go through the same code paths as
a real Wikipedia run. So this writes a `pages-articles-multistream.xml.bz2` (bz2 streams of 100
pages, as Wikimedia publishes them, which extraction reads in parallel) in the export-0.10 schema that
Wikipedia uses, with the markup the extractor has to strip: infobox and citation templates,
wikitables, <ref> tags, piped and plain links, file links, headings, lists, categories, plus
redirect pages and pages outside the article namespace (templates, categories) that it must skip.

The prose is generated here from sentence patterns about invented places, rivers, people and
animals, with facts that stay consistent within an article (a city keeps its river, its founding
year and its country), so a small BERT has something learnable to fit.

    python -m data.demo_dump --output results/demo/demo-pages-articles-multistream.xml.bz2 --articles 400
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from tqdm import tqdm

from data.multistream import write_multistream

_ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t",
           "tr", "v", "w", "z", "th", "sh", "ch"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou", "ia"]
_CODAS = ["", "", "n", "r", "l", "s", "m", "th", "nd", "rk", "st"]
_SUFFIXES = {"city": ["holm", "burg", "ton", "vik", "ford", "mere", "stad", "port"],
             "river": ["", "a", "en", "wy"], "mountain": ["berg", "horn", "peak", "fell"],
             "country": ["ia", "land", "mark", "stan", "ovia"], "person": ["", "", "son", "ev", "ini"]}
_INDUSTRIES = ["fishing", "shipbuilding", "textile weaving", "wine making", "copper mining", "timber",
               "printing", "glass making", "tourism", "salt trade", "clock making", "grain milling"]
_DIRECTIONS = ["north", "south", "east", "west", "northeast", "northwest", "southeast", "southwest"]
_SEAS = ["Northern Sea", "Amber Sea", "Gulf of Stills", "Quiet Ocean", "Grey Bay"]
_FIELDS = {"physicist": ("physics", ["optics", "heat", "magnetism", "crystals", "sound"]),
           "chemist": ("chemistry", ["salts", "dyes", "metals", "gases", "acids"]),
           "composer": ("music", ["symphonies", "string quartets", "operas", "songs", "organ works"]),
           "painter": ("painting", ["landscapes", "portraits", "harbour scenes", "still lifes", "frescoes"]),
           "mathematician": ("mathematics", ["number theory", "geometry", "probability", "algebra", "series"])}
_ANIMALS = {"bird": ("birds", ["seeds", "insects", "berries", "small fish"], ["nests in reeds", "nests on cliffs"]),
            "fish": ("fish", ["plankton", "worms", "small crabs", "algae"], ["spawns in gravel", "spawns in lakes"]),
            "beetle": ("insects", ["leaves", "dead wood", "pollen", "fungi"], ["lays eggs in bark", "lays eggs in soil"]),
            "frog": ("amphibians", ["flies", "snails", "beetles", "worms"], ["breeds in ponds", "breeds in streams"])}
_COLOURS = ["red", "green", "brown", "grey", "yellow", "black", "blue", "white"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December"]


class _World:
    """Named things and their fixed facts, drawn once so articles can refer to each other."""

    def __init__(self, rng: random.Random, num_articles: int):
        self.rng = rng
        self._used: set[str] = set()
        self.countries = [self.name("country") for _ in range(max(3, num_articles // 60))]
        self.rivers = [self.name("river") for _ in range(max(4, num_articles // 12))]
        self.mountains = [self.name("mountain") for _ in range(max(3, num_articles // 20))]
        self.cities = [self.name("city") for _ in range(max(4, num_articles // 3))]
        self.city_country = {c: rng.choice(self.countries) for c in self.cities}
        self.city_river = {c: rng.choice(self.rivers) for c in self.cities}
        self.river_sea = {r: rng.choice(_SEAS) for r in self.rivers}

    def name(self, kind: str) -> str:
        while True:
            stem = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS)
                           for _ in range(self.rng.choice((1, 2))))
            word = (stem + self.rng.choice(_SUFFIXES[kind])).capitalize()
            if word not in self._used and len(word) > 3:
                self._used.add(word)
                return word


def _ref(rng: random.Random, title: str, year: int) -> str:
    author = rng.choice(["Mardel", "Okoth", "Virtanen", "Sauer", "Lindqvist", "Ferro", "Abara"])
    return (f"<ref>{{{{cite book |last={author} |title={title} |year={year} |page={rng.randint(3, 400)}}}}}"
            "</ref>")


def _city(w: _World, name: str) -> tuple[str, str, list[str]]:
    r = w.rng
    country, river = w.city_country[name], w.city_river[name]
    founded, population = r.randint(900, 1500), r.randint(2, 900) * 1000
    industry, other = r.sample(_INDUSTRIES, 2)
    twin = r.choice([c for c in w.cities if c != name])
    mountain, direction = r.choice(w.mountains), r.choice(_DIRECTIONS)
    temps = [r.randint(-8, 4) + int(14 * (1 - abs(6 - m) / 6)) for m in range(12)]
    lead = [f"'''{name}''' is a [[city]] in [[{country}]], on the banks of the [[{river} (river)|{river}]].",
            f"With about {population:,} inhabitants it is one of the larger towns of {country}."
            + _ref(r, f"A gazetteer of {country}", r.randint(1950, 2020)),
            f"The city lies {direction} of the [[{mountain}]] range."]
    history = [f"{name} was founded in {founded} as a market on the {river}.",
               f"In the following century the town grew because of {industry}.",
               f"A stone bridge over the {river} was built in {founded + r.randint(20, 200)}.",
               f"During the {r.choice(['great flood', 'long winter', 'plague years', 'civil war'])} of "
               f"{founded + r.randint(201, 400)}, much of the old town was destroyed.",
               f"The people of {name} rebuilt the centre in brick, and the town hall dates from that time."]
    economy = [f"Today the economy of {name} depends on {industry} and {other}.",
               f"The port on the {river} connects the city to the {w.river_sea[river]}.",
               f"{name} is twinned with [[{twin}]]."]
    table = ["{| class=\"wikitable\"", "|+ Climate of " + name, "! Month !! Mean temperature (C)"]
    for m in range(0, 12, 3):
        table += ["|-", f"| {_MONTHS[m]} || {temps[m]}"]
    table.append("|}")
    text = "\n".join([
        "{{Infobox settlement", f"| name = {name}", f"| country = [[{country}]]",
        f"| population = {population}", f"| founded = {founded}", "}}",
        f"[[File:{name} old town.jpg|thumb|right|The old town of {name} seen from the {river}]]",
        " ".join(lead), "", "== History ==", " ".join(history), "", "== Geography ==",
        f"The climate of {name} is {r.choice(['mild', 'cool', 'continental', 'wet'])}, "
        f"with the warmest month in {_MONTHS[temps.index(max(temps))]}.", *table, "",
        "== Economy ==", " ".join(economy), "", "== See also ==", f"* [[{twin}]]", f"* [[{river} (river)]]",
        "", "== References ==", "{{Reflist}}", "", f"[[Category:Cities in {country}]]",
        f"[[Category:Populated places on the {river}]]",
    ])
    return name, text, [f"{name} (city)", f"{name}, {country}"]


def _river(w: _World, name: str) -> tuple[str, str, list[str]]:
    r = w.rng
    towns = [c for c in w.cities if w.city_river[c] == name] or [r.choice(w.cities)]
    length, sea, source = r.randint(40, 1400), w.river_sea[name], r.choice(w.mountains)
    tributaries = r.sample([x for x in w.rivers if x != name], k=min(3, len(w.rivers) - 1))
    text = "\n".join([
        "{{Infobox river", f"| name = {name}", f"| length = {length} km", f"| mouth = {sea}", "}}",
        f"The '''{name}''' is a [[river]] about {length} kilometres long that rises in the [[{source}]] "
        f"mountains and flows into the {sea}." + _ref(r, "Rivers and their valleys", r.randint(1900, 2020)),
        f"It passes through {', '.join(f'[[{t}]]' for t in towns[:4])}.", "",
        "== Course ==",
        f"From its source the {name} runs {r.choice(_DIRECTIONS)} through a narrow valley. "
        f"Below the gorge the valley widens and the river becomes navigable. "
        f"The {name} reaches the {sea} in a wide delta.", "",
        "== Tributaries ==", *[f"* [[{t} (river)|{t}]]" for t in tributaries], "",
        "== Ecology ==",
        f"The waters of the {name} are home to {r.choice(['trout', 'eels', 'salmon', 'pike'])} "
        f"and many kinds of water birds. Floods in spring are common.", "",
        "== References ==", "<references />", "[[Category:Rivers]]", f"[[Category:Tributaries of the {sea}]]",
    ])
    return f"{name} (river)", text, [f"{name} River", f"River {name}"]


def _person(w: _World, name: str) -> tuple[str, str, list[str]]:
    r = w.rng
    given = w.name("person")
    job = r.choice(sorted(_FIELDS))
    field_name, topics = _FIELDS[job]
    born = r.randint(1600, 1930)
    died = born + r.randint(35, 90)
    home, work_city = r.choice(w.cities), r.choice(w.cities)
    topic, second = r.sample(topics, 2)
    text = "\n".join([
        "{{Infobox person", f"| name = {given} {name}", f"| birth_date = {born}", f"| death_date = {died}",
        f"| occupation = {job}", "}}",
        f"'''{given} {name}''' ({born} – {died}) was a {job} from [[{home}]], known for work on {topic}.",
        "", "== Life ==",
        f"{name} was born in {home} in {born}. {name} studied {field_name} in [[{work_city}]] and "
        f"taught there for many years." + _ref(r, f"The life of {given} {name}", r.randint(1950, 2021)),
        f"In {born + r.randint(25, 34)} {name} moved to {r.choice(w.cities)}, where most of the later work "
        f"on {second} was done. {name} died in {died}.", "",
        "== Work ==",
        f"The work of {name} on {topic} was widely read. Later writers called {name} one of the founders of "
        f"the modern study of {topic}.",
        "{| class=\"wikitable\"", "! Year !! Work", "|-", f"| {born + 30} || On {topic}", "|-",
        f"| {born + 41} || Notes on {second}", "|}", "",
        "== References ==", "{{Reflist}}", f"[[Category:{job.capitalize()}s]]", f"[[Category:People from {home}]]",
    ])
    return f"{given} {name}", text, [f"{name}, {given}"]


def _animal(w: _World, name: str) -> tuple[str, str, list[str]]:
    r = w.rng
    kind = r.choice(sorted(_ANIMALS))
    group, foods, habits = _ANIMALS[kind]
    colour, second = r.sample(_COLOURS, 2)
    food = r.choice(foods)
    river, country = r.choice(w.rivers), r.choice(w.countries)
    size = r.randint(2, 60)
    text = "\n".join([
        "{{Speciesbox", f"| name = {name} {kind}", f"| taxon = {name}ia {r.choice(_COLOURS)}is", "}}",
        f"The '''{name} {kind}''' is a {colour} {kind} found along the [[{river} (river)|{river}]] in "
        f"[[{country}]]. It is about {size} centimetres long.",
        "", "== Description ==",
        f"The {name} {kind} is {colour} with {second} marks on the back. It feeds mainly on {food} and "
        f"{habits[r.randint(0, 1)]}." + _ref(r, f"The {group} of {country}", r.randint(1950, 2022)),
        "", "== Behaviour ==",
        f"Like many {group}, the {name} {kind} is most active in {r.choice(_MONTHS)}. "
        f"It is rarely seen far from the {river}.", "",
        "== References ==", "<references />", f"[[Category:{group.capitalize()} of {country}]]",
    ])
    return f"{name} {kind}", text, []


_KINDS = (_city, _river, _person, _animal)


@dataclass(frozen=True)
class DumpStats:
    path: Path
    articles: int
    redirects: int
    other_namespace: int
    bytes_xml: int


_HEADER = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" \
xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance" \
xsi:schemaLocation="http://www.mediawiki.org/xml/export-0.10/ http://www.mediawiki.org/xml/export-0.10.xsd" \
version="0.10" xml:lang="en">
  <siteinfo>
    <sitename>Demopedia</sitename>
    <dbname>demowiki</dbname>
    <base>http://demo.invalid/wiki/Main_Page</base>
    <generator>bert-pretraining data.demo_dump</generator>
    <case>first-letter</case>
    <namespaces>
      <namespace key="0" case="first-letter" />
      <namespace key="6" case="first-letter">File</namespace>
      <namespace key="10" case="first-letter">Template</namespace>
      <namespace key="14" case="first-letter">Category</namespace>
    </namespaces>
  </siteinfo>
"""


def _page(title: str, ns: int, page_id: int, text: str, redirect: str | None = None) -> str:
    redirect_tag = f"    <redirect title={quoteattr(redirect)} />\n" if redirect else ""
    body = escape(text)
    return (f"  <page>\n    <title>{escape(title)}</title>\n    <ns>{ns}</ns>\n    <id>{page_id}</id>\n"
            f"{redirect_tag}    <revision>\n      <id>{page_id * 10}</id>\n"
            f"      <timestamp>2026-11-01T00:00:00Z</timestamp>\n"
            f"      <contributor>\n        <username>DemoBot</username>\n        <id>1</id>\n      </contributor>\n"
            f"      <model>wikitext</model>\n      <format>text/x-wiki</format>\n"
            f"      <text bytes=\"{len(text.encode())}\" xml:space=\"preserve\">{body}</text>\n"
            f"    </revision>\n  </page>\n")


def generate_demo_dump(output: str | os.PathLike, articles: int = 400, seed: int = 12345) -> DumpStats:
    """Write a bz2-compressed MediaWiki dump with `articles` article pages (plus redirects and
    template/category pages). Deterministic for a seed; written to a temporary name, then renamed."""
    if articles < 4:
        raise ValueError(f"articles must be >= 4 (one of each kind), got {articles}")
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    world = _World(rng, articles)
    subjects = {_city: iter(world.cities), _river: iter(world.rivers)}
    page_id, redirects, other, size = 0, 0, 0, 0
    fd, tmp = tempfile.mkstemp(prefix=f".{output.name}.", dir=output.parent)
    os.close(fd)

    def pages():
        nonlocal page_id, redirects, other, size
        for i in tqdm(range(articles), desc="demo dump", unit="article", leave=False):
            make = _KINDS[i % len(_KINDS)]
            name = next(subjects[make], None) if make in subjects else world.name("person")
            if name is None:  # every pre-drawn city or river has its article: write an animal instead
                make, name = _animal, world.name("person")
            title, text, aliases = make(world, name)
            page_id += 1
            chunk = [_page(title, 0, page_id, text)]
            for alias in aliases:
                if alias != title:
                    page_id += 1
                    redirects += 1
                    chunk.append(_page(alias, 0, page_id, f"#REDIRECT [[{title}]] {{{{R from alternative name}}}}",
                                       redirect=title))
            if i % 25 == 0:  # pages outside the article namespace, which extraction must skip
                page_id += 2
                other += 2
                chunk.append(_page(f"Template:Demo box {i}", 10, page_id - 1,
                                   "<includeonly>{| class=\"infobox\"\n|-\n| {{{name}}}\n|}</includeonly>"))
                chunk.append(_page(f"Category:Demo {i}", 14, page_id,
                                   "Pages generated for the demo. [[Category:Demo]]"))
            for page in chunk:
                data = page.encode("utf-8")
                size += len(data)
                yield data

    try:
        with open(tmp, "wb") as f:
            write_multistream(f, _HEADER.encode("utf-8"), pages(), b"</mediawiki>\n")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a dump is an ordinary shared file
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return DumpStats(path=output, articles=articles, redirects=redirects, other_namespace=other, bytes_xml=size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data.demo_dump", description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="path of the .xml.bz2 to write")
    parser.add_argument("--articles", type=int, default=400, help="number of article pages (default 400)")
    parser.add_argument("--seed", type=int, default=12345, help="seed of the generated text (default 12345)")
    args = parser.parse_args(argv)
    try:
        stats = generate_demo_dump(args.output, args.articles, args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{stats.path}: {stats.articles} articles, {stats.redirects} redirects, "
          f"{stats.other_namespace} template/category pages, {stats.bytes_xml / 1e6:.2f} MB of XML")
    return 0


if __name__ == "__main__":
    sys.exit(main())
