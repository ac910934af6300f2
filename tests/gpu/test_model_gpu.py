"""The model's CUDA-only path under torch.compile: a DeepSeek-V2-Lite-shaped MoE layer (torch._grouped_mm) compiled
by inductor as one graph (no graph break) under selective checkpointing, equal to eager.

Run on the GPU machine: `make test-gpu` or `python3 -m pytest -q -m gpu tests/gpu`."""

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from paraseek.models.args import ModelArgs, preset_config
from paraseek.models.deepseek import MoE, build_model
from paraseek.parallel.parallelize import _selective_policy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_v2_lite_moe_compiles_as_one_graph_under_selective_checkpointing():
    """The MoE layer alone (a whole block's bf16 attention, compiled, rounds the router's input differently and flips
    near-tie expert choices; the MoE's own router math is fp32), wrapped in the engine's selective-checkpointing
    policy exactly as apply_activation_checkpointing wraps a block."""
    cfg = {**preset_config("deepseek-v2-lite"), "num_hidden_layers": 2}
    torch.manual_seed(0)
    model = build_model(ModelArgs.from_hf_config(cfg), "cuda", torch.bfloat16)
    moe = model.layers["1"].mlp
    assert isinstance(moe, MoE)
    wrapped = checkpoint_wrapper(moe, preserve_rng_state=False,
                                 context_fn=lambda: create_selective_checkpoint_contexts(_selective_policy))
    x = torch.randn(2, 512, model.args.dim, device="cuda", dtype=torch.bfloat16)

    def run(fn):
        moe.zero_grad(set_to_none=True)
        moe.tokens_per_expert.zero_()
        xx = x.clone().requires_grad_(True)
        y = fn(xx)
        y.float().pow(2).mean().backward()
        return y.detach(), xx.grad, moe.experts.down_proj.grad.clone(), moe.tokens_per_expert.clone()

    eager = run(wrapped)
    compiled = run(torch.compile(wrapped, fullgraph=True))
    torch.testing.assert_close(compiled[3], eager[3], rtol=0, atol=0)  # same routing; counts written back
    assert int(eager[3].sum()) == 2 * 512 * moe.top_k
    for got, want in zip(compiled[:3], eager[:3]):
        assert _rel(got, want) < 2e-2
