"""The whole data pipeline in one command: Wikipedia dump -> vocab + sharded HDF5.

    python -m data.prepare --input <dump path or http(s) URL> --output_dir <dir> --vocab_file <vocab.txt> \\
        --max_seq_length 128 --max_predictions_per_seq 20 [--dupe_factor 5] [--num_shards N] [--seed S] \\
        [--workers W] [--phase 1|2]

Stages (each also runs alone: python -m data.<stage> --help):
  download  -> <text_dir>/download/       only when --input is a URL or --dump_date is given
  extract   -> <text_dir>/extracted/      article text (wikiextractor as a library)
  segment   -> <text_dir>/sentences/      one sentence per line (blingfire)
  vocab     -> <output_dir>/vocab.txt     the given vocab, or one trained on the corpus
  tokens    -> <text_dir>/tokens_<vocab>/ token ids (Rust WordPiece, batched)
  create    -> <output_dir>/instances/    NSP pairs + MLM masks (numpy, parallel, seeded per part)
  shard     -> <output_dir>/hdf5/{training,test}/*.hdf5

`<text_dir>` defaults to `<output_dir>/text`; give phase 1 and phase 2 the same --text_dir to
extract, segment and tokenize once. Every stage skips complete work, so rerunning the same
command after an interruption finishes the job with identical output.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from data import stage
from data.cli import HelpFormatter, add_workers_argument, given_options, usable_cores
from data.create import (
    CreateConfig,
    add_masking_arguments,
    capped_masking,
    create,
    held_out_documents,
    long_sequence_warning,
    validate,
)
from data.download import (
    DEFAULT_DUMP_DATE,
    DEFAULT_MIRROR,
    DownloadConfig,
    add_no_verify_argument,
    download,
    dump_source,
    dump_url,
    file_name,
    is_http,
)
from data.extract import (
    MIN_ARTICLES_PER_PART,
    ExtractConfig,
    ExtractResult,
    check_articles_per_part,
    check_dump,
    extract,
)
from data.segment import SegmentConfig, SegmentResult, segment
from data.shard import (
    ShardConfig,
    ShardResult,
    add_compression_argument,
    check_name,
    check_shard_counts,
    compression_filter,
    shard,
)
from data.stage import COMPLETE_FILE, PARAMS_FILE, PipelineError, StageConflict, cli_call, file_sha1, make_dir
from data.tokens import TokenizeConfig, TokenizeResult, tokenize, unknown_warning
from data.vocab import (
    TRAINING_OPTIONS,
    VocabConfig,
    add_training_arguments,
    build_vocab,
    check_case,
    check_training_settings,
    load_vocab,
    shortfall,
    vocab_line,
)

PHASES = {1: (128, 20), 2: (512, 80)}
T = TypeVar("T")


@dataclass(frozen=True)
class PrepareConfig:
    input: Path | str
    output_dir: Path
    vocab_file: Path | None = None
    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    dupe_factor: int = 5
    num_shards: int = 256
    num_test_shards: int = 1
    seed: int = 12345
    workers: int = field(default_factory=usable_cores)
    text_dir: Path | None = None
    short_seq_prob: float = 0.1
    masked_lm_prob: float = 0.15
    whole_word_masking: bool = False
    static_masking: bool = True
    test_fraction: float = 0.02
    lower_case: bool = True
    vocab_size: int = 30522
    min_frequency: int = 2
    limit_alphabet: int = 1000
    articles_per_part: int = 2000
    name: str = "wikicorpus_en"
    hdf5_compression: str | None = None
    verify_download: bool = True  # check a downloaded dump against its published checksum file

    @property
    def text_root(self) -> Path:
        """Where the text stages write: --text_dir, else <output_dir>/text."""
        return self.text_dir or self.output_dir / "text"


# What a stage did in this run: all of its work, the rest of the work of an interrupted run, or nothing
# (its output was complete before the run).
RAN, RESUMED, COMPLETE = "ran", "resumed", "complete"
# The stages that process the dump's text, whose time the MB/s figure is over (not the download's).
TEXT_STAGES = ("extract", "segment", "vocab", "tokens", "create", "shard")


@dataclass(frozen=True)
class StageRun:
    name: str
    state: str  # RAN, RESUMED or COMPLETE
    seconds: float  # in this run


@dataclass(frozen=True)
class PrepareResult:
    output_dir: Path
    vocab_file: Path
    vocab_size: int
    extracted: ExtractResult
    documents: int
    sentences: int
    tokens: int
    unknown_share: float  # of the tokens, [UNK]
    instances: dict[str, int]
    shards: dict[str, int]
    text_bytes: int
    hdf5_bytes: int
    stages: list[StageRun]
    seconds: float  # the whole run, its checks included
    unknown_warning: str | None = None
    vocab_shortfall: str | None = None  # why a trained vocab holds fewer tokens than --vocab_size (vocab.shortfall)

    @property
    def articles(self) -> int:
        return self.extracted.articles

    def summary(self) -> str:
        lines = [
            f"prepare: {self.articles} articles, {self.documents} documents, {self.sentences} sentences, "
            f"{self.tokens} tokens ({self.unknown_share:.3%} [UNK]) -> "
            f"{self.instances['training']} training + {self.instances['test']} test "
            f"instances in {self.shards['training']} + {self.shards['test']} shards "
            f"({self.hdf5_bytes / 1e6:.1f} MB) under {self.output_dir / 'hdf5'}"]
        lines.append(f"  of the dump's {self.extracted.pages} pages, not counted as articles: "
                     f"{self.extracted.skipped_pages()}")
        lines.append(f"  this run: {self.run_line()}")
        if self.vocab_shortfall:
            lines.append(f"  the trained vocab {self.vocab_file} holds {self.vocab_size} tokens, {self.vocab_shortfall}")
        if self.unknown_warning:
            lines.append(self.unknown_warning)
        return "\n".join(lines)

    def run_line(self) -> str:
        """The work done in this run and its time; MB/s only when every text stage did all of its work in it."""
        done = [s for s in self.stages if s.state != COMPLETE]
        skipped = ", ".join(s.name for s in self.stages if s.state == COMPLETE)
        if not done:
            return f"nothing to do: every stage was already complete ({skipped}); {duration(self.seconds)} of checks"
        times = ", ".join(f"{s.name}{' (resumed)' if s.state == RESUMED else ''} {duration(s.seconds)}" for s in done)
        line = f"{long_duration(sum(s.seconds for s in done))} ({times})"
        if skipped:
            line += f"; skipped as already complete: {skipped}"
        text = [s for s in self.stages if s.name in TEXT_STAGES]
        if all(s.state == RAN for s in text):
            seconds, mb = sum(s.seconds for s in text), self.text_bytes / 1e6
            return f"{mb / max(seconds, 1e-9):.2f} MB/s ({mb:.1f} MB of text in {long_duration(seconds)}); {line}"
        resumed = ", ".join(s.name for s in text if s.state == RESUMED)
        why = f"{resumed} went on from an earlier run" if resumed else "stages were skipped"
        return f"{line} (no MB/s figure: {why}, so this run did not process the whole text)"


def duration(seconds: float) -> str:
    """12.3 s, 2 min 05 s, 1 h 02 min 05 s."""
    if round(seconds, 1) < 60:  # 59.96 s is "1 min 00 s", not "60.0 s"
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min {secs:02d} s" if hours else f"{minutes} min {secs:02d} s"


def long_duration(seconds: float) -> str:
    """Seconds, and hours and minutes too when there are any: 3725.0 s = 1 h 02 min 05 s."""
    return f"{seconds:.1f} s" + (f" = {duration(seconds)}" if round(seconds, 1) >= 60 else "")


def _stage_state(stage_dir: Path) -> str:
    """COMPLETE when the stage directory holds complete output (the stage then only checks its settings),
    RESUMED when an interrupted run began it, else RAN."""
    if (stage_dir / COMPLETE_FILE).is_file():
        return COMPLETE
    return RESUMED if (stage_dir / PARAMS_FILE).is_file() else RAN


def _file_state(path: Path, partial: Path | None = None) -> str:
    """The state of a stage whose output is one file, written at `partial` first (if it resumes)."""
    if path.is_file():
        return COMPLETE
    return RESUMED if partial is not None and partial.exists() else RAN


def check_test_split(create_cfg: CreateConfig, cfg: PrepareConfig) -> None:
    """Test shards need held-out documents. On a small corpus (or small parts) --test_fraction may
    hold out none; say so before the create stage records its settings, so that a rerun with
    another --test_fraction is not refused."""
    if cfg.num_test_shards == 0 or (create_cfg.output_dir / COMPLETE_FILE).is_file():
        return
    if held_out_documents(create_cfg.input_dir, cfg.test_fraction, cfg.seed) == 0:
        raise PipelineError(
            f"--test_fraction {cfg.test_fraction} holds out no document of this corpus for the test shards (each "
            f"part of --articles_per_part {cfg.articles_per_part} articles needs 2 or more, drawn at random); "
            "pass a larger --test_fraction, or --test_fraction 0 --num_test_shards 0 to train on every document")


def made_from(failed: Path, cfg: PrepareConfig, text_dir: Path) -> list[Path]:
    """The stage directory `failed` and the outputs of this run made from it that exist, in the order
    the stages run: all that must go to redo it, so that the next rerun is not refused at a later one."""
    vocab = cfg.output_dir / "vocab.txt"
    chain = [text_dir / "extracted", text_dir / "sentences"]
    if cfg.vocab_file is None:
        chain += [cfg.output_dir / "vocab_training", vocab]
    if failed in chain[:2]:
        chain += sorted(text_dir.glob("tokens_*"))  # every vocab's tokens are made from the sentences
    elif vocab.is_file():
        chain.append(text_dir / f"tokens_{file_sha1(vocab)[:10]}_{'uncased' if cfg.lower_case else 'cased'}")
    chain += [cfg.output_dir / "instances", cfg.output_dir / "hdf5"]
    if failed not in chain:
        return [failed]
    return [failed, *(path for path in chain[chain.index(failed) + 1:] if path.exists())]


# What a stage writes whole in <output_dir>, by that stage.
_OUTPUT_STAGES = {"vocab_training": "data.vocab", "instances": "data.create", "hdf5": "data.shard",
                  "vocab.txt": "data.vocab (the vocab the shards are made with)"}


def check_text_dir(text_dir: Path, output_dir: Path) -> None:
    """A --text_dir inside what a later stage writes would be refused by that stage as holding files it
    did not make (or, at vocab.txt, fail to replace it), only once the text stages had run."""
    resolved = text_dir.resolve()
    for name, writer in _OUTPUT_STAGES.items():
        owned = (output_dir / name).resolve()
        if resolved == owned or owned in resolved.parents:
            raise PipelineError(f"--text_dir {text_dir} is in {output_dir / name}, which {writer} writes; "
                                "pass a --text_dir outside it (the default is <output_dir>/text)")


def check_vocab_target(output_dir: Path) -> None:
    """<output_dir>/vocab.txt is a file the vocab stage writes; a directory there would fail it after the text
    stages had run."""
    target = output_dir / "vocab.txt"
    if target.is_dir():
        raise PipelineError(f"{target} is a directory, where data.prepare writes the vocab the shards are made with; "
                            "move it away, or pass another --output_dir")


def check_settings(cfg: PrepareConfig) -> CreateConfig:
    """Every check of `cfg` that needs no stage's output (PipelineError), before any long stage runs; returns the
    create stage's settings. The tokens directory and the vocab are known only after their stages."""
    text_dir = cfg.text_root
    create_cfg = CreateConfig(
        input_dir=text_dir, vocab_file=Path(cfg.vocab_file or text_dir), output_dir=cfg.output_dir / "instances",
        max_seq_length=cfg.max_seq_length, max_predictions_per_seq=cfg.max_predictions_per_seq,
        dupe_factor=cfg.dupe_factor, short_seq_prob=cfg.short_seq_prob, masked_lm_prob=cfg.masked_lm_prob,
        whole_word_masking=cfg.whole_word_masking, static_masking=cfg.static_masking,
        test_fraction=cfg.test_fraction, seed=cfg.seed, workers=cfg.workers)
    validate(create_cfg)
    check_shard_counts(cfg.num_shards, cfg.num_test_shards, cfg.test_fraction)
    check_articles_per_part(cfg.articles_per_part)
    check_name(cfg.name)
    if cfg.vocab_file is not None:
        check_case(load_vocab(Path(cfg.vocab_file)), cfg.lower_case)
    else:
        check_training_settings(cfg.vocab_size, cfg.limit_alphabet)
    return create_cfg


