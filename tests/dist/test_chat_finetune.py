"""Fine-tuning on chat data through `paraseek train` (gloo, fp32, real processes): conversations packed into
document-masked windows, the loss on assistant tokens only, and validation on an --eval-split carve-out.

One process with 4 accumulated micro-batches is the reference; FSDP2 over 2, HSDP 2 x 2 and tp = 2 (sequence
parallel) x pp = 2 (1F1B) each give its training losses and its validation losses within 1e-4 relative: the same
trained-token sums divided by the same global count of trained tokens, only reduction orders differ. Every run starts
from the same fresh initialization (models/init.py draws each tensor whole, whatever the layout). The validation loss
appears at the asked steps, in the console and in the JSONL."""

import json

import pytest
from chat_corpus import chat_corpus
from dist_helpers import EXACT, assert_same_losses, run_train, step_losses

pytestmark = pytest.mark.dist

FLAGS = ["--model", "tiny-dense", "--data", "chat.jsonl", "--tokenizer", "tok", "--seq-len", "64", "--micro-batch-size", "2", "--steps", "4",
         "--eval-split", "0.1", "--eval-every", "2", "--metrics-jsonl", "m.jsonl"]
PLANS = {
    "fsdp2": ["--nproc", "2", "--dp-shard", "2"],
    "hsdp2x2": ["--nproc", "4", "--dp-replicate", "2", "--dp-shard", "2"],
    "tp2-sp-x-pp2-1f1b": ["--nproc", "4", "--dp-shard", "1", "--tp", "2", "--pp", "2", "--pp-schedule", "1F1B"],
}


def eval_losses(jsonl) -> dict[int, float]:
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    return {r["step"]: r["eval_loss"] for r in rows if r.get("event") == "eval"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    chat_corpus(root)
    r = run_train(*EXACT, *FLAGS, "--nproc", "1", cwd=root)
    return root, r, step_losses(root / "m.jsonl"), eval_losses(root / "m.jsonl")


def test_validation_loss_at_the_asked_steps(reference):
    root, r, losses, evals = reference
    assert "data: chat.jsonl: 48 conversations" in r.stdout and "packed, attention masked to each document" in r.stdout
    assert "loss on assistant" in r.stdout and "evaluation: 5 windows held out of --data" in r.stdout
    assert sorted(evals) == [2, 4] and sorted(losses) == [1, 2, 3, 4]
    lines = [line for line in r.stdout.splitlines() if line.startswith("eval ")]
    assert [line.split("|")[0].split()[1] for line in lines] == ["2/4", "4/4"]
    assert all(f"loss {evals[s]:.4f}" in line for s, line in zip((2, 4), lines))
    assert evals[4] < evals[2]  # and it learns


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_plan_matches_single_process(plan, reference, tmp_path):
    root, _, ref_losses, ref_evals = reference
    for name in ("tok", "chat.jsonl"):
        (tmp_path / name).symlink_to(root / name)
    run_train(*EXACT, *FLAGS, *PLANS[plan], cwd=tmp_path)
    assert_same_losses(step_losses(tmp_path / "m.jsonl"), ref_losses, rtol=1e-4)
    assert_same_losses(eval_losses(tmp_path / "m.jsonl"), ref_evals, rtol=1e-4)
