"""scripts/export_hf.py on real checkpoints: ZeRO-1 + BF16 from 2 ranks, its universal conversion, and a
checkpoint without ZeRO; the results load in transformers with a working tokenizer."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch
from safetensors.torch import load_file

from modeling import BertConfig, BertForPreTraining, ConfigError, save_hf
from scripts.export_hf import ExportError, export, locate, read_weights, their_checkpoint, tokenizer_case
from tests.test_launch import shared_two_node_run
from training.accelerator import free_port
from training.weights import read_fp32_weights, rounds_to

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def zero_run(tmp_path_factory, phase1_shards) -> Path:
    return shared_two_node_run(tmp_path_factory, phase1_shards)[0]


@pytest.fixture(scope="module")
def zero_export(zero_run: Path, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    hf = tmp_path_factory.mktemp("export") / "hf"
    done = export(zero_run, hf)
    assert done.path == hf.resolve() and "merged from 2 ZeRO partition(s)" in done.weights
    # The run kept its shards' lower_case attribute, and the export's tokenizer follows it.
    assert json.loads((zero_run / "tokenization.json").read_text()) == {"lower_case": True}
    assert done.tokenizer == f"lower-cases, as the run's shards were made ({zero_run.resolve() / 'tokenization.json'})"
    # The export records where it came from; the record is also the mark that lets a later export replace it.
    assert json.loads((hf / "export_info.json").read_text()) == {
        "written_by": "bert-pretraining (modeling.save_hf)", "weights": done.weights,
        "config": str(zero_run.resolve() / "model_config.json"), "vocab": str(zero_run.resolve() / "vocab.txt"),
        "tokenizer": done.tokenizer}
    weights, _ = read_weights(locate(zero_run))
    return hf, weights


def assert_exported(hf: Path, weights: dict[str, torch.Tensor]) -> None:
    """The export's model.safetensors holds exactly `weights` (vocabulary rows past the padding cut)."""
    exported = load_file(hf / "model.safetensors")
    assert set(exported) == set(weights)
    for name, value in exported.items():
        assert value.dtype == torch.float32 and torch.equal(value, weights[name][: len(value)]), name


def _real_batch(shards: Path, n: int = 4) -> dict[str, torch.Tensor]:
    path = next((shards / "hdf5" / "test").glob("*.hdf5"))
    with h5py.File(path) as f:
        return {k: torch.from_numpy(f[k][:n].astype("int64")) for k in ("input_ids", "input_mask", "segment_ids")}


def test_a_run_its_checkpoints_dir_and_a_tag_locate_the_same_checkpoint(zero_run: Path):
    run = locate(zero_run)
    assert run.run_dir == zero_run.resolve() and run.checkpoints_dir == zero_run.resolve() / "checkpoints"
    assert locate(zero_run / "checkpoints") == run
    assert locate(run.tag_dir) == run
    # A file of the tag stands for the tag (it had been taken for NVIDIA's or Habana's ckpt_<step>.pt).
    files = sorted(p.name for p in run.tag_dir.glob("*.pt"))
    assert files == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                     "mp_rank_00_model_states.pt"]
    for name in files:
        assert their_checkpoint(run.tag_dir / name, None) is None and locate(run.tag_dir / name) == run


def test_zero_export_is_the_fp32_master_weights(zero_run: Path, zero_export):
    _, weights = zero_export
    tag_dir = locate(zero_run).tag_dir
    module = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    assert set(weights) == set(module)
    for name, bf16 in module.items():
        # the bf16 weights DeepSpeed trains with are the fp32 masters rounded: equal only if merged in order
        assert torch.equal(weights[name].to(torch.bfloat16), bf16), name
    assert any(not torch.equal(w, w.to(torch.bfloat16).float()) for w in weights.values()), "fp32, not bf16 copies"
    assert_exported(zero_export[0], weights)


def test_transformers_loads_the_export_and_agrees(zero_export, phase1_shards: Path):
    from tokenizers import BertWordPieceTokenizer
    from transformers import AutoModelForPreTraining, AutoTokenizer, pipeline

    hf, weights = zero_export
    ours = BertForPreTraining(BertConfig.from_json_file(ROOT / "configs/models/bert-tiny.json"))
    ours.load_state_dict(weights)
    ours.eval()
    theirs = AutoModelForPreTraining.from_pretrained(hf).eval()
    batch = _real_batch(phase1_shards)
    with torch.no_grad():
        hidden_ours = ours.bert(batch["input_ids"], batch["segment_ids"], batch["input_mask"])
        out = theirs(input_ids=batch["input_ids"], token_type_ids=batch["segment_ids"],
                     attention_mask=batch["input_mask"], output_hidden_states=True)
    torch.testing.assert_close(out.hidden_states[-1], hidden_ours, atol=1e-5, rtol=1e-5)

    tokenizer = AutoTokenizer.from_pretrained(hf)
    vocab = phase1_shards / "vocab.txt"
    assert len(tokenizer) == len(vocab.read_text().splitlines()) == 30522
    text = "The Amazon river flows into the Atlantic Ocean near Belém."
    reference = BertWordPieceTokenizer(str(vocab), lowercase=True).encode(text).ids
    assert tokenizer(text)["input_ids"] == reference and tokenizer.unk_token_id not in reference
    fill = pipeline("fill-mask", model=str(hf), tokenizer=str(hf), device="cpu")
    top = fill("the river flows into the [MASK].", top_k=5)
    assert len(top) == 5 and all(p["token_str"] and p["token_str"] != "[UNK]" for p in top)


