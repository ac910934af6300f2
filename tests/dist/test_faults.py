"""Injected faults are detected, named once, and the job ends (CPU, gloo, 2 processes)."""

import json
import os
import subprocess
import sys
import time

import pytest
from dist_helpers import EXACT, SRC, run_train

pytestmark = pytest.mark.dist
TINY = [*EXACT, "--model", "tiny-dense", "--nproc", "2", "--micro-batch-size", "2", "--metrics-jsonl", "run/metrics.jsonl"]


def _events(tmp_path):
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "event" in r]


def _diagnose(tmp_path, failed=True):
    env = dict(os.environ, PYTHONPATH=SRC)
    r = subprocess.run([sys.executable, "-m", "paraseek", "diagnose", "run", "--json"], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == (1 if failed else 0), r.stderr  # diagnose exits 1 for a failed run
    return json.loads(r.stdout)


def test_nan(tmp_path):
    r = run_train(*TINY, "--steps", "6", "--inject-fault", "nan@3", cwd=tmp_path, check=False)
    assert r.returncode != 0
    (nan,) = [e for e in _events(tmp_path) if e["event"] == "nan"]
    assert nan["step"] == 3
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("paraseek:")]
    assert len(errors) == 1 and "step 3" in errors[0]


def test_hang(tmp_path):
    t = time.monotonic()
    r = run_train(*TINY, "--steps", "8", "--inject-fault", "hang@1:4", "--comm-timeout", "20", cwd=tmp_path,
                  check=False)
    assert r.returncode != 0 and time.monotonic() - t < 90
    assert "rank 1 (host" in r.stderr and "did not reach the collective of step 4" in r.stderr
    (hang,) = [e for e in _events(tmp_path) if e["event"] == "hang"]
    assert (hang["step"], hang["rank"]) == (4, 1)
    d = _diagnose(tmp_path)
    assert (d["verdict"], d["step"], d["rank"]) == ("hang", 4, 1)
    assert "rank 1" in d["message"] and "did not reach the collective of step 4" in d["message"]


def test_straggler(tmp_path):
    run_train(*TINY, "--steps", "6", "--inject-fault", "slow@1:400", cwd=tmp_path)
    stragglers = [e for e in _events(tmp_path) if e["event"] == "straggler"]
    assert len(stragglers) == 1 and stragglers[0]["rank"] == 1 and stragglers[0]["step"] <= 5


def test_crash_then_resume(tmp_path):
    common = [*TINY, "--steps", "5", "--checkpoint-dir", "ck", "--checkpoint-every", "1"]
    t = time.monotonic()
    r = run_train(*common, "--inject-fault", "crash@1:3", cwd=tmp_path, check=False)
    assert r.returncode != 0 and time.monotonic() - t < 60
    assert r.stderr.count("Traceback") <= 1 and "rank 1" in r.stderr
    d = _diagnose(tmp_path)
    assert (d["verdict"], d["step"], d["rank"]) == ("crash", 3, 1)
    r = run_train(*common, "--resume", cwd=tmp_path)
    assert "resumed from" in r.stdout and "step 2" in r.stdout and "step     5/5" in r.stdout
    assert _diagnose(tmp_path, failed=False)["verdict"] == "ok"


def test_profile(tmp_path):
    r = run_train(*TINY, "--steps", "4", "--profile-steps", "2:3", cwd=tmp_path)
    assert "profile rank 0 (cpu" in r.stdout and "profile rank 1 (cpu" in r.stdout
    for rank in (0, 1):
        assert (tmp_path / "run" / "profile" / f"rank{rank}.json").is_file()


def test_oom_reports_once_with_the_planners_fix(tmp_path):
    """An out-of-memory error (injected: the same exception type CUDA raises) names the rank and step once, and the
    planner's breakdown of this plan with the fastest change that fits follows."""
    r = run_train(*TINY, "--steps", "4", "--inject-fault", "oom@0:2", cwd=tmp_path, check=False)
    assert r.returncode != 0
    assert r.stderr.count("out of memory") == 1 and "rank 0" in r.stderr and "at step 2" in r.stderr
    assert "GiB/GPU for this plan" in r.stderr and "cheapest fix:" in r.stderr
    assert "Traceback" not in r.stderr
    assert any(e.get("event") == "oom" and e["step"] == 2 and e["rank"] == 0 for e in _events(tmp_path))
