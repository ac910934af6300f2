"""`paraseek bench`: real training runs on synthetic tokens, weak scaling over process counts, JSON and a plot."""

import json
import os
import subprocess
import sys

import pytest
from dist_helpers import SRC

from paraseek.models import flops_per_token, resolve_model

pytestmark = pytest.mark.dist


def test_weak_scaling_json_and_plot(tmp_path):
    env = dict(os.environ, PYTHONPATH=SRC, PARASEEK_CACHE=str(tmp_path / "cache"))
    # A hardware profile with a measured GEMM ceiling (here a made-up 0.002 TFLOP/s): MFU against it is reported.
    (tmp_path / "hw.json").write_text(json.dumps({
        "schema": "paraseek.hardware_profile/1", "gpu_name": "NVIDIA H200", "mixed": False, "memory_gib": 139.8,
        "gpus_per_node": 2, "nodes": 1, "matmul_tflops": 0.002, "hbm_gbps": 4300.0, "intra_node_busbw_gbps": 348.0,
        "inter_node_busbw_gbps": None, "gpus": [], "links": {}}))
    r = subprocess.run([sys.executable, "-m", "paraseek", "bench", "--model", "tiny-dense", "--device", "cpu",
                        "--seq-len", "32", "--global-batch-size", "2", "--micro-batch-size", "1", "--steps", "3",
                        "--warmup", "1", "--scaling", "1,2", "--json", "--plot", "scaling.png",
                        "--hardware", "hw.json"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)  # one document on stdout; the runs' lines went to stderr
    runs = doc["runs"]
    assert [run["gpus"] for run in runs] == [1, 2]
    # weak scaling: the per-rank batch stays 2, the global batch grows with the ranks
    assert [run["global_batch_size"] for run in runs] == [2, 4]
    flops_tok = flops_per_token(resolve_model("tiny-dense")[0], 32)
    for run in runs:
        assert run["measured_steps"] == 3 and run["tokens_per_s_per_gpu"] > 0 and run["mfu"] is None
        assert run["matmul_ceiling_tflops"] == 0.002
        assert run["mfu_vs_ceiling"] == pytest.approx(flops_tok * run["tokens_per_s_per_gpu"] / 0.002e12)
    assert runs[0]["weak_scaling_efficiency"] == 1.0
    assert runs[1]["weak_scaling_efficiency"] == pytest.approx(
        runs[1]["tokens_per_s_per_gpu"] / runs[0]["tokens_per_s_per_gpu"])
    assert (tmp_path / "scaling.png").stat().st_size > 0
