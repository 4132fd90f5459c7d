"""Checkpoint bookkeeping without DeepSpeed: `latest` only names complete tags, keep-K, loud corruption.

The DeepSpeed side (save/load through a real engine, SIGKILL, universal checkpoints) is in
tests/test_train_run.py."""

import json
import os
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from tests.conftest import communicate_all, record_fsyncs
from training import checkpoint, weights
from training.accelerator import free_port
from training.checkpoint import (
    COMMIT_PENDING,
    LATEST,
    RUN_STATE,
    CheckpointError,
    commit,
    complete_tags,
    describe_files,
    find_resume,
    make_room,
    read_latest,
    recover,
    remove_unfinished,
    tag_for,
    verify_files,
)


def _fake_deepspeed_tag(ckpt_dir, step, world_size=2, weights=b"m"):
    """The files DeepSpeed writes for one ZeRO-1 bf16 tag."""
    tag_dir = ckpt_dir / tag_for(step)
    tag_dir.mkdir(parents=True)
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(weights * (100 + step))
    for rank in range(world_size):
        (tag_dir / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"o" * 50)
    return tag_dir


def _state(step, world_size=2):
    return {"step": step, "consumed_samples": step * 16, "world_size": world_size, "seed": 1, "skipped_batches": 0,
            "identity": {"optimizer": "lamb", "weight_decay": 0.01, "train_batch_size": 16,
                         "training_shards": [["t_training_0.hdf5", 16]]}}


def _describe(ckpt_dir, step):
    tag_dir = ckpt_dir / tag_for(step)
    return describe_files(tag_dir, sorted(p.name for p in tag_dir.iterdir()))


def _save(ckpt_dir, step, keep=2):
    _fake_deepspeed_tag(ckpt_dir, step)
    return commit(ckpt_dir, tag_for(step), _state(step), keep, _describe(ckpt_dir, step))


def test_commit_writes_manifest_then_latest(tmp_path):
    state = _save(tmp_path, 10)
    assert read_latest(tmp_path) == "step00000010"
    assert {name: f["size"] for name, f in state.files.items()} == {
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt": 50, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt": 50,
        "mp_rank_00_model_states.pt": 110}
    assert state.files["mp_rank_00_model_states.pt"]["crc32"] == zlib.crc32(b"m" * 110)
    tag, resumed = find_resume(tmp_path)
    assert tag == "step00000010" and resumed.consumed_samples == 160 and resumed.world_size == 2


def test_fresh_directory_resumes_nothing(tmp_path):
    assert find_resume(tmp_path / "checkpoints") is None


@pytest.mark.parametrize(("missing", "message"), [
    ("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "optimizer partition of rank 1"),
    ("mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt"),
])
def test_missing_partition_never_becomes_latest(missing, message, tmp_path):
    _save(tmp_path, 10)
    tag_dir = _fake_deepspeed_tag(tmp_path, 20)
    (tag_dir / missing).unlink()
    with pytest.raises(CheckpointError, match=message):
        commit(tmp_path, "step00000020", _state(20), keep=2, files=_describe(tmp_path, 20))
    assert read_latest(tmp_path) == "step00000010"


def test_crash_mid_save_leaves_latest_on_previous_tag(tmp_path):
    _save(tmp_path, 10)
    _fake_deepspeed_tag(tmp_path, 20)  # DeepSpeed wrote its files, the process died before commit
    tag, state = find_resume(tmp_path)
    assert tag == "step00000010" and state.step == 10
    assert complete_tags(tmp_path) == ["step00000010"]


def test_keep_last_k_and_drop_unfinished(tmp_path):
    for step in (10, 20):
        _save(tmp_path, step, keep=2)
    (tmp_path / "step00000010_universal").mkdir()
    (tmp_path / "latest_universal").write_text("step00000010_universal")
    _fake_deepspeed_tag(tmp_path, 25)  # unfinished, older than the next commit
    _save(tmp_path, 30, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step00000020", "step00000030"]
    assert read_latest(tmp_path) == "step00000030"
    assert not (tmp_path / "latest_universal").exists()  # it named the pruned copy
    (tmp_path / "step00000030_universal").mkdir()
    for pointer in ("step00000030_universal", "", ".", "..", f"../{tmp_path.name}"):  # directories, not a copy
        (tmp_path / "latest_universal").write_text(pointer + "\n")
        remove_unfinished(tmp_path)
        assert (tmp_path / "latest_universal").exists() == (pointer == "step00000030_universal"), pointer


def test_rewound_timeline_is_neither_pruned_nor_overwritten(tmp_path):
    for step in (10, 20, 30):
        _save(tmp_path, step, keep=3)
    (tmp_path / LATEST).write_text("step00000010\n")  # the user rewinds to step 10
    assert find_resume(tmp_path)[0] == "step00000010"
    (tmp_path / "step00000020_universal").mkdir()  # converted from the old step 20: its weights are stale
    make_room(tmp_path, "step00000020")  # the resumed run reaches step 20 again
    assert (tmp_path / "step00000020.abandoned" / RUN_STATE).is_file()
    assert not (tmp_path / "step00000020_universal").exists()
    _save(tmp_path, 20, keep=1)
    # keep=1 up to latest; step 30 of the abandoned timeline stays
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "step00000020", "step00000020.abandoned", "step00000030"]


def test_a_second_rewind_past_the_same_step_keeps_both_abandoned_checkpoints(tmp_path):
    for step in (10, 20):
        _save(tmp_path, step, keep=3)
    for _ in range(2):  # rewound to step 10 twice
        (tmp_path / LATEST).write_text("step00000010\n")
        make_room(tmp_path, "step00000020")
        _save(tmp_path, 20, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "step00000010", "step00000020", "step00000020.abandoned", "step00000020.abandoned-2"]
    for name in ("step00000020.abandoned", "step00000020.abandoned-2"):
        assert (tmp_path / name / RUN_STATE).is_file()


def test_abandoned_tags_the_rewound_run_passes_are_set_aside_not_pruned(tmp_path):
    for step in (10, 17, 30):
        _save(tmp_path, step, keep=3)
    (tmp_path / "step00000017_universal").mkdir()
    (tmp_path / LATEST).write_text("step00000010\n")  # rewound to step 10; 17 and 30 are abandoned
    for step in (20, 30, 40, 50):
        make_room(tmp_path, tag_for(step))
        _save(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "step00000017.abandoned", "step00000030.abandoned", "step00000040", "step00000050"]
    for name in ("step00000017.abandoned", "step00000030.abandoned"):
        assert (tmp_path / name / RUN_STATE).is_file()


def test_keep_counts_only_the_tags_of_the_rewound_timeline(tmp_path):
    for step in (10, 20, 30, 40):
        _save(tmp_path, step, keep=4)
    (tmp_path / LATEST).write_text("step00000020\n")  # rewound to step 20
    make_room(tmp_path, "step00000030")
    _save(tmp_path, 30, keep=2)
    # keep=2 of the current timeline (20 and the new 30), not of the abandoned 30 and 40 ahead of it
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "step00000020", "step00000030", "step00000030.abandoned", "step00000040"]


def test_crash_debris_of_the_same_name_is_removed_before_saving(tmp_path):
    _fake_deepspeed_tag(tmp_path, 20)
    make_room(tmp_path, "step00000020")
    assert not (tmp_path / "step00000020").exists()
    assert not (tmp_path / "step00000020.abandoned").exists()


def _killed_before_latest(ckpt_dir, step, monkeypatch, keep=2, weights=b"m"):
    """A commit killed after the tag's run_state.json and before `latest` names the tag."""
    real = checkpoint.atomic_write_text

    def write(path, text):
        if Path(path).name == LATEST:
            raise KeyboardInterrupt("killed")
        return real(path, text)

    _fake_deepspeed_tag(ckpt_dir, step, weights=weights)
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "atomic_write_text", write)
        with pytest.raises(KeyboardInterrupt):
            commit(ckpt_dir, tag_for(step), _state(step), keep, _describe(ckpt_dir, step))
    assert (ckpt_dir / tag_for(step) / RUN_STATE).is_file()


