"""The `paraseek` command as a user runs it: a subprocess, its exit code, stdout and stderr."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paraseek.models import ModelArgs, param_counts, preset_config

SRC = str(Path(__file__).resolve().parents[2] / "src")


def run(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC)
    return subprocess.run([sys.executable, "-m", "paraseek", *argv], capture_output=True, text=True, env=env, timeout=120)


def test_info_json_has_the_exact_counts():
    r = run("info", "deepseek-v3", "--json", "--seq-len", "4096")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    c = param_counts(ModelArgs.from_hf_config(preset_config("deepseek-v3")))
    assert (doc["total_params"], doc["active_params"], doc["embedding_params"]) == (c.total, c.active, c.embedding)
    assert doc["moe_layers"] == 58 and doc["dense_layers"] == 3
    # 6 x (active - embedding) + 6 x L x seq x H x (192 + 128)
    assert doc["flops_per_token"] == 6 * (c.active - c.embedding) + 6 * 61 * 4096 * 128 * (192 + 128)


def test_info_table_for_an_hf_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset_config("deepseek-v2-lite")))
    r = run("info", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "15,706,484,224" in r.stdout and "MLA" in r.stdout


@pytest.mark.parametrize("argv,message", [
    (["info", "deepseek-v9"], "unknown model 'deepseek-v9'"),
    (["info", "/nonexistent/folder"], "no such folder"),
    (["info", "tiny-moe", "--seq-len", "0"], "--seq-len must be positive"),
    (["info", "tiny-moe", "--seq-len", "513"], "--seq-len 513 is longer than tiny-moe's 512 positions"),
    (["plan", "--model", "deepseek-v2-lite", "--gpus", "8", "--gpu-type", "A100-80GB", "--mode", "infer",
      "--weight-dtype", "fp8", "--global-batch-size", "8"], "--weight-dtype fp8: A100-80GB has no float8 tensor cores"),
])
def test_bad_input_exits_2_with_one_line(argv, message):
    r = run(*argv)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
    assert "Traceback" not in r.stderr


def test_the_limits_themselves_are_accepted():
    assert run("info", "tiny-moe", "--seq-len", "512").returncode == 0  # the model's positions exactly
    r = run("plan", "--model", "deepseek-v2-lite", "--gpus", "8", "--gpu-type", "H100", "--mode", "infer",
            "--weight-dtype", "fp8", "--global-batch-size", "8", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["weight_dtype"] == "fp8", r.stderr


def test_help_lists_only_working_subcommands():
    r = run("--help")
    assert r.returncode == 0
    assert "info" in r.stdout and "demo" in r.stdout


def test_help_and_argument_checks_do_not_import_torch():
    """`paraseek --help` (and every subcommand's parser) answers without importing torch: seconds saved per call."""
    import subprocess
    import sys

    code = ("import sys\nfrom paraseek.cli import main\n"
            "for argv in (['--help'], ['generate', '--help'], ['serve', '--help'], ['plan', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**__import__("os").environ, "PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[2] / "src")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False"