def prepare(cfg: PrepareConfig, report: Callable[[str], None] = print) -> PrepareResult:
    """Run every stage, each skipping work already done; `report` gets a line as each stage ends, so that a
    run that fails still shows what the stages before the failure did."""
    start = time.perf_counter()
    text_dir = cfg.text_root
    create_cfg = check_settings(cfg)
    warning = long_sequence_warning(cfg.max_seq_length)
    if warning:
        report(warning)
    dump = dump_source(cfg.input)
    if isinstance(dump, Path):
        check_dump(dump)  # a dump refused after the directories are made left an empty <text_dir> behind
    check_vocab_target(cfg.output_dir)
    if cfg.text_dir is not None:
        check_text_dir(cfg.text_dir, cfg.output_dir)
        make_dir(cfg.text_dir, "--text_dir")
    make_dir(cfg.output_dir, "--output_dir")
    make_dir(text_dir)
    stages: list[StageRun] = []

    def timed(name: str, state: str | Path, fn: Callable[[Any], T], stage_cfg: Any, line: Callable[[T], str]) -> T:
        """Run a stage; `state` is its state before, or its stage directory to read that from."""
        stage_dir = state if isinstance(state, Path) else None
        if stage_dir is not None:
            state, begun = _stage_state(stage_dir), stage.begun(stage_dir)
        t = time.perf_counter()
        try:
            out = fn(stage_cfg)
        except StageConflict as exc:
            raise StageConflict(exc.stage_dir, exc.problem, made_from(exc.stage_dir, cfg, text_dir)) from exc
        seconds = round(time.perf_counter() - t, 3)
        if state == RESUMED and stage_dir is not None and stage.begun(stage_dir) != begun:
            state = RAN  # it discarded the unfinished output of other settings and began afresh
        stages.append(StageRun(name, state, seconds))
        when = "already complete" if state == COMPLETE else duration(seconds)
        report(f"{name}: {line(out)}, {when}{' (resumed)' if state == RESUMED else ''}")
        return out

    if isinstance(dump, str):
        target = text_dir / "download" / file_name(dump)
        dump = timed("download", _file_state(target, target.with_name(f"{target.name}.part")), download,
                     DownloadConfig(url=dump, output_dir=text_dir / "download", verify=cfg.verify_download),
                     lambda path: f"{path} ({path.stat().st_size / 1e9:.2f} GB)")
    ex = timed("extract", text_dir / "extracted", extract,
               ExtractConfig(dump, text_dir / "extracted", cfg.workers, cfg.articles_per_part), ExtractResult.line)
    seg = timed("segment", text_dir / "sentences", segment,
                SegmentConfig(text_dir / "extracted", text_dir / "sentences", cfg.workers), SegmentResult.line)
    vocab_state = (_file_state(cfg.output_dir / "vocab.txt") if cfg.vocab_file
                   else cfg.output_dir / "vocab_training")
    vocab_cfg = VocabConfig(cfg.output_dir, cfg.vocab_file, text_dir / "sentences", cfg.vocab_size, cfg.lower_case,
                            cfg.min_frequency, cfg.limit_alphabet, cfg.workers)
    vocab = timed("vocab", vocab_state, build_vocab, vocab_cfg, lambda v: vocab_line(v, vocab_cfg))
    digest = file_sha1(vocab.path)[:10]
    tokens_dir = text_dir / f"tokens_{digest}_{'uncased' if cfg.lower_case else 'cased'}"
    tok = timed("tokens", tokens_dir, tokenize,
                TokenizeConfig(text_dir / "sentences", vocab.path, tokens_dir, cfg.lower_case, cfg.workers),
                TokenizeResult.line)
    warning = unknown_warning(tok, cfg.vocab_file or vocab.path)
    if warning:
        report(warning)
    create_cfg = dataclasses.replace(create_cfg, input_dir=tokens_dir, vocab_file=vocab.path)
    check_test_split(create_cfg, cfg)
    timed("create", create_cfg.output_dir, create, create_cfg,
          lambda c: f"{c.instances['training']} training + {c.instances['test']} test instances")
    sh = timed("shard", cfg.output_dir / "hdf5", shard,
               ShardConfig(create_cfg.output_dir, cfg.output_dir / "hdf5", cfg.num_shards, cfg.num_test_shards,
                           cfg.name, cfg.workers, cfg.hdf5_compression), ShardResult.line)
    return PrepareResult(
        output_dir=cfg.output_dir, vocab_file=vocab.path, vocab_size=vocab.size, extracted=ex, documents=tok.documents,
        sentences=tok.sentences, tokens=tok.tokens, unknown_share=tok.unknown_share, instances=sh.instances,
        shards=sh.shards, text_bytes=seg.text_bytes, hdf5_bytes=sh.bytes_written, stages=stages,
        seconds=round(time.perf_counter() - start, 3), unknown_warning=warning,
        vocab_shortfall=shortfall(vocab, vocab_cfg))


