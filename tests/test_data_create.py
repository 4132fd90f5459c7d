"""data.create's vectorised pieces against the reference's one-at-a-time loops, on the real tokenized sample."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from data.create import (
    CreateConfig,
    MaskingVocab,
    capped_masking,
    create_instances,
    derive_seed,
    held_out,
    mask_rows,
    plan_pairs,
    truncate_pairs,
    validate,
)
from data.create import main as create_main
from data.prepare import main as prepare_main
from data.stage import PipelineError
from data.tokens import TokenizedPart, load_part


def reference_plan(lengths: list[int], doc_first: list[int], docs: list[int], max_num_tokens: int,
                   short_seq_prob: float, dupe_factor: int, rnd: random.Random) -> list[tuple[int, ...]]:
    """create_instances_from_document's loop, adding sentences one at a time (same draws as data.create;
    at least two documents)."""
    starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    out = []
    for _ in range(dupe_factor):
        for di, d in enumerate(docs):
            first, last = doc_first[d], doc_first[d + 1]
            target = max_num_tokens
            if rnd.random() < short_seq_prob:
                target = 2 + int(rnd.random() * (max_num_tokens - 1))
            chunk, length, i = [], 0, first
            while i < last:
                chunk.append(i)
                length += lengths[i]
                if i == last - 1 or length >= target:
                    a_end = 1 + int(rnd.random() * (len(chunk) - 1)) if len(chunk) >= 2 else 1
                    a_len = sum(lengths[s] for s in chunk[:a_end])
                    if len(chunk) == 1 or rnd.random() < 0.5:
                        # (the reference retries 10 times; data.create draws among the others at once)
                        r = int(rnd.random() * (len(docs) - 1))
                        r += r >= di
                        rf, rl = doc_first[docs[r]], doc_first[docs[r] + 1]
                        start = rf + int(rnd.random() * (rl - rf))
                        b_len = 0
                        for j in range(start, rl):
                            b_len += lengths[j]
                            if b_len >= target - a_len:
                                break
                        out.append((starts[chunk[0]], a_len, starts[start], b_len, 1))
                        i -= len(chunk) - a_end
                    else:
                        out.append((starts[chunk[0]], a_len, starts[chunk[a_end]],
                                    sum(lengths[s] for s in chunk[a_end:]), 0))
                    chunk, length = [], 0
                i += 1
    return out


@pytest.fixture(scope="module")
def part(phase1_shards):
    return load_part(sorted((phase1_shards / "text").glob("tokens_*/part-*.npz"))[0])


@pytest.mark.parametrize("max_seq_length", [128, 512])
def test_plan_pairs_equals_the_sentence_by_sentence_loop(part, max_seq_length):
    lengths = part.sentence_lengths.tolist()
    doc_first = np.concatenate([[0], np.cumsum(part.doc_sentences)]).tolist()
    starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    docs = list(range(len(part.doc_sentences)))
    ours = plan_pairs(starts, doc_first, docs, max_seq_length - 3, 0.1, 3, random.Random(5))
    ref = reference_plan(lengths, doc_first, docs, max_seq_length - 3, 0.1, 3, random.Random(5))
    assert len(ref) > 1000
    assert np.array_equal(ours, np.array(ref))
    # Every instance has both segments, and B is the continuation of A when is_random_next is 0.
    assert (ours[:, 1] > 0).all() and (ours[:, 3] > 0).all()
    following = ours[ours[:, 4] == 0]
    assert np.array_equal(following[:, 0] + following[:, 1], following[:, 2])


def test_random_next_always_comes_from_another_document(part):
    starts = np.concatenate([[0], np.cumsum(part.sentence_lengths)]).tolist()
    doc_first = np.concatenate([[0], np.cumsum(part.doc_sentences)]).tolist()
    doc_token_starts = np.array(starts)[doc_first[:-1]]

    def doc_of(offsets: np.ndarray) -> np.ndarray:
        return np.searchsorted(doc_token_starts, offsets, side="right") - 1

    # Pools as small as a part's test split can be: the reference's 10 retries end on A's own
    # document once in 1,024 random draws from two documents, and always from one.
    for docs in ([0, 1], [2], list(range(len(part.doc_sentences)))):
        pairs = plan_pairs(starts, doc_first, docs, 125, 0.1, 200 if len(docs) < 3 else 5, random.Random(1))
        is_random = pairs[:, 4] == 1
        a_doc, b_doc = doc_of(pairs[:, 0]), doc_of(pairs[:, 2])
        assert len(pairs) > 1000 and set(a_doc) == set(docs)
        assert (a_doc[is_random] != b_doc[is_random]).all()
        assert (a_doc[~is_random] == b_doc[~is_random]).all()
        assert is_random.any() == (len(docs) > 1)


def test_a_lone_held_out_document_is_trained_on():
    lone = 0
    for n_docs in range(1, 40):
        for seed in range(20):
            drawn = np.random.default_rng(derive_seed(seed, 3, 0)).random(n_docs) < 0.05
            got = held_out(n_docs, 0.05, seed, 3)
            if drawn.sum() == 1:
                lone += 1
                assert not got.any()
            else:
                assert np.array_equal(got, drawn)
    assert lone > 100


def test_truncation_matches_the_one_token_at_a_time_loop():
    rng = np.random.default_rng(0)
    n, max_num_tokens = 20000, 125
    pairs = np.zeros((n, 5), dtype=np.int64)
    pairs[:, 0] = 1000
    pairs[:, 1] = rng.integers(1, 200, n)
    pairs[:, 2] = 5000
    pairs[:, 3] = rng.integers(1, 200, n)
    ours = pairs.copy()
    truncate_pairs(ours, max_num_tokens, np.random.default_rng(1))
    rnd = random.Random(2)
    front = np.zeros((n, 2))
    for k, (_, la, _, lb, _) in enumerate(pairs.tolist()):
        a, b = list(range(la)), list(range(lb))
        while len(a) + len(b) > max_num_tokens:
            trunc = a if len(a) > len(b) else b
            if rnd.random() < 0.5:
                del trunc[0]
            else:
                trunc.pop()
        assert (len(a), len(b)) == (ours[k, 1], ours[k, 3])
        front[k] = (a[0] if a else 0, b[0] if b else 0)
    # How many tokens come off the front has the reference's distribution (same mean and spread).
    cut = ours[:, [0, 2]] - pairs[:, [0, 2]]
    assert (cut >= 0).all() and (ours[:, 1] + ours[:, 3] <= max_num_tokens).all()
    removed = pairs[:, [1, 3]] - ours[:, [1, 3]]
    for side in (0, 1):
        assert abs(cut[:, side].mean() - front[:, side].mean()) < 0.5
        assert abs(cut[:, side].std() - front[:, side].std()) < 1.0
        # Where the cut falls, given how much is cut: the reference's front share is a fair coin per
        # token, Binomial(removed, 0.5), whose spread around removed / 2 a fixed cut point lacks.
        spread_ref = ((front[:, side] - removed[:, side] / 2) ** 2).mean()
        spread_ours = ((cut[:, side] - removed[:, side] / 2) ** 2).mean()
        assert spread_ref > 1.0 and abs(spread_ours - spread_ref) < 0.1 * spread_ref


def test_whole_word_choice_equals_the_reference_greedy_loop(phase1_shards):
    """Same random word order (the keys) -> the same words as the reference's per-word loop."""
    from data.create import _whole_words

    tokens = (phase1_shards / "vocab.txt").read_text().splitlines()
    is_piece = np.array([t.startswith("##") for t in tokens])
    part = load_part(sorted((phase1_shards / "text").glob("tokens_*/part-*.npz"))[0])
    n, seq = 300, 128
    rng = np.random.default_rng(3)
    ids = np.stack([part.ids[s:s + seq] for s in rng.integers(0, len(part.ids) - seq, n)])
    cand = np.ones((n, seq), dtype=bool)
    cand[:, 0] = cand[:, 60] = False  # [CLS] and a [SEP]
    cand[np.arange(n) % 3 == 0, 100:] = False  # some short rows
    keys = rng.permutation(n * seq).reshape(n, seq).astype(np.int32)
    n_pred = np.minimum(20, np.round(cand.sum(1) * 0.15).astype(np.int64))
    ours = _whole_words(keys, cand, is_piece[ids], n_pred)
    for row in range(n):
        words: list[list[int]] = []
        for i in range(seq):
            if not cand[row, i]:
                continue
            if is_piece[ids[row, i]] and words and words[-1][-1] == i - 1:
                words[-1].append(i)
            else:
                words.append([i])
        words.sort(key=lambda w: keys[row, w[0]])  # the shuffled order
        chosen: list[int] = []
        for w in words:
            if len(chosen) >= n_pred[row]:
                break
            if len(chosen) + len(w) > n_pred[row]:
                continue
            chosen.extend(w)
        assert sorted(chosen) == np.flatnonzero(ours[row]).tolist(), row
    assert (ours.sum(1) == n_pred).mean() > 0.8


