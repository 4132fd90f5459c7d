"""Tokenize the segmented corpus once, with the Rust WordPiece tokenizer, in batches.

Each segmented part becomes `<output_dir>/part-NNNNN.npz` holding
  ids               int32 [tokens]     all token ids of the part, sentence after sentence
  sentence_lengths  int32 [sentences]  tokens per sentence (sentences with no tokens are dropped)
  doc_sentences     int32 [documents]  sentences per document (documents with none are dropped)
Phase 1 and phase 2 both create their instances from these files, so text is tokenized once.

    python -m data.tokens --input_dir text/sentences --vocab_file out/vocab.txt --output_dir text/tokens
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data import stage
from data.extract import list_parts
from data.parallel import bounded_map
from data.stage import PipelineError
from data.vocab import load_vocab, make_tokenizer


@dataclass(frozen=True)
class TokenizeConfig:
    input_dir: Path
    vocab_file: Path
    output_dir: Path
    lower_case: bool = True
    workers: int = 1


@dataclass(frozen=True)
class TokenizeResult:
    documents: int
    sentences: int
    tokens: int
    seconds: float


@dataclass(frozen=True)
class TokenizedPart:
    ids: np.ndarray
    sentence_lengths: np.ndarray
    doc_sentences: np.ndarray


def tokenize_text(text: str, vocab_file: Path, lower_case: bool) -> TokenizedPart:
    """Tokenize segmented text (one sentence per line, blank line between documents)."""
    tokenizer = make_tokenizer(vocab_file, lower_case)
    docs = [d.split("\n") for d in text.split("\n\n") if d.strip()]
    sentences = [s for d in docs for s in d]
    encodings = tokenizer.encode_batch(sentences, add_special_tokens=False)
    ids = [e.ids for e in encodings]
    lengths = np.fromiter(map(len, ids), dtype=np.int32, count=len(ids))
    # Documents by their sentence counts; sentences that tokenize to nothing are dropped.
    doc_sentences = []
    start = 0
    for d in docs:
        doc_sentences.append(int(np.count_nonzero(lengths[start:start + len(d)])))
        start += len(d)
    flat = np.fromiter((t for seq in ids for t in seq), dtype=np.int32, count=int(lengths.sum()))
    counts = np.asarray(doc_sentences, dtype=np.int32)
    return TokenizedPart(flat, lengths[lengths > 0], counts[counts > 0])


def load_part(path: Path) -> TokenizedPart:
    with np.load(path) as z:
        return TokenizedPart(z["ids"], z["sentence_lengths"], z["doc_sentences"])


def _tokenize_part(task: tuple[Path, Path, Path, bool]) -> tuple[int, int, int]:
    src, dst, vocab_file, lower_case = task
    if dst.is_file():
        part = load_part(dst)
    else:
        part = tokenize_text(src.read_text(encoding="utf-8"), vocab_file, lower_case)
        with stage.atomic_path(dst) as tmp, tmp.open("wb") as f:
            np.savez(f, ids=part.ids, sentence_lengths=part.sentence_lengths, doc_sentences=part.doc_sentences)
    return len(part.doc_sentences), len(part.sentence_lengths), len(part.ids)


def tokenize(cfg: TokenizeConfig) -> TokenizeResult:
    if not (cfg.input_dir / stage.COMPLETE_FILE).is_file():
        raise PipelineError(f"{cfg.input_dir} is not a complete segmentation; run data.segment into it first")
    load_vocab(cfg.vocab_file)
    sources = list_parts(cfg.input_dir)
    params = {"sentences": stage.fingerprint(cfg.input_dir), "parts": len(sources), "lower_case": cfg.lower_case,
              "vocab_sha1": hashlib.sha1(cfg.vocab_file.read_bytes()).hexdigest()}
    done = stage.begin(cfg.output_dir, params)
    if done is not None:
        return TokenizeResult(**done)
    start = time.perf_counter()
    tasks = [(src, cfg.output_dir / f"{src.stem}.npz", cfg.vocab_file, cfg.lower_case) for src in sources]
    documents = sentences = tokens = 0
    with tqdm(total=len(tasks), desc="tokenize", unit=" parts", dynamic_ncols=True) as bar:
        for d, s, t in bounded_map(_tokenize_part, tasks, cfg.workers):
            documents, sentences, tokens = documents + d, sentences + s, tokens + t
            bar.update(1)
    if tokens == 0:
        raise PipelineError(f"{cfg.input_dir}: the corpus has no tokens")
    summary = {"documents": documents, "sentences": sentences, "tokens": tokens,
               "seconds": round(time.perf_counter() - start, 3)}
    return TokenizeResult(**stage.finish(cfg.output_dir, params, summary))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input_dir", type=Path, required=True, help="output of data.segment")
    p.add_argument("--vocab_file", type=Path, required=True)
    p.add_argument("--output_dir", type=Path, required=True)
    p.add_argument("--no_lower_case", dest="lower_case", action="store_false")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    a = p.parse_args(argv)
    r = stage.cli_call(tokenize, TokenizeConfig(a.input_dir, a.vocab_file, a.output_dir, a.lower_case, a.workers))
    print(f"tokenize: {r.documents} documents, {r.sentences} sentences, {r.tokens} tokens, {r.seconds:.1f} s")


if __name__ == "__main__":
    main()
