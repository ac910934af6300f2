"""The plain-torch references of paraseek.infer.moe against computations that do not share their code: `route`
against the training model's Gate (the tiny preset and DeepSeek-V2-Lite / V2 / V3-shaped routers, all three
top-k methods, both score functions), `fused_moe` against the training model's MoE layer (sorted grouped GEMMs
plus a dense shared MLP) with the experts packed as w13 / w2, `align_slots` against a per-expert Python loop, and
the tile-config file and its lookup."""

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from paraseek.infer import moe, ops
from paraseek.models.args import resolve_model
from paraseek.models.deepseek import Gate, MoE

from numerics import normal_init, rel_error

ROUTER_PRESETS = ["tiny-moe", "deepseek-v2-lite", "deepseek-v2", "deepseek-v3"]


@pytest.fixture(autouse=True)
def _reference_ops():
    before = ops.kernels_on()
    ops.use_kernels(False)
    yield
    ops.use_kernels(before)


def _route_kwargs(a) -> dict:
    return dict(score_func=a.score_func, topk_method=a.topk_method, n_group=a.n_group, topk_group=a.topk_group,
                top_k=a.n_activated_experts, norm_topk_prob=a.norm_topk_prob, scaling=a.routed_scaling_factor)


# ---- route ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy", "noaux_tc"])
@pytest.mark.parametrize("preset", ROUTER_PRESETS)
def test_route_matches_the_training_gate(preset, topk_method, score_func, norm):
    a = dataclasses.replace(resolve_model(preset)[0], topk_method=topk_method, score_func=score_func,
                            norm_topk_prob=norm)
    torch.manual_seed(len(preset) * 7 + len(topk_method) + len(score_func) + norm)
    gate = Gate(a)
    with torch.no_grad():
        gate.weight.normal_(0.0, 1.0 / a.dim ** 0.5)
        if gate.e_score_correction_bias is not None:  # noaux_tc: a balancing bias of the scores' own size
            gate.e_score_correction_bias.normal_(0.0, 0.5 / a.n_routed_experts if score_func == "softmax" else 0.05)
    N = 61
    x = torch.randn(N, a.dim)
    want_w, want_i, scores = gate(x)
    logits = F.linear(x.float(), gate.weight.float())
    got_w, got_i = moe.route(logits, gate.e_score_correction_bias, **_route_kwargs(a))
    assert got_w.dtype == torch.float32 and got_i.dtype == torch.int32
    assert got_i.shape == (N, a.n_activated_experts)
    # Gate's top-k is unsorted: compare each token's experts as a set, and the weights expert by expert.
    got_sorted, got_order = got_i.long().sort(dim=1)
    want_sorted, want_order = want_i.sort(dim=1)
    assert torch.equal(got_sorted, want_sorted)
    torch.testing.assert_close(got_w.gather(1, got_order), want_w.gather(1, want_order), rtol=1e-6, atol=1e-6)
    # The reference's own order: descending in the (biased) choice score.
    choice = scores if gate.e_score_correction_bias is None else scores + gate.e_score_correction_bias
    c = choice.gather(1, got_i.long())
    assert (c[:, :-1] >= c[:, 1:]).all()


def test_route_rejects_bad_arguments():
    logits = torch.randn(3, 12)
    kw = dict(score_func="softmax", topk_method="noaux_tc", n_group=4, topk_group=2, top_k=2, norm_topk_prob=True,
              scaling=1.0)
    with pytest.raises(ValueError, match="groups"):
        moe.route(logits, None, **{**kw, "n_group": 5})
    with pytest.raises(ValueError, match="top_k"):
        moe.route(logits, None, **{**kw, "top_k": 13})
    with pytest.raises(ValueError, match="score_func"):
        moe.route(logits, None, **{**kw, "score_func": "relu"})
    with pytest.raises(ValueError, match="top-2"):
        moe.route(logits, None, **{**kw, "n_group": 12, "topk_group": 3})


# ---- fused_moe ------------------------------------------------------------------------------------------------------
def _moe_args(name: str):
    """Router shapes of the real models, expert widths cut down so an fp32 layer is small."""
    if name == "tiny":
        return resolve_model("tiny-moe")[0]
    if name == "tiny-no-shared":
        return dataclasses.replace(resolve_model("tiny-moe")[0], n_shared_experts=0)
    if name == "v2-lite":
        return dataclasses.replace(resolve_model("deepseek-v2-lite")[0], dim=128, moe_inter_dim=48)
    if name == "v2":
        return dataclasses.replace(resolve_model("deepseek-v2")[0], dim=96, moe_inter_dim=16)
    return dataclasses.replace(resolve_model("deepseek-v3")[0], dim=128, moe_inter_dim=32)


