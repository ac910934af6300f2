"""The DeepSeek family as single-device math: Llama/Qwen2-style dense models (DeepSeek-LLM, R1-Distill) and
DeepSeek-V2/V3 (MLA + DeepSeekMoE). Parallelism is applied from outside; nothing here knows the world size.

Shape letters, in variable names where tensors are reshaped (TorchTitan's suffixes) -- the one legend every paraseek
file uses: B batch (sequences), T tokens per sequence, W = T + 1 tokens of a training window, N = B*T tokens, C the
tokens of one chunk, D model dim, F ffn (expert) width, H heads, Q q/k head dim, U v head dim, R rope dim, V vocab,
I/O a linear's in/out features, E experts, K experts per token, G expert groups, L local experts (E / ep), M
token-expert slots (N*K, the rows of a grouped GEMM), P ranks of a process group, Y MoE layers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paraseek.models.args import ModelArgs
from paraseek.models.fp8_grouped import fp8_grouped_mm, pad_groups


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 whatever the compute dtype (norms are the precision-sensitive part).
        x_fp32 = x.float()
        x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x_fp32.to(x.dtype)


# ---- rotary position embedding ----------------------------------------------------------------------------------------
def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context extended `scale` times: sqrt(1/t) = 0.1 ln(s) + 1 (Peng et al.
    2023, sec. 3.4); DeepSeek's config multiplies the 0.1 by `mscale` (the hub's yarn_get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [R/2] and the cos/sin scale for plain, linear, llama3 and YaRN RoPE.

    llama3: Meta's piecewise frequency rescaling (Llama 3.1). YaRN: Peng et al. 2023, eqs. 17-20 -- frequencies
    below the `beta_slow` rotation count are interpolated by `factor`, above `beta_fast` kept, ramped in between;
    cos/sin are scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim) as DeepSeek-V2 configures it.
    """
    dim, base = args.rope_dim, args.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if args.rope_type == "linear":
        return inv_freq / args.rope_factor, 1.0
    if args.rope_type == "llama3":
        factor, old_len = args.rope_factor, args.rope_original_max_seq_len
        low_wavelen, high_wavelen = old_len / args.rope_low_freq_factor, old_len / args.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - args.rope_low_freq_factor) / (args.rope_high_freq_factor - args.rope_low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if args.rope_type == "yarn":
        factor, old_len = args.rope_factor, args.rope_original_max_seq_len

        def correction_dim(n_rot: float) -> float:
            return dim * math.log(old_len / (n_rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(args.rope_beta_fast)), 0)
        high = min(math.ceil(correction_dim(args.rope_beta_slow)), dim - 1)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001), 0, 1)
        keep = 1 - ramp  # 1 = keep the original (extrapolated) frequency
        inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep
        if args.rope_mscale and args.rope_mscale_all_dim:
            attn_factor = _yarn_mscale(factor, args.rope_mscale) / _yarn_mscale(factor, args.rope_mscale_all_dim)
        else:
            attn_factor = _yarn_mscale(factor)
        return inv_freq, attn_factor
    return inv_freq, 1.0