def prepare_from_args(a: argparse.Namespace) -> PrepareResult:
    seq, pred = PHASES[a.phase]
    source = dump_source(a.input if a.input else dump_url(a.mirror, a.dump_date))
    return prepare(PrepareConfig(
        input=source, output_dir=a.output_dir, vocab_file=a.vocab_file,
        max_seq_length=seq if a.max_seq_length is None else a.max_seq_length,
        max_predictions_per_seq=pred if a.max_predictions_per_seq is None else a.max_predictions_per_seq,
        dupe_factor=a.dupe_factor, num_shards=a.num_shards, num_test_shards=a.num_test_shards, seed=a.seed,
        workers=a.workers, text_dir=a.text_dir, short_seq_prob=a.short_seq_prob, masked_lm_prob=a.masked_lm_prob,
        whole_word_masking=a.whole_word_masking, static_masking=not a.dynamic_masking,
        test_fraction=a.test_fraction, lower_case=a.lower_case, vocab_size=a.vocab_size,
        min_frequency=a.min_frequency, limit_alphabet=a.limit_alphabet,
        articles_per_part=a.articles_per_part, name=a.name, hdf5_compression=compression_filter(a.hdf5_compression),
        verify_download=not a.no_verify))


def preset_predictions_problem(a: argparse.Namespace) -> str | None:
    """Why the --phase preset's predictions, taken for a --max_seq_length or --masked_lm_prob given without
    --max_predictions_per_seq, would cap the masking below --masked_lm_prob (phase 1's 20 at 512 masks 4%)."""
    if a.max_predictions_per_seq is not None:
        return None  # an explicit cap is kept
    seq, pred = PHASES[a.phase]
    return capped_masking(seq if a.max_seq_length is None else a.max_seq_length, pred, a.masked_lm_prob,
                          f"--phase {a.phase}'s")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help="a MediaWiki dump (.xml.bz2 or .xml): a path or file:// URL, or an http(s) URL to download")
    src.add_argument("--dump_date",
                     help=f"download enwiki-<date>-pages-articles-multistream.xml.bz2, e.g. {DEFAULT_DUMP_DATE}")
    p.add_argument("--mirror", default=DEFAULT_MIRROR, help="dump mirror used with --dump_date")
    add_no_verify_argument(p)
    p.add_argument("--output_dir", type=Path, required=True, help="hdf5/{training,test}/, vocab.txt, instances/")
    p.add_argument("--text_dir", type=Path, help="where text stages go (default <output_dir>/text)")
    p.add_argument("--vocab_file", type=Path, help="BERT vocab.txt; without it a WordPiece vocab is trained")
    add_training_arguments(p)
    p.add_argument("--no_lower_case", dest="lower_case", action="store_false", help="keep case and accents")
    p.add_argument("--phase", type=int, choices=sorted(PHASES), default=1,
                   help="1: seq 128 / 20 predictions, 2: seq 512 / 80 (explicit flags override)")
    p.add_argument("--max_seq_length", type=int, help="overrides --phase's sequence length")
    p.add_argument("--max_predictions_per_seq", type=int, help="overrides --phase's masked positions")
    add_masking_arguments(p)
    p.add_argument("--num_shards", type=int, default=256, help="training shards")
    p.add_argument("--num_test_shards", type=int, default=1, help="test shards (0: no test split)")
    p.add_argument("--articles_per_part", type=int, default=2000,
                   help="articles per part (the parallel work unit from segmentation on); NSP's random next document "
                        f"is drawn from the same part, so at least {MIN_ARTICLES_PER_PART}")
    p.add_argument("--name", default="wikicorpus_en", help="shard file name prefix")
    add_compression_argument(p)
    add_workers_argument(p)
    a = p.parse_args(argv)
    given = given_options(p, argv)
    if a.input and "mirror" in given:
        p.error("--mirror applies to --dump_date; with --input, put the mirror in the URL")
    if a.no_verify and a.input and not is_http(a.input):
        p.error("--no_verify applies to a dump this command downloads (--dump_date or an http(s) --input); a local "
                "--input is read as it is")
    if a.vocab_file and given & TRAINING_OPTIONS:
        p.error("--vocab_size, --min_frequency and --limit_alphabet apply when a vocab is trained; they cannot change "
                "the given --vocab_file")
    problem = preset_predictions_problem(a)
    if problem:
        p.error(problem)
    result = cli_call(prepare_from_args, a)
    print(result.summary())


if __name__ == "__main__":
    main()
