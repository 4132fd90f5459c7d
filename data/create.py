"""Stage 6: tokenized documents -> NSP sentence pairs with (optionally) static MLM masks.

The recipe is BERT's (`create_pretraining_data.py`): per document and per duplicate, sentences
are packed greedily up to a target length (`max_seq_length - 3`, or with probability
`short_seq_prob` a random shorter one), split at a random point into A and B, and B is replaced
by text from a random other document half of the time (NSP label 1). The pair is truncated
from the longer side, at a random end. `masked_lm_prob` of the tokens (at least one, at most
`max_predictions_per_seq`) are chosen; 80% become [MASK], 10% a random token, 10% stay.

What differs from the reference is how, not what:
- only the pair boundaries are planned in a Python loop, over sentence lengths; tokens are never
  touched there. Every instance is a pair of spans into the part's flat token array, and the
  instances are built and masked for a whole block at once with numpy.
- truncation removes the same number of tokens from each side as the reference's one-at-a-time
  loop; the number taken from the front is drawn as Binomial(k, 0.5), which is the distribution
  of the reference's k coin flips.
- the random "next" document is drawn from the same part (2,000 articles by default) and split
  rather than from the whole corpus, uniformly among the documents other than A's (the reference
  retries 10 times and may end on A's own), and every random draw comes from generators seeded
  by (seed, part, split). The output is therefore identical whatever the number of workers.
- random replacement tokens exclude [PAD], [UNK], [CLS], [SEP] and [MASK].

A fraction `test_fraction` of each part's documents is held out: their instances (pairs drawn
only among held-out documents) go to the test split. A part with a single held-out document
trains on it instead, since a random next needs another document.

Output, per part and split: `<output_dir>/<training|test>/part-NNNNN/<key>.npy` with the HDF5 keys.

    python -m data.create --input_dir text/tokens_xxx --vocab_file out/vocab.txt --output_dir out/instances
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data import stage
from data import tokens as tokens_stage
from data.cli import HelpFormatter, add_workers_argument
from data.parallel import bounded_map
from data.stage import PipelineError
from data.tokens import TokenizedPart, load_part, open_part
from data.vocab import SPECIAL_TOKENS, load_vocab

# The version of the instances this stage writes. Bump it whenever its output for the same tokens and
# settings changes (another pairing, truncation or masking rule, random draw or file layout): a
# finished instances directory of another version is then refused, and an unfinished one started
# afresh, instead of being reused.
FORMAT_VERSION = 1

SPLITS = ("training", "test")
KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels")
DTYPES = {"input_ids": np.int32, "input_mask": np.int8, "segment_ids": np.int8,
          "masked_lm_positions": np.int32, "masked_lm_ids": np.int32, "next_sentence_labels": np.int8}
# Instances built per numpy block: bounds the temporaries (about 40 bytes per token slot).
BLOCK = 8192


@dataclass(frozen=True)
class CreateConfig:
    input_dir: Path
    vocab_file: Path
    output_dir: Path
    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    dupe_factor: int = 5
    short_seq_prob: float = 0.1
    masked_lm_prob: float = 0.15
    whole_word_masking: bool = False
    static_masking: bool = True
    test_fraction: float = 0.02
    seed: int = 12345
    workers: int = 1


@dataclass(frozen=True)
class CreateResult:
    instances: dict[str, int]
    part_counts: dict[str, list[int]]
    masked_tokens: int
    vocab_size: int
    seconds: float


def validate(cfg: CreateConfig) -> None:
    if cfg.max_seq_length < 8:
        raise PipelineError(f"max_seq_length must be at least 8, got {cfg.max_seq_length}")
    maskable = cfg.max_seq_length - 3
    if cfg.max_predictions_per_seq < 1:
        raise PipelineError(f"max_predictions_per_seq must be at least 1, got {cfg.max_predictions_per_seq}: every "
                            "instance masks at least one token; use 20 at 128 or 80 at 512")
    if cfg.max_predictions_per_seq > maskable:
        raise PipelineError(
            f"max_predictions_per_seq {cfg.max_predictions_per_seq} is not possible at max_seq_length "
            f"{cfg.max_seq_length}: at most {maskable} tokens can be masked ([CLS] and two [SEP] never are); "
            "use 20 at 128 or 80 at 512"
        )
    for name in ("short_seq_prob", "test_fraction"):
        value = getattr(cfg, name)
        if not 0.0 <= value < 1.0:
            raise PipelineError(f"{name} must be in [0, 1), got {value}")
    if not 0.0 < cfg.masked_lm_prob < 1.0:
        # The trainer refuses shards whose masked_lm_prob attribute is outside (0, 1) (training/loader.py).
        raise PipelineError(f"masked_lm_prob must be in (0, 1), got {cfg.masked_lm_prob}: run_pretraining.py "
                            "refuses shards made with it; BERT uses 0.15")
    if cfg.dupe_factor < 1:
        raise PipelineError(f"dupe_factor must be >= 1, got {cfg.dupe_factor}")
    if cfg.seed < 0:
        raise PipelineError(f"seed must be >= 0 (numpy's seed sequences take no negative numbers), got {cfg.seed}")


BERT_POSITIONS = 512  # max_position_embeddings of BERT, and the most of any model config in configs/models


def long_sequence_warning(max_seq_length: int) -> str | None:
    """Longer sequences are valid data but no shipped model can train on them; say so before the stages run,
    since the trainer only refuses them after the shards are written."""
    if max_seq_length <= BERT_POSITIONS:
        return None
    return (f"warning: --max_seq_length {max_seq_length} is above {BERT_POSITIONS}, the max_position_embeddings of "
            "BERT and the most of any config in configs/models; run_pretraining.py refuses these shards unless its "
            f"--config_file has max_position_embeddings of at least {max_seq_length}")


def capped_masking(seq: int, pred: int, masked_lm_prob: float, source: str) -> str | None:
    """Why `pred` predictions, not given but taken from `source` (a default or a preset), would cap the masking
    below masked_lm_prob; None when they do not. Impossible values are left to `validate`."""
    if seq < 1 or not 0 <= masked_lm_prob < 1:
        return None
    wanted = round(masked_lm_prob * seq)
    if wanted <= pred:
        return None
    return (f"{source} --max_predictions_per_seq {pred} would mask at most {pred} of {seq} tokens "
            f"({pred / seq:.1%}), fewer than --masked_lm_prob {masked_lm_prob} asks for ({wanted}); pass "
            f"--max_predictions_per_seq {wanted} or more (given explicitly, a smaller cap is kept)")


@dataclass(frozen=True)
class MaskingVocab:
    """What masking needs of a vocab; the loader's dynamic masking uses it too."""

    cls: int
    sep: int
    mask: int
    size: int
    is_continuation: np.ndarray  # bool per id: a "##" word piece
    replacements: np.ndarray  # ids a random replacement may take

    @classmethod
    def from_file(cls, vocab_file: Path) -> MaskingVocab:
        vocab = load_vocab(vocab_file)
        index = {t: i for i, t in enumerate(vocab.tokens)}
        special = np.array([index[t] for t in SPECIAL_TOKENS])
        return cls(
            cls=index["[CLS]"], sep=index["[SEP]"], mask=index["[MASK]"], size=vocab.size,
            is_continuation=np.array([t.startswith("##") for t in vocab.tokens]),
            replacements=np.flatnonzero(~np.isin(np.arange(vocab.size), special)).astype(np.int32),
        )