def apply_rope(x_BTHR: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate the last dim. cos/sin hold R/2 angles, [T, R/2] (positions 0..T-1 of every row) or [B, T, R/2] (each
    row's own positions: packed documents). Half-split layout (Llama) or adjacent pairs (DeepSeek MLA).

    For adjacent pairs the output is written in half-split order; queries and keys get the same permutation, so
    q.k is unchanged and the layout after rotation is free to choose."""
    cos, sin = cos_TR.unsqueeze(-2), sin_TR.unsqueeze(-2)  # a heads dim to broadcast over
    if interleave:
        x1, x2 = x_BTHR[..., 0::2], x_BTHR[..., 1::2]
    else:
        x1, x2 = x_BTHR.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# ---- attention --------------------------------------------------------------------------------------------------------
def document_mask(positions_BT: torch.Tensor):
    """Causal attention inside each document of packed rows: query t sees key s iff s <= t and no document starts in
    (s, t], a document starting wherever a row's position is 0 (the rule HF's packing collator and FlashAttention-2's
    varlen path read position ids by). One mask per micro-batch, shared by every layer.

    On CUDA a FlexAttention BlockMask (Dong et al. 2024: only the 128 x 128 blocks a document touches are computed);
    elsewhere a dense [B, 1, T, T] boolean mask for SDPA, since torch 2.13's FlexAttention has no backward on the CPU
    ("FlexAttention does not support backward on CPU"). Both are the same predicate."""
    doc_BT = (positions_BT == 0).cumsum(dim=1)
    B, T = doc_BT.shape
    if positions_BT.is_cuda:
        from torch.nn.attention.flex_attention import create_block_mask

        def same_document_causal(b, h, q, kv):
            return (doc_BT[b, q] == doc_BT[b, kv]) & (q >= kv)

        return create_block_mask(same_document_causal, B, None, T, T, device=positions_BT.device, _compile=True)
    t_T = torch.arange(T, device=positions_BT.device)
    causal_TT = t_T[:, None] >= t_T[None, :]
    return ((doc_BT[:, :, None] == doc_BT[:, None, :]) & causal_TT)[:, None]


_compiled_flex = None


def attention(q_BHTQ: torch.Tensor, k_BHTQ: torch.Tensor, v_BHTU: torch.Tensor, scale: float, mask=None,
              enable_gqa: bool = False) -> torch.Tensor:
    """Causal SDPA, or, given a `document_mask`, attention restricted to each document: FlexAttention for a
    BlockMask (compiled once: eager FlexAttention materializes the whole score matrix), SDPA with the boolean
    mask otherwise."""
    if mask is None:
        return F.scaled_dot_product_attention(q_BHTQ, k_BHTQ, v_BHTU, is_causal=True, scale=scale,
                                              enable_gqa=enable_gqa)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q_BHTQ, k_BHTQ, v_BHTU, attn_mask=mask, scale=scale,
                                              enable_gqa=enable_gqa)
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q_BHTQ, k_BHTQ, v_BHTU, block_mask=mask, scale=scale, enable_gqa=enable_gqa)


class Attention(nn.Module):
    """Multi-head attention with GQA and optional q/k/v bias (DeepSeek-LLM, Llama, Qwen2)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.o_bias)
        self.softmax_scale = args.head_dim**-0.5

    def forward(self, x_BTD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor, mask=None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        # -1 heads: under tensor parallelism the projections hold n_heads / tp (n_kv_heads / tp) heads.
        q = apply_rope(self.q_proj(x_BTD).view(B, T, -1, self.head_dim), cos_TR, sin_TR, False)
        k = apply_rope(self.k_proj(x_BTD).view(B, T, -1, self.head_dim), cos_TR, sin_TR, False)
        v = self.v_proj(x_BTD).view(B, T, -1, self.head_dim)
        o = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.softmax_scale, mask,
                      enable_gqa=self.n_kv_heads != self.n_heads)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class MLA(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 paper, sec. 2.1): queries optionally through a low-rank q_lora,
    keys/values from one compressed latent of width kv_lora_rank, plus a decoupled RoPE key shared by all heads."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.q_lora_rank, self.kv_lora_rank = args.q_lora_rank, args.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        qk_dim = self.nope_dim + self.rope_dim
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(args.dim, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)
            self.q_b_proj = nn.Linear(self.q_lora_rank, args.n_heads * qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(args.dim, args.n_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(args.dim, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, args.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=False)
        # DeepSeek's softmax scale: 1/sqrt(qk_dim), times mscale(factor, mscale_all_dim)^2 under YaRN -- the
        # temperature of every q.k logit (the non-rotary dims' too), sqrt(1/t) on q and on k, hence squared; as
        # DeepSeek-V3's inference/model.py (MLA) and the hub's modeling_deepseek.py compute it.
        self.softmax_scale = qk_dim**-0.5
        if args.rope_type == "yarn" and args.rope_mscale_all_dim:
            self.softmax_scale *= _yarn_mscale(args.rope_factor, args.rope_mscale_all_dim) ** 2
        self.interleave = args.rope_interleave

    def forward(self, x_BTD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor, mask=None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD))) if self.q_lora_rank else self.q_proj(x_BTD)
        q_nope, q_pe = q.view(B, T, -1, self.nope_dim + self.rope_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        H = q_nope.shape[2]  # n_heads, or n_heads / tp under tensor parallelism
        kv_latent, k_pe = self.kv_a_proj_with_mqa(x_BTD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_latent)).view(B, T, H, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos_TR, sin_TR, self.interleave)
        k_pe = apply_rope(k_pe.view(B, T, 1, self.rope_dim), cos_TR, sin_TR, self.interleave)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(B, T, H, self.rope_dim)], dim=-1)
        # q/k head dim 192, v 128: SDPA runs cuDNN's kernel, 357 TFLOP/s forward+backward on H200 at V2-Lite's shape;
        # padding v to 192 for the flash kernel measured 2.3x slower
        # (benchmarks/2026-11-30/train-v2lite14-padded-mla-attention.json; BENCHMARKS.md, "The compile terms").
        o = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.softmax_scale, mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * self.v_dim))


