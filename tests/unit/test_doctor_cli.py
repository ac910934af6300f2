"""`paraseek doctor` as a user runs it (through `python -m paraseek doctor`, the subcommand the CLI
registers): exit codes, the JSON document, the profile, one-line errors; and under torchrun as two nodes."""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from paraseek.hardware.doctor import register, run_doctor

ROOT = Path(__file__).resolve().parents[2]
SRC = str(ROOT / "src")
FIXTURES = ROOT / "tests" / "fixtures" / "doctor"
NO_CUDA = not __import__("torch").cuda.is_available()


def doctor(*argv, env=None):
    e = dict(os.environ, PYTHONPATH=SRC, **(env or {}))
    return subprocess.run([sys.executable, "-m", "paraseek", "doctor", *argv], capture_output=True,
                          text=True, env=e, timeout=300)


def test_register_adds_the_subcommand():
    p = argparse.ArgumentParser()
    register(p.add_subparsers(dest="command"))
    ns = p.parse_args(["doctor", "--quick", "--json", "--sizes", "1M,1G"])
    assert ns.func is run_doctor and ns.quick and ns.json and ns.timeout == 60.0


@pytest.mark.skipif(not NO_CUDA, reason="the CPU-only check: no GPU visible")
def test_cpu_only_json_exits_0_with_no_gpus_and_says_so():
    r = doctor("--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) >= {"gpus", "topology", "measurements", "findings"}
    assert doc["gpus"] == []
    (f,) = [f for f in doc["findings"] if f["code"] == "NO_GPU"]
    assert "no NVIDIA GPU" in f["seen"]
    assert doc["measurements"]["backend"] == "gloo"
    assert doc["measurements"]["collectives"]["intra_node"]["results"]["all_reduce"][0]["busbw_gbps"] > 0


@pytest.mark.skipif(not NO_CUDA, reason="the CPU path")
def test_quick_report_and_fail_on(capsys):
    p = argparse.ArgumentParser()
    register(p.add_subparsers(dest="command"))
    run = lambda *argv: (lambda ns: ns.func(ns))(p.parse_args(["doctor", "--quick", *argv]))
    assert run() == 0 and "NO_GPU" in capsys.readouterr().out
    assert run("--fail-on", "warning") == 1
    assert run("--fail-on", "error") == 0


def test_load_a_recorded_machine_and_save_its_profile(tmp_path):
    prof = tmp_path / "profile.json"
    r = doctor("--load", str(FIXTURES / "a100_sxm_8x_one_throttled.json"), "--json", "--save", str(prof))
    assert r.returncode == 0, r.stderr
    assert {f["code"] for f in json.loads(r.stdout)["findings"]} == {"SLOW_GPU", "GPU_THROTTLED", "NVLINK_DOMAIN"}
    p = json.loads(prof.read_text())
    assert (p["gpu_name"], p["gpus_per_node"], p["nodes"], p["matmul_tflops"]) == ("NVIDIA A100-SXM4-80GB", 8, 1, 171.2)
    r = doctor("--load", str(FIXTURES / "two_nodes_h100_ib.json"), env={"COLUMNS": "200"})  # the readable report
    assert r.returncode == 0 and "NCCL_IB_DISABLE" in r.stdout and "Topology (node 1)" in r.stdout


@pytest.mark.parametrize("argv,message", [
    (["--sizes", "1X"], "--sizes: cannot read '1X'"),
    (["--collectives", "all_reduce,broadcast"], "--collectives: unknown broadcast"),
    (["--iters", "0"], "--iters must be positive"),
    (["--load", "/nonexistent/report.json"], "--load /nonexistent/report.json: no such file"),
    (["--quick", "--save", "/nonexistent/dir/p.json"], "the folder /nonexistent/dir does not exist"),
    # tried with a probe file, not asked of os.access (which says yes to root): refused before anything is measured
    (["--quick", "--save", "/proc/p.json"], "--save /proc/p.json: /proc cannot be written"),
    (["--load", "/proc/self/exe"], "--load /proc/self/exe: not JSON (not UTF-8 text"),  # a binary file
])
def test_user_mistakes_exit_2_with_one_line(argv, message):
    r = doctor(*argv)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and message in r.stderr and "Traceback" not in r.stderr


def test_save_does_not_replace_a_profile_unless_asked(tmp_path):
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"gpu_name": "x", "calibration": {"matmul_tflops": 1.0}}))
    r = doctor("--quick", "--save", str(prof))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "exists; pass --overwrite to replace it and its calibration" in r.stderr
    assert json.loads(prof.read_text())["gpu_name"] == "x"  # untouched
    r = doctor("--load", str(FIXTURES / "a100_sxm_8x_one_throttled.json"), "--save", str(prof), "--overwrite")
    assert r.returncode == 0, r.stderr
    assert json.loads(prof.read_text())["gpu_name"] == "NVIDIA A100-SXM4-80GB"


def test_load_rejects_other_json(tmp_path):
    f = tmp_path / "x.json"
    f.write_text('{"a": 1}')
    r = doctor("--load", str(f))
    assert r.returncode == 2 and "not a paraseek doctor document" in r.stderr


@pytest.mark.dist
@pytest.mark.skipif(not NO_CUDA, reason="the gloo path")
def test_two_nodes_under_torchrun_report_on_rank_0():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    e = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(r),
                               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "-m", "paraseek", "doctor", "--json", "--sizes", "64K,1M", "--iters", "3",
                               "--warmup", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
             for r in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:]
    assert outs[1][0] == ""  # only global rank 0 reports
    doc = json.loads(outs[0][0])
    assert [n["node"] for n in doc["nodes"]] == [0, 1]
    world = doc["measurements"]["collectives"]["world"]
    assert world["ranks"] == 2 and world["results"]["all_reduce"][-1]["busbw_gbps"] > 0
    assert "NO_GPU" in {f["code"] for f in doc["findings"]}


def test_a_hardware_profile_is_read_in_one_line_whatever_it_holds(tmp_path):
    from paraseek.errors import UserError
    from paraseek.hardware.document import load_document
    from paraseek.hardware.profile import build_profile, load_profile

    f = tmp_path / "h.json"
    good = build_profile(load_document(str(FIXTURES / "a100_sxm_8x_one_throttled.json")))
    f.write_text(json.dumps(good))
    assert load_profile(f)["gpu_name"] == "NVIDIA A100-SXM4-80GB"
    for content, message in ((b"\x89PNG\r\n\x1a\n\x00\x00", "not JSON (not UTF-8 text"),
                             (json.dumps(dict(good, nodes="two")), "nodes is 'two', not a whole number"),
                             (json.dumps(dict(good, matmul_tflops=[1])), "matmul_tflops is [1], not a number or null"),
                             (json.dumps({"gpu_name": 80}), "gpu_name is 80, not the GPUs' name")):
        f.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(UserError, match="^" + re.escape(f"hardware profile {f}: {message}")):
            load_profile(f, required=("gpu_name",))
