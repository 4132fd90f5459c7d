"""Stage 5: tokenize the segmented corpus once, with BERT's WordPiece, each distinct word once per part.

Distinct words are looked up in the vocab (most of them) or tokenized by the Rust tokenizer in
one batch; the token ids equal the Rust tokenizer's on whole sentences (`WordPieceTokenizer`).

Each segmented part becomes `<output_dir>/part-NNNNN.npz` holding
  ids               int32 [tokens]     all token ids of the part, sentence after sentence
  sentence_lengths  int32 [sentences]  tokens per sentence (sentences with no tokens are dropped)
  doc_sentences     int32 [documents]  sentences per document (documents with none are dropped)
Phase 1 and phase 2 both create their instances from these files, so text is tokenized once.

    python -m data.tokens --input_dir text/sentences --vocab_file out/vocab.txt --output_dir text/tokens
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import re
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data import segment as segment_stage
from data import stage
from data.cli import HelpFormatter, add_workers_argument
from data.extract import list_parts
from data.parallel import bounded_map
from data.stage import PipelineError
from data.vocab import check_case, load_vocab, make_tokenizer

# The version of the token files this stage writes. Bump it whenever its output for the same sentences
# and vocab changes (another tokenization rule, file layout or dtype): a finished tokens directory of
# another version is then refused, and an unfinished one started afresh, instead of being reused.
# (Version 1 tokenizes text that spells a special token, "[SEP]", as text.)
FORMAT_VERSION = 1


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
    # [UNK]s: 0.002% with the BERT uncased vocab on English Wikipedia; far more says the vocab does not fit
    # (UNKNOWN_WARNING_SHARE).
    unknown_tokens: int
    seconds: float

    @property
    def unknown_share(self) -> float:
        return self.unknown_tokens / max(self.tokens, 1)

    def line(self) -> str:
        """What the stage did, in one line."""
        return (f"{self.documents} documents, {self.sentences} sentences, {self.tokens} tokens "
                f"({self.unknown_share:.3%} [UNK])")


# Above this share of [UNK] tokens the vocab does not fit the corpus. On the English sample, BERT's uncased
# vocab leaves 0.002% and vocabs trained on it 0% to 0.07% (--limit_alphabet 1000 down to 60), while a
# trained alphabet that misses characters of the corpus leaves 1.8% (40 characters: some digits missing),
# 8.2% (26) or 26% (20): 1% is 14 times the largest share of a vocab that fits (measured 2026-11-24).
UNKNOWN_WARNING_SHARE = 0.01


def unknown_warning(result: TokenizeResult, vocab_file: Path) -> str | None:
    """A warning line when the [UNK] share says the vocab does not fit the corpus, else None."""
    if result.unknown_share <= UNKNOWN_WARNING_SHARE:
        return None
    return (f"warning: {result.unknown_share:.2%} of the tokens are [UNK] with the vocab {vocab_file} (a vocab that "
            f"fits the text leaves under {UNKNOWN_WARNING_SHARE:.0%}: BERT's uncased vocab leaves 0.002% of English "
            "Wikipedia). The model learns nothing from those tokens: use a vocab for the corpus's language and "
            "script, or train one (with a larger --limit_alphabet if the corpus has many characters, as Chinese "
            "or Japanese)")


@dataclass(frozen=True)
class TokenizedPart:
    ids: np.ndarray
    sentence_lengths: np.ndarray
    doc_sentences: np.ndarray


# Python's str.split() separates words at these control characters (category Cc), which BERT's
# normalizer deletes instead: "a\x1cb" is one word to BERT. They are deleted before splitting.
_DELETED_SEPARATORS_STR = "\x0b\x0c\x1c\x1d\x1e\x1f\x85"
_DELETED_SEPARATORS = dict.fromkeys(map(ord, _DELETED_SEPARATORS_STR))
# How BERT's pre-tokenizer splits a printable ASCII word: runs of letters and digits, and every
# other character (all ASCII punctuation and symbols) on its own.
_ASCII_PIECES = re.compile(r"[A-Za-z0-9]+|[^A-Za-z0-9]")


class WordPieceTokenizer:
    """BERT WordPiece tokenization of whole texts, each distinct word tokenized once.

    BERT's normalizer and pre-tokenizer never join or split text across whitespace, so a text's
    tokens are the concatenation of its whitespace-separated words' tokens. A part of Wikipedia
    has several times fewer distinct words than words (7x in the sample), so this class tokenizes each
    distinct word once: a printable ASCII word whose pieces are all in the vocab (most of them) by
    dictionary lookups, every other word by the Rust tokenizer in one batch. The result equals the Rust tokenizer's on
    the whole text (tested on the sample corpus and on every separator and special case).

    Text that spells a special token ("[SEP]") is tokenized as text, never as the special token.
    """

    def __init__(self, vocab_file: Path, lower_case: bool):
        self.rust = make_tokenizer(vocab_file, lower_case)
        self._vocab = self.rust.get_vocab()
        self._lower_case = lower_case

    def encode_words(self, words: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(token ids of all `words` concatenated, int32; tokens per word, int64).

        `words` must be distinct and free of whitespace (as `split_words` returns them, deduplicated).
        """
        n = len(words)
        vocab_get, pieces_of = self._vocab.get, _ASCII_PIECES.findall
        direct: list[list[int] | None] = []
        for word in words:
            ids = None
            if word.isascii() and word.isprintable():
                ids = [vocab_get(p) for p in pieces_of(word.lower() if self._lower_case else word)]
                if None in ids:
                    ids = None  # a piece outside the vocab: WordPiece splits it, in Rust below
            direct.append(ids)
        rest = [i for i, ids in enumerate(direct) if ids is None]
        counts = np.fromiter((0 if ids is None else len(ids) for ids in direct), dtype=np.int64, count=n)
        rest_ids = np.zeros(0, dtype=np.int32)
        if rest:
            enc = self.rust.encode([words[i] for i in rest], is_pretokenized=True, add_special_tokens=False)
            rest_ids = np.asarray(enc.ids, dtype=np.int32)
            counts[rest] = np.bincount(np.asarray(enc.word_ids, dtype=np.int64), minlength=len(rest))
        offsets = _offsets(counts)
        flat = np.empty(int(offsets[-1]), dtype=np.int32)
        is_direct = np.ones(n, dtype=bool)
        is_direct[rest] = False
        flat[_ranges(offsets[:-1][is_direct], counts[is_direct])] = np.fromiter(
            (t for ids in direct if ids is not None for t in ids), dtype=np.int32, count=int(counts[is_direct].sum()))
        flat[_ranges(offsets[rest], counts[rest])] = rest_ids
        return flat, counts

    def tokenize_sentences(self, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(all token ids, sentence after sentence, int32; tokens per sentence, int32)."""
        sentence_words = [split_words(s) for s in sentences]
        n_words = np.fromiter(map(len, sentence_words), dtype=np.int64, count=len(sentences))
        distinct = list(dict.fromkeys(itertools.chain.from_iterable(sentence_words)))
        index = dict(zip(distinct, range(len(distinct))))
        occurrences = np.fromiter(map(index.__getitem__, itertools.chain.from_iterable(sentence_words)),
                                  dtype=np.int64, count=int(n_words.sum()))
        flat, counts = self.encode_words(distinct)
        per_word = counts[occurrences]
        ids = flat[_ranges(_offsets(counts)[occurrences], per_word)]
        return ids, np.diff(_offsets(per_word)[_offsets(n_words)]).astype(np.int32)


def split_words(text: str) -> list[str]:
    """Whitespace-separated words, as BERT's normalizer delimits them."""
    if any(c in text for c in _DELETED_SEPARATORS_STR):
        text = text.translate(_DELETED_SEPARATORS)
    return text.split()


def _offsets(counts: np.ndarray) -> np.ndarray:
    """[0, c0, c0 + c1, ...]: where each run of `counts` starts in the concatenation, then its end (int64)."""
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of arange(s, s + n) for each (s, n), without a Python loop."""
    run_starts = _offsets(lengths)
    return np.repeat(starts - run_starts[:-1], lengths) + np.arange(run_starts[-1])


def tokenize_text(text: str, tokenizer: WordPieceTokenizer) -> TokenizedPart:
    """Tokenize segmented text (one sentence per line, blank line between documents)."""
    docs = [d.split("\n") for d in text.split("\n\n") if d.strip()]
    ids, lengths = tokenizer.tokenize_sentences([s for d in docs for s in d])
    # Documents by their sentence counts; sentences that tokenize to nothing are dropped.
    doc_ends = _offsets(np.fromiter(map(len, docs), dtype=np.int64, count=len(docs)))
    counts = np.diff(_offsets(lengths > 0)[doc_ends]).astype(np.int32)
    return TokenizedPart(ids, lengths[lengths > 0], counts[counts > 0])


@contextlib.contextmanager
def open_part(path: Path) -> Iterator[np.lib.npyio.NpzFile]:
    """A tokenized part's arrays, read lazily; a file that cannot be read as one is named in a PipelineError."""
    try:
        with np.load(path) as z:
            yield z
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as exc:
        raise PipelineError(
            f"{path} cannot be read as a tokenized part ({type(exc).__name__}: {exc}); it was damaged after "
            f"data.tokens wrote it: delete {path.parent} and the directories made from it, and tokenize again"
        ) from exc


def load_part(path: Path) -> TokenizedPart:
    with open_part(path) as z:
        return TokenizedPart(z["ids"], z["sentence_lengths"], z["doc_sentences"])


def _tokenize_part(task: tuple[Path, Path, Path, bool, int]) -> tuple[int, int, int, int]:
    src, dst, vocab_file, lower_case, unk_id = task
    if dst.is_file():
        part = load_part(dst)
    else:
        text, _ = stage.read_utf8(src, f"delete {src.parent} and the directories made from it, and segment again")
        part = tokenize_text(text, WordPieceTokenizer(vocab_file, lower_case))
        with stage.atomic_path(dst) as tmp, tmp.open("wb") as f:
            np.savez(f, ids=part.ids, sentence_lengths=part.sentence_lengths, doc_sentences=part.doc_sentences)
    unknown = int(np.count_nonzero(part.ids == unk_id))
    return len(part.doc_sentences), len(part.sentence_lengths), len(part.ids), unknown


def tokenize(cfg: TokenizeConfig) -> TokenizeResult:
    stage.require_input(cfg.input_dir, "--input_dir", "data.segment",
                        f"{cfg.input_dir} is not a complete segmentation; run data.segment into it first")
    vocab = load_vocab(cfg.vocab_file)
    sources = list_parts(cfg.input_dir)
    params = {stage.VERSION_KEY: FORMAT_VERSION,
              "sentences": stage.fingerprint(cfg.input_dir, segment_stage.FORMAT_VERSION, writer="data.segment"),
              "parts": len(sources),
              "lower_case": cfg.lower_case, "vocab_sha1": stage.file_sha1(cfg.vocab_file)}
    done = stage.begin(cfg.output_dir, params)
    if done is not None:
        return TokenizeResult(**done)
    start = time.perf_counter()
    unk_id = vocab.tokens.index("[UNK]")
    tasks = [(src, cfg.output_dir / f"{src.stem}.npz", cfg.vocab_file, cfg.lower_case, unk_id) for src in sources]
    documents = sentences = tokens = unknown = 0
    with tqdm(total=len(tasks), desc="tokenize", unit=" parts", dynamic_ncols=True) as bar:
        for d, s, t, u in bounded_map(_tokenize_part, tasks, cfg.workers):
            documents, sentences, tokens, unknown = documents + d, sentences + s, tokens + t, unknown + u
            bar.update(1)
    if tokens == 0:
        raise PipelineError(f"{cfg.input_dir}: the corpus has no tokens")
    summary = {"documents": documents, "sentences": sentences, "tokens": tokens, "unknown_tokens": unknown,
               "seconds": round(time.perf_counter() - start, 3)}
    return TokenizeResult(**stage.finish(cfg.output_dir, params, summary,
                                         inputs={"vocab_file": str(cfg.vocab_file.resolve())}))


def tokenize_with_given_vocab(cfg: TokenizeConfig) -> TokenizeResult:
    """tokenize() with a vocab the user chose, whose case must match the tokenization's.

    data.prepare checks a given vocab the same way, before any stage; a vocab trained on the corpus
    is not checked: text in a script without capitals trains a vocab without any.
    """
    check_case(load_vocab(cfg.vocab_file), cfg.lower_case)
    return tokenize(cfg)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--input_dir", type=Path, required=True, help="output of data.segment")
    p.add_argument("--vocab_file", type=Path, required=True, help="BERT vocab.txt")
    p.add_argument("--output_dir", type=Path, required=True, help="the tokens directory")
    p.add_argument("--no_lower_case", dest="lower_case", action="store_false",
                   help="keep case and accents (for a cased vocab)")
    add_workers_argument(p)
    a = p.parse_args(argv)
    r = stage.cli_call(tokenize_with_given_vocab, TokenizeConfig(a.input_dir, a.vocab_file, a.output_dir, a.lower_case, a.workers))
    print(f"tokens: {r.line()}, {r.seconds:.1f} s")
    warning = unknown_warning(r, a.vocab_file)
    if warning:
        print(warning)


if __name__ == "__main__":
    main()