# ---- feed-forward -----------------------------------------------------------------------------------------------------
class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter_dim, bias=False)
        self.up_proj = nn.Linear(dim, inter_dim, bias=False)
        self.down_proj = nn.Linear(inter_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _use_grouped_mm(x: torch.Tensor) -> bool:
    # torch._grouped_mm's fast kernels are Hopper+ (sm90) and bf16; elsewhere the exact per-expert loop is used.
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )


def grouped_mm(x_MI: torch.Tensor, w_EOI: torch.Tensor, counts_E: torch.Tensor, use_grouped: bool | None = None,
               fp8: bool = False) -> torch.Tensor:
    """Rows of x sorted by expert (counts_E rows for expert e) times expert e's weight [O, I]: one grouped GEMM.

    The fallback loops over experts (never over tokens) and is exact; it needs the counts on the host.
    fp8: the float8 grouped GEMM of --fp8-experts (models/fp8_grouped.py)."""
    if fp8:
        return fp8_grouped_mm(x_MI, w_EOI, counts_E)
    if use_grouped is None:
        use_grouped = _use_grouped_mm(x_MI)
    if use_grouped:
        offs_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
        return torch._grouped_mm(x_MI, w_EOI.transpose(-2, -1), offs=offs_E)
    chunks = x_MI.split(counts_E.tolist(), dim=0)
    return torch.cat([chunk @ w_EOI[e].t() for e, chunk in enumerate(chunks)], dim=0)


class Experts(nn.Module):
    """E routed SwiGLU experts as stacked [E, out, in] weights (one per-expert nn.Linear each in the hub format)."""

    # The GEMMs in float8 (--fp8-experts on; set by parallel.fp8.apply_fp8). A class attribute: expert
    # parallelism's subclass is built without Experts.__init__.
    fp8: bool = False

    def __init__(self, n_experts: int, dim: int, inter_dim: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n_experts, inter_dim, dim))
        self.up_proj = nn.Parameter(torch.empty(n_experts, inter_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, inter_dim))

    def forward(self, x_MD: torch.Tensor, counts_E: torch.Tensor, use_grouped: bool | None = None) -> torch.Tensor:
        if self.fp8:  # the float8 grouped GEMM takes groups of 16k rows: zero rows added once for all three GEMMs
            dest_M, counts_E, n_pad = pad_groups(counts_E, x_MD.shape[0])
            x_MD = x_MD.new_zeros(n_pad, x_MD.shape[1]).index_copy(0, dest_M, x_MD)
        h_MF = F.silu(self.project("gate_proj", x_MD, counts_E, use_grouped)) * self.project(
            "up_proj", x_MD, counts_E, use_grouped
        )
        y_MD = self.project("down_proj", h_MF, counts_E, use_grouped)
        return y_MD.index_select(0, dest_M) if self.fp8 else y_MD

    def project(self, name: str, x_MI: torch.Tensor, counts_E: torch.Tensor, use_grouped: bool | None) -> torch.Tensor:
        """x through the stacked projection `name` ([E, O, I]): the one place an expert weight is applied, so that
        what is applied from outside (expert parallelism's local shards, LoRA's low-rank term) overrides only this."""
        return grouped_mm(x_MI, getattr(self, name), counts_E, use_grouped, self.fp8)


