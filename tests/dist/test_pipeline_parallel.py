"""Pipeline parallelism through `paraseek train` (gloo, fp32, real processes) against one process.

A 4-layer tiny-moe (V3-shaped: MLA, one dense layer, then shared + routed experts, and an MTP module, which trains
with it by default, on the last stage) starts from one seeded HF folder (routers with std 1, see dist_helpers.seed_checkpoint) and trains 6
steps of 8 sequences at the training issue's exact settings. One process with 8 accumulated micro-batches is the
reference; pp = 2 runs every schedule torch provides (two virtual stages per rank for the interleaved ones: 4
stages), pp = 4 puts one layer on each rank (rank 0 without MoE layers), pp x tp, pp x ep x dp_shard and (no
pipeline) tp x ep run on 4 processes. Each gives the reference losses within 1e-4 relative (the same sums, only the reduction order of the
gradients differs: stages, tp or dp shards) and its gradient norms (see _same_grad_norms). A checkpoint written under tp=2 x pp=2 resumes under dp_shard=4 with
the uninterrupted losses, and an export under pp gathers every stage into one HF folder.
"""

import pytest
import torch
import json

from dist_helpers import (EXACT, assert_same_losses, run_train, run_train_refusals, run_trains, seeded_model,
                          step_losses)

from paraseek.models import load_pretrained, save_pretrained
from paraseek.models.args import ModelArgs, preset_config
from paraseek.models.deepseek import build_model
from paraseek.parallel.dims import SCHEDULES, SINGLE_SCHEDULES

pytestmark = pytest.mark.dist

STEPS = 6
RTOL = 1e-4


