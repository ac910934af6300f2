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
from dist_helpers import EXACT, assert_same_losses, run_trains, step_losses

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
    """The one-process run (its folder, the command's result, its losses and validation losses) and every plan's
    run (its folder and result), trained in one batch (dist_helpers.run_trains: processes start slowly)."""
    root = tmp_path_factory.mktemp("chat")
    chat_corpus(root)
    folders = {plan: tmp_path_factory.mktemp(plan) for plan in PLANS}
    for folder in folders.values():
        for name in ("tok", "chat.jsonl"):
            (folder / name).symlink_to(root / name)
    r, *results = run_trains([([*EXACT, *FLAGS, "--nproc", "1"], root)]
                             + [([*EXACT, *FLAGS, *flags], folders[plan]) for plan, flags in PLANS.items()],
                             check=False)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return (root, r, step_losses(root / "m.jsonl"), eval_losses(root / "m.jsonl"),
            {plan: (folders[plan], res) for plan, res in zip(PLANS, results, strict=True)})


def test_validation_loss_at_the_asked_steps(reference):
    root, r, losses, evals, _ = reference
    assert "data: chat.jsonl: 48 conversations" in r.stdout and "packed, attention masked to each document" in r.stdout
    assert "loss on assistant" in r.stdout and "evaluation: 5 windows held out of --data" in r.stdout
    assert sorted(evals) == [2, 4] and sorted(losses) == [1, 2, 3, 4]
    lines = [line for line in r.stdout.splitlines() if line.startswith("eval ")]
    assert [line.split("|")[0].split()[1] for line in lines] == ["2/4", "4/4"]
    assert all(f"loss {evals[s]:.4f}" in line for s, line in zip((2, 4), lines))
    assert evals[4] < evals[2]  # and it learns


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_plan_matches_single_process(plan, reference):
    _, _, ref_losses, ref_evals, runs = reference
    folder, r = runs[plan]
    assert r.returncode == 0, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    assert_same_losses(step_losses(folder / "m.jsonl"), ref_losses, rtol=1e-4)
    assert_same_losses(eval_losses(folder / "m.jsonl"), ref_evals, rtol=1e-4)
