"""The vocab stage: the vocab in an output directory is the one its shards were made with, read as
the Rust tokenizer reads it; and the pipeline's up-front checks of flags."""

from __future__ import annotations

import collections
import random
import re
import shutil
import subprocess
from pathlib import Path

import h5py
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordPiece
from tokenizers.normalizers import BertNormalizer

from data.prepare import PrepareConfig, prepare
from data.prepare import main as prepare_main
from data.stage import PipelineError
from data.vocab import VocabConfig, build_vocab, load_vocab
from data.vocab import main as vocab_main


def _settings(dump, out, **kw) -> dict:
    return dict(input=dump, output_dir=out, max_seq_length=128, max_predictions_per_seq=20, dupe_factor=2,
                num_shards=2, num_test_shards=1, seed=12345, workers=1, test_fraction=0.1, articles_per_part=40) | kw


def test_rerun_with_another_given_vocab_is_refused_and_leaves_the_vocab(phase1_shards, sample_dump, bert_vocab,
                                                                          tmp_path):
    out = tmp_path / "out"
    shutil.copytree(phase1_shards, out)
    other = tmp_path / "other-vocab.txt"
    tokens = bert_vocab.read_text(encoding="utf-8").split("\n")
    tokens[1000] = "zzzunusedpiece"
    other.write_text("\n".join(tokens), encoding="utf-8")
    with pytest.raises(PipelineError, match=re.escape(f"{out / 'vocab.txt'} is another vocab than --vocab_file")):
        prepare(PrepareConfig(**_settings(sample_dump, out, vocab_file=other)))
    assert (out / "vocab.txt").read_bytes() == bert_vocab.read_bytes()


def test_a_trained_vocab_is_kept_and_never_replaced_by_a_given_one(phase1_shards, bert_vocab, tmp_path):
    corpus = phase1_shards / "text" / "sentences"
    out = tmp_path / "trained"
    trained = build_vocab(VocabConfig(out, corpus_dir=corpus, vocab_size=1200))
    assert trained.size == 1200
    first = (out / "vocab.txt").read_bytes()
    with pytest.raises(PipelineError, match="is another vocab than --vocab_file"):
        build_vocab(VocabConfig(out, vocab_file=bert_vocab))
    # The rerun with the training settings gets the trained vocab back, not whatever was left there.
    assert build_vocab(VocabConfig(out, corpus_dir=corpus, vocab_size=1200)).tokens == trained.tokens
    assert (out / "vocab.txt").read_bytes() == first
    # A lost copy is restored from the stage's own file; a replaced one is refused.
    (out / "vocab.txt").unlink()
    assert build_vocab(VocabConfig(out, corpus_dir=corpus, vocab_size=1200)).tokens == trained.tokens
    shutil.copyfile(bert_vocab, out / "vocab.txt")
    with pytest.raises(PipelineError, match="is another vocab than the vocab trained into"):
        build_vocab(VocabConfig(out, corpus_dir=corpus, vocab_size=1200))

    given = tmp_path / "given"
    build_vocab(VocabConfig(given, vocab_file=bert_vocab))
    with pytest.raises(PipelineError, match="is another vocab than a vocab trained on the corpus"):
        build_vocab(VocabConfig(given, corpus_dir=corpus, vocab_size=1200))
    assert (given / "vocab.txt").read_bytes() == bert_vocab.read_bytes()


def test_a_vocab_the_user_put_in_an_empty_output_dir_is_not_to_be_deleted(phase1_shards, bert_vocab, tmp_path):
    """A vocab.txt alone in the output directory was made by no stage: the advice is to move it away or pass it,
    not to delete the directory (and the file with it)."""
    own = tmp_path / "out" / "vocab.txt"
    own.parent.mkdir()
    own.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nmine\n", encoding="utf-8")
    corpus = phase1_shards / "text" / "sentences"
    for cfg in (VocabConfig(own.parent, vocab_file=bert_vocab), VocabConfig(own.parent, corpus_dir=corpus)):
        with pytest.raises(PipelineError) as exc:
            build_vocab(cfg)
        assert str(exc.value).endswith(f"and nothing in {own.parent} was made with it; move it away (or pass it as "
                                       "--vocab_file to use it) and rerun")
        assert "delete" not in str(exc.value)
        assert own.read_text(encoding="utf-8").endswith("mine\n")