def derive_seed(*values: int) -> int:
    return int(np.random.SeedSequence(list(values)).generate_state(1, dtype=np.uint64)[0])


def plan_pairs(sentence_starts: list[int], doc_first: list[int], docs: list[int], max_num_tokens: int,
               short_seq_prob: float, dupe_factor: int, rnd: random.Random) -> np.ndarray:
    """The reference's create_instances_from_document, over sentence boundaries only.

    `sentence_starts` are the token offsets of the part's sentences (with the end as sentinel),
    so the tokens of sentences i..j-1 are starts[j] - starts[i]. `doc_first[d]` is the first
    sentence of document d (with a sentinel); `docs` are the documents to use. Where the
    reference adds sentences one by one until a length is reached, a bisection over the offsets
    finds the same sentence. Uniform integers come from `lo + int(random() * span)`
    (random.randint costs several times more). Returns int64 [n, 5]: a_start, a_len, b_start,
    b_len, is_random_next, with starts as offsets into the part's flat token array.
    With a single document there is no other to draw a random next from: every pair is a true
    next, and a chunk of one sentence makes none.
    """
    out: list[tuple[int, int, int, int, int]] = []
    append, uniform, starts = out.append, rnd.random, sentence_starts  # bound once: the loop is hot
    n_docs = len(docs)
    for _ in range(dupe_factor):
        for di, d in enumerate(docs):
            first, last = doc_first[d], doc_first[d + 1]
            target = max_num_tokens
            if uniform() < short_seq_prob:
                target = 2 + int(uniform() * (max_num_tokens - 1))
            chunk_start = first
            while chunk_start < last:
                # The chunk ends at the first sentence that brings it to `target` tokens, or the last one.
                chunk_end = bisect_left(starts, starts[chunk_start] + target, chunk_start + 1, last)
                n_chunk = chunk_end - chunk_start
                a_end = chunk_start + (1 + int(uniform() * (n_chunk - 1)) if n_chunk >= 2 else 1)
                a_start = starts[chunk_start]
                a_len = starts[a_end] - a_start
                if n_docs > 1 and (n_chunk == 1 or uniform() < 0.5):
                    # Uniform over the other documents: the reference's 10 retries can end on A's own.
                    r = int(uniform() * (n_docs - 1))
                    r += r >= di
                    rf, rl = doc_first[docs[r]], doc_first[docs[r] + 1]
                    j = rf + int(uniform() * (rl - rf))
                    b_end = bisect_left(starts, starts[j] + target - a_len, j + 1, rl)
                    append((a_start, a_len, starts[j], starts[b_end] - starts[j], 1))
                    # The unused sentences of this chunk start the next one.
                    chunk_start = a_end
                elif n_chunk > 1:
                    append((a_start, a_len, starts[a_end], starts[chunk_end] - starts[a_end], 0))
                    chunk_start = chunk_end
                else:
                    chunk_start = chunk_end  # one sentence of the only document: no pair can be made
    return np.array(out, dtype=np.int64).reshape(-1, 5)