def _packed(layer: MoE):
    ex, sh = layer.experts, layer.shared_experts
    shared = (sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight) if sh is not None else (None,) * 3
    return moe.pack_expert_weights(ex.gate_proj.detach(), ex.up_proj.detach(), ex.down_proj.detach(),
                                   *(t.detach() if t is not None else None for t in shared))


@pytest.mark.parametrize("N", [1, 5, 33])
@pytest.mark.parametrize("name", ["tiny", "tiny-no-shared", "v2-lite", "v2", "v3"])
def test_fused_moe_matches_the_training_layer(name, N):
    a = _moe_args(name)
    torch.manual_seed(N * 31 + len(name))
    layer = normal_init(MoE(a), 0.1)
    layer.use_grouped_mm = False  # the exact per-expert loop (fp32, CPU)
    if layer.gate.e_score_correction_bias is not None:
        with torch.no_grad():
            layer.gate.e_score_correction_bias.normal_(0.0, 0.05)
    x = torch.randn(N, a.dim)
    with torch.no_grad():
        want = layer(x)
        w13, w2, n_shared = _packed(layer)
        assert n_shared == a.n_shared_experts
        logits = F.linear(x, layer.gate.weight)
        w_NK, idx_NK = moe.route(logits, layer.gate.e_score_correction_bias, **_route_kwargs(a))
        got = moe.fused_moe(x, w13, w2, w_NK, idx_NK, n_shared)
    assert got.dtype == x.dtype and got.shape == want.shape
    assert rel_error(got, want) < 1e-5


def test_pack_expert_weights_layout():
    E, F_, D, ns = 3, 4, 5, 2
    gate, up, down = torch.randn(E, F_, D), torch.randn(E, F_, D), torch.randn(E, D, F_)
    sg, su, sd = torch.randn(ns * F_, D), torch.randn(ns * F_, D), torch.randn(D, ns * F_)
    w13, w2, n = moe.pack_expert_weights(gate, up, down, sg, su, sd)
    assert n == ns and w13.shape == (E + ns, 2 * F_, D) and w2.shape == (E + ns, D, F_)
    assert w13.is_contiguous() and w2.is_contiguous()
    for e in range(E):
        assert torch.equal(w13[e, :F_], gate[e]) and torch.equal(w13[e, F_:], up[e]) and torch.equal(w2[e], down[e])
    for j in range(ns):
        rows = slice(j * F_, (j + 1) * F_)
        assert torch.equal(w13[E + j, :F_], sg[rows]) and torch.equal(w13[E + j, F_:], su[rows])
        assert torch.equal(w2[E + j], sd[:, rows])
    w13, w2, n = moe.pack_expert_weights(gate, up, down)
    assert n == 0 and w13.shape == (E, 2 * F_, D)


def test_fused_moe_rounds_h_and_the_output_to_x_dtype():
    """bf16 in, bf16 out; h is rounded to bf16 once, so the result is within bf16 precision of the fp32 math."""
    torch.manual_seed(0)
    E, F_, D, N, K = 6, 16, 32, 7, 2
    x = torch.randn(N, D)
    w13, w2 = torch.randn(E, 2 * F_, D) / D ** 0.5, torch.randn(E, D, F_) / F_ ** 0.5
    idx = torch.stack([torch.randperm(E - 1)[:K] for _ in range(N)]).int()
    w = torch.rand(N, K)
    out32 = moe.fused_moe(x, w13, w2, w, idx, n_shared=1)
    out16 = moe.fused_moe(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), w, idx, n_shared=1)
    assert out16.dtype == torch.bfloat16
    assert 0 < rel_error(out16, out32) < 2e-2


def test_fused_moe_rejects_mismatched_shapes():
    x, w13, w2 = torch.randn(2, 8), torch.randn(3, 8, 8), torch.randn(3, 8, 4)
    w, idx = torch.rand(2, 1), torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="x is"):
        moe.fused_moe(torch.randn(2, 7), w13, w2, w, idx)
    with pytest.raises(ValueError, match="w13"):
        moe.fused_moe(x, w13, torch.randn(3, 8, 5), w, idx)
    with pytest.raises(ValueError, match="n_shared"):
        moe.fused_moe(x, w13, w2, w, idx, n_shared=3)


