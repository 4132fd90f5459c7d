"""data.tokens' word-level tokenization against the Rust WordPiece tokenizer run on whole sentences."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

from data.stage import PipelineError
from data.tokens import (
    TokenizeConfig,
    WordPieceTokenizer,
    load_part,
    tokenize,
    tokenize_text,
    unknown_warning,
)
from data.tokens import main as tokens_main
from data.vocab import make_tokenizer

# Every character Python's str.split() splits at, and what BERT's normalizer does with it.
PYTHON_WHITESPACE = "".join(chr(c) for c in range(0x3001) if chr(c).isspace())


def rust_reference(sentences: list[str], vocab, lower_case: bool) -> tuple[np.ndarray, np.ndarray]:
    encodings = make_tokenizer(vocab, lower_case).encode_batch(sentences, add_special_tokens=False)
    ids = np.array([i for e in encodings for i in e.ids], dtype=np.int32)
    return ids, np.array([len(e.ids) for e in encodings], dtype=np.int32)


@pytest.mark.parametrize("lower_case", [True, False])
def test_sample_corpus_equals_the_rust_tokenizer_sentence_by_sentence(phase1_shards, bert_vocab, lower_case):
    text = "".join(p.read_text(encoding="utf-8")
                   for p in sorted((phase1_shards / "text" / "sentences").glob("part-*.txt")))
    part = tokenize_text(text, WordPieceTokenizer(bert_vocab, lower_case))
    sentences = [s for d in text.split("\n\n") if d.strip() for s in d.split("\n")]
    ids, lengths = rust_reference(sentences, bert_vocab, lower_case)
    assert len(ids) > 500_000
    np.testing.assert_array_equal(part.ids, ids)
    np.testing.assert_array_equal(part.sentence_lengths, lengths[lengths > 0])
    # each document's count of sentences that tokenize to something
    bounds = np.cumsum([0] + [len(d.split("\n")) for d in text.split("\n\n") if d.strip()])
    per_doc = [int(np.count_nonzero(lengths[a:b])) for a, b in zip(bounds[:-1], bounds[1:])]
    np.testing.assert_array_equal(part.doc_sentences, [n for n in per_doc if n])
    assert len(part.doc_sentences) == 105


def test_sentences_and_documents_that_tokenize_to_nothing_are_dropped(bert_vocab):
    # control characters and an empty line tokenize to nothing; the second document has nothing else
    text = "alpha beta\n\x01\ngamma\n\n\x01\n\x02\n\ndelta\n"
    part = tokenize_text(text, WordPieceTokenizer(bert_vocab, True))
    tokenizer = make_tokenizer(bert_vocab, True)
    assert part.ids.tolist() == [tokenizer.token_to_id(w) for w in ("alpha", "beta", "gamma", "delta")]
    assert part.sentence_lengths.tolist() == [2, 1, 1] and part.doc_sentences.tolist() == [2, 1]


def test_tokenize_stage_counts_unknown_tokens(phase1_shards, bert_vocab, tmp_path, capsys):
    sentences_dir = phase1_shards / "text" / "sentences"
    result = tokenize(TokenizeConfig(sentences_dir, bert_vocab, tmp_path / "tokens", workers=2))
    ids = np.concatenate([load_part(p).ids for p in sorted((tmp_path / "tokens").glob("part-*.npz"))])
    unk = make_tokenizer(bert_vocab, True).token_to_id("[UNK]")
    # The English sample has a few [UNK]s with the BERT uncased vocab (Armenian, Bopomofo, rare symbols).
    assert result.tokens == len(ids) > 500_000
    assert 0 < result.unknown_tokens == np.count_nonzero(ids == unk) < 1e-4 * result.tokens
    assert tokenize(TokenizeConfig(sentences_dir, bert_vocab, tmp_path / "tokens")) == result  # stored summary
    # A vocab that lacks the corpus's letters: every word with one becomes [UNK], and the count says so.
    small = tmp_path / "digits-vocab.txt"
    small.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"0123456789", *"abcdefghij"]) + "\n")
    poor = tokenize(TokenizeConfig(sentences_dir, small, tmp_path / "poor"))
    assert poor.unknown_share > 0.5
    # ... and a warning line says what that means; none for the vocab that fits (0.002%).
    assert unknown_warning(result, bert_vocab) is None
    tokens_main(["--input_dir", str(sentences_dir), "--vocab_file", str(small), "--output_dir", str(tmp_path / "poor")])
    printed = capsys.readouterr().out.splitlines()
    # the stage's line, named as data.prepare names it (it was "tokenize:" alone, "tokens:" in data.prepare)
    assert re.fullmatch(re.escape(f"tokens: {poor.line()}, ") + r"\d+\.\d s", printed[0])
    assert printed[-1].startswith(
        f"warning: {poor.unknown_share:.2%} of the tokens are [UNK] with the vocab {small} (a vocab that fits the text "
        "leaves under 1%")


def test_tokens_made_uncased_are_refused_to_a_cased_run(phase1_shards, bert_vocab, tmp_path):
    """The case is a setting of the tokens: data.tokens alone names it, as data.prepare names the directory by it."""
    tokens = tmp_path / "tokens"
    shutil.copytree(next((phase1_shards / "text").glob("tokens_*_uncased")), tokens)
    sentences = phase1_shards / "text" / "sentences"
    assert tokenize(TokenizeConfig(sentences, bert_vocab, tokens)).tokens == 538619  # the same settings: complete
    with pytest.raises(PipelineError, match=f"^{re.escape(str(tokens))} holds output made with other settings:\n"
                                            "  lower_case: made with true, now false\n"):
        tokenize(TokenizeConfig(sentences, bert_vocab, tokens, lower_case=False))


EDGE_CASES = [
    "plain words, punctuation (brackets) and 1,234.5 numbers!",
    "Café naïve Ångström résumé ĲSSELMEER straße",           # accents: stripped when uncased
    "日本語のテキスト and 中文 mixed漢字with latin",              # CJK characters are split one by one
    "emoji 🙂 and symbols ™ © ° ± → ∞ and math 𝔸",
    "a" * 99 + " " + "b" * 100 + " " + "c" * 101,              # WordPiece gives [UNK] above 100 characters
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "literal [SEP] and [MASK] and x[CLS]y are text, [PAD][UNK]",
    "zero\u200bwidth soft\u00adhyphen bidi\u200emark bom\ufeffx nul\x00x repl\ufffdx",
    "tab\there cr\rthere " + "".join(f"w{i}{c}v{i}" for i, c in enumerate(PYTHON_WHITESPACE)),
    "control\x01\x02\x7f\x9fchars and private\ue000use",
    "UPPER lower MiXeD O'Neill's don't e-mail U.S.A. 3rd 1990s",
    "",
    "   ",
    "\x1c\x1d",
]


@pytest.mark.parametrize("lower_case", [True, False])
def test_edge_cases_equal_the_rust_tokenizer(bert_vocab, lower_case):
    tokenizer = WordPieceTokenizer(bert_vocab, lower_case)
    ids, lengths = tokenizer.tokenize_sentences(EDGE_CASES)
    ref_ids, ref_lengths = rust_reference(EDGE_CASES, bert_vocab, lower_case)
    np.testing.assert_array_equal(lengths, ref_lengths)
    np.testing.assert_array_equal(ids, ref_ids)
    unk = tokenizer.rust.token_to_id("[UNK]")
    assert unk in ids  # the 101-character word and the emoji


@pytest.mark.parametrize("lower_case, sentence, tokens", [
    (True, "Café naïve", ["cafe", "naive"]),  # lower-cased and accents stripped
    (False, "Café naïve", ["[UNK]", "[UNK]"]),  # kept: the uncased vocab holds no "Café"
    (True, "日本 and 中文", ["日", "本", "and", "中", "文"]),  # CJK characters one by one
    (True, "UPPER O'Neill", ["upper", "o", "'", "neill"]),
])
def test_edge_cases_give_bert_uncased_tokens(bert_vocab, lower_case, sentence, tokens):
    """The tokens themselves, not only equality with data.vocab's Rust tokenizer, which shares its settings:
    a tokenizer that kept accents when uncased passed that comparison."""
    tokenizer = WordPieceTokenizer(bert_vocab, lower_case)
    ids, _ = tokenizer.tokenize_sentences([sentence])
    vocab = tokenizer.rust.get_vocab()
    assert ids.tolist() == [vocab[t] for t in tokens]


def test_cased_tokens_of_an_uncased_vocab_never_match_lower_cased_text(bert_vocab, tmp_path):
    """An uncased vocab may hold a few cased tokens (data.vocab tolerates 1%): lower-cased text never reaches
    them, in the dictionary lookups as in the Rust tokenizer."""
    lines = bert_vocab.read_text(encoding="utf-8").splitlines()
    assert lines[1:3] == ["[unused0]", "[unused1]"]
    lines[1:3] = ["Paris", "The"]
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(lines) + "\n", encoding="utf-8")
    sentences = ["Paris is The capital", "PARIS the paris"]
    ids, lengths = WordPieceTokenizer(vocab, True).tokenize_sentences(sentences)
    ref_ids, ref_lengths = rust_reference(sentences, vocab, True)
    np.testing.assert_array_equal(lengths, ref_lengths)
    np.testing.assert_array_equal(ids, ref_ids)
    assert 1 not in ids and 2 not in ids and ids.tolist()[0] == lines.index("paris")
    cased, _ = WordPieceTokenizer(vocab, False).tokenize_sentences(["Paris The"])
    assert cased.tolist() == [1, 2]


def test_every_python_separator_splits_or_joins_as_bert_does(bert_vocab):
    tokenizer = WordPieceTokenizer(bert_vocab, True)
    rust = make_tokenizer(bert_vocab, True)
    for c in PYTHON_WHITESPACE:
        sentence = f"dog{c}house"
        ids, _ = tokenizer.tokenize_sentences([sentence])
        assert ids.tolist() == rust.encode(sentence, add_special_tokens=False).ids, hex(ord(c))
    # BERT deletes the control characters among them: the two words become one ("doghouse").
    joined, _ = tokenizer.tokenize_sentences(["dog\x1chouse"])
    assert joined.tolist() == rust.encode("doghouse", add_special_tokens=False).ids


def test_text_spelling_a_special_token_is_not_that_token(bert_vocab):
    tokenizer = WordPieceTokenizer(bert_vocab, True)
    ids, _ = tokenizer.tokenize_sentences(["a [SEP] b [MASK]"])
    vocab = tokenizer.rust.get_vocab()
    assert ids.tolist() == [vocab[t] for t in ("a", "[", "sep", "]", "b", "[", "mask", "]")]
    assert vocab["[SEP]"] not in ids and vocab["[MASK]"] not in ids