def truncate_pairs(pairs: np.ndarray, max_num_tokens: int, rng: np.random.Generator) -> None:
    """Truncate in place as the reference does: from the longer side (B on ties), at a random end."""
    a_len, b_len = pairs[:, 1], pairs[:, 3]
    excess = np.maximum(a_len + b_len - max_num_tokens, 0)
    cut_a = np.where(a_len > b_len, np.minimum(excess, a_len - b_len), 0)
    cut_b = np.where(b_len >= a_len, np.minimum(excess, b_len - a_len), 0)
    rest = excess - cut_a - cut_b
    cut_a += rest // 2
    cut_b += (rest + 1) // 2
    pairs[:, 0] += rng.binomial(cut_a, 0.5)
    pairs[:, 2] += rng.binomial(cut_b, 0.5)
    pairs[:, 1] -= cut_a
    pairs[:, 3] -= cut_b


def build_block(pairs: np.ndarray, tokens: np.ndarray, max_seq_length: int, vocab: MaskingVocab
                ) -> dict[str, np.ndarray]:
    """[CLS] A [SEP] B [SEP], zero-padded, for every pair at once."""
    n, seq = len(pairs), max_seq_length
    col = np.arange(seq, dtype=np.int32)[None, :]
    spans = pairs[:, :4].astype(np.int32) if len(tokens) < 2**31 - seq else pairs[:, :4]
    a_start, a_len, b_start, b_len = (spans[:, k:k + 1] for k in range(4))
    in_a = (col >= 1) & (col <= a_len)
    in_b = (col >= a_len + 2) & (col <= a_len + b_len + 1)
    # Index of each slot's token in the flat array (slots outside A and B read token 0, then zeroed).
    src = np.where(in_a, a_start - 1 + col, 0)
    np.copyto(src, b_start - a_len - 2 + col, where=in_b)
    ids = tokens[src]
    ids[~(in_a | in_b)] = 0
    rows = np.arange(n)
    ids[:, 0] = vocab.cls
    ids[rows, a_len[:, 0] + 1] = vocab.sep
    ids[rows, a_len[:, 0] + b_len[:, 0] + 2] = vocab.sep
    total = a_len + b_len + 3
    return {
        "input_ids": ids,
        "input_mask": (col < total).astype(np.int8),
        "segment_ids": ((col >= a_len + 2) & (col < total)).astype(np.int8),
        "next_sentence_labels": pairs[:, 4].astype(np.int8),
        "_candidates": in_a | in_b,
        "_total": total[:, 0],
    }