def test_a_first_checkpoint_killed_before_latest_is_committed_on_rerun(tmp_path, monkeypatch):
    _killed_before_latest(tmp_path, 10, monkeypatch)
    assert read_latest(tmp_path) is None
    assert recover(tmp_path) == "step00000010"
    tag, state = find_resume(tmp_path)
    assert tag == "step00000010" and state.step == 10 and state.previous is None
    assert not (tmp_path / tag / COMMIT_PENDING).exists()
    assert recover(tmp_path) is None  # nothing left to finish


def test_a_later_checkpoint_killed_before_latest_is_committed_not_set_aside(tmp_path, monkeypatch):
    for step in (10, 20):
        _save(tmp_path, step)
    _killed_before_latest(tmp_path, 30, monkeypatch)
    (tmp_path / ".latest.4242.0123456789ab.tmp").write_text("step000")  # the kill's other leftover
    assert read_latest(tmp_path) == "step00000020"
    assert recover(tmp_path) == "step00000030"
    assert find_resume(tmp_path)[0] == "step00000030"
    make_room(tmp_path, "step00000040")
    _save(tmp_path, 40)
    # pruned to keep=2, nothing set aside as a rewound timeline, no temporary left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step00000030", "step00000040"]


def test_recover_leaves_what_the_user_rewound_past(tmp_path, monkeypatch):
    for step in (10, 20):
        _save(tmp_path, step, keep=3)
    _killed_before_latest(tmp_path, 30, monkeypatch, keep=3)  # saved when `latest` was step 20
    (tmp_path / LATEST).write_text("step00000010\n")  # then the user rewound to step 10
    assert recover(tmp_path) is None
    assert read_latest(tmp_path) == "step00000010"
    assert complete_tags(tmp_path) == ["step00000010", "step00000020", "step00000030"]


@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
def test_recover_sets_aside_an_uncommitted_tag_whose_files_do_not_check_out(tmp_path, monkeypatch, capsys, damage):
    """It was never committed, so the run resumes from `latest`. Before, every rerun stopped with an error that
    said to point `latest` at an older tag, which it already named."""
    _save(tmp_path, 10)
    _killed_before_latest(tmp_path, 20, monkeypatch)
    model_states = tmp_path / "step00000020" / "mp_rank_00_model_states.pt"
    model_states.write_bytes(b"m" * 7 if damage == "truncated" else b"x" * 120)  # damaged after the manifest
    assert recover(tmp_path) is None
    assert read_latest(tmp_path) == "step00000010" and find_resume(tmp_path)[0] == "step00000010"
    assert (tmp_path / "step00000020.damaged" / COMMIT_PENDING).exists()  # kept, out of keep-K's reach
    assert f"warning: {tmp_path / 'step00000020'} was never committed and does not check out (" in capsys.readouterr().err


def test_recover_never_commits_a_tag_of_a_timeline_rewound_past(tmp_path, monkeypatch):
    """Step 30 was saved after step 20 and killed before `latest` named it; the user rewound to step 10, and the
    rewound run saved step 20 again (other weights: another world size, say). Step 30 recorded its parent by
    name only, so the next rerun committed it and resumed the abandoned timeline without training 21-30."""
    for step in (10, 20):
        _save(tmp_path, step, keep=5)
    _killed_before_latest(tmp_path, 30, monkeypatch, keep=5)
    (tmp_path / LATEST).write_text("step00000010\n")  # the rewind
    assert recover(tmp_path) is None
    make_room(tmp_path, "step00000020")
    _fake_deepspeed_tag(tmp_path, 20, weights=b"n")  # other weights
    commit(tmp_path, "step00000020", _state(20), 5, _describe(tmp_path, 20))
    assert recover(tmp_path) is None
    assert read_latest(tmp_path) == "step00000020"
    # the same when the new step 20 was itself killed before `latest`: one recover met both
    (tmp_path / LATEST).write_text("step00000010\n")
    make_room(tmp_path, "step00000020")
    _killed_before_latest(tmp_path, 20, monkeypatch, keep=5, weights=b"k")
    assert recover(tmp_path) == "step00000020" and read_latest(tmp_path) == "step00000020"
    assert (tmp_path / "step00000030" / COMMIT_PENDING).exists()
    # its parent byte for byte (the same weights: a deterministic rerun) is its parent: then it is committed
    (tmp_path / LATEST).write_text("step00000010\n")
    shutil.rmtree(tmp_path / "step00000020")
    shutil.copytree(tmp_path / "step00000020.abandoned", tmp_path / "step00000020")  # the first step 20
    (tmp_path / LATEST).write_text("step00000020\n")
    assert recover(tmp_path) == "step00000030"


def test_recover_prunes_no_complete_tag(tmp_path):
    """It runs before the run has checked that the directory is its own (seed, model, shards): a command with a
    mistyped --output_dir or --seed, refused a moment later, had already deleted checkpoints down to
    --keep_checkpoints of its own. Only unfinished tags go; the next save prunes."""
    for step in (10, 20, 30):
        _save(tmp_path, step, keep=5)
    _fake_deepspeed_tag(tmp_path, 40)  # unfinished
    assert recover(tmp_path) is None
    assert complete_tags(tmp_path) == ["step00000010", "step00000020", "step00000030"]
    assert not (tmp_path / "step00000040").exists()
    _save(tmp_path, 50, keep=2)
    assert complete_tags(tmp_path) == ["step00000030", "step00000050"]


def test_recover_finishes_a_commit_killed_after_latest(tmp_path):
    for step in (10, 20, 30):
        _save(tmp_path, step, keep=3)
    (tmp_path / "step00000030" / COMMIT_PENDING).touch()  # killed before the mark went and before pruning
    assert recover(tmp_path) is None
    assert not (tmp_path / "step00000030" / COMMIT_PENDING).exists()
    _save(tmp_path, 40, keep=2)  # the next save prunes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step00000030", "step00000040"]


def test_recover_removes_a_killed_universal_conversion(tmp_path):
    """Its temporary directory is the size of a whole tag, and nothing else ever removed it."""
    _save(tmp_path, 10)
    (tmp_path / ".step00000010_universal.tmp" / "zero").mkdir(parents=True)
    (tmp_path / ".step00000010_universal.failed").write_text("converting ... failed")
    (tmp_path / "..step00000010_universal.failed.4242.0123456789ab.tmp").write_text("conv")  # the mark's, killed
    (tmp_path / ".latest_universal.4242.0123456789ab.tmp").write_text("step")  # the pointer's, killed
    # Killed before the pointer was rewritten to the final name, it names the temporary directory.
    (tmp_path / "latest_universal").write_text(".step00000010_universal.tmp\n")
    assert recover(tmp_path) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step00000010"]


def test_truncated_file_is_a_loud_error(tmp_path):
    _save(tmp_path, 10)
    path = tmp_path / "step00000010" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    path.write_bytes(b"o" * 10)
    with pytest.raises(CheckpointError, match=r"has 10 bytes but was saved with 50.*corrupt"):
        find_resume(tmp_path)


def test_overwritten_bytes_fail_the_checksum(tmp_path):
    state = _save(tmp_path, 10)
    path = tmp_path / "step00000010" / "mp_rank_00_model_states.pt"
    path.write_bytes(b"m" * 50 + b"x" + b"m" * 59)  # same size
    find_resume(tmp_path)  # sizes alone cannot tell
    with pytest.raises(CheckpointError, match="CRC-32 differs"):
        verify_files(tmp_path / "step00000010", state, checksum=["mp_rank_00_model_states.pt"])
    verify_files(tmp_path / "step00000010", state, checksum=["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"])


