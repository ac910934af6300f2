"""The FP8 KV cache's Triton kernels against the plain-torch references of paraseek.infer.ops: the cache writes
(rope_write_kv_, mla_prepare_) quantize each row as kv_fp8.quantize_rows does, and the paged decode kernels on an
e4m3 cache equal the reference decode on the same cache (which dequantizes it first), for GQA and MLA.

Run on the GPU machine: `PYTHONPATH=src python -m pytest -q -m gpu tests/gpu/test_kv_fp8_gpu.py` (fp32 and bf16
queries). Without a GPU, through Triton's interpreter (fp32, fewer shapes):
`PARASEEK_TRITON_INTERPRET=1 PYTHONPATH=src python -m pytest -q -m gpu tests/gpu/test_kv_fp8_gpu.py`."""

import pytest
import torch

# First: it chooses CUDA or Triton's interpreter before triton is imported. reference_ops is an autouse fixture.
from triton_device import CUDA as _CUDA, DEVICE, DTYPES, INTERPRET as _INTERPRET  # noqa: F401
from triton_device import gen as _gen, reference_ops, rel as _rel  # noqa: F401
from test_infer_kernels import _paged_layout  # noqa: E402

from paraseek.infer import kernels, kv_fp8, ops  # noqa: E402

pytestmark = pytest.mark.gpu
# max|kernel - reference| / max|reference|. The kernel multiplies the scale into the scores and P where the reference
# dequantizes first: the same sums in another order (fp32), or P rounded to bf16 (as the bf16 cache's kernel does).
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
E4M3 = torch.float8_e4m3fn


