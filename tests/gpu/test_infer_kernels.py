"""The Triton kernels of paraseek.infer.kernels against the plain-torch reference of paraseek.infer.ops, op by op, on
fresh random inputs: norms, SwiGLU, RoPE (in place, strided views), paged decode for GQA (groups of 1, 4, 8...) and
MLA (DeepSeek's 512 + 64 latent and tiny test dims), block sizes 16 to 256, permuted block tables, context lengths
from 1 token to past the largest fixed-size partition, and a CUDA-graph capture replayed on new inputs.

Run on the GPU machine: `make test-gpu` or `python3 -m pytest -q -m gpu tests/gpu` (fp32 and bf16). Without a GPU,
PARASEEK_TRITON_INTERPRET=1 runs the fp32 cases on CPU through Triton's interpreter (a smaller set of shapes):
`PARASEEK_TRITON_INTERPRET=1 PYTHONPATH=src python -m pytest -q -m gpu tests/gpu/test_infer_kernels.py`."""

import pytest
import torch

# First: it chooses CUDA or Triton's interpreter before triton is imported. reference_ops is an autouse fixture.
from triton_device import CUDA as _CUDA, DEVICE, DTYPES, INTERPRET as _INTERPRET  # noqa: F401
from triton_device import gen as _gen, reference_ops, rel as _rel  # noqa: F401

from paraseek.infer import kernels, ops  # noqa: E402

pytestmark = pytest.mark.gpu
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # max|kernel - reference| / max|reference|