@pytest.mark.parametrize("limit_alphabet", [1000, 60])
def test_a_trained_vocab_is_the_same_in_every_run(phase1_shards, limit_alphabet, tmp_path):
    """tokenizers' trainer alone numbers pieces in a Rust HashMap's order, seeded afresh for each map:
    two trainings in one process gave the same tokens in other orders (and at 30,522 other tokens)."""
    corpus = phase1_shards / "text" / "sentences"
    runs = [build_vocab(VocabConfig(tmp_path / str(i), corpus_dir=corpus, vocab_size=1500,
                                    limit_alphabet=limit_alphabet, workers=workers))
            for i, workers in enumerate([1, 2, 1])]
    assert runs[0].size == 1500
    assert runs[1].path.read_bytes() == runs[0].path.read_bytes() == runs[2].path.read_bytes()

    # The alphabet: the most frequent characters of the normalised text (ties by code point), each
    # also in its ## form, right after the special tokens; counted here on the whole text at once.
    text = "".join(p.read_text(encoding="utf-8") for p in sorted(corpus.glob("part-*.txt")))
    normaliser = BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=True, lowercase=True)
    counts = collections.Counter(c for c in normaliser.normalize_str(text) if not c.isspace())
    top = sorted(sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:limit_alphabet])
    alphabet = sorted(c for c, _ in top)
    assert len(alphabet) == min(limit_alphabet, len(counts)) and len(counts) > 60
    tokens = runs[0].tokens
    assert tokens[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert tokens[5:5 + 2 * len(alphabet)] == alphabet + [f"##{c}" for c in alphabet]
    assert {t for t in tokens if len(t.removeprefix("##")) == 1} == set(alphabet) | {f"##{c}" for c in alphabet}


def test_a_vocab_size_below_the_alphabet_is_refused(phase1_shards, tmp_path):
    corpus = phase1_shards / "text" / "sentences"
    with pytest.raises(PipelineError) as refused:
        build_vocab(VocabConfig(tmp_path / "small", corpus_dir=corpus, vocab_size=300))
    # The corpus has fewer characters than the default limit of 1000: only --vocab_size can help.
    found = re.fullmatch(r"--vocab_size 300 is smaller than the 5 special tokens and the corpus's (\d+) characters "
                         r"in their two forms \((\d+) tokens\); raise --vocab_size to at least (\d+)",
                         str(refused.value))
    assert found and int(found[2]) == int(found[3]) == 5 + 2 * int(found[1]) > 300
    with pytest.raises(PipelineError, match=r"the corpus's 200 most frequent characters in their two forms \(405 "
                                            r"tokens\); raise --vocab_size to at least 405 or lower "
                                            r"--limit_alphabet \(now 200\)$"):
        build_vocab(VocabConfig(tmp_path / "clipped", corpus_dir=corpus, vocab_size=300, limit_alphabet=200))
    with pytest.raises(PipelineError, match="--limit_alphabet 0 keeps no character"):
        build_vocab(VocabConfig(tmp_path / "none", corpus_dir=corpus, vocab_size=3000, limit_alphabet=0))


def test_a_vocab_copy_left_by_a_killed_run_is_removed(bert_vocab, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".vocab.txt.tmp-4242").write_text("[PAD]\n[UN", encoding="utf-8")  # killed while copying
    build_vocab(VocabConfig(out, vocab_file=bert_vocab))
    assert sorted(p.name for p in out.iterdir()) == ["vocab.txt"]
    assert (out / "vocab.txt").read_bytes() == bert_vocab.read_bytes()


def _devanagari_dump(path) -> None:
    """A small MediaWiki dump in a script without letter case."""
    rng = random.Random(0)
    words = ["नदी", "लोग", "उत्तर", "हिंदी", "लिखता", "रहते", "यहाँ", "वाक्य", "बहती", "मैं", "में", "है", "हैं", "एक", "यह", "की", "ओर", "हूँ"]
    pages = []
    for i in range(1, 41):
        paragraphs = ["। ".join(" ".join(rng.choices(words, k=rng.randint(5, 12))) for _ in range(6)) + "।"
                      for _ in range(3)]
        pages.append(f"<page><title>T{i}</title><ns>0</ns><id>{i}</id><revision><id>{i}</id>"
                     f"<text xml:space=\"preserve\">{chr(10).join(paragraphs)}</text></revision></page>")
    path.write_text('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10">\n'
                    + "\n".join(pages) + "\n</mediawiki>\n", encoding="utf-8")


def test_no_lower_case_trains_and_uses_a_vocab_for_a_script_without_case(tmp_path):
    dump = tmp_path / "hiwiki.xml"
    _devanagari_dump(dump)
    prepare(PrepareConfig(**_settings(dump, tmp_path / "out", lower_case=False, vocab_size=200, num_shards=1,
                                      num_test_shards=0, test_fraction=0.0)))
    vocab = load_vocab(tmp_path / "out" / "vocab.txt")
    # Case folding would have stripped the vowel signs; the trained vocab keeps them.
    assert "हूँ" in vocab.tokens and "हिंदी" in vocab.tokens
    with h5py.File(tmp_path / "out" / "hdf5" / "training" / "wikicorpus_en_training_0.hdf5", "r") as f:
        ids = f["input_ids"][:]
        assert f.attrs["lower_case"] == 0  # for the tokenizer a run on these shards exports
    assert len(ids) > 0 and (ids == vocab.tokens.index("[UNK]")).sum() == 0


def test_vocab_lines_are_numbered_as_the_rust_tokenizer_numbers_them(bert_vocab, tmp_path):
    tokens = bert_vocab.read_text(encoding="utf-8").split("\n")
    tokens[101] += " "  # "[CLS] ": the Rust reader trims it
    padded = tmp_path / "padded.txt"
    padded.write_text("\n".join(tokens), encoding="utf-8")
    ours = load_vocab(padded).tokens
    rust = Tokenizer(WordPiece.from_file(str(padded))).get_vocab()
    assert {t: i for i, t in enumerate(ours)} == rust and ours[101] == "[CLS]"

    tokens = bert_vocab.read_text(encoding="utf-8").split("\n")
    tokens[6] = "a\u2028b"
    split = tmp_path / "split.txt"
    split.write_text("\n".join(tokens), encoding="utf-8")
    with pytest.raises(PipelineError, match="line 7: 'a\\\\u2028b' holds a line-break character"):
        load_vocab(split)

    tokens = bert_vocab.read_text(encoding="utf-8").split("\n")
    tokens[0], tokens[1] = tokens[1], tokens[0]  # [PAD] at id 1: the shards' padding 0 would be "[unused0]"
    moved = tmp_path / "moved.txt"
    moved.write_text("\n".join(tokens), encoding="utf-8")
    with pytest.raises(PipelineError, match=r"moved.txt: \[PAD\] must be the first line \(id 0\), since the HDF5 "
                                            "shards pad with 0"):
        load_vocab(moved)

    tokens = bert_vocab.read_text(encoding="utf-8").split("\n")
    tokens[2000] = tokens[1999] + "\t"
    twice = tmp_path / "twice.txt"
    twice.write_text("\n".join(tokens), encoding="utf-8")
    with pytest.raises(PipelineError, match=f"line 2001 repeats the token '{tokens[1999]}' of line 2000"):
        load_vocab(twice)


def test_a_vocab_with_a_byte_order_mark_is_named_with_the_fix(sample_dump, bert_vocab, tmp_path):
    """It was reported as lacking [PAD]. Stripping the mark on reading would not do: the Rust tokenizer reads it
    into the first token, as other readers of the file would."""
    bom = tmp_path / "vocab with bom.txt"
    bom.write_bytes(b"\xef\xbb\xbf" + bert_vocab.read_bytes())
    assert Tokenizer(WordPiece.from_file(str(bom))).id_to_token(0) == "\ufeff[PAD]"
    message = rf"{re.escape(str(bom))} starts with a UTF-8 byte-order mark .* first token \('\\ufeff\[PAD\]'\); remove it"
    with pytest.raises(PipelineError, match=f"^{message}") as refused:
        load_vocab(bom)
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=message):
        prepare_main(["--input", str(sample_dump), "--output_dir", str(out), "--vocab_file", str(bom)])
    assert not out.exists()
    # The command the message gives removes the mark, and only the mark.
    subprocess.run(str(refused.value).split("e.g. with: ", 1)[1], shell=True, check=True)
    assert bom.read_bytes() == bert_vocab.read_bytes()
    assert load_vocab(bom).tokens[0] == "[PAD]"


