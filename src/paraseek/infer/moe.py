"""DeepSeek MoE decode ops: the router's expert choice (`route`) and the routed + shared experts in one pass
(`fused_moe`). Each function is a plain-torch reference (CPU, tests, any dtype) unless `ops.kernels_on()`, then it
runs the Triton kernels of `moe_kernels.py`, which have the same contract.

Shape legend (this module's; the MoE-facing letters differ from ops.py's attention legend, where E is the model
width): N tokens in the step, D model width, E experts (routed, or routed + shared where said: E_total), K routed
experts per token, F one expert's width, X = 2F (the fused gate|up rows), G expert groups, S token-expert slots,
P padded slot positions (a multiple of BLOCK_M), T tiles of BLOCK_M positions.

Slots. Token t has K + n_shared slots, numbered token-major: slot s = t * (K + n_shared) + j. Slot j < K is the
token's j-th routed expert idx_NK[t, j] with weight weights_NK[t, j]; slot K + i is shared expert E + i with weight
1.0. DeepSeekMoE's shared MLP of width n_shared x F is exactly n_shared experts of width F summed with weight 1
(SwiGLU is elementwise in its hidden units), so the shared experts are the last n_shared rows of the stacked
weights and cost no extra kernel (`pack_expert_weights` builds that layout).

The fused path (vLLM's fused_moe design, written anew here): instead of sorting the tokens by expert and running
grouped GEMMs (models/deepseek.py's MoE: an argsort, counts, gathers and three GEMMs, dozens of small kernels at
batch 1), one counting-sort kernel (`align_slots`) lays each expert's slots out contiguously, padded to a multiple
of BLOCK_M, and records the expert of every BLOCK_M-row tile; a gate|up kernel then runs one program per (tile, F
block), gathering its tile's token rows of x and reading the expert's weight block once for the whole tile; a down
kernel does the same for the down projection and scales by the routing weight; a combine kernel sums each token's
slots in slot order. Five launches in all with the router, none of them dependent on the data for its grid.

Tile configs: `moe_configs.json` (next to this module) holds, per expert-weight shape, the tile config for each
token count measured by scripts/gpu/tune_fused_moe.py:

    {"E=66,F=1408,D=2048": {"source": "<how these were chosen>",
                           "configs": {"1": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128,
                                             "num_warps": 4, "num_stages": 4}, "2": {...}, ...}}, ...}

The key is E_total (routed + shared experts of this rank), F and D of the stacked weights; "configs" maps a token
count to the config to use up to that many tokens (the entry with the smallest count >= N; beyond the largest, the
largest). BLOCK_M is the tile of slot rows (16, 32 or 64; tl.dot needs >= 16), BLOCK_N the output columns of a
program (of F for gate|up, of D for down), BLOCK_K the reduction step (over D, then over F). The configs are for
bf16 (the entries shipped first are starting defaults, not measurements; each entry's "source" says which); the
launcher lowers num_stages where a wider dtype would overflow shared memory. A shape that is not in the file gets
`default_config` (BLOCK_M from the mean slots per expert).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paraseek.infer import ops
from paraseek.infer.moe_layout import (  # noqa: F401  (re-exported: the tuning script and tests)
    CONFIG_FILE, CONFIG_KEYS, SCORE_FUNCS, TOPK_METHODS, _check_moe_args, _check_route_args, _config_file,
    _config_table, config_key, default_config, format_config_file, max_tiles, moe_config)



# ---- routing --------------------------------------------------------------------------------------------------------
def route(logits_NE: torch.Tensor, bias_E: torch.Tensor | None, *, score_func: str, topk_method: str, n_group: int,
          topk_group: int, top_k: int, norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice from its fp32 logits (the caller's GEMM): (weights_NK fp32, idx_NK int32), exactly
    models.deepseek.Gate.forward after its logits. scores = softmax or sigmoid(logits); the choice is scores + bias_E
    where given (noaux_tc's balancing bias; Gate has one only for noaux_tc). greedy: top-k of the choice.
    group_limited_greedy / noaux_tc with n_group > 1: groups of E / n_group experts ranked by their max choice
    (group_limited_greedy) or by the sum of their top-2 choices (noaux_tc); the experts outside the best topk_group
    groups are set to -inf, then top-k. The weights are the UNBIASED scores of the chosen experts, divided by their
    sum + 1e-20 when norm_topk_prob and top_k > 1, times `scaling`. The K experts come in descending order of the
    choice; the kernel breaks exact ties towards the lower expert index (and the lower group index)."""
    E = logits_NE.shape[-1]
    grouped = _check_route_args(E, score_func, topk_method, n_group, topk_group, top_k)
    if ops.kernels_on():
        from paraseek.infer import moe_kernels

        return moe_kernels.route(logits_NE, bias_E, score_func=score_func, topk_method=topk_method, n_group=n_group,
                                 topk_group=topk_group, top_k=top_k, norm_topk_prob=norm_topk_prob, scaling=scaling)
    logits_NE = logits_NE.float()
    scores_NE = logits_NE.softmax(dim=-1) if score_func == "softmax" else logits_NE.sigmoid()
    choice_NE = scores_NE if bias_E is None else scores_NE + bias_E.float()
    if grouped:
        grouped_NGX = choice_NE.view(-1, n_group, E // n_group)
        if topk_method == "noaux_tc":
            group_NG = grouped_NGX.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_NG = grouped_NGX.amax(dim=-1)
        keep_NG = torch.zeros_like(group_NG, dtype=torch.bool)
        keep_NG.scatter_(1, group_NG.topk(topk_group, dim=-1).indices, True)
        keep_NE = keep_NG.unsqueeze(-1).expand_as(grouped_NGX).reshape(-1, E)
        choice_NE = choice_NE.masked_fill(~keep_NE, float("-inf"))
    idx_NK = choice_NE.topk(top_k, dim=-1, sorted=True).indices
    weights_NK = scores_NE.gather(1, idx_NK)
    if norm_topk_prob and top_k > 1:
        weights_NK = weights_NK / (weights_NK.sum(dim=-1, keepdim=True) + 1e-20)
    return weights_NK * scaling, idx_NK.to(torch.int32)


# ---- slot layout --------------------------------------------------------------------------------------------------
def align_slots(idx_NK: torch.Tensor, n_shared: int, n_experts: int,
                block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counting sort of the slots by expert: (sorted_slots_P int32, tile_expert_T int32), T = max_tiles(S,
    n_experts, block_m), P = T x block_m. Expert e's slots, in slot order, fill positions [start_e, start_e + c_e),
    then padding up to the next multiple of block_m; start_e is the sum of the padded counts of the experts before
    it. Padding positions, and everything past the last expert, hold S (no slot). tile_expert_T[t] is the expert of
    positions [t x block_m, (t + 1) x block_m), or -1 past the last tile. n_experts counts routed + shared."""
    if ops.kernels_on():
        from paraseek.infer import moe_kernels

        return moe_kernels.align_slots(idx_NK, n_shared, n_experts, block_m)
    N, K = idx_NK.shape
    E, dev = n_experts, idx_NK.device
    expert_S = slot_experts(idx_NK, n_shared, E).reshape(-1)
    S = expert_S.numel()
    T = max_tiles(S, E, block_m)
    counts_E = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, expert_S, torch.ones_like(expert_S))
    padded_E = (counts_E + block_m - 1) // block_m * block_m
    start_E = torch.cumsum(padded_E, 0) - padded_E
    order_S = torch.argsort(expert_S, stable=True)  # slot order within each expert
    first_E = torch.cumsum(counts_E, 0) - counts_E  # where each expert's run starts in the unpadded order
    e_S = expert_S[order_S]
    pos_S = start_E[e_S] + torch.arange(S, device=dev) - first_E[e_S]
    sorted_P = torch.full((T * block_m,), S, dtype=torch.int32, device=dev)
    sorted_P[pos_S] = order_S.to(torch.int32)
    tile_start_E = start_E // block_m
    t_T = torch.arange(T, device=dev)
    tile_expert_T = torch.searchsorted(tile_start_E, t_T, right=True) - 1  # the last expert starting at or before t
    tile_expert_T = torch.where(t_T < padded_E.sum() // block_m, tile_expert_T, -1)
    return sorted_P, tile_expert_T.to(torch.int32)


def slot_experts(idx_NK: torch.Tensor, n_shared: int, n_experts: int) -> torch.Tensor:
    """[N, K + n_shared] int64: each slot's expert (the routed ones, then the shared experts E - n_shared + i)."""
    N = idx_NK.shape[0]
    shared_NS = torch.arange(n_experts - n_shared, n_experts, device=idx_NK.device).expand(N, n_shared)
    return torch.cat([idx_NK.long(), shared_NS], dim=1)


# ---- experts ------------------------------------------------------------------------------------------------------
def pack_expert_weights(gate_EFD: torch.Tensor, up_EFD: torch.Tensor, down_EDF: torch.Tensor,
                        shared_gate_XD: torch.Tensor | None = None, shared_up_XD: torch.Tensor | None = None,
                        shared_down_DX: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The stacked routed experts (models.deepseek.Experts' [E, F, D], [E, F, D], [E, D, F]) and optionally the
    shared MLP (nn.Linear weights [n_shared F, D], [n_shared F, D], [D, n_shared F]) -> (w13_EXD [E_total, 2F, D],
    w2_EDF [E_total, D, F], n_shared): per expert gate rows then up rows; shared chunk j is gate/up rows
    j F:(j+1) F and down columns j F:(j+1) F, appended after the routed experts. Contiguous copies."""
    F_ = gate_EFD.shape[1]
    n_shared = 0
    if shared_gate_XD is not None:
        if shared_gate_XD.shape[0] % F_:
            raise ValueError(f"pack_expert_weights: the shared MLP width {shared_gate_XD.shape[0]} is not a multiple "
                             f"of the expert width {F_}")
        n_shared = shared_gate_XD.shape[0] // F_
        gate_EFD = torch.cat([gate_EFD, shared_gate_XD.reshape(n_shared, F_, -1)])
        up_EFD = torch.cat([up_EFD, shared_up_XD.reshape(n_shared, F_, -1)])
        down_EDF = torch.cat([down_EDF, torch.stack(shared_down_DX.split(F_, dim=1))])
    return torch.cat([gate_EFD, up_EFD], dim=1).contiguous(), down_EDF.contiguous(), n_shared


def fused_moe(x_ND: torch.Tensor, w13_EXD: torch.Tensor, w2_EDF: torch.Tensor, weights_NK: torch.Tensor,
              idx_NK: torch.Tensor, n_shared: int = 0, config: dict | None = None) -> torch.Tensor:
    """out[t] = sum over token t's slots of w_slot * down_e(silu(gate_e(x_t)) * up_e(x_t)): its K routed experts
    idx_NK[t] with weights_NK[t], then the n_shared shared experts (the last n_shared of w13/w2) with weight 1.0.
    h = silu(x W_gate^T) * (x W_up^T) accumulated in fp32 and rounded once to x's dtype; y = h W2^T accumulated in
    fp32; the weighted sum in fp32, slot by slot, rounded to x's dtype at the end. `config` (the kernels' tile
    config, see the module docstring) is ignored by the reference."""
    _check_moe_args(x_ND, w13_EXD, w2_EDF, weights_NK, idx_NK, n_shared)
    if ops.kernels_on():
        from paraseek.infer import moe_kernels

        return moe_kernels.fused_moe(x_ND, w13_EXD, w2_EDF, weights_NK, idx_NK, n_shared, config)

    def expert(e: int, x_MD: torch.Tensor) -> torch.Tensor:
        w13 = w13_EXD[e].float()
        F_ = w13.shape[0] // 2
        h_MF = (F.silu(x_MD @ w13[:F_].t()) * (x_MD @ w13[F_:].t())).to(x_ND.dtype)
        return h_MF.float() @ w2_EDF[e].float().t()

    return _combine_experts(x_ND.float(), expert, weights_NK, idx_NK, n_shared, w13_EXD.shape[0], x_ND.dtype)


def fused_moe_fp8(x_ND: torch.Tensor, w13_EXD: torch.Tensor, w13_scale: torch.Tensor, w2_EDF: torch.Tensor,
                  w2_scale: torch.Tensor, weights_NK: torch.Tensor, idx_NK: torch.Tensor, n_shared: int = 0,
                  config: dict | None = None) -> torch.Tensor:
    """`fused_moe` with the experts in DeepSeek-V3's FP8 format (infer/fp8.py): w13_EXD and w2_EDF float8 e4m3 with
    one fp32 scale per 128 x 128 block of each expert's matrix, w13_scale [E, ceil(2F/128), ceil(D/128)] (one grid
    over the 2F gate|up rows) and w2_scale [E, ceil(D/128), ceil(F/128)]. Activations are quantized per token in
    1 x 128 groups (fp8.quantize_1x128): x once per token; h = silu(x W_gate^T) * (x W_up^T) from the quantized x,
    accumulated in fp32 and rounded to x's dtype, then quantized per slot row; y = w_slot * h W2^T in fp32; the
    slots summed in slot order, rounded to x's dtype at the end. The reference computes each product in fp32 from
    the dequantized values; the kernels of moe_kernels.py scale each 128-wide partial sum instead (the same sums)."""
    _check_moe_args(x_ND, w13_EXD, w2_EDF, weights_NK, idx_NK, n_shared)
    _check_fp8_scales(w13_EXD, w13_scale, w2_EDF, w2_scale)
    if ops.kernels_on():
        from paraseek.infer import moe_kernels

        return moe_kernels.fused_moe_fp8(x_ND, w13_EXD, w13_scale, w2_EDF, w2_scale, weights_NK, idx_NK, n_shared,
                                         config)
    from paraseek.infer.fp8 import dequantize_1x128, dequantize_fp8, quantize_1x128

    def expert(e: int, x_MD: torch.Tensor) -> torch.Tensor:
        w13 = dequantize_fp8(w13_EXD[e], w13_scale[e])
        F_ = w13.shape[0] // 2
        h_MF = (F.silu(x_MD @ w13[:F_].t()) * (x_MD @ w13[F_:].t())).to(x_ND.dtype)
        return dequantize_1x128(*quantize_1x128(h_MF)) @ dequantize_fp8(w2_EDF[e], w2_scale[e]).t()

    x32_ND = dequantize_1x128(*quantize_1x128(x_ND))
    return _combine_experts(x32_ND, expert, weights_NK, idx_NK, n_shared, w13_EXD.shape[0], x_ND.dtype)


def _check_fp8_scales(w13_EXD, w13_scale, w2_EDF, w2_scale) -> None:
    E, X, D = w13_EXD.shape
    cdiv = lambda n: -(-n // 128)  # noqa: E731
    want = ((E, cdiv(X), cdiv(D)), (E, cdiv(D), cdiv(X // 2)))
    for name, w, s, shape in (("w13", w13_EXD, w13_scale, want[0]), ("w2", w2_EDF, w2_scale, want[1])):
        if w.dtype != torch.float8_e4m3fn or s.dtype != torch.float32 or tuple(s.shape) != shape:
            raise ValueError(f"fused_moe_fp8: {name} must be float8_e4m3fn with float32 block scales {shape}, got "
                             f"{w.dtype} and {s.dtype} {tuple(s.shape)}")


def _combine_experts(x32_ND: torch.Tensor, expert, weights_NK: torch.Tensor, idx_NK: torch.Tensor, n_shared: int,
                     E: int, dtype: torch.dtype) -> torch.Tensor:
    """The reference's slot loop: expert(e, x rows of the slots that chose e) -> their fp32 outputs, each weighted,
    summed per token slot by slot (the order the combine kernel sums in), rounded to `dtype`."""
    N, D = x32_ND.shape
    expert_NS = slot_experts(idx_NK, n_shared, E)
    w_NS = torch.cat([weights_NK.float(), weights_NK.new_ones(N, n_shared, dtype=torch.float32)], dim=1)
    y_NSD = torch.zeros(N, expert_NS.shape[1], D, dtype=torch.float32, device=x32_ND.device)
    for e in range(E):  # every expert once, on the rows of the slots that chose it
        tok, j = (expert_NS == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        y_NSD[tok, j] = expert(e, x32_ND[tok]) * w_NS[tok, j, None]
    out_ND = y_NSD[:, 0]
    for s in range(1, y_NSD.shape[1]):  # slot by slot, the order the combine kernel sums in
        out_ND = out_ND + y_NSD[:, s]
    return out_ND.to(dtype)
