"""From a fresh random initialization (no --init-from) every plan starts from the single process's weights: each
tensor is drawn from its own generator seeded by (--seed, its name) and each rank keeps its part (models/init.py).
So FSDP2, HSDP, TP, PP and EP give the single-process losses from step 1 on, within the plan tests' 1e-4 relative
(test_data_parallel.py, which start every plan from one saved checkpoint instead)."""

import pytest
from dist_helpers import EXACT, assert_same_losses, run_trains, step_losses

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
def trained(tmp_path_factory):
    """Every plan's losses, and one process's with the plans' micro-batch (2 sequences: the same matmul shapes) per
    model, all trained in one batch (dist_helpers.run_trains: processes start slowly): {(model, plan or "one"):
    losses}."""
    runs = {(model, "one"): ["--nproc", "1"] for model in sorted({m for m, _ in PLANS})} | PLANS
    folders = {key: tmp_path_factory.mktemp(f"{key[0]}-{key[1]}") for key in runs}
    results = run_trains([([*EXACT, *STEPS, "--model", key[0], *flags, "--micro-batch-size", "2",
                            "--metrics-jsonl", "m.jsonl"], folders[key]) for key, flags in runs.items()], check=False)
    out = {}
    for key, r in zip(runs, results, strict=True):
        assert r.returncode == 0 or key[1] != "one", (key, r.stdout[-3000:], r.stderr[-3000:])
        out[key] = (r, step_losses(folders[key] / "m.jsonl") if r.returncode == 0 else None)
    return out


@pytest.mark.parametrize("model,plan", sorted(PLANS), ids=[f"{m}-{p}" for m, p in sorted(PLANS)])
def test_fresh_init_gives_the_single_process_losses(model, plan, trained):
    r, got = trained[model, plan]
    assert r.returncode == 0, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    assert_same_losses(got, trained[model, "one"][1], rtol=1e-4)
