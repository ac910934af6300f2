"""`paraseek bench --calibrate` on the CPU: the measuring functions run at tiny sizes and return positive, finite
rates (no timing claims: a CPU says nothing about a GPU); the section merges into a profile file that the planner
then prices at exactly those rates; the CLI's flow with the measurement stubbed; the one-line errors. Fast."""

import json
import math
from pathlib import Path

import pytest
import torch

from paraseek.bench import calibrate as cal
from paraseek.bench.run import _print_calibration
from paraseek.cli import main
from paraseek.errors import UserError
from paraseek.hardware.profile import add_calibration, save_profile
from paraseek.models import resolve_model
from paraseek.planner import Plan, evaluate, make_cluster
from paraseek.planner import plan as plan_module
from paraseek.planner.plan import load_profile

CPU = torch.device("cpu")
DOCTOR_PROFILE = {"schema": "paraseek.hardware_profile/1", "gpu_name": "NVIDIA H200", "mixed": False,
                  "memory_gib": 139.8, "gpus_per_node": 8, "nodes": 1, "matmul_tflops": 790.0, "hbm_gbps": 4300.0,
                  "intra_node_busbw_gbps": 348.0, "inter_node_busbw_gbps": None, "gpus": [], "links": {}}


@pytest.fixture(scope="module")
def section():
    return cal.calibrate(CPU, cal.TINY)


def positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_measuring_functions_run_on_cpu_and_return_positive_rates():
    s = cal.TINY
    assert positive(cal.median_seconds(lambda: torch.ones(8).sum(), CPU, 1, 3))
    rows = cal.gemm_rates(CPU, s)
    assert len(rows) == 10 and all(positive(r["tflops"]) and positive(r["ms"]) for r in rows)
    # the three layouts of each weight have the same FLOPs: m x n x k is a permutation of (tokens, out, in)
    for r in rows[:9]:
        assert sorted((r["m"], r["n"], r["k"])) in (sorted((s.tokens, s.dim, s.dim)), sorted((s.tokens, s.ffn, s.dim)))
    assert positive(cal.attention_tflops(CPU, 1, 2, 32, 24, 16, 1, 3))  # MLA-like: d_qk != d_v
    g = cal.grouped_rate(CPU, s)
    assert g["impl"] == "per-expert loop" and g["rows_per_expert"] == s.expert_tokens * s.top_k // s.experts
    assert positive(g["tflops"])
    assert positive(cal.copy_gbps(CPU, 1 << 16, 1, 3))


def test_section_has_the_planner_rates_and_their_sources(section):
    assert section["schema"] == cal.SCHEMA and section["torch"] == torch.__version__
    assert section["device"].startswith("cpu") and section["created"]
    assert positive(section["matmul_tflops"]) and positive(section["hbm_gbps"])
    assert section["matmul_tflops"] == max(r["tflops"] for r in section["gemm"])  # the ceiling is the best GEMM
    assert set(section["efficiency"]) == {"linear", "attention", "grouped"}
    assert all(positive(v) and v <= 1 for v in section["efficiency"].values())
    assert [a["name"] for a in section["attention"]] == ["MHA", "MLA"]
    assert all(positive(a["tflops"]) and positive(a["ratio"]) for a in section["attention"])
    json.dumps(section)  # JSON-able as it is


def test_profile_file_with_calibration_is_priced_at_exactly_those_rates(section, tmp_path):
    path = tmp_path / "hw.json"
    save_profile(path, add_calibration(DOCTOR_PROFILE, section))
    back = json.loads(path.read_text())
    assert back["calibration"] == section
    assert {k: v for k, v in back.items() if k != "calibration"} == DOCTOR_PROFILE  # the doctor's part stays
    c = load_profile(path)
    e = section["efficiency"]
    assert c.matmul_tflops == section["matmul_tflops"] and c.hbm_gbps == section["hbm_gbps"]
    hopper, ref = plan_module.EFFICIENCY["hopper"], plan_module.REFERENCE_KERNEL_EFFICIENCY
    for key in ("linear", "attention", "grouped"):  # the fitted in-training rate, scaled by kernels vs the reference
        assert getattr(c.eff, key) == pytest.approx(min(1.0, getattr(hopper, key) * e[key] / ref[key]))
    assert c.intra_busbw_gbps == 348.0 and c.memory_gib == 139.8  # not calibrated: the doctor's numbers
    defaults = make_cluster("H200", 8)
    assert (c.eff.hbm, c.eff.busbw) == (defaults.eff.hbm, defaults.eff.busbw)

    # without the section: the doctor's matmul and the datasheet efficiencies, as before
    plain = tmp_path / "plain.json"
    save_profile(plain, DOCTOR_PROFILE)
    p = load_profile(plain)
    assert p.matmul_tflops == 790.0 and p.eff == defaults.eff

    # a newer calibration replaces the older one; a faster GEMM ceiling gives a faster predicted step
    fast = {**section, "matmul_tflops": 1600.0, "hbm_gbps": 8600.0, "efficiency": plan_module.REFERENCE_KERNEL_EFFICIENCY}
    save_profile(path, add_calibration(back, fast))
    c = load_profile(path)
    assert c.matmul_tflops == 1600.0 and c.hbm_gbps == 8600.0
    assert (c.eff.linear, c.eff.attention, c.eff.grouped) == (defaults.eff.linear, defaults.eff.attention,
                                                              defaults.eff.grouped)
    args = resolve_model("deepseek-llm-7b")[0]
    assert (evaluate(args, c, Plan(dp_shard=8), 4096, 16).time.total
            < evaluate(args, p, Plan(dp_shard=8), 4096, 16).time.total)


