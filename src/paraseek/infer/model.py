"""The inference model: DeepSeek-family layers built for decode from ModelArgs and the training model's weights.

The training model (models/deepseek.py) is single-device math shaped for autograd; this one is shaped for a step of
flattened tokens over the paged cache, on one tp rank. Its weights are laid out once, at build time, for how decode
reads them:
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

MoE layers choose their path per step by the number of token-expert slots: the fused kernels of infer/moe.py (no
sort, weights read once per expert tile) up to `FUSED_MAX_SLOTS`, torch._grouped_mm over tokens sorted by expert
beyond (prefill, large batches); off CUDA the plain-torch forms of either. The two round differently in bf16 (the
grouped form rounds gate and up before SwiGLU, the fused one rounds their product once), so a bf16 batch that
crosses the threshold may pick other near-tied tokens; in fp32 they agree (tests/gpu/test_infer_gpu.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paraseek.infer import moe, ops
from paraseek.infer.attention import prefill_attention
from paraseek.infer.linear import Linear
from paraseek.models.args import ModelArgs
from paraseek.models.deepseek import MLA, MoE, Transformer, _use_grouped_mm, grouped_mm

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


def _heads(w: torch.Tensor, rank: int, tp: int, dim: int = 0, unit: int = 1) -> torch.Tensor:
    """This rank's contiguous share of `dim` in whole units of `unit` rows (one head, one expert row...)."""
    per = w.shape[dim] // unit // tp
    return w.narrow(dim, rank * per * unit, per * unit)


@dataclass
class Norm:
    w: torch.Tensor
    eps: float


class DenseAttention:
    """Multi-head attention with GQA and optional q/k/v/o bias over the paged K/V cache."""

    def __init__(self, attn, a: ModelArgs, rank: int, tp: int):
        D = self.D = a.head_dim
        self.H = a.n_heads // tp
        q_w = _heads(attn.q_proj.weight, rank, tp, 0, D)
        q_b = _heads(attn.q_proj.bias, rank, tp, 0, D) if attn.q_proj.bias is not None else None
        if a.n_kv_heads % tp == 0:
            kv = [(_heads(lin.weight, rank, tp, 0, D), _heads(lin.bias, rank, tp, 0, D) if lin.bias is not None else None)
                  for lin in (attn.k_proj, attn.v_proj)]
        else:  # fewer kv heads than ranks: rank r keeps kv head r * n_kv // tp
            h = rank * a.n_kv_heads // tp
            kv = [(lin.weight[h * D:(h + 1) * D], lin.bias[h * D:(h + 1) * D] if lin.bias is not None else None)
                  for lin in (attn.k_proj, attn.v_proj)]
        self.G = kv[0][0].shape[0] // D
        self.qkv = Linear(torch.cat([q_w, kv[0][0], kv[1][0]]).contiguous(),
                          torch.cat([q_b, kv[0][1], kv[1][1]]).contiguous() if q_b is not None else None)
        b = attn.o_proj.bias
        self.o = Linear(_heads(attn.o_proj.weight, rank, tp, 1, D).contiguous(),
                        None if b is None else (b.clone() if rank == 0 else torch.zeros_like(b)))  # bias added once
        self.scale = attn.softmax_scale

    def forward(self, h_NE: torch.Tensor, b, cache, i: int, rope) -> torch.Tensor:
        N, H, G, D = h_NE.shape[0], self.H, self.G, self.D
        qkv = self.qkv(h_NE)
        q_NHD = qkv[:, :H * D].view(N, H, D)
        # One launch rotates q and k in the fused output and writes k and v into the cache.
        ops.rope_write_kv_(qkv, H, G, rope.cos_PR, rope.sin_PR, b.positions, b.slots, cache.kv[i])
        k_SGD, v_SGD = cache.k[i], cache.v[i]
        nd = b.n_decode
        if nd == N:  # decode-only (every CUDA-graph step): the kernel's output is the attention output
            o_NHD = ops.paged_decode_gqa(q_NHD, k_SGD, v_SGD, b.block_tables, b.context_lens, cache.block_size,
                                         self.scale)
            return self.o(o_NHD.view(N, H * D))
        o_NHD = q_NHD.new_empty((N, H, D))
        if nd:
            o_NHD[:nd] = ops.paged_decode_gqa(q_NHD[:nd], k_SGD, v_SGD, b.block_tables, b.context_lens,
                                              cache.block_size, self.scale)
        o_NHD[nd:] = prefill_attention(q_NHD[nd:], k_SGD[b.k_slots], v_SGD[b.k_slots], b.cu_q, b.cu_k,
                                       max(q for q, _ in b.lens), max(k for _, k in b.lens), b.lens, self.scale)
        return self.o(o_NHD.view(N, H * D))

    def decode_bytes(self) -> int:
        return self.qkv.nbytes() + self.o.nbytes()


