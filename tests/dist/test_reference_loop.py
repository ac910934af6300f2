"""The engine against an independent plain-torch training loop: one model, torch.optim.AdamW, F.cross_entropy and
torch's clip_grad_norm_ on the same batches, about 30 lines that share nothing with the engine but the model code and
the data. One process and FSDP2 over 2 must give its losses within 1e-4 relative, so that a bug common to 1 and N
processes (the loss normalization, the optimizer's settings, the clip, the order of update and schedule) cannot hide
behind the plan tests, which compare the engine with itself."""

import pytest
from dist_helpers import EXACT, assert_same_losses, plain_torch_losses, run_train, seed_checkpoint, step_losses

pytestmark = pytest.mark.dist
STEPS = 5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")
    init = seed_checkpoint("tiny-dense", root / "init")
    return init, plain_torch_losses(init, STEPS)


@pytest.mark.parametrize("plan", [["--nproc", "1"], ["--nproc", "2", "--dp-shard", "2"]], ids=["one", "fsdp2"])
def test_engine_equals_a_plain_torch_loop(plan, reference, tmp_path):
    init, ref = reference
    run_train(*EXACT, "--model", "tiny-dense", "--steps", str(STEPS), "--init-from", str(init), "--micro-batch-size",
              "2", *plan, "--metrics-jsonl", "m.jsonl", cwd=tmp_path)
    assert_same_losses(step_losses(tmp_path / "m.jsonl"), ref, rtol=1e-4)
    assert ref[STEPS] < ref[1]