def test_deleted_file_is_a_loud_error(tmp_path):
    _save(tmp_path, 10)
    (tmp_path / "step00000010" / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt is missing"):
        find_resume(tmp_path)


def test_latest_pointing_at_incomplete_tag_is_a_loud_error_and_deletes_nothing(tmp_path):
    """A committed tag that lost its run_state.json still holds the weights: the start-up's `recover` had deleted
    it as a save cut short, then the error said the checkpoint "was deleted"."""
    for step in (10, 20, 30):
        _save(tmp_path, step, keep=3)
    (tmp_path / "step00000030" / RUN_STATE).unlink()
    (tmp_path / "step00000010" / RUN_STATE).unlink()  # an older one, also committed
    _fake_deepspeed_tag(tmp_path, 40)  # a save cut short beyond latest: debris
    files = {tag: sorted(p.name for p in (tmp_path / tag).iterdir()) for tag in ("step00000010", "step00000030")}
    recover(tmp_path)
    # set aside, out of reach of the cleanup and of pruning (a review: the error's advice, to point 'latest' at a
    # complete tag, had made the next start delete it as a save beyond 'latest')
    assert {tag: sorted(p.name for p in (tmp_path / f"{tag}.incomplete").iterdir()) for tag in files} == files
    assert not (tmp_path / "step00000040").exists()
    with pytest.raises(CheckpointError, match=rf"incomplete or was deleted\. Its files are kept in "
                                              rf"{re.escape(str(tmp_path / 'step00000030.incomplete'))}: with its "
                                              rf"{RUN_STATE} put back, rename it to step00000030 to resume from it\. "
                                              r"Point 'latest' at one of the complete tags: step00000020$"):
        find_resume(tmp_path)
    (tmp_path / LATEST).write_text("step00000020\n")  # as the error says
    recover(tmp_path)
    assert find_resume(tmp_path)[0] == "step00000020"
    assert {tag: sorted(p.name for p in (tmp_path / f"{tag}.incomplete").iterdir()) for tag in files} == files


@pytest.mark.parametrize("tag", ["..", ".", "../../other_run/checkpoints/step00000010"])
def test_latest_holding_a_path_is_not_a_tag(tmp_path, tag):
    """'..' named the run's directory and a path another run's checkpoint: the first was reported as an incomplete
    checkpoint, the second resumed from another run. Neither is a tag of this directory."""
    _save(tmp_path, 10)
    (tmp_path / LATEST).write_text(tag + "\n")
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(tmp_path / LATEST))}: {re.escape(repr(tag))} is not "
                                              r"a tag name; write into it one of the complete tags: step00000010$"):
        find_resume(tmp_path)


def test_latest_naming_a_missing_tag_names_the_complete_ones(tmp_path):
    """It said "Point 'latest' at a complete tag" without naming any, where TRAINING.md promises them named."""
    _save(tmp_path, 10)
    _save(tmp_path, 20)
    (tmp_path / LATEST).write_text("step00000999\n")
    with pytest.raises(CheckpointError, match=rf"{LATEST} names 'step00000999' but .*step00000999/{RUN_STATE} does not "
                                              r"exist: the checkpoint is incomplete or was deleted. Point 'latest' at "
                                              r"one of the complete tags: step00000010, step00000020$"):
        find_resume(tmp_path)
    shutil.rmtree(tmp_path / "step00000010")
    shutil.rmtree(tmp_path / "step00000020")
    with pytest.raises(CheckpointError, match=rf"No tag there is complete \(none has a {RUN_STATE}\), so there is "
                                              rf"nothing to start from: use another run's directory, or remove "
                                              rf"{tmp_path / LATEST} to train this one from scratch$"):
        find_resume(tmp_path)


def test_garbled_run_state_is_a_loud_error(tmp_path):
    _save(tmp_path, 10)
    state_file = tmp_path / "step00000010" / RUN_STATE
    saved = json.loads(state_file.read_text())
    state_file.write_text("{not json")
    with pytest.raises(CheckpointError, match="run_state.json is corrupt"):
        find_resume(tmp_path)
    state_file.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"run_state.json is corrupt \(a JSON list, not an object\)"):
        find_resume(tmp_path)
    # another version's fields: not "corrupt", whose advice (an older tag) cannot help
    del saved["identity"]
    state_file.write_text(json.dumps(saved | {"format": 3}))
    with pytest.raises(CheckpointError, match=r"run_state.json was written by another version of run_pretraining.py "
                                              r"\(fields missing: identity; unknown: format\); resume the run with "
                                              "the version that wrote it"):
        find_resume(tmp_path)
    state_file.write_text(json.dumps(saved | {"identity": {}, "format": 3}))  # a field of a newer version only
    with pytest.raises(CheckpointError, match=r"\(fields missing: none; unknown: format\)"):
        find_resume(tmp_path)
    del saved["skipped_steps"]  # absent before it was counted: still readable
    state_file.write_text(json.dumps(saved | {"identity": {}}))
    assert checkpoint.read_state(tmp_path / "step00000010").skipped_steps == 0


@pytest.mark.parametrize("change, message", [
    ({"files": None}, "field 'files' is not an object of {\"size\": bytes, \"crc32\": checksum} per file"),
    ({"files": {"mp_rank_00_model_states.pt": {"size": "110"}}},
     "field 'files' is not an object of {\"size\": bytes, \"crc32\": checksum} per file"),
    ({"step": "10"}, "field 'step' is '10', not a whole number >= 0"),
    ({"world_size": True}, "field 'world_size' is True, not a whole number >= 0"),
    ({"consumed_samples": -16}, "field 'consumed_samples' is -16, not a whole number >= 0"),
    ({"identity": []}, "field 'identity' is \\[\\], not an object"),
    ({"previous": 7}, "field 'previous' is 7, not a tag name"),
])
def test_a_run_state_field_of_the_wrong_type_is_named(tmp_path, change, message):
    """"files": null was an AttributeError traceback; "step": "10" said the schedule was at step 10 but the run
    state at 10."""
    _save(tmp_path, 10)
    state_file = tmp_path / "step00000010" / RUN_STATE
    state_file.write_text(json.dumps(json.loads(state_file.read_text()) | change))
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(state_file))}: {message}; the file was altered. "
                                              f"Point {re.escape(str(tmp_path / LATEST))} at an older tag$"):
        find_resume(tmp_path)


def test_checkpoints_without_latest_are_not_silently_ignored(tmp_path):
    _save(tmp_path, 10)
    (tmp_path / LATEST).unlink()
    with pytest.raises(CheckpointError, match="no 'latest' file"):
        find_resume(tmp_path)


def test_run_state_is_plain_json(tmp_path):
    _save(tmp_path, 10)
    data = json.loads((tmp_path / "step00000010" / RUN_STATE).read_text())
    assert data["consumed_samples"] == 160 and data["world_size"] == 2


SAVE_ON_A_RANK = """
import sys
from pathlib import Path

import torch.distributed as dist

from training import checkpoint
from training.accelerator import leave
from training.atomic import atomic_write_text

rank, ckpt_dir, port, identity, fault = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]


class Engine:  # writes the files DeepSpeed writes for this rank, then waits in the barrier DeepSpeed ends with
    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        tag_dir = Path(save_dir) / tag
        tag_dir.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"m" * 120)
        if rank == 1 and fault == "write":  # what torch.save raises on a full disk
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4416 vs 4308")
        if fault == "gone":  # a backend error on every rank: no collective can report it
            raise dist.DistError("peer gone")
        (tag_dir / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"o" * 50)
        dist.barrier()


def unreadable(tag_dir, names):
    raise OSError(5, "Input/output error")


def full_disk(*args):
    raise OSError(28, "No space left on device")


def latest_on_a_full_disk(path, text):
    if path.name == checkpoint.LATEST:
        raise OSError(28, "No space left on device")
    return atomic_write_text(path, text)


if rank == 1 and fault == "read":  # only rank 1 cannot read its share of the files back
    checkpoint.describe_files = unreadable
if rank == 0 and fault == "room":  # rank 0 cannot make room for the tag
    checkpoint.make_room = full_disk
if rank == 0 and fault == "latest":  # run_state.json written, then `latest` does not fit
    checkpoint.atomic_write_text = latest_on_a_full_disk
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
try:
    checkpoint.save(Engine(), ckpt_dir, 20, 320, 1, (0, 0), eval(identity), keep=2)
    print("saved")
except checkpoint.CheckpointError as e:
    print(f"CheckpointError: {e}")
except dist.DistError as e:
    print(f"DistError: {e}")
finally:
    dist.destroy_process_group()
leave(0)  # no interpreter teardown, where finished ranks have aborted (training.accelerator.leave)
"""