def test_a_tokenizer_json_given_as_the_vocab_is_named_json(sample_dump, bert_vocab, tmp_path):
    """It was "line 15 repeats the token '    {' of line 6 ...: remove one of the two lines"."""
    from tokenizers import BertWordPieceTokenizer

    tokenizer_json = tmp_path / "tokenizer.json"
    BertWordPieceTokenizer(str(bert_vocab)).save(str(tokenizer_json))
    message = (f"{tokenizer_json} is JSON (a tokenizer.json or vocab.json?), not a vocab.txt of one token per line "
               "in id order; pass the vocab.txt saved with the model (tokenizer.save_pretrained writes one)")
    with pytest.raises(PipelineError) as exc:
        load_vocab(tokenizer_json)
    assert str(exc.value) == message
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        prepare_main(["--input", str(sample_dump), "--output_dir", str(out), "--vocab_file", str(tokenizer_json)])
    assert exit_.value.code == f"error: {message}"
    assert not out.exists()


def test_a_directory_given_as_the_vocab_is_named_a_directory(sample_dump, tmp_path):
    """It was "no such vocab file"."""
    with pytest.raises(PipelineError, match=rf"^{re.escape(str(tmp_path))}: is a directory, not a vocab file"):
        load_vocab(tmp_path)
    with pytest.raises(SystemExit, match=f"{re.escape(str(tmp_path))}: is a directory, not a vocab file"):
        prepare_main(["--input", str(sample_dump), "--output_dir", str(tmp_path / "out"), "--vocab_file",
                      str(tmp_path)])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["--max_seq_length", "0"], "max_seq_length"),
    (["--max_predictions_per_seq", "0"], "max_predictions_per_seq"),
    (["--num_shards", "0"], "--num_shards must be at least 1, got 0"),
    (["--num_test_shards", "-1"], "--num_test_shards must be 0 or more, got -1"),
    (["--num_test_shards", "0"], "--num_test_shards 0 with --test_fraction 0.02: the held-out documents' instances"),
    (["--test_fraction", "0"], "--num_test_shards 1 with --test_fraction 0: no document is held out"),
])
def test_bad_flags_are_refused_before_any_stage_runs(flags, message, sample_dump, bert_vocab, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=message):
        prepare_main(["--input", str(sample_dump), "--output_dir", str(out), "--vocab_file", str(bert_vocab), *flags])
    assert not out.exists()


