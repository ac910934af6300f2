"""Memory per GPU of a training plan, itemized.

Model states follow the engine: AdamW with fp32 master params, fp32 grads and two fp32 moments (16 B/param,
Rajbhandari et al. 2020, ZeRO, sec. 3), sharded by FSDP2 over dp_shard (ZeRO-3) and replicated over dp_replicate.
Activations are counted tensor by tensor for the layers of `models/deepseek.py` (what autograd saves in eager
mode, checked against `saved_tensors_hooks` in the tests), in the form of Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", eq. 2 and sec. 4.2.2 for sequence parallelism): bytes per
token per layer, each term either divided by tp (heads, ffn width, or sequence-sharded under SP) or whole on every
tp rank (the all-gathered inputs of column-parallel projections, MLA's replicated low-rank paths).

Tensor parallelism is the engine's (parallel/tensor.py), always with sequence parallelism (its default; the planner
prices no TP plan without SP): attention, dense MLPs and shared experts are Megatron-sharded, while the router and
the routed experts are replicated on every tp rank, and each tp rank routes and computes only its own T / tp tokens.
So routed-expert params, grads and optimizer states are *not* divided by tp (FSDP2 still shards them over dp_shard,
EP over ep), MoE routing/dispatch activations are per local token, and the router's, the routed experts' and MLA's
replicated down-projections' partial gradients are all-reduced over tp once per step (`reduce_tp_grads`).
With flash/memory-efficient SDPA the paper's 5*a*s/h attention-score term is replaced by the output and its fp32
log-sum-exp (FlexAttention, which document masking runs on CUDA, saves the same). Pipeline schedules keep several
micro-batches in flight (sec. 4.2.3 of the same paper). Packed rows with document masks add a few bytes per token of
each micro-batch in flight (document_mask_bytes); padded rows (--pack false) have the shapes of packed ones, so their
memory is the same and their price is the compute spent on padding.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from paraseek.models.args import ModelArgs
from paraseek.models.lora_spec import LoRASpec, adapter_params
from paraseek.models.stats import attention_flops_per_token, param_counts
from paraseek.parallel.dims import rank_chunks
from paraseek.planner.plan import Cluster, Plan

BF16, FP32 = 2, 4
AC = ("none", "selective", "full")
GiB = 2**30
CUDA_CONTEXT = 1.0 * GiB  # CUDA context, cuBLAS/cuDNN workspaces, NCCL's own allocations
ALLOCATOR_BASE, ALLOCATOR_FRACTION = 0.5 * GiB, 0.02  # caching-allocator rounding and fragmentation
NCCL_BUFFERS_PER_GROUP = 0.125 * GiB  # NCCL channel buffers of one communicator
LOSS_BYTES_PER_LOGIT = 10  # bf16 logits + fp32 copy + fp32 log-softmax (saved) at the cross-entropy
LOGIT_GRAD_BYTES = 6  # early backward: the logits' fp32 grad and its bf16 cast
MOE_IMBALANCE = 1.1  # busiest expert rank's share over the mean (aux-loss-free balancing is good, not perfect)
# AdamW(fused=True) as the HF + FSDP2 baseline and TorchTitan run it; foreach would add 4 B/param (sqrt temp)
OPTIM_TEMP_BYTES = 0
# The compiled loss (train/loop.py: --compile without tp/pp) fuses the fp32 cast, log-softmax and gather: it keeps the
# bf16 logits (and an fp32 log-sum-exp per token) for backward, and its backward writes the bf16 grad directly, while
# the logits are still alive.
COMPILED_LOSS_BYTES_PER_LOGIT = 2
COMPILED_LOGIT_GRAD_BYTES = 4


@functools.cache
def compiled_ac_saves_fp8_expert_outputs() -> bool:
    """Whether full checkpointing of a compiled block keeps the float8 experts' GEMM outputs (--fp8-experts; a
    custom autograd.Function, models/fp8_grouped.py) instead of recomputing them: torch before 2.13 tags a plain
    checkpoint's ops for recompute before the Function's ops are inlined, so the partitioner saves them (pytorch
    #177396; torch 2.13 checkpoints through the selective path, which tags them: tests/unit/test_fp8.py checks this
    rule against the installed torch). Measured on torch 2.11: +3.6 GiB a MoE layer at 64k tokens (BENCHMARKS.md,
    "Float8 routed experts"). 2.12 is not checked and taken as affected. The installed torch is what the run will
    use."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(x) for x in version("torch").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) < (2, 13)


def _norm(d: int) -> int:
    """Eager RMSNorm (deepseek.py): saves the fp32 copy of its input, the fp32 rstd and the normalized bf16 tensor."""
    return FP32 * d + FP32 + BF16 * d