def _on_ranks(script: str, world: int, argv) -> list[str]:
    """`script` in `world` processes, rank r with the arguments `argv(r, port)`; what each printed (every rank
    must exit 0)."""
    port = str(free_port())
    root = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen([sys.executable, "-c", script, *argv(rank, port)], cwd=root, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(root)})
             for rank in range(world)]
    outputs = communicate_all(procs, timeout=120)
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-2000:]
    return [out for out, _ in outputs]


def _save_on_two_ranks(ckpt_dir: Path, fault: str) -> list[str]:
    """SAVE_ON_A_RANK on ranks 0 and 1; what each printed."""
    return _on_ranks(SAVE_ON_A_RANK, 2, lambda rank, port: [str(rank), str(ckpt_dir), port,
                                                            repr(_state(20)["identity"]), fault])


def test_a_rank_that_cannot_read_back_the_tag_fails_the_save_on_every_rank(tmp_path):
    """Rank 1's read-back error travels to rank 0, which keeps 'latest' and raises it on both ranks
    (raised on rank 1 alone, it would leave rank 0 waiting in the gather)."""
    _save(tmp_path, 10)
    for out in _save_on_two_ranks(tmp_path, "read"):
        assert re.fullmatch(r"CheckpointError: rank 1 could not read back .*step00000020: \[Errno 5\] Input/output "
                            r"error; 'latest' was left at the previous checkpoint\n", out), out
    assert read_latest(tmp_path) == "step00000010"


def test_a_rank_whose_write_fails_fails_the_save_on_every_rank(tmp_path):
    """DeepSpeed's save_checkpoint raised on rank 1 alone (torch.save on a full disk), while rank 0 waited
    in the barrier it ends with: rank 1 died with a traceback and rank 0 with gloo's "Connection closed by
    peer" (or, where a dead peer goes unnoticed, at the process group's timeout). Now rank 1 joins that
    barrier, and both raise rank 1's error, naming the tag, the cause, the free space and the fix; the
    unfinished tag is removed and 'latest' is kept."""
    _save(tmp_path, 10)
    for out in _save_on_two_ranks(tmp_path, "write"):
        assert re.fullmatch(rf"CheckpointError: rank 1 could not write checkpoint {re.escape(str(tmp_path))}/"
                            r"step00000020 \(RuntimeError: .* unexpected pos 4416 vs 4308; [0-9.]+ MiB free there\)\. "
                            r"'latest' was left as it was; if the disk is full, free space there \(.*\) and rerun "
                            r"the same command: it resumes from step00000010\n", out), out
    assert read_latest(tmp_path) == "step00000010" and not (tmp_path / "step00000020").exists()


def _rank_0_disk_full(ckpt_dir):
    """What both ranks raise when rank 0's write of step 20 finds the disk full, with step 10 committed."""
    return (rf"CheckpointError: rank 0 could not write checkpoint {re.escape(str(ckpt_dir))}/"
            r"step00000020 \(OSError: \[Errno 28\] No space left on device; [0-9.]+ MiB free there\)\. "
            r"'latest' was left as it was; .* it resumes from step00000010\n")


def test_rank_0_failing_to_make_room_fails_the_save_on_every_rank(tmp_path):
    """make_room's error on rank 0 is raised on both ranks (raised on rank 0 alone, it left rank 1 waiting)."""
    _save(tmp_path, 10)
    for out in _save_on_two_ranks(tmp_path, "room"):
        assert re.fullmatch(_rank_0_disk_full(tmp_path), out), out
    assert read_latest(tmp_path) == "step00000010"


def test_a_full_disk_after_the_manifest_keeps_the_tag_for_the_rerun_to_commit(tmp_path):
    """run_state.json was written and `latest` did not fit: the tag is complete, so it is kept (marked
    commit_pending) rather than removed as unfinished, and the rerun's `recover` commits it."""
    _save(tmp_path, 10)
    for out in _save_on_two_ranks(tmp_path, "latest"):
        assert re.fullmatch(_rank_0_disk_full(tmp_path), out), out
    assert read_latest(tmp_path) == "step00000010"
    assert (tmp_path / "step00000020" / RUN_STATE).is_file() and (tmp_path / "step00000020" / COMMIT_PENDING).exists()
    assert recover(tmp_path) == "step00000020" and read_latest(tmp_path) == "step00000020"


def test_a_backend_error_during_the_save_is_not_reported_as_a_write_failure(tmp_path):
    """dist.DistError (NCCL and the other backends' errors) propagates as it is: no barrier is entered for it
    and it is not called a full disk."""
    _save(tmp_path, 10)
    for out in _save_on_two_ranks(tmp_path, "gone"):
        assert out == "DistError: peer gone\n", out


CONVERT_ON_A_FULL_DISK = """
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from training import checkpoint
from training.accelerator import leave
from training.atomic import atomic_write_text

rank, ckpt_dir, port = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
tmp = ckpt_dir / ".step00000010_universal.tmp"


def convert_until_the_disk_is_full(cmd, **kwargs):  # ds_to_universal, stopped by a full disk
    (tmp / "zero").mkdir(parents=True)
    (tmp / "zero" / "part").write_bytes(b"x" * 1000)
    return subprocess.CompletedProcess(cmd, 1, "", "OSError: [Errno 28] No space left on device")


def full_while_the_partial_conversion_is_there(path, text):
    if tmp.exists():
        raise OSError(28, "No space left on device")
    return atomic_write_text(path, text)


if rank == 0:
    checkpoint.subprocess.run = convert_until_the_disk_is_full
    checkpoint.atomic_write_text = full_while_the_partial_conversion_is_there
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
try:
    checkpoint.universal_tag(ckpt_dir, "step00000010", poll_seconds=0.05)
    print("converted")
except checkpoint.CheckpointError as e:
    print(f"CheckpointError: {e}")
finally:
    dist.destroy_process_group()
leave(0)  # no interpreter teardown, where finished ranks have aborted (training.accelerator.leave)
"""


def test_a_conversion_stopped_by_a_full_disk_fails_every_rank_and_gives_the_space_back(tmp_path):
    """The universal conversion filled the disk, so rank 0 could not write the mark that tells the other
    ranks (which wait on the file system, not in a collective) that it failed: rank 0 died with an OSError
    and the others waited for good (on one node the launcher killed them), the partial conversion still
    holding the space. Now it is removed first, and every rank raises the conversion's error."""
    _save(tmp_path, 10)
    root = Path(__file__).resolve().parents[1]
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", CONVERT_ON_A_FULL_DISK, str(rank), str(tmp_path), port],
                              cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(root)}) for rank in (0, 1)]
    outputs = communicate_all(procs, timeout=60)
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-2000:]
        assert out.startswith(f"CheckpointError: converting {tmp_path / 'step00000010'} to a universal checkpoint "
                              "failed"), out
        assert "No space left on device" in out and out.rstrip().endswith(
            "if the disk is full, free space there and rerun the same command)"), out
    assert not (tmp_path / ".step00000010_universal.tmp").exists()

def test_saved_files_reach_the_disk_before_latest_names_them(tmp_path, monkeypatch):
    """A power cut after `latest` names a tag must find the tag's files and manifest on disk: every file is
    fsynced when it is described, run_state.json and `latest` before their rename, their directory after it."""
    tag_dir = _fake_deepspeed_tag(tmp_path, 10)
    names = sorted(p.name for p in tag_dir.iterdir())
    events = record_fsyncs(monkeypatch)
    files = describe_files(tag_dir, names)
    assert events == [("fsync", str(tag_dir / name)) for name in names]
    events.clear()
    commit(tmp_path, tag_for(10), _state(10), 2, files)
    # a temporary file (.<name>.<pid>.<12 hex>.tmp) stands for the file it becomes
    written = [(kind, re.sub(r"/\.([^/]+)\.\d+\.[0-9a-f]{12}\.tmp$", r"/\1 (temporary)", path))
               for kind, path in events]
    run_state, latest = str(tag_dir / RUN_STATE), str(tmp_path / LATEST)
    assert written == [("fsync", f"{run_state} (temporary)"), ("replace", run_state), ("fsync", str(tag_dir)),
                       ("fsync", f"{latest} (temporary)"), ("replace", latest), ("fsync", str(tmp_path))]