def _whole_words(keys: np.ndarray, cand: np.ndarray, is_piece: np.ndarray, n_pred: np.ndarray) -> np.ndarray:
    """The reference's whole-word choice: words in random order, each taken if it still fits.

    A "##" piece joins the word before it (never across [SEP]). Every word takes the key of its
    first piece, so sorting by key lists the words in random order with their pieces adjacent;
    the greedy pass then runs over word ranks, for all rows at once.
    """
    n, seq = keys.shape
    cont = is_piece & cand
    cont[:, 1:] &= cand[:, :-1]
    col = np.arange(seq)
    word_keys = np.take_along_axis(keys, np.maximum.accumulate(np.where(cont, 0, col[None, :]), axis=1), axis=1)
    order = np.argsort(word_keys, axis=1, kind="stable")
    ordered = np.take_along_axis(word_keys, order, axis=1)
    in_word = np.take_along_axis(cand, order, axis=1)
    first = in_word.copy()
    first[:, 1:] &= ordered[:, 1:] != ordered[:, :-1]
    rank = np.cumsum(first, axis=1) - 1  # the word's place in the random order
    lengths = np.bincount((np.arange(n)[:, None] * seq + rank)[in_word], minlength=n * seq).reshape(n, seq)
    taken = np.zeros((n, seq), dtype=bool)
    count = np.zeros(n, dtype=np.int64)
    for w in range(int(first.sum(axis=1).max(initial=0))):
        fits = (lengths[:, w] > 0) & (count + lengths[:, w] <= n_pred)
        count += np.where(fits, lengths[:, w], 0)
        taken[:, w] = fits
    selected = np.zeros((n, seq), dtype=bool)
    np.put_along_axis(selected, order, np.take_along_axis(taken, np.maximum(rank, 0), axis=1) & in_word, axis=1)
    return selected


def mask_block(block: dict[str, np.ndarray], cfg: CreateConfig, vocab: MaskingVocab, rng: np.random.Generator
               ) -> None:
    """Choose and replace the masked tokens of a block in place; adds the two masked_lm keys."""
    block["masked_lm_positions"], block["masked_lm_ids"] = mask_rows(
        block["input_ids"], block["_candidates"], block["_total"], cfg.max_predictions_per_seq, cfg.masked_lm_prob,
        cfg.whole_word_masking, vocab, rng)


