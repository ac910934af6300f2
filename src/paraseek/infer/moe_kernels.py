"""Triton kernels of the MoE decode ops of `moe.py`: same names, same arguments, same semantics and output dtypes as
the plain-torch reference there (shape legend and slot numbering in moe.py's docstring).

Every function is CUDA-graph capturable: no host syncs, grids and workspaces sized from tensor shapes only (the
number of tiles from `moe.max_tiles`, never from the routing), and no autotuning (the tile config is a fixed
function of the shapes, read from moe_configs.json). All of them also run under TRITON_INTERPRET=1 on CPU tensors
in fp32, which is how they are tested without a GPU; on the GPU they take bf16 and fp16 as well.

  route: one program per token holds the token's whole row of E <= 512 logits, laid out as [groups, experts per
    group] (both padded to powers of two; [1, E] without groups), so group maxima and top-2 sums are row
    reductions. Top-k is K rounds of argmax (the max, then the lowest expert index holding it), which yields the
    experts in descending order of the choice with ties going to the lower index; groups are kept the same way.

  align_slots: the counting sort with no atomics, so the layout is deterministic, one program per chunk of slots
    (and of tiles): each program counts every slot's expert (tl.histogram over all slots, and over the slots before
    its chunk), takes the padded offsets (tl.cumsum), places each slot of its chunk at its expert's offset + the
    expert's slots before the chunk + the earlier slots of the same expert in the chunk (an exclusive cumsum of the
    chunk's [slots, E] one-hot matrix), and writes its tiles' experts (the last expert whose first tile is at or
    before the tile) and their padding sentinels. Slot positions and sentinel positions are disjoint, so no store
    order matters across programs.

  gate_up and down (vLLM's fused_moe design: expert-major tiles over the sorted slots, one weight block read per
    tile instead of per token): grid (tiles, column blocks); a program reads its tile's expert and returns at once
    past the last tile, gathers its BLOCK_M slot rows (of x, or of h), and streams the expert's weight block over the
    reduction dim with tl.dot. gate_up keeps two fp32 accumulators (gate rows and up rows of the same columns), so
    silu(g) * u happens in registers and h is written once, rounded to x's dtype. down writes y = w_slot * h W2^T
    in fp32 to the slot's own row of y [S, D], so the result does not depend on which tile or program got the slot.

  combine: out[t] = the sum of token t's K + n_shared rows of y, in slot order, rounded to x's dtype.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from paraseek.infer import kernels  # noqa: F401  (patches Triton's interpreter under TRITON_INTERPRET=1)
from paraseek.infer import moe_layout as moe  # the ops' rules and configs (not moe.py: it imports this module)
from paraseek.infer.kernels import _dot_precision, _pow2

MAX_ROUTE_EXPERTS = 512  # route holds a token's whole row of logits in one program


# ---- routing --------------------------------------------------------------------------------------------------------
@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, idx_ptr, stride_l, stride_w, stride_i, GS, N_GROUP, scaling,
                  SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_MODE: tl.constexpr,
                  TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, NORM: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_GS: tl.constexpr, BLOCK_K: tl.constexpr):
    # GROUP_MODE 0: no groups (N_GROUP = 1, GS = E); 1: groups ranked by their max; 2: by the sum of their top 2.
    n = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_j = tl.arange(0, BLOCK_GS)
    e_GJ = offs_g[:, None] * GS + offs_j[None, :]  # expert index
    valid_GJ = (offs_g < N_GROUP)[:, None] & (offs_j < GS)[None, :]
    l_GJ = tl.load(logits_ptr + n * stride_l + e_GJ, mask=valid_GJ, other=float("-inf")).to(tl.float32)
    if SOFTMAX:
        m = tl.max(tl.max(l_GJ, axis=1), axis=0)
        p_GJ = tl.exp(l_GJ - m)  # padding: exp(-inf) = 0
        s_GJ = p_GJ / tl.sum(tl.sum(p_GJ, axis=1), axis=0)
    else:
        s_GJ = tl.sigmoid(l_GJ)
    s_GJ = tl.where(valid_GJ, s_GJ, 0.0)
    c_GJ = s_GJ
    if HAS_BIAS:
        c_GJ = c_GJ + tl.load(bias_ptr + e_GJ, mask=valid_GJ, other=0.0).to(tl.float32)
    c_GJ = tl.where(valid_GJ, c_GJ, float("-inf"))

    if GROUP_MODE > 0:
        m1_G = tl.max(c_GJ, axis=1)
        if GROUP_MODE == 2:
            # Remove one occurrence of the max (so a repeated max counts twice, as torch.topk(2) does).
            first_G = tl.min(tl.where(c_GJ == m1_G[:, None], offs_j[None, :], BLOCK_GS), axis=1)
            rest_GJ = tl.where(offs_j[None, :] == first_G[:, None], float("-inf"), c_GJ)
            score_G = m1_G + tl.max(rest_GJ, axis=1)
        else:
            score_G = m1_G
        score_G = tl.where(offs_g < N_GROUP, score_G, float("-inf"))
        keep_G = offs_g < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(score_G, axis=0)
            g_sel = tl.min(tl.where((score_G == best) & (offs_g < N_GROUP) & ~keep_G, offs_g, BLOCK_G), axis=0)
            keep_G = keep_G | (offs_g == g_sel)
            score_G = tl.where(offs_g == g_sel, float("-inf"), score_G)
        c_GJ = tl.where(keep_G[:, None], c_GJ, float("-inf"))

    offs_k = tl.arange(0, BLOCK_K)
    w_K = tl.zeros([BLOCK_K], tl.float32)
    i_K = tl.zeros([BLOCK_K], tl.int32)
    avail_GJ = valid_GJ  # not chosen yet (so -inf experts, if K exceeds the kept ones, are still chosen once each)
    for k in tl.static_range(TOP_K):
        best = tl.max(tl.max(c_GJ, axis=1), axis=0)
        sel = tl.min(tl.min(tl.where((c_GJ == best) & avail_GJ, e_GJ, 2147483647), axis=1), axis=0)
        hit_GJ = e_GJ == sel
        w_K = tl.where(offs_k == k, tl.sum(tl.sum(tl.where(hit_GJ, s_GJ, 0.0), axis=1), axis=0), w_K)
        i_K = tl.where(offs_k == k, sel, i_K)
        c_GJ = tl.where(hit_GJ, float("-inf"), c_GJ)
        avail_GJ = avail_GJ & ~hit_GJ
    if NORM:
        w_K = w_K / (tl.sum(w_K, axis=0) + 1e-20)
    mask_K = offs_k < TOP_K
    tl.store(w_ptr + n * stride_w + offs_k, w_K * scaling, mask=mask_K)
    tl.store(idx_ptr + n * stride_i + offs_k, i_K, mask=mask_K)


def route(logits_NE: torch.Tensor, bias_E: torch.Tensor | None, *, score_func: str, topk_method: str, n_group: int,
          topk_group: int, top_k: int, norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    N, E = logits_NE.shape
    grouped = moe._check_route_args(E, score_func, topk_method, n_group, topk_group, top_k)
    if E > MAX_ROUTE_EXPERTS:
        raise ValueError(f"route: at most {MAX_ROUTE_EXPERTS} experts in one program, got {E}")
    logits_NE = logits_NE if logits_NE.stride(-1) == 1 else logits_NE.contiguous()
    weights_NK = torch.empty((N, top_k), device=logits_NE.device, dtype=torch.float32)
    idx_NK = torch.empty((N, top_k), device=logits_NE.device, dtype=torch.int32)
    if N == 0:
        return weights_NK, idx_NK
    G = n_group if grouped else 1
    GS = E // G
    has_bias = bias_E is not None
    bias_E = bias_E.contiguous() if has_bias else logits_NE  # unused without bias
    lanes = _pow2(G) * _pow2(GS)
    _route_kernel[(N,)](
        logits_NE, bias_E, weights_NK, idx_NK, logits_NE.stride(0), weights_NK.stride(0), idx_NK.stride(0),
        GS, G, float(scaling),
        SOFTMAX=score_func == "softmax", HAS_BIAS=has_bias,
        GROUP_MODE=0 if not grouped else (2 if topk_method == "noaux_tc" else 1),
        TOPK_GROUP=topk_group if grouped else 1, TOP_K=top_k, NORM=bool(norm_topk_prob and top_k > 1),
        BLOCK_G=_pow2(G), BLOCK_GS=_pow2(GS), BLOCK_K=_pow2(top_k),
        num_warps=4 if lanes >= 512 else (2 if lanes >= 128 else 1))
    return weights_NK, idx_NK


# ---- slot layout --------------------------------------------------------------------------------------------------
@triton.jit
def _slot_experts(idx_ptr, stride_i, s, mask_s, K: tl.constexpr, KS: tl.constexpr, E_ROUTED):
    """The expert of each slot in s (slot = token * KS + j; j >= K is shared expert E_ROUTED + j - K), -1 masked."""
    t = s // KS
    j = s % KS
    routed = j < K
    e = tl.load(idx_ptr + t.to(tl.int64) * stride_i + j, mask=mask_s & routed, other=0).to(tl.int32)
    e = tl.where(routed, e, E_ROUTED + j - K)
    return tl.where(mask_s, e, -1)


# S and N_TILES change with the batch: not specialized (one compile per config, not per batch size's divisibility).
@triton.jit(do_not_specialize=["S", "N_TILES"])
def _align_kernel(idx_ptr, sorted_ptr, tile_ptr, stride_i, S, E, E_ROUTED, N_TILES,
                  K: tl.constexpr, KS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                  COUNT_CHUNK: tl.constexpr, CHUNK: tl.constexpr, TILE_CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    valid_e = offs_e < E

    # Pass 1 (every program): slots per expert over all S, and the slots per expert before this program's chunk.
    mine = pid * CHUNK
    counts_E = tl.zeros([BLOCK_E], tl.int32)
    run_E = tl.zeros([BLOCK_E], tl.int32)
    for s0 in range(0, S, COUNT_CHUNK):
        s = s0 + tl.arange(0, COUNT_CHUNK)
        mask_s = s < S
        e_C = tl.where(mask_s, _slot_experts(idx_ptr, stride_i, s, mask_s, K, KS, E_ROUTED), 0)
        counts_E += tl.histogram(e_C, BLOCK_E, mask=mask_s)
        run_E += tl.histogram(e_C, BLOCK_E, mask=mask_s & (s < mine))
    padded_E = (counts_E + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start_E = tl.cumsum(padded_E, axis=0) - padded_E  # first position of each expert
    total_tiles = tl.sum(padded_E, axis=0) // BLOCK_M

    # Pass 2: each slot of this program's chunk to its position = its expert's start + the expert's slots before the
    # chunk (run_E) + the expert's slots earlier in the chunk (an exclusive cumsum of the one-hot matrix down the chunk).
    s = mine + tl.arange(0, CHUNK)
    mask_s = s < S
    e_C = _slot_experts(idx_ptr, stride_i, s, mask_s, K, KS, E_ROUTED)
    hot_CE = (e_C[:, None] == offs_e[None, :]).to(tl.int32)  # masked slots (-1) match no expert
    before_CE = tl.cumsum(hot_CE, axis=0) - hot_CE
    pos_C = tl.sum(tl.where(hot_CE != 0, (start_E + run_E)[None, :] + before_CE, 0), axis=1)
    tl.store(sorted_ptr + pos_C, s, mask=mask_s)

    # Pass 3: this program's share of tiles: each tile's expert (-1 past the last) and the sentinel S at every
    # position of it without a slot.
    tile_start_E = start_E // BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    t = pid * TILE_CHUNK + tl.arange(0, TILE_CHUNK)
    mask_t = t < N_TILES
    live_t = t < total_tiles
    # An empty expert starts where the next one does, so the last expert starting at or before t is t's own.
    e_T = tl.sum(((tile_start_E[None, :] <= t[:, None]) & valid_e[None, :]).to(tl.int32), axis=1) - 1
    e_T = tl.where(live_t, e_T, -1)
    tl.store(tile_ptr + t, e_T, mask=mask_t)
    hot_TE = offs_e[None, :] == e_T[:, None]
    start_T = tl.sum(tl.where(hot_TE, start_E[None, :], 0), axis=1)
    count_T = tl.sum(tl.where(hot_TE, counts_E[None, :], 0), axis=1)
    pos_TM = t[:, None] * BLOCK_M + offs_m[None, :]
    pad_TM = (pos_TM - start_T[:, None] >= count_T[:, None]) | ~live_t[:, None]
    tl.store(sorted_ptr + pos_TM, S + tl.zeros([TILE_CHUNK, BLOCK_M], tl.int32), mask=mask_t[:, None] & pad_TM)


def align_slots(idx_NK: torch.Tensor, n_shared: int, n_experts: int,
                block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    N, K = idx_NK.shape
    KS = K + n_shared
    S = N * KS
    T = moe.max_tiles(S, n_experts, block_m)
    dev = idx_NK.device
    sorted_P = torch.empty((T * block_m,), device=dev, dtype=torch.int32)
    tile_expert_T = torch.empty((T,), device=dev, dtype=torch.int32)
    if T == 0:
        return sorted_P, tile_expert_T
    idx_NK = idx_NK if idx_NK.stride(-1) == 1 else idx_NK.contiguous()
    block_e = _pow2(n_experts)
    # One program per chunk of slots (and per chunk of tiles), all at once: each counts every slot's expert (a
    # histogram of a few thousand slots at most, cheap) and places its own chunk. The single program this replaced
    # placed the chunks one after another: 3.4 us a layer at batch 1 but 37 us at batch 64 of DeepSeek-V2-Lite on an
    # H200 (benchmarks/2026-12-04/v2lite-decode-profile-b64-serial-align.txt). The [chunk, E] one-hot matrices stay at
    # 8K elements or fewer.
    chunk = max(16, min(64, 8192 // block_e, _pow2(S)))
    tile_chunk = max(16, min(64, 8192 // max(block_e, block_m), _pow2(T)))
    grid = max(triton.cdiv(S, chunk), triton.cdiv(T, tile_chunk))
    _align_kernel[(grid,)](idx_NK, sorted_P, tile_expert_T, idx_NK.stride(0), S, n_experts,
                           n_experts - n_shared, T, K=K, KS=KS, BLOCK_M=block_m, BLOCK_E=block_e,
                           COUNT_CHUNK=max(16, min(1024, _pow2(S))), CHUNK=chunk, TILE_CHUNK=tile_chunk,
                           num_warps=4)
    return sorted_P, tile_expert_T


# ---- experts ------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["S"])
def _gate_up_kernel(x_ptr, w13_ptr, h_ptr, sorted_ptr, tile_ptr,
                    stride_xn, stride_we, stride_wx, stride_wd, stride_h, S, D, F,
                    KS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr):
    tile = tl.program_id(0)
    e = tl.load(tile_ptr + tile)
    if e < 0:  # past the last tile of this step's routing
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    slot_m = tl.load(sorted_ptr + offs_m)
    valid_m = slot_m < S
    token_m = tl.where(valid_m, slot_m // KS, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < F
    offs_k = tl.arange(0, BLOCK_K)

    x_rows = x_ptr + token_m[:, None] * stride_xn + offs_k[None, :]
    # The gate rows [0, F) and the up rows [F, 2F) of the same columns: one pass over D feeds both products.
    wg = w13_ptr + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wx + offs_k[:, None] * stride_wd
    wu = wg + F * stride_wx
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, D, BLOCK_K):
        if EVEN_K:
            x_mk = tl.load(x_rows, mask=valid_m[:, None], other=0.0)
            g_kn = tl.load(wg, mask=mask_n[None, :], other=0.0)
            u_kn = tl.load(wu, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = offs_k < D - k0
            x_mk = tl.load(x_rows, mask=valid_m[:, None] & mask_k[None, :], other=0.0)
            g_kn = tl.load(wg, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            u_kn = tl.load(wu, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc_g = tl.dot(x_mk, g_kn, acc_g, input_precision=DOT_PREC)
        acc_u = tl.dot(x_mk, u_kn, acc_u, input_precision=DOT_PREC)
        x_rows += BLOCK_K
        wg += BLOCK_K * stride_wd
        wu += BLOCK_K * stride_wd
    h_mn = acc_g * tl.sigmoid(acc_g) * acc_u  # silu(g) * u in fp32, one rounding
    tl.store(h_ptr + offs_m[:, None].to(tl.int64) * stride_h + offs_n[None, :], h_mn.to(h_ptr.dtype.element_ty),
             mask=valid_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["S"])
def _down_kernel(h_ptr, w2_ptr, wt_ptr, y_ptr, sorted_ptr, tile_ptr,
                 stride_h, stride_we, stride_wd, stride_wf, stride_wt, stride_y, S, D, F,
                 K: tl.constexpr, KS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr):
    tile = tl.program_id(0)
    e = tl.load(tile_ptr + tile)
    if e < 0:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    slot_m = tl.load(sorted_ptr + offs_m)
    valid_m = slot_m < S
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)

    # h rows are indexed by position (the gate_up program of this tile wrote them); padding rows were not written.
    h_rows = h_ptr + offs_m[:, None].to(tl.int64) * stride_h + offs_k[None, :]
    w_cols = (w2_ptr + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wd
              + offs_k[:, None] * stride_wf)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, F, BLOCK_K):
        if EVEN_K:
            h_mk = tl.load(h_rows, mask=valid_m[:, None], other=0.0)
            w_kn = tl.load(w_cols, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = offs_k < F - k0
            h_mk = tl.load(h_rows, mask=valid_m[:, None] & mask_k[None, :], other=0.0)
            w_kn = tl.load(w_cols, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(h_mk, w_kn, acc, input_precision=DOT_PREC)
        h_rows += BLOCK_K
        w_cols += BLOCK_K * stride_wf

    # The slot's routing weight (1.0 for the shared experts), applied to the fp32 product.
    j_m = slot_m % KS
    routed_m = valid_m & (j_m < K)
    wt_m = tl.load(wt_ptr + (slot_m // KS).to(tl.int64) * stride_wt + j_m, mask=routed_m, other=1.0)
    acc = acc * wt_m.to(tl.float32)[:, None]
    tl.store(y_ptr + slot_m[:, None].to(tl.int64) * stride_y + offs_n[None, :], acc,
             mask=valid_m[:, None] & mask_n[None, :])


@triton.jit
def _combine_kernel(y_ptr, out_ptr, stride_y, stride_o, D, KS: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for j in tl.static_range(KS):  # slot order, as the reference sums
        acc += tl.load(y_ptr + (t * KS + j) * stride_y + offs_d, mask=mask_d, other=0.0)
    tl.store(out_ptr + t * stride_o + offs_d, acc.to(out_ptr.dtype.element_ty), mask=mask_d)


@functools.lru_cache(maxsize=None)
def _shared_memory_limit(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 166912)


def _fit_config(cfg: dict, x_ND: torch.Tensor) -> dict:
    """The config as given, with num_stages lowered until gate_up's pipelined tiles (x and the gate and up blocks,
    per stage) fit in the device's shared memory: the file's configs are measured in bf16, fp32 doubles the bytes."""
    cfg = {k: int(cfg[k]) for k in moe.CONFIG_KEYS}
    for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        if cfg[k] < 16 or cfg[k] & (cfg[k] - 1):
            raise ValueError(f"fused_moe: {k}={cfg[k]} must be a power of two >= 16 (tl.dot)")
    if x_ND.is_cuda:
        stage = (cfg["BLOCK_M"] * cfg["BLOCK_K"] + 2 * cfg["BLOCK_K"] * cfg["BLOCK_N"]) * x_ND.element_size()
        limit = _shared_memory_limit(x_ND.device.index if x_ND.device.index is not None else 0) - 8192
        while cfg["num_stages"] > 1 and cfg["num_stages"] * stage > limit:
            cfg["num_stages"] -= 1
    return cfg


def fused_moe(x_ND: torch.Tensor, w13_EXD: torch.Tensor, w2_EDF: torch.Tensor, weights_NK: torch.Tensor,
              idx_NK: torch.Tensor, n_shared: int = 0, config: dict | None = None) -> torch.Tensor:
    moe._check_moe_args(x_ND, w13_EXD, w2_EDF, weights_NK, idx_NK, n_shared)
    if not (x_ND.dtype == w13_EXD.dtype == w2_EDF.dtype):
        raise ValueError(f"fused_moe: x ({x_ND.dtype}), w13 ({w13_EXD.dtype}) and w2 ({w2_EDF.dtype}) must share a "
                         "dtype")
    N, D = x_ND.shape
    E, X, _ = w13_EXD.shape
    F_ = X // 2
    K = idx_NK.shape[1]
    KS = K + n_shared
    S = N * KS
    out_ND = torch.empty((N, D), device=x_ND.device, dtype=x_ND.dtype)
    if N == 0:
        return out_ND
    cfg = _fit_config(config if config is not None else moe.moe_config(N, KS, E, F_, D), x_ND)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    x_ND = x_ND if x_ND.stride(-1) == 1 else x_ND.contiguous()
    weights_NK = weights_NK if weights_NK.stride(-1) == 1 else weights_NK.contiguous()
    idx_NK = idx_NK if idx_NK.dtype == torch.int32 else idx_NK.to(torch.int32)

    sorted_P, tile_expert_T = align_slots(idx_NK, n_shared, E, bm)
    T = tile_expert_T.shape[0]
    P = sorted_P.shape[0]
    h_PF = torch.empty((P, F_), device=x_ND.device, dtype=x_ND.dtype)
    y_SD = torch.empty((S, D), device=x_ND.device, dtype=torch.float32)
    prec = _dot_precision(x_ND.dtype)
    _gate_up_kernel[(T, triton.cdiv(F_, bn))](
        x_ND, w13_EXD, h_PF, sorted_P, tile_expert_T,
        x_ND.stride(0), w13_EXD.stride(0), w13_EXD.stride(1), w13_EXD.stride(2), h_PF.stride(0), S, D, F_,
        KS=KS, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=D % bk == 0, DOT_PREC=prec, **launch)
    _down_kernel[(T, triton.cdiv(D, bn))](
        h_PF, w2_EDF, weights_NK, y_SD, sorted_P, tile_expert_T,
        h_PF.stride(0), w2_EDF.stride(0), w2_EDF.stride(1), w2_EDF.stride(2), weights_NK.stride(0), y_SD.stride(0),
        S, D, F_, K=K, KS=KS, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=F_ % bk == 0, DOT_PREC=prec, **launch)
    block_d = min(_pow2(D), 1024)
    _combine_kernel[(N, triton.cdiv(D, block_d))](y_SD, out_ND, y_SD.stride(0), out_ND.stride(0), D, KS=KS,
                                                  BLOCK_D=block_d, num_warps=4 if block_d >= 512 else 1)
    return out_ND


# ---- experts in FP8 -------------------------------------------------------------------------------------------------
# moe.fused_moe_fp8's kernels: the gate_up and down programs above, with float8 e4m3 operands (activations quantized
# per token in 1 x 128 groups beforehand, fp8.quantize_1x128) and each BLOCK_K step's product scaled by the rows'
# activation scales and the columns' weight-block scales before it joins the fp32 accumulator (BLOCK_K divides 128,
# so a step lies in one scale group). tl.dot accumulates the step's e4m3 products in fp32 on the tensor cores.
@triton.jit(do_not_specialize=["S"])
def _gate_up_fp8_kernel(x_ptr, xs_ptr, w13_ptr, ws_ptr, h_ptr, sorted_ptr, tile_ptr,
                        stride_xn, stride_xsn, stride_xsg, stride_we, stride_wx, stride_wd, stride_se, stride_sx,
                        stride_sg, stride_h, S, D, F,
                        KS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, GROUP: tl.constexpr):
    tile = tl.program_id(0)
    e = tl.load(tile_ptr + tile)
    if e < 0:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    slot_m = tl.load(sorted_ptr + offs_m)
    valid_m = slot_m < S
    token_m = tl.where(valid_m, slot_m // KS, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < F
    offs_k = tl.arange(0, BLOCK_K)

    x_rows = x_ptr + token_m[:, None] * stride_xn + offs_k[None, :]
    xs_rows = xs_ptr + token_m * stride_xsn
    wg = w13_ptr + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wx + offs_k[:, None] * stride_wd
    wu = wg + F * stride_wx
    # One block grid over the 2F gate|up rows: gate row n is in block row n // 128, up row n in (F + n) // 128.
    sg_rows = ws_ptr + e.to(tl.int64) * stride_se + (offs_n // GROUP) * stride_sx
    su_rows = ws_ptr + e.to(tl.int64) * stride_se + ((F + offs_n) // GROUP) * stride_sx
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, D, BLOCK_K):
        if EVEN_K:
            x_mk = tl.load(x_rows, mask=valid_m[:, None], other=0.0)
            g_kn = tl.load(wg, mask=mask_n[None, :], other=0.0)
            u_kn = tl.load(wu, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = offs_k < D - k0
            x_mk = tl.load(x_rows, mask=valid_m[:, None] & mask_k[None, :], other=0.0)
            g_kn = tl.load(wg, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            u_kn = tl.load(wu, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        g = k0 // GROUP
        xs_m = tl.load(xs_rows + g * stride_xsg, mask=valid_m, other=0.0)[:, None]
        gs_n = tl.load(sg_rows + g * stride_sg, mask=mask_n, other=0.0)[None, :]
        us_n = tl.load(su_rows + g * stride_sg, mask=mask_n, other=0.0)[None, :]
        acc_g += tl.dot(x_mk, g_kn) * xs_m * gs_n
        acc_u += tl.dot(x_mk, u_kn) * xs_m * us_n
        x_rows += BLOCK_K
        wg += BLOCK_K * stride_wd
        wu += BLOCK_K * stride_wd
    h_mn = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h_ptr + offs_m[:, None].to(tl.int64) * stride_h + offs_n[None, :], h_mn.to(h_ptr.dtype.element_ty),
             mask=valid_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["S"])
def _down_fp8_kernel(h_ptr, hs_ptr, w2_ptr, ws_ptr, wt_ptr, y_ptr, sorted_ptr, tile_ptr,
                     stride_h, stride_hsp, stride_hsg, stride_we, stride_wd, stride_wf, stride_se, stride_sd,
                     stride_sg, stride_wt, stride_y, S, D, F,
                     K: tl.constexpr, KS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, GROUP: tl.constexpr):
    tile = tl.program_id(0)
    e = tl.load(tile_ptr + tile)
    if e < 0:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    slot_m = tl.load(sorted_ptr + offs_m)
    valid_m = slot_m < S
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)

    h_rows = h_ptr + offs_m[:, None].to(tl.int64) * stride_h + offs_k[None, :]
    hs_rows = hs_ptr + offs_m.to(tl.int64) * stride_hsp
    w_cols = (w2_ptr + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wd
              + offs_k[:, None] * stride_wf)
    s_rows = ws_ptr + e.to(tl.int64) * stride_se + (offs_n // GROUP) * stride_sd
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, F, BLOCK_K):
        if EVEN_K:
            h_mk = tl.load(h_rows, mask=valid_m[:, None], other=0.0)
            w_kn = tl.load(w_cols, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = offs_k < F - k0
            h_mk = tl.load(h_rows, mask=valid_m[:, None] & mask_k[None, :], other=0.0)
            w_kn = tl.load(w_cols, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        g = k0 // GROUP
        hs_m = tl.load(hs_rows + g * stride_hsg, mask=valid_m, other=0.0)
        ws_n = tl.load(s_rows + g * stride_sg, mask=mask_n, other=0.0)
        acc += tl.dot(h_mk, w_kn) * hs_m[:, None] * ws_n[None, :]
        h_rows += BLOCK_K
        w_cols += BLOCK_K * stride_wf

    j_m = slot_m % KS
    routed_m = valid_m & (j_m < K)
    wt_m = tl.load(wt_ptr + (slot_m // KS).to(tl.int64) * stride_wt + j_m, mask=routed_m, other=1.0)
    acc = acc * wt_m.to(tl.float32)[:, None]
    tl.store(y_ptr + slot_m[:, None].to(tl.int64) * stride_y + offs_n[None, :], acc,
             mask=valid_m[:, None] & mask_n[None, :])


def fp8_config(cfg: dict, xq_ND: torch.Tensor) -> dict:
    """A bf16 tile config made fit for the FP8 kernels: BLOCK_K at most one scale group (128), and at least 32 on
    the GPU (FP8 tensor-core MMAs take K >= 32); stages fitted to shared memory at one byte an element."""
    cfg = dict(cfg)
    cfg["BLOCK_K"] = min(int(cfg["BLOCK_K"]), 128)
    if xq_ND.is_cuda:
        cfg["BLOCK_K"] = max(cfg["BLOCK_K"], 32)
    return _fit_config(cfg, xq_ND)


def fused_moe_fp8(x_ND: torch.Tensor, w13_EXD: torch.Tensor, w13_scale: torch.Tensor, w2_EDF: torch.Tensor,
                  w2_scale: torch.Tensor, weights_NK: torch.Tensor, idx_NK: torch.Tensor, n_shared: int = 0,
                  config: dict | None = None) -> torch.Tensor:
    from paraseek.infer.fp8 import BLOCK, quantize_1x128

    moe._check_moe_args(x_ND, w13_EXD, w2_EDF, weights_NK, idx_NK, n_shared)
    N, D = x_ND.shape
    E, X, _ = w13_EXD.shape
    F_ = X // 2
    K = idx_NK.shape[1]
    KS = K + n_shared
    S = N * KS
    out_ND = torch.empty((N, D), device=x_ND.device, dtype=x_ND.dtype)
    if N == 0:
        return out_ND
    xq_ND, xs_NG = quantize_1x128(x_ND)
    cfg = fp8_config(config if config is not None else moe.moe_config(N, KS, E, F_, D), xq_ND)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    weights_NK = weights_NK if weights_NK.stride(-1) == 1 else weights_NK.contiguous()
    idx_NK = idx_NK if idx_NK.dtype == torch.int32 else idx_NK.to(torch.int32)

    sorted_P, tile_expert_T = align_slots(idx_NK, n_shared, E, bm)
    T = tile_expert_T.shape[0]
    P = sorted_P.shape[0]
    h_PF = torch.empty((P, F_), device=x_ND.device, dtype=x_ND.dtype)
    _gate_up_fp8_kernel[(T, triton.cdiv(F_, bn))](
        xq_ND, xs_NG, w13_EXD, w13_scale, h_PF, sorted_P, tile_expert_T,
        xq_ND.stride(0), xs_NG.stride(0), xs_NG.stride(1), w13_EXD.stride(0), w13_EXD.stride(1), w13_EXD.stride(2),
        w13_scale.stride(0), w13_scale.stride(1), w13_scale.stride(2), h_PF.stride(0), S, D, F_,
        KS=KS, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=D % bk == 0, GROUP=BLOCK, **launch)
    # Every position row is quantized, the padding rows (never written, never read back) included: a fixed shape.
    hq_PF, hs_PG = quantize_1x128(h_PF)
    y_SD = torch.empty((S, D), device=x_ND.device, dtype=torch.float32)
    _down_fp8_kernel[(T, triton.cdiv(D, bn))](
        hq_PF, hs_PG, w2_EDF, w2_scale, weights_NK, y_SD, sorted_P, tile_expert_T,
        hq_PF.stride(0), hs_PG.stride(0), hs_PG.stride(1), w2_EDF.stride(0), w2_EDF.stride(1), w2_EDF.stride(2),
        w2_scale.stride(0), w2_scale.stride(1), w2_scale.stride(2), weights_NK.stride(0), y_SD.stride(0), S, D, F_,
        K=K, KS=KS, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=F_ % bk == 0, GROUP=BLOCK, **launch)
    block_d = min(_pow2(D), 1024)
    _combine_kernel[(N, triton.cdiv(D, block_d))](y_SD, out_ND, y_SD.stride(0), out_ND.stride(0), D, KS=KS,
                                                  BLOCK_D=block_d, num_warps=4 if block_d >= 512 else 1)
    return out_ND