class LatentAttention:
    """Multi-head latent attention over the latent cache [S, C + R] (the normalized latent, then the roped shared
    key): absorbed for decodes, expanded through kv_b for prefill chunks."""

    def __init__(self, attn: MLA, a: ModelArgs, rank: int, tp: int):
        self.C, self.R, self.nope, self.V = attn.kv_lora_rank, attn.rope_dim, attn.nope_dim, attn.v_dim
        self.H = a.n_heads // tp
        self.q_lora = attn.q_lora_rank
        qk = self.nope + self.R
        first = attn.q_a_proj.weight if self.q_lora else _heads(attn.q_proj.weight, rank, tp, 0, qk)
        self.in_proj = Linear(torch.cat([first, attn.kv_a_proj_with_mqa.weight]).contiguous())
        if self.q_lora:
            self.q_a_norm = Norm(attn.q_a_layernorm.weight.detach().clone(), attn.q_a_layernorm.eps)
            self.q_b = Linear(_heads(attn.q_b_proj.weight, rank, tp, 0, qk).contiguous())
        self.kv_norm = Norm(attn.kv_a_layernorm.weight.detach().clone(), attn.kv_a_layernorm.eps)
        self.kv_b_w = _heads(attn.kv_b_proj.weight, rank, tp, 0, self.nope + self.V).contiguous()
        # Views of kv_b (one copy in memory; cuBLAS reads the strided and transposed batches as they are):
        w_HXC = self.kv_b_w.view(self.H, self.nope + self.V, self.C)
        self.w_uk_HDC = w_HXC[:, :self.nope]  # q_nope -> latent space (absorbed into the query)
        self.w_uv_HCV = w_HXC[:, self.nope:].transpose(1, 2)  # attended latent -> each head's value
        self.o = Linear(_heads(attn.o_proj.weight, rank, tp, 1, self.V).contiguous())
        self.scale, self.interleave = attn.softmax_scale, attn.interleave
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
                         b.slots, c_SX, self.interleave)
        o_NHV = h_NE.new_empty((N, H, Dv))
        nd = b.n_decode
        if nd:
            # Absorbed (DeepSeek-V2 appendix C): W_UK folded into the query, W_UV applied after attention, so the
            # keys and values are the cached latent itself: [H, nd, nope] @ [H, nope, C] -> [H, nd, C].
            q_lat_HnC = torch.bmm(q_NHX[:nd, :, :nope].transpose(0, 1), self.w_uk_HDC)
            if self.kv_b_lora is not None:
                self.kv_b_lora.absorb_q_(q_lat_HnC, q_NHX[:nd, :, :nope])
            o_lat_nHC = ops.paged_decode_mla(q_lat_HnC.transpose(0, 1), q_pe_NHR[:nd], c_SX, b.block_tables,
                                             b.context_lens, cache.block_size, self.scale)
            o_NHV[:nd] = torch.bmm(o_lat_nHC.transpose(0, 1), self.w_uv_HCV).transpose(0, 1)
            if self.kv_b_lora is not None:
                self.kv_b_lora.value_(o_NHV, o_lat_nHC)
        if nd < N:
            # Expanded (the training model's form): the context's latents through kv_b to per-head keys and values.
            ctx_KX = c_SX[b.k_slots]
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

    def __init__(self, mlp, rank: int, tp: int):
        self.gate_up = Linear(torch.cat([_heads(mlp.gate_proj.weight, rank, tp),
                                         _heads(mlp.up_proj.weight, rank, tp)]).contiguous())
        self.down = Linear(_heads(mlp.down_proj.weight, rank, tp, 1).contiguous())

    def forward(self, h_NE: torch.Tensor) -> torch.Tensor:
        return self.down(ops.silu_mul(self.gate_up(h_NE)))