def test_a_copy_and_a_replaced_directory_reach_the_disk_before_their_names(tmp_path, monkeypatch):
    """The run's vocab.txt (atomic_copy) and an export or TensorBoard directory (replace_dir): a power cut must
    not leave a name standing for bytes that were never written."""
    from training.atomic import atomic_copy, replace_dir

    (tmp_path / "shards").mkdir()
    source = tmp_path / "shards" / "vocab.txt"
    source.write_text("[PAD]\n[UNK]\n")
    (tmp_path / ".vocab.txt.999.0123456789ab.tmp").write_text("[PAD]\n[UN")  # a killed copy's: left alone here
    new, old = tmp_path / ".hf.tmp", tmp_path / "hf"
    (new / "sub").mkdir(parents=True)
    (new / "config.json").write_text("{}")
    (new / "sub" / "x").write_text("x")
    old.mkdir()
    (old / "config.json").write_text('{"old": 1}')
    events = record_fsyncs(monkeypatch)
    copied = atomic_copy(source, tmp_path / "vocab.txt")
    replace_dir(new, old)
    temporary = [(kind, re.sub(r"/\.([^/]+)\.\d+\.[0-9a-f]{12}\.tmp$", r"/\1 (temporary)", path)) for kind, path in events]
    assert temporary[:3] == [("fsync", f"{copied} (temporary)"), ("replace", str(copied)), ("fsync", str(tmp_path))]
    assert sorted(temporary[3:7]) == sorted([("fsync", str(new / "config.json")), ("fsync", str(new / "sub" / "x")),
                                             ("fsync", str(new)), ("fsync", str(new / "sub"))])
    trash = str(tmp_path / ".hf.old")
    assert temporary[7:] == [("replace", trash), ("replace", str(old)), ("fsync", str(tmp_path))]
    assert copied.read_text() == "[PAD]\n[UNK]\n" and (old / "sub" / "x").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".vocab.txt.999.0123456789ab.tmp", "hf", "shards",
                                                          "vocab.txt"]


def test_a_directory_swap_killed_after_both_renames_is_finished_by_the_next(tmp_path):
    """Killed after its second rename, a swap leaves the new directory in place and the old one in .<name>.old:
    the next swap removes that first (a rename onto a non-empty directory fails)."""
    from training.atomic import replace_dir

    old, trash = tmp_path / "hf", tmp_path / ".hf.old"
    for directory, text in ((old, "second"), (trash, "first")):
        directory.mkdir()
        (directory / "config.json").write_text(text)
    new = tmp_path / ".hf.tmp"
    new.mkdir()
    (new / "config.json").write_text("third")
    replace_dir(new, old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"] and (old / "config.json").read_text() == "third"


INIT_FROM_A_RUN = """
import sys
from pathlib import Path

import torch.distributed as dist

from modeling import BertForPreTraining
from tests.test_modeling import small_config
from training.accelerator import leave
from training.checkpoint import CheckpointError
from training.weights import load_initial_weights

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=0, world_size=1)
try:
    load_initial_weights(BertForPreTraining(small_config()), Path(sys.argv[1]))
except CheckpointError as e:
    print(e)
dist.destroy_process_group()
leave(0)
"""


def test_phase2_from_a_run_whose_checkpoint_is_damaged_at_its_size_is_refused_as_damaged(tmp_path):
    """--init_checkpoint <a phase-1 run> checks the CRC of every file of its tag, as a resume does: a changed
    byte is named as damage, not left to whatever reading the file makes of it."""
    from tests.test_modeling import small_config

    run = tmp_path / "run"
    _save(run / "checkpoints", 10)
    small_config().to_json_file(run / "model_config.json")
    states = run / "checkpoints" / "step00000010" / "mp_rank_00_model_states.pt"
    states.write_bytes(b"m" * 109 + b"x")  # same size
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", INIT_FROM_A_RUN, str(run), str(free_port())], cwd=root,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"{states}: CRC-32 differs from the one saved: the checkpoint is corrupt"), \
        proc.stdout


def test_the_architecture_fields_are_every_field_but_dropout_init_and_padding():
    """What an override or a phase-1 config is compared on: every field that changes the function of the
    weights (a config with other heads loads the same tensors into another model)."""
    import dataclasses

    from modeling import BertConfig
    from training.weights import ARCHITECTURE

    fields = {f.name for f in dataclasses.fields(BertConfig)}
    assert set(ARCHITECTURE) == fields - {"hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range",
                                          "pad_vocab_size_multiple"}


def test_a_file_system_that_refuses_to_fsync_a_directory_is_not_an_error(tmp_path, monkeypatch):
    """Some refuse it with EINVAL (PostgreSQL allows that too); since the data stages flush their directories,
    such a file system would have failed every stage. Any other error is raised."""
    import errno
    import stat

    from training.atomic import atomic_write_text, fsync_dir

    fsync = os.fsync

    def refusing(fd, error=errno.EINVAL):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(error, os.strerror(error))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", refusing)
    assert atomic_write_text(tmp_path / "run_info.json", "{}\n").read_text() == "{}\n"
    monkeypatch.setattr(os, "fsync", lambda fd: refusing(fd, errno.EIO))
    with pytest.raises(OSError, match="Input/output error"):
        fsync_dir(tmp_path)


def test_small_files_are_replaced_whole_and_get_the_users_umask(tmp_path):
    from training.atomic import atomic_write_text

    path = atomic_write_text(tmp_path / "sub" / "run_info.json", "{}\n")
    umask = os.umask(0o022)
    try:
        atomic_write_text(path, '{"a": 1}\n')  # not mkstemp's 0600: other users of a cluster read run files
        assert path.stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(umask)
    with pytest.raises(TypeError):
        atomic_write_text(path, None)  # fails mid-write: the old content stays, no temporary file is left
    assert path.read_text() == '{"a": 1}\n'
    assert [p.name for p in path.parent.iterdir()] == ["run_info.json"]


def test_a_small_file_that_does_not_fit_names_itself_and_keeps_the_old_content(tmp_path):
    """Writes past 2000 bytes fail with EFBIG (RLIMIT_FSIZE), as on a full disk, whose error names no file."""
    import errno
    import resource

    script = ("import sys; from pathlib import Path; from training.atomic import atomic_write_text\n"
              "try:\n    atomic_write_text(Path(sys.argv[1]), 'x' * 5000)\n"
              "except OSError as e:\n    print(type(e).__name__, e.errno, e.filename)\n")
    path = tmp_path / "run_info.json"
    path.write_text("{}\n")
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", script, str(path)], cwd=root, capture_output=True, text=True,
                            timeout=60, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000)))
    assert result.stdout == f"OSError {errno.EFBIG} {path}\n", result.stderr[-2000:]
    assert path.read_text() == "{}\n" and [p.name for p in tmp_path.iterdir()] == ["run_info.json"]

def test_stale_temporaries_are_removed_and_nothing_else(tmp_path):
    from training.atomic import remove_stale_temporaries

    path = tmp_path / "run_info.json"
    path.write_text("{}\n")
    for name in (".run_info.json.123.0123456789ab.tmp", ".run_info.json.swp", ".run_info.json.bak.tmp.keep",
                 ".other.json.123.0123456789ab.tmp"):
        (tmp_path / name).write_text("x")
    remove_stale_temporaries(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.json.123.0123456789ab.tmp",
                                                         ".run_info.json.bak.tmp.keep", ".run_info.json.swp",
                                                         "run_info.json"]