def document_mask_bytes(a: ModelArgs, seq_len: int) -> float:
    """Bytes per token of one micro-batch with document masking (models/deepseek.py: hidden_states and
    document_mask), alive from its forward to the end of its backward: the int64 positions and document ids; RoPE's
    cos and sin per token ([B, T, R/2] each in the compute dtype; without positions they are [T, R/2], shared by the
    batch, which the layer terms count as free) -- whole on every tp rank, as attention reads them after the
    sequence is gathered; and FlexAttention's BlockMask: four [B, T/128, T/128] int32 block tables (kv and q,
    partial and full blocks) plus their [B, T/128] counts, i.e. ~16 * T / 128^2 bytes per token."""
    blocks = -(-seq_len // 128)
    return 8 + 8 + 2 * BF16 * (a.rope_dim // 2) + (4 * 4 * blocks * blocks + 4 * 4 * blocks) / seq_len


def layer_activation_bytes(a: ModelArgs, layer_id: int, ac: str) -> tuple[int, int]:
    """Bytes per token that block `layer_id` keeps for backward: (whole on every tp rank, divided by tp).

    none: what autograd saves in eager mode (Korthikanti eq. 2's method, for RMSNorm/RoPE/SwiGLU/MLA/MoE).
    selective: the block input plus the outputs of matmuls and attention (norms, activations, RoPE recomputed).
    full: the block input only (sequence-sharded under SP); one block is rematerialized at a time in backward.
    Multiplication by RoPE's cos/sin saves only the (shared) cos/sin, so projection outputs feeding RoPE are free.
    """
    D, H = a.dim, a.n_heads
    if ac == "full":
        return 0, BF16 * D
    whole = split = 0
    none = ac == "none"
    # attention sub-block
    if none:
        split += _norm(D)  # sequence-sharded under SP
        whole += BF16 * D  # the all-gathered norm output, input of the (column-parallel) projections
    else:
        split += BF16 * D  # the block input
    if a.is_mla:
        ql, kvl, qk, v = a.q_lora_rank, a.kv_lora_rank, a.qk_head_dim, a.v_head_dim
        kv_b_out = BF16 * H * (a.qk_nope_head_dim + v)  # k_nope and v are views of it; SDPA keeps v
        if none:
            if ql:
                whole += _norm(ql) + BF16 * ql  # q_a_layernorm on the replicated low-rank path, its output
            whole += _norm(kvl) + BF16 * kvl  # kv_a_layernorm and its output (input of kv_b_proj)
            split += 2 * BF16 * H * qk + kv_b_out  # q and k after concatenating the rotated part, v
        else:
            if ql:
                whole += BF16 * ql  # q_a_proj output
            whole += BF16 * (kvl + a.qk_rope_head_dim)  # kv_a_proj output
            split += BF16 * H * qk + kv_b_out + BF16 * D  # q_b/q_proj output, kv_b output, o_proj output
        split += BF16 * H * v + FP32 * H  # attention output (o_proj's input is a view of it) + log-sum-exp
    else:
        q, kv = H * a.head_dim, a.n_kv_heads * a.head_dim
        split += BF16 * (q + 2 * kv) + BF16 * q + FP32 * H  # q, k (rotated), v; attention output; log-sum-exp
        if not none:
            split += BF16 * D  # o_proj output (to recompute the residual stream)
    # MLP / MoE sub-block
    if none:
        split += _norm(D)
        whole += BF16 * D  # gathered norm output
    if not a.is_moe_layer(layer_id):
        F = a.inter_dim
        split += 4 * BF16 * F if none else 2 * BF16 * F + BF16 * D  # gate, up, silu, product | gate, up, down out
        return whole, split
    E, K, Fe, Fs = a.n_routed_experts, a.n_activated_experts, a.moe_inter_dim, a.moe_inter_dim * a.n_shared_experts
    # Under TP + SP the router and the routed experts are replicated and each tp rank routes only its own T / tp
    # tokens: everything below but the shared experts (column-parallel on the gathered tokens) is per local token,
    # i.e. divided by tp like the sequence-sharded terms. (Without SP every tp rank would route all T tokens.)
    if none:
        # fp32 input, scores, top-k index, weights and their sum. The biased/grouped choice only yields indices, so
        # autograd frees what it saved -- except V2's group max, a view of the scores.
        router = FP32 * D + FP32 * E + 8 * K + FP32 * K + FP32
        if a.topk_method == "group_limited_greedy" and a.n_group > 1:
            router += FP32 * a.n_group
        dispatch = 8 * K + BF16 * D * K  # token index per slot, the gathered rows (the all-to-all output under EP)
        combine = 8 * K + FP32 * D * K + FP32 * K  # slot order, fp32 expert outputs in token order, their weights
        split += router + dispatch + combine
        split += 4 * BF16 * Fe * K + 4 * BF16 * Fs  # routed (local tokens, whole Fe) and shared (Fs / tp) SwiGLU
    else:
        # Saved: the router's fp32 logits and the grouped-GEMM outputs (the gather is an index op: recomputed).
        split += FP32 * E + BF16 * D * K
        split += 2 * BF16 * Fe * K + 2 * BF16 * Fs + BF16 * D  # gate/up outputs (routed, shared), shared down out
    return whole, split


def compiled_layer_activation_bytes(a: ModelArgs, layer_id: int, ac: str) -> tuple[int, int]:
    """Bytes per token that block `layer_id` keeps for backward when torch.compile'd (--compile), as
    layer_activation_bytes: (whole on every tp rank, divided by tp).

    What AOTAutograd's min-cut partitioner saves, measured with saved_tensors_hooks on compiled blocks (CPU, torch
    2.13: tiny-dense with head_dim 24, tiny-moe with v_head_dim 24; docs/planner.md): every RMSNorm keeps its bf16
    input and output and its fp32 rstd (not an fp32 copy of the input), SwiGLU keeps gate, up and their product
    (SiLU recomputed), RoPE'd q/k, v, the attention output and its log-sum-exp stay, the projections feeding RoPE and
    the o_proj input (a transposed copy) are recomputed; in MoE layers the combine's fp32 expert outputs are not kept.
    selective: as eager, less the MLP's down-projection output (recomputed). full: as eager (the block input)."""
    if ac == "full":
        return layer_activation_bytes(a, layer_id, ac)
    D, H = a.dim, a.n_heads
    moe = a.is_moe_layer(layer_id)
    if ac == "selective":
        whole, split = layer_activation_bytes(a, layer_id, ac)
        return whole, split - (BF16 * D if not moe else 0)
    norm_in_out = 2 * BF16  # per channel: the bf16 input (or the residual it reads) and the bf16 output
    # block input x and the mid-block residual h (sequence-sharded), each norm's rstd; the norm outputs are gathered
    split = 2 * BF16 * D + 2 * FP32
    whole = 2 * BF16 * D
    if a.is_mla:
        ql, kvl, qk, v, rope = a.q_lora_rank, a.kv_lora_rank, a.qk_head_dim, a.v_head_dim, a.qk_rope_head_dim
        if ql:
            whole += norm_in_out * ql + FP32  # q_a_proj output, q_a_layernorm output, rstd
        whole += BF16 * (kvl + rope) + BF16 * kvl + FP32  # kv_a_proj output, kv_a_layernorm output, rstd
        split += 2 * BF16 * H * qk + BF16 * H * (a.qk_nope_head_dim + v)  # q, k (RoPE'd), kv_b output (v a view)
        split += BF16 * H * v + FP32 * H  # attention output, log-sum-exp
    else:
        q, kv = H * a.head_dim, a.n_kv_heads * a.head_dim
        split += BF16 * (q + 2 * kv) + BF16 * q + FP32 * H  # q, k (RoPE'd), v; attention output; log-sum-exp
    if not moe:
        return whole, split + 3 * BF16 * a.inter_dim  # gate, up, product
    E, K, Fe, Fs = a.n_routed_experts, a.n_activated_experts, a.moe_inter_dim, a.moe_inter_dim * a.n_shared_experts
    split += FP32 * D + FP32 * E + 8 * K + 2 * FP32 * K  # router: fp32 input, scores, top-k index, weights
    split += 2 * 8 * K + BF16 * D * K  # token index and slot order, the gathered rows
    split += 3 * BF16 * Fe * K + 3 * BF16 * Fs  # routed and shared SwiGLU: gate, up, product
    return whole, split


@dataclass(frozen=True, eq=False)
class LayerTerms:
    """Per-layer numbers the planner sums over stages. Parameters split three ways by how TP/EP shard them."""

    moe: bool
    params_split: int  # divided by tp: head-sharded attention projections, dense MLP, shared experts
    params_whole: int  # on every tp rank: norms, router, MLA's q_a/kv_a down-projections, o_proj bias
    params_experts: int  # routed experts: replicated over tp, divided by ep
    router: int  # the router's weight (part of params_whole): run on this tp rank's T / tp tokens only
    partial_whole: int  # whole params whose grads reduce_tp_grads sums over tp: the router, MLA's latent path
    active_split: int  # the same, counting the parameters one token uses
    active_whole: int
    active_experts: int
    attn_flops: int  # score + value matmuls per token, fwd+bwd, model count (no causal halving)
    act: dict  # ac mode -> (whole, split) bytes per token; "MODE+compile": the same, torch.compile'd
    dispatch_bytes: int  # bytes per token of one all-to-all (K routed copies of the hidden state, bf16)


@dataclass(frozen=True, eq=False)  # hashed by identity: model_terms() caches one per (model, seq_len)
class ModelTerms:
    args: ModelArgs
    seq_len: int
    layers: tuple[LayerTerms, ...]
    embedding: int  # V*D, divided by tp (vocab-parallel)
    head: int  # V*D unless tied, divided by tp
    final_norm: int
    total_params: int
    flops_per_token: int  # the MFU numerator (stats.flops_per_token)


def _mla_latent_params(a: ModelArgs) -> int:
    """MLA's q_a_proj, kv_a_proj_with_mqa and their norms: replicated on every tp rank (the latent is shared by all
    heads), each rank's gradient a partial sum over its own heads."""
    if not a.is_mla:
        return 0
    n = a.dim * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
    if a.q_lora_rank:
        n += a.dim * a.q_lora_rank + a.q_lora_rank
    return n


def _router_params(a: ModelArgs, layer_id: int) -> int:
    return a.n_routed_experts * a.dim if a.is_moe_layer(layer_id) else 0  # V3's bias is a buffer, not trained


def _whole_params(a: ModelArgs, layer_id: int) -> int:
    return 2 * a.dim + (a.dim if a.o_bias else 0) + _mla_latent_params(a) + _router_params(a, layer_id)


def _layer_terms(a: ModelArgs, i: int, params: int, active: int, attn: int) -> LayerTerms:
    """LayerTerms of block `i` with `params` (all) and `active` (one token's) parameters, `attn` its attention FLOPs
    per token."""
    moe = a.is_moe_layer(i)
    expert = 3 * a.dim * a.moe_inter_dim
    experts, active_experts = (a.n_routed_experts * expert, a.n_activated_experts * expert) if moe else (0, 0)
    whole, router = _whole_params(a, i), _router_params(a, i)
    return LayerTerms(
        moe=moe,
        params_split=params - experts - whole, params_whole=whole, params_experts=experts,
        router=router, partial_whole=router + _mla_latent_params(a),
        active_split=active - active_experts - whole, active_whole=whole,
        active_experts=active_experts, attn_flops=attn,
        act={**{ac: layer_activation_bytes(a, i, ac) for ac in AC},
             **{ac + "+compile": compiled_layer_activation_bytes(a, i, ac) for ac in AC}},
        dispatch_bytes=BF16 * a.dim * a.n_activated_experts if moe else 0,
    )


@functools.lru_cache(maxsize=64)
def model_terms(a: ModelArgs, seq_len: int) -> ModelTerms:
    """Everything per layer the memory and time models need, computed once per (model, seq_len)."""
    c = param_counts(a)
    attn = attention_flops_per_token(a, seq_len) // a.n_layers
    layers = tuple(_layer_terms(a, i, c.per_layer[i], c.per_layer_active[i], attn) for i in range(a.n_layers))
    head = 0 if a.tie_embeddings else a.vocab_size * a.dim
    return ModelTerms(
        args=a, seq_len=seq_len, layers=layers, embedding=a.vocab_size * a.dim, head=head,
        final_norm=a.dim, total_params=c.total,
        flops_per_token=6 * (c.active - c.embedding) + attention_flops_per_token(a, seq_len),
    )


# ---- multi-token prediction (--mtp-layers D) -----------------------------------------------------------------------
# DeepSeek-V3's MTP module k (models/deepseek.py: MTPModule; V3 report sec. 2.2) runs block n_layers + k - 1 -- a block
# of the same kind as that layer id makes (MoE for V3 and V2-Lite shapes, dense for dense ones) -- between its own
# token-wise parts: enorm and hnorm, eh_proj ([enorm(emb); hnorm(h)]: 2D -> D) and its final norm, then the main
# model's head and one more cross-entropy. The modules live on the last pipeline stage, beside the head they share
# (parallel/pipeline.py), which the stage cut does not price (partition() balances the main layers only, as the
# engine's cut does). Under TP the blocks are sharded as the main ones and the token-wise parts run on this rank's
# positions with replicated weights (parallel/tensor.py).
# The MTP loss is never compiled (models/loss.py: token_cross_entropy in the model's forward): each depth keeps its
# fp32 log-softmax for backward until the step's backward reaches it.
MTP_LOSS_SAVED_BYTES_PER_LOGIT = FP32


@functools.lru_cache(maxsize=64)
def mtp_blocks(t: ModelTerms, depth: int) -> tuple[LayerTerms, ...]:
    """The LayerTerms of the `depth` MTP modules' blocks: block n_layers + k is layer n_layers + k of the same model
    extended by `depth` layers (Block(n_layers + k, args), so param_counts of that model counts it)."""
    a = t.args
    longer = param_counts(a.replace(n_layers=a.n_layers + depth))
    attn = attention_flops_per_token(a, t.seq_len) // a.n_layers
    return tuple(_layer_terms(a, i, longer.per_layer[i], longer.per_layer_active[i], attn)
                 for i in range(a.n_layers, a.n_layers + depth))


def mtp_module_params(a: ModelArgs) -> int:
    """One MTP module's parameters besides its block: eh_proj (2D x D), enorm, hnorm and its final norm."""
    return 2 * a.dim * a.dim + 3 * a.dim


def mtp_module_activation_bytes(a: ModelArgs) -> tuple[int, int]:
    """Bytes per token one MTP module keeps besides its block, (whole on every tp rank, divided by tp), whatever
    the checkpointing (only the block is checkpointed and compiled): enorm and hnorm, the concatenated [emb; h]
    (eh_proj's input), its final norm (on this rank's positions under SP) and that norm's gathered output (the
    head's input)."""
    D = a.dim
    return BF16 * D, 3 * _norm(D) + BF16 * 2 * D


# ---- pipeline stages ---------------------------------------------------------------------------------------------
def layer_cost(t: ModelTerms, i: int) -> float:
    L = t.layers[i]
    cost = 6 * (L.active_split + L.active_whole + L.active_experts) + L.attn_flops
    if i == len(t.layers) - 1:
        cost += 6 * t.args.vocab_size * t.args.dim  # the output head rides on the last chunk
    return cost


@functools.lru_cache(maxsize=256)
def partition(t: ModelTerms, n_chunks: int) -> tuple[tuple[int, int], ...]:
    """Contiguous layer ranges [start, end) for n_chunks model chunks, balancing training FLOPs (the head counts
    on the last chunk, as a cost-balanced split does). Bisection on the max chunk cost with a greedy fill."""
    costs = [layer_cost(t, i) for i in range(len(t.layers))]
    n = len(costs)

    def fill(limit: float) -> list[int] | None:
        cuts, acc = [], 0.0
        for i, c in enumerate(costs):
            if acc and acc + c > limit:
                cuts.append(i)
                acc = 0.0
            acc += c
        return cuts if len(cuts) + 1 <= n_chunks else None

    lo, hi = max(costs), sum(costs)
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fill(mid) is not None else (mid, hi)
    cuts = fill(hi) or []
    # Fewer chunks than asked: split the largest ones (never raises the max).
    bounds = [0, *cuts, n]
    while len(bounds) - 1 < n_chunks:
        k = max(range(len(bounds) - 1),
                key=lambda j: (bounds[j + 1] - bounds[j] > 1, sum(costs[bounds[j]:bounds[j + 1]])))
        bounds.insert(k + 1, (bounds[k] + bounds[k + 1]) // 2)
    return tuple((bounds[j], bounds[j + 1]) for j in range(n_chunks))


def in_flight(plan: Plan, rank: int, m: int) -> float:
    """Micro-batches whose activations pp rank `rank` holds at its peak, in units of its whole share of layers.

    GPipe: all m. 1F1B: pp - rank (Narayanan et al. 2021). Interleaved1F1B: torch's warm-up of
    (v-1)*pp + 2*(pp-1-rank) chunk-micro-batches + 1, i.e. Korthikanti sec. 4.2.3's L/pp * (1 + (pp-1)/(pp*v)) on
    rank 0. ZBVZeroBubble: the same peak as 1F1B (Qi et al. 2024, ZB-V). DualPipeV: PP + 1 stages' worth on the
    PP / 2 ranks of its 2pp stages (deepseek-ai/DualPipe README, "Pipeline Bubbles and Memory Usage Comparison"):
    pp + 1/2 shares of this rank's two stages."""
    pp, v = plan.pp, plan.pp_virtual_stages
    if pp == 1:
        return 1.0
    s = plan.pp_schedule
    if s == "GPipe":
        return float(m)
    if s == "1F1B":
        return float(min(m, pp - rank))
    if s == "Interleaved1F1B":
        return min(m * v, (v - 1) * pp + 2 * (pp - 1 - rank) + 1) / v
    if s == "DualPipeV":
        return min(float(m), pp + 0.5)
    return float(min(m, pp))  # ZBVZeroBubble


@dataclass(frozen=True, eq=False)
class RankShare:
    """What one pp rank holds of the model, per tp rank, summed once per (model, tp, ep, pp, v, schedule, MTP depth)."""

    layers: tuple[int, ...]  # the main layers (the MTP modules' blocks are counted apart: `mtp`)
    first: bool  # holds the embedding
    last: bool  # holds the final norm, head and loss
    mtp: int  # MTP modules trained on this rank (all of them on the last stage's rank, else 0)
    dense: float  # non-expert params on this tp rank (root included)
    experts: float  # routed-expert params on this tp rank (before ep): all of them, they are replicated over tp
    block_max: float  # largest block's local params (FSDP's all-gather unit), experts divided by ep
    tp_partial: float  # params whose grads reduce_tp_grads all-reduces over tp: router, MLA latent, experts / ep
    root: float  # embedding + head + final norm local params (FSDP's root module)
    act: dict  # ac mode (LayerTerms.act's keys) -> bytes per token of saved activations on this tp rank, all its layers
    noac_max: float  # bytes per token of the largest block without checkpointing (rematerialized in backward)
    noac_max_compiled: float  # the same, torch.compile'd
    dispatch_max: float  # bytes per token (of the dp rank's micro-batch) this tp rank sends in one all-to-all
    n_moe: int  # MoE blocks, the MTP modules' included
    linear_flops: float  # training FLOPs per token on this tp rank: dense/replicated linears (+ head_flops)
    head_flops: float  # the output matmul's share of linear_flops (0 off the last rank): bf16 under --fp8
    expert_flops: float  # routed-expert FLOPs per token on this tp rank: whole experts on T / tp tokens (SP)
    attn_flops: float  # causal half of the score/value matmuls per token on this tp rank
    elem_bytes: float  # saved-activation bytes per token without checkpointing (memory-bound traffic proxy)

    @property
    def blocks(self) -> int:
        """Transformer blocks this rank runs: its main layers and its MTP modules' blocks."""
        return len(self.layers) + self.mtp


@functools.lru_cache(maxsize=4096)
def rank_shares(t: ModelTerms, tp: int, ep: int, pp: int, v: int, schedule: str,
                mtp: int = 0) -> tuple[RankShare, ...]:
    """Each pp rank's share. `mtp`: the MTP modules trained (--mtp-layers), held by the rank with the last stage: their
    blocks count as blocks of that rank, their token-wise parts (mtp_module_params) as whole params beside them, and
    their heads as more output matmuls."""
    chunks = partition(t, pp * v)
    a = t.args
    module_w, module_s = mtp_module_activation_bytes(a)
    out = []
    for holds in rank_chunks(pp, v, schedule):
        layers = tuple(i for c in holds for i in range(*chunks[c]))
        first, last = 0 in holds, pp * v - 1 in holds
        n_mtp = mtp if last else 0
        main, extra = [t.layers[i] for i in layers], list(mtp_blocks(t, n_mtp))
        Ls = main + extra
        modules = n_mtp * mtp_module_params(a)  # whole on every tp rank, run on this rank's positions (SP)
        module_act = n_mtp * (module_w + module_s / tp)
        root = (t.embedding / tp if first else 0) + ((t.head / tp + t.final_norm) if last else 0)
        # the output matmul's training FLOPs, tied or not, once for the main loss and once per MTP depth
        head = (1 + n_mtp) * 6 * a.vocab_size * a.dim / tp if last else 0
        act = {ac: sum(L.act[ac][0] + L.act[ac][1] / tp for L in Ls) + module_act for ac in Ls[0].act}
        noac = [L.act["none"][0] + L.act["none"][1] / tp for L in Ls]
        noac_c = [L.act["none+compile"][0] + L.act["none+compile"][1] / tp for L in Ls]
        out.append(RankShare(
            layers=layers, first=first, last=last, mtp=n_mtp,
            dense=sum(L.params_split / tp + L.params_whole for L in Ls) + modules + root,
            # Routed experts are replicated over tp (the engine's TP layout), split over ep only.
            experts=sum(L.params_experts for L in Ls),
            # FSDP2 wraps each MTP module whole (its block and token-wise parts)
            block_max=max([L.params_split / tp + L.params_whole + L.params_experts / ep for L in main]
                          + [L.params_split / tp + L.params_whole + L.params_experts / ep + mtp_module_params(a)
                             for L in extra]),
            tp_partial=sum(L.partial_whole + L.params_experts / ep for L in Ls) if tp > 1 else 0.0,
            root=root, act=act, noac_max=max(noac), noac_max_compiled=max(noac_c),
            # Each tp rank dispatches its own T / tp tokens (SP).
            dispatch_max=max(L.dispatch_bytes for L in Ls) / tp, n_moe=sum(L.moe for L in Ls),
            # MLA's replicated down-projections run on all T gathered tokens on every tp rank (duplicated work); the
            # router and the MTP modules' token-wise parts only on this rank's T / tp tokens.
            linear_flops=6 * sum((L.active_split + L.router) / tp + L.active_whole - L.router for L in Ls)
            + 6 * modules / tp + head,
            head_flops=head,
            # Whole experts on T / tp tokens (SP): 1/tp of the expert work per rank. Without SP every tp rank would
            # run them on all T tokens (x tp); the planner's tp plans are SP plans, as the engine's default.
            expert_flops=6 * sum(L.active_experts for L in Ls) / tp,
            attn_flops=sum(L.attn_flops for L in Ls) / tp / 2,
            elem_bytes=sum(noac) + module_act,
        ))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def hot_ranks(shares: tuple[RankShare, ...]) -> tuple[int, ...]:
    """The pp ranks that can hold the memory or time peak: the first two (most micro-batches in flight), the one
    with the head, the one with the most layers, the most params and the most FLOPs. Checking only these keeps the
    search fast at pp = 64 without missing the max."""
    n = len(shares)
    idx = {0, min(1, n - 1), next(r for r, s in enumerate(shares) if s.last)}
    idx.add(max(range(n), key=lambda r: shares[r].act["none"]))
    idx.add(max(range(n), key=lambda r: shares[r].dense + shares[r].experts))
    idx.add(max(range(n), key=lambda r: shares[r].linear_flops + shares[r].expert_flops + shares[r].attn_flops))
    return tuple(sorted(idx))


# ---- model states --------------------------------------------------------------------------------------------------
def _state_elems(share: RankShare, plan: Plan) -> float:
    """Params this rank owns after FSDP: dense over dp_shard; experts (all of them on every tp rank) over ep, then
    over dp_shard/ep."""
    return share.dense / plan.dp_shard + share.experts / plan.dp_shard


def model_state_bytes(args: ModelArgs, plan: Plan, stage: int | None = None, seq_len: int | None = None) -> dict:
    """Bytes of fp32 params, fp32 grads and AdamW moments one rank owns (sharded, wherever they live), for pp rank
    `stage` (default: the largest). Closed form: 4/4/8 B x (params on this tp/pp rank) / dp_shard, where routed
    experts are whole on every tp rank (replicated over tp) and divided by ep first (ep*(dp_shard/ep) = dp_shard);
    DDP is dp_shard = 1. FSDP2's dim-0 chunking makes ranks differ by at most one row per parameter; this is the
    mean. `seq_len` only moves pipeline-stage boundaries (they balance FLOPs, attention's included)."""
    t = model_terms(args, seq_len or args.max_seq_len)
    shares = rank_shares(t, plan.tp, plan.ep, plan.pp, plan.pp_virtual_stages, plan.pp_schedule, plan.mtp_layers)
    elems = [_state_elems(s, plan) for s in shares]
    n = elems[stage] if stage is not None else max(elems)
    out = {"params": FP32 * n, "grads": FP32 * n, "optimizer": 2 * FP32 * n}
    out["total"] = sum(out.values())
    out["device"] = "cpu" if plan.cpu_offload else "cuda"
    return out


def lora_state_bytes(args: ModelArgs, plan: Plan, spec: LoRASpec, base_bytes: int = BF16, stage: int | None = None,
                     seq_len: int | None = None) -> dict:
    """LoRA's model states per rank, the term that replaces model_state_bytes in a LoRA run (models/lora.py): the
    frozen base stored in the compute dtype (`base_bytes` per parameter) with no gradients and no optimizer states,
    and the adapters as every trained parameter (fp32 params, grads and two AdamW moments: 16 B/param). Both are
    sharded as model_state_bytes shards (FSDP2 over dp_shard; routed experts, and their adapters, over ep and then
    dp_shard / ep). LoRA runs without tp, so nothing is divided by it."""
    t = model_terms(args, seq_len or args.max_seq_len)
    shares = rank_shares(t, plan.tp, plan.ep, plan.pp, plan.pp_virtual_stages, plan.pp_schedule, plan.mtp_layers)
    r = stage if stage is not None else max(range(len(shares)), key=lambda i: _state_elems(shares[i], plan))
    out = _lora_states(args, shares[r], plan, spec, base_bytes)
    out["total"] = sum(out.values())
    out["device"] = "cpu" if plan.cpu_offload else "cuda"
    return out


def _lora_states(args: ModelArgs, share: RankShare, plan: Plan, spec: LoRASpec, base_bytes: int = BF16) -> dict:
    """lora_state_bytes of one pp rank's share: the frozen base's bytes and the adapters' params, grads, moments."""
    adapters = adapter_params(args, spec, share.layers) / plan.dp_shard
    return {"base_params": base_bytes * _state_elems(share, plan), "params": FP32 * adapters,
            "grads": FP32 * adapters, "optimizer": 2 * FP32 * adapters}


# ---- the whole breakdown -------------------------------------------------------------------------------------------
@dataclass
class Memory:
    items: dict  # name -> bytes on the worst GPU
    total: float  # bytes at the peak on the worst GPU
    host_per_node: float  # bytes of host memory the node's ranks need (CPU offload), 0 otherwise
    worst_rank: int  # pp rank with the peak
    phase: str = "loss"  # when the peak happens: loss, backward (its start), end_of_backward, tp_grad_reduce,
    # optimizer_step


def compiled_loss(plan: Plan) -> bool:
    """The engine compiles the loss with --compile, except under tp (loss_parallel) and pp (the schedule's loss)."""
    return plan.compile and plan.tp == 1 and plan.pp == 1


def n_groups(plan: Plan) -> int:
    """Communicators of size > 1 that a rank belongs to (each keeps NCCL buffers)."""
    sizes = [plan.tp, plan.dp_shard, plan.dp_replicate, plan.pp]
    if plan.ep > 1:
        sizes += [plan.ep, plan.dp_shard // plan.ep]
    return sum(1 for s in sizes if s > 1)


def memory(t: ModelTerms, c: Cluster, plan: Plan, global_batch_size: int) -> Memory:
    """Peak bytes per GPU of `plan` (the worst pp rank), itemized. Plain floats in the loop: the search calls
    this ~10^5 times for 2,048 GPUs."""
    a, tp, ac = t.args, plan.tp, plan.activation_checkpointing
    shares = rank_shares(t, tp, plan.ep, plan.pp, plan.pp_virtual_stages, plan.pp_schedule, plan.mtp_layers)
    m = plan.n_microbatches(global_batch_size)
    tokens = plan.micro_batch_size * t.seq_len  # per micro-batch per dp rank
    fsdp = not plan.ddp
    on_gpu = 0.0 if plan.cpu_offload else 1.0
    # send/recv of activations and their grads; with MTP every stage passes [h; embedding] on (two tensors' worth)
    p2p = 4 * tokens * BF16 * a.dim / tp * (2 if plan.mtp_layers else 1) if plan.pp > 1 else 0.0
    comm = NCCL_BUFFERS_PER_GROUP * n_groups(plan) + p2p
    dispatch_factor = 2 * tokens * MOE_IMBALANCE if plan.ep > 1 else 0.0
    loss_bytes, grad_bytes = ((COMPILED_LOSS_BYTES_PER_LOGIT, COMPILED_LOGIT_GRAD_BYTES) if compiled_loss(plan)
                              else (LOSS_BYTES_PER_LOGIT, LOGIT_GRAD_BYTES))
    worst = None
    for r in hot_ranks(shares):
        s = shares[r]
        local = s.dense + s.experts / plan.ep  # params on this rank before FSDP sharding
        owned = _state_elems(s, plan)
        params, grads, optim = FP32 * owned * on_gpu, FP32 * owned * on_gpu, 2 * FP32 * owned * on_gpu
        trained = owned  # what gradients, AdamW and the optimizer step's temporaries are kept for
        if plan.lora is not None:  # lora_state_bytes: the base in the compute dtype, 16 B/param for the adapters
            states = _lora_states(a, s, plan, plan.lora)
            trained = states["params"] / FP32
            params = (states["base_params"] + states["params"]) * on_gpu
            grads, optim = states["grads"] * on_gpu, states["optimizer"] * on_gpu
        # Gathered bf16 compute copies and unsharded grads awaiting reduction.
        if not fsdp:  # DDP + autocast: bf16 casts of every weight live from forward to backward; gradient buckets
            bf16, unreduced = BF16 * local, FP32 * local  # are copies (gradient_as_bucket_view=False, the default)
            head_grads = unreduced
        elif plan.pp > 1:  # pipelining keeps params gathered and grads unsynced until the last micro-batch
            bf16, unreduced = BF16 * local, FP32 * local
            head_grads = unreduced
        else:
            # The block in use + the prefetched one (or every block when not resharded after forward), plus
            # FSDP2's root (embedding, head), which is not resharded after forward.
            bf16 = BF16 * (local - s.root if plan.keeps_params_gathered else 2 * s.block_max) + BF16 * s.root
            # bf16 grads of the block being reduced + their fp32 reduce-scatter input; the root's (embedding, head)
            # bf16 grads wait for the end of backward
            unreduced = (BF16 + FP32) * s.block_max + BF16 * s.root
            head_grads = BF16 * s.root  # while the head's backward runs, no block's grads are being reduced yet
        if plan.lora is not None:  # only the adapters have gradients (at most all of this rank's, unsharded)
            unreduced = head_grads = (BF16 + FP32) * trained * plan.dp_shard
        # Activations: micro-batches in flight x this rank's layers; backward rematerializes one block whole
        # (full) or its elementwise part (selective).
        acts = in_flight(plan, r, m) * tokens * s.act[ac + ("+compile" if plan.compile else "")]
        recompute = tokens * (s.noac_max_compiled if plan.compile else s.noac_max) if ac != "none" else 0.0
        if plan.document_mask:
            acts += in_flight(plan, r, m) * tokens * document_mask_bytes(a, t.seq_len)
        if plan.fp8_experts and ac == "full" and plan.compile and compiled_ac_saves_fp8_expert_outputs():
            # each routed row's gate, up (Fe wide) and down (D wide) GEMM outputs in bf16, in every MoE layer
            rows = tokens / tp * a.n_activated_experts
            acts += in_flight(plan, r, m) * s.n_moe * rows * BF16 * (2 * a.moe_inter_dim + a.dim)
        logits = 0.0
        if s.last:
            acts += tokens * (_norm(a.dim) / tp + BF16 * a.dim)  # final norm, gathered head input
            logits = tokens * a.vocab_size / tp  # vocab-parallel loss
        # The logits' bytes at the loss and in the head's backward. MTP: each depth's eager cross-entropy runs inside
        # the forward beside the main logits (bf16) and keeps its fp32 log-softmax until backward reaches it.
        at_loss, at_head = loss_bytes * logits, grad_bytes * logits
        if s.mtp:
            mtp_saved = s.mtp * MTP_LOSS_SAVED_BYTES_PER_LOGIT * logits
            at_loss = max(at_loss, (BF16 + LOSS_BYTES_PER_LOGIT - MTP_LOSS_SAVED_BYTES_PER_LOGIT) * logits) + mtp_saved
            at_head += mtp_saved
        dispatch = dispatch_factor * s.dispatch_max  # all-to-all send + receive buffers of one MoE layer
        # reduce_tp_grads concatenates this rank's (dp-sharded) fp32 grads of the tp-replicated params into one flat
        # buffer for its all-reduce, after backward (every block resharded by then).
        tp_flat = FP32 * s.tp_partial / plan.dp_shard * on_gpu
        # Six moments can hold the peak. Grads exist before the last micro-batch's backward only when accumulating
        # (m > 1): zero_grad(set_to_none=True) frees them every step.
        # Pipelining accumulates unsharded grads instead (FSDP2 syncs only in the last micro-batch's backward).
        pipelined = fsdp and plan.pp > 1
        acc = grads if m > 1 and not pipelined else 0.0
        base = params + optim + comm
        moments = {
            # the loss: every activation in flight, logits in bf16 + fp32 + fp32 log-softmax
            # (pipelined: from the first backward on, the unsharded grads accumulate beside the activations)
            "loss": base + (unreduced if pipelined else acc) + bf16 + acts + at_loss + dispatch,
            # the head's backward: the logits' grads beside every activation (the blocks' grads not yet made)
            "head_backward": base + acc + bf16 + acts + head_grads + at_head + dispatch,
            # early backward: a block rematerialized and its grads being reduced; the logits' grads are freed once
            # the head's backward has made its input's grad (measured: counting both together over-predicted the
            # no-checkpointing 1-GPU runs of benchmarks/2026-12-02/compiled-oos-1gpu-c-measured.json by 3-5 GiB,
            # about the smaller of the two)
            "backward": base + acc + bf16 + acts + recompute + unreduced + dispatch,
            # pipelined: each block's unsharded grads are freed as its sharded ones are written
            "end_of_backward": base + bf16 + (max(grads, unreduced) if pipelined else grads + unreduced),
            "tp_grad_reduce": base + grads + tp_flat,
            "optimizer_step": base + grads + OPTIM_TEMP_BYTES * trained * on_gpu,
        }
        phase = max(moments, key=moments.__getitem__)
        if worst is None or moments[phase] > worst[0]:
            worst = (moments[phase], r, phase, (params, grads, acc, optim, bf16, unreduced, acts, recompute,
                                                 (at_loss, at_head), dispatch, comm, trained, tp_flat,
                                                 head_grads))
    peak, r, phase, (params, grads, acc, optim, bf16, unreduced, acts, recompute, (at_loss, at_head), dispatch,
                     comm, trained, tp_flat, head_grads) = worst
    during = phase in ("loss", "head_backward", "backward")  # activations alive
    items = {
        "parameters": params, "gradients": acc if during else grads, "optimizer_states": optim,
        "bf16_params": bf16 if phase not in ("tp_grad_reduce", "optimizer_step") else 0.0,
        "unreduced_grads": unreduced if phase in ("backward", "end_of_backward") or (phase == "loss" and pipelined)
        else head_grads if phase == "head_backward" else 0.0,
        "activations": acts if during else 0.0, "recompute": recompute if phase == "backward" else 0.0,
        "logits_loss": at_loss if phase == "loss" else at_head if phase == "head_backward" else 0.0,
        "moe_dispatch": dispatch if during else 0.0, "comm_buffers": comm,
        "tp_grad_buffer": tp_flat if phase == "tp_grad_reduce" else 0.0,
        "optimizer_step_temp": OPTIM_TEMP_BYTES * trained * on_gpu if phase == "optimizer_step" else 0.0,
        "cuda_context": CUDA_CONTEXT, "allocator_overhead": ALLOCATOR_BASE + ALLOCATOR_FRACTION * peak,
    }
    host = 0.0
    if plan.cpu_offload:  # every rank's 16 B/param shard, foreach AdamW's 4 B/param temporary on the CPU
        host = c.gpus_per_node * (5 * FP32 * max(_state_elems(x, plan) for x in shares))
    return Memory(items, sum(items.values()), host, r, phase)