class MoELayer:
    """DeepSeekMoE for inference: routing in fp32 from a cached fp32 router weight, then routed and shared experts
    together, either fused (few slots) or as sorted grouped GEMMs (many)."""

    def __init__(self, mlp: MoE, a: ModelArgs, rank: int, tp: int):
        self.a = a
        self.E, self.K = a.n_routed_experts, a.n_activated_experts
        g = mlp.gate
        self.router_w32 = g.weight.detach().float().contiguous()
        bias = g.e_score_correction_bias
        self.bias_E = bias.detach().float().contiguous() if bias is not None else None
        ex = mlp.experts
        gate, up, down = ex.gate_proj, ex.up_proj, ex.down_proj  # [E, F, D], [E, F, D], [E, D, F]
        F_ = gate.shape[1]
        gate_l, up_l, down_l = _heads(gate, rank, tp, 1), _heads(up, rank, tp, 1), _heads(down, rank, tp, 2)
        self.n_shared = 0
        if mlp.shared_experts is not None:
            s = mlp.shared_experts
            ns = s.gate_proj.weight.shape[0] // F_  # the shared MLP's width is n_shared x F
            self.n_shared = ns
            # Shared chunk j: gate/up rows j*F:(j+1)*F and down columns j*F:(j+1)*F, each cut by tp like an expert.
            sg = torch.stack([_heads(c, rank, tp) for c in s.gate_proj.weight.split(F_, 0)])
            su = torch.stack([_heads(c, rank, tp) for c in s.up_proj.weight.split(F_, 0)])
            sd = torch.stack([_heads(c, rank, tp, 1) for c in s.down_proj.weight.split(F_, 1)])
            gate_l, up_l, down_l = torch.cat([gate_l, sg]), torch.cat([up_l, su]), torch.cat([down_l, sd])
        self.w13_EXD = torch.cat([gate_l, up_l], dim=1).contiguous()  # [E', 2F, D]: gate rows, then up rows
        self.w2_EDF = down_l.contiguous()

    def route(self, h_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.a
        logits_NE = F.linear(h_ND.float(), self.router_w32)
        return moe.route(logits_NE, self.bias_E, score_func=a.score_func, topk_method=a.topk_method,
                         n_group=a.n_group, topk_group=a.topk_group, top_k=self.K, norm_topk_prob=a.norm_topk_prob,
                         scaling=a.routed_scaling_factor)

    def forward(self, h_ND: torch.Tensor) -> torch.Tensor:
        w_NK, idx_NK = self.route(h_ND)
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
            shared_NS = torch.arange(self.E, self.E + self.n_shared, device=h_ND.device).expand(N, self.n_shared)
            idx_NK = torch.cat([idx_NK, shared_NS], dim=1)
            w_NK = torch.cat([w_NK, w_NK.new_ones(N, self.n_shared)], dim=1)
        Kt = idx_NK.shape[1]
        flat_M = idx_NK.reshape(-1)
        order_M = torch.argsort(flat_M, stable=True)
        counts_E = torch.zeros(self.E + self.n_shared, dtype=torch.int64, device=h_ND.device).scatter_add_(
            0, flat_M, torch.ones_like(flat_M))
        gu_M2F = grouped_mm(h_ND[order_M // Kt], self.w13_EXD, counts_E)
        y_MD = grouped_mm(ops.silu_mul(gu_M2F), self.w2_EDF, counts_E)
        y_slots = torch.empty_like(y_MD)
        y_slots[order_M] = y_MD
        return (y_slots.view(N, Kt, D).float() * w_NK.unsqueeze(-1)).sum(1).to(h_ND.dtype)


class Layer:
    def __init__(self, attn, mlp, in_norm: Norm, post_norm: Norm):
        self.attn, self.mlp, self.in_norm, self.post_norm = attn, mlp, in_norm, post_norm


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
                 head_w: torch.Tensor, rope_inv_freq: torch.Tensor, rope_attn_factor: float, tp_group=None):
        self.args, self.layers, self.embed_w, self.final_norm, self.head_w = args, layers, embed_w, final_norm, head_w
        self.rope_inv_freq, self.rope_attn_factor = rope_inv_freq, rope_attn_factor
        self.tp_group = tp_group
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.device, self.dtype = embed_w.device, embed_w.dtype
        self.rope: Rope | None = None
        self.lora = None  # infer/lora.LoRASlots once adapters are attached (lora.attach)

    @classmethod
    @torch.no_grad()
    def from_training(cls, model: Transformer, tp_group=None) -> InferenceModel:
        """Lay out a whole training model's weights for inference, taking this rank's tp share. The training model
        is emptied layer by layer as it goes (peak memory: the model plus one layer's fused copy): it cannot be
        used afterwards."""
        from paraseek.infer.tp import check_tp

        a = model.args
        tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        check_tp(a, tp)
        rank = dist.get_rank(tp_group) if tp_group is not None else 0
        layers = []
        for key in list(model.layers.keys()):
            blk = model.layers[key]
            attn = (LatentAttention(blk.self_attn, a, rank, tp) if isinstance(blk.self_attn, MLA)
                    else DenseAttention(blk.self_attn, a, rank, tp))
            mlp = MoELayer(blk.mlp, a, rank, tp) if isinstance(blk.mlp, MoE) else DenseMLP(blk.mlp, rank, tp)
            layers.append(Layer(attn, mlp, Norm(blk.input_layernorm.weight.detach().clone(), blk.input_layernorm.eps),
                                Norm(blk.post_attention_layernorm.weight.detach().clone(), blk.post_attention_layernorm.eps)))
            del model.layers[key]  # frees the training layer's weights (the fused copies hold their own)
        head = model.lm_head.weight if model.lm_head is not None else model.embed_tokens.weight
        if tp > 1:
            pad = -head.shape[0] % tp  # vocabularies that tp does not divide: zero rows, their logits cut after
            if pad:
                head = torch.cat([head, head.new_zeros((pad, head.shape[1]))])
            head = _heads(head, rank, tp).contiguous()
        embed = model.embed_tokens.weight.detach()
        out = cls(a, layers, embed, Norm(model.norm.weight.detach().clone(), model.norm.eps), head.detach(),
                  model.rope_inv_freq.detach().clone(), model.rope_attn_factor, tp_group)
        model.mtp = None  # the MTP modules are not run by the engine
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
                experts = size(m.w13_EXD, m.w2_EDF)
                routed += experts * m.E // (m.E + m.n_shared)
                dense += experts - experts * m.E // (m.E + m.n_shared) + size(m.router_w32, m.bias_E)
            else:
                dense += L.mlp.gate_up.nbytes() + L.mlp.down.nbytes()
        return {"dense": dense, "routed": routed, "embed": size(self.embed_w)}

    @torch.no_grad()
    def forward(self, b, cache, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n_sample, vocab] of the rows b.logits_idx (written into `logits_out` when given: the CUDA graphs
        share one output buffer instead of keeping one each)."""
        layers = self.layers
        if self.lora is not None:
            self.lora.begin(b)  # the step's token -> adapter slot, read by every adapted projection
        x_NE = F.embedding(b.input_ids, self.embed_w)
        h_NE = ops.rms_norm(x_NE, layers[0].in_norm.w, layers[0].in_norm.eps)
        for i, L in enumerate(layers):
            a_NE = L.attn.forward(h_NE, b, cache, i, self.rope)
            self._all_reduce(a_NE)
            h_NE = ops.add_rms_norm(a_NE, x_NE, L.post_norm.w, L.post_norm.eps)
            m_NE = L.mlp.forward(h_NE)
            self._all_reduce(m_NE)
            if i + 1 < len(layers):
                h_NE = ops.add_rms_norm(m_NE, x_NE, layers[i + 1].in_norm.w, layers[i + 1].in_norm.eps)
            else:
                x_NE.add_(m_NE)
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