class Gate(nn.Module):
    """The router: scores (softmax or sigmoid, in fp32), expert selection and combine weights.

    greedy: top-k of the scores. group_limited_greedy (V2's device-limited routing, V2 paper sec. 2.2.2): keep the
    topk_group groups with the highest max score. noaux_tc (V3's node-limited routing, V3 report sec. 2.1.2: groups
    ranked by the sum of their experts' highest K / topk_group scores, 2 per group in V3's configs): choose with
    scores + e_score_correction_bias (the auxiliary-loss-free balancing bias, sec. 2.1.2), but weight with the
    unbiased scores. As DeepSeek-V3's inference/model.py Gate and the hub's modeling_deepseek.py do."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.dim))
        if args.topk_method == "noaux_tc":
            # A buffer, not a parameter: it is moved by the balancing rule, not by gradients.
            self.register_buffer("e_score_correction_bias", torch.zeros(args.n_routed_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self.args
        logits_NE = F.linear(x_ND.float(), self.weight.float())
        scores_NE = logits_NE.softmax(dim=-1) if a.score_func == "softmax" else logits_NE.sigmoid()
        choice_NE = scores_NE
        if self.e_score_correction_bias is not None:
            choice_NE = scores_NE + self.e_score_correction_bias
        if a.topk_method != "greedy" and a.n_group > 1:
            grouped = choice_NE.view(-1, a.n_group, a.n_routed_experts // a.n_group)
            if a.topk_method == "noaux_tc":
                group_scores_NG = grouped.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores_NG = grouped.amax(dim=-1)
            keep_NG = torch.zeros_like(group_scores_NG, dtype=torch.bool)
            keep_NG.scatter_(1, group_scores_NG.topk(a.topk_group, dim=-1, sorted=False).indices, True)
            keep_NE = keep_NG.unsqueeze(-1).expand_as(grouped).reshape(-1, a.n_routed_experts)
            # -inf (not 0) so a masked-out expert can never win when biased scores are negative.
            choice_NE = choice_NE.masked_fill(~keep_NE, float("-inf"))
        idx_NK = choice_NE.topk(a.n_activated_experts, dim=-1, sorted=False).indices
        weights_NK = scores_NE.gather(1, idx_NK)
        if a.norm_topk_prob and a.n_activated_experts > 1:
            weights_NK = weights_NK / (weights_NK.sum(dim=-1, keepdim=True) + 1e-20)
        return weights_NK * a.routed_scaling_factor, idx_NK, scores_NE


class MoE(nn.Module):
    """DeepSeekMoE: shared experts every token passes through + fine-grained routed experts (top-K of E).

    Tokens are sorted by expert so each expert's rows are contiguous, then one grouped GEMM per projection.
    Expert parallelism swaps `self.experts` for a module with the same call (paraseek.parallel.expert)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_experts, self.top_k = args.n_routed_experts, args.n_activated_experts
        self.gate = Gate(args)
        self.experts = Experts(args.n_routed_experts, args.dim, args.moe_inter_dim)
        self.shared_experts = (
            MLP(args.dim, args.moe_inter_dim * args.n_shared_experts) if args.n_shared_experts else None
        )
        self.use_grouped_mm: bool | None = None  # None: torch._grouped_mm where the GPU supports it; False: the loop
        # Tokens routed to each expert in the last forward (load telemetry and V3's balancing rule read it).
        # int64: a float buffer would be cast to bf16 with the model and lose counts above 256.
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_routed_experts, dtype=torch.int64), persistent=False)
        # Training-only balance loss (V2 expert-level, V3 sequence-wise), off by default: a callable
        # (out_ND, scores_NE, idx_NK, n_seqs) -> out_ND that attaches the loss's gradient to the output
        # (paraseek.parallel.expert.enable_balance_loss).
        self.balance_loss = None

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        shape = x_BTD.shape
        x_ND = x_BTD.reshape(-1, shape[-1])
        weights_NK, idx_NK, scores_NE = self.gate(x_ND)
        flat_idx = idx_NK.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)  # slots sorted by expert
        # Not bincount: its output size depends on the data, which costs a host sync on CUDA and a graph break under
        # torch.compile; this tensor is always [E].
        counts_E = torch.zeros(self.n_experts, dtype=torch.int64, device=flat_idx.device).scatter_add_(
            0, flat_idx, torch.ones_like(flat_idx))
        with torch.no_grad():
            self.tokens_per_expert.copy_(counts_E)
        token_of_slot = order // self.top_k
        y_MD = self.experts(x_ND[token_of_slot], counts_E, self.use_grouped_mm)
        # Back to token-major slot order (a permutation: no atomics), then the weighted sum over the K experts in
        # fp32 -- deterministic, unlike index_add_, and as precise as transformers' fp32 combine.
        y_slots = torch.empty_like(y_MD)
        y_slots[order] = y_MD
        out_ND = (y_slots.view(-1, self.top_k, y_MD.shape[-1]).float() * weights_NK.unsqueeze(-1)).sum(1).to(x_ND.dtype)
        if self.balance_loss is not None:
            out_ND = self.balance_loss(out_ND, scores_NE, idx_NK, shape[0] if len(shape) == 3 else 1)
        if self.shared_experts is not None:
            out_ND = out_ND + self.shared_experts(x_ND)
        return out_ND.view(shape)