@pytest.mark.parametrize("flag, value", [("--vocab_size", "3000"), ("--min_frequency", "5"), ("--limit_alphabet", "500"),
                                         ("--vocab_size", "30522"), ("--min_frequency", "2"),  # the defaults
                                         ("--limit_alphabet", "1000")])
def test_a_trained_vocab_setting_with_a_given_vocab_is_refused(flag, value, sample_dump, bert_vocab, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        prepare_main(["--input", str(sample_dump), "--output_dir", str(out), "--vocab_file", str(bert_vocab), flag,
                      value])
    assert exc.value.code == 2
    assert "error: --vocab_size, --min_frequency and --limit_alphabet apply when a vocab is trained; they cannot " \
           "change the given --vocab_file" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("flags", [["--vocab_size", "30522"], ["--min_frequency", "2"], ["--limit_alphabet", "1000"],
                                   ["--no_lower_case"], ["--workers", "1"]])
def test_the_vocab_stage_refuses_training_settings_beside_a_given_vocab(flags, bert_vocab, tmp_path, capsys):
    """Given at their defaults too: they change nothing in a given vocab (--vocab_size 30522 passed before)."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        vocab_main(["--output_dir", str(out), "--vocab_file", str(bert_vocab), *flags])
    assert exc.value.code == 2
    assert capsys.readouterr().err.endswith(
        "error: --vocab_size, --min_frequency, --limit_alphabet, --no_lower_case and --workers apply when training "
        "(--corpus_dir), not with --vocab_file (tokenization case is data.tokens' --no_lower_case)\n")
    assert not out.exists()
    vocab_main(["--output_dir", str(out), "--vocab_file", str(bert_vocab)])
    assert (out / "vocab.txt").read_bytes() == bert_vocab.read_bytes()


def test_a_vocab_size_without_room_for_pieces_is_refused_before_any_stage_runs(sample_dump, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="--vocab_size -5 leaves no room"):
        prepare_main(["--input", str(sample_dump), "--output_dir", str(out), "--vocab_size", "-5"])
    assert not out.exists()


def test_a_negative_min_frequency_is_refused_by_the_vocab_command(phase1_shards, tmp_path, capsys):
    """It was an OverflowError traceback from the tokenizers trainer, after the characters were counted."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        vocab_main(["--corpus_dir", str(phase1_shards / "text" / "sentences"), "--output_dir", str(out),
                    "--vocab_size", "3000", "--min_frequency", "-3"])
    assert exc.value.code == 2
    assert "error: argument --min_frequency: must be >= 0, got -3" in capsys.readouterr().err
    assert not out.exists()


