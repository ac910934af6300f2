"""`paraseek train` bad input: exit 2, one line naming the problem, no traceback, nothing written."""

import json

import pytest
from dist_helpers import run_train_refusals

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


ALL = sorted(CASES) + ["tokenizer vocab"]


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, tuple]:
    """Every case's command in a folder of its own, run one after the other in one process (each is refused by the
    launcher before any worker starts; one torch import for all): case -> (folder, files before, exit code, stdout,
    stderr)."""
    runs, before = {}, {}
    for case in ALL:
        folder = tmp_path_factory.mktemp("bad-input")
        if case == "tokenizer vocab":
            argv = ["--model", _small_vocab_model(folder / "m"), "--data",
                    str(__import__("paraseek.train.corpus", fromlist=["x"]).BUNDLED_CORPUS)]
        else:
            argv = CASES[case][0]
        before[case] = set(folder.rglob("*"))
        runs[case] = (["--device", "cpu", "--steps", "2", "--seq-len", "16", *argv, "--metrics-jsonl", "m.jsonl",
                       "--checkpoint-dir", "ck", "--tensorboard", "tb"], folder)
    results = run_train_refusals(list(runs.values()))
    return {case: (runs[case][1], before[case], *result) for case, result in zip(ALL, results, strict=True)}


@pytest.mark.parametrize("case", ALL)
def test_bad_input(case, refused):
    message = "vocab_size is 1,000" if case == "tokenizer vocab" else CASES[case][1]
    tmp_path, before, returncode, stdout, stderr = refused[case]
    assert returncode == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], stderr
    assert "Traceback" not in stderr + stdout
    assert set(tmp_path.rglob("*")) - before <= {tmp_path / "cache"} | set((tmp_path / "cache").rglob("*"))
