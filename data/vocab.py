"""Stage 4: the WordPiece vocabulary: a given vocab.txt (checked) or one trained on the corpus.

    python -m data.vocab --vocab_file bert-base-uncased-vocab.txt --output_dir out
    python -m data.vocab --corpus_dir text/sentences --vocab_size 30522 --output_dir out [--min_frequency 2] \\
        [--no_lower_case]

The vocab used is always written to `<output_dir>/vocab.txt`. A trained vocab holds up to --vocab_size tokens:
training stops early when no pair of pieces left occurs --min_frequency times or more in the corpus, and the
stage's line then says so.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from tokenizers import BertWordPieceTokenizer, Tokenizer
from tokenizers.models import WordPiece
from tokenizers.normalizers import BertNormalizer
from tokenizers.pre_tokenizers import BertPreTokenizer

from data import segment as segment_stage
from data import stage
from data.cli import HelpFormatter, add_workers_argument, given_options, non_negative_int
from data.extract import list_parts
from data.parallel import bounded_map
from data.stage import PipelineError

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_BOM = "\ufeff"
# The version of the vocab this stage trains. Bump it whenever a training on the same corpus and
# settings gives another vocab (another alphabet rule, trainer or ordering): a finished vocab_training
# directory of another version is then refused, and an unfinished one started afresh.
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Vocab:
    path: Path
    tokens: list[str]

    @property
    def size(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class VocabConfig:
    output_dir: Path
    vocab_file: Path | None = None
    corpus_dir: Path | None = None
    vocab_size: int = 30522
    lower_case: bool = True
    min_frequency: int = 2
    limit_alphabet: int = 1000  # the most frequent characters kept as single-character tokens
    workers: int = 1


# Unicode White_Space, which the Rust tokenizer trims from the end of each vocab line.
_TRAILING_SPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" \
    "\u2028\u2029\u202f\u205f\u3000"


def load_vocab(path: Path) -> Vocab:
    """Read a vocab.txt (one token per line, id = line number) and check the special tokens.

    Lines are read as the Rust tokenizer reads them (split at "\n", trailing white space trimmed), so
    that both number the tokens alike. A file they would number differently is refused.
    """
    if not path.is_file():
        what = "is a directory, not a vocab file" if path.is_dir() else "no such vocab file"
        raise PipelineError(f"{path}: {what}; pass a BERT vocab.txt with --vocab_file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PipelineError(f"{path} is not UTF-8 text; a vocab.txt has one token per line") from exc
    except OSError as exc:
        raise stage.unreadable_input(path, exc, "--vocab_file") from exc
    if text.startswith(_BOM):
        # Refused, not stripped: the file would still carry it to the other readers, which keep it (the Rust
        # tokenizer reads '\ufeff[PAD]'; the export's tokenizer then finds no [PAD] and adds one).
        raise PipelineError(
            f"{path} starts with a UTF-8 byte-order mark (bytes EF BB BF, as some Windows editors save), which "
            f"readers of a vocab.txt take as part of the first token ({text.split(chr(10), 1)[0]!r}); remove it, "
            f"e.g. with: sed -i '1s/^\\xEF\\xBB\\xBF//' {shlex.quote(str(path))}")
    if text.lstrip().startswith("{"):
        # A vocab.txt starts with [PAD]; this one's lines would be refused as repeats or as lacking it.
        raise PipelineError(
            f"{path} is JSON (a tokenizer.json or vocab.json?), not a vocab.txt of one token per line in id "
            "order; pass the vocab.txt saved with the model (tokenizer.save_pretrained writes one)")
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    tokens = [line.rstrip(_TRAILING_SPACE) for line in lines]
    _check_lines(path, lines, tokens)
    missing = [t for t in SPECIAL_TOKENS if t not in tokens]
    if missing:
        raise PipelineError(
            f"{path} lacks the special token(s) {', '.join(missing)}; a BERT vocab.txt needs "
            f"{', '.join(SPECIAL_TOKENS)} (the standard uncased vocab has them at ids 0, 100-103)"
        )
    if tokens[0] != "[PAD]":
        raise PipelineError(f"{path}: [PAD] must be the first line (id 0), since the HDF5 shards pad with 0")
    if len(tokens) == len(SPECIAL_TOKENS):  # (they are all there, once each)
        raise PipelineError(f"{path} holds only the special tokens {', '.join(SPECIAL_TOKENS)}: no word piece to "
                            "tokenize text into, nor to replace a masked token with; pass a BERT vocab.txt (the "
                            "standard uncased one has 30,522 tokens)")
    return Vocab(path, tokens)


def _check_lines(path: Path, lines: list[str], tokens: list[str]) -> None:
    """Refuse lines that would give a token two ids, or that another reader would split in two."""
    for number, line in enumerate(lines, 1):
        if len(line.splitlines()) > 1:
            raise PipelineError(
                f"{path} line {number}: {line!r} holds a line-break character inside the token, so readers "
                "that split lines at it (Python's splitlines, some editors) number the tokens differently; "
                "remove or replace that character")
    first: dict[str, int] = {}
    for number, token in enumerate(tokens, 1):
        if token in first:
            raise PipelineError(
                f"{path} line {number} repeats the token {token!r} of line {first[token]} (trailing white space "
                "is ignored); a token can have only one id: remove one of the two lines")
        first[token] = number


def cased_tokens(tokens: list[str]) -> list[str]:
    """The tokens (special ones aside) that BERT's uncased normalisation would change: it lower-cases and
    strips accents and combining marks, so an uncased vocab holds none, and a cased one holds capitals,
    or marks in a script without capitals."""
    uncased = BertNormalizer(clean_text=False, handle_chinese_chars=False, strip_accents=True, lowercase=True)
    return [t for t in tokens if t not in SPECIAL_TOKENS and uncased.normalize_str(t) != t]


# A lower-cased run's vocab may hold this fraction of cased tokens (check_case); for shards that do not
# record their case, the export's tokenizer lower-cases for a vocab within it (modeling.vocab_lower_cases).
CASED_TOKENS_TOLERATED = 0.01


def check_case(vocab: Vocab, lower_case: bool) -> None:
    """Refuse a vocab whose case contradicts the tokenization's (Google's validate_case_matches_checkpoint).

    Cased or uncased is decided by `cased_tokens`, as the export guesses it for shards that do not record
    their case (`modeling.vocab_lower_cases`: up to CASED_TOKENS_TOLERATED of them, as a lower-cased run
    may have).
    Cased text against an uncased vocab turns every capitalised or accented word into [UNK]; uncased text
    against a cased vocab can never produce its cased tokens. A few stray cased tokens in a custom vocab
    pass. A vocab with neither (Han alone, say) counts as uncased: lower-casing then changes nothing the
    vocab could tell apart.
    """
    cased = cased_tokens(vocab.tokens)
    if not lower_case and not cased:
        raise PipelineError(
            f"{vocab.path} is an uncased vocab (no token has a capital letter, an accent or a combining mark), but "
            "lower-casing is off: every capitalised or accented word would become [UNK]. Drop --no_lower_case, "
            "or pass a cased vocab.txt")
    if lower_case and len(cased) > CASED_TOKENS_TOLERATED * len(vocab.tokens):
        raise PipelineError(
            f"{vocab.path} is a cased vocab ({len(cased)} tokens such as {cased[0]!r} have capitals, accents or "
            "combining marks), but the text is lower-cased and stripped of accents, so those tokens could never "
            "occur. Pass --no_lower_case, or an uncased vocab.txt")


def make_tokenizer(vocab_path: Path, lower_case: bool) -> Tokenizer:
    """BERT's WordPiece tokenizer (the Rust one) for corpus text.

    Unlike `BertWordPieceTokenizer`, it knows no special tokens, so article text that spells
    "[SEP]" or "[MASK]" becomes ordinary pieces ("[", "sep", "]") as in Google's
    create_pretraining_data.py, never a real separator or mask inside an instance.
    (transformers.BertTokenizer(vocab_file=...) is no alternative: 5.x silently ignores the file.)
    """
    tokenizer = Tokenizer(WordPiece.from_file(str(vocab_path), unk_token="[UNK]", max_input_chars_per_word=100))
    tokenizer.normalizer = BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                          strip_accents=lower_case, lowercase=lower_case)
    tokenizer.pre_tokenizer = BertPreTokenizer()
    return tokenizer


def check_training_settings(vocab_size: int, limit_alphabet: int) -> None:
    if vocab_size <= len(SPECIAL_TOKENS):
        raise PipelineError(f"--vocab_size {vocab_size} leaves no room for word pieces beside the "
                            f"{len(SPECIAL_TOKENS)} special tokens; BERT's is 30522")
    if limit_alphabet < 1:
        raise PipelineError(f"--limit_alphabet {limit_alphabet} keeps no character; the default is 1000")


def build_vocab(cfg: VocabConfig) -> Vocab:
    """Write `<output_dir>/vocab.txt` (copied or trained) and return it.

    The output directory's shards are made with that vocab, so a run that would put another vocab
    there is refused rather than leaving shards beside a vocab that does not match them.
    """
    stage.make_dir(cfg.output_dir)
    target = cfg.output_dir / "vocab.txt"
    stage.remove_leftovers(target)
    if cfg.vocab_file is not None:
        vocab = load_vocab(cfg.vocab_file)
        if target.is_file():
            if target.read_bytes() != cfg.vocab_file.read_bytes():
                raise PipelineError(_other_vocab(target, f"--vocab_file {cfg.vocab_file}"))
        else:
            with stage.atomic_path(target) as tmp:
                shutil.copyfile(cfg.vocab_file, tmp)
        return Vocab(target, vocab.tokens)
    if cfg.corpus_dir is None:
        raise PipelineError("no vocab: pass --vocab_file vocab.txt, or a corpus to train one on")
    check_training_settings(cfg.vocab_size, cfg.limit_alphabet)
    files = list_parts(cfg.corpus_dir)
    if not files:
        raise PipelineError(f"{cfg.corpus_dir}: no part-*.txt files to train a vocab on; run data.segment first")
    params = {stage.VERSION_KEY: FORMAT_VERSION,
              "corpus": stage.fingerprint(cfg.corpus_dir, segment_stage.FORMAT_VERSION, writer="data.segment"),
              "vocab_size": cfg.vocab_size,
              "lower_case": cfg.lower_case, "min_frequency": cfg.min_frequency, "limit_alphabet": cfg.limit_alphabet}
    stage_dir = cfg.output_dir / "vocab_training"
    trained = stage_dir / "model" / "vocab.txt"
    if target.is_file() and stage.completed(stage_dir, params) is None:
        # Ours is copied into place only once training is complete: this one came from elsewhere.
        raise PipelineError(_other_vocab(target, "a vocab trained on the corpus"))
    done = stage.begin(stage_dir, params)
    if done is None:
        tokenizer = _train(files, cfg)
        with stage.atomic_path(stage_dir / "model") as tmp:
            tmp.mkdir()
            _save_model(tokenizer, tmp, trained)
        done = stage.finish(stage_dir, params, {"vocab_size": load_vocab(trained).size, "sha1": stage.file_sha1(trained)})
    if not target.is_file():
        with stage.atomic_path(target) as tmp:
            shutil.copyfile(trained, tmp)
    elif stage.file_sha1(target) != done["sha1"]:
        raise PipelineError(_other_vocab(target, f"the vocab trained into {trained}"))
    return load_vocab(target)


def shortfall(vocab: Vocab, cfg: VocabConfig) -> str | None:
    """Why a vocab trained for `cfg` holds fewer tokens than --vocab_size, or None (a vocab given, or one of that
    size). The trainer merges the corpus's most frequent pair of pieces into a new token until the vocab holds
    --vocab_size tokens, and stops early when no pair left occurs --min_frequency times or more, as on a small
    corpus: the 206-page sample gives 26887 tokens at the defaults (30522 and 2)."""
    if cfg.vocab_file is not None or vocab.size >= cfg.vocab_size:
        return None
    if cfg.min_frequency > 1:
        why = (f"the corpus has no more pairs of pieces that occur --min_frequency {cfg.min_frequency} times or more "
               "to merge; more text, or a lower --min_frequency, gives more tokens")
    else:
        why = "the corpus has no more pairs of pieces to merge; more text gives more tokens"
    return f"fewer than --vocab_size {cfg.vocab_size}: {why}"


def vocab_line(vocab: Vocab, cfg: VocabConfig) -> str:
    """The vocab stage's line: its size and file, and why a trained one holds fewer tokens than asked for."""
    short = shortfall(vocab, cfg)
    return f"{vocab.size} tokens -> {vocab.path}" + (f" ({short})" if short else "")