def test_a_gap_in_the_optimizer_partitions_is_an_incomplete_checkpoint(tmp_path):
    tag = tmp_path / "step00000010"
    tag.mkdir()
    torch.save({"module": {"w": torch.zeros(2)}, "param_shapes": [{"w": torch.Size([2])}]},
               tag / "mp_rank_00_model_states.pt")
    for rank in (0, 2):  # rank 1's partition is missing
        (tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"step00000010: partitions of ranks \[0, 2\] are present, not 0\.\.2; "
                                              r"the checkpoint is incomplete"):
        weights.read_fp32_weights(tag)


def test_init_weights_from_a_hugging_face_directory(tmp_path):
    """--phase2 --init_checkpoint <an HF BERT directory>: continued pretraining from published weights."""
    import modeling
    from tests.test_modeling import small_config

    torch.manual_seed(1)
    source = modeling.BertForPreTraining(small_config(pre_layer_norm=True))
    modeling.save_hf(source, tmp_path / "hf")  # as transformers' MegatronBertForPreTraining
    torch.manual_seed(2)
    model = modeling.BertForPreTraining(small_config(pre_layer_norm=True))
    assert weights.load_initial_weights(model, tmp_path / "hf") == f"{tmp_path / 'hf'} (Hugging Face)"
    for (name, a), b in zip(source.state_dict().items(), model.state_dict().values()):
        real = a[:1001] if a.shape[0] == 1008 else a  # padded vocab rows are not exported
        assert torch.equal(real, b[:len(real)]), name
    other = modeling.BertForPreTraining(small_config(num_hidden_layers=2))
    with pytest.raises(CheckpointError, match=r"hf/config.json: not the model of --config_file \(num_hidden_layers 3 "
                                              r"there, 2 in --config_file; pre_layer_norm True there, False in"):
        weights.load_initial_weights(other, tmp_path / "hf")
    # A checkpoint labelled BertForMaskedLM that has the NSP weights too (as bert-base-uncased is) keeps them.
    nsp_source = modeling.BertForPreTraining(small_config())
    modeling.save_hf(nsp_source, tmp_path / "labelled_mlm")
    hf_config = json.loads((tmp_path / "labelled_mlm" / "config.json").read_text())
    (tmp_path / "labelled_mlm" / "config.json").write_text(json.dumps(hf_config | {"architectures": ["BertForMaskedLM"]}))
    nsp_model = modeling.BertForPreTraining(small_config())
    weights.load_initial_weights(nsp_model, tmp_path / "labelled_mlm")
    assert torch.equal(nsp_model.cls.seq_relationship.weight, nsp_source.cls.seq_relationship.weight)
    # A bare encoder has no MLM head: refused, not loaded with random heads.
    modeling.to_hf_model(source).bert.save_pretrained(tmp_path / "encoder_only")
    with pytest.raises(CheckpointError, match=r"encoder_only: the checkpoint has no weights for cls\.predictions"):
        weights.load_initial_weights(model, tmp_path / "encoder_only")
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(CheckpointError, match="cannot load it as a Hugging Face BERT"):
        weights.load_initial_weights(model, tmp_path / "hf")


def test_init_weights_from_a_hugging_face_directory_with_another_vocab_is_refused(tmp_path):
    """A published BERT or an export of ours (vocab.txt), or a directory with only tokenizer.json (exports before
    vocab.txt was added, some hub models), whose tokens are not the shards':
    same vocab_size, so the config check passes, but every embedding would be trained on another token's text
    (data.prepare trains a 30522-token vocab unless given bert-base-uncased's)."""
    import modeling
    from tests.test_modeling import small_config

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = [f"w{i}" for i in range(1001 - len(specials))]
    hf_vocab, shards_vocab = tmp_path / "hf_vocab.txt", tmp_path / "shards_vocab.txt"
    hf_vocab.write_text("\n".join(specials + words) + "\n")
    shards_vocab.write_text("\n".join(specials + words[::-1]) + "\n")  # the same tokens, other ids
    modeling.save_hf(modeling.BertForPreTraining(small_config()), tmp_path / "hf", vocab_file=hf_vocab)
    model = modeling.BertForPreTraining(small_config())
    with pytest.raises(CheckpointError, match=r"hf: its vocabulary \(vocab.txt, 1001 tokens\) is not the shards' "
                                              r".*shards_vocab.txt \(1001 tokens\): token id 5 is 'w0' there"):
        weights.load_initial_weights(model, tmp_path / "hf", shards_vocab)
    (tmp_path / "hf" / "vocab.txt").unlink()
    with pytest.raises(CheckpointError, match=r"hf: its vocabulary \(tokenizer.json, 1001 tokens\) is not the "
                                              r"shards' .*shards_vocab.txt \(1001 tokens\): token id 5 is 'w0' "
                                              r"there, 'w995' in the shards"):
        weights.load_initial_weights(model, tmp_path / "hf", shards_vocab)
    tokenizer = tmp_path / "hf" / "tokenizer.json"
    whole = tokenizer.read_bytes()
    for damaged, reason in ((b'{"model": ', r"not a tokenizer.json \(Expecting value: line 1 column 11"),
                            (b"[1, 2]", r"not a tokenizer.json \(a JSON object\)")):
        tokenizer.write_bytes(damaged)  # was a JSONDecodeError / AttributeError traceback
        with pytest.raises(CheckpointError, match=rf"{re.escape(str(tokenizer))}: {reason}.*put the model's vocab.txt "
                                                  "beside it"):
            weights.load_initial_weights(model, tmp_path / "hf", shards_vocab)
    tokenizer.write_bytes(whole)
    (tmp_path / "hf" / "vocab.txt").write_text(shards_vocab.read_text().replace("w995", "x995"))  # as published
    with pytest.raises(CheckpointError, match=r"vocab.txt, 1001 tokens.*token id 5 is 'x995' there, 'w995'"):
        weights.load_initial_weights(model, tmp_path / "hf", shards_vocab)
    (tmp_path / "hf" / "vocab.txt").unlink()
    assert weights.load_initial_weights(model, tmp_path / "hf", hf_vocab) == f"{tmp_path / 'hf'} (Hugging Face)"


def test_init_weights_from_a_run_with_another_vocab_is_refused(tmp_path):
    """--phase2 --init_checkpoint <a phase-1 run> whose shards had another vocab of the same size: the run's copy
    of its vocab.txt is compared with the phase-2 shards' before any weight is read."""
    import modeling
    from tests.test_modeling import small_config

    run = tmp_path / "run"
    _save(run / "checkpoints", 10)
    small_config().to_json_file(run / "model_config.json")
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(996)]
    (run / "vocab.txt").write_text("\n".join(tokens) + "\n")
    shards_vocab = tmp_path / "vocab.txt"
    shards_vocab.write_text("\n".join(tokens[:5] + tokens[:4:-1]) + "\n")
    with pytest.raises(CheckpointError, match=r"run: its vocabulary \(vocab.txt, 1001 tokens\) is not the shards' "
                                              r".*token id 5 is 'w0' there, 'w995' in the shards"):
        weights.load_initial_weights(modeling.BertForPreTraining(small_config()), run, shards_vocab)


def test_a_vocab_that_extends_another_differs_where_the_shorter_ends():
    """Tokens appended to a vocabulary (words added to bert-base's) leave every shared id the same: the first
    difference is the first id only one of them has, not id 0."""
    base = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "w0"]
    assert weights.vocab_difference(base + ["w1"], base) == ("7 tokens, against 6",
                                                             "token id 6 is 'w1' there, absent here")
    assert weights.vocab_difference(base, base + ["w1"]) == ("6 tokens, against 7",
                                                             "token id 6 is absent there, 'w1' here")
    assert weights.vocab_difference(base, list(base)) is None


