"""Loss equivalence of every plan with one process (gloo, fp32, same seed checkpoint and data): FSDP2 over 4,
HSDP 2x2, DDP over 2, FSDP with gradient accumulation, full and selective activation checkpointing, tensor parallel
(with and without sequence parallel, and x FSDP2), expert parallel (x FSDP2 and x HSDP).
Tolerance 1e-4 relative: the same math, only the order of the gradient reductions differs."""

import pytest
from dist_helpers import EXACT, assert_same_losses, run_trains, seed_checkpoint, step_losses

pytestmark = pytest.mark.dist

PLANS = {
    "fsdp4": ["--nproc", "4", "--dp-shard", "4", "--micro-batch-size", "2"],
    "hsdp2x2": ["--nproc", "4", "--dp-replicate", "2", "--dp-shard", "2", "--micro-batch-size", "2"],
    "ddp2": ["--nproc", "2", "--dp-replicate", "2", "--dp-shard", "1", "--micro-batch-size", "2"],
    "fsdp2-accum4": ["--nproc", "2", "--dp-shard", "2", "--micro-batch-size", "1"],
    "fsdp2-ac-full": ["--nproc", "2", "--dp-shard", "2", "--micro-batch-size", "2", "--activation-checkpointing", "full"],
    "fsdp2-ac-selective": ["--nproc", "2", "--dp-shard", "2", "--micro-batch-size", "2",
                           "--activation-checkpointing", "selective"],
}
# Tensor parallelism (with and without sequence parallelism) and its product with FSDP2. The vocab-parallel loss
# and the tp reductions change summation orders only.
PLANS.update({
    "tp2-sp": ["--nproc", "2", "--dp-shard", "1", "--tp", "2", "--micro-batch-size", "2"],
    "tp2-no-sp": ["--nproc", "2", "--dp-shard", "1", "--tp", "2", "--sequence-parallel", "false",
                  "--micro-batch-size", "2"],
    "fsdp2-x-tp2": ["--nproc", "4", "--dp-shard", "2", "--tp", "2", "--micro-batch-size", "2"],
})
# Expert parallelism (tiny-moe only): routed experts sharded over ep ranks of dp_shard, all-to-all dispatch.
EP_PLANS = {
    "fsdp2-ep2": ["--nproc", "2", "--dp-shard", "2", "--ep", "2", "--micro-batch-size", "2"],
    "fsdp4-ep4": ["--nproc", "4", "--dp-shard", "4", "--ep", "4", "--micro-batch-size", "2"],
    "hsdp2x2-ep2": ["--nproc", "4", "--dp-replicate", "2", "--dp-shard", "2", "--ep", "2", "--micro-batch-size", "2"],
}
STEPS = ["--steps", "6"]
MODELS = ["tiny-dense", "tiny-moe"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[tuple, tuple]:
    """Every plan of the module on both models, and the single-process references (1 rank, gradient accumulation
    over the whole global batch), one per micro-batch size: the same micro-batch shapes keep fp32 matmul blocking
    identical, so that MoE routing cannot flip on a 1e-7 difference and the comparison isolates the data-parallel
    plan. All trained in one batch of `paraseek train` commands (dist_helpers.run_trains: processes start slowly);
    {(model, plan) or (model, "ref", micro_batch): (the command's result, its losses)}."""
    keys, runs = [], []
    for model in MODELS:
        root = tmp_path_factory.mktemp(model)
        init = seed_checkpoint(model, root / "init")
        plans = {**PLANS, **(EP_PLANS if model == "tiny-moe" else {})}
        for mb in sorted({flags[flags.index("--micro-batch-size") + 1] for flags in plans.values()}):
            keys.append((model, "ref", mb))
            runs.append(([*EXACT, *STEPS, "--init-from", str(init), "--nproc", "1", "--micro-batch-size", mb,
                          "--metrics-jsonl", "m.jsonl"], root / f"ref{mb}"))
        for plan, flags in plans.items():
            keys.append((model, plan))
            runs.append(([*EXACT, *STEPS, "--init-from", str(init), *flags, "--metrics-jsonl", "m.jsonl"],
                         root / plan))
    for _, cwd in runs:
        cwd.mkdir()
    results = run_trains(runs, check=False)
    return {key: (r, step_losses(cwd / "m.jsonl") if r.returncode == 0 else None)
            for key, r, (_, cwd) in zip(keys, results, runs, strict=True)}


def _losses(trained, key) -> dict[int, float]:
    r, losses = trained[key]
    assert r.returncode == 0, (key, r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    return losses


def _check_plan(model, plan, flags, trained):
    ref = _losses(trained, (model, "ref", flags[flags.index("--micro-batch-size") + 1]))
    got = _losses(trained, (model, plan))
    assert_same_losses(got, ref, rtol=1e-4)
    assert ref[6] < ref[1]  # and it trains


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("model", MODELS)
def test_plan_matches_single_process(plan, model, trained):
    _check_plan(model, plan, PLANS[plan], trained)


@pytest.mark.parametrize("plan", sorted(EP_PLANS))
def test_expert_parallel_plan_matches_single_process(plan, trained):
    """Tokens cross ranks through two all-to-alls and each expert sees them in source order, so the math is the
    single process's; only reduction orders differ."""
    _check_plan("tiny-moe", plan, EP_PLANS[plan], trained)