def test_universal_checkpoint_exports_the_same_weights(zero_run: Path, zero_export, tmp_path: Path):
    """A universal copy (made where a run resumes on another world size) lies beside the run's complete tags; it
    has no run_state.json of its own and is complete once renamed into place, so it is exported as it is."""
    run = tmp_path / "run"
    shutil.copytree(zero_run, run)
    tag_dir = locate(run).tag_dir
    universal = run / "checkpoints" / f"{tag_dir.name}_universal"
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
                    "--output_folder", str(universal), "--num_extract_workers", "1", "--num_merge_workers", "1"],
                   check=True, capture_output=True, timeout=300)
    _, weights = zero_export
    hf = tmp_path / "hf"
    source = export(universal, hf).weights
    assert "universal checkpoint" in source
    exported, _ = read_weights(locate(universal))
    for name, value in exported.items():
        assert torch.equal(value, weights[name]), name
    assert_exported(hf, weights)
    assert (hf / "tokenizer.json").is_file()


def test_fp32_zero_checkpoint_and_one_without_partitions(phase1_shards: Path, tmp_path: Path):
    """ZeRO-1 in fp32 (DeepSpeed's standard ZeRO optimizer, read by zero_to_fp32), then the same tag
    without its optimizer partitions, as a stage-0 checkpoint is laid out: both give the same model."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({**json.loads((ROOT / "configs/deepspeed/zero1-fp32.json").read_text()),
                              "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}))
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "run_pretraining.py"), "--deepspeed", "--deepspeed_config",
                           str(ds), "--input_dir", str(phase1_shards), "--output_dir", str(run), "--config_file",
                           str(ROOT / "configs/models/bert-tiny.json"), "--max_steps", "2", "--optimizer", "adamw",
                           "--learning_rate", "1e-3", "--num_steps_per_checkpoint", "2", "--num_workers", "0"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    assert proc.returncode == 0, proc.stderr[-3000:]
    source = export(run, tmp_path / "hf_zero").weights
    assert "merged from 1 ZeRO partition(s)" in source and "bf16" not in source
    tag_dir = locate(run).tag_dir
    # Phase 2 takes such a tag's fp32 module weights without reading its partitions: they equal the masters.
    masters, _ = read_weights(locate(run))
    module, module_source = read_fp32_weights(tag_dir, fp32_module_suffices=True)
    assert module_source.startswith("module weights (float32)") and set(module) == set(masters)
    assert all(torch.equal(module[name], masters[name]) for name in masters)
    plain = tmp_path / "plain" / "checkpoints" / tag_dir.name
    plain.mkdir(parents=True)
    shutil.copy(tag_dir / "mp_rank_00_model_states.pt", plain)
    source = export(plain, tmp_path / "hf_plain", config_file=run / "model_config.json",
                    vocab_file=run / "vocab.txt").weights
    assert "module weights (float32), no ZeRO partitions" in source
    assert_exported(tmp_path / "hf_zero", masters)
    assert_exported(tmp_path / "hf_plain", masters)  # fp32 training: the module weights are the masters


_ZERO3_SAVE = r"""
import sys
import deepspeed
import torch
from deepspeed.utils import safe_get_full_fp32_param
from modeling import BertConfig, BertForPreTraining

deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = BertForPreTraining(BertConfig.from_json_file(sys.argv[2]))
config = {"train_batch_size": 2, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
          "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)
ids = torch.randint(5, 1000, (2, 16))
out = engine(ids, masked_lm_positions=torch.tensor([[1, 2], [3, 4]]), masked_lm_labels=torch.tensor([[5, 6], [7, 8]]))
engine.backward(out.loss)
engine.step()
engine.save_checkpoint(sys.argv[1], "step00000001")
torch.save({n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}, sys.argv[3])
"""


def test_a_zero3_checkpoint_of_another_deepspeed_run_exports_its_fp32_masters(tmp_path: Path, bert_vocab: Path):
    """This project trains with ZeRO-1/2; a ZeRO-3 tag (one model states file per rank, its module weights empty)
    of another DeepSpeed run of this model exports from its merged fp32 masters. It had been called "not a
    DeepSpeed checkpoint tag" while the help listed ZeRO-3 (found by an audit)."""
    config = ROOT / "configs" / "models" / "bert-tiny.json"
    checkpoints, masters = tmp_path / "checkpoints", tmp_path / "masters.pt"
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-c", _ZERO3_SAVE, str(checkpoints), str(config), str(masters)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    tag = checkpoints / "step00000001"
    assert sorted(p.name for p in tag.iterdir()) == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                      "zero_pp_rank_0_mp_rank_00_model_states.pt"]
    (checkpoints / "latest").write_text("step00000099")  # names no tag: the ZeRO-3 tag is offered
    with pytest.raises(ExportError, match=re.escape("none has a run_state.json; pass --tag with (or point 'latest' "
                                                    "at) one of the tag directories there: step00000001")):
        export(tmp_path, tmp_path / "hf", config_file=config, vocab_file=bert_vocab)
    # The run with --tag, the tag directory, or a file in it.
    for named, tag_flag in ((tmp_path, tag.name), (tag, None), (tag / "zero_pp_rank_0_mp_rank_00_model_states.pt", None)):
        result = export(named, tmp_path / "hf", tag=tag_flag, config_file=config, vocab_file=bert_vocab)
        assert result.weights == f"fp32 master weights merged from 1 ZeRO-3 partition(s) of {tag}"
        shutil.rmtree(tmp_path / "hf")
    export(tag, tmp_path / "hf", config_file=config, vocab_file=bert_vocab)
    fp32 = torch.load(masters)
    assert any(not torch.equal(v, v.bfloat16().float()) for v in fp32.values())  # masters, not bf16 weights
    assert_exported(tmp_path / "hf", fp32)