def test_the_alphabet_breaks_ties_by_code_point_not_by_first_appearance(tmp_path):
    """The characters kept at --limit_alphabet's cut-off are the same in every run: among equally frequent
    characters the lowest code points, not the ones a part happens to show first."""
    from tokenizers import BertWordPieceTokenizer

    from data.vocab import corpus_alphabet

    part = tmp_path / "part-00000.txt"
    part.write_text("zzzz ÉÉÉ cba\nc b a\nD\n")  # z 4; é 3 (accent stripped, lower-cased); a, b, c 2 each; d 1
    tokenizer = BertWordPieceTokenizer(lowercase=True)
    assert corpus_alphabet([part], tokenizer, limit=4, workers=1) == ["a", "b", "e", "z"]
    assert corpus_alphabet([part], tokenizer, limit=3, workers=1) == ["a", "e", "z"]
    assert corpus_alphabet([part], tokenizer, limit=10, workers=1) == ["a", "b", "c", "d", "e", "z"]


def _corpus(directory: Path) -> Path:
    """A data.segment output of 5 words seen 20 times and 40 seen once."""
    from data import segment, stage

    rnd = random.Random(0)
    word = lambda: "".join(rnd.choice("bcdfghklmnprstvz") + rnd.choice("aeiou") for _ in range(3))  # noqa: E731
    frequent, once = [word() for _ in range(5)], [word() for _ in range(40)]
    directory.mkdir()
    (directory / "part-00000.txt").write_text(" ".join(frequent * 20 + once) + "\n", encoding="utf-8")
    stage.finish(directory, {stage.VERSION_KEY: segment.FORMAT_VERSION}, {})
    return directory


