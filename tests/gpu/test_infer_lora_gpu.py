"""LoRA adapters on CUDA (infer/lora.py): the decode graphs, captured before any adapter is loaded, read the slots
as they are at replay, so adapters loaded, unloaded and replaced after capture give the tokens of the eager kernel
path and of the plain-torch reference path (fp32, adapter and base requests in one batch)."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from test_infer_gpu import GQA, MLA, _model, _prompts  # noqa: E402

from paraseek.infer import ops  # noqa: E402
from paraseek.infer.engine import Engine, EngineConfig  # noqa: E402
from paraseek.infer.lora import Adapter  # noqa: E402
from paraseek.infer.sampling import SamplingParams  # noqa: E402
from paraseek.models.lora_spec import LoRASpec, adapted, model_targets  # noqa: E402


def _adapter(args, rank: int, seed: int) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    targets = tuple(t for t in model_targets(args) if t not in ("experts", "shared_experts"))
    out = Adapter(f"random-{seed}", rank)
    for w in adapted(args, LoRASpec(rank, rank, targets)):
        out.weights[w.name] = (torch.randn(rank, w.in_features, generator=g) / w.in_features ** 0.5,
                               torch.randn(w.out_features, rank, generator=g) * 0.05)
    return out


def _tokens(cfg, kernels: bool, eager: bool):
    engine = Engine(_model(cfg, torch.float32), EngineConfig(num_kv_blocks=400, max_batched_tokens=256,
                                                             enforce_eager=eager, max_loras=2, max_lora_rank=16),
                    log=lambda *_: None)
    assert eager or engine.runner.graphs
    ops.use_kernels(kernels)
    args, prompts = engine.args, _prompts(12, cfg["vocab_size"])
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    out = []
    try:
        engine.load_lora("a", "a", _adapter(args, 16, 1))
        engine.load_lora("b", "b", _adapter(args, 8, 2))
        names = ["a", None, "b"] * 4
        out.append([r.output_ids for r in engine.generate(prompts, params, loras=names)])
        engine.unload_lora("a")
        engine.load_lora("c", "c", _adapter(args, 4, 3))  # into a's slot
        names = ["c", "b", None] * 4
        out.append([r.output_ids for r in engine.generate(prompts, params, loras=names)])
    finally:
        ops.use_kernels(True)
    return out


@pytest.mark.parametrize("cfg", [GQA, dict(MLA, first_k_dense_replace=3)], ids=["gqa", "mla"])
def test_graphs_read_adapters_loaded_after_capture(cfg):
    ref = _tokens(cfg, kernels=False, eager=True)
    assert _tokens(cfg, kernels=True, eager=True) == ref
    assert _tokens(cfg, kernels=True, eager=False) == ref