def _save_model(tokenizer: BertWordPieceTokenizer, directory: Path, final: Path) -> None:
    """Save the trained vocab into `directory`. The Rust library raises a failed write (a full disk) as a bare
    Exception with the OS error's number in its text ("No space left on device (os error 28)"): it is raised
    as the OSError it is, naming the vocab file (`final`), for the line that says to free space."""
    try:
        tokenizer.save_model(str(directory))
    except Exception as exc:  # noqa: BLE001 - the library's only exception type; others are raised as they are
        code = re.search(r"\(os error (\d+)\)$", str(exc))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(final)) from exc


def _count_characters(path: Path) -> collections.Counter[str]:
    text, _ = stage.read_utf8(path, f"delete {path.parent} and the directories made from it, and segment again")
    return collections.Counter(text)


def corpus_alphabet(files: list[Path], tokenizer: BertWordPieceTokenizer, limit: int, workers: int) -> list[str]:
    """The `limit` most frequent characters of the corpus as `tokenizer` normalises it, ties broken by
    code point, in code-point order.

    Characters are counted raw and normalised one by one: BERT's normaliser (control characters
    dropped, NFD, accents stripped, lower-casing) maps each character on its own, so the counts are
    those of the normalised text, at the speed of a C loop instead of the normaliser's.
    """
    raw: collections.Counter[str] = collections.Counter()
    for counts in bounded_map(_count_characters, files, workers):
        raw.update(counts)
    normalised: collections.Counter[str] = collections.Counter()
    for char, count in raw.items():
        for c in tokenizer.normalizer.normalize_str(char):
            if not c.isspace():
                normalised[c] += count
    ranked = sorted(normalised.items(), key=lambda item: (-item[1], item[0]))
    return sorted(c for c, _ in ranked[:limit])