# ---- blocks and the model ---------------------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = MLA(args) if args.is_mla else Attention(args)
        self.mlp = MoE(args) if args.is_moe_layer(layer_id) else MLP(args.dim, args.inter_dim)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x_BTD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor, mask=None) -> torch.Tensor:
        # `mask` by keyword: tensor parallelism's input hooks lay out the positional inputs only
        x_BTD = x_BTD + self.self_attn(self.input_layernorm(x_BTD), cos_TR, sin_TR, mask=mask)
        return x_BTD + self.mlp(self.post_attention_layernorm(x_BTD))


def shift_tokens(x_BTD: torch.Tensor, k: int) -> torch.Tensor:
    """Position i gets x at position i + k: the sequence shifted k to the left, zeros at the last k positions."""
    return torch.cat([x_BTD[:, k:], torch.zeros_like(x_BTD[:, :k])], dim=1)


class MTPModule(nn.Module):
    """DeepSeek-V3's multi-token-prediction module of depth k = `depth` (1, 2, ...; V3 report, sec. 2.2, eqs. 21-23):
    at position i it combines the previous depth's hidden state h^{k-1}_i (k = 1: the main model's last block
    output, before the final norm) with the embedding of token i + k,

        h'^k_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])

    (the report writes the two halves the other way round; the hub's eh_proj weights take the embedding first, as
    vLLM and SGLang run them), runs its transformer block over the sequence, h^k = block(h'^k), and predicts
    t_{i+k+1} through its own final norm (the hub's shared_head.norm) and the main model's output head. The
    embedding table and the head are the main model's."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.depth = layer_id - args.n_layers + 1
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = Block(layer_id, args)
        self.norm = RMSNorm(args.dim, args.norm_eps)  # the hub's shared_head.norm

    def forward(self, h_BTD: torch.Tensor, emb_BTD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor,
                mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(h^k [B, T, D], for the next depth; norm(h^k), the head's input) from h^{k-1} and the main embedding's
        output Emb(t_i) [B, T, D] (unshifted: the module takes position i + k's). The last k positions combine
        with zeros; they have no target, and causal attention keeps them out of every earlier position."""
        emb_BTD = shift_tokens(emb_BTD, self.depth)
        x_BTD = self.eh_proj(torch.cat([self.enorm(emb_BTD), self.hnorm(h_BTD)], dim=-1))
        h_BTD = self.block(x_BTD, cos_TR, sin_TR, mask=mask)
        return h_BTD, self.norm(h_BTD)


