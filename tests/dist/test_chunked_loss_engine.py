"""`--loss-chunks` in the engine: FSDP2 over 2 processes with the chunked head loss gives the plain run's losses
within 1e-4 relative over 6 steps (only the summation order of the head's gradient differs), and it is refused
with --tp and --pp."""

import pytest
from dist_helpers import EXACT, assert_same_losses, run_train, run_trains, seed_checkpoint, step_losses

pytestmark = pytest.mark.dist


def test_chunked_loss_trains_like_whole_logits(tmp_path):
    init = seed_checkpoint("tiny-moe", tmp_path / "init")
    common = [*EXACT, "--steps", "6", "--init-from", str(init), "--nproc", "2"]
    run_trains([([*common, "--metrics-jsonl", "plain.jsonl"], tmp_path),
                ([*common, "--loss-chunks", "4", "--metrics-jsonl", "chunked.jsonl"], tmp_path)])
    assert_same_losses(step_losses(tmp_path / "chunked.jsonl"), step_losses(tmp_path / "plain.jsonl"), 1e-4)


def test_chunked_loss_is_refused_with_tp(tmp_path):
    r = run_train(*EXACT, "--steps", "1", "--nproc", "2", "--tp", "2", "--loss-chunks", "4", cwd=tmp_path,
                  check=False)
    assert r.returncode == 2 and "--loss-chunks works without --tp" in r.stderr and "Traceback" not in r.stderr
