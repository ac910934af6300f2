"""Loss equivalence of every plan with one process (gloo, fp32, same seed checkpoint and data): FSDP2 over 4,
HSDP 2x2, DDP over 2, FSDP with gradient accumulation, full and selective activation checkpointing, tensor parallel
(with and without sequence parallel, and x FSDP2), expert parallel (x FSDP2 and x HSDP).
Tolerance 1e-4 relative: the same math, only the order of the gradient reductions differs."""

import pytest
from dist_helpers import EXACT, assert_same_losses, run_train, seed_checkpoint, step_losses

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


_REFERENCES: dict[str, tuple] = {}  # model -> (init, ref_for): shared by the plan and the expert-parallel tests


def _references(model: str, tmp_path_factory):
    """Single-process runs (1 rank, gradient accumulation over the whole global batch), one per micro-batch size:
    the same micro-batch shapes keep fp32 matmul blocking identical, so that MoE routing cannot flip on a 1e-7
    difference and the comparison isolates the data-parallel plan. Computed once per model and micro-batch size
    for the module (tiny-moe's serve both test functions: the same seed checkpoint, flags and data)."""
    if model in _REFERENCES:
        return _REFERENCES[model]
    root = tmp_path_factory.mktemp(model)
    init = seed_checkpoint(model, root / "init")
    refs: dict[str, dict[int, float]] = {}

    def ref_for(micro_batch: str) -> dict[int, float]:
        if micro_batch not in refs:
            run_train(*EXACT, *STEPS, "--init-from", str(init), "--nproc", "1", "--micro-batch-size", micro_batch,
                      "--metrics-jsonl", f"ref{micro_batch}.jsonl", cwd=root)
            refs[micro_batch] = step_losses(root / f"ref{micro_batch}.jsonl")
        return refs[micro_batch]

    _REFERENCES[model] = init, ref_for
    return _REFERENCES[model]


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-moe"])
def reference(request, tmp_path_factory):
    return _references(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    return _references("tiny-moe", tmp_path_factory)


def _check_plan(flags, references, tmp_path):
    init, ref_for = references
    ref = ref_for(flags[flags.index("--micro-batch-size") + 1])
    run_train(*EXACT, *STEPS, "--init-from", str(init), *flags, "--metrics-jsonl", "m.jsonl", cwd=tmp_path)
    got = step_losses(tmp_path / "m.jsonl")
    assert_same_losses(got, ref, rtol=1e-4)
    assert ref[6] < ref[1]  # and it trains


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_plan_matches_single_process(plan, reference, tmp_path):
    _check_plan(PLANS[plan], reference, tmp_path)


@pytest.mark.parametrize("plan", sorted(EP_PLANS))
def test_expert_parallel_plan_matches_single_process(plan, moe_reference, tmp_path):
    """Tokens cross ranks through two all-to-alls and each expert sees them in source order, so the math is the
    single process's; only reduction orders differ."""
    _check_plan(EP_PLANS[plan], moe_reference, tmp_path)
