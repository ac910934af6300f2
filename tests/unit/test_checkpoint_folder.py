"""The checkpoint folder's rules on real DCP folders (written in this process, no process group): which step
--resume takes past each kind of damage, what is refused before a worker starts (one line, exit code 2), the resume
command a stopped run prints, and the lr schedule a resume keeps."""

import json
import warnings
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from paraseek.cli import main
from paraseek.errors import UserError
from paraseek.models import build_model, resolve_model
from paraseek.train.checkpoint import latest_checkpoint, prepare_checkpoint_dir
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
