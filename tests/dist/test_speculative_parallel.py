"""Speculative decoding under `--tp 2` on gloo: the driver broadcasts every step (the verification chunks and the MTP
drafter's own forwards, which every rank runs on the hidden states it kept), and the greedy tokens are one process's
without speculation."""

import json
import os
import subprocess
import sys

import pytest
import torch

from dist_helpers import SRC
from test_infer_parallel import GQA, _folder

pytestmark = pytest.mark.dist


def _rows(folder, tmp, *extra: str) -> list[dict]:
    prompts = tmp / "prompts.jsonl"
    g = torch.Generator().manual_seed(1)
    with prompts.open("w") as f:
        for n in (3, 17, 40, 9, 25, 2):
            f.write(json.dumps({"prompt_token_ids": torch.randint(0, 300, (n,), generator=g).tolist()}) + "\n")
    r = subprocess.run([sys.executable, "-m", "paraseek", "generate", str(folder), "--device", "cpu", "--prompts",
                        str(prompts), "--json", "--quiet", "--max-new-tokens", "20", "--temperature", "0",
                        "--ignore-eos", "--block-size", "8", "--max-batched-tokens", "32", *extra],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=SRC), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines()]


@pytest.mark.parametrize("name,cfg", [("gqa-tied-mtp", dict(GQA, num_nextn_predict_layers=1)),
                                      ("tiny-moe-mla-mtp", "tiny-moe")])
def test_tp2_speculative_gives_tp1_plain_tokens(name, cfg, tmp_path):
    from paraseek.models import preset_config

    if cfg == "tiny-moe":
        cfg = dict(preset_config("tiny-moe"), vocab_size=300, num_nextn_predict_layers=1)
    folder = _folder(tmp_path, name, cfg)
    plain = [r["token_ids"] for r in _rows(folder, tmp_path)]
    for flags in (["--speculative", "mtp", "--num-speculative-tokens", "3"],
                  ["--speculative", "ngram", "--num-speculative-tokens", "3", "--ngram-min", "1"]):
        rows = _rows(folder, tmp_path, "--tp", "2", *flags)
        assert [r["token_ids"] for r in rows] == plain, flags
        assert sum(r["draft_tokens"] for r in rows) > 0, flags