def test_the_vocab_command_says_why_a_trained_vocab_is_smaller_than_asked(tmp_path, capsys):
    """A trained vocab came out smaller than --vocab_size and the line gave its size alone (the sample gave 26887
    tokens of 30522): training stops when no pair of pieces left occurs --min_frequency times or more."""
    corpus = _corpus(tmp_path / "sentences")

    def line(out, *flags) -> str:
        vocab_main(["--corpus_dir", str(corpus), "--output_dir", str(tmp_path / out), "--workers", "1", *flags])
        return capsys.readouterr().out.splitlines()[-1]

    printed = line("two", "--vocab_size", "2000")
    two = load_vocab(tmp_path / "two" / "vocab.txt")
    assert printed == (f"vocab: {two.size} tokens -> {two.path} (fewer than --vocab_size 2000: the corpus has no more "
                       "pairs of pieces that occur --min_frequency 2 times or more to merge; more text, or a lower "
                       "--min_frequency, gives more tokens)")
    printed = line("one", "--vocab_size", "2000", "--min_frequency", "1")
    one = load_vocab(tmp_path / "one" / "vocab.txt")
    assert two.size < one.size < 2000
    assert printed == (f"vocab: {one.size} tokens -> {one.path} (fewer than --vocab_size 2000: the corpus has no more "
                       "pairs of pieces to merge; more text gives more tokens)")
    # a vocab of the size asked for, and a given one, get no such words
    assert line("full", "--vocab_size", str(two.size)) == f"vocab: {two.size} tokens -> {tmp_path / 'full' / 'vocab.txt'}"
    vocab_main(["--vocab_file", str(two.path), "--output_dir", str(tmp_path / "given")])
    assert capsys.readouterr().out == f"vocab: {two.size} tokens -> {tmp_path / 'given' / 'vocab.txt'}\n"


def test_data_prepare_says_why_its_trained_vocab_is_smaller_and_passes_min_frequency(tmp_path, capsys):
    """data.prepare printed "vocab: 26887 tokens" for the sample without a word on the 30522 asked for, and had no
    --min_frequency to pass to the vocab stage. The vocab line and the summary say why; --min_frequency 1 merges
    the pairs seen once too."""
    pages = "".join(f"<page><title>{name}</title><ns>0</ns><id>{k}</id><revision><id>{k}</id><text>The {name} river "
                    f"flows north. It meets the sea at {k}0 old ports.\n\nA bridge crosses it near the town."
                    "</text></revision></page>" for k, name in enumerate(["alpha", "beta", "gamma"], 1))
    dump = tmp_path / "dump.xml"
    dump.write_text(f"<mediawiki>{pages}</mediawiki>\n", encoding="utf-8")
    flags = ["--input", str(dump), "--num_shards", "1", "--num_test_shards", "0", "--test_fraction", "0",
             "--workers", "1"]
    sizes = {}
    for name, more, why in [
        ("two", [], "the corpus has no more pairs of pieces that occur --min_frequency 2 times or more to merge; more "
                    "text, or a lower --min_frequency, gives more tokens"),
        ("one", ["--min_frequency", "1"], "the corpus has no more pairs of pieces to merge; more text gives more "
                                          "tokens")]:
        out = tmp_path / name
        prepare_main([*flags, "--output_dir", str(out), *more])
        printed = capsys.readouterr().out.splitlines()
        vocab = load_vocab(out / "vocab.txt")
        sizes[name] = vocab.size
        stage_line = next(line for line in printed if line.startswith("vocab: "))
        assert re.fullmatch(re.escape(f"vocab: {vocab.size} tokens -> {vocab.path} (fewer than --vocab_size 30522: "
                                      f"{why}), ") + r"\d+\.\d s", stage_line)
        assert f"  the trained vocab {vocab.path} holds {vocab.size} tokens, fewer than --vocab_size 30522: {why}" \
            in printed
    assert sizes["two"] < sizes["one"] < 30522