def test_init_weights_trained_on_text_of_another_case_are_refused(tmp_path):
    """Phase 2 on shards whose text was lower-cased differently from the text --init_checkpoint was trained on:
    the run's tokenization.json, or a Hugging Face tokenizer's do_lower_case, against the shards' lower_case."""
    import modeling
    from tests.test_modeling import small_config

    run = tmp_path / "run"
    _save(run / "checkpoints", 10)
    small_config().to_json_file(run / "model_config.json")
    (run / "tokenization.json").write_text('{"lower_case": true}\n')
    model = modeling.BertForPreTraining(small_config())
    with pytest.raises(CheckpointError, match=rf"--init_checkpoint {run} was trained on lower-cased text "
                                              r"\(tokenization.json: lower_case true\) but the shards hold text that "
                                              "kept its case .*; make the shards without data.prepare --no_lower_case"):
        weights.load_initial_weights(model, run, lower_case=False)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(996)]) + "\n")
    modeling.save_hf(modeling.BertForPreTraining(small_config()), tmp_path / "hf", vocab_file=vocab, lower_case=False)
    with pytest.raises(CheckpointError, match=r"hf was trained on text that kept its case \(tokenizer_config.json: "
                                              r"do_lower_case false\) but the shards hold lower-cased text .*; make the "
                                              "shards with data.prepare --no_lower_case"):
        weights.load_initial_weights(model, tmp_path / "hf", vocab, lower_case=True)
    # The same case, or shards that do not say (NVIDIA's), pass.
    assert weights.load_initial_weights(model, tmp_path / "hf", vocab, lower_case=False).endswith("(Hugging Face)")
    assert weights.load_initial_weights(model, tmp_path / "hf", vocab, lower_case=None).endswith("(Hugging Face)")
    # A record that cannot be read is not taken for one that does not say (the check was skipped in silence).
    for content, why in (('{"lower_case": tr', r"not JSON \(Expecting value: line 1 column 16 \(char 15\)\)"),
                         ("[true]", "not a JSON object")):
        (run / "tokenization.json").write_text(content)
        with pytest.raises(CheckpointError, match=rf"^--init_checkpoint {run}: tokenization.json is {why}; it says "
                                                  "whether the text the checkpoint was trained on was lower-cased"):
            weights.load_initial_weights(model, run, lower_case=True)


def test_init_weights_from_a_run_of_another_model_name_the_fields(tmp_path):
    """--phase2 --init_checkpoint <a phase-1 run> trained with another model config: its model_config.json is
    compared field by field before the weights are read (it was load_state_dict's line per tensor)."""
    import modeling
    from tests.test_modeling import small_config

    _save(tmp_path / "checkpoints", 10)
    small_config(num_hidden_layers=2, hidden_size=32).to_json_file(tmp_path / "model_config.json")
    with pytest.raises(CheckpointError) as error:
        weights.load_initial_weights(modeling.BertForPreTraining(small_config()), tmp_path)
    assert str(error.value) == (f"{tmp_path / 'model_config.json'}: the phase-1 run trained another model than "
                                "--config_file (hidden_size 32 there, 64 in --config_file; num_hidden_layers 2 there, "
                                "3 in --config_file); pass that run's model config as --config_file")


def test_a_phase1_model_config_saved_before_layer_norm_large_model_existed_is_accepted(tmp_path):
    """A model_config.json without the field (written before it existed) is the post-LN model it trained."""
    import modeling
    from tests.test_modeling import small_config

    _save(tmp_path / "checkpoints", 10)
    old = {k: v for k, v in small_config().to_dict().items() if k != "layer_norm_large_model"}
    (tmp_path / "model_config.json").write_text(json.dumps(old))
    weights._check_phase1_config(tmp_path / "model_config.json", modeling.BertForPreTraining(small_config()))
    with pytest.raises(CheckpointError) as error:
        weights.load_initial_weights(modeling.BertForPreTraining(small_config(layer_norm_large_model=True)), tmp_path)
    assert str(error.value) == (f"{tmp_path / 'model_config.json'}: the phase-1 run trained another model than "
                                "--config_file (layer_norm_large_model False there, True in --config_file); pass that "
                                "run's model config as --config_file")


def test_a_hugging_face_directory_is_refused_for_layer_norm_large_model(tmp_path):
    """Its tensors would load (post-LN names) into another function: refused, naming the field and why."""
    import modeling
    from tests.test_modeling import small_config

    modeling.save_hf(modeling.BertForPreTraining(small_config()), tmp_path / "hf")
    with pytest.raises(CheckpointError, match=re.escape(
            f"--init_checkpoint {tmp_path / 'hf'} is a Hugging Face model directory, but --config_file: field "
            "'layer_norm_large_model' is true (Habana deepspeed-bert's pre-LN block), which no transformers model "
            "computes: ") + r".*another function of the same weights\. Start this model from a run of ours"):
        weights.load_initial_weights(modeling.BertForPreTraining(small_config(layer_norm_large_model=True)),
                                     tmp_path / "hf")
    weights.load_initial_weights(modeling.BertForPreTraining(small_config()), tmp_path / "hf")


def test_export_checks_every_files_crc_not_only_its_size(tmp_path):
    from scripts.export_hf import ExportError, check_complete, locate

    _save(tmp_path / "checkpoints", 10)
    check_complete(locate(tmp_path))
    path = tmp_path / "checkpoints" / "step00000010" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    path.write_bytes(b"o" * 20 + b"x" + b"o" * 29)  # same size
    with pytest.raises(ExportError, match=rf"{path}: CRC-32 differs from the one saved: the checkpoint is corrupt.*"
                                          "or export another tag with --tag"):
        check_complete(locate(tmp_path))


def test_a_load_that_fails_after_the_checksums_passed_is_not_called_corrupt(tmp_path):
    class Engine:  # DeepSpeed refusing weights of another shape, as after a model config change
        def load_checkpoint(self, load_dir, tag, load_module_only):
            raise RuntimeError("Error(s) in loading state_dict: size mismatch for bert.pooler.dense.weight")

    with pytest.raises(CheckpointError) as error:
        checkpoint.load(Engine(), tmp_path, "step00000010")
    message = str(error.value)
    assert message.startswith(f"{tmp_path / 'step00000010'}: DeepSpeed cannot load the checkpoint (RuntimeError: ")
    assert "passed their size and CRC-32 checks, so this is rarely damage: resume with the DeepSpeed version, " \
           "DeepSpeed JSON and model config it was saved with" in message and "corrupt" not in message


def test_a_prune_that_fails_after_the_commit_is_a_warning_and_the_save_stands(tmp_path, monkeypatch, capsys):
    """The commit had moved `latest` when pruning failed; the error then said "'latest' was left as it was" and
    named the new tag to resume from. The save stands, with a warning, and the next save prunes again."""
    for step in (10, 20):
        _save(tmp_path, step, keep=1)
    real_rmtree = shutil.rmtree

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(shutil, "rmtree", refuse)
    state = _save(tmp_path, 30, keep=1)
    assert state.step == 30 and read_latest(tmp_path) == "step00000030"
    assert complete_tags(tmp_path) == ["step00000020", "step00000030"]
    assert re.search(r"warning: \S+step00000030 is saved and 'latest' names it, but removing older checkpoints "
                     r"failed \(\[Errno 13\] Permission denied: '\S+step00000020'\)", capsys.readouterr().err)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    _save(tmp_path, 40, keep=1)
    assert complete_tags(tmp_path) == ["step00000040"]


