"""bf16 MoE on CUDA: the grouped-matmul path (torch._grouped_mm) against the exact per-expert fallback, forward and
backward, on a DeepSeek-V2-Lite-shaped layer (dim 2048, 64 experts of width 1408, top-6, 2 shared) with few tokens.

Run on the GPU machine: `make test-gpu` or `python3 -m pytest -q -m gpu tests/gpu`."""

import pytest
import torch

from paraseek.models.args import ModelArgs, preset_config
from paraseek.models.deepseek import MoE, _use_grouped_mm, grouped_mm

from numerics import normal_init, rel_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm"),
]

DEVICE = "cuda"
TOL = 2e-2  # max|grouped - fallback| / max|fallback|, bf16


def _fwd_bwd(moe: MoE, x: torch.Tensor, dy: torch.Tensor, grouped: bool) -> dict[str, torch.Tensor]:
    moe.use_grouped_mm = grouped
    moe.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_(True)
    out = moe(xx)
    out.backward(dy)
    e = moe.experts
    return {"out": out.detach(), "d_input": xx.grad, "d_gate_proj": e.gate_proj.grad.clone(),
            "d_up_proj": e.up_proj.grad.clone(), "d_down_proj": e.down_proj.grad.clone(),
            "counts": moe.tokens_per_expert.clone()}


@pytest.fixture(scope="module")
def v2_lite_moe() -> MoE:
    args = ModelArgs.from_hf_config(preset_config("deepseek-v2-lite"))
    torch.manual_seed(0)
    with torch.device(DEVICE):
        moe = MoE(args)
    moe.to(torch.bfloat16)
    normal_init(moe, 0.02)
    return moe


@pytest.mark.parametrize("n_tokens", [24, 1024])  # 24 x top-6 slots over 64 experts: many experts get no tokens
def test_grouped_matches_fallback_bf16(v2_lite_moe, n_tokens):
    moe = v2_lite_moe
    gen = torch.Generator().manual_seed(n_tokens)
    x = torch.randn(1, n_tokens, moe.gate.args.dim, generator=gen).to(DEVICE, torch.bfloat16)
    dy = torch.randn(1, n_tokens, moe.gate.args.dim, generator=gen).to(DEVICE, torch.bfloat16)
    g = _fwd_bwd(moe, x, dy, grouped=True)
    f = _fwd_bwd(moe, x, dy, grouped=False)
    moe.use_grouped_mm = None
    for key in ("out", "d_input", "d_gate_proj", "d_up_proj", "d_down_proj"):
        assert torch.isfinite(g[key].float()).all(), key
        assert rel_error(g[key], f[key]) < TOL, (key, rel_error(g[key], f[key]))
    # Experts that got no token: their weight grads are exactly zero on both paths (nothing left unwritten).
    with torch.no_grad():
        idx = moe.gate(x.view(-1, x.shape[-1]))[1]
    unused = torch.bincount(idx.reshape(-1), minlength=moe.n_experts) == 0
    if n_tokens == 24:
        assert unused.any()
    for key in ("d_gate_proj", "d_up_proj", "d_down_proj"):
        assert (g[key][unused] == 0).all() and (f[key][unused] == 0).all(), key


def test_grouped_mm_empty_groups_bf16():
    """The primitive with experts that get no rows, after filling the allocator's cache with NaN."""
    counts = torch.tensor([0, 37, 0, 64, 5, 0, 100, 50, 0, 0, 17, 1])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(int(counts.sum()), 2048, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(len(counts), 1408, 2048, generator=gen) * 0.02).to(DEVICE, torch.bfloat16)
    dy = torch.randn(int(counts.sum()), 1408, generator=gen).to(DEVICE, torch.bfloat16)
    res = {}
    for grouped in (True, False):
        if torch.device(DEVICE).type == "cuda":
            blocks = [torch.full((1 << 27,), float("nan"), dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
            del blocks
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = grouped_mm(xx, ww, counts.to(DEVICE), use_grouped=grouped)
        y.backward(dy)
        res[grouped] = (y.detach(), xx.grad, ww.grad)
    for a, b in zip(res[True], res[False]):
        assert torch.isfinite(a.float()).all()
        assert rel_error(a, b) < TOL
    assert (res[True][2][counts == 0] == 0).all()


def test_grouped_path_is_the_default_on_hopper():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the grouped path is chosen automatically on sm90+ only")
    assert _use_grouped_mm(torch.zeros(1, device="cuda", dtype=torch.bfloat16))
    assert not _use_grouped_mm(torch.zeros(1, device="cuda", dtype=torch.float32))
