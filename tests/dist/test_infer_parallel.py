"""`paraseek generate --tp 2` (and --dp 2) on gloo give `--tp 1`'s greedy tokens, run as a user would."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_helpers import SRC

pytestmark = pytest.mark.dist

# tp 2 divides everything: heads, kv heads (GQA 4/2), widths; the MLA model's latent is replicated.
GQA = {"model_type": "qwen2", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": True,
       "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "use_sliding_window": False}
KV1 = dict(GQA, model_type="llama", num_key_value_heads=1, tie_word_embeddings=False)  # kv head replicated over tp


def _folder(tmp: Path, name: str, cfg: dict) -> Path:
    from paraseek.models import ModelArgs, save_pretrained, preset_config, build_model

    folder = tmp / name
    if cfg is None:
        cfg = preset_config("tiny-moe")
    torch.manual_seed(0)
    model = build_model(ModelArgs.from_hf_config(cfg), "cpu", torch.float32)
    with torch.no_grad():  # as the parity tests do: every weight large enough that attention and routing matter
        for n, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in n else 0.2) + (1.0 if "norm" in n else 0.0))
    save_pretrained(model, folder)
    return folder


def _generate(folder: Path, tmp: Path, *extra: str) -> list[list[int]]:
    prompts = tmp / "prompts.jsonl"
    g = torch.Generator().manual_seed(1)
    with prompts.open("w") as f:
        for n in (3, 17, 40, 9, 25, 2):
            f.write(json.dumps({"prompt_token_ids": torch.randint(0, 300, (n,), generator=g).tolist()}) + "\n")
    env = dict(os.environ, PYTHONPATH=SRC)
    r = subprocess.run([sys.executable, "-m", "paraseek", "generate", str(folder), "--device", "cpu", "--prompts",
                        str(prompts), "--json", "--quiet", "--max-new-tokens", "20", "--temperature", "0",
                        "--ignore-eos", "--block-size", "8", "--max-batched-tokens", "32", *extra],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["index"] for row in rows] == list(range(6))
    return [row["token_ids"] for row in rows]


_SINGLE: dict[str, tuple[Path, list[list[int]]]] = {}


def _single(name: str, cfg: dict | None, tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """The model folder of `name` and its tokens from one process (--tp 1 --dp 1), made once for the module: the tp
    and the dp test of a model compare with the same run."""
    if name not in _SINGLE:
        tmp = tmp_path_factory.mktemp(name)
        folder = _folder(tmp, name, cfg)
        _SINGLE[name] = folder, _generate(folder, tmp)
    return _SINGLE[name]


@pytest.mark.parametrize("name,cfg", [("gqa-tied", GQA), ("one-kv-head", KV1), ("tiny-moe-mla", None)])
def test_tp2_equals_tp1(name, cfg, tmp_path, tmp_path_factory):
    folder, one = _single(name, cfg, tmp_path_factory)
    assert _generate(folder, tmp_path, "--tp", "2") == one


def test_dp2_equals_dp1(tmp_path, tmp_path_factory):
    folder, one = _single("gqa-tied", GQA, tmp_path_factory)
    assert _generate(folder, tmp_path, "--dp", "2") == one