def test_phase1_moments_are_refused_where_they_cannot_be_read(tmp_path):
    """--init_optimizer_moments is refused before any weight is read: a directory that is not a run of this
    project (a Hugging Face export holds no optimizer state), a run without checkpoints, a run that trained
    with another optimizer (LANS moments are of normalised gradients), partitions that are not DeepSpeed's."""
    from training.moments import open_phase1_moments

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "ckpt_7038.pt").write_bytes(b"NVIDIA's phase 1")
    for source in (tmp_path / "hf", tmp_path / "ckpt_7038.pt"):
        with pytest.raises(CheckpointError, match=re.escape(
                "--init_optimizer_moments reads phase 1's optimizer moments from a run of this project (its "
                f"--output_dir, with checkpoints/ in it); {source} is not one. A Hugging Face directory holds no "
                "optimizer state, and that of NVIDIA's or Habana's ckpt_<step>.pt or Habana's DeepSpeed folder is "
                "not read. Drop --init_optimizer_moments (scripts/launch.sh: --set init_optimizer_moments=false): "
                "the moments then start at zero")):
            open_phase1_moments(source, "lamb")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=f"^--init_optimizer_moments: no checkpoint under {run / 'checkpoints'}$"):
        open_phase1_moments(run, "lamb")
    _save(run / "checkpoints", 10)  # trained with lamb; its files are DeepSpeed's names, not its contents
    with pytest.raises(CheckpointError, match=re.escape(
            f"--init_optimizer_moments: {run / 'checkpoints' / 'step00000010'} was trained with --optimizer lamb, "
            "whose moments are not those of --optimizer lans. Pass --optimizer lamb, or drop "
            "--init_optimizer_moments")):
        open_phase1_moments(run, "lans")
    with pytest.raises(CheckpointError, match=r"step00000010: cannot read its optimizer moments \(.*\); the "
                                              r"checkpoint is damaged or was not written by this project$"):
        open_phase1_moments(run, "lamb")


def test_a_rank_reads_its_fragment_of_a_moment_across_phase1_ranks_pieces(tmp_path):
    """Phase 1's ranks each hold a piece of a parameter; a phase-2 rank's fragment may span them."""
    from training.moments import Phase1Moments

    values = torch.arange(10.0)
    moments = Phase1Moments(tmp_path, {"exp_avg": {"w": [values[:4], values[4:]]}, "exp_avg_sq": {}},
                            {"w": torch.Size([2, 5])})
    for start, numel in [(0, 10), (0, 4), (4, 6), (3, 2), (5, 3), (9, 1)]:
        assert torch.equal(moments.fragment("exp_avg", "w", start, numel), values[start:start + numel])
    with pytest.raises(CheckpointError, match=r": parameter w is in no rank's partition; the checkpoint is incomplete"):
        moments.fragment("exp_avg_sq", "w", 0, 10)
    short = Phase1Moments(tmp_path, {"exp_avg": {"w": [values[:4]]}}, {"w": torch.Size([2, 5])})
    with pytest.raises(CheckpointError, match=r"parameter w has 4 exp_avg values in the partitions but shape \(2, 5\); "
                                              r"the checkpoint is inconsistent"):
        short.fragment("exp_avg", "w", 0, 4)


REUSE_A_UNIVERSAL_COPY = """
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from training import checkpoint
from training.accelerator import leave

ckpt_dir, port = Path(sys.argv[1]), sys.argv[2]
conversions = []


def convert(cmd, **kwargs):  # what ds_to_universal writes, the same bytes every time
    out = Path(cmd[cmd.index("--output_folder") + 1])
    (out / "zero" / "bert.pooler.dense.weight").mkdir(parents=True)
    (out / "zero" / "bert.pooler.dense.weight" / "fp32.pt").write_bytes(b"w" * 64)
    (out / checkpoint.MODEL_STATES).write_bytes(b"m" * 32)
    conversions.append(out)
    return subprocess.CompletedProcess(cmd, 0, "", "")


checkpoint.subprocess.run = convert
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
weight = ckpt_dir / "step00000010_universal" / "zero" / "bert.pooler.dense.weight" / "fp32.pt"
try:
    for damage in (None, None, b"w" * 63 + b"x", b"w" * 10, "manifest"):
        if damage == "manifest":  # a copy made before copies had one
            (ckpt_dir / "step00000010_universal" / checkpoint.UNIVERSAL_MANIFEST).unlink()
        elif damage is not None:
            weight.write_bytes(damage)
        assert checkpoint.universal_tag(ckpt_dir, "step00000010", poll_seconds=0.05) == "step00000010_universal"
        print(len(conversions), weight.read_bytes() == b"w" * 64)
finally:
    dist.destroy_process_group()
leave(0)
"""


def test_a_universal_copy_is_reused_only_if_its_files_check_out(tmp_path):
    """A universal copy left by an earlier resume was reused after comparing only its copy of run_state.json:
    a weight file of it altered in place trained on without a word (loss 11.04 where the run had 10.58)."""
    _save(tmp_path, 10)
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", REUSE_A_UNIVERSAL_COPY, str(tmp_path), str(free_port())], cwd=root,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    # converted, reused, converted again after a changed byte, after a truncation, and without a manifest
    assert proc.stdout.splitlines() == ["1 True", "1 True", "2 True", "3 True", "4 True"]
    universal = tmp_path / "step00000010_universal"
    assert proc.stderr.count(f"warning: {universal} does not check out (") == 3
    assert f"{universal / 'zero' / 'bert.pooler.dense.weight' / 'fp32.pt'} differs from the size or CRC-32" in proc.stderr
    manifest = json.loads((universal / checkpoint.UNIVERSAL_MANIFEST).read_text())
    assert manifest == {"mp_rank_00_model_states.pt": {"size": 32, "crc32": zlib.crc32(b"m" * 32)},
                        "zero/bert.pooler.dense.weight/fp32.pt": {"size": 64, "crc32": zlib.crc32(b"w" * 64)}}


VERIFY_ON_A_RANK = """
import sys
from pathlib import Path

import torch.distributed as dist

from training import checkpoint
from training.accelerator import leave

ckpt_dir, port, rank, world = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
state = checkpoint.read_state(ckpt_dir / "step00000010")
for module_only in (True, False):
    try:
        checkpoint.verify_checksums(ckpt_dir, "step00000010", state, module_only=module_only)
        print("ok")
    except checkpoint.CheckpointError as e:
        print(e)
dist.destroy_process_group()
leave(0)
"""


def test_a_rerun_that_loads_only_the_weights_reads_only_their_file(tmp_path):
    """A finished run rerun on another world size loads the module weights alone, yet read every optimizer
    partition for its CRC (about 3x the model for nothing). A changed byte in a partition is not its concern;
    in the weights' file it is."""
    _save(tmp_path, 10)
    partition = tmp_path / "step00000010" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    partition.write_bytes(b"o" * 49 + b"x")  # same size
    assert _verify_on_ranks(tmp_path, 1) == [["ok", f"{partition}: CRC-32 differs from the one saved: the checkpoint "
                                                   f"is corrupt. Point {tmp_path / LATEST} at an older tag"]]
    (tmp_path / "step00000010" / "mp_rank_00_model_states.pt").write_bytes(b"m" * 109 + b"x")
    assert _verify_on_ranks(tmp_path, 1)[0][0].startswith(
        f"{tmp_path / 'step00000010' / 'mp_rank_00_model_states.pt'}: CRC-32 differs")


def _verify_on_ranks(ckpt_dir: Path, world: int) -> list[list[str]]:
    """VERIFY_ON_A_RANK on `world` ranks; the lines each printed."""
    outputs = _on_ranks(VERIFY_ON_A_RANK, world, lambda rank, port: [str(ckpt_dir), port, str(rank), str(world)])
    return [out.splitlines() for out in outputs]


def test_two_ranks_check_the_crc_of_every_file_between_them(tmp_path):
    """The ranks share the CRC checks: whichever rank a changed file falls to, every rank fails with its name."""
    _save(tmp_path, 10)
    tag_dir = tmp_path / "step00000010"
    for path in sorted(tag_dir.glob("*.pt")):
        good = path.read_bytes()
        path.write_bytes(good[:-1] + b"x")  # same size
        error = f"{path}: CRC-32 differs from the one saved: the checkpoint is corrupt. Point {tmp_path / LATEST} at " \
                "an older tag"
        expected = "ok" if path.name != "mp_rank_00_model_states.pt" else error  # module_only reads the weights only
        assert _verify_on_ranks(tmp_path, 2) == [[expected, error]] * 2, path.name
        path.write_bytes(good)
    assert _verify_on_ranks(tmp_path, 2) == [["ok", "ok"]] * 2