class Transformer(nn.Module):
    """Decoder-only LM. `forward(input_ids [B, T]) -> logits [B, T, V]`. Layers live in a ModuleDict keyed by their
    global index so that a pipeline stage that deletes layers keeps the checkpoint names.

    `mtp` holds V3's multi-token-prediction modules (args.n_mtp_layers); `mtp_depth` says how many of them forward
    runs when asked for their losses (training with --mtp-layers sets it; 0 keeps them as weights only)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPModule(args.n_layers + k, args) for k in range(args.n_mtp_layers))
        # Every pipeline stage is told the depth: a stage before the last then passes the embedding's output on, beside
        # the hidden states, to the last stage, which holds the MTP modules but not the embedding.
        self.mtp_depth = 0
        inv_freq, self.rope_attn_factor = rope_inv_freq(args)
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)

    def rope_cos_sin(self, seq_len: int, device: torch.device,
                     positions_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, R/2] of positions 0..seq_len-1, or [B, T, R/2] of each row's own `positions_BT`."""
        if positions_BT is None:
            pos = torch.arange(seq_len, device=device, dtype=torch.float32)
        else:
            pos = positions_BT.to(device=device, dtype=torch.float32)
        angles = pos.unsqueeze(-1) * self.rope_inv_freq.to(device=device, dtype=torch.float32)
        return angles.cos() * self.rope_attn_factor, angles.sin() * self.rope_attn_factor

    def hidden_states(self, input_ids_BT: torch.Tensor, seq_len: int | None = None,
                      positions_BT: torch.Tensor | None = None) -> torch.Tensor:
        """The final-norm hidden states [B, T, D] (the loss can then be computed without whole logits). A pipeline
        stage without the embedding takes hidden states instead of ids, and one without the final norm returns its
        last block's output. `seq_len`: the whole sequence's length when the input holds only part of its positions
        (a later pipeline stage under sequence parallelism receives T / tp of them); default its own length.
        `positions_BT`: each token's position in its document, for rows that pack several documents: RoPE restarts
        and attention stays inside each document (document_mask); None = one sequence per row."""
        h_BTD = self._trunk(input_ids_BT, seq_len, positions_BT)[0]
        return self.norm(h_BTD) if self.norm is not None else h_BTD

    def _trunk(self, x_BT: torch.Tensor, seq_len: int | None, positions_BT: torch.Tensor | None) -> tuple:
        """(the last block's output h [B, T, D], the embedding's output [B, T, D] when MTP runs (else None), cos,
        sin, mask). A pipeline stage without the embedding takes the hidden states -- [h; embedding output]
        concatenated on the last dim when MTP runs -- instead of ids."""
        emb_BTD = None
        if self.embed_tokens is not None:
            h_BTD = self.embed_tokens(x_BT)
            emb_BTD = h_BTD if self.mtp_depth else None
        elif self.mtp_depth:
            h_BTD, emb_BTD = x_BT.chunk(2, dim=-1)
        else:
            h_BTD = x_BT
        # RoPE over the whole sequence: under sequence parallelism h_BTD holds only this rank's T / tp positions.
        cos_TR, sin_TR = self.rope_cos_sin(seq_len or x_BT.shape[1], h_BTD.device, positions_BT)
        cos_TR, sin_TR = cos_TR.to(h_BTD.dtype), sin_TR.to(h_BTD.dtype)
        mask = None if positions_BT is None else document_mask(positions_BT.to(h_BTD.device))
        for layer in self.layers.values():
            h_BTD = layer(h_BTD, cos_TR, sin_TR, mask=mask)
        return h_BTD, emb_BTD, cos_TR, sin_TR, mask

    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def head(self, h_BTD: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] of final-norm hidden states. Through the lm_head module (same math as F.linear) so that
        a tensor-parallel plan's hooks on it apply."""
        return self.lm_head(h_BTD) if self.lm_head is not None else F.linear(h_BTD, self.embed_tokens.weight)

    def forward(self, input_ids_BT: torch.Tensor, labels_BT: torch.Tensor | None = None, loss_chunks: int = 0,
                seq_len: int | None = None, positions_BT: torch.Tensor | None = None,
                mtp_labels_BT: torch.Tensor | None = None):
        """Logits [B, T, V]; or, given labels and loss_chunks > 0, the summed token cross-entropy computed chunk by
        chunk without whole logits (models/loss.py). Inside forward, so that FSDP2 has the head gathered. `seq_len`,
        `positions_BT`: see hidden_states.

        `mtp_labels_BT`: the next-token labels [B, T] once more, from which each MTP depth's targets are shifted
        (models/loss.py: mtp_labels); given, and with `mtp_depth` > 0, the result is (the above, mtp_losses [D])
        with each depth's summed token cross-entropy. A pipeline stage gets it as a keyword, as `positions_BT`."""
        h_BTD, emb_BTD, cos_TR, sin_TR, mask = self._trunk(input_ids_BT, seq_len, positions_BT)
        if self.norm is None:  # a pipeline stage before the last: its output is the next stage's input
            return h_BTD if emb_BTD is None else torch.cat([h_BTD, emb_BTD], dim=-1)
        if labels_BT is not None and loss_chunks > 0:
            from paraseek.models.loss import chunked_head_loss

            out = chunked_head_loss(self.norm(h_BTD), self.output_weight(), labels_BT, loss_chunks)
        else:
            out = self.head(self.norm(h_BTD))
        if mtp_labels_BT is None or not self.mtp_depth:
            return out
        return out, self.mtp_losses(h_BTD, emb_BTD, cos_TR, sin_TR, mask, mtp_labels_BT, positions_BT, loss_chunks)

    def mtp_losses(self, h_BTD: torch.Tensor, emb_BTD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor,
                   mask, labels_BT: torch.Tensor, positions_BT: torch.Tensor | None = None,
                   loss_chunks: int = 0) -> torch.Tensor:
        """[mtp_depth] fp32: the summed token cross-entropy of each depth k = 1 .. mtp_depth, from the main model's
        last block output `h_BTD` (h^0) and embedding output `emb_BTD`, each depth on the previous one's h^{k-1}.
        The V3 report's L^k_MTP (eq. 24) is this sum / T; the trainer divides every loss by the same token count."""
        from paraseek.models.loss import chunked_head_loss, mtp_labels, token_cross_entropy

        losses = []
        for module in list(self.mtp)[:self.mtp_depth]:
            h_BTD, hn_BTD = module(h_BTD, emb_BTD, cos_TR, sin_TR, mask=mask)
            target_BT = mtp_labels(labels_BT, module.depth, positions_BT)
            if loss_chunks > 0:
                losses.append(chunked_head_loss(hn_BTD, self.output_weight(), target_BT, loss_chunks))
            else:
                losses.append(token_cross_entropy(self.head(hn_BTD), target_BT))
        return torch.stack(losses)

    def init_rule(self, name: str, std: float = 0.02) -> tuple[str, float]:
        """How the parameter or persistent buffer `name` (its checkpoint name) starts: ("normal", std of the draw),
        ("ones", 1) for the norms' gains or ("zeros", 0) for biases and V3's routing bias. The projections that write
        into the residual stream (attention's o_proj, every down_proj) draw with std / sqrt(2 * n_layers), GPT-2's
        residual scaling (Radford et al. 2019, sec. 2.3), so that deep stacks start stable; the untied head with
        dim^-0.5, so its logits start at unit scale."""
        if name.endswith("norm.weight"):  # every RMSNorm: *_layernorm, norm, MTP's enorm/hnorm/norm
            return "ones", 1.0
        if name.endswith("bias"):  # q/k/v/o biases, mlp.gate.e_score_correction_bias
            return "zeros", 0.0
        if name == "lm_head.weight":
            return "normal", self.args.dim**-0.5
        if name.endswith(("o_proj.weight", "down_proj", "down_proj.weight")):
            return "normal", std / math.sqrt(2 * self.args.n_layers)
        return "normal", std

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, device: torch.device | None = None, seed: int | None = None,
                     select=None) -> None:
        """Initialize every parameter and buffer in place (after `to_empty` from the meta device) by `init_rule`,
        each tensor from its own generator seeded by (seed, its name): a pipeline stage, an FSDP2/TP/EP shard or one
        process all hold the same values of it (models/init.py). seed None: drawn from torch's global generator,
        so that torch.manual_seed(s) before build_model is reproducible. `select(name)`: only those tensors (MTP
        modules created fresh beside loaded weights)."""
        from paraseek.models.init import init_weights

        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        init_weights(self, lambda name: self.init_rule(name, std), seed, device, select)
        self.init_buffers(device)

    @torch.no_grad()
    def init_buffers(self, device: torch.device | None = None) -> None:
        """Recompute the non-persistent buffers (RoPE, the routing counts), which `to_empty` leaves uninitialized."""
        inv_freq, self.rope_attn_factor = rope_inv_freq(self.args)
        self.rope_inv_freq = inv_freq.to(device or self.rope_inv_freq.device)
        for m in self.modules():
            if isinstance(m, MoE):
                m.tokens_per_expert.zero_()


def build_model(args: ModelArgs, device: torch.device | str = "meta", dtype: torch.dtype | None = None) -> Transformer:
    """Build on the meta device (no memory), then, if a real device is given, allocate and initialize there.
    Distributed code stops at meta, parallelizes, and calls `to_empty` + `init_weights` itself."""
    with torch.device("meta"):
        model = Transformer(args)
    if str(device) != "meta":
        if dtype is not None:  # on the meta device: the weights are allocated once, in their dtype
            model.to(dtype)
        model.to_empty(device=device)
        model.init_weights(device=torch.device(device))
        _keep_fp32_buffers(model)
    return model


def _keep_fp32_buffers(model: nn.Module) -> None:
    # The routing bias stays fp32 (as in the hub checkpoints): bf16 would round away its small updates.
    for m in model.modules():
        if isinstance(m, Gate) and m.e_score_correction_bias is not None:
            m.e_score_correction_bias.data = m.e_score_correction_bias.data.float()
