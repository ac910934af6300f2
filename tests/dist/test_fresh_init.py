"""From a fresh random initialization (no --init-from) every plan starts from the single process's weights: each
tensor is drawn from its own generator seeded by (--seed, its name) and each rank keeps its part (models/init.py).
So FSDP2, HSDP, TP, PP and EP give the single-process losses from step 1 on, within the plan tests' 1e-4 relative
(test_data_parallel.py, which start every plan from one saved checkpoint instead)."""

import pytest
from dist_helpers import EXACT, assert_same_losses, run_train, step_losses

pytestmark = pytest.mark.dist

STEPS = ["--steps", "4"]
PLANS = {
    ("tiny-dense", "fsdp2"): ["--nproc", "2", "--dp-shard", "2"],
    ("tiny-dense", "hsdp2x2"): ["--nproc", "4", "--dp-replicate", "2", "--dp-shard", "2"],
    ("tiny-dense", "tp2"): ["--nproc", "2", "--dp-shard", "1", "--tp", "2"],
    ("tiny-dense", "pp2"): ["--nproc", "2", "--pp", "2"],
    ("tiny-moe", "ep2"): ["--nproc", "2", "--dp-shard", "2", "--ep", "2"],
}


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """One process with the plans' micro-batch (2 sequences: the same matmul shapes), per model."""
    refs = {}
    for model in sorted({m for m, _ in PLANS}):
        root = tmp_path_factory.mktemp(model)
        run_train(*EXACT, *STEPS, "--model", model, "--nproc", "1", "--micro-batch-size", "2",
                  "--metrics-jsonl", "ref.jsonl", cwd=root)
        refs[model] = step_losses(root / "ref.jsonl")
    return refs


@pytest.mark.parametrize("model,plan", sorted(PLANS), ids=[f"{m}-{p}" for m, p in sorted(PLANS)])
def test_fresh_init_gives_the_single_process_losses(model, plan, single_process, tmp_path):
    run_train(*EXACT, *STEPS, "--model", model, *PLANS[model, plan], "--micro-batch-size", "2",
              "--metrics-jsonl", "m.jsonl", cwd=tmp_path)
    assert_same_losses(step_losses(tmp_path / "m.jsonl"), single_process[model], rtol=1e-4)