def _randn(gen: torch.Generator, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


# ---- norms and activations -----------------------------------------------------------------------------------------
NORM_SHAPES = [(1, 64), (7, 100), (33, 2048), (4, 7168)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,E", NORM_SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm(N, E, strided, dtype):
    gen = _gen("rms", N, E, strided)
    x = _randn(gen, N, E + 24, dtype=dtype)[:, 8:8 + E] if strided else _randn(gen, N, E, dtype=dtype)
    w = (1 + 0.1 * _randn(gen, E)).to(dtype)
    got = kernels.rms_norm(x, w, 1e-6)
    want = ops.rms_norm(x, w, 1e-6)
    assert got.dtype == want.dtype and got.is_contiguous()
    assert _rel(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,E", NORM_SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_add_rms_norm(N, E, strided, dtype):
    gen = _gen("add_rms", N, E, strided)
    if strided:  # x and the residual as column slices of wider buffers
        x = _randn(gen, N, E + 16, dtype=dtype)[:, 16:]
        res_buf = _randn(gen, N, 2 * E, dtype=dtype)
        ref_buf = res_buf.clone()
        res, res_ref = res_buf[:, :E], ref_buf[:, :E]
    else:
        x = _randn(gen, N, E, dtype=dtype)
        res = _randn(gen, N, E, dtype=dtype)
        res_ref = res.clone()
    w = (1 + 0.1 * _randn(gen, E)).to(dtype)
    got = kernels.add_rms_norm(x, res, w, 1e-5)
    want = ops.add_rms_norm(x, res_ref, w, 1e-5)
    assert got.dtype == want.dtype and got.is_contiguous()
    assert torch.equal(res, res_ref)  # the same fp32 sum, rounded once to the residual's dtype
    assert _rel(got, want) < TOL[dtype]
    if strided:  # the columns beside the residual view are untouched
        assert torch.equal(res_buf[:, E:], ref_buf[:, E:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,F", [(1, 16), (5, 1408), (3, 100), (2, 5000)])
@pytest.mark.parametrize("strided", [False, True])
def test_silu_mul(N, F, strided, dtype):
    gen = _gen("silu", N, F, strided)
    gu = _randn(gen, N, 2 * F + 10, dtype=dtype)[:, :2 * F] if strided else _randn(gen, N, 2 * F, dtype=dtype)
    gu = gu * 3  # reach silu's tails
    got = kernels.silu_mul(gu)
    want = ops.silu_mul(gu)
    assert got.dtype == want.dtype and got.is_contiguous()
    assert _rel(got, want) < TOL[dtype]


def test_kernels_switch_routes_ops():
    """ops.use_kernels(True) sends the op names to kernels.* with the same arguments."""
    gen = _gen("switch")
    x, w = _randn(gen, 3, 64), _randn(gen, 64)
    want = kernels.rms_norm(x, w, 1e-6)
    ops.use_kernels(True)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), want)


# ---- RoPE -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("N,H,R", [(5, 4, 64), (3, 16, 128), (7, 3, 8), (2, 2, 16), (4, 5, 32), (3, 40, 96)])
def test_rope_in_place_on_a_strided_view(N, H, R, interleave, dtype):
    """x is the middle slice of a fused projection [N, 3, H, R + 8] (token and head strides both arbitrary); the
    kernel rotates it in place and leaves the rest of the buffer alone."""
    gen = _gen("rope", N, H, R, interleave)
    P = 50
    buf = _randn(gen, N, 3, H, R + 8, dtype=dtype)
    x = buf[:, 1, :, 4:4 + R]
    assert x.stride(-1) == 1 and not x.is_contiguous()
    angles = torch.rand(P, R // 2, generator=gen) * 6.3
    mscale = 1 + torch.rand((), generator=gen).item()  # a YaRN-like attention factor folded into the tables
    cos, sin = (angles.cos() * mscale).to(DEVICE), (angles.sin() * mscale).to(DEVICE)
    positions = torch.randint(0, P, (N,), generator=gen).to(DEVICE)
    want_buf = buf.clone()
    ops.rope_(want_buf[:, 1, :, 4:4 + R], cos, sin, positions, interleave)
    assert kernels.rope_(x, cos, sin, positions.int(), interleave) is None
    assert _rel(buf, want_buf) < TOL[dtype]
    untouched = torch.ones_like(buf, dtype=torch.bool)
    untouched[:, 1, :, 4:4 + R] = False
    assert torch.equal(buf[untouched], want_buf[untouched])


# ---- paged decode attention ------------------------------------------------------------------------------------------
CAP_PARTITIONS = kernels.PARTITION * kernels.MAX_PARTITIONS  # past this many tokens a partition grows


def _paged_layout(gen: torch.Generator, B: int, M: int, block_size: int):
    """Random context lengths (1 token, the full capacity, partition edges and random ones), block tables holding a
    random permutation of the physical blocks (and spare blocks nobody owns), -1 past each sequence's last block."""
    cap = M * block_size
    ctx = torch.randint(1, cap + 1, (B,), generator=gen)
    specials = [cap, 1, kernels.PARTITION, kernels.PARTITION + 1, 2 * kernels.PARTITION - 1, CAP_PARTITIONS + 1,
                kernels.SHORT_CONTEXT, kernels.SHORT_CONTEXT + 1, kernels.SHORT_PARTITION + 1]
    for i, c in enumerate([c for c in specials if c <= cap][:B]):
        ctx[i] = c
    num_blocks = B * M + 5
    tables = torch.randperm(num_blocks, generator=gen)[:B * M].view(B, M).int()
    used = (ctx + block_size - 1) // block_size
    tables[torch.arange(M)[None, :] >= used[:, None]] = -1
    # Poison every slot that no valid token reads: a kernel that reads one is far off.
    valid_slots = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for b in range(B):
        t = torch.arange(int(ctx[b]))
        valid_slots[tables[b, t // block_size].long() * block_size + t % block_size] = True
    return ctx.int().to(DEVICE), tables.to(DEVICE), num_blocks * block_size, ~valid_slots.to(DEVICE)


GQA_CASES_INTERPRET = [
    # B, H, G, D, block_size, M
    (3, 32, 8, 128, 16, 36),  # groups of 4 at D=128, 3 partitions
    (3, 4, 2, 16, 16, 40),  # groups of 2, tiny test dims
    (37, 8, 8, 32, 64, 8),  # groups of 1 (MHA), 2 partitions
    (3, 8, 1, 32, 64, 1),  # a group of 8 (MQA), one partition: the direct path
    (2, 4, 1, 16, 256, 66),  # past MAX_PARTITIONS x PARTITION tokens: partitions of 512
]
GQA_CASES_CUDA = [
    (3, 32, 8, 128, 16, 80),
    (37, 12, 2, 128, 64, 20),  # groups of 6 (padded to 16)
    (1, 64, 8, 128, 16, 256),  # groups of 8, 4K context, batch 1
    (37, 32, 32, 64, 16, 40),  # groups of 1
    (3, 4, 2, 16, 16, 64),
    (5, 16, 4, 128, 32, 30),
    (3, 8, 2, 64, 128, 9),
    (4, 8, 1, 128, 64, 1),  # direct path
    (2, 128, 1, 64, 256, 80),  # a group of 128 (two tiles of 64 heads), past 16K tokens
    (1, 8, 2, 128, 16, 1100),  # 17.6K context, block 16
]
GQA_CASES = GQA_CASES_CUDA if _CUDA else GQA_CASES_INTERPRET


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,H,G,D", [(1, 32, 8, 128), (5, 12, 2, 128), (37, 4, 2, 16), (3, 8, 8, 64)])
def test_rope_write_kv(N, H, G, D, dtype):
    """Fused RoPE of q and k in a q|k|v projection output plus the k/v cache write, against rope_ + index_copy_."""
    gen = _gen("rope_kv", N, H, G, D)
    S = 64
    qkv = _randn(gen, N, (H + 2 * G) * D + 16, dtype=dtype)[:, :(H + 2 * G) * D]  # a strided row view
    angles = torch.rand(300, D // 2, generator=gen) * 6
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    pos = torch.randint(0, 300, (N,), generator=gen).to(DEVICE)
    slots = torch.randperm(S, generator=gen)[:N].to(DEVICE)
    kv_ref = _randn(gen, S, 2, G, D, dtype=dtype)
    kv_got = kv_ref.clone()
    q_ref, q_got = qkv.clone(), qkv.clone()
    ops.rope_write_kv_(q_ref, H, G, cos, sin, pos, slots, kv_ref)
    kernels.rope_write_kv_(q_got, H, G, cos, sin, pos, slots, kv_got)
    assert _rel(q_got, q_ref) < TOL[dtype]
    assert _rel(kv_got, kv_ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("N,H,C,R", [(1, 16, 512, 64), (5, 3, 32, 8), (9, 128, 512, 64)])
def test_mla_prepare(N, H, C, R, interleave, dtype):
    """MLA's latent norm + rope key + cache write + the queries' rope, in one kernel, against rms_norm, rope_ and
    index_copy_ (the queries' rope part a strided view of the q projection, as the model passes it)."""
    gen = _gen("mla_prepare", N, H, C, R, interleave)
    S = 64
    q_full = _randn(gen, N, H, 32 + R, dtype=dtype)
    kv_a = _randn(gen, N, C + R + 8, dtype=dtype)[:, :C + R]  # a view into a wider projection output
    w = (1 + 0.1 * torch.randn(C, generator=gen)).to(DEVICE, dtype)
    angles = torch.rand(300, R // 2, generator=gen) * 6
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    pos = torch.randint(0, 300, (N,), generator=gen).to(DEVICE)
    slots = torch.randperm(S, generator=gen)[:N].to(DEVICE)
    c_ref = _randn(gen, S, C + R, dtype=dtype)
    c_got, q_ref, q_got = c_ref.clone(), q_full.clone(), q_full.clone()
    ops.mla_prepare_(q_ref[..., 32:], kv_a.clone(), w, 1e-6, cos, sin, pos, slots, c_ref, interleave)
    kernels.mla_prepare_(q_got[..., 32:], kv_a.clone(), w, 1e-6, cos, sin, pos, slots, c_got, interleave)
    assert _rel(q_got, q_ref) < TOL[dtype]
    assert _rel(c_got, c_ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,G,D,block_size,M", GQA_CASES)
def test_paged_decode_gqa(B, H, G, D, block_size, M, dtype):
    gen = _gen("gqa", B, H, G, D, block_size, M)
    ctx, tables, S, unread_S = _paged_layout(gen, B, M, block_size)
    # q a view of a fused projection's output; K and V two halves of one cache tensor [S, 2, G, D].
    q = _randn(gen, B, (H + 2 * G) * D, dtype=dtype)[:, :H * D].view(B, H, D)
    kv = _randn(gen, S, 2, G, D, dtype=dtype)
    kv[unread_S] = 1e4
    k, v = kv[:, 0], kv[:, 1]
    scale = D ** -0.5
    got = kernels.paged_decode_gqa(q, k, v, tables, ctx, block_size, scale)
    want = ops.paged_decode_gqa(q, k, v, tables, ctx, block_size, scale)
    assert got.dtype == want.dtype and got.is_contiguous()
    assert _rel(got, want) < TOL[dtype]


MLA_CASES_INTERPRET = [
    # B, H, C, R, block_size, M
    (3, 16, 512, 64, 16, 40),  # DeepSeek-V2-Lite's latent, 3 partitions
    (1, 128, 512, 64, 64, 2),  # V2/V3's 128 heads, one partition: the direct path
    (37, 4, 32, 8, 16, 24),  # tiny test model dims, batch 37
    (2, 4, 32, 8, 256, 66),  # past MAX_PARTITIONS x PARTITION tokens
    (2, 96, 32, 8, 16, 20),  # two tiles of 64 heads, the second one half empty
]
MLA_CASES_CUDA = [
    (3, 16, 512, 64, 16, 40),
    (37, 16, 512, 64, 16, 50),
    (3, 128, 512, 64, 64, 20),
    (1, 8, 512, 64, 16, 256),  # V2-Lite at tp=2, 4K context, batch 1
    (5, 64, 512, 64, 32, 40),
    (1, 128, 512, 64, 64, 2),
    (37, 4, 32, 8, 16, 24),
    (2, 16, 512, 64, 256, 80),  # past 16K tokens
    (3, 96, 512, 64, 16, 40),  # two tiles of 64 heads, the second one half empty
    (4, 32, 512, 64, 16, 40),  # V2 at tp=4
]
MLA_CASES = MLA_CASES_CUDA if _CUDA else MLA_CASES_INTERPRET


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,C,R,block_size,M", MLA_CASES)
def test_paged_decode_mla(B, H, C, R, block_size, M, dtype):
    gen = _gen("mla", B, H, C, R, block_size, M)
    ctx, tables, S, unread_S = _paged_layout(gen, B, M, block_size)
    q = _randn(gen, B, H, C + R, dtype=dtype)  # q_lat and q_pe: two slices of one tensor
    q_lat, q_pe = q[..., :C], q[..., C:]
    cache = _randn(gen, S, C + R, dtype=dtype)
    cache[unread_S] = 1e4
    scale = (128 + R) ** -0.5  # DeepSeek scales by the un-absorbed qk head dim
    got = kernels.paged_decode_mla(q_lat, q_pe, cache, tables, ctx, block_size, scale)
    want = ops.paged_decode_mla(q_lat, q_pe, cache, tables, ctx, block_size, scale)
    assert got.dtype == want.dtype and got.is_contiguous()
    assert _rel(got, want) < TOL[dtype]


def test_paged_decode_cuda_graph_replays_on_new_inputs():
    """Capture both decode ops once, then change q, the context lengths, the block tables and the caches in place:
    each replay must match the reference on the new contents (grids and workspaces depend on shapes only)."""
    if not _CUDA:
        pytest.skip("CUDA graphs need a GPU; the interpreter path has none")
    dtype, B, M, block_size = torch.bfloat16, 5, 40, 16
    H, G, D, Hm, C, R = 16, 4, 128, 16, 512, 64

    def fill(seed: int):
        gen = _gen("graph", seed)
        ctx, tables, S, _ = _paged_layout(gen, B, M, block_size)
        return dict(ctx=ctx, tables=tables, q=_randn(gen, B, H, D, dtype=dtype),
                    k=_randn(gen, S, G, D, dtype=dtype), v=_randn(gen, S, G, D, dtype=dtype),
                    q_lat=_randn(gen, B, Hm, C, dtype=dtype), q_pe=_randn(gen, B, Hm, R, dtype=dtype),
                    c=_randn(gen, S, C + R, dtype=dtype))

    static = fill(0)

    def step():
        s = static
        return (kernels.paged_decode_gqa(s["q"], s["k"], s["v"], s["tables"], s["ctx"], block_size, D ** -0.5),
                kernels.paged_decode_mla(s["q_lat"], s["q_pe"], s["c"], s["tables"], s["ctx"], block_size, 0.07))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and load every kernel before the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_gqa, out_mla = step()

    for seed in (1, 2):
        new = fill(seed)
        for name, t in new.items():
            static[name].copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        want_gqa = ops.paged_decode_gqa(new["q"], new["k"], new["v"], new["tables"], new["ctx"], block_size, D ** -0.5)
        want_mla = ops.paged_decode_mla(new["q_lat"], new["q_pe"], new["c"], new["tables"], new["ctx"], block_size,
                                        0.07)
        assert _rel(out_gqa, want_gqa) < TOL[dtype]
        assert _rel(out_mla, want_mla) < TOL[dtype]
