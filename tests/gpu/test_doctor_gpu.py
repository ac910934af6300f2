"""`paraseek doctor` on a CUDA machine (run there: `make test-gpu` or scripts/gpu/doctor_check.sh): the inventory
sees every GPU, NCCL is measured, and an environment mistake set for the run is found."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SRC = str(Path(__file__).resolve().parents[2] / "src")


def doctor(*argv, **env):
    e = dict(os.environ, PYTHONPATH=SRC, NCCL_NVLS_ENABLE="0", **env)
    r = subprocess.run([sys.executable, "-m", "paraseek", "doctor", "--json", *argv], capture_output=True,
                       text=True, env=e, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_inventory_sees_every_gpu():
    doc = doctor("--quick")
    n = torch.cuda.device_count()
    assert len(doc["gpus"]) >= n
    for g in doc["gpus"]:
        assert g["name"] and g["memory_gib"] > 0 and g["compute_capability"]
    names = {torch.cuda.get_device_name(i) for i in range(n)}
    assert names <= {g["name"] for g in doc["gpus"]}
    if n > 1:
        m = doc["topology"]["nodes"][0]["matrix"]
        assert len(m) == len(doc["gpus"]) and m[0][0] == "X"
    assert "NO_GPU" not in {f["code"] for f in doc["findings"]}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_measured_and_launch_blocking_found():
    doc = doctor("--collectives", "all_reduce", "--sizes", "256M", CUDA_LAUNCH_BLOCKING="1")
    meas = doc["measurements"]
    assert meas["backend"] == "nccl" and meas["errors"] == []
    (row,) = meas["collectives"]["intra_node"]["results"]["all_reduce"]
    assert row["bytes"] == 2**28 and row["busbw_gbps"] > 1
    assert all(g["measured"]["matmul_tflops"] > 1 for g in doc["gpus"])
    p2p = meas["p2p"][0]["gbps"]
    assert p2p[0][1] > 1 and meas["p2p"][0]["intact"][0][1] is True
    assert "CUDA_LAUNCH_BLOCKING" in {f["code"] for f in doc["findings"]}