def _train(files: list[Path], cfg: VocabConfig) -> BertWordPieceTokenizer:
    """Train a WordPiece vocab that is the same in every run on the same corpus.

    Left to itself, `tokenizers`' trainer is not: it numbers the `##` continuation pieces in the
    iteration order of a Rust HashMap, seeded afresh for every map, breaks ties between equally
    frequent pairs by those numbers, and picks the alphabet among equally frequent characters the
    same way. The same corpus gave vocabs in other orders, and at 30,522 tokens other tokens, from
    run to run. So the alphabet is chosen here, and it and its `##` forms are handed to the trainer
    as fixed tokens in code-point order (Google's vocab also holds every character in both forms):
    every piece then has the same number in every run, and so does every merge.
    """
    tokenizer = BertWordPieceTokenizer(lowercase=cfg.lower_case, strip_accents=cfg.lower_case)
    alphabet = corpus_alphabet(files, tokenizer, cfg.limit_alphabet, cfg.workers)
    if not alphabet:
        raise PipelineError(f"{cfg.corpus_dir}: the part files hold no text to train a vocab on")
    fixed = [*SPECIAL_TOKENS, *alphabet, *(f"##{c}" for c in alphabet)]
    if cfg.vocab_size < len(fixed):
        # Lowering --limit_alphabet is offered only where it chose the alphabet; below the corpus's own
        # character count it would turn characters the text uses into [UNK].
        clipped = len(alphabet) == cfg.limit_alphabet
        raise PipelineError(
            f"--vocab_size {cfg.vocab_size} is smaller than the {len(SPECIAL_TOKENS)} special tokens and the "
            f"corpus's {len(alphabet)} {'most frequent ' if clipped else ''}characters in their two forms "
            f"({len(fixed)} tokens); raise --vocab_size to at least {len(fixed)}"
            + (f" or lower --limit_alphabet (now {cfg.limit_alphabet})" if clipped else ""))
    # limit_alphabet = the alphabet's size with the alphabet as initial_alphabet keeps exactly it.
    tokenizer.train([str(f) for f in files], vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                    limit_alphabet=len(alphabet), initial_alphabet=alphabet, special_tokens=fixed,
                    show_progress=True)
    return tokenizer