def _randn(gen: torch.Generator, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def _row_error_bound(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """kv_fp8's bound per value: max(|x| / 16, s / 1024), plus fp32 slack."""
    return torch.maximum(x.abs() / 16, s[..., None] / 1024) * (1 + 1e-5) + 1e-30


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,H,G,D", [(1, 32, 8, 128), (5, 12, 2, 128), (37, 4, 2, 16)])
def test_rope_write_kv_fp8(N, H, G, D, dtype):
    gen = _gen("rope_kv_fp8", N, H, G, D)
    S = 64
    qkv = _randn(gen, N, (H + 2 * G) * D, dtype=dtype) * torch.logspace(-2, 1, (H + 2 * G) * D).to(DEVICE, dtype)
    angles = torch.rand(300, D // 2, generator=gen) * 6
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    pos = torch.randint(0, 300, (N,), generator=gen).to(DEVICE)
    slots = torch.randperm(S, generator=gen)[:N].to(DEVICE)
    kv_ref, kv_got = (torch.zeros(S, 2, G, D, dtype=E4M3, device=DEVICE) for _ in range(2))
    sc_ref, sc_got = (torch.zeros(S, 2, G, device=DEVICE) for _ in range(2))
    q_ref, q_got, q_plain = qkv.clone(), qkv.clone(), qkv.clone()
    ops.rope_write_kv_(q_ref, H, G, cos, sin, pos, slots, kv_ref, sc_ref)
    kernels.rope_write_kv_(q_got, H, G, cos, sin, pos, slots, kv_got, sc_got)
    plain = torch.zeros(S, 2, G, D, dtype=dtype, device=DEVICE)
    ops.rope_write_kv_(q_plain, H, G, cos, sin, pos, slots, plain)  # the rows a cache in the model's dtype holds
    assert _rel(q_got, q_ref) < TOL[dtype]
    assert _rel(sc_got[slots], sc_ref[slots]) < TOL[dtype]
    x, got = plain[slots].float(), kv_fp8.dequantize_rows(kv_got[slots], sc_got[slots], torch.float32)
    assert ((got - x).abs() <= _row_error_bound(x, sc_got[slots]) + TOL[dtype] * x.abs().amax()).all()
    if dtype == torch.float32:  # the same rows: e4m3 codes agree except where a rounding tie is an ulp away
        assert (kv_got[slots].view(torch.uint8) != kv_ref[slots].view(torch.uint8)).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("N,H,C,R", [(1, 16, 512, 64), (5, 3, 32, 8)])
def test_mla_prepare_fp8(N, H, C, R, interleave, dtype):
    gen = _gen("mla_prepare_fp8", N, H, C, R, interleave)
    S = 64
    q_full = _randn(gen, N, H, 32 + R, dtype=dtype)
    kv_a = _randn(gen, N, C + R, dtype=dtype) * 3
    w = (1 + 0.1 * torch.randn(C, generator=gen)).to(DEVICE, dtype)
    angles = torch.rand(300, R // 2, generator=gen) * 6
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    pos = torch.randint(0, 300, (N,), generator=gen).to(DEVICE)
    slots = torch.randperm(S, generator=gen)[:N].to(DEVICE)
    c_ref, c_got = (torch.zeros(S, C + R, dtype=E4M3, device=DEVICE) for _ in range(2))
    sc_ref, sc_got = (torch.zeros(S, device=DEVICE) for _ in range(2))
    q_ref, q_got = q_full.clone(), q_full.clone()
    ops.mla_prepare_(q_ref[..., 32:], kv_a.clone(), w, 1e-6, cos, sin, pos, slots, c_ref, interleave, sc_ref)
    kernels.mla_prepare_(q_got[..., 32:], kv_a.clone(), w, 1e-6, cos, sin, pos, slots, c_got, interleave, sc_got)
    plain = torch.zeros(S, C + R, dtype=dtype, device=DEVICE)
    ops.mla_prepare_(q_full.clone()[..., 32:], kv_a.clone(), w, 1e-6, cos, sin, pos, slots, plain, interleave)
    assert _rel(q_got, q_ref) < TOL[dtype]
    assert _rel(sc_got[slots], sc_ref[slots]) < TOL[dtype]
    x, got = plain[slots].float(), kv_fp8.dequantize_rows(c_got[slots], sc_got[slots], torch.float32)
    assert ((got - x).abs() <= _row_error_bound(x, sc_got[slots]) + TOL[dtype] * x.abs().amax()).all()
    if dtype == torch.float32:
        assert (c_got[slots].view(torch.uint8) != c_ref[slots].view(torch.uint8)).float().mean() < 0.01


GQA_CASES = [
    # B, H, G, D, block_size, M
    (3, 32, 8, 128, 16, 36),  # groups of 4 at D=128, 3 partitions
    (3, 8, 1, 32, 64, 1),  # a group of 8, one partition: the direct path
    (37, 8, 8, 32, 64, 8),  # groups of 1
] + ([(1, 64, 8, 128, 16, 256), (2, 128, 1, 64, 256, 80), (5, 16, 4, 128, 32, 30)] if _CUDA else [])


def _fp8_cache(gen, shape_S_, unread_S):
    """Random rows of mixed magnitudes quantized per row; the slots no valid token reads get huge scales."""
    x = torch.randn(*shape_S_, generator=gen) * torch.logspace(-1, 1, shape_S_[-1])
    q, s = kv_fp8.quantize_rows(x)
    q, s = q.to(DEVICE), s.to(DEVICE)
    s[unread_S] = 1e4
    return q, s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,G,D,block_size,M", GQA_CASES)
def test_paged_decode_gqa_fp8(B, H, G, D, block_size, M, dtype):
    gen = _gen("gqa_fp8", B, H, G, D, block_size, M)
    ctx, tables, S, unread_S = _paged_layout(gen, B, M, block_size)
    q = _randn(gen, B, (H + 2 * G) * D, dtype=dtype)[:, :H * D].view(B, H, D)
    kv, sc = _fp8_cache(gen, (S, 2, G, D), unread_S)
    k, v, ks, vs = kv[:, 0], kv[:, 1], sc[:, 0], sc[:, 1]
    scale = D ** -0.5
    got = kernels.paged_decode_gqa(q, k, v, tables, ctx, block_size, scale, ks, vs)
    want = ops.paged_decode_gqa(q, k, v, tables, ctx, block_size, scale, ks, vs)
    assert got.dtype == want.dtype and got.is_contiguous()
    assert _rel(got, want) < TOL[dtype]
    # The reference on an fp8 cache is the reference on the dequantized cache.
    deq = kv_fp8.dequantize_rows(kv, sc, torch.float32)
    plain = ops.paged_decode_gqa(q.float(), deq[:, 0], deq[:, 1], tables, ctx, block_size, scale)
    assert _rel(want.float(), plain) < TOL[dtype]


MLA_CASES = [
    # B, H, C, R, block_size, M
    (3, 16, 512, 64, 16, 40),  # DeepSeek-V2-Lite's latent, 3 partitions
    (1, 128, 512, 64, 64, 2),  # 128 heads, the direct path
    (37, 4, 32, 8, 16, 24),  # tiny test dims
] + ([(37, 16, 512, 64, 16, 50), (1, 8, 512, 64, 16, 256), (2, 16, 512, 64, 256, 80)] if _CUDA else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,C,R,block_size,M", MLA_CASES)
def test_paged_decode_mla_fp8(B, H, C, R, block_size, M, dtype):
    gen = _gen("mla_fp8", B, H, C, R, block_size, M)
    ctx, tables, S, unread_S = _paged_layout(gen, B, M, block_size)
    q = _randn(gen, B, H, C + R, dtype=dtype)
    q_lat, q_pe = q[..., :C], q[..., C:]
    c, sc = _fp8_cache(gen, (S, C + R), unread_S)
    scale = (128 + R) ** -0.5
    got = kernels.paged_decode_mla(q_lat, q_pe, c, tables, ctx, block_size, scale, sc)
    want = ops.paged_decode_mla(q_lat, q_pe, c, tables, ctx, block_size, scale, sc)
    assert got.dtype == want.dtype and got.is_contiguous()
    assert _rel(got, want) < TOL[dtype]
    deq = kv_fp8.dequantize_rows(c, sc, torch.float32)
    plain = ops.paged_decode_mla(q_lat.float(), q_pe.float(), deq, tables, ctx, block_size, scale)
    assert _rel(want.float(), plain) < TOL[dtype]


@pytest.mark.skipif(not _CUDA, reason="CUDA graphs")
def test_paged_decode_fp8_cuda_graph_replays_on_new_inputs():
    gen = _gen("fp8_graph")
    B, H, G, D, C, R, block_size, M = 4, 16, 4, 128, 512, 64, 16, 40
    ctx, tables, S, unread_S = _paged_layout(gen, B, M, block_size)
    kv, ksv = _fp8_cache(gen, (S, 2, G, D), unread_S)
    c, cs = _fp8_cache(gen, (S, C + R), unread_S)
    q = _randn(gen, B, H, D, dtype=torch.bfloat16)
    ql = _randn(gen, B, H, C + R, dtype=torch.bfloat16)

    def step():
        return (kernels.paged_decode_gqa(q, kv[:, 0], kv[:, 1], tables, ctx, block_size, D ** -0.5, ksv[:, 0],
                                         ksv[:, 1]),
                kernels.paged_decode_mla(ql[..., :C], ql[..., C:], c, tables, ctx, block_size, 0.07, cs))

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    q.copy_(_randn(gen, B, H, D, dtype=torch.bfloat16))
    ql.copy_(_randn(gen, B, H, C + R, dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    want = step()
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])


# ---- the engine on CUDA -----------------------------------------------------------------------------------------------
@pytest.mark.skipif(not _CUDA, reason="the engine on CUDA")
@pytest.mark.parametrize("which", ["gqa", "mla"])
def test_engine_fp8_cache_kernels_and_graphs_equal_the_reference_path_fp32(which):
    """fp32 weights, an fp8 cache: the Triton path (eager and CUDA-graph replay) gives the plain-torch path's greedy
    tokens (the same e4m3 rows; the kernels sum in another order)."""
    import test_infer_gpu as eng

    cfg = eng.GQA if which == "gqa" else dict(eng.MLA, first_k_dense_replace=3)
    prompts = eng._prompts(12, cfg["vocab_size"])
    ref, _ = eng._run(cfg, torch.float32, kernels=False, eager=True, prompts=prompts, kv_cache_dtype="fp8")
    eager, _ = eng._run(cfg, torch.float32, kernels=True, eager=True, prompts=prompts, kv_cache_dtype="fp8")
    graphs, engine = eng._run(cfg, torch.float32, kernels=True, eager=False, prompts=prompts, kv_cache_dtype="fp8")
    assert engine.runner.cache.k[0].dtype == E4M3 and engine.runner.graphs
    assert eager == ref and graphs == ref


@pytest.mark.skipif(not _CUDA, reason="the engine on CUDA")
@pytest.mark.parametrize("which", ["gqa", "mla"])
def test_engine_fp8_cache_bf16_logits_near_the_bf16_cache(which):
    """bf16: one graph-replayed decode step's logits with an fp8 cache against the same step with a bf16 cache (the
    quantization's whole effect on the step), relative 5e-2; and a token takes 1.88x (GQA, head_dim 64) or 1.99x (MLA) fewer bytes."""
    import test_infer_gpu as eng
    from paraseek.infer.engine import Engine, EngineConfig
    from paraseek.infer.sampling import SamplingParams

    cfg = eng.GQA if which == "gqa" else eng.MLA
    prompts = eng._prompts(5, cfg["vocab_size"], seed=1)
    logits, reports = {}, {}
    for dtype in ("auto", "fp8"):
        engine = Engine(eng._model(cfg, torch.bfloat16), EngineConfig(max_batched_tokens=2048, kv_cache_dtype=dtype,
                                                                      gpu_memory_utilization=0.3, max_num_seqs=64),
                        log=lambda *_: None)
        reports[dtype] = engine.report
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        engine.step()
        engine.flush()
        hb, _ = engine._host_batch(engine.scheduler.schedule())
        assert engine.runner.graph_key(hb) is not None
        logits[dtype] = engine.runner.run(hb).float().clone()
        del engine
        torch.cuda.empty_cache()
    got, want = logits["fp8"], logits["auto"]
    assert ((got - want).abs().max() / want.abs().max()).item() < 5e-2
    fp8, auto = reports["fp8"], reports["auto"]
    assert fp8.extra["model_dtype_bytes_per_token"] == auto.bytes_per_token
    assert auto.bytes_per_token / fp8.bytes_per_token > 1.85  # GQA head_dim 64: 128 / 68 = 1.88; MLA 1.99
