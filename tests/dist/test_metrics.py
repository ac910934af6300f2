"""Per-step metrics: the JSONL schema of docs/design.md and TensorBoard scalars, read back with tensorboard's own
reader."""

import json

import pytest
from dist_helpers import EXACT, run_train

pytestmark = pytest.mark.dist
SCHEMA = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "mem_peak_gib", "step_time_s",
          "gc_s"}


def test_jsonl_and_tensorboard(tmp_path):
    r = run_train(*EXACT, "--model", "tiny-dense", "--steps", "3", "--nproc", "2", "--micro-batch-size", "2",
                  "--metrics-jsonl", "m.jsonl", "--tensorboard", "tb", cwd=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [row["event"] for row in rows if "event" in row] == ["model_state"]  # where each rank's state lives
    rows = [row for row in rows if "event" not in row]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert SCHEMA <= set(row)
        assert row["tokens_per_s"] == pytest.approx(8 * 32 / row["step_time_s"])
        assert row["tokens_per_s_per_gpu"] == pytest.approx(row["tokens_per_s"] / 2)
        assert row["mfu"] is None  # no datasheet peak for a CPU
        assert 0 <= row["gc_s"] < row["step_time_s"] + 5  # collector seconds since the last step (step 1: startup too)
    assert "step     3/3" in r.stdout and "done: 3 steps" in r.stdout

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    loss = [e.value for e in acc.Scalars("train/loss")]
    assert loss == pytest.approx([row["loss"] for row in rows])
    assert len(acc.Scalars("train/tokens_per_s_per_gpu")) == 3
