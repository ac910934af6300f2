"""The checkpoint folder's rules on real DCP folders (written in this process): which step --resume takes past each
kind of damage, what is refused before a worker starts (one line, exit code 2), what a resume with nothing left to
train or no checkpoint to continue says, the resume command a stopped run prints, the lr schedule a resume keeps,
and what a save that fails leaves (the last good checkpoint) and says."""

import errno
import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from paraseek.cli import main
from paraseek.errors import UserError
from paraseek.models import build_model, resolve_model
from paraseek.models.checkpoint_read import latest_checkpoint
from paraseek.train.checkpoint import prepare_checkpoint_dir, save_checkpoint
from paraseek.train.config import TrainConfig
from paraseek.train.optim import lr_at, resumed_schedule, schedule_of
from paraseek.train.stop import ARGV_ENV, resume_command, stop_message

TRAIN = ["train", "--device", "cpu", "--model", "tiny-dense", "--nproc", "2", "--seq-len", "32",
         "--global-batch-size", "8", "--micro-batch-size", "2"]


def _write_step(root, step, model="tiny-dense"):
    """A complete step folder as save_checkpoint writes it: DCP shards and .metadata, then trainer_state.json."""
    args, _, _ = resolve_model(model)
    tensors = {name: torch.zeros(t.shape) for name, t in build_model(args, "meta").state_dict().items()}
    path = root / f"step-{step:06d}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
        dcp.save({"model": tensors, "optim": {}}, checkpoint_id=str(path))
    (path / "trainer_state.json").write_text(json.dumps({"step": step, "config": {"model": model}}))
    (root / "latest").write_text(path.name + "\n")
    return path


def _shapes():
    args, _, _ = resolve_model("tiny-dense")
    return {name: tuple(t.shape) for name, t in build_model(args, "meta").state_dict().items()}