def test_masking_vocab_of_the_bert_vocab(bert_vocab):
    """A random replacement is any token but the five special ones; "##" pieces join the word before them."""
    vocab = MaskingVocab.from_file(bert_vocab)
    assert (vocab.cls, vocab.sep, vocab.mask, vocab.size) == (101, 102, 103, 30522)
    # [PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103 are never drawn
    assert vocab.replacements.dtype == np.int32
    assert np.array_equal(vocab.replacements, np.setdiff1d(np.arange(30522), [0, 100, 101, 102, 103]))
    tokens = bert_vocab.read_text(encoding="utf-8").splitlines()
    pieces = np.flatnonzero(vocab.is_continuation)
    assert len(pieces) == 5828 and all(tokens[i].startswith("##") and len(tokens[i]) > 2 for i in pieces)
    assert not vocab.is_continuation[tokens.index("#")]


def _rows(n: int, seq: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`n` rows [CLS] words [SEP] padding of random lengths (ids 1000-1999): ids, candidates, token counts."""
    rng = np.random.default_rng(seed)
    total = rng.integers(3, seq + 1, n)
    ids = rng.integers(1000, 2000, (n, seq)).astype(np.int32)
    col = np.arange(seq)
    ids[:, 0] = 101
    ids[np.arange(n), total - 1] = 102
    ids[col >= total[:, None]] = 0
    return ids, (col > 0) & (col < total[:, None] - 1), total


def test_every_row_gets_its_share_of_predictions_and_at_least_one(bert_vocab):
    """min(max_predictions, max(1, round(tokens x masked_lm_prob))) per row: at 0.01, rows under 50 tokens still
    get one, as in the reference (a row without one has no MLM loss)."""
    vocab = MaskingVocab.from_file(bert_vocab)
    for prob in (0.01, 0.15, 0.5):
        ids, candidates, total = _rows(400, 128, 1)
        positions, labels = mask_rows(ids, candidates, total, 20, prob, False, vocab, np.random.default_rng(2))
        expected = np.minimum(20, np.maximum(1, np.round(total * prob).astype(int)))
        expected = np.minimum(expected, candidates.sum(axis=1))  # a 3-token row has one word to mask
        assert np.array_equal(np.count_nonzero(labels, axis=1), expected), prob
        assert (total < 50).sum() > 100  # the rows that 0.01 x tokens rounds to 0


def test_a_random_replacement_may_be_any_replacement_id(bert_vocab):
    """The draw covers every id it may take, the last included."""
    vocab = MaskingVocab.from_file(bert_vocab)
    two = MaskingVocab(vocab.cls, vocab.sep, vocab.mask, vocab.size, vocab.is_continuation,
                       np.array([7, 8], np.int32))
    ids, candidates, total = _rows(2000, 32, 3)
    before = ids.copy()
    mask_rows(ids, candidates, total, 30, 0.9, False, two, np.random.default_rng(4))
    changed = ids[(ids != before) & (ids != vocab.mask)]
    assert set(np.unique(changed).tolist()) == {7, 8}
    assert abs((changed == 8).mean() - 0.5) < 0.05


def test_the_predictions_cap_binds_only_above_what_masked_lm_prob_asks_for():
    """round(0.15 x 133) = 20 predictions fit a cap of 20; 137 tokens ask for 21."""
    assert capped_masking(133, 20, 0.15, "the default") is None
    assert capped_masking(128, 20, 0.15, "the default") is None
    assert capped_masking(137, 20, 0.15, "the default").startswith(
        "the default --max_predictions_per_seq 20 would mask at most 20 of 137 tokens (14.6%), fewer than "
        "--masked_lm_prob 0.15 asks for (21)")


def _synthetic_part(n_docs: int, sentences_per_doc: int = 12, sentence_len: int = 20) -> TokenizedPart:
    """Documents whose token ids tell where they come from: document d uses ids 1000 + 500 d ... + 499."""
    rng = np.random.default_rng(0)
    ids = np.concatenate([rng.integers(1000 + 500 * d, 1500 + 500 * d, sentences_per_doc * sentence_len)
                          for d in range(n_docs)]).astype(np.int32)
    return TokenizedPart(ids=ids, sentence_lengths=np.full(n_docs * sentences_per_doc, sentence_len, np.int32),
                         doc_sentences=np.full(n_docs, sentences_per_doc, np.int32))


def _documents(input_ids: np.ndarray) -> list[set[int]]:
    """The documents each instance's tokens come from (ids 0-999: [PAD], [CLS], [SEP], [MASK], random)."""
    return [set(((row[row >= 1000] - 1000) // 500).tolist()) for row in input_ids]


def test_held_out_documents_never_reach_the_training_split(bert_vocab):
    part = _synthetic_part(40)
    cfg = CreateConfig(Path("."), bert_vocab, Path("."), dupe_factor=2, test_fraction=0.25, static_masking=False)
    out = create_instances(part, 3, cfg, MaskingVocab.from_file(bert_vocab))
    is_test = held_out(40, 0.25, cfg.seed, 3)
    train = set().union(*_documents(out["training"]["input_ids"]))
    test = set().union(*_documents(out["test"]["input_ids"]))
    assert test == set(np.flatnonzero(is_test).tolist()) and len(test) >= 5
    assert train == set(np.flatnonzero(~is_test).tolist())


def test_instances_of_a_part_are_shuffled(bert_vocab):
    """Shards take consecutive runs of a part's instances: in document order, a shard would be a few documents."""
    part = _synthetic_part(60)
    cfg = CreateConfig(Path("."), bert_vocab, Path("."), dupe_factor=1, test_fraction=0.0, static_masking=False)
    ids = create_instances(part, 0, cfg, MaskingVocab.from_file(bert_vocab))["training"]["input_ids"]
    first_doc = [min(docs) for docs in _documents(ids)]
    assert len(first_doc) > 100
    assert abs(np.corrcoef(np.arange(len(first_doc)), first_doc)[0, 1]) < 0.3


def test_parts_of_the_same_text_draw_their_own_pairs_and_masks(bert_vocab):
    """Every draw is seeded by (seed, part, split): without the part, two parts of the same text (a corpus given
    twice, a dump's duplicated articles) drew the same pair plan, truncation and masks."""
    part = _synthetic_part(20)
    cfg = CreateConfig(Path("."), bert_vocab, Path("."), dupe_factor=1, test_fraction=0.0)
    vocab = MaskingVocab.from_file(bert_vocab)
    first, second, again = (create_instances(part, index, cfg, vocab)["training"] for index in (0, 1, 0))
    assert min(len(first["input_ids"]), len(second["input_ids"])) > 50
    assert not np.array_equal(first["input_ids"], second["input_ids"])
    assert all(np.array_equal(first[key], again[key]) for key in first)


def test_the_default_predictions_that_would_cap_the_masking_are_refused(phase1_shards, bert_vocab, tmp_path, capsys):
    """python -m data.create --max_seq_length 512 took the default 20 predictions: 4% of the tokens masked, while
    the shards' masked_lm_prob attribute said 0.15. Given explicitly, the cap is kept."""
    tokens = next((phase1_shards / "text").glob("tokens_*"))
    argv = ["--input_dir", str(tokens), "--vocab_file", str(bert_vocab), "--max_seq_length", "512", "--workers", "1"]
    with pytest.raises(SystemExit) as exc:
        create_main([*argv, "--output_dir", str(tmp_path / "refused")])
    assert exc.value.code == 2
    assert ("error: the default --max_predictions_per_seq 20 would mask at most 20 of 512 tokens (3.9%), fewer than "
            "--masked_lm_prob 0.15 asks for (77); pass --max_predictions_per_seq 77 or more (given explicitly, a "
            "smaller cap is kept)") in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()
    create_main([*argv, "--output_dir", str(tmp_path / "kept"), "--max_predictions_per_seq", "20", "--dupe_factor", "1"])
    assert "create:" in capsys.readouterr().out


def test_a_masked_lm_prob_of_zero_is_refused_before_any_work(sample_dump, bert_vocab, tmp_path):
    """--masked_lm_prob 0 was accepted: data.prepare wrote shards whose masked_lm_prob attribute, 0.0, the trainer then
    refused ('outside (0, 1); recreate the shards'). It is refused at the start, as the loader would refuse it."""
    refused = r"masked_lm_prob must be in \(0, 1\), got 0.0: run_pretraining.py refuses shards made with it"
    with pytest.raises(PipelineError, match=refused):
        validate(CreateConfig(tmp_path, bert_vocab, tmp_path, masked_lm_prob=0.0))
    validate(CreateConfig(tmp_path, bert_vocab, tmp_path, masked_lm_prob=0.01))
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=refused):
        prepare_main(["--input", str(sample_dump), "--output_dir", str(out), "--vocab_file", str(bert_vocab),
                      "--masked_lm_prob", "0"])
    assert not out.exists()
