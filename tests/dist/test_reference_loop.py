"""The engine against an independent plain-torch training loop: one model, torch.optim.AdamW, F.cross_entropy and
torch's clip_grad_norm_ on the same batches, about 30 lines that share nothing with the engine but the model code and
the data. One process and FSDP2 over 2 must give its losses within 1e-4 relative, so that a bug common to 1 and N
processes (the loss normalization, the optimizer's settings, the clip, the order of update and schedule) cannot hide
behind the plan tests, which compare the engine with itself."""

import pytest
import torch
import torch.nn.functional as F
from dist_helpers import EXACT, assert_same_losses, run_train, seed_checkpoint, step_losses

from paraseek.models import load_pretrained
from paraseek.train.data import open_dataset

pytestmark = pytest.mark.dist
STEPS, GLOBAL_BATCH, SEQ, LR = 5, 8, 32, 0.01  # EXACT's batch, sequence and constant learning rate


def plain_torch_losses(folder) -> dict[int, float]:
    model = load_pretrained(folder, dtype=torch.float32)
    # The engine's documented settings: AdamW(0.9, 0.95), eps 1e-8, weight decay 0.1, global-norm clip 1.0.
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    data = open_dataset("synthetic", seq_len=SEQ, vocab_size=model.args.vocab_size, seed=0)
    losses = {}
    for step in range(1, STEPS + 1):
        batch = torch.stack([data.sequence(i) for i in range((step - 1) * GLOBAL_BATCH, step * GLOBAL_BATCH)])
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())  # the mean over the global batch
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses[step] = loss.item()
    return losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")
    init = seed_checkpoint("tiny-dense", root / "init")
    return init, plain_torch_losses(init)


@pytest.mark.parametrize("plan", [["--nproc", "1"], ["--nproc", "2", "--dp-shard", "2"]], ids=["one", "fsdp2"])
def test_engine_equals_a_plain_torch_loop(plan, reference, tmp_path):
    init, ref = reference
    run_train(*EXACT, "--model", "tiny-dense", "--steps", str(STEPS), "--init-from", str(init), "--micro-batch-size",
              "2", *plan, "--metrics-jsonl", "m.jsonl", cwd=tmp_path)
    assert_same_losses(step_losses(tmp_path / "m.jsonl"), ref, rtol=1e-4)
    assert ref[STEPS] < ref[1]