def test_resume_takes_the_newest_complete_step_past_each_kind_of_damage(tmp_path):
    for step in (1, 2, 3, 4, 5, 6):
        _write_step(tmp_path, step)
    shard = next((tmp_path / "step-000006").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # a truncated shard
    (tmp_path / "step-000005" / ".metadata").write_bytes(b"not a pickle")  # a torn index
    (tmp_path / "step-000004" / "trainer_state.json").unlink()  # a save that died before its last file
    (tmp_path / "step-000003" / "trainer_state.json").write_text('{"step": 3')  # cut short
    (tmp_path / "step-000007.tmp").mkdir()  # a save in progress when it was killed
    (tmp_path / "latest").write_text("step-000009\n")  # names a folder that was deleted
    seen = []
    assert latest_checkpoint(tmp_path, seen.append) == tmp_path / "step-000002"
    assert seen[0].startswith(f"{tmp_path}/step-000006: shard {shard.name} is truncated (100 of ")
    assert seen[1:] == [f"{tmp_path}/step-000005: .metadata is not readable (UnpicklingError); skipped",
                        f"{tmp_path}/step-000004: no trainer_state.json; skipped",
                        f"{tmp_path}/step-000003: trainer_state.json is not readable; skipped",
                        f"{tmp_path}/latest names step-000009, which is gone; ignored"]
    (tmp_path / "latest").write_text("\x00\x01junk")
    seen.clear()
    latest_checkpoint(tmp_path, seen.append)
    assert seen[-1] == f"{tmp_path}/latest holds '\\x00\\x01junk', not a step folder's name; ignored"


def _train(argv, capsys, monkeypatch):
    monkeypatch.setenv(ARGV_ENV, "")  # cmd_train sets it for its workers; monkeypatch puts it back
    code = main(TRAIN + argv)
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize("damage, argv, message", [
    ("none", ["--checkpoint-dir", "{ck}"], "--checkpoint-dir {ck} already holds checkpoints (newest step-000002): "
                                           "add --resume to continue from the newest, or --overwrite"),
    ("none", ["--checkpoint-dir", "{ck}", "--resume", "--overwrite"],
     "--resume continues the checkpoints in --checkpoint-dir and --overwrite deletes them: give one of the two"),
    ("all", ["--checkpoint-dir", "{ck}", "--resume"], "--resume: {ck} holds no complete checkpoint ({ck}/step-000002: "
                                                     "no .metadata (DCP's index of the shards); {ck}/step-000001: "),
    ("foreign", ["--checkpoint-dir", "{ck}", "--resume"],
     "--resume: {ck}/step-000002 holds another model (tiny-moe) than tiny-dense: "),
    ("none", ["--keep-last", "-1"], "--keep-last must be >= 0"),
    ("none", ["--overwrite"], "--overwrite replaces the checkpoints of --checkpoint-dir, and none is given"),
])
def test_what_is_refused_before_any_worker_starts(tmp_path, capsys, monkeypatch, damage, argv, message):
    ck = tmp_path / "ck"
    ck.mkdir()
    _write_step(ck, 1)
    _write_step(ck, 2, "tiny-moe" if damage == "foreign" else "tiny-dense")
    if damage == "all":
        for path in ck.glob("step-*"):
            (path / ".metadata").unlink()
    code, err = _train([a.format(ck=ck) for a in argv], capsys, monkeypatch)
    assert code == 2 and err.startswith("paraseek: error: " + message.format(ck=ck)), err
    assert len(err.splitlines()) == 1, err  # (all damaged: why each step was skipped is in the one line)
    assert (ck / "step-000002").is_dir()  # nothing was removed


def test_overwrite_removes_and_a_new_folder_starts_from_step_0(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    _write_step(ck, 1)
    cfg = TrainConfig(model="tiny-dense", checkpoint_dir=str(ck), overwrite=True)
    said = []
    prepare_checkpoint_dir(cfg, _shapes, log=said.append)
    assert said == [f"--overwrite: removed 1 checkpoint(s) from {ck}"] and list(ck.iterdir()) == []
    for folder in (ck, tmp_path / "new"):  # empty, or not there yet: --resume is a start at step 0
        prepare_checkpoint_dir(replace(cfg, checkpoint_dir=str(folder), overwrite=False, resume=True), _shapes)
    _write_step(ck, 3)
    prepare_checkpoint_dir(replace(cfg, overwrite=False, resume=True), _shapes)  # this model's: fine
    with pytest.raises(UserError, match="already holds checkpoints"):
        prepare_checkpoint_dir(replace(cfg, overwrite=False), _shapes)


def test_the_resume_command_and_the_line_without_a_checkpoint_folder(monkeypatch):
    assert resume_command(["train", "--steps", "8", "--overwrite", "--data", "my corpus", "--resume", "false"]) == \
        "paraseek train --steps 8 --data 'my corpus' --resume"
    assert resume_command(["train", "--overwrite=true", "--resume"]) == "paraseek train --resume"
    assert resume_command(["train", "--config", "run.toml"], overwrite=True) == \
        "paraseek train --config run.toml --overwrite false --resume"  # the file may hold overwrite = true
    monkeypatch.setenv(ARGV_ENV, json.dumps(["train", "--checkpoint-dir", "ck"]))
    assert stop_message(15, 7, "ck/step-000007") == ("paraseek: stopped by SIGTERM after step 7, saved ck/step-000007; "
                                                     "resume with: paraseek train --checkpoint-dir ck --resume")
    assert stop_message(2, 7, None) == ("paraseek: stopped by SIGINT after step 7; nothing was saved (no "
                                        "--checkpoint-dir): add --checkpoint-dir DIR to be able to resume a stopped run")


def test_a_resume_keeps_the_original_lr_schedule_unless_reset():
    original = TrainConfig(steps=10, lr=0.01, lr_schedule="cosine", warmup_steps=2)
    state = {"step": 6, "lr_schedule": schedule_of(original)}
    longer = replace(original, steps=20, lr=0.02)
    kept = resumed_schedule(longer, state)
    assert [lr_at(kept, s) for s in range(7, 11)] == [lr_at(original, s) for s in range(7, 11)]
    assert lr_at(kept, 15) == lr_at(kept, 10) == pytest.approx(0.001)  # past the original end: its final value
    assert resumed_schedule(replace(longer, lr_schedule_reset=True), state).steps == 20
    assert resumed_schedule(longer, {"step": 6, "config": schedule_of(original)}).lr == 0.01  # older checkpoints


def test_a_resume_says_where_it_found_no_checkpoint_and_returns_the_step_it_continues_from(tmp_path):
    cfg = TrainConfig(model="tiny-dense", checkpoint_dir=str(tmp_path / "ckpt"), resume=True)
    warned = []
    assert prepare_checkpoint_dir(cfg, _shapes, warn=warned.append) == 0
    assert warned == [f"no checkpoint found in {tmp_path / 'ckpt'} (no such folder yet: it is made); starting from "
                      "step 0 (a run meant to be continued has its checkpoints elsewhere)"]
    (tmp_path / "ckpt").mkdir()
    warned.clear()
    assert prepare_checkpoint_dir(cfg, _shapes, warn=warned.append) == 0 and "(an empty folder)" in warned[0]
    _write_step(tmp_path / "ckpt", 3)
    warned.clear()
    assert prepare_checkpoint_dir(cfg, _shapes, warn=warned.append) == 3 and warned == []


def test_a_resume_with_no_step_left_ends_with_exit_code_0_and_one_line(tmp_path, capsys, monkeypatch):
    from paraseek.train import launch

    ck = tmp_path / "ck"
    ck.mkdir()
    _write_step(ck, 2)
    monkeypatch.setattr(launch, "launch", lambda cfg: pytest.fail("launched with nothing to train"))
    code, err = _train(["--steps", "2", "--checkpoint-dir", str(ck), "--resume"], capsys, monkeypatch)
    assert code == 0 and err == (f"paraseek: --resume: {ck} holds step 2 and --steps is 2: nothing left to train "
                                 f"(raise --steps to train on; `paraseek export {ck} OUT` writes the model)")
    cfg = TrainConfig(model="tiny-dense", steps=2, checkpoint_dir=str(ck), resume=True)
    launch.check_steps(replace(cfg, steps=3), 2)  # one step left
    launch.check_steps(replace(cfg, export_hf=str(tmp_path / "hf")), 2)  # the export is still to be written
    with pytest.raises(UserError, match=r"--profile-steps 1:3: this run trains step 3 \(steps 1-2 before this "
                                        r"--resume\), so that window would never be profiled; give A:B with 3 <= A"):
        launch.check_steps(replace(cfg, steps=3, profile_steps="1:3"), 2)


def test_an_unwritable_checkpoint_folder_stops_the_run_before_step_1_in_one_line(capsys, monkeypatch):
    from paraseek.train import launch

    monkeypatch.setattr(launch, "launch", lambda cfg: pytest.fail("launched"))
    code, err = _train(["--checkpoint-dir", "/proc/paraseek-ck"], capsys, monkeypatch)  # not writable, for root too
    assert code == 2 and err == ("paraseek: error: --checkpoint-dir /proc/paraseek-ck: /proc cannot be written (a "
                                 "virtual file system that takes no new files); give a path this user can write")


@pytest.mark.parametrize("failure, why", [
    (CheckpointException("save", {0: (OSError(errno.ENOSPC, "No space left on device"), None)}),
     "OSError: [Errno 28] No space left on device"),
    (PermissionError(errno.EACCES, "Permission denied"), "PermissionError: [Errno 13] Permission denied"),
])
def test_a_save_that_fails_keeps_the_last_good_checkpoint_and_says_what_failed(tmp_path, monkeypatch, failure, why):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        ck = tmp_path / "ck"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            first = save_checkpoint(ck, 1, model, optimizer, {"data": {"position": 8}})

        def disk_fills(state, checkpoint_id):  # a shard half written, then the failure
            (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half a shard")
            raise failure

        monkeypatch.setattr(dcp, "save", disk_fills)
        with pytest.raises(RuntimeError) as e:
            save_checkpoint(ck, 2, model, optimizer, {"data": {"position": 16}})
    finally:
        dist.destroy_process_group()
    assert str(e.value) == (f"checkpoint step 2 could not be written to {ck} ({why}); the newest complete "
                            f"checkpoint, {first}, is kept")
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-000001"]  # the partial step-000002.tmp is gone
    assert latest_checkpoint(ck) == first and (ck / "latest").read_text() == "step-000001\n"