def test_a_bf16_weight_is_its_master_rounded_in_any_mode():
    """The check of a checkpoint's bf16 module weights against its fp32 masters (and of set_fp32_masters) takes
    either bf16 neighbour of the master, as a device may truncate where the host rounds to nearest."""
    fp32 = torch.tensor([1.0 + 2**-8 + 2**-10, -3.0 - 2**-6 - 2**-9, 1e-3, 0.0])
    nearest = fp32.bfloat16()
    truncated = (fp32.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()  # toward zero
    assert not torch.equal(nearest, truncated)
    assert rounds_to(fp32, nearest) and rounds_to(fp32, truncated)
    for i in range(len(fp32) - 1):  # each value once one unit past both neighbours, toward zero or away
        for step in (-0x10000, 0x20000):
            off = truncated.float().view(torch.int32).clone()
            off[i] += step
            assert not rounds_to(fp32, off.view(torch.float32).bfloat16()), (i, step)
    assert rounds_to(fp32, fp32.clone()) and not rounds_to(fp32, fp32 + 2**-20)  # fp32 weights: equal
    # A zero or subnormal master may be flushed to a zero of either sign; a normal one may not.
    tiny = torch.tensor([0.0, -0.0, 1e-39, -1e-39])
    assert rounds_to(tiny, torch.tensor([-0.0, 0.0, 0.0, -0.0]).bfloat16()) and rounds_to(tiny, tiny.bfloat16())
    assert not rounds_to(torch.tensor([1e-37]), torch.tensor([0.0]).bfloat16())
    # A master that bf16 holds exactly (a LayerNorm's 1.0, a bias's 0.5) has one rounding: itself.
    exact = torch.tensor([1.0, 0.5])
    assert rounds_to(exact, exact.bfloat16())
    for wrong in ([1.0078125, 0.5], [0.99609375, 0.5], [1.0, 0.50390625]):
        assert not rounds_to(exact, torch.tensor(wrong).bfloat16()), wrong


def test_the_tokenizer_case_comes_from_the_run_record_then_the_flag_then_the_vocab(tmp_path: Path, bert_vocab):
    """The run's record of its shards' case decides; a flag may repeat it, not contradict it (a lower-cased run
    exported with --no_do_lower_case gave the model cased ids it never saw: [UNK] for 'The')."""
    lines = bert_vocab.read_text(encoding="utf-8").splitlines()
    lines[lines.index("gunners")] = "McDonald"  # within the stray cased tokens a lower-cased run accepts
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert tokenizer_case(tmp_path, vocab, None) == (
        True, f"guessed from {vocab}: the shards do not record it; pass --do_lower_case or --no_do_lower_case if "
              "that is wrong")
    record = tmp_path / "tokenization.json"
    record.write_text('{"lower_case": false}\n')
    assert tokenizer_case(tmp_path, vocab, None) == (False, f"as the run's shards were made ({record})")
    assert tokenizer_case(tmp_path, vocab, False) == (False, f"as the run's shards were made ({record})")
    with pytest.raises(ExportError) as refused:
        tokenizer_case(tmp_path, vocab, True)
    assert str(refused.value) == (f"--do_lower_case contradicts {record}: the run's shards were made keeping case, "
                                  "and the model learned the ids that tokenization gives; drop --do_lower_case")
    for bad, why in (('{"lower_case": "no"}', r"lower_case is 'no', not true or false"),
                     ("{}", r"not a tokenization record \('lower_case'\)"), ("[", "not a tokenization record"),
                     ("[]", "not a tokenization record"), ("\xff", "not a tokenization record")):
        record.write_text(bad)
        for flag in (None, False):
            with pytest.raises(ExportError, match=f"{record}: {why}.*; restore it, or delete it and pass "
                                                  "--do_lower_case or --no_do_lower_case as the shards were made"):
                tokenizer_case(tmp_path, vocab, flag)
    record.unlink()  # the way past a damaged record, as its message says
    assert tokenizer_case(tmp_path, vocab, False) == (False, "as --do_lower_case/--no_do_lower_case says")


def test_a_run_that_kept_case_exports_a_tokenizer_that_keeps_case(zero_run: Path, tmp_path: Path):
    """The case the run recorded reaches the tokenizer files, though its vocab (BERT's uncased) looks uncased."""
    from transformers import AutoTokenizer

    run = tmp_path / "run"
    shutil.copytree(zero_run, run, ignore=shutil.ignore_patterns("tensorboard"))
    (run / "tokenization.json").write_text('{"lower_case": false}\n')
    done = export(run, tmp_path / "hf")
    assert done.tokenizer.startswith("keeps case, as the run's shards were made")
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["do_lower_case"] is False
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").tokenize("The the") == ["[UNK]", "the"]


def test_a_file_given_as_the_checkpoint_is_named_a_file(tmp_path: Path):
    """Say what is wrong with the path given (a run's model_config.json, say), not "no such directory"."""
    (tmp_path / "model_config.json").write_text("{}")
    with pytest.raises(ExportError, match=r"model_config.json: a file, not a directory; pass a training --output_dir"):
        locate(tmp_path / "model_config.json")


def _tags(checkpoints: Path, complete: tuple[str, ...], incomplete: str) -> None:
    """Tag directories: `complete` ones with a run_state.json, and one that was never completed."""
    for tag in complete:
        (checkpoints / tag).mkdir(parents=True)
        (checkpoints / tag / "run_state.json").write_text("{}")
    (checkpoints / incomplete).mkdir()


def test_latest_naming_a_missing_tag_says_so_and_names_the_complete_ones(tmp_path: Path):
    checkpoints = tmp_path / "run" / "checkpoints"
    _tags(checkpoints, ("step00000002", "step00000004"), "step00000006")  # the incomplete one is not offered
    (checkpoints / "latest").write_text("step00000009\n")
    with pytest.raises(ExportError, match=r"latest names 'step00000009', but .*step00000009 does not exist; pass --tag "
                                          r"with \(or point 'latest' at\) one of the complete tags: step00000002, "
                                          r"step00000004$"):
        locate(tmp_path / "run")
    (checkpoints / "latest").write_text("\n")  # was read as the tag "", i.e. checkpoints/ itself
    with pytest.raises(ExportError, match=r"latest is empty; pass --tag with \(or point 'latest' at\) one of the "
                                          r"complete tags: step00000002, step00000004$"):
        locate(tmp_path / "run")
    # '..' was read as the tag '..', i.e. the run's directory, and a path as another run's tag
    for tag in ("..", "../../other/checkpoints/step00000002"):
        (tmp_path / "other" / "checkpoints" / "step00000002").mkdir(parents=True, exist_ok=True)
        (checkpoints / "latest").write_text(tag + "\n")
        with pytest.raises(ExportError, match=rf"latest holds {re.escape(repr(tag))}, not a tag name; pass --tag with "
                                              r"\(or point 'latest' at\) one of the complete tags: step00000002, "
                                              r"step00000004$"):
            locate(tmp_path / "run")
        with pytest.raises(ExportError, match=rf"^--tag {re.escape(repr(tag))} is not a tag name; pass the name of a "
                                              rf"directory in {re.escape(str(checkpoints))}, or pass the tag directory "
                                              "itself as the checkpoint$"):
            locate(tmp_path / "run", tag)


@pytest.mark.parametrize("tag", ["step00000098", "20"])
def test_a_tag_that_does_not_exist_names_the_complete_ones(tmp_path: Path, tag: str):
    """It said only "no such checkpoint tag"; a mistyped step or a bare step number needs the tags to choose from."""
    checkpoints = tmp_path / "run" / "checkpoints"
    _tags(checkpoints, ("step00000020", "step00000040"), "step00000060")  # the incomplete one is not offered
    (checkpoints / "latest").write_text("step00000040\n")
    with pytest.raises(ExportError, match=rf"checkpoints/{tag}: no such checkpoint tag; pass --tag with one of the "
                                          r"complete tags: step00000020, step00000040$"):
        locate(tmp_path / "run", tag)


def test_a_missing_tag_of_another_deepspeed_run_names_its_tag_directories(tmp_path: Path):
    """Another DeepSpeed run's tags (Habana deepspeed-bert's "7038") have no run_state.json: none is "complete",
    and the message names the tag directories there instead."""
    folder = tmp_path / "habana"
    for tag in ("7000", "7038"):
        (folder / tag).mkdir(parents=True)
        (folder / tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    (folder / "latest").write_text("7038")
    with pytest.raises(ExportError, match=r"habana/20: no such checkpoint tag; none has a run_state.json; pass --tag "
                                          r"with one of the tag directories there: 7000, 7038$"):
        locate(folder, "20")
    (folder / "latest").write_text("7100")
    with pytest.raises(ExportError, match=r"latest names '7100', but .*7100 does not exist; none has a run_state.json; "
                                          r"pass --tag with \(or point 'latest' at\) one of the tag directories "
                                          r"there: 7000, 7038$"):
        locate(folder)
    empty = tmp_path / "run" / "checkpoints"
    empty.mkdir(parents=True)
    with pytest.raises(ExportError, match=r"step00000002: no such checkpoint tag; there is no checkpoint tag there yet$"):
        locate(empty.parent, "step00000002")


def test_a_vocab_and_config_of_other_sizes_name_both_files_and_both_fixes(tmp_path: Path, bert_vocab: Path):
    """A --config_file of another model than the run's own is refused as such (it had been blamed on the run's
    vocab.txt alone); a vocab of another size than the run's own config names both files and both fixes, as either
    may be the wrong one. Checked before any weight is read."""
    run = tmp_path / "run"
    tag_dir = run / "checkpoints" / "step00000002"
    tag_dir.mkdir(parents=True)
    (tag_dir / "run_state.json").write_text("not read")  # reading the checkpoint would fail on it
    (tag_dir.parent / "latest").write_text("step00000002\n")
    shutil.copy(ROOT / "configs/models/bert-tiny.json", run / "model_config.json")  # 30522, as the vocab
    shutil.copy(bert_vocab, run / "vocab.txt")
    demo = ROOT / "configs/models/bert-demo.json"  # 2048
    with pytest.raises(ExportError, match=re.escape(
            f"{demo}: not the model the run trained ({run.resolve() / 'model_config.json'}: vocab_size 30522 there, "
            "2048 in --config_file; ")):
        export(run, tmp_path / "hf", config_file=demo)
    shutil.copy(demo, run / "model_config.json")  # the run's own config, and a vocab of another size
    with pytest.raises(ExportError, match=re.escape(
            f"{bert_vocab}: 30522 tokens, but {run.resolve() / 'model_config.json'} says vocab_size 2048; pass the "
            "vocab.txt the shards were made with as --vocab_file, or the model config the run trained with as "
            "--config_file")):
        export(run, tmp_path / "hf", vocab_file=bert_vocab)
    assert not (tmp_path / "hf").exists()


def test_an_output_that_holds_other_files_is_refused_before_the_checkpoint_is_read(tmp_path: Path):
    """The output is checked first: merging a large model's partitions takes minutes, and was done in vain."""
    tag_dir = tmp_path / "run" / "checkpoints" / "step00000002"
    tag_dir.mkdir(parents=True)
    (tag_dir / "run_state.json").write_text("not read")  # reading the checkpoint would fail on it
    (tag_dir.parent / "latest").write_text("step00000002\n")
    output = tmp_path / "notes"
    output.mkdir()
    (output / "todo.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"notes: holds todo.txt, which no export writes"):
        export(tmp_path / "run", output)
    assert [p.name for p in output.iterdir()] == ["todo.txt"]


def test_clear_errors(zero_run: Path, tmp_path: Path):
    with pytest.raises(ExportError, match="no such directory"):
        export(tmp_path / "nowhere", tmp_path / "hf")
    empty = tmp_path / "empty" / "checkpoints"
    empty.mkdir(parents=True)
    with pytest.raises(ExportError, match="no 'latest' file, so no checkpoint was completed there"):
        export(empty.parent, tmp_path / "hf")
    with pytest.raises(ExportError, match=r"bert-demo.json: not the model the run trained \(.*model_config.json: "
                                          r"vocab_size 30522 there, 2048 in --config_file; .*\); drop --config_file, "
                                          r"and the run's own is used$"):
        export(zero_run, tmp_path / "hf", config_file=ROOT / "configs/models/bert-demo.json")
    # The vocab is read as the tokenizers read it (data.vocab.load_vocab): a file that is not UTF-8 had ended in
    # a UnicodeDecodeError naming no file, and a token holding U+0085 was counted as two lines.
    latin1, nel = tmp_path / "latin1" / "vocab.txt", tmp_path / "nel" / "vocab.txt"
    tokens = (zero_run / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    latin1.parent.mkdir()
    latin1.write_bytes("\n".join(tokens[:-1]).encode("utf-8") + "\ncafé\n".encode("latin-1"))
    nel.parent.mkdir()
    nel.write_text("\n".join(tokens[:-1] + ["a\x85b"]) + "\n", encoding="utf-8")
    with pytest.raises(ExportError, match=rf"^{re.escape(str(latin1))} is not UTF-8 text; a vocab.txt has one token "
                                          "per line$"):
        export(zero_run, tmp_path / "hf", vocab_file=latin1)
    with pytest.raises(ExportError, match=rf"^{re.escape(str(nel))} line {len(tokens)}: 'a\\x85b' holds a line-break "
                                          "character inside the token"):
        export(zero_run, tmp_path / "hf", vocab_file=nel)
    assert not (tmp_path / "hf").exists()
    deeper = tmp_path / "deeper.json"
    deeper.write_text(json.dumps({**json.loads((zero_run / "model_config.json").read_text()), "num_hidden_layers": 3}))
    with pytest.raises(ExportError, match=r"deeper.json: not the model the run trained \(.*model_config.json: "
                                          r"num_hidden_layers 2 there, 3 in --config_file\); drop --config_file"):
        export(zero_run, tmp_path / "hf", config_file=deeper)
    broken = tmp_path / "broken"
    shutil.copytree(zero_run / "checkpoints", broken / "checkpoints")
    shutil.copy(zero_run / "vocab.txt", broken)
    # without the run's model_config.json (checkpoints copied alone), --config_file stands in, checked by the weights
    with pytest.raises(ExportError, match=r"(?s)the weights do not fit .*deeper.json \(.*Missing key\(s\) in state_dict: "
                                          r'"bert.encoder.layer.2.*; pass the model config the run trained with'):
        export(broken, tmp_path / "hf", config_file=deeper)
    shutil.copy(zero_run / "model_config.json", broken)
    tag = (broken / "checkpoints" / "latest").read_text().strip()
    partition = broken / "checkpoints" / tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    partition.write_bytes(partition.read_bytes()[:1000])  # truncated: was a torch.load traceback
    with pytest.raises(ExportError, match=r"has 1000 bytes but was saved with .*corrupt.*or export another tag "
                                          r"with --tag"):
        export(broken, tmp_path / "hf")
    partition.unlink()
    with pytest.raises(ExportError, match=r"missing from checkpoint"):
        export(broken, tmp_path / "hf")
    assert not (tmp_path / "hf").exists(), "a failed export leaves no model directory"
    # A tag the run was stopped while saving (no run_state.json): the complete ones are named.
    unfinished = broken / "checkpoints" / "step99999999"
    unfinished.mkdir()
    with pytest.raises(ExportError, match=rf"no run_state.json, so this tag was never completed.*complete tags: .*"
                                          rf"{tag}"):
        export(broken, tmp_path / "hf", tag="step99999999")
    # A run directory that saved no checkpoint yet is named as such, not read as a checkpoints/ directory.
    fresh = tmp_path / "fresh"
    (fresh / "tensorboard").mkdir(parents=True)
    with pytest.raises(ExportError, match="fresh: no checkpoints/ directory in it"):
        export(fresh, tmp_path / "hf")
    (fresh / "checkpoints").mkdir()
    with pytest.raises(ExportError, match=r"no 'latest' file, so no checkpoint was completed there; the run "
                                          r"saved none yet"):
        export(fresh, tmp_path / "hf")


def test_a_layer_norm_large_model_run_is_refused_before_its_weights_are_read(tmp_path: Path):
    """transformers has no model computing Habana's pre-LN block: no export that computes something else."""
    from tests.test_modeling import small_config

    run = tmp_path / "run"
    tag_dir = run / "checkpoints" / "step00000002"
    tag_dir.mkdir(parents=True)
    (tag_dir / "run_state.json").write_text("not read")  # reading the checkpoint would fail on it
    (tag_dir.parent / "latest").write_text("step00000002\n")
    small_config(layer_norm_large_model=True).to_json_file(run / "model_config.json")
    (run / "vocab.txt").write_text("".join(f"t{i}\n" for i in range(1001)))
    with pytest.raises(ExportError, match=re.escape(
            f"{run / 'model_config.json'}: field 'layer_norm_large_model' is true (Habana deepspeed-bert's pre-LN "
            "block), which no transformers model computes: BertModel is post-LN and MegatronBert adds the raw "
            "embeddings to the residual stream, so a Hugging Face export or import of this model would compute "
            "another function of the same weights. Nothing was exported; the checkpoint remains usable with this "
            "project (resume its run, or start phase 2 from it with --phase2 --init_checkpoint)")):
        export(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    # The library call refuses too, rather than writing a MegatronBert or BertModel.
    with pytest.raises(ConfigError, match="^the model config: field 'layer_norm_large_model' is true"):
        save_hf(BertForPreTraining(small_config(layer_norm_large_model=True)), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_torch_older_than_transformers_accepts_is_refused_before_the_weights_are_read(tmp_path: Path):
    """transformers 5 with torch < 2.6 (Habana's 1.18 container: 2.4.0) imports, reports PyTorch missing and
    raises an ImportError at its first model class: after the partitions were merged, or as a traceback from
    --init_checkpoint. Here the torch distribution's metadata says 2.4.0, as there (transformers reads it)."""
    from tests.test_modeling import small_config

    old = tmp_path / "site" / "torch-2.4.0.dist-info"
    old.mkdir(parents=True)
    (old / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.4.0\n")
    run = tmp_path / "run"
    tag_dir = run / "checkpoints" / "step00000002"
    tag_dir.mkdir(parents=True)
    (tag_dir / "run_state.json").write_text("not read")  # reading the checkpoint would fail on it
    (tag_dir.parent / "latest").write_text("step00000002\n")
    small_config().to_json_file(run / "model_config.json")
    (run / "vocab.txt").write_text("".join(f"t{i}\n" for i in range(1001)))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    code = ("import sys; from pathlib import Path; from scripts.export_hf import main; "
            "from training.weights import load_initial_weights; from modeling import BertForPreTraining, BertConfig\n"
            "try:\n"
            f"    load_initial_weights(BertForPreTraining(BertConfig.from_json_file({str(run / 'model_config.json')!r})), "
            f"Path({str(hf)!r}))\n"
            "except Exception as e: print(type(e).__name__, e)\n"
            f"sys.exit(main(['--checkpoint', {str(run)!r}, '--output', {str(tmp_path / 'export')!r}]))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)])}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    refusal = ("does not run its models with this torch 2.4.0 (it needs torch 2.6 or later), and the Hugging Face "
               "export and import need them: use a torch it accepts (Intel Gaudi software 1.21 or later, NVIDIA's "
               "PyTorch container 25.05 or later), or export on any machine with pip install '.[cpu]'")
    assert result.returncode == 2, result.stderr
    assert f"CheckpointError --init_checkpoint {hf}: cannot load it as a Hugging Face BERT (ConfigError: " \
           "transformers " in result.stdout and refusal in result.stdout
    assert re.search(r"^error: transformers \S+ " + re.escape(refusal) + "$", result.stderr, re.M), result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "export").exists()


def test_an_export_to_a_full_disk_says_so_keeps_the_earlier_export_and_leaves_no_staging(zero_run: Path,
                                                                                         zero_export, tmp_path):
    """Writes past 1 MB fail with EFBIG (RLIMIT_FSIZE; Python ignores SIGXFSZ), as on a full disk: safetensors
    reports it as a SafetensorError, which was a traceback, and the staging directory was left holding the space."""
    import resource

    hf = tmp_path / "hf"
    shutil.copytree(zero_export[0], hf)  # an earlier export, which a failed one must not touch
    before = {p.name: p.read_bytes() for p in hf.iterdir()}
    cmd = [sys.executable, str(ROOT / "scripts" / "export_hf.py"), "--checkpoint", str(zero_run), "--output", str(hf)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20)))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: could not write {hf} (") and line.endswith(
        "nothing was written under that name and an earlier export there is kept. If the disk is full, free space "
        "there and rerun the same command"), line
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no .hf.tmp
    assert subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env).returncode == 0
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == before  # the same checkpoint: the same export


def test_the_command_says_how_it_chose_the_tokenizer_case_and_a_flag_may_not_contradict_the_run(zero_run: Path,
                                                                                                 tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "export_hf.py"), "--checkpoint", str(zero_run)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    record = zero_run.resolve() / "tokenization.json"
    for flags in ([], ["--do_lower_case"]):
        hf = tmp_path / f"hf{len(flags)}"
        result = subprocess.run(cmd + ["--output", str(hf)] + flags, capture_output=True, text=True, timeout=300,
                                cwd=ROOT, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.splitlines()[-1] == f"  tokenizer: lower-cases, as the run's shards were made ({record})"
        assert json.loads((hf / "tokenizer_config.json").read_text())["do_lower_case"] is True
        from transformers import AutoTokenizer

        assert AutoTokenizer.from_pretrained(hf).tokenize("The Fox")[0] == "the"
    result = subprocess.run(cmd + ["--output", str(tmp_path / "cased"), "--no_do_lower_case"], capture_output=True,
                            text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 2 and result.stderr.strip() == (
        f"error: --no_do_lower_case contradicts {record}: the run's shards were made lower-cased, and the model "
        "learned the ids that tokenization gives; drop --no_do_lower_case")
    assert not (tmp_path / "cased").exists()


def test_a_config_or_vocab_given_must_agree_with_the_runs_own(zero_run: Path, tmp_path: Path):
    """--config_file and --vocab_file stand in for files a run lacks. Given beside the run's own, another
    hidden_act had exported a model computing another function, and a vocab with two ids swapped a tokenizer
    giving ids the model was not trained on, both without a word. The same contents at another path are fine."""
    tokens = (zero_run / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    tokens[2000], tokens[2001] = tokens[2001], tokens[2000]
    swapped = tmp_path / "swapped.txt"
    swapped.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    run_vocab = zero_run.resolve() / "vocab.txt"
    with pytest.raises(ExportError) as refused:
        export(zero_run, tmp_path / "hf", vocab_file=swapped)
    assert str(refused.value) == (
        f"{swapped}: not the vocabulary the run trained with ({run_vocab}, 30522 tokens, against 30522: token id 2000 "
        f"is {tokens[2001]!r} there, {tokens[2000]!r} here); drop --vocab_file, and the run's own is used")
    config = json.loads((zero_run / "model_config.json").read_text())
    relu = tmp_path / "relu.json"
    relu.write_text(json.dumps({**config, "hidden_act": "relu", "layer_norm_eps": 1e-5}))
    with pytest.raises(ExportError) as refused:
        export(zero_run, tmp_path / "hf", config_file=relu)
    assert str(refused.value) == (
        f"{relu}: not the model the run trained ({zero_run.resolve() / 'model_config.json'}: hidden_act 'gelu' there, "
        "'relu' in --config_file; layer_norm_eps 1e-12 there, 1e-05 in --config_file); drop --config_file, and the "
        "run's own is used")
    assert not (tmp_path / "hf").exists()
    same_vocab, same_config = tmp_path / "copy" / "vocab.txt", tmp_path / "copy" / "config.json"
    same_vocab.parent.mkdir()
    shutil.copy(run_vocab, same_vocab)
    same_config.write_text(json.dumps({**config, "hidden_dropout_prob": 0.0}))  # dropout: not the architecture
    export(zero_run, tmp_path / "hf", config_file=same_config, vocab_file=same_vocab)
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    # A run's own file that cannot be read: named, with the way past it (it is checked before the checkpoint is read)
    damaged = tmp_path / "damaged"
    (damaged / "checkpoints" / "step00000001").mkdir(parents=True)
    (damaged / "checkpoints" / "latest").write_text("step00000001\n")
    (damaged / "model_config.json").write_text('{"vocab_size": ')
    shutil.copy(run_vocab, damaged / "vocab.txt")
    with pytest.raises(ExportError) as refused:
        export(damaged, tmp_path / "hf2", config_file=same_config)
    assert str(refused.value) == (
        f"{damaged.resolve() / 'model_config.json'}: not valid JSON (line 1, column 16: Expecting value). Restore it, "
        "or move it out of the run directory so that --config_file stands in for it")
    shutil.copy(zero_run / "model_config.json", damaged)
    (damaged / "vocab.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(ExportError) as refused:
        export(damaged, tmp_path / "hf2", vocab_file=same_vocab)
    assert str(refused.value) == (
        f"{damaged.resolve() / 'vocab.txt'} is not UTF-8 text; a vocab.txt has one token per line. Restore it, or move "
        "it out of the run directory so that --vocab_file stands in for it")


def test_a_run_that_completed_no_checkpoint_is_refused_and_a_missing_last_partition_named(zero_run: Path,
                                                                                       tmp_path: Path):
    """A run killed while saving its first checkpoint holds one tag without run_state.json and no complete one: it
    was read as another DeepSpeed run's tag and exported. Another DeepSpeed run's tag (no run_info.json) is still
    read as it is, and one without its last rank's partition (no gap to show it) is named incomplete."""
    tag = (zero_run / "checkpoints" / "latest").read_text().strip()
    killed = tmp_path / "killed"
    shutil.copytree(zero_run / "checkpoints" / tag, killed / "checkpoints" / tag)
    for name in ("model_config.json", "vocab.txt", "run_info.json", "tokenization.json"):
        shutil.copy(zero_run / name, killed)
    (killed / "checkpoints" / tag / "run_state.json").unlink()
    with pytest.raises(ExportError) as refused:
        export(killed, tmp_path / "hf", tag=tag)
    assert str(refused.value) == (
        f"{killed.resolve() / 'checkpoints' / tag}: no run_state.json, so this tag was never completed (the run "
        f"stopped while saving it); the run completed no checkpoint; resume it (run_pretraining.py with --output_dir "
        f"{killed.resolve()}) until it saves one")
    # A committed tag that lost its run_state.json, which a start of the run set aside: not "stopped while saving"
    aside = killed / "checkpoints" / f"{tag}.incomplete"
    (killed / "checkpoints" / tag).rename(aside)
    with pytest.raises(ExportError) as refused:
        export(killed, tmp_path / "hf", tag=aside.name)
    assert str(refused.value) == (
        f"{aside.resolve()}: a start of the run set this tag aside, as it was committed but had lost its "
        "run_state.json; put that file back into it to export it")
    aside.rename(killed / "checkpoints" / tag)
    (killed / "run_info.json").unlink()  # now another DeepSpeed run's directory, as far as can be told
    partition = killed / "checkpoints" / tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    # one partition more than the run had ranks: another save's, left among these
    extra = shutil.copy(partition, partition.with_name("bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"))
    with pytest.raises(ExportError) as refused:
        export(killed, tmp_path / "hf", tag=tag)
    assert str(refused.value) == (
        f"{killed.resolve() / 'checkpoints' / tag}: 3 optimizer partition(s) for a run of 2 data-parallel ranks "
        "(files of another save are mixed in); the checkpoint is incomplete; export another tag with --tag")
    Path(extra).unlink()
    partition.unlink()
    with pytest.raises(ExportError) as refused:
        export(killed, tmp_path / "hf", tag=tag)
    assert str(refused.value) == (
        f"{killed.resolve() / 'checkpoints' / tag}: 1 optimizer partition(s) for a run of 2 data-parallel ranks "
        "(no optimizer partition of rank 1); the checkpoint is incomplete; export another tag with --tag")
    assert not (tmp_path / "hf").exists()
