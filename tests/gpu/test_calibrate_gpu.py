"""`paraseek bench --calibrate` on a CUDA machine (run there: `make test-gpu` or
`python3 -m pytest -q -m gpu tests/gpu/test_calibrate_gpu.py`): the measured rates are plausible for the GPU, and
the command writes a profile that the planner prices at those rates: the GEMM ceiling and HBM as measured, and each
kernel efficiency as plan.calibrated scales it (the fitted in-training efficiency times this GPU's kernel efficiency
over the reference machine's)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paraseek.bench.calibrate import calibrate
from paraseek.planner.plan import EFFICIENCY, REFERENCE_KERNEL_EFFICIENCY, load_profile

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture(scope="module")
def section():
    return calibrate(torch.device("cuda", 0))


def test_rates_are_plausible(section):
    name = torch.cuda.get_device_name(0)
    hopper = "H100" in name or "H200" in name
    best, eff = section["matmul_tflops"], section["efficiency"]
    assert section["dtype"] == "bfloat16" or torch.cuda.get_device_capability(0)[0] < 8
    # H200 here: 790-803 TFLOP/s at 8192^3 (doctor), 4.3 TB/s copy, SDPA 343-402 TFLOP/s on the causal half
    assert best > (300 if hopper else 100), section["gemm"]
    assert best <= 1.05 * 989 or not hopper  # never above the datasheet peak
    assert all(r["tflops"] > 0.3 * best for r in section["gemm"]), section["gemm"]  # large shapes all run well
    assert 0.5 < eff["linear"] <= 1.0, section["gemm"]
    for a in section["attention"]:
        assert 0.2 < a["ratio"] < 1.0, section["attention"]
    assert 0.2 < eff["attention"] < 1.0
    g = section["grouped"]
    assert g["impl"] == ("torch._grouped_mm" if torch.cuda.get_device_capability(0)[0] >= 9 else "per-expert loop")
    assert 0.05 < g["ratio"] < 1.0 and 0.1 < eff["grouped"] <= 1.0, g
    assert section["hbm_gbps"] > (2000 if hopper else 300)


def test_cli_writes_a_profile_the_planner_uses(tmp_path):
    path = tmp_path / "hw.json"
    env = dict(os.environ, PYTHONPATH=SRC, NCCL_NVLS_ENABLE="0")
    r = subprocess.run([sys.executable, "-m", "paraseek", "bench", "--calibrate", "--save", str(path), "--json"],
                       capture_output=True, text=True, env=env, timeout=900, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    cal = doc["calibration"]
    assert doc["profile"] == str(path) and json.loads(path.read_text())["calibration"] == cal
    c = load_profile(path)
    assert (c.matmul_tflops, c.hbm_gbps) == (cal["matmul_tflops"], cal["hbm_gbps"])
    # Not the measured fractions themselves: those are isolated kernels, while the planner's efficiencies are
    # in-training rates fitted on the reference machine; calibration scales them by this GPU's kernels over the
    # reference's (tests/unit/test_calibrate.py checks the same rule on CPU-made profiles).
    fitted, reference = EFFICIENCY["hopper"], REFERENCE_KERNEL_EFFICIENCY
    for key in ("linear", "attention", "grouped"):
        scaled = min(1.0, getattr(fitted, key) * cal["efficiency"][key] / reference[key])
        assert getattr(c.eff, key) == pytest.approx(scaled), (key, cal["efficiency"])
    if torch.cuda.device_count() > 1:  # NCCL measured the doctor's way: the planner's intra-node link rate
        assert doc["intra_node_busbw_gbps"] and c.intra_busbw_gbps == doc["intra_node_busbw_gbps"]
