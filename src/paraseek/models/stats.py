"""Exact parameter and FLOP counts from ModelArgs alone (the planner's inputs); tests check them against the
numel of the real modules and of transformers' models."""

from __future__ import annotations

from dataclasses import dataclass

from paraseek.models.args import ModelArgs


@dataclass(frozen=True)
class ParamCounts:
    total: int  # the main model, as transformers counts it (V3's MTP layer excluded; see `mtp`)
    active: int  # per token: MoE layers count the shared experts, the router and the top-K routed experts only
    embedding: int  # the input embedding (the output head is counted as compute)
    mtp: int  # V3's multi-token-prediction modules, embedding/head shared (not in `total`)
    per_layer: tuple[int, ...]  # each block's parameters (all experts)
    per_layer_active: tuple[int, ...]


def _attention_params(a: ModelArgs) -> int:
    D = a.dim
    if a.is_mla:
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        q = D * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * a.n_heads * qk if a.q_lora_rank else D * a.n_heads * qk
        kv = D * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank + a.kv_lora_rank * a.n_heads * (a.qk_nope_head_dim + a.v_head_dim)
        return q + kv + a.n_heads * a.v_head_dim * D
    q_out, kv_out = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    weights = D * q_out + 2 * D * kv_out + q_out * D
    return weights + (q_out + 2 * kv_out if a.qkv_bias else 0) + (D if a.o_bias else 0)


def _layer_params(a: ModelArgs, layer_id: int) -> tuple[int, int]:
    """(all parameters, parameters one token uses) of block `layer_id`."""
    D = a.dim
    common = _attention_params(a) + 2 * D  # attention + its two norms
    if not a.is_moe_layer(layer_id):
        dense = common + 3 * D * a.inter_dim
        return dense, dense
    expert = 3 * D * a.moe_inter_dim
    shared = a.n_shared_experts * expert + a.n_routed_experts * D  # shared experts + router
    return common + shared + a.n_routed_experts * expert, common + shared + a.n_activated_experts * expert


def param_counts(a: ModelArgs) -> ParamCounts:
    D, V = a.dim, a.vocab_size
    layers = [_layer_params(a, i) for i in range(a.n_layers)]
    head = 0 if a.tie_embeddings else V * D
    outer = V * D + D + head  # embedding, final norm, lm_head
    mtp = sum(_layer_params(a, a.n_layers + k)[0] + 3 * D + 2 * D * D for k in range(a.n_mtp_layers))
    return ParamCounts(
        total=outer + sum(p for p, _ in layers),
        active=outer + sum(p for _, p in layers),
        embedding=V * D,
        mtp=mtp,
        per_layer=tuple(p for p, _ in layers),
        per_layer_active=tuple(p for _, p in layers),
    )


def attention_flops_per_token(a: ModelArgs, seq_len: int) -> int:
    """Forward+backward FLOPs of the score and value matmuls per token: 3 x 2 x seq x H x (d_qk + d_v) per layer
    (PaLM appendix B's 12*L*h*seq when d_qk = d_v; MLA with its real 192/128 head dims; no causal halving, as
    the peers count it)."""
    return 6 * a.n_layers * seq_len * a.n_heads * (a.qk_head_dim + a.attn_v_head_dim)


def flops_per_token(a: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token: 6 x (active parameters - input embedding) + attention (PaLM appendix B)."""
    c = param_counts(a)
    return 6 * (c.active - c.embedding) + attention_flops_per_token(a, seq_len)