def _other_vocab(target: Path, wanted: str) -> str:
    if not any(p.name != target.name and not p.name.startswith(".") for p in target.parent.iterdir()):
        # Nothing was made with it: a vocab the user put there, which "delete the directory" would lose.
        return (f"{target} is another vocab than {wanted}, and nothing in {target.parent} was made with it; move "
                f"it away (or pass it as --vocab_file to use it) and rerun")
    return (f"{target} is another vocab than {wanted}, and the output in {target.parent} was made with it; "
            f"use another output directory, or delete {target.parent} to start over with the new vocab")


TRAINING_OPTIONS = {"vocab_size", "min_frequency", "limit_alphabet"}  # the dests add_training_arguments adds


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a trained vocab, for data.vocab and data.prepare (which refuse them beside --vocab_file)."""
    parser.add_argument("--vocab_size", type=int, default=30522,
                        help="size of a trained vocab: the most it holds (fewer when the corpus runs out of pairs to "
                             "merge)")
    parser.add_argument("--min_frequency", type=non_negative_int, default=2,
                        help="when training: merge only pairs of pieces that occur this many times or more in the "
                             "corpus")
    parser.add_argument("--limit_alphabet", type=int, default=1000,
                        help="characters kept as tokens when training: the most frequent ones")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--output_dir", type=Path, required=True, help="where vocab.txt is written")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--vocab_file", type=Path, help="use this BERT vocab.txt")
    src.add_argument("--corpus_dir", type=Path, help="train a WordPiece vocab on this data.segment output")
    add_training_arguments(p)
    p.add_argument("--no_lower_case", dest="lower_case", action="store_false",
                   help="keep case (and accents) when training the vocab; data.tokens needs the same flag")
    add_workers_argument(p, help="processes counting characters (default: the cores this process may use, %(default)s here)")
    a = p.parse_args(argv)
    if a.vocab_file is not None and given_options(p, argv) & (TRAINING_OPTIONS | {"lower_case", "workers"}):
        p.error("--vocab_size, --min_frequency, --limit_alphabet, --no_lower_case and --workers apply when "
                "training (--corpus_dir), not with --vocab_file (tokenization case is data.tokens' --no_lower_case)")
    cfg = VocabConfig(a.output_dir, a.vocab_file, a.corpus_dir, a.vocab_size, a.lower_case, a.min_frequency,
                      a.limit_alphabet, a.workers)
    v = stage.cli_call(build_vocab, cfg)
    print(f"vocab: {vocab_line(v, cfg)}")


if __name__ == "__main__":
    main()