def mask_rows(ids: np.ndarray, candidates: np.ndarray, total: np.ndarray, max_predictions: int,
              masked_lm_prob: float, whole_word_masking: bool, vocab: MaskingVocab,
              rng: np.random.Generator | list[np.random.Generator]) -> tuple[np.ndarray, np.ndarray]:
    """BERT's masking of rows of token ids, in place: min(max_predictions, max(1, round(total *
    masked_lm_prob))) of each row's candidate slots (whole words with `whole_word_masking`); 80% of
    them become [MASK], 10% a random non-special token, 10% stay. `total` is each row's token count,
    [CLS] and [SEP]s included, as in the reference. Returns (masked_lm_positions, masked_lm_ids),
    int32 [rows, max_predictions], ascending positions and zero padding.
    `rng`: one generator for the block, or one per row; a row masked with its own generator comes out as
    it would alone, whichever rows are masked beside it (the loader's masking per stream position).
    """
    n, seq = ids.shape
    n_pred = np.minimum(max_predictions, np.maximum(1, np.round(total * masked_lm_prob).astype(np.int64)))
    col = np.arange(seq, dtype=np.int32)
    # A random key per slot, made unique within its row by its column in the low bits;
    # [CLS], [SEP] and padding get the largest key so they are never chosen.
    low = max(1, int(seq - 1).bit_length())
    draw = _RowDraws(rng)
    keys = (draw.integers(1 << (31 - low), np.full(n, seq), np.int32).reshape(n, seq) << low) | col
    keys[~candidates] = np.iinfo(np.int32).max
    rows = np.arange(n)
    if whole_word_masking:
        selected = _whole_words(keys, candidates, vocab.is_continuation[ids], n_pred)
    else:
        threshold = np.sort(keys, axis=1)[rows, n_pred - 1]
        selected = (keys <= threshold[:, None]) & candidates
    # np.nonzero walks row-major, so each row's positions come out ascending.
    sel_rows, sel_cols = np.nonzero(selected)
    counts = np.count_nonzero(selected, axis=1)
    slot = np.arange(len(sel_rows)) - np.repeat(np.cumsum(counts) - counts, counts)
    positions = np.zeros((n, max_predictions), dtype=np.int32)
    masked_ids = np.zeros((n, max_predictions), dtype=np.int32)
    positions[sel_rows, slot] = sel_cols
    masked_ids[sel_rows, slot] = ids[sel_rows, sel_cols]
    action = draw.random(counts)
    replace_mask = action < 0.8
    replace_random = action >= 0.9
    ids[sel_rows[replace_mask], sel_cols[replace_mask]] = vocab.mask
    ids[sel_rows[replace_random], sel_cols[replace_random]] = vocab.replacements[
        draw.integers(len(vocab.replacements), np.bincount(sel_rows[replace_random], minlength=n), np.int64)]
    return positions, masked_ids


@dataclass(frozen=True)
class _RowDraws:
    """Draws of `counts[i]` numbers for each row i, concatenated in row order: from one generator for the
    whole block, or from row i's own generator."""

    rng: np.random.Generator | list[np.random.Generator]

    def integers(self, high: int, counts: np.ndarray, dtype: type) -> np.ndarray:
        return self._draw(counts, dtype, lambda rng, k: rng.integers(0, high, k, dtype=dtype))

    def random(self, counts: np.ndarray) -> np.ndarray:
        return self._draw(counts, np.float32, lambda rng, k: rng.random(k, dtype=np.float32))

    def _draw(self, counts: np.ndarray, dtype: type,
              draw: Callable[[np.random.Generator, int], np.ndarray]) -> np.ndarray:
        if isinstance(self.rng, np.random.Generator):
            return draw(self.rng, int(counts.sum()))
        return np.concatenate([np.zeros(0, dtype), *(draw(r, int(c)) for r, c in zip(self.rng, counts, strict=True))])


def held_out(n_docs: int, test_fraction: float, seed: int, part_index: int) -> np.ndarray:
    """Which of a part's documents go to the test split (bool [n_docs]).

    Test pairs draw their random next among the part's test documents, so a lone test document
    would have none to draw from: it is trained on instead.
    """
    is_test = np.random.default_rng(derive_seed(seed, part_index, 0)).random(n_docs) < test_fraction
    if np.count_nonzero(is_test) == 1:
        is_test[:] = False
    return is_test


def held_out_documents(tokens_dir: Path, test_fraction: float, seed: int) -> int:
    """How many documents `create` will hold out for the test split. Reads only each part's
    document count, so a run can learn before creating anything that no test split would result."""
    total = 0
    for path in sorted(tokens_dir.glob("part-*.npz")):
        with open_part(path) as z:
            n_docs = len(z["doc_sentences"])
        total += int(np.count_nonzero(held_out(n_docs, test_fraction, seed, part_index_of(path))))
    return total


