"""The routed experts under --fp8 on Hopper: torchao's float8 rowwise grouped GEMM (torch._scaled_grouped_mm) on token
groups padded to 16 rows (models/deepseek.py grouped_mm, pad_groups) against the bf16 grouped GEMM (torch._grouped_mm):
the primitive forward and backward on V2-Lite's expert shapes with uneven and empty groups, and a 2-layer
DeepSeek-V2-Lite (its MoE layer: 64 experts of width 1408, top-6) trained a few steps with the experts in float8,
eager and with the MoE compiled, following the bf16 losses.

Run on the GPU machine (sm90, torchao installed): `make test-gpu` or `python3 -m pytest -q -m gpu tests/gpu`."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from paraseek.models.args import ModelArgs, preset_config
from paraseek.models.deepseek import Experts, MoE, build_model, grouped_mm


def _fp8_grouped_available() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return False  # the kernel paraseek enables: sm90 only (parallel/fp8.py fp8_experts)
    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _fp8_grouped_available(), reason="needs an sm90 GPU and torchao's moe_training")]

DEVICE = "cuda"
# float8 e4m3 keeps 3 mantissa bits: each operand rounds with ~2.7% RMS relative error under per-row scales, so a GEMM
# of Gaussian data lands ~3.8% (relative Frobenius) from its bf16 result -- the same for the output, dgrad and wgrad
# (a CPU emulation of the casts measured 0.0377 on these shapes). The bound leaves room for heavier-tailed rows.
GEMM_TOL = 0.06
COUNTS = [0, 37, 0, 64, 5, 0, 100, 50, 0, 0, 17, 1, 16, 300, 3, 0]  # 16 experts: empty, aligned and uneven groups


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _gemm(x, w, dy, counts, fp8: bool):
    xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = grouped_mm(xx, ww, counts, use_grouped=True, fp8=fp8)
    y.backward(dy)
    return y.detach(), xx.grad, ww.grad


@pytest.mark.parametrize("dims", [(2048, 1408), (1408, 2048)])  # V2-Lite's gate/up and down projections (in, out)
def test_fp8_grouped_gemm_tracks_bf16(dims):
    in_dim, out_dim = dims
    counts = torch.tensor(COUNTS, device=DEVICE)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(COUNTS), in_dim, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(len(COUNTS), out_dim, in_dim, generator=gen) * 0.02).to(DEVICE, torch.bfloat16)
    dy = torch.randn(sum(COUNTS), out_dim, generator=gen).to(DEVICE, torch.bfloat16)
    got, ref = _gemm(x, w, dy, counts, fp8=True), _gemm(x, w, dy, counts, fp8=False)
    for name, g, r in zip(("out", "d_x", "d_w"), got, ref):
        assert g.shape == r.shape and g.dtype == torch.bfloat16, name
        assert torch.isfinite(g.float()).all(), name
        assert _rel(g, r) < GEMM_TOL, (name, _rel(g, r))
    used = counts > 0
    assert _rel(got[2][used], ref[2][used]) < GEMM_TOL


def test_fp8_grouped_gemm_leaves_no_garbage_for_empty_experts():
    """Experts without rows get exactly zero weight gradient, and no padding row leaks into a result, after filling
    the allocator's cache with NaN (so anything left unwritten would show)."""
    counts = torch.tensor(COUNTS, device=DEVICE)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(sum(COUNTS), 2048, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(len(COUNTS), 1408, 2048, generator=gen) * 0.02).to(DEVICE, torch.bfloat16)
    dy = torch.randn(sum(COUNTS), 1408, generator=gen).to(DEVICE, torch.bfloat16)
    blocks = [torch.full((1 << 27,), float("nan"), dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    del blocks
    y, dx, dw = _gemm(x, w, dy, counts, fp8=True)
    for t in (y, dx, dw):
        assert torch.isfinite(t.float()).all()
    assert (dw[counts == 0] == 0).all()


def test_apply_fp8_puts_the_experts_on_the_fp8_grouped_gemm_here():
    from paraseek.parallel.fp8 import apply_fp8, fp8_experts

    assert fp8_experts()
    cfg = {**preset_config("deepseek-v2-lite"), "num_hidden_layers": 2}
    model = build_model(ModelArgs.from_hf_config(cfg))  # meta
    apply_fp8(model, "rowwise", fsdp=False)
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts and all(m.fp8_grouped for m in experts)


# ---- a 2-layer V2-Lite trained with the experts in float8 ------------------------------------------------------------
@pytest.fixture(scope="module")
def v2_lite_2l():
    # V2-Lite's shapes (layer 1 its MoE) with a 4k vocabulary: the head is not what this test is about
    cfg = {**preset_config("deepseek-v2-lite"), "num_hidden_layers": 2, "vocab_size": 4096}
    torch.manual_seed(0)
    model = build_model(ModelArgs.from_hf_config(cfg), DEVICE, torch.bfloat16)
    assert isinstance(model.layers["1"].mlp, MoE)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg["vocab_size"], (4, 513), generator=gen).to(DEVICE)
    return model, tokens


def _losses(model, tokens, fp8: bool, compile: bool = False, steps: int = 6) -> list[float]:
    model = copy.deepcopy(model)
    moe = model.layers["1"].mlp
    moe.experts.fp8_grouped = fp8
    if compile:
        moe.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    out = []
    for _ in range(steps):
        logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    del model, opt
    torch.cuda.empty_cache()
    return out


# The experts are one MoE layer of two: float8's rounding moves the loss by far less than this over 6 steps (the
# whole-model --fp8 runs of tests/gpu/test_fp8_gpu.py hold 3% over 40 steps).
LOSS_TOL = 0.03


def _assert_follows(got: list[float], ref: list[float]):
    assert all(math.isfinite(v) for v in got), got
    assert got[-1] < got[0], got  # it learns
    for step, (g, r) in enumerate(zip(got, ref)):
        assert abs(g - r) / r < LOSS_TOL, (step, got, ref)


def test_fp8_experts_train_like_bf16(v2_lite_2l):
    model, tokens = v2_lite_2l
    ref = _losses(model, tokens, fp8=False)
    got = _losses(model, tokens, fp8=True)
    assert got != ref  # the float8 path ran
    _assert_follows(got, ref)


def test_fp8_experts_train_like_bf16_with_the_moe_compiled(v2_lite_2l):
    model, tokens = v2_lite_2l
    ref = _losses(model, tokens, fp8=False)
    _assert_follows(_losses(model, tokens, fp8=True, compile=True), ref)


def test_fp8_moe_compiles_as_one_graph_under_selective_checkpointing(v2_lite_2l):
    """No graph break in the padding or torchao's float8 grouped GEMM (forward and backward), under the engine's
    selective-checkpointing policy as apply_activation_checkpointing wraps a block; equal to eager up to the fused
    kernels' bf16 rounding (which can move a few float8 roundings)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from paraseek.parallel.parallelize import _selective_policy

    model, _ = v2_lite_2l
    moe = copy.deepcopy(model.layers["1"].mlp)
    moe.experts.fp8_grouped = True
    wrapped = checkpoint_wrapper(moe, preserve_rng_state=False,
                                 context_fn=lambda: create_selective_checkpoint_contexts(_selective_policy))
    x = torch.randn(2, 512, model.args.dim, device=DEVICE, dtype=torch.bfloat16)

    def run(fn):
        moe.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        y = fn(xx)
        y.float().pow(2).mean().backward()
        return y.detach(), xx.grad, moe.experts.down_proj.grad.clone(), moe.experts.gate_proj.grad.clone()

    eager = run(wrapped)
    compiled = run(torch.compile(wrapped, fullgraph=True))
    for name, got, want in zip(("out", "d_x", "d_down_proj", "d_gate_proj"), compiled, eager):
        assert torch.isfinite(got.float()).all(), name
        assert _rel(got, want) < 2e-2, (name, _rel(got, want))
