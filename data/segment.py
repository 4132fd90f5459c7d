"""Stage 3: article text -> one sentence per line, a blank line between documents.

Sentences are split with blingfire, whose model ships inside its wheel (nothing is downloaded
at run time). Each extracted part becomes one segmented part of the same name; parts are
processed in parallel.

    python -m data.segment --input_dir text/extracted --output_dir text/sentences
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import blingfire
from tqdm import tqdm

from data import extract as extract_stage
from data import stage
from data.cli import HelpFormatter, add_workers_argument
from data.parallel import bounded_map
from data.stage import PipelineError

# The version of the sentences this stage writes. Bump it whenever its output for the same extracted
# text changes (another segmenter, a new rule): a finished sentences directory of another version is
# then refused, and an unfinished one started afresh, instead of being reused.
FORMAT_VERSION = 1


@dataclass(frozen=True)
class SegmentConfig:
    input_dir: Path
    output_dir: Path
    workers: int = 1


@dataclass(frozen=True)
class SegmentResult:
    documents: int
    sentences: int
    text_bytes: int
    seconds: float

    def line(self) -> str:
        """What the stage did, in one line."""
        return f"{self.documents} documents, {self.sentences} sentences"


def split_sentences(paragraph: str) -> list[str]:
    return [s for s in blingfire.text_to_sentences(paragraph).split("\n") if s.strip()]


def segment_text(text: str) -> tuple[str, int, int]:
    """Segment a part's text. Returns (segmented text, documents, sentences)."""
    out: list[str] = []
    documents = sentences = 0
    for doc in text.split("\n\n"):
        doc_sentences = [s for para in doc.split("\n") if para for s in split_sentences(para)]
        if doc_sentences:
            out.append("\n".join(doc_sentences) + "\n\n")
            documents += 1
            sentences += len(doc_sentences)
    return "".join(out), documents, sentences


def _segment_part(task: tuple[Path, Path]) -> tuple[int, int, int]:
    src, dst = task
    if dst.is_file():
        text, _ = stage.read_utf8(dst, "delete it and rerun to segment its part again")
        return text.count("\n\n"), text.count("\n") - text.count("\n\n"), src.stat().st_size
    source, size = stage.read_utf8(src, f"delete {src.parent} and the directories made from it, and extract again")
    text, documents, sentences = segment_text(source)
    with stage.atomic_path(dst) as tmp:
        stage.write_file(tmp, text.encode("utf-8"))
    return documents, sentences, size


def segment(cfg: SegmentConfig) -> SegmentResult:
    sources = extract_stage.list_parts(cfg.input_dir)
    stage.require_input(cfg.input_dir, "--input_dir", "data.extract",
                        f"{cfg.input_dir} is not a complete extraction; run data.extract into it first")
    extracted = stage.fingerprint(cfg.input_dir, extract_stage.FORMAT_VERSION, writer="data.extract")
    params = {stage.VERSION_KEY: FORMAT_VERSION, "extracted": extracted, "parts": len(sources)}
    done = stage.begin(cfg.output_dir, params)
    if done is not None:
        return SegmentResult(**done)
    start = time.perf_counter()
    documents = sentences = text_bytes = 0
    tasks = [(src, cfg.output_dir / src.name) for src in sources]
    with tqdm(total=len(tasks), desc="segment", unit=" parts", dynamic_ncols=True) as bar:
        for d, s, b in bounded_map(_segment_part, tasks, cfg.workers):
            documents, sentences, text_bytes = documents + d, sentences + s, text_bytes + b
            bar.update(1)
    if documents == 0:
        raise PipelineError(f"{cfg.input_dir}: the extracted corpus is empty (no sentences)")
    summary = {"documents": documents, "sentences": sentences, "text_bytes": text_bytes,
               "seconds": round(time.perf_counter() - start, 3)}
    return SegmentResult(**stage.finish(cfg.output_dir, params, summary))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--input_dir", type=Path, required=True, help="output of data.extract")
    p.add_argument("--output_dir", type=Path, required=True, help="the sentences directory")
    add_workers_argument(p)
    a = p.parse_args(argv)
    r = stage.cli_call(segment, SegmentConfig(a.input_dir, a.output_dir, a.workers))
    print(f"segment: {r.line()}, {r.seconds:.1f} s")


if __name__ == "__main__":
    main()