def create_instances(part: TokenizedPart, part_index: int, cfg: CreateConfig, vocab: MaskingVocab
                     ) -> dict[str, dict[str, np.ndarray]]:
    """All instances of one tokenized part, per split, shuffled, as HDF5-ready arrays."""
    sentence_starts = np.zeros(len(part.sentence_lengths) + 1, dtype=np.int64)
    np.cumsum(part.sentence_lengths, out=sentence_starts[1:])
    doc_first = np.zeros(len(part.doc_sentences) + 1, dtype=np.int64)
    np.cumsum(part.doc_sentences, out=doc_first[1:])
    is_test = held_out(len(part.doc_sentences), cfg.test_fraction, cfg.seed, part_index)
    starts_list, first_list = sentence_starts.tolist(), doc_first.tolist()
    keys = KEYS if cfg.static_masking else tuple(k for k in KEYS if not k.startswith("masked_lm"))
    result = {}
    for split_index, split in enumerate(SPLITS):
        docs = np.flatnonzero(is_test if split == "test" else ~is_test).tolist()
        rnd = random.Random(derive_seed(cfg.seed, part_index, split_index, 1))
        rng = np.random.default_rng(derive_seed(cfg.seed, part_index, split_index, 2))
        pairs = plan_pairs(starts_list, first_list, docs, cfg.max_seq_length - 3,
                           cfg.short_seq_prob, cfg.dupe_factor, rnd) if docs else np.zeros((0, 5), np.int64)
        truncate_pairs(pairs, cfg.max_seq_length - 3, rng)
        pairs = pairs[rng.permutation(len(pairs))]
        blocks = []
        for lo in range(0, len(pairs), BLOCK):
            block = build_block(pairs[lo:lo + BLOCK], part.ids, cfg.max_seq_length, vocab)
            if cfg.static_masking:
                mask_block(block, cfg, vocab, rng)
            blocks.append(block)
        result[split] = {
            k: (np.concatenate([b[k] for b in blocks]) if blocks else
                np.zeros((0,) if k == "next_sentence_labels" else
                         (0, cfg.max_predictions_per_seq if k.startswith("masked_lm") else cfg.max_seq_length),
                         dtype=DTYPES[k]))
            for k in keys
        }
    return result


def part_index_of(path: Path) -> int:
    return int(path.stem.split("-")[-1])


def load_instances(path: Path) -> np.ndarray:
    """One array of a part's instances, memory-mapped; a file that cannot be read as one is named in a
    PipelineError."""
    try:
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as exc:
        raise PipelineError(
            f"{path} cannot be read as an array of instances ({type(exc).__name__}: {exc}); it was damaged after "
            f"data.create wrote it: delete {path.parent.parent.parent} and the directories made from it, and "
            "create the instances again") from exc


def _create_part(task: tuple[Path, CreateConfig]) -> tuple[dict[str, int], int]:
    src, cfg = task
    out = {split: cfg.output_dir / split / src.stem for split in SPLITS}
    if not all(d.is_dir() for d in out.values()):
        arrays = create_instances(load_part(src), part_index_of(src), cfg, MaskingVocab.from_file(cfg.vocab_file))
        for split, directory in out.items():
            if directory.is_dir():
                continue
            with stage.atomic_path(directory) as tmp:
                tmp.mkdir()
                for key, value in arrays[split].items():
                    stage.save_array(tmp / f"{key}.npy", value)
    counts, masked = {}, 0
    for split, directory in out.items():
        counts[split] = len(load_instances(directory / "next_sentence_labels.npy"))
        if cfg.static_masking:
            masked += int(np.count_nonzero(load_instances(directory / "masked_lm_ids.npy")))
    return counts, masked


def stage_params(cfg: CreateConfig) -> dict:
    params = asdict(cfg)
    params[stage.VERSION_KEY] = FORMAT_VERSION
    params.pop("workers")
    for path_field in ("vocab_file", "input_dir", "output_dir"):
        params.pop(path_field)
    params["vocab_sha1"] = stage.file_sha1(cfg.vocab_file)
    params["tokens"] = stage.fingerprint(cfg.input_dir, tokens_stage.FORMAT_VERSION, writer="data.tokens")
    return params


def check_tokens_vocab(tokens_dir: Path, vocab_file: Path, params: dict) -> None:
    """Refuse a vocab other than the one the tokens were made with: its ids would name other tokens.
    `params`: the stage's (`stage_params`), which hold both vocabs' sha1."""
    made_with, given = params["tokens"]["params"]["vocab_sha1"], params["vocab_sha1"]
    if made_with == given:
        return
    path = stage.finished_record(tokens_dir).get("inputs", {}).get("vocab_file")
    then = f"the vocab {path} (sha1 {made_with[:10]}...)" if path else f"a vocab of sha1 {made_with[:10]}..."
    raise PipelineError(
        f"{tokens_dir} was tokenized with {then}, not with --vocab_file {vocab_file} (sha1 {given[:10]}...), "
        "so its ids would stand for other tokens. Pass the vocab it was made with, or tokenize the text again "
        "with this vocab into another directory (python -m data.tokens)")


