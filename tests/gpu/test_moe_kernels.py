"""The Triton kernels of paraseek.infer.moe_kernels against the plain-torch references of paraseek.infer.moe: the
router (all three top-k methods, both score functions, 8 to 256 experts, 1 to 8 per token, 1 to 300 tokens), the
counting sort of the slots (its invariants, and equal to the reference element by element), the fused experts
(1 to 200 tokens, with and without shared experts, every expert hit or most unused, several tile configs) and a
CUDA-graph capture replayed on new inputs.

Run on the GPU machine: `python3 -m pytest -q -m gpu tests/gpu/test_moe_kernels.py` (fp32 and bf16, larger shapes).
Without a GPU, PARASEEK_TRITON_INTERPRET=1 runs the fp32 cases on CPU through Triton's interpreter (small shapes):
`PARASEEK_TRITON_INTERPRET=1 PYTHONPATH=src python -m pytest -q -m gpu tests/gpu/test_moe_kernels.py`."""

import pytest
import torch

# First: it chooses CUDA or Triton's interpreter before triton is imported. reference_ops is an autouse fixture.
from triton_device import CUDA as _CUDA, DEVICE, DTYPES, INTERPRET as _INTERPRET  # noqa: F401
from triton_device import gen as _gen, reference_ops, rel as _rel  # noqa: F401

from paraseek.infer import moe, moe_kernels, ops  # noqa: E402

pytestmark = pytest.mark.gpu
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # max|kernel - reference| / max|reference|
NEAR_TIE = 1e-5  # router scores closer than this may be ordered either way by two correct implementations


