"""The run configuration: TOML + flags (flags win), defaults from the machine, validation messages."""

import argparse

import pytest

from paraseek.errors import UserError
from paraseek.train.config import TrainConfig, resolve_defaults
from paraseek.train.flags import add_arguments, did_you_mean, from_namespace
from paraseek.train.validate import validate
from paraseek.train.optim import lr_at


def parse(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return from_namespace(p.parse_args(list(argv)))


def test_toml_then_flags(tmp_path):
    (tmp_path / "run.toml").write_text('model = "tiny-dense"\nsteps = 7\ndp-shard = 2\nactivation_checkpointing = "full"\n'
                                       "reshard_after_forward = false\n")
    cfg = parse("--config", str(tmp_path / "run.toml"), "--steps", "9")
    assert (cfg.model, cfg.steps, cfg.dp_shard, cfg.activation_checkpointing) == ("tiny-dense", 9, 2, "full")
    assert cfg.reshard_after_forward is False
    assert parse("--reshard-after-forward", "false").reshard_after_forward is False


def test_unknown_toml_key(tmp_path):
    (tmp_path / "run.toml").write_text("stepz = 3\n")
    with pytest.raises(UserError, match="unknown key 'stepz'"):
        parse("--config", str(tmp_path / "run.toml"))


def test_defaults_fill_the_world_and_check_the_batch():
    cfg = resolve_defaults(TrainConfig(nproc=4, dp_replicate=2, global_batch_size=8, micro_batch_size=2, seq_len=64),
                           False, 0)
    assert (cfg.device, cfg.precision, cfg.dp_shard, cfg.grad_accum_steps) == ("cpu", "fp32", 2, 1)
    validate(cfg, False, 0)
    with pytest.raises(UserError, match="not divisible by micro-batch 2 x data-parallel size 4 = 8"):
        validate(TrainConfig(**{**cfg.__dict__, "global_batch_size": 12}), False, 0)
    with pytest.raises(UserError, match="no CUDA device"):
        validate(TrainConfig(**{**cfg.__dict__, "device": "cuda"}), False, 0)


def test_lr_schedules():
    cfg = TrainConfig(lr=1.0, warmup_steps=10, steps=110, min_lr_ratio=0.1, lr_schedule="cosine")
    assert lr_at(cfg, 5) == pytest.approx(0.5)
    assert lr_at(cfg, 10) == pytest.approx(1.0)
    assert lr_at(cfg, 60) == pytest.approx(0.55)  # half-way down the cosine
    assert lr_at(cfg, 110) == pytest.approx(0.1)
    assert lr_at(TrainConfig(**{**cfg.__dict__, "lr_schedule": "linear"}), 60) == pytest.approx(0.55)
    assert lr_at(TrainConfig(**{**cfg.__dict__, "lr_schedule": "constant"}), 100) == 1.0


TRAIN_NAMES = [f for f in TrainConfig.__dataclass_fields__]


@pytest.mark.parametrize("word, meant", [
    # other tools' names and spellings: by meaning, where the closest spelling is another field
    ("sequence_len", "seq_len"), ("--sequence-length", "seq_len"), ("max_seq_len", "seq_len"),
    ("max_sequence_length", "seq_len"), ("seq-length", "seq_len"), ("--batch-size", "global_batch_size"),
    ("lr-warmup", "warmup_steps"), ("num_warmup_steps", "warmup_steps"), ("warmup_iters", "warmup_steps"),
    ("train_iters", "steps"), ("--max-steps", "steps"), ("num_gpus", "nproc"), ("tensor_parallel_size", "tp"),
    ("ckpt_dir", "checkpoint_dir"), ("checkpoint_interval", "checkpoint_every"), ("eval_interval", "eval_every"),
    ("learning_rate", "lr"),
    # misspellings: by spelling
    ("stpes", "steps"), ("--seqlen", "seq_len"), ("grad_clipp", "grad_clip"),
])
def test_did_you_mean_by_meaning_and_by_spelling(word, meant):
    assert did_you_mean(word, TRAIN_NAMES) == f" (did you mean {meant}?)"


def test_did_you_mean_picks_the_name_the_command_has():
    assert did_you_mean("--max-seq-len", ["max_model_len", "max_num_seqs", "prompt"]) == \
        " (did you mean max_model_len?)"  # generate's and serve's word for it
    assert did_you_mean("--frobnicate", TRAIN_NAMES) == ""
