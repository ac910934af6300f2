"""The model's CUDA-only paths: MLA attention through SDPA's flash kernel (v zero-padded from 128 to q/k's 192), and a
DeepSeek-V2-Lite-shaped MoE block compiled by inductor as one graph with selective checkpointing.

Run on the GPU machine: `make test-gpu` or `python3 -m pytest -q -m gpu tests/gpu`."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from paraseek.models.args import ModelArgs, preset_config
from paraseek.models.deepseek import MoE, build_model, causal_attention
from paraseek.parallel.apply import apply_activation_checkpointing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_mla_attention_runs_on_the_flash_kernel_and_matches_fp32():
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, T, K, V = 2, 16, 1024, 192, 128  # V2-Lite's heads and head dims
    q, k = (torch.randn(B, H, T, K, device="cuda", generator=g) for _ in range(2))
    v = torch.randn(B, H, T, V, device="cuda", generator=g)
    do = torch.randn(B, H, T, V, device="cuda", generator=g)
    q16, k16, v16 = (t.bfloat16().requires_grad_(True) for t in (q, k, v))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises if the padded call could not use flash
        o16 = causal_attention(q16, k16, v16, K**-0.5)
        o16.backward(do.bfloat16())
    q32, k32, v32 = (t.clone().requires_grad_(True) for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        o32 = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True, scale=K**-0.5)
        o32.backward(do)
    assert o16.shape == (B, H, T, V)
    for got, want in ((o16, o32), (q16.grad, q32.grad), (k16.grad, k32.grad), (v16.grad, v32.grad)):
        assert _rel(got, want) < 1e-2


def test_v2_lite_moe_block_compiles_as_one_graph():
    cfg = {**preset_config("deepseek-v2-lite"), "num_hidden_layers": 2}
    torch.manual_seed(0)
    model = build_model(ModelArgs.from_hf_config(cfg), "cuda", torch.bfloat16)
    apply_activation_checkpointing(model, "selective")
    block = model.layers["1"]
    moe = next(m for m in block.modules() if isinstance(m, MoE))
    cos, sin = (t.bfloat16() for t in model.rope_cos_sin(512, torch.device("cuda")))
    x = torch.randn(2, 512, model.args.dim, device="cuda", dtype=torch.bfloat16)

    def run(fn):
        block.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        y = fn(xx, cos, sin)
        y.float().pow(2).mean().backward()
        return y.detach(), xx.grad, moe.experts.down_proj.grad.clone(), moe.tokens_per_expert.clone()

    eager = run(block)
    compiled = run(torch.compile(block, fullgraph=True))
    torch.testing.assert_close(compiled[3], eager[3], rtol=0, atol=0)  # same routing, counts written back
    for got, want in zip(compiled[:3], eager[:3]):
        assert _rel(got, want) < 2e-2