def _randn(gen: torch.Generator, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


# ---- route ----------------------------------------------------------------------------------------------------------
# (E, K, n_group, topk_group, N, topk_method, score_func, norm)
ROUTE_CASES_INTERPRET = [
    (8, 1, 1, 1, 1, "greedy", "softmax", False),
    (8, 2, 4, 2, 5, "noaux_tc", "sigmoid", True),  # tiny-moe
    (8, 2, 4, 2, 3, "group_limited_greedy", "softmax", True),
    (64, 6, 1, 1, 300, "greedy", "softmax", False),  # DeepSeek-V2-Lite
    (64, 6, 1, 1, 17, "noaux_tc", "sigmoid", True),  # bias without groups
    (96, 4, 3, 2, 33, "group_limited_greedy", "sigmoid", False),  # groups of 32
    (160, 6, 8, 3, 64, "group_limited_greedy", "softmax", False),  # DeepSeek-V2: groups of 20 (padded to 32)
    (256, 8, 8, 4, 300, "noaux_tc", "sigmoid", True),  # DeepSeek-V3
    (256, 8, 1, 1, 7, "greedy", "sigmoid", True),
    (256, 3, 8, 1, 9, "noaux_tc", "softmax", True),  # one group kept
]
ROUTE_CASES_CUDA = ROUTE_CASES_INTERPRET + [
    (384, 8, 8, 4, 1000, "noaux_tc", "sigmoid", True),
    (512, 8, 1, 1, 100, "greedy", "softmax", True),
    (160, 6, 8, 3, 1000, "group_limited_greedy", "softmax", False),
]
ROUTE_CASES = ROUTE_CASES_CUDA if _CUDA else ROUTE_CASES_INTERPRET


def _clear_rows(logits, bias, E, K, G, TG, method, score_func) -> torch.Tensor:
    """Rows whose choice is not a near-tie: the top K + 1 choice scores (after the group mask) and, with groups, the
    group scores around the topk_group cut are all more than NEAR_TIE apart."""
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    clear = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    if method != "greedy" and G > 1:
        grouped = choice.view(-1, G, E // G)
        gs = grouped.topk(2, -1).values.sum(-1) if method == "noaux_tc" else grouped.amax(-1)
        gs_sorted = gs.sort(-1, descending=True).values
        if TG < G:
            clear &= (gs_sorted[:, TG - 1] - gs_sorted[:, TG]) > NEAR_TIE
        keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gs.topk(TG, -1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // G, 1), float("-inf"))
    top = choice.topk(min(K + 1, E), -1).values
    gaps = top[:, :-1] - top[:, 1:]
    finite = torch.isfinite(top[:, 1:])
    clear &= torch.where(finite, gaps > NEAR_TIE, True).all(-1)
    return clear


@pytest.mark.parametrize("E,K,G,TG,N,method,score_func,norm", ROUTE_CASES)
def test_route(E, K, G, TG, N, method, score_func, norm):
    gen = _gen("route", E, K, G, TG, N, method, score_func, norm)
    logits = _randn(gen, N, E, scale=2.0)
    bias = _randn(gen, E, scale=0.05) if method == "noaux_tc" else None
    kw = dict(score_func=score_func, topk_method=method, n_group=G, topk_group=TG, top_k=K, norm_topk_prob=norm,
              scaling=2.5)
    want_w, want_i = moe.route(logits, bias, **kw)
    got_w, got_i = moe_kernels.route(logits, bias, **kw)
    assert got_w.dtype == torch.float32 and got_i.dtype == torch.int32 and got_i.shape == (N, K)
    clear = _clear_rows(logits, bias, E, K, G, TG, method, score_func)
    assert clear.float().mean() > 0.9  # the comparison below covers almost every row
    # Same experts in the same order, same weights, wherever the choice is not a near-tie.
    assert torch.equal(got_i[clear], want_i[clear])
    torch.testing.assert_close(got_w[clear], want_w[clear], rtol=1e-5, atol=1e-6)
    # Everywhere: K distinct experts in range.
    assert ((got_i >= 0) & (got_i < E)).all()
    assert (got_i.sort(-1).values.diff(dim=-1) > 0).all()


def test_route_breaks_ties_towards_the_lower_expert():
    logits = torch.zeros(2, 16, device=DEVICE)
    logits[1, 3] = logits[1, 9] = 1.0
    w, i = moe_kernels.route(logits, None, score_func="softmax", topk_method="greedy", n_group=1, topk_group=1,
                             top_k=4, norm_topk_prob=False, scaling=1.0)
    assert i.tolist() == [[0, 1, 2, 3], [3, 9, 0, 1]]
    torch.testing.assert_close(w[0], torch.full((4,), 1 / 16, device=DEVICE))


# ---- align_slots -----------------------------------------------------------------------------------------------------
def _routing(gen, N, K, E_routed, skew: bool) -> torch.Tensor:
    """[N, K] int32: K distinct experts per token, uniformly or (skew) mostly the first few experts."""
    pref = torch.rand(N, E_routed, generator=gen)
    if skew:
        pref += torch.linspace(4, 0, E_routed)
    return pref.topk(K, dim=1).indices.int().to(DEVICE)


def _check_layout(sorted_P, tile_T, expert_S, E, block_m):
    """The layout's invariants, whatever produced it."""
    S = expert_S.numel()
    P, T = sorted_P.numel(), tile_T.numel()
    assert P == T * block_m == moe.max_tiles(S, E, block_m) * block_m
    sorted_P, tile_T, expert_S = sorted_P.long().cpu(), tile_T.long().cpu(), expert_S.cpu()
    real = sorted_P < S
    assert ((sorted_P >= 0) & (sorted_P <= S)).all()  # a slot, or the sentinel S
    assert torch.equal(sorted_P[real].sort().values, torch.arange(S))  # every slot exactly once
    live = tile_T >= 0
    n_live = int(live.sum())
    assert live[:n_live].all() and not live[n_live:].any()  # -1 only past the last tile
    counts = torch.bincount(expert_S, minlength=E)
    assert n_live == int(((counts + block_m - 1) // block_m).sum())
    assert (tile_T[:n_live].diff() >= 0).all()  # experts in order
    tile_of_P = tile_T.repeat_interleave(block_m)
    assert torch.equal(expert_S[sorted_P[real]], tile_of_P[real])  # a tile holds only its expert's slots
    assert not real[n_live * block_m:].any()
    for e in expert_S.unique().tolist():  # within an expert: slot order, real rows first, then padding
        rows = tile_of_P == e
        mine = sorted_P[rows]
        n = int(counts[e])
        assert torch.equal(mine[:n], (expert_S == e).nonzero().flatten())
        assert (mine[n:] == S).all() and mine.numel() - n < block_m


# (N, K, n_shared, E_total, block_m, skew)
ALIGN_CASES = [(1, 2, 1, 9, 16, False), (1, 8, 1, 257, 16, False), (3, 6, 2, 66, 16, False),
               (17, 6, 2, 66, 32, True), (64, 6, 0, 66, 16, False), (200, 6, 2, 66, 64, False),
               (300, 8, 1, 257, 16, True), (100, 1, 0, 2, 16, True), (40, 3, 3, 9, 128, False),
               (512, 6, 2, 66, 16, False)]


@pytest.mark.parametrize("N,K,n_shared,E,block_m,skew", ALIGN_CASES)
def test_align_slots(N, K, n_shared, E, block_m, skew):
    gen = _gen("align", N, K, n_shared, E, block_m, skew)
    idx = _routing(gen, N, K, E - n_shared, skew)
    got_P, got_T = moe_kernels.align_slots(idx, n_shared, E, block_m)
    expert_S = moe.slot_experts(idx, n_shared, E).reshape(-1)
    _check_layout(got_P, got_T, expert_S, E, block_m)
    want_P, want_T = moe.align_slots(idx, n_shared, E, block_m)
    assert torch.equal(got_P, want_P) and torch.equal(got_T, want_T)


# ---- fused_moe ------------------------------------------------------------------------------------------------------
def _config(bm, bn, bk, warps=4, stages=2):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


# (N, E_total, n_shared, K, D, F, skew, config). D and F not multiples of BLOCK_K/BLOCK_N on purpose (masked
# tails), and equal to them (the EVEN_K path).
MOE_CASES_INTERPRET = [
    (1, 9, 0, 2, 80, 48, False, _config(16, 32, 32)),
    (1, 9, 1, 2, 80, 48, False, _config(16, 32, 32)),
    (3, 9, 1, 2, 80, 48, False, _config(16, 16, 16)),
    (3, 66, 2, 6, 64, 32, False, _config(16, 32, 32)),
    (17, 9, 0, 2, 64, 32, True, _config(16, 32, 64)),
    (17, 66, 2, 6, 64, 32, False, _config(16, 32, 32)),
    (64, 9, 1, 2, 80, 48, False, _config(32, 32, 32)),
    (64, 66, 0, 6, 64, 32, True, _config(16, 32, 32)),
    (200, 9, 1, 2, 64, 32, False, _config(64, 32, 64)),
    (200, 66, 2, 6, 64, 32, False, _config(32, 64, 64)),
    (200, 66, 2, 6, 64, 32, True, _config(32, 64, 64)),
    (5, 66, 2, 6, 64, 48, False, None),  # the default config
]
MOE_CASES_CUDA = MOE_CASES_INTERPRET + [
    (n, 66, 2, 6, 2048, 1408, skew, cfg)  # DeepSeek-V2-Lite
    for n in (1, 3, 17, 64, 200) for skew in (False, True) for cfg in (None, _config(16, 64, 128, 4, 4))
] + [(n, 257, 1, 8, 1024, 256, False, None) for n in (1, 64, 200)]  # V3's routing, narrower experts
MOE_CASES = MOE_CASES_CUDA if _CUDA else MOE_CASES_INTERPRET


def _weights(gen, E, D, F_, dtype):
    return _randn(gen, E, 2 * F_, D, dtype=dtype, scale=D ** -0.5), _randn(gen, E, D, F_, dtype=dtype,
                                                                          scale=F_ ** -0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,E,n_shared,K,D,F_,skew,config", MOE_CASES)
def test_fused_moe(N, E, n_shared, K, D, F_, skew, config, dtype):
    gen = _gen("moe", N, E, n_shared, K, D, F_, skew, str(config))
    x = _randn(gen, N, D, dtype=dtype)
    w13, w2 = _weights(gen, E, D, F_, dtype)
    idx = _routing(gen, N, K, E - n_shared, skew)
    w = torch.rand(N, K, generator=gen).to(DEVICE)
    if N * K >= 8 * (E - n_shared) and not skew:  # enough slots that uniform routing hits every expert
        assert idx.unique().numel() == E - n_shared
    got = moe_kernels.fused_moe(x, w13, w2, w, idx, n_shared, config)
    want = moe.fused_moe(x, w13, w2, w, idx, n_shared)
    assert got.dtype == dtype and got.shape == (N, D)
    assert _rel(got, want) < TOL[dtype]


def test_fused_moe_after_the_route_kernel_and_with_int64_experts():
    """The two kernels chained as a layer runs them; Gate-style int64 expert ids give the same result."""
    gen = _gen("chain")
    N, E, ns, K, D, F_ = 9, 66, 2, 6, 64, 32
    x = _randn(gen, N, D)
    w13, w2 = _weights(gen, E, D, F_, torch.float32)
    logits = _randn(gen, N, E - ns)
    kw = dict(score_func="softmax", topk_method="greedy", n_group=1, topk_group=1, top_k=K, norm_topk_prob=False,
              scaling=1.0)
    w, idx = moe_kernels.route(logits, None, **kw)
    got = moe_kernels.fused_moe(x, w13, w2, w, idx, ns, _config(16, 32, 32))
    got64 = moe_kernels.fused_moe(x, w13, w2, w, idx.long(), ns, _config(16, 32, 32))
    want = moe.fused_moe(x, w13, w2, *moe.route(logits, None, **kw), ns)
    assert _rel(got, want) < TOL[torch.float32]
    assert torch.equal(got, got64)


def test_kernels_switch_routes_moe_ops():
    gen = _gen("switch")
    N, E, K, D, F_ = 4, 9, 2, 32, 16
    x = _randn(gen, N, D)
    w13, w2 = _weights(gen, E, D, F_, torch.float32)
    logits = _randn(gen, N, E - 1)
    kw = dict(score_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2, top_k=K, norm_topk_prob=True,
              scaling=2.5)
    bias = _randn(gen, E - 1, scale=0.05)
    ops.use_kernels(True)
    w, idx = moe.route(logits, bias, **kw)
    sorted_P, tiles_T = moe.align_slots(idx, 1, E, 16)
    out = moe.fused_moe(x, w13, w2, w, idx, 1)
    ops.use_kernels(False)
    kw_w, kw_i = moe_kernels.route(logits, bias, **kw)
    assert torch.equal(idx, kw_i) and torch.equal(w, kw_w)
    assert torch.equal(sorted_P, moe_kernels.align_slots(idx, 1, E, 16)[0])
    assert torch.equal(out, moe_kernels.fused_moe(x, w13, w2, w, idx, 1))


def test_fused_moe_cuda_graph_replays_on_new_inputs():
    """Capture the router and the experts once, then change the logits and x in place: each replay must match the
    reference on the new contents (grids and workspaces depend on shapes only, never on the routing)."""
    if not _CUDA:
        pytest.skip("CUDA graphs need a GPU; the interpreter path has none")
    dtype, N, E, ns, K, D, F_ = torch.bfloat16, 24, 66, 2, 6, 2048, 1408
    gen = _gen("graph")
    w13, w2 = _weights(gen, E, D, F_, dtype)
    kw = dict(score_func="softmax", topk_method="group_limited_greedy", n_group=8, topk_group=3, top_k=K,
              norm_topk_prob=True, scaling=1.0)
    static = dict(x=_randn(gen, N, D, dtype=dtype), logits=_randn(gen, N, E - ns))

    def step():
        w, idx = moe_kernels.route(static["logits"], None, **kw)
        return moe_kernels.fused_moe(static["x"], w13, w2, w, idx, ns)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and load every kernel before the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    for seed in (1, 2):
        g = _gen("graph", seed)
        new = dict(x=_randn(g, N, D, dtype=dtype), logits=_randn(g, N, E - ns, scale=3.0))
        for name, t in new.items():
            static[name].copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        want = moe.fused_moe(new["x"], w13, w2, *moe.route(new["logits"], None, **kw), ns)
        assert _rel(out, want) < TOL[dtype]