# ---- align_slots -----------------------------------------------------------------------------------------------------
def _naive_align(expert_S: list[int], E: int, block_m: int, T: int) -> tuple[list[int], list[int]]:
    S = len(expert_S)
    positions, tiles = [], []
    for e in range(E):
        mine = [s for s in range(S) if expert_S[s] == e]
        if not mine:
            continue
        n_tiles = -(-len(mine) // block_m)
        positions += mine + [S] * (n_tiles * block_m - len(mine))
        tiles += [e] * n_tiles
    assert len(tiles) <= T  # the shape-only bound holds
    return positions + [S] * (T * block_m - len(positions)), tiles + [-1] * (T - len(tiles))


@pytest.mark.parametrize("N,K,n_shared,E,block_m,skew", [
    (1, 2, 1, 9, 16, False), (3, 6, 2, 66, 16, False), (40, 6, 2, 66, 16, True), (50, 2, 0, 4, 16, False),
    (17, 8, 1, 257, 32, False), (30, 1, 0, 3, 64, True), (0, 3, 1, 9, 16, False)])
def test_align_slots_matches_a_loop_over_experts(N, K, n_shared, E, block_m, skew):
    gen = torch.Generator().manual_seed(N * 131 + E)
    pref = torch.rand(N, E - n_shared, generator=gen)
    if skew:  # most tokens on the first experts: some experts span several tiles, others are unused
        pref += torch.linspace(3, 0, E - n_shared)
    idx = pref.topk(K, dim=1).indices.int()
    sorted_P, tile_T = moe.align_slots(idx, n_shared, E, block_m)
    expert_S = moe.slot_experts(idx, n_shared, E).reshape(-1).tolist()
    T = moe.max_tiles(len(expert_S), E, block_m)
    want_P, want_T = _naive_align(expert_S, E, block_m, T)
    assert sorted_P.dtype == tile_T.dtype == torch.int32
    assert sorted_P.tolist() == want_P and tile_T.tolist() == want_T


def test_max_tiles_is_reached():
    """The bound is tight: m experts with one slot each and one expert holding the rest."""
    E, block_m, S = 10, 16, 100
    expert_S = [e for e in range(E - 1)] + [E - 1] * (S - E + 1)
    tiles = sum(-(-expert_S.count(e) // block_m) for e in range(E))
    assert tiles == moe.max_tiles(S, E, block_m)


# ---- tile configs -------------------------------------------------------------------------------------------------
def test_config_file_entries_are_valid_and_round_trip():
    data = json.loads(moe.CONFIG_FILE.read_text())
    assert data
    for key, entry in data.items():
        E, F_, D = (int(part.split("=")[1]) for part in key.split(","))
        assert key == moe.config_key(E, F_, D) and entry["source"]
        for count, cfg in entry["configs"].items():
            assert int(count) > 0 and set(cfg) == set(moe.CONFIG_KEYS)
            assert cfg["BLOCK_M"] in (16, 32, 64, 128)
            for k in ("BLOCK_N", "BLOCK_K"):
                assert cfg[k] >= 16 and cfg[k] & (cfg[k] - 1) == 0
            assert cfg["num_warps"] in (1, 2, 4, 8, 16) and cfg["num_stages"] >= 1
    assert json.loads(moe.format_config_file(data)) == data


def test_config_lookup_takes_the_next_listed_token_count():
    key = moe.config_key(66, 1408, 2048)
    table = json.loads(moe.CONFIG_FILE.read_text())[key]["configs"]
    counts = sorted(int(c) for c in table)
    assert moe.moe_config(counts[0], 8, 66, 1408, 2048) == table[str(counts[0])]
    between = counts[1] + 1 if counts[2] > counts[1] + 1 else counts[2]
    assert moe.moe_config(between, 8, 66, 1408, 2048) == table[str(counts[2])]
    assert moe.moe_config(10 * counts[-1], 8, 66, 1408, 2048) == table[str(counts[-1])]
    # A shape the file does not hold: the heuristic, BLOCK_M from the mean slots per expert.
    assert moe.moe_config(1, 9, 7, 48, 80) == moe.default_config(1, 9, 7)
    assert moe.default_config(1, 9, 257)["BLOCK_M"] == 16
    assert moe.default_config(512, 8, 66)["BLOCK_M"] == 64


def test_config_file_ships_with_the_package():
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert "moe_configs.json" in pyproject["tool"]["setuptools"]["package-data"]["paraseek.infer"]
