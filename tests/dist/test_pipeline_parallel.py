"""Pipeline parallelism through `paraseek train` (gloo, fp32, real processes) against one process.

A 4-layer tiny-moe (V3-shaped: MLA, one dense layer, then shared + routed experts) starts from one seeded HF folder
(routers with std 1, see dist_helpers.seed_checkpoint) and trains 6 steps of 8 sequences at the training issue's
exact settings. One process with 8 accumulated micro-batches is the reference; pp = 2 runs every schedule torch
provides (two virtual stages per rank for the interleaved ones: 4 stages), pp x tp and pp x ep x dp_shard run on 4
processes. Each gives the reference losses within 1e-4 relative: the same sums, only the reduction order of the
gradients differs (stages, tp or dp shards). A checkpoint written under tp=2 x pp=2 resumes under dp_shard=4 with
the uninterrupted losses, and an export under pp gathers every stage into one HF folder.
"""

import pytest
import torch
from dist_helpers import EXACT, assert_same_losses, run_train, step_losses

from paraseek.models import load_pretrained, save_pretrained
from paraseek.models.args import ModelArgs, preset_config
from paraseek.models.deepseek import Gate, build_model
from paraseek.parallel.pipeline import SCHEDULES, SINGLE_SCHEDULES

pytestmark = pytest.mark.dist

STEPS = 6
RTOL = 1e-4


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    args = ModelArgs.from_hf_config({**preset_config("tiny-moe"), "num_hidden_layers": 4})
    torch.manual_seed(1234)
    model = build_model(args, "cpu", torch.float32)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Gate):
                m.weight.normal_(0.0, 1.0)
    save_pretrained(model, root / "init")
    run_train(*EXACT, "--steps", str(STEPS), "--init-from", str(root / "init"), "--nproc", "1",
              "--metrics-jsonl", "ref.jsonl", cwd=root)
    return root / "init", step_losses(root / "ref.jsonl")


def _run(init, cwd, *plan: str, steps: int = STEPS, jsonl: str = "m.jsonl", extra: tuple = ()):
    r = run_train(*EXACT, "--steps", str(steps), "--init-from", str(init), *plan, "--metrics-jsonl", jsonl, *extra,
                  cwd=cwd)
    return r, step_losses(cwd / jsonl)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_each_schedule_equals_single_process(reference, tmp_path, schedule):
    init, ref = reference
    v = "1" if schedule in SINGLE_SCHEDULES else "2"
    r, got = _run(init, tmp_path, "--nproc", "2", "--pp", "2", "--pp-schedule", schedule, "--pp-virtual-stages", v)
    assert f"pp=2 {schedule}" in r.stdout
    # The split it balanced is printed: 2 or 4 stages, the last with the head.
    n_stages = 2 * int(v)
    assert f"pipeline: {n_stages} stages on 2 ranks" in r.stdout
    assert f"stage {n_stages - 1} (pp rank" in r.stdout and "norm + head + loss" in r.stdout
    assert_same_losses(got, ref, RTOL)


def test_pp2_tp2_equals_single_process(reference, tmp_path):
    init, ref = reference
    _, got = _run(init, tmp_path, "--nproc", "4", "--pp", "2", "--tp", "2")
    assert_same_losses(got, ref, RTOL)


def test_pp2_ep2_dp_shard2_equals_single_process(reference, tmp_path):
    init, ref = reference
    r, got = _run(init, tmp_path, "--nproc", "4", "--pp", "2", "--dp-shard", "2", "--ep", "2",
                  "--pp-schedule", "Interleaved1F1B")
    assert_same_losses(got, ref, RTOL)
    # Expert-load telemetry covers every stage's MoE layers (3 of the 4 layers are MoE).
    import json

    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "event" not in row]
    assert all(len(row["expert_load_max_over_mean_per_layer"]) == 3 for row in steps)


def test_checkpoint_tp2_pp2_resumes_under_dp_shard4(reference, tmp_path):
    init, ref = reference
    ck = ("--checkpoint-dir", "ck")
    _run(init, tmp_path, "--nproc", "4", "--pp", "2", "--tp", "2", steps=3, jsonl="a.jsonl", extra=ck)
    r, resumed = _run(init, tmp_path, "--nproc", "4", "--dp-shard", "4", jsonl="b.jsonl", extra=(*ck, "--resume"))
    assert "resumed from ck/step-000003 at step 3" in r.stdout
    assert_same_losses(resumed, {s: ref[s] for s in range(4, STEPS + 1)}, RTOL)


def test_export_under_pp_has_every_stage(reference, tmp_path):
    init, _ = reference
    _run(init, tmp_path, "--nproc", "2", "--pp", "2", steps=2, extra=("--export-hf", "out"))
    exported = load_pretrained(tmp_path / "out", dtype=torch.float32)
    trained_on_one = tmp_path / "one"
    trained_on_one.mkdir()
    _run(init, trained_on_one, "--nproc", "1", steps=2, extra=("--export-hf", "out"))
    ref = load_pretrained(trained_on_one / "out", dtype=torch.float32)
    got_sd, ref_sd = exported.state_dict(), ref.state_dict()
    assert sorted(got_sd) == sorted(ref_sd)
    # Per tensor, max |diff| / max |ref|: AdamW turns a gradient element of ~1e-9 whose reduction order differs
    # into a different update of up to lr, so single elements move by ~1e-5 after 2 steps (1e-4 relative); a
    # tensor from the wrong stage or an untrained one would be off by O(1).
    for name, t in ref_sd.items():
        rel = ((got_sd[name] - t).abs().max() / t.abs().max()).item()
        assert rel < 1e-3, (name, rel)


def test_bad_pipeline_plans_fail_in_one_line(tmp_path):
    for plan, words in [(("--pp", "2", "--pp-schedule", "Bogus"), "--pp-schedule 'Bogus'"),
                        (("--pp", "2", "--pp-virtual-stages", "2", "--pp-schedule", "1F1B"), "one stage per rank"),
                        (("--pp", "4", "--nproc", "4"), "4 stages, but the model has 3 layers"),
                        (("--pp", "2", "--global-batch-size", "1"), "at least 2 micro-batches")]:
        argv = [*EXACT, "--model", "tiny-moe", "--nproc", "2", "--steps", "1", *plan]
        r = run_train(*argv, cwd=tmp_path, check=False)
        assert r.returncode == 2, (plan, r.stderr)
        assert words in r.stderr and "Traceback" not in r.stderr, (plan, r.stderr)