def create(cfg: CreateConfig) -> CreateResult:
    validate(cfg)
    stage.require_input(cfg.input_dir, "--input_dir", "data.tokens",
                        f"{cfg.input_dir} is not a complete tokenization; run data.tokens into it first")
    load_vocab(cfg.vocab_file)
    params = stage_params(cfg)
    check_tokens_vocab(cfg.input_dir, cfg.vocab_file, params)
    sources = sorted(cfg.input_dir.glob("part-*.npz"))
    done = stage.begin(cfg.output_dir, params)
    if done is not None:
        return CreateResult(**done)
    start = time.perf_counter()
    part_counts: dict[str, list[int]] = {split: [] for split in SPLITS}
    masked = 0
    with tqdm(total=len(sources), desc="create", unit=" parts", dynamic_ncols=True) as bar:
        for counts, m in bounded_map(_create_part, [(s, cfg) for s in sources], cfg.workers):
            for split in SPLITS:
                part_counts[split].append(counts[split])
            masked += m
            bar.update(1)
            bar.set_postfix(instances=sum(part_counts["training"]) + sum(part_counts["test"]))
    instances = {split: sum(c) for split, c in part_counts.items()}
    if instances["training"] == 0:
        raise PipelineError(f"{cfg.input_dir}: the corpus yields no training instances")
    summary = {"instances": instances, "part_counts": part_counts, "masked_tokens": masked,
               "vocab_size": load_vocab(cfg.vocab_file).size,
               "seconds": round(time.perf_counter() - start, 3)}
    return CreateResult(**stage.finish(cfg.output_dir, params, summary))


def add_masking_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dupe_factor", type=int, default=5, help="instances made from each document, each with new masks")
    p.add_argument("--short_seq_prob", type=float, default=0.1,
                   help="probability of a shorter target length for an instance, as in BERT")
    p.add_argument("--masked_lm_prob", type=float, default=0.15,
                   help="share of tokens masked (80%% [MASK], 10%% random, 10%% kept)")
    p.add_argument("--whole_word_masking", action="store_true", help="mask all pieces of a word together")
    p.add_argument("--dynamic_masking", action="store_true",
                   help="write no static masks (no masked_lm_* keys); the loader masks at load time")
    p.add_argument("--test_fraction", type=float, default=0.02, help="fraction of documents held out for test")
    p.add_argument("--seed", type=int, default=12345, help="pairs, masks and the test hold-out")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--input_dir", type=Path, required=True, help="output of data.tokens")
    p.add_argument("--vocab_file", type=Path, required=True, help="the vocab.txt data.tokens used")
    p.add_argument("--output_dir", type=Path, required=True, help="the instances directory (input of data.shard)")
    p.add_argument("--max_seq_length", type=int, default=128, help="tokens per instance, [CLS] and [SEP]s included")
    p.add_argument("--max_predictions_per_seq", type=int,
                   help="most masked positions per instance (default: 20, if it lets --masked_lm_prob be met)")
    add_masking_arguments(p)
    add_workers_argument(p)
    a = p.parse_args(argv)
    if a.max_predictions_per_seq is None:
        problem = capped_masking(a.max_seq_length, 20, a.masked_lm_prob, "the default")
        if problem:
            p.error(problem)
        a.max_predictions_per_seq = 20
    warning = long_sequence_warning(a.max_seq_length)
    if warning:
        print(warning, file=sys.stderr)
    r = stage.cli_call(create, CreateConfig(a.input_dir, a.vocab_file, a.output_dir, a.max_seq_length, a.max_predictions_per_seq,
                            a.dupe_factor, a.short_seq_prob, a.masked_lm_prob, a.whole_word_masking,
                            not a.dynamic_masking, a.test_fraction, a.seed, a.workers))
    print(f"create: {r.instances['training']} training + {r.instances['test']} test instances, {r.seconds:.1f} s")


if __name__ == "__main__":
    main()
