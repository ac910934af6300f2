"""LoRA adapters under serving tensor parallelism (gloo, fp32): adapters cut as their weights are (q|k|v and gate|up
by output rows, o_proj and down_proj by input columns, one kv head replicated over the ranks, MLA's q_b and kv_b by
heads) give `--tp 1`'s greedy tokens, for adapter and base requests in one batch: loaded at runtime on the driver
(the other rank loads the same slot on its word), and loaded at start by `paraseek generate --tp 2 --lora`."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_helpers import SRC, spawn
from test_infer_parallel import GQA, KV1, _folder

pytestmark = pytest.mark.dist

CFG = dict(block_size=8, num_kv_blocks=128, max_batched_tokens=32)
NEW = 12
TARGETS = {"gqa-tied": "", "one-kv-head": "", "tiny-moe-mla": "attention,mlp"}
CONFIGS = {"gqa-tied": GQA, "one-kv-head": KV1, "tiny-moe-mla": None}


def _adapter(folder: Path, targets: str, out: Path) -> Path:
    """A rank-4 adapter with B != 0 on `folder`'s model, as a PEFT folder."""
    from paraseek.models import load_pretrained
    from paraseek.models.lora import apply_lora, init_adapters, is_adapter, save_peft_adapter
    from paraseek.models.lora_spec import lora_spec

    model = load_pretrained(folder, dtype=torch.float32)
    spec = lora_spec(4, 8.0, targets, model.args, str(folder))
    apply_lora(model, spec)
    init_adapters(model, seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    save_peft_adapter({n: t for n, t in model.state_dict().items() if is_adapter(n)}, model.args, spec, out,
                      base_model=str(folder), dtype=torch.float32)
    return out


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 25, 2)]


LORAS = ["a", None, "a", "a", None, "a"]


def _tp_engine(rank, world, folder, adapter, max_loras):
    import torch.distributed as dist

    from paraseek.infer.engine import Engine, EngineConfig, serve_worker
    from paraseek.infer.model import InferenceModel
    from paraseek.infer.sampling import SamplingParams
    from paraseek.models import load_pretrained

    group = dist.group.WORLD
    model = InferenceModel.from_training(load_pretrained(folder, dtype=torch.float32), group)
    engine = Engine(model, EngineConfig(**CFG, max_loras=max_loras, max_lora_rank=8), tp_group=group, meta_group=group,
                    log=lambda *_: None)
    if rank:
        serve_worker(engine.runner, group)
        return None
    engine.load_lora("a", str(adapter))  # at runtime: rank 1 is in serve_worker and loads it on the driver's word
    out = engine.generate(_prompts(), SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True), loras=LORAS)
    engine.shutdown()
    return [r.output_ids for r in out]


def _one_process(folder, adapter, loras=LORAS) -> list[list[int]]:
    from paraseek.infer.engine import Engine, EngineConfig
    from paraseek.infer.sampling import SamplingParams
    from paraseek.models import load_pretrained

    engine = Engine(load_pretrained(folder, dtype=torch.float32), EngineConfig(**CFG, max_loras=1, max_lora_rank=8),
                    log=lambda *_: None, lora_modules={"a": str(adapter)})
    out = engine.generate(_prompts(), SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True), loras=loras)
    return [r.output_ids for r in out]


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_tp2_with_an_adapter_loaded_at_runtime_equals_tp1(name, tmp_path):
    folder = _folder(tmp_path, name, copy.deepcopy(CONFIGS[name]))
    adapter = _adapter(folder, TARGETS[name], tmp_path / "adapter")
    one = _one_process(folder, adapter)
    base = _one_process(folder, adapter, [None] * len(LORAS))
    assert any(o != b for o, b, name in zip(one, base, LORAS) if name)  # the adapter matters
    got = spawn(_tp_engine, 2, tmp_path, folder=folder, adapter=adapter, max_loras=2)[0]
    assert got == one


def test_generate_tp2_with_lora_equals_one_process(tmp_path):
    folder = _folder(tmp_path, "gqa-tied", copy.deepcopy(GQA))
    adapter = _adapter(folder, "", tmp_path / "a")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": p, "lora": name}) + "\n"
                               for p, name in zip(_prompts(), LORAS)))
    r = subprocess.run([sys.executable, "-m", "paraseek", "generate", str(folder), "--device", "cpu", "--prompts",
                        str(prompts), "--json", "--quiet", "--max-new-tokens", str(NEW), "--temperature", "0",
                        "--ignore-eos", "--block-size", "8", "--max-batched-tokens", "32", "--tp", "2",
                        "--lora", f"a={adapter}"], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=SRC),
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["lora"] for row in rows] == LORAS
    assert [row["token_ids"] for row in rows] == _one_process(folder, adapter)