@pytest.mark.parametrize("bad, message", [
    ({"efficiency": {"linear": 1.5}}, "'calibration.efficiency.linear' must be at most 1"),
    ({"efficiency": {"attention": "fast"}}, "'calibration.efficiency.attention' must be a positive number"),
    ({"matmul_tflops": float("nan")}, "'calibration.matmul_tflops' must be a positive number"),
    ({"hbm_gbps": -1}, "'calibration.hbm_gbps' must be a positive number"),
])
def test_bad_calibration_is_one_clear_line(tmp_path, bad, message):
    path = tmp_path / "hw.json"
    save_profile(path, add_calibration(DOCTOR_PROFILE, bad))
    with pytest.raises(UserError, match=message.replace("(", r"\(")) as e:
        load_profile(path)
    assert "\n" not in str(e.value)


def test_cli_without_cuda_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--calibrate"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "paraseek: error: --calibrate measures GPUs; no CUDA device is visible"
    assert main(["bench", "--save", "x.json"]) == 2
    assert "--save goes with --calibrate" in capsys.readouterr().err


@pytest.fixture
def fake_gpu(monkeypatch, section):
    """CUDA 'visible' and the measurement stubbed with the CPU section: the CLI's own flow runs for real."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(cal, "calibrate", lambda device: {**section, "device": "NVIDIA H200"})
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_cli_adds_calibration_to_the_hardware_profile(fake_gpu, section, tmp_path, capsys):
    hw, out = tmp_path / "hw.json", tmp_path / "out.json"
    save_profile(hw, DOCTOR_PROFILE)
    assert main(["bench", "--calibrate", "--hardware", str(hw), "--save", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"hardware profile written to {out}" in text and "planner rates: matmul" in text
    assert json.loads(hw.read_text()) == DOCTOR_PROFILE  # --save elsewhere: the input is left alone
    assert load_profile(out).matmul_tflops == section["matmul_tflops"]
    # without --save the --hardware file itself gets the section; --json prints one document
    assert main(["bench", "--calibrate", "--hardware", str(hw), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["profile"] == str(hw) and doc["intra_node_busbw_gbps"] == 348.0
    assert json.loads(hw.read_text())["calibration"]["matmul_tflops"] == section["matmul_tflops"]


def test_cli_refuses_a_profile_of_other_gpus_and_a_missing_folder(fake_gpu, tmp_path, capsys):
    hw = tmp_path / "a100.json"
    save_profile(hw, {**DOCTOR_PROFILE, "gpu_name": "NVIDIA A100-SXM4-80GB"})
    assert main(["bench", "--calibrate", "--hardware", str(hw)]) == 2
    assert "describes NVIDIA A100-SXM4-80GB GPUs but this machine's GPU is NVIDIA H200" in capsys.readouterr().err
    assert main(["bench", "--calibrate", "--save", str(tmp_path / "no" / "p.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_table_renders(section, capsys):
    _print_calibration({**section, "device": "NVIDIA H200"}, DOCTOR_PROFILE)
    out = capsys.readouterr().out
    assert "SDPA causal fwd+bwd MLA" in out and "(default 0.73)" in out and "348 GB/s in a node" in out


def test_the_reference_h200_calibration_prices_like_the_fitted_defaults():
    """The calibration measured on the 2x H200 the defaults were fitted on (a real `paraseek bench --calibrate`
    output) must give the defaults' predictions back, within the 0.3% its GEMM ceiling differs by."""
    profile = Path(__file__).resolve().parents[2] / "benchmarks" / "2026-11-30" / "h200-calibrated-profile.json"
    c = load_profile(profile, 2)
    d = make_cluster("H200", 2, gpus_per_node=2)
    for model, plan, gbs in (("deepseek-llm-7b", Plan(dp_shard=2, micro_batch_size=2, activation_checkpointing="selective"), 4),
                             ("deepseek-v2-lite", Plan(dp_shard=2, micro_batch_size=4, activation_checkpointing="full"), 8)):
        args = resolve_model(model)[0]
        assert evaluate(args, c, plan, 4096, gbs).time.total == pytest.approx(evaluate(args, d, plan, 4096, gbs).time.total,
                                                                              rel=0.02)