# Each test's `paraseek train` plan ((name, plan flags, steps, extra flags) on 2 or 4 processes), trained together
# with the reference in one batch (dist_helpers.run_trains: processes start slowly).
PLANS = [*((f"pp2-{schedule}", ("--nproc", "2", "--pp", "2", "--pp-schedule", schedule, "--pp-virtual-stages",
                                "1" if schedule in SINGLE_SCHEDULES else "2"), STEPS, ()) for schedule in SCHEDULES),
         ("pp4", ("--nproc", "4", "--pp", "4"), STEPS, ()),
         ("pp2-tp2", ("--nproc", "4", "--pp", "2", "--tp", "2"), STEPS, ()),
         ("tp2-ep2", ("--nproc", "4", "--tp", "2", "--ep", "2"), STEPS, ()),
         ("pp2-ep2-dp2", ("--nproc", "4", "--pp", "2", "--dp-shard", "2", "--ep", "2",
                          "--pp-schedule", "Interleaved1F1B"), STEPS, ()),
         # the first leg of the checkpoint test: 3 steps under tp=2 x pp=2, saved
         ("tp2-pp2-saved", ("--nproc", "4", "--pp", "2", "--tp", "2"), 3, ("--checkpoint-dir", "ck")),
         # the export test's two runs: under pp, and on one process
         ("export-pp2", ("--nproc", "2", "--pp", "2"), 2, ("--export-hf", "out")),
         ("export-one", ("--nproc", "1"), 2, ("--export-hf", "out"))]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The seeded init folder, and the reference's and every plan's run: (init, ref losses, ref rows,
    {name: (folder, the command's result)})."""
    root = tmp_path_factory.mktemp("pp")
    config = {**preset_config("tiny-moe"), "num_hidden_layers": 4}
    main = seeded_model(ModelArgs.from_hf_config(config))
    # The same main weights plus an MTP module: drawing it first would move every later draw, and a new draw can
    # put a token's top-k choice on a near-tie that a 1e-7 reduction-order difference flips.
    model = build_model(ModelArgs.from_hf_config({**config, "num_nextn_predict_layers": 1}), "cpu", torch.float32)
    missing, unexpected = model.load_state_dict(main.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("mtp.") for k in missing)
    save_pretrained(model, root / "init")
    folders = {name: root / name for name, *_ in PLANS}
    for folder in folders.values():
        folder.mkdir()
    results = run_trains([([*EXACT, "--steps", str(STEPS), "--init-from", str(root / "init"), "--nproc", "1",
                            "--metrics-jsonl", "ref.jsonl"], root)]
                         + [([*EXACT, "--steps", str(steps), "--init-from", str(root / "init"), *plan,
                              "--metrics-jsonl", "m.jsonl", *extra], folders[name])
                            for name, plan, steps, extra in PLANS], check=False)
    _succeeded(results[0])
    return (root / "init", step_losses(root / "ref.jsonl"), _steps(root / "ref.jsonl"),
            {name: (folders[name], r) for (name, *_), r in zip(PLANS, results[1:], strict=True)})


def _succeeded(r):
    assert r.returncode == 0, f"paraseek train failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _steps(jsonl) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, jsonl.read_text().splitlines()) if "event" not in r}


def _run(reference, name: str):
    """The plan's folder, the command's result and its losses."""
    folder, r = reference[3][name]
    return folder, _succeeded(r), step_losses(folder / "m.jsonl")


def _same_grad_norms(cwd, ref_rows, jsonl: str = "m.jsonl") -> None:
    """The global gradient norm of step 1 (squared norms summed over the stages) within 1e-5: the same weights, only
    the reduction order differs. Later norms are compared through the losses only: AdamW turns 1e-7 differences of
    near-zero gradient elements into weight differences of up to lr, which a norm in a loss spike amplifies to 1e-3."""
    got, ref = _steps(cwd / jsonl)[1]["grad_norm"], ref_rows[1]["grad_norm"]
    assert abs(got - ref) <= 1e-5 * ref, (got, ref)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_each_schedule_equals_single_process(reference, schedule):
    _, ref, ref_rows, _ = reference
    v = "1" if schedule in SINGLE_SCHEDULES else "2"
    folder, r, got = _run(reference, f"pp2-{schedule}")
    assert f"pp=2 {schedule}" in r.stdout
    # The split it balanced is printed: 2 or 4 stages, the last with the head.
    n_stages = 2 * int(v)
    assert f"pipeline: {n_stages} stages on 2 ranks" in r.stdout
    assert f"stage {n_stages - 1} (pp rank" in r.stdout and "norm + head + loss" in r.stdout
    assert_same_losses(got, ref, RTOL)
    _same_grad_norms(folder, ref_rows)


def test_pp4_one_layer_per_rank_equals_single_process(reference):
    _, ref, ref_rows, _ = reference
    folder, r, got = _run(reference, "pp4")
    assert "stage 0 (pp rank 0): embedding, layer 0:" in r.stdout  # the dense layer: a rank without MoE layers
    assert_same_losses(got, ref, RTOL)
    _same_grad_norms(folder, ref_rows)


def test_pp2_tp2_equals_single_process(reference):
    _, ref, ref_rows, _ = reference
    folder, _, got = _run(reference, "pp2-tp2")
    assert_same_losses(got, ref, RTOL)
    _same_grad_norms(folder, ref_rows)


def test_tp2_ep2_equals_single_process(reference):
    # Not a pipeline, but the same reference: experts sharded over ep ranks of dp_shard, each tp rank routing its
    # own T / tp tokens through them (their grads summed over tp).
    _, ref, ref_rows, _ = reference
    folder, _, got = _run(reference, "tp2-ep2")
    assert_same_losses(got, ref, RTOL)
    _same_grad_norms(folder, ref_rows)


def test_pp2_ep2_dp_shard2_equals_single_process(reference):
    _, ref, ref_rows, _ = reference
    folder, _, got = _run(reference, "pp2-ep2-dp2")
    assert_same_losses(got, ref, RTOL)
    _same_grad_norms(folder, ref_rows)
    # Expert-load telemetry covers every stage's MoE layers (3 of the 4 main layers, then the MTP module's, on the
    # last stage) at every step, and at step 1 (the same weights: the same tokens go to the same experts) matches the
    # single process's within one token. Later steps differ by more: AdamW's update of a ~1e-8 gradient element
    # depends on the reduction order, so the weights part by up to lr in such elements and near-ties move (by step 6
    # the MTP layer's max/mean read 2.67 against 2.84, with the losses still within 1e-4).
    rows = _steps(folder / "m.jsonl")
    assert sorted(rows) == sorted(ref_rows)
    for step, row in rows.items():
        assert len(row["expert_load_max_over_mean_per_layer"]) == 4, (step, row)
    first, ref_first = rows[1], ref_rows[1]
    assert first["expert_load_max_over_mean_per_layer"] == pytest.approx(
        ref_first["expert_load_max_over_mean_per_layer"], abs=1.5 / 64)  # a token moves max/mean by 1/64 here
    assert abs(first["expert_tokens_max"] - ref_first["expert_tokens_max"]) <= 1


def test_checkpoint_tp2_pp2_resumes_under_dp_shard4(reference):
    init, ref, _, _ = reference
    folder, _, _ = _run(reference, "tp2-pp2-saved")  # 3 steps under tp=2 x pp=2, checkpoint in ck
    # the second leg through `paraseek train` itself, one launch
    r = run_train(*EXACT, "--steps", str(STEPS), "--init-from", str(init), "--nproc", "4", "--dp-shard", "4",
                  "--metrics-jsonl", "b.jsonl", "--checkpoint-dir", "ck", "--resume", cwd=folder)
    assert "resumed from ck/step-000003 at step 3" in r.stdout
    assert_same_losses(step_losses(folder / "b.jsonl"), {s: ref[s] for s in range(4, STEPS + 1)}, RTOL)


def test_export_under_pp_has_every_stage(reference):
    init, _, _, _ = reference
    folder, _, _ = _run(reference, "export-pp2")
    exported = load_pretrained(folder / "out", dtype=torch.float32)
    trained_on_one, _, _ = _run(reference, "export-one")
    ref = load_pretrained(trained_on_one / "out", dtype=torch.float32)
    got_sd, ref_sd = exported.state_dict(), ref.state_dict()
    assert sorted(got_sd) == sorted(ref_sd)
    init_sd = load_pretrained(init, dtype=torch.float32).state_dict()
    # Per tensor, the difference measured against the training's own change, |got - ref| / |ref - init| in the
    # Frobenius norm: a tensor from the wrong stage or an untrained one is off by about 1 or more. Not against |ref|,
    # and not elementwise: AdamW's update is g / (|g| + 1e-8), so an element whose gradient is ~1e-8 (an expert or
    # an embedding row with few tokens) moves by a fraction of lr that the gradients' reduction order decides; on
    # different CPUs that reached 1.7e-3 of |ref| for the embedding.
    for name, t in ref_sd.items():
        change = (t - init_sd[name]).norm()
        if change == 0:  # a tensor no step moves (a zero routing bias without load balancing)
            assert torch.equal(got_sd[name], t), name
            continue
        rel = ((got_sd[name] - t).norm() / change).item()
        assert rel < 0.1, (name, rel)


def test_bad_pipeline_plans_fail_in_one_line(tmp_path):
    cases = [(("--pp", "2", "--pp-schedule", "Bogus"), "--pp-schedule must be one of"),
             (("--pp", "2", "--pp-virtual-stages", "2", "--pp-schedule", "1F1B"), "one stage per rank"),
             (("--pp", "4", "--nproc", "4"), "4 stages, but the model has 3 layers"),
             (("--pp", "2", "--global-batch-size", "1"), "at least 2 micro-batches"),
             (("--pp", "2", "--pp-schedule", "ZBVZeroBubble", "--compile"), "torch.compile")]
    # All refused in the launcher's process, before any worker: one process runs the five commands one by one.
    results = run_train_refusals([([*EXACT, "--model", "tiny-moe", "--nproc", "2", "--steps", "1", *plan], tmp_path)
                                  for plan, _ in cases])
    for (plan, words), (code, _, stderr) in zip(cases, results, strict=True):
        assert code == 2, (plan, stderr)
        assert words in stderr and "Traceback" not in stderr, (plan, stderr)
