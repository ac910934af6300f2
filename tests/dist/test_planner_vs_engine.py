"""The planner's model-state bytes per rank equal what the engine's ranks actually hold (parameters, gradients and
AdamW moments, summed over ranks) for tiny plans run with gloo."""

import json

import pytest
from dist_helpers import EXACT, run_trains

from paraseek.models import ModelArgs, preset_config
from paraseek.planner import Plan, model_state_bytes

pytestmark = pytest.mark.dist


PLANS = [
    ("tiny-moe", 2, 1, 2, 1),   # FSDP2: sharded
    ("tiny-dense", 2, 2, 1, 1),  # DDP: replicated
    ("tiny-moe", 4, 2, 2, 1),   # HSDP: sharded inside, replicated across
    # TP + SP: attention, dense MLP, shared experts and vocabulary split over tp; router and routed experts
    # replicated on every tp rank (not divided by tp), then FSDP2-sharded over dp_shard like everything else
    ("tiny-moe", 2, 1, 1, 2),
    ("tiny-moe", 4, 1, 2, 2),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One step of every plan, trained in one batch (dist_helpers.run_trains: processes start slowly): {plan:
    (folder, result)}."""
    folders = [tmp_path_factory.mktemp("-".join(map(str, plan))) for plan in PLANS]
    results = run_trains([([*EXACT, "--model", model, "--steps", "1", "--nproc", str(nproc), "--dp-replicate",
                            str(dp_replicate), "--dp-shard", str(dp_shard), "--tp", str(tp), "--micro-batch-size", "2",
                            "--metrics-jsonl", "m.jsonl"], folder)
                          for (model, nproc, dp_replicate, dp_shard, tp), folder in zip(PLANS, folders)], check=False)
    return dict(zip(PLANS, zip(folders, results)))


@pytest.mark.parametrize("model,nproc,dp_replicate,dp_shard,tp", PLANS)
def test_model_state_bytes_match_the_run(model, nproc, dp_replicate, dp_shard, tp, runs):
    folder, r = runs[model, nproc, dp_replicate, dp_shard, tp]
    assert r.returncode == 0, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    rows = [json.loads(line) for line in (folder / "m.jsonl").read_text().splitlines()]
    measured = next(r for r in rows if r.get("event") == "model_state")
    args = ModelArgs.from_hf_config(preset_config(model))
    predicted = model_state_bytes(args, Plan(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp))
    for key in ("params", "grads", "optimizer"):
        # the planner gives the mean per rank; FSDP2's uneven dim-0 chunks make ranks differ slightly
        assert sum(measured[key]) == pytest.approx(predicted[key] * nproc, rel=0, abs=0), key
