"""`paraseek bench`: real training runs on synthetic tokens, weak scaling over process counts, JSON and a plot."""

import json
import os
import subprocess
import sys

import pytest
from dist_helpers import SRC

pytestmark = pytest.mark.dist


def test_weak_scaling_json_and_plot(tmp_path):
    env = dict(os.environ, PYTHONPATH=SRC, PARASEEK_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "paraseek", "bench", "--model", "tiny-dense", "--device", "cpu",
                        "--seq-len", "32", "--global-batch-size", "2", "--micro-batch-size", "1", "--steps", "3",
                        "--warmup", "1", "--scaling", "1,2", "--json", "--plot", "scaling.png"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)  # one document on stdout; the runs' lines went to stderr
    runs = doc["runs"]
    assert [run["gpus"] for run in runs] == [1, 2]
    # weak scaling: the per-rank batch stays 2, the global batch grows with the ranks
    assert [run["global_batch_size"] for run in runs] == [2, 4]
    for run in runs:
        assert run["measured_steps"] == 3 and run["tokens_per_s_per_gpu"] > 0 and run["mfu"] is None
    assert runs[0]["weak_scaling_efficiency"] == 1.0
    assert runs[1]["weak_scaling_efficiency"] == pytest.approx(
        runs[1]["tokens_per_s_per_gpu"] / runs[0]["tokens_per_s_per_gpu"])
    assert (tmp_path / "scaling.png").stat().st_size > 0
