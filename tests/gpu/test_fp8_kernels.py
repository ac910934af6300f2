"""The FP8 kernels against their plain-torch references: the block-FP8 fused MoE (moe_kernels.fused_moe_fp8 against
moe.fused_moe_fp8) and the block-FP8 GEMM (fp8_kernels.block_mm against fp8.block_mm_reference) -- both also under
Triton's interpreter on CPU, where loads of float8 and tl.dot of float8 operands work -- and, on the GPU only, the
1 x 128 activation quantization kernel (the interpreter rounds float32 -> float8e4nv wrongly where the rounding
carries into the exponent), torch._scaled_mm's blockwise path on sm90, and a CUDA-graph replay of the FP8 MoE.

On the GPU machine: `python3 -m pytest -q -m gpu tests/gpu/test_fp8_kernels.py`. Without a GPU:
`PARASEEK_TRITON_INTERPRET=1 PYTHONPATH=src python -m pytest -q -m gpu tests/gpu/test_fp8_kernels.py`."""

import pytest
import torch

# First: it chooses CUDA or Triton's interpreter before triton is imported. reference_ops is an autouse fixture.
from triton_device import CUDA, DEVICE, gen as _gen, reference_ops, rel as _rel  # noqa: F401

from paraseek.infer import fp8, fp8_kernels, moe, moe_kernels  # noqa: E402
from paraseek.models.hf import quantize_fp8  # noqa: E402

pytestmark = pytest.mark.gpu
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a GPU (see the module docstring)")
# Kernel and reference compute the same 128-wide partial sums in another order (fp32). The MoE quantizes h between
# its two GEMMs, and an h element an fp32 ulp from an e4m3 rounding boundary may round either way (6-12% of that
# element): relative L2 over the output absorbs a few such flips (1e-3 each at most here); a wrong scale, group or
# row costs > 3e-2.
MOE_TOL = 2e-3
MM_TOL = 1e-5  # max|kernel - reference| / max|reference|: no quantization between, only the summation order


