"""The inference model: DeepSeek-family layers built for decode from ModelArgs and a model's weights.

The training model (models/deepseek.py) is single-device math shaped for autograd; this one is shaped for a step of
flattened tokens over the paged cache, on one tp rank. Each layer reads what it keeps by name from a `Share`
(infer/weights.py): this rank's slices of a training model's tensors or of an HF folder's safetensors, the latter
read slice by slice without building the whole model; the layout rules below are written once, here, for both.
Projections are `Linear`s in the model's dtype or `Fp8Linear`s (DeepSeek-V3's FP8 128 x 128 blocks, infer/fp8.py),
the experts bf16 or FP8 stacks. Its weights are laid out once, at build time, for how decode reads them:
  - dense attention: q|k|v fused into one projection ([(H + 2G) x D, E]), so a step reads the block input once;
  - MLA (DeepSeek-V2 paper, sec. 2.1 and appendix C): the projections of the block input (q or q_a, and kv_a)
    fused; kv_b read as its two halves W_UK [H, nope, C] (absorbed into the query) and W_UV [H, C, V] (applied to
    the attended latent), views of the one weight, so decode attends over the cached latent itself;
  - dense MLPs: gate|up fused ([2F, E]);
  - MoE: the router weight cached in fp32 (the router scores in fp32, as the training Gate does, without casting
    the weight every step); routed experts as w13 [E', 2F, D] (gate rows then up rows) and w2 [E', D, F], with
    the shared experts appended as n_shared more experts of width F (DeepSeekMoE's shared MLP of width
    n_shared x F is exactly n_shared experts of width F summed with weight 1), so one fused-MoE launch computes
    routed and shared experts together.
Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) is applied while building: attention split by heads
(column-parallel q/k/v, row-parallel o_proj), MLPs and experts by their hidden width, one all-reduce after each
of the two halves of a block; the head split by vocabulary (its logits all-gathered); MLA's latent projection,
the norms and the router stay whole, so every rank holds the whole latent cache. GQA with fewer kv heads than ranks
replicates each kv head over tp / n_kv_heads ranks.
Expert parallelism (infer/ep.py, `ep`): the routed experts split by expert index instead, each rank computing its
experts' slots of every token; the shared experts then form one SwiGLU MLP of their own (width n_shared x F, cut
by tp like a dense MLP, whole at tp 1), since the stack holds whole-width routed experts. With `dp_attention` each
rank's forward holds its own requests' tokens only, and the MoE layers gather every rank's tokens, compute this
rank's experts' slots of all of them and hand each rank back its rows' sums (infer/ep.py says why and how).

Built with mtp=True, the model also holds DeepSeek-V3's first multi-token-prediction module (MTPLayer, same layer
classes, a cache layer of its own after the model's), which speculative decoding drafts with (infer/spec.py): its
forward (forward_mtp) takes the hidden states that `trunk` returns.

MoE layers choose their path per step by the number of token-expert slots: the fused kernels of infer/moe.py (no
sort, weights read once per expert tile) up to `FUSED_MAX_SLOTS`, torch._grouped_mm over tokens sorted by expert
beyond (prefill, large batches); off CUDA the plain-torch forms of either. The two round differently in bf16 (the
grouped form rounds gate and up before SwiGLU, the fused one rounds their product once), so a bf16 batch that
crosses the threshold may pick other near-tied tokens; in fp32 they agree (tests/gpu/test_infer_gpu.py). FP8
experts always take the fused FP8 kernels (moe.fused_moe_fp8): torch._grouped_mm has no block-scaled form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paraseek.infer import moe, ops
from paraseek.infer.attention import prefill_attention
from paraseek.infer.ep import gather_rows, local_slots, pad_rows, scatter_sums
from paraseek.infer.weights import Part, Share
from paraseek.models.args import ModelArgs
from paraseek.models.deepseek import MLA, Attention, Transformer, _use_grouped_mm, grouped_mm, rope_inv_freq

# Token-expert slots (tokens x (K + n_shared)) up to which a MoE layer runs the fused kernels; beyond, the sorted
# grouped GEMMs. "fused" / "grouped" force one path (tests); None: by the slot count, fused only with the kernels on.
FUSED_MAX_SLOTS = 4096
MOE_PATH: str | None = None


def moe_path(slots: int, kernels: bool, grouped_gemm: bool) -> str:
    """"fused" or "grouped" for a MoE step of `slots` token-expert slots: the fused kernels up to FUSED_MAX_SLOTS, and
    beyond where no fast grouped GEMM exists (off Hopper the grouped form is a per-expert loop, which also needs the
    counts on the host); the plain-torch grouped form without the kernels."""
    if MOE_PATH:
        return MOE_PATH
    return "fused" if kernels and (slots <= FUSED_MAX_SLOTS or not grouped_gemm) else "grouped"


@dataclass
class Norm:
    w: torch.Tensor
    eps: float


class DenseAttention:
    """Multi-head attention with GQA and optional q/k/v/o bias over the paged K/V cache."""

    def __init__(self, s: Share, p: str, a: ModelArgs):
        D = self.D = a.head_dim
        tp, rank = s.tp, s.rank
        self.H = a.n_heads // tp
        if a.n_kv_heads % tp == 0:
            kv = lambda name: s.part(name, 0, D)  # noqa: E731
            self.G = a.n_kv_heads // tp
        else:  # fewer kv heads than ranks: rank r keeps kv head r * n_kv // tp
            h = rank * a.n_kv_heads // tp
            kv = lambda name: Part(name, 0, h * D, D)  # noqa: E731
            self.G = 1
        at = f"{p}.self_attn"
        self.qkv = s.linear([s.part(f"{at}.q_proj.weight", 0, D), kv(f"{at}.k_proj.weight"), kv(f"{at}.v_proj.weight")],
                            [s.part(f"{at}.q_proj.bias", 0, D), kv(f"{at}.k_proj.bias"), kv(f"{at}.v_proj.bias")]
                            if a.qkv_bias else None)
        o_bias = None
        if a.o_bias:  # added once: by rank 0
            o_bias = s.tensor(s.whole(f"{at}.o_proj.bias"))
            o_bias = o_bias if rank == 0 else torch.zeros_like(o_bias)
        self.o = s.linear([s.part(f"{at}.o_proj.weight", 1, D)], o_bias)
        with torch.device("meta"):
            self.scale = Attention(a).softmax_scale

    def forward(self, h_NE: torch.Tensor, b, cache, i: int, rope) -> torch.Tensor:
        N, H, G, D = h_NE.shape[0], self.H, self.G, self.D
        qkv = self.qkv(h_NE)
        q_NHD = qkv[:, :H * D].view(N, H, D)
        # One launch rotates q and k in the fused output and writes k and v into the cache.
        ops.rope_write_kv_(qkv, H, G, rope.cos_PR, rope.sin_PR, b.positions, b.slots, cache.kv[i], cache.kv_scale[i])
        k_SGD, v_SGD, scales = cache.k[i], cache.v[i], (cache.k_scale[i], cache.v_scale[i])  # scales: fp8 only
        nd = b.n_decode
        if nd == N:  # decode-only (every CUDA-graph step): the kernel's output is the attention output
            o_NHD = ops.paged_decode_gqa(q_NHD, k_SGD, v_SGD, b.block_tables, b.context_lens, cache.block_size,
                                         self.scale, *scales)
            return self.o(o_NHD.view(N, H * D))
        o_NHD = q_NHD.new_empty((N, H, D))
        if nd:
            o_NHD[:nd] = ops.paged_decode_gqa(q_NHD[:nd], k_SGD, v_SGD, b.block_tables, b.context_lens,
                                              cache.block_size, self.scale, *scales)
        k_KGD, v_KGD = cache.context_kv(i, b.k_slots)
        o_NHD[nd:] = prefill_attention(q_NHD[nd:], k_KGD, v_KGD, b.cu_q, b.cu_k,
                                       max(q for q, _ in b.lens), max(k for _, k in b.lens), b.lens, self.scale)
        return self.o(o_NHD.view(N, H * D))

    def decode_bytes(self) -> int:
        return self.qkv.nbytes() + self.o.nbytes()


class LatentAttention:
    """Multi-head latent attention over the latent cache [S, C + R] (the normalized latent, then the roped shared
    key): absorbed for decodes, expanded through kv_b for prefill chunks."""

    # The latent's and q_lora's RMSNorms use RMSNorm's default eps, not rms_norm_eps (models/deepseek.py's MLA, as
    # the hub's modeling_deepseek.py builds them).
    LATENT_NORM_EPS = 1e-6

    def __init__(self, s: Share, p: str, a: ModelArgs):
        self.C, self.R, self.nope, self.V = a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim, a.v_head_dim
        self.H = a.n_heads // s.tp
        self.q_lora = a.q_lora_rank
        qk = self.nope + self.R
        at = f"{p}.self_attn"
        first = s.whole(f"{at}.q_a_proj.weight") if self.q_lora else s.part(f"{at}.q_proj.weight", 0, qk)
        self.in_proj = s.linear([first, s.whole(f"{at}.kv_a_proj_with_mqa.weight")])
        if self.q_lora:
            self.q_a_norm = Norm(s.tensor(s.whole(f"{at}.q_a_layernorm.weight")), self.LATENT_NORM_EPS)
            self.q_b = s.linear([s.part(f"{at}.q_b_proj.weight", 0, qk)])
        self.kv_norm = Norm(s.tensor(s.whole(f"{at}.kv_a_layernorm.weight")), self.LATENT_NORM_EPS)
        # kv_b in the model's dtype, also from an FP8 checkpoint: decode reads it as per-head W_UK / W_UV batches
        # (torch.bmm), prefill through F.linear. Dequantizing is exact -- W_e4m3 * scale_inv blockwise is the
        # weight the checkpoint means, as DeepSeek-V3's inference/model.py also dequantizes wkv_b for its absorbed
        # MLA -- rounded once to the model's dtype; it costs 2x kv_b's FP8 bytes (32 MiB a layer on V3, 1.5% of
        # an FP8 layer's weights).
        self.kv_b_w = s.tensor(s.part(f"{at}.kv_b_proj.weight", 0, self.nope + self.V))
        # Views of kv_b (one copy in memory; cuBLAS reads the strided and transposed batches as they are):
        w_HXC = self.kv_b_w.view(self.H, self.nope + self.V, self.C)
        self.w_uk_HDC = w_HXC[:, :self.nope]  # q_nope -> latent space (absorbed into the query)
        self.w_uv_HCV = w_HXC[:, self.nope:].transpose(1, 2)  # attended latent -> each head's value
        self.o = s.linear([s.part(f"{at}.o_proj.weight", 1, self.V)])
        with torch.device("meta"):
            mla = MLA(a)
        self.scale, self.interleave = mla.softmax_scale, mla.interleave
        self.kv_b_lora = None  # infer/lora.LatentLoRA: kv_b's adapters, in each form kv_b is read

    def forward(self, h_NE: torch.Tensor, b, cache, i: int, rope) -> torch.Tensor:
        N, C, R, nope, Dv, H = h_NE.shape[0], self.C, self.R, self.nope, self.V, self.H
        y = self.in_proj(h_NE)
        if self.q_lora:
            q_a, kv_a = y.split([self.q_lora, C + R], dim=-1)
            q = self.q_b(ops.rms_norm(q_a, self.q_a_norm.w, self.q_a_norm.eps))
        else:
            q, kv_a = y.split([y.shape[-1] - C - R, C + R], dim=-1)
        q_NHX = q.view(N, H, nope + R)
        q_pe_NHR = q_NHX[..., nope:]
        c_SX = cache.k[i]
        # RMSNorm of the latent, RoPE of the shared key and of the queries' rope part, the token's cache row.
        ops.mla_prepare_(q_pe_NHR, kv_a, self.kv_norm.w, self.kv_norm.eps, rope.cos_PR, rope.sin_PR, b.positions,
                         b.slots, c_SX, self.interleave, cache.k_scale[i])
        o_NHV = h_NE.new_empty((N, H, Dv))
        nd = b.n_decode
        if nd:
            # Absorbed (DeepSeek-V2 appendix C): W_UK folded into the query, W_UV applied after attention, so the
            # keys and values are the cached latent itself: [H, nd, nope] @ [H, nope, C] -> [H, nd, C].
            q_lat_HnC = torch.bmm(q_NHX[:nd, :, :nope].transpose(0, 1), self.w_uk_HDC)
            if self.kv_b_lora is not None:
                self.kv_b_lora.absorb_q_(q_lat_HnC, q_NHX[:nd, :, :nope])
            o_lat_nHC = ops.paged_decode_mla(q_lat_HnC.transpose(0, 1), q_pe_NHR[:nd], c_SX, b.block_tables,
                                             b.context_lens, cache.block_size, self.scale, cache.k_scale[i])
            o_NHV[:nd] = torch.bmm(o_lat_nHC.transpose(0, 1), self.w_uv_HCV).transpose(0, 1)
            if self.kv_b_lora is not None:
                self.kv_b_lora.value_(o_NHV, o_lat_nHC)
        if nd < N:
            # Expanded (the training model's form): the context's latents through kv_b to per-head keys and values.
            ctx_KX = cache.context_latent(i, b.k_slots)
            kv_KO = F.linear(ctx_KX[:, :C], self.kv_b_w)
            if self.kv_b_lora is not None:
                kv_KO = self.kv_b_lora.expand_(kv_KO, ctx_KX[:, :C])
            kv_KHX = kv_KO.view(-1, H, nope + Dv)
            K = kv_KHX.shape[0]
            k_KHD = torch.cat([kv_KHX[..., :nope], ctx_KX[:, None, C:].expand(K, H, R)], dim=-1)
            o_NHV[nd:] = prefill_attention(q_NHX[nd:], k_KHD, kv_KHX[..., nope:], b.cu_q, b.cu_k,
                                           max(q for q, _ in b.lens), max(k for _, k in b.lens), b.lens, self.scale)
        return self.o(o_NHV.reshape(N, H * Dv))

    def decode_bytes(self) -> int:
        # Decode reads kv_b as W_UK and W_UV (views of it), each element once.
        ts = [self.kv_norm.w, self.kv_b_w] + ([self.q_a_norm.w] if self.q_lora else [])
        projs = [self.in_proj, self.o] + ([self.q_b] if self.q_lora else [])
        lora = self.kv_b_lora.nbytes_lora() if self.kv_b_lora is not None else 0
        return sum(t.numel() * t.element_size() for t in ts) + sum(p.nbytes() for p in projs) + lora


class DenseMLP:
    """SwiGLU with gate|up fused: down(silu(gate(x)) * up(x))."""

    def __init__(self, s: Share, p: str, mlp: str = "mlp"):
        self.gate_up = s.linear([s.part(f"{p}.{mlp}.gate_proj.weight"), s.part(f"{p}.{mlp}.up_proj.weight")])
        self.down = s.linear([s.part(f"{p}.{mlp}.down_proj.weight", 1)])

    def forward(self, h_NE: torch.Tensor) -> torch.Tensor:
        return self.down(ops.silu_mul(self.gate_up(h_NE)))


class MoELayer:
    """DeepSeekMoE for inference: routing in fp32 from a cached fp32 router weight, then routed and shared experts
    together, either fused (few slots) or as sorted grouped GEMMs (many). Under expert parallelism this rank's
    routed experts whole (E_local of them, from expert_first on) and the shared experts as their own MLP."""

    def __init__(self, s: Share, p: str, a: ModelArgs):
        self.a = a
        self.E, self.K = a.n_routed_experts, a.n_activated_experts
        self.router_w32 = s.tensor(s.whole(f"{p}.mlp.gate.weight"), torch.float32)
        self.bias_E = (s.tensor(s.whole(f"{p}.mlp.gate.e_score_correction_bias"), torch.float32)
                       if a.topk_method == "noaux_tc" else None)
        ex, F_ = f"{p}.mlp.experts", a.moe_inter_dim
        self.shared: DenseMLP | None = None  # the shared experts under ep (see the module docstring)
        self.ep_group = s.ep_group
        self.dp_attention = False  # each rank's own tokens in, gathered here (InferenceModel.build sets it)
        if s.ep > 1:  # this rank's experts, whole; every other tensor of them is never read
            self.E_local = self.E // s.ep
            self.expert_first = s.ep_rank * self.E_local
            mine = range(self.expert_first, self.expert_first + self.E_local)
            w13 = [[s.whole(f"{ex}.{e}.gate_proj.weight"), s.whole(f"{ex}.{e}.up_proj.weight")] for e in mine]
            w2 = [s.whole(f"{ex}.{e}.down_proj.weight") for e in mine]
            if a.n_shared_experts:
                self.shared = DenseMLP(s, p, "mlp.shared_experts")
            self.n_shared = 0  # shared experts in the stack
            self.w13_EXD, self.w13_scale, self.w2_EDF, self.w2_scale = s.experts(w13, w2)
            return
        self.E_local, self.expert_first = self.E, None
        w13 = [[s.part(f"{ex}.{e}.gate_proj.weight"), s.part(f"{ex}.{e}.up_proj.weight")] for e in range(self.E)]
        w2 = [s.part(f"{ex}.{e}.down_proj.weight", 1) for e in range(self.E)]
        self.n_shared = ns = a.n_shared_experts
        # Shared chunk j (the shared MLP's width is n_shared x F): gate/up rows j*F:(j+1)*F and down columns
        # j*F:(j+1)*F, each cut by tp like an expert.
        sh = f"{p}.mlp.shared_experts"
        w13 += [[s.part(f"{sh}.{proj}.weight", within=(j * F_, F_)) for proj in ("gate_proj", "up_proj")]
                for j in range(ns)]
        w2 += [s.part(f"{sh}.down_proj.weight", 1, within=(j * F_, F_)) for j in range(ns)]
        # [E', 2F, D] (gate rows, then up rows) and [E', D, F]; FP8: e4m3 with their block scales, else None.
        self.w13_EXD, self.w13_scale, self.w2_EDF, self.w2_scale = s.experts(w13, w2)

    def route(self, h_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.a
        logits_NE = F.linear(h_ND.float(), self.router_w32)
        return moe.route(logits_NE, self.bias_E, score_func=a.score_func, topk_method=a.topk_method,
                         n_group=a.n_group, topk_group=a.topk_group, top_k=self.K, norm_topk_prob=a.norm_topk_prob,
                         scaling=a.routed_scaling_factor)

    def forward(self, h_ND: torch.Tensor, rows: int = 0) -> torch.Tensor:
        """`rows`: under dp-attention the step's agreed rows per rank (0: this step's own, a CUDA graph's bucket)."""
        if self.dp_attention:
            return self._forward_gathered(h_ND, rows)
        w_NK, idx_NK = self.route(h_ND)
        if self.expert_first is None:
            return self._experts(h_ND, w_NK, idx_NK)
        # Expert parallel: this rank's slots (ep.local_slots), the ranks' sums added by one all-reduce -- here at
        # tp 1, then the replicated shared experts once; at tp == ep by the model's all-reduce after the layer,
        # this rank's width share of the shared experts in it.
        y_ND = self._experts(h_ND, *local_slots(w_NK, idx_NK, self.expert_first, self.E_local))
        if self.ep_group is not None:
            dist.all_reduce(y_ND, group=self.ep_group)
        return y_ND if self.shared is None else y_ND + self.shared.forward(h_ND)

    def _forward_gathered(self, h_ND: torch.Tensor, rows: int) -> torch.Tensor:
        """dp-attention (infer/ep.py): the ranks' tokens gathered (each rank's padded to the same P rows), routed
        and this rank's experts' slots computed over all of them, the partial sums reduce-scattered back to their
        ranks; then the shared experts on this rank's own rows. Every rank routes every gathered token (the same
        inputs, the same choice): a [rows, D] x [D, E] product, less than two more collectives for the choice."""
        N = h_ND.shape[0]
        h_GD = gather_rows(pad_rows(h_ND, rows), self.ep_group)
        w_GK, idx_GK = self.route(h_GD)
        y_GD = self._experts(h_GD, *local_slots(w_GK, idx_GK, self.expert_first, self.E_local))
        y_ND = scatter_sums(y_GD, self.ep_group)[:N]
        return y_ND if self.shared is None else y_ND + self.shared.forward(h_ND)

    def _experts(self, h_ND: torch.Tensor, w_NK: torch.Tensor, idx_NK: torch.Tensor) -> torch.Tensor:
        """The stacked experts' weighted sum for the slots (w_NK, idx_NK), in the path the step's size picks."""
        if self.w13_scale is not None:  # FP8 experts: the fused kernels (or their reference) at every batch size
            return moe.fused_moe_fp8(h_ND, self.w13_EXD, self.w13_scale, self.w2_EDF, self.w2_scale, w_NK, idx_NK,
                                     self.n_shared)
        slots = h_ND.shape[0] * (self.K + self.n_shared)
        if moe_path(slots, ops.kernels_on(), _use_grouped_mm(h_ND)) == "fused":
            return moe.fused_moe(h_ND, self.w13_EXD, self.w2_EDF, w_NK, idx_NK, self.n_shared)
        return self._grouped(h_ND, w_NK, idx_NK)

    def _grouped(self, h_ND: torch.Tensor, w_NK: torch.Tensor, idx_NK: torch.Tensor) -> torch.Tensor:
        """Tokens sorted by expert, one grouped GEMM per projection (torch._grouped_mm on Hopper, the exact
        per-expert loop elsewhere), then the weighted sum over each token's slots in fp32."""
        N, D = h_ND.shape
        idx_NK = idx_NK.long()
        if self.n_shared:
            shared_NS = torch.arange(self.E_local, self.E_local + self.n_shared,
                                     device=h_ND.device).expand(N, self.n_shared)
            idx_NK = torch.cat([idx_NK, shared_NS], dim=1)
            w_NK = torch.cat([w_NK, w_NK.new_ones(N, self.n_shared)], dim=1)
        Kt = idx_NK.shape[1]
        flat_M = idx_NK.reshape(-1)
        order_M = torch.argsort(flat_M, stable=True)
        counts_E = torch.zeros(self.E_local + self.n_shared, dtype=torch.int64, device=h_ND.device).scatter_add_(
            0, flat_M, torch.ones_like(flat_M))
        gu_M2F = grouped_mm(h_ND[order_M // Kt], self.w13_EXD, counts_E)
        y_MD = grouped_mm(ops.silu_mul(gu_M2F), self.w2_EDF, counts_E)
        y_slots = torch.empty_like(y_MD)
        y_slots[order_M] = y_MD
        return (y_slots.view(N, Kt, D).float() * w_NK.unsqueeze(-1)).sum(1).to(h_ND.dtype)


class Layer:
    def __init__(self, attn, mlp, in_norm: Norm, post_norm: Norm):
        self.attn, self.mlp, self.in_norm, self.post_norm = attn, mlp, in_norm, post_norm


class MTPLayer:
    """DeepSeek-V3's multi-token-prediction module of depth 1 (V3 report, sec. 2.2, eqs. 21-23; models/deepseek.py's
    MTPModule) as a drafter: at position i it combines the target's last-block output h_i with the embedding of
    token i + 1, h'_i = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)]), runs its block over the sequence (its own cache
    layer, n_layers), and its output through shared_head.norm and the model's head predicts token i + 2. Built
    from the hub's names (model.layers.{n_layers}.*) with the main layers' classes and this rank's share; eh_proj
    is kept whole on every rank (its output is the block's replicated input)."""

    def __init__(self, s: Share, a: ModelArgs):
        p = f"layers.{a.n_layers}"
        self.enorm = Norm(s.tensor(s.whole(f"{p}.enorm.weight")), a.norm_eps)
        self.hnorm = Norm(s.tensor(s.whole(f"{p}.hnorm.weight")), a.norm_eps)
        self.eh_proj = s.linear([s.whole(f"{p}.eh_proj.weight")])
        attn = LatentAttention(s, p, a) if a.is_mla else DenseAttention(s, p, a)
        mlp = MoELayer(s, p, a) if a.is_moe_layer(a.n_layers) else DenseMLP(s, p)
        self.block = Layer(attn, mlp, Norm(s.tensor(s.whole(f"{p}.input_layernorm.weight")), a.norm_eps),
                           Norm(s.tensor(s.whole(f"{p}.post_attention_layernorm.weight")), a.norm_eps))
        self.norm = Norm(s.tensor(s.whole(f"{p}.shared_head.norm.weight")), a.norm_eps)


class Rope:
    """cos/sin tables [P, R/2] in fp32 for positions 0..P-1, the YaRN attention factor folded in."""

    def __init__(self, inv_freq: torch.Tensor, attn_factor: float, positions: int, device):
        angles_PR = torch.outer(torch.arange(positions, device=device, dtype=torch.float32),
                                inv_freq.to(device, torch.float32))
        self.cos_PR = angles_PR.cos() * attn_factor
        self.sin_PR = angles_PR.sin() * attn_factor


class InferenceModel:
    """One tp rank's weights and the forward over a step's flattened tokens and the paged cache."""

    def __init__(self, args: ModelArgs, layers: list[Layer], embed_w: torch.Tensor, final_norm: Norm,
                 head_w: torch.Tensor, rope_inv_freq: torch.Tensor, rope_attn_factor: float, tp_group=None,
                 tp: int | None = None, ep: int = 1):
        self.args, self.layers, self.embed_w, self.final_norm, self.head_w = args, layers, embed_w, final_norm, head_w
        self.rope_inv_freq, self.rope_attn_factor = rope_inv_freq, rope_attn_factor
        self.tp_group = tp_group  # the replica's ranks (tp's, ep's or both's)
        self.tp = tp if tp is not None else dist.get_world_size(tp_group) if tp_group is not None else 1
        self.ep = ep
        self.device, self.dtype = embed_w.device, embed_w.dtype
        self.rope: Rope | None = None
        self.lora = None  # infer/lora.LoRASlots once adapters are attached (lora.attach)
        self.weights = ""  # what the projections are (dtype, FP8 blocks kept or quantized), for the log line
        self.mtp: MTPLayer | None = None  # the speculative drafter (infer/spec.py), when built with mtp=True
        self.dp_attention = False  # each rank's forward holds its own requests; the MoE layers gather (infer/ep.py)

    @classmethod
    @torch.no_grad()
    def from_training(cls, model: Transformer, tp_group=None, fp8: bool = False, mtp: bool = False, ep: int = 1,
                      tp: int | None = None, dp_attention: bool = False) -> InferenceModel:
        """Lay out a whole training model's weights for inference, taking this rank's tp share (`fp8`: every
        projection and expert quantized to FP8 128 x 128 blocks; `mtp`: its first MTP module too, as the
        speculative drafter; `ep`, `tp`, `dp_attention`: as `build`). The training model is emptied layer by layer
        as it goes (peak memory: the model plus one layer's copies): it cannot be used afterwards."""
        from paraseek.infer.weights import ModelWeights

        w = model.embed_tokens.weight
        out = cls.build(ModelWeights(model), model.args, tp_group, w.dtype, w.device, fp8, mtp, ep, tp, dp_attention)
        model.mtp = None  # what the engine runs of them was copied (mtp=True); the rest is not run
        return out

    @classmethod
    @torch.no_grad()
    def from_folder(cls, folder, args: ModelArgs, tp_group=None, *, dtype: torch.dtype, device,
                    block: tuple[int, int] | None = None, fp8: bool = False,
                    map_budget: int = 1 << 30, mtp: bool = False, ep: int = 1,
                    tp: int | None = None, dp_attention: bool = False) -> InferenceModel:
        """Read an HF folder's safetensors straight into this rank's layout, slice by slice (each rank reads only
        what it keeps; the whole model is never built). `block`: the FP8 weight block of its quantization_config.
        `fp8`: keep its FP8 blocks (or quantize a bf16 checkpoint's projections); otherwise FP8 weights are
        dequantized to `dtype`. `map_budget`: models.hf.HubTensors'. `mtp`: its first MTP layer too (the
        speculative drafter). `ep`, `tp`, `dp_attention`: as `build` (under ep each rank reads only its experts'
        tensors)."""
        from paraseek.infer.weights import FolderWeights

        src = FolderWeights(folder, args, block, map_budget)
        try:
            return cls.build(src, args, tp_group, dtype, device, fp8, mtp, ep, tp, dp_attention)
        finally:
            src.close()

    @classmethod
    def build(cls, source, a: ModelArgs, tp_group, dtype: torch.dtype, device, fp8: bool,
              mtp: bool = False, ep: int = 1, tp: int | None = None, dp_attention: bool = False) -> InferenceModel:
        """The layers from `source` (infer/weights.py), each layer's share read and laid out before the next;
        `mtp`: V3's first MTP module as well (MTPLayer). The drafter runs that one module for every draft (V3 ships
        one; a model with more keeps only the first: its deeper modules would need each earlier depth's hidden
        states of the same positions kept from step to step). `tp_group` holds the replica's ranks; `ep` > 1 splits
        the routed experts over all of them by expert (infer/ep.py), `tp` (default: all of them when ep is 1, else
        1) the rest by heads and width: tp and ep are each 1 or the group's size. `dp_attention` (ep > 1, tp 1): each
        rank's forward runs its own requests, the MoE layers gather and scatter the ranks' tokens (infer/ep.py)."""
        from paraseek.infer.ep import check_ep
        from paraseek.infer.tp import check_tp

        world = dist.get_world_size(tp_group) if tp_group is not None else 1
        tp = tp if tp is not None else world if ep == 1 else 1
        check_ep(a, tp, ep)
        check_tp(a, tp, ep)
        if tp not in (1, world) or ep not in (1, world) or max(tp, ep) != world:
            raise ValueError(f"tp {tp} and ep {ep} on a group of {world} ranks: each is 1 or the group's size")
        if dp_attention and (ep < 2 or tp != 1):
            raise ValueError(f"dp-attention runs attention at tp 1 over ep > 1 ranks, not tp {tp} ep {ep}")
        rank = dist.get_rank(tp_group) if tp_group is not None else 0
        s = Share(source, rank if tp > 1 else 0, tp, dtype, torch.device(device), fp8, ep_rank=rank if ep > 1 else 0,
                  ep=ep, ep_group=tp_group if ep > 1 and tp == 1 else None)
        layers = []
        for i in range(a.n_layers):
            p = f"layers.{i}"
            attn = LatentAttention(s, p, a) if a.is_mla else DenseAttention(s, p, a)
            mlp = MoELayer(s, p, a) if a.is_moe_layer(i) else DenseMLP(s, p)
            layers.append(Layer(attn, mlp, Norm(s.tensor(s.whole(f"{p}.input_layernorm.weight")), a.norm_eps),
                                Norm(s.tensor(s.whole(f"{p}.post_attention_layernorm.weight")), a.norm_eps)))
            s.release(p)
        embed = s.tensor(s.whole("embed_tokens.weight"))
        head_name = "embed_tokens.weight" if a.tie_embeddings else "lm_head.weight"
        if tp == 1:
            head = embed if a.tie_embeddings else s.tensor(s.whole(head_name))
        else:  # by vocabulary; one that tp does not divide gets zero rows, their logits cut after the gather
            per = -(-a.vocab_size // tp)
            start = rank * per
            head = torch.zeros((per, a.dim), dtype=dtype, device=s.device)
            if start < a.vocab_size:
                rows = min(per, a.vocab_size - start)
                head[:rows] = s.tensor(Part(head_name, 0, start, rows))
        inv_freq, attn_factor = rope_inv_freq(a)
        out = cls(a, layers, embed, Norm(s.tensor(s.whole("norm.weight")), a.norm_eps), head, inv_freq,
                  attn_factor, tp_group, tp, ep)
        if mtp:
            out.mtp = MTPLayer(s, a)
            s.release(f"layers.{a.n_layers}")
        out.dp_attention = dp_attention
        for L in layers + ([out.mtp.block] if out.mtp is not None else []):
            if isinstance(L.mlp, MoELayer):
                L.mlp.dp_attention = dp_attention
        out.weights = s.summary()
        return out

    def set_positions(self, positions: int) -> None:
        self.rope = Rope(self.rope_inv_freq, self.rope_attn_factor, positions, self.device)

    def decode_bytes(self) -> dict[str, int]:
        """Bytes of this rank's weights by how a decode step reads them, for the rooflines of `bench-infer`:
        "dense" read whole by every step (shared experts and the fp32 router included; MLA's kv_b once, as its
        W_UK and W_UV views), "routed" all routed experts (a step reads the share its tokens pick), "embed" the
        embedding (one row per token)."""
        size = lambda *ts: sum(t.numel() * t.element_size() for t in ts if t is not None)  # noqa: E731
        dense = size(self.final_norm.w) + (0 if self.head_w.data_ptr() == self.embed_w.data_ptr() else size(self.head_w))
        routed = 0
        for L in self.layers:
            dense += size(L.in_norm.w, L.post_norm.w) + L.attn.decode_bytes()
            if isinstance(L.mlp, MoELayer):
                m = L.mlp
                experts = size(m.w13_EXD, m.w2_EDF, m.w13_scale, m.w2_scale)
                routed += experts * m.E_local // (m.E_local + m.n_shared)
                dense += experts - experts * m.E_local // (m.E_local + m.n_shared) + size(m.router_w32, m.bias_E)
                if m.shared is not None:
                    dense += m.shared.gate_up.nbytes() + m.shared.down.nbytes()
            else:
                dense += L.mlp.gate_up.nbytes() + L.mlp.down.nbytes()
        return {"dense": dense, "routed": routed, "embed": size(self.embed_w)}

    @torch.no_grad()
    def forward(self, b, cache, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n_sample, vocab] of the rows b.logits_idx (written into `logits_out` when given: the CUDA graphs
        share one output buffer instead of keeping one each)."""
        return self.head(self.trunk(b, cache), b, logits_out)

    @torch.no_grad()
    def trunk(self, b, cache) -> torch.Tensor:
        """The last block's output [N, E] (the residual stream before the final norm) of every row."""
        layers = self.layers
        if self.lora is not None:
            self.lora.begin(b)  # the step's token -> adapter slot, read by every adapted projection
        x_NE = F.embedding(b.input_ids, self.embed_w)
        h_NE = ops.rms_norm(x_NE, layers[0].in_norm.w, layers[0].in_norm.eps)
        for i, L in enumerate(layers):
            a_NE = L.attn.forward(h_NE, b, cache, i, self.rope)
            self._all_reduce(a_NE)
            h_NE = ops.add_rms_norm(a_NE, x_NE, L.post_norm.w, L.post_norm.eps)
            m_NE = L.mlp.forward(h_NE, b.moe_rows) if isinstance(L.mlp, MoELayer) else L.mlp.forward(h_NE)
            self._all_reduce(m_NE)
            if i + 1 < len(layers):
                h_NE = ops.add_rms_norm(m_NE, x_NE, layers[i + 1].in_norm.w, layers[i + 1].in_norm.eps)
            else:
                x_NE.add_(m_NE)
        return x_NE

    @torch.no_grad()
    def forward_mtp(self, b, cache, h_NE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP drafter over a step (MTPLayer): row i's input is the token after its position (b.input_ids) and
        the hidden state `h_NE` of its position (the target's last-block output, or for a further draft the
        drafter's own output at the position before: the module reused, as vLLM and SGLang draft with V3's one
        module). Returns (the drafts' logits [n_sample, vocab] of the rows b.logits_idx, its output [N, E]: the
        next draft's hidden state)."""
        m, L = self.mtp, self.mtp.block
        e_NE = ops.rms_norm(F.embedding(b.input_ids, self.embed_w), m.enorm.w, m.enorm.eps)
        # The hub's eh_proj takes the embedding half first (models/deepseek.py's MTPModule says why).
        x_NE = m.eh_proj(torch.cat([e_NE, ops.rms_norm(h_NE, m.hnorm.w, m.hnorm.eps)], dim=-1))
        a_NE = L.attn.forward(ops.rms_norm(x_NE, L.in_norm.w, L.in_norm.eps), b, cache, self.args.n_layers, self.rope)
        self._all_reduce(a_NE)
        m_NE = L.mlp.forward(ops.add_rms_norm(a_NE, x_NE, L.post_norm.w, L.post_norm.eps))
        self._all_reduce(m_NE)
        x_NE.add_(m_NE)
        h_SE = ops.rms_norm(x_NE if b.every_row else x_NE[b.logits_idx], m.norm.w, m.norm.eps)
        return self._gather_vocab(F.linear(h_SE, self.head_w)), x_NE

    def head(self, x_NE: torch.Tensor, b, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n_sample, vocab] of the rows b.logits_idx of the last block's output."""
        fn = self.final_norm
        h_SE = ops.rms_norm(x_NE if b.every_row else x_NE[b.logits_idx], fn.w, fn.eps)
        if logits_out is not None and self.tp == 1:
            if ops.kernels_on():  # the decode GEMV where it measured faster than cuBLAS (infer/gemv.py)
                from paraseek.infer import gemv

                cfg = gemv.dispatch_config(h_SE, self.head_w, None)
                if cfg is not None:
                    return gemv.gemv(h_SE, self.head_w, None, cfg, out=logits_out)
            return torch.mm(h_SE, self.head_w.t(), out=logits_out)
        logits_SV = self._gather_vocab(F.linear(h_SE, self.head_w))
        return logits_out.copy_(logits_SV) if logits_out is not None else logits_SV

    def _all_reduce(self, x: torch.Tensor) -> None:
        if self.tp > 1:
            dist.all_reduce(x, group=self.tp_group)

    def _gather_vocab(self, logits_SV: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return logits_SV
        parts = [torch.empty_like(logits_SV) for _ in range(self.tp)]
        dist.all_gather(parts, logits_SV.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)[:, :self.args.vocab_size]
