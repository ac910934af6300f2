"""`paraseek train` bad input: exit 2, one line naming the problem, no traceback, nothing written."""

import json

import pytest
from dist_helpers import run_train

from paraseek.models import preset_config

pytestmark = pytest.mark.dist


def _small_vocab_model(folder):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(preset_config("tiny-dense"), vocab_size=1000)))
    return str(folder)


CASES = {
    "unknown model": (["--model", "deepseek-v9"], "unknown model 'deepseek-v9'"),
    "degrees": (["--nproc", "4", "--dp-replicate", "3", "--dp-shard", "2"], "world size is 4"),
    "batch": (["--nproc", "2", "--global-batch-size", "6", "--micro-batch-size", "2"], "not divisible"),
    "data path": (["--data", "no/such/corpus.txt"], "no such file or folder"),
    "compression on fsdp": (["--nproc", "2", "--grad-compression", "bf16"], "needs DDP"),
    # sequence parallelism shards the sequence: refused in the parent, before any worker starts
    "sequence over tp": (["--nproc", "2", "--dp-shard", "1", "--tp", "2", "--seq-len", "31"],
                         "not divisible by --tp 2"),
    # a bad choice and a misspelt flag: one line, not argparse's usage block
    "precision fp8": (["--precision", "fp8"], "--precision must be one of fp32, bf16, fp16, got 'fp8'"),
    "misspelt flag": (["--seqlen", "64"], "unknown flag --seqlen (did you mean --seq-len?)"),
}


@pytest.mark.parametrize("case", sorted(CASES) + ["tokenizer vocab"])
def test_bad_input(case, tmp_path):
    if case == "tokenizer vocab":
        argv, message = ["--model", _small_vocab_model(tmp_path / "m"), "--data",
                         str(__import__("paraseek.train.data", fromlist=["x"]).BUNDLED_CORPUS)], "vocab_size is 1,000"
    else:
        argv, message = CASES[case]
    before = set(tmp_path.rglob("*"))
    r = run_train("--device", "cpu", "--steps", "2", "--seq-len", "16", *argv, "--metrics-jsonl", "m.jsonl",
                  "--checkpoint-dir", "ck", "--tensorboard", "tb", cwd=tmp_path, check=False)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert set(tmp_path.rglob("*")) - before <= {tmp_path / "cache"} | set((tmp_path / "cache").rglob("*"))