def _x(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def _experts(gen, E, D, F_):
    """FP8 expert stacks whose 128 x 128 blocks have different magnitudes (so that a scale read from a wrong block
    shows)."""
    w13 = torch.randn(E, 2 * F_, D, generator=gen) * D**-0.5 * torch.rand(E, 2 * F_, 1, generator=gen).add(0.25)
    w2 = torch.randn(E, D, F_, generator=gen) * F_**-0.5 * torch.rand(E, 1, F_, generator=gen).add(0.25)
    return [t.to(DEVICE) for t in (*quantize_fp8(w13), *quantize_fp8(w2))]


def _routing(gen, N, K, E_routed):
    return torch.rand(N, E_routed, generator=gen).topk(K, dim=1).indices.int().to(DEVICE)


def _config(bm, bn, bk, warps=4, stages=2):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


def _l2(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


# (N, E_total, n_shared, K, D, F, config). D and F not multiples of 128 (ragged scale groups, masked tails) and
# multiples of it; F not a multiple of 128 puts the up rows' first block inside the gate rows' last (one grid over
# the 2F rows).
MOE_CASES_INTERPRET = [
    (1, 9, 1, 2, 200, 80, _config(16, 32, 64)),
    (3, 9, 0, 2, 256, 128, _config(16, 64, 128)),
    (17, 9, 1, 2, 256, 96, _config(16, 32, 32)),
    (40, 66, 2, 6, 128, 64, _config(16, 32, 64)),
    (64, 9, 1, 2, 136, 200, _config(32, 64, 128)),
    (5, 66, 2, 6, 128, 128, None),  # the default config
]
MOE_CASES_CUDA = MOE_CASES_INTERPRET + [
    (n, 257, 1, 8, 7168, 256, cfg) for n in (1, 16, 200) for cfg in (None, _config(16, 64, 128, 4, 3))  # V3, tp 8
] + [(n, 66, 2, 6, 2048, 1408, None) for n in (1, 64)]  # V2-Lite's shape in FP8


@pytest.mark.parametrize("N,E,n_shared,K,D,F_,config", MOE_CASES_CUDA if CUDA else MOE_CASES_INTERPRET)
def test_fused_moe_fp8(N, E, n_shared, K, D, F_, config):
    gen = _gen("moe-fp8", N, E, n_shared, K, D, F_, str(config))
    dtypes = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]
    q13, s13, q2, s2 = _experts(gen, E, D, F_)
    idx = _routing(gen, N, K, E - n_shared)
    w = torch.rand(N, K, generator=gen).to(DEVICE)
    for dtype in dtypes:
        x = _x(gen, N, D, dtype=dtype)
        got = moe_kernels.fused_moe_fp8(x, q13, s13, q2, s2, w, idx, n_shared, config)
        want = moe.fused_moe_fp8(x, q13, s13, q2, s2, w, idx, n_shared)
        assert got.dtype == dtype and got.shape == (N, D)
        assert _l2(got, want) < (MOE_TOL if dtype == torch.float32 else 1e-2)


# (M, N, K): decode and prefill rows, ragged N and K
MM_CASES = [(1, 80, 200), (5, 300, 256), (40, 128, 384), (70, 192, 136)]
MM_CASES_CUDA = MM_CASES + [(1, 7168, 2048), (16, 2112, 7168), (300, 4096, 7168)]


@pytest.mark.parametrize("M,N,K", MM_CASES_CUDA if CUDA else MM_CASES)
def test_block_mm(M, N, K):
    gen = _gen("mm", M, N, K)
    x = _x(gen, M, K)
    wq, ws = (t.to(DEVICE) for t in quantize_fp8(torch.randn(N, K, generator=gen) * K**-0.5))
    xq, xs = fp8.quantize_1x128(x)
    got = fp8_kernels.block_mm(xq, xs, wq, ws, torch.float32)
    want = fp8.block_mm_reference(xq, xs, wq, ws, torch.float32)
    assert _rel(got, want) < MM_TOL


@cuda_only
@pytest.mark.parametrize("N,K", [(1, 7168), (7, 200), (300, 2048)])
def test_quantize_kernel_equals_the_reference(N, K):
    x = _x(_gen("quant", N, K), N, K, dtype=torch.bfloat16, scale=3.0)
    x[0, :128] = 0  # an all-zero group: zeros, not NaN
    q, s = fp8_kernels.quantize_1x128(x)
    x32 = x.float().cpu()
    G = -(-K // 128)
    pad = torch.nn.functional.pad(x32, (0, G * 128 - K)).view(N, G, 128)
    s_ref = pad.abs().amax(-1).clamp_min(1e-12) / 448
    q_ref = (pad / s_ref[..., None]).view(N, -1)[:, :K].to(torch.float8_e4m3fn)
    assert s.stride() == (1, N)
    torch.testing.assert_close(s.cpu(), s_ref, rtol=2**-22, atol=0)  # Triton's fp32 division: within 2 ulp
    # fp32 division on the GPU may round one ulp away from the CPU's: allow an e4m3 neighbour on a few elements
    diff = (q.float().cpu() - q_ref.float()).abs()
    assert (diff > 0).float().mean() < 1e-3 and (diff <= q_ref.float().abs() * 2**-3 + 2**-9).all()


@cuda_only
@pytest.mark.parametrize("M,O,I", [(1, 2112, 7168), (16, 7168, 2048), (300, 1536, 7168)])
def test_fp8_linear_on_the_gpu(M, O, I):
    """Fp8Linear on this GPU (cuBLASLt's blockwise _scaled_mm on sm90 when this torch runs it, else the Triton GEMM)
    against the plain-torch product of the same quantized operands."""
    gen = _gen("lin", M, O, I)
    w = torch.randn(O, I, generator=gen) * I**-0.5
    q, s = (t.cuda() for t in quantize_fp8(w))
    lin = fp8.Fp8Linear(q, s)
    x = _x(gen, M, I, dtype=torch.bfloat16)
    got = lin(x)
    xq, xs = fp8.quantize_1x128(x)
    want = fp8.block_mm_reference(xq, xs, q, s, torch.float32)
    assert got.dtype == torch.bfloat16
    assert _l2(got, want) < 1e-2  # bf16 output: 2^-8 relative
    if torch.cuda.get_device_capability()[0] == 9:
        print(f"sm90 backend: {lin.backend}")


@cuda_only
def test_fused_moe_fp8_cuda_graph_replays_on_new_inputs():
    N, E, ns, K, D, F_ = 24, 257, 1, 8, 7168, 256
    gen = _gen("graph-fp8")
    q13, s13, q2, s2 = _experts(gen, E, D, F_)
    kw = dict(score_func="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4, top_k=K, norm_topk_prob=True,
              scaling=2.5)
    static = dict(x=_x(gen, N, D, dtype=torch.bfloat16), logits=_x(gen, N, E - ns))

    def step():
        w, idx = moe_kernels.route(static["logits"], None, **kw)
        return moe_kernels.fused_moe_fp8(static["x"], q13, s13, q2, s2, w, idx, ns)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (1, 2):
        g = _gen("graph-fp8", seed)
        new = dict(x=_x(g, N, D, dtype=torch.bfloat16), logits=_x(g, N, E - ns, scale=3.0))
        for name, t in new.items():
            static[name].copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        want = moe.fused_moe_fp8(new["x"], q13, s13, q2, s2, *moe.route(new["logits"], None, **kw), ns)
        assert _l2(out, want) < 1e-2
