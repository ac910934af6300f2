"""The engine's hot-path operations: a plain-torch reference (CPU, tests, any dtype) and, on CUDA, the Triton kernels
of `kernels.py` with the same contract. The engine calls only these names; `use_kernels(True)` switches them.

Shape legend (the engine's, one for the whole infer package): N tokens in the step (flattened over sequences),
B sequences, H query heads (local to this tp rank), G kv heads (local), D head dim, C MLA latent width
(kv_lora_rank), R RoPE dims, S cache slots (num_blocks x block_size), M blocks per sequence in a block table,
P positions in the RoPE table, F MLP width, E model width.

KV cache layouts (one tensor per layer, slot = physical_block * block_size + offset):
  MHA/GQA: k_SGD and v_SGD, [S, G, D] each.   MLA: c_SX, [S, C + R]: the normalized latent then the roped shared key.
  FP8 (infer/kv_fp8.py): the same tensors in e4m3 and each row's fp32 scale beside them, k_scale_SG / v_scale_SG
  (views of kv_scale_S2G) and c_scale_S, passed to the ops below; None (the default) for a cache in the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paraseek.infer import kv_fp8

_KERNELS = False


def use_kernels(on: bool) -> None:
    """Route the ops below to the Triton kernels (CUDA only). Off by default and on CPU."""
    global _KERNELS
    _KERNELS = on


def kernels_on() -> bool:
    return _KERNELS


# ---- norms and activations -----------------------------------------------------------------------------------------
def rms_norm(x_NE: torch.Tensor, w_E: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm: normalize in fp32, round to x's dtype, then scale by the weight (deepseek.RMSNorm)."""
    if _KERNELS:
        from paraseek.infer import kernels

        return kernels.rms_norm(x_NE, w_E, eps)
    x32 = x_NE.float()
    return w_E * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x_NE.dtype)


def add_rms_norm(x_NE: torch.Tensor, residual_NE: torch.Tensor, w_E: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x in place (rounded to the residual's dtype, as the model's `h + f(h)`), then rms_norm(residual)."""
    if _KERNELS:
        from paraseek.infer import kernels

        return kernels.add_rms_norm(x_NE, residual_NE, w_E, eps)
    residual_NE.add_(x_NE)
    return rms_norm(residual_NE, w_E, eps)


def silu_mul(gu_N2F: torch.Tensor) -> torch.Tensor:
    """SwiGLU's inner product from a fused [gate | up] projection: silu(gate) * up."""
    if _KERNELS:
        from paraseek.infer import kernels

        return kernels.silu_mul(gu_N2F)
    gate, up = gu_N2F.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- RoPE -----------------------------------------------------------------------------------------------------------
def rope_(x_NHR: torch.Tensor, cos_PR: torch.Tensor, sin_PR: torch.Tensor, positions_N: torch.Tensor,
          interleave: bool) -> None:
    """Rotate x in place at the given positions (cos/sin: fp32 tables [P, R/2], the YaRN attention factor folded
    in). Adjacent pairs (interleave, DeepSeek MLA) are written back in half-split order, as deepseek.apply_rope
    does: queries and keys get the same permutation, so q.k is unchanged. x may be a strided view (heads of a fused
    projection); its last dim is contiguous."""
    if _KERNELS:
        from paraseek.infer import kernels

        return kernels.rope_(x_NHR, cos_PR, sin_PR, positions_N, interleave)
    cos = cos_PR[positions_N][:, None, :].to(x_NHR.dtype)
    sin = sin_PR[positions_N][:, None, :].to(x_NHR.dtype)
    if interleave:
        x1, x2 = x_NHR[..., 0::2], x_NHR[..., 1::2]
    else:
        x1, x2 = x_NHR.chunk(2, dim=-1)
    x_NHR.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


def rope_write_kv_(qkv_NX: torch.Tensor, n_heads: int, n_kv_heads: int, cos_PR: torch.Tensor, sin_PR: torch.Tensor,
                   positions_N: torch.Tensor, slots_N: torch.Tensor, kv_S2GD: torch.Tensor,
                   kv_scale_S2G: torch.Tensor | None = None) -> None:
    """MHA/GQA: the fused projection's output [N, (H + 2G) x D] -> q and k rotated in place (half-split RoPE), and
    each token's rotated k and its v written to its cache slot (kv_S2GD[slot] = [k, v]; fp8: each head's K and V
    quantized, their scales to kv_scale_S2G[slot]). One kernel on CUDA."""
    if _KERNELS:
        from paraseek.infer import kernels

        return kernels.rope_write_kv_(qkv_NX, n_heads, n_kv_heads, cos_PR, sin_PR, positions_N, slots_N, kv_S2GD,
                                      kv_scale_S2G)
    N, G = qkv_NX.shape[0], n_kv_heads
    D = qkv_NX.shape[1] // (n_heads + 2 * G)
    rope_(qkv_NX[:, :(n_heads + G) * D].view(N, n_heads + G, D), cos_PR, sin_PR, positions_N, False)
    kv_N2GD = qkv_NX[:, n_heads * D:].view(N, 2, G, D)
    if kv_scale_S2G is not None:
        kv_fp8.write_rows_(kv_S2GD, kv_scale_S2G, slots_N, kv_N2GD)
    else:
        kv_S2GD.index_copy_(0, slots_N, kv_N2GD)


def mla_prepare_(q_pe_NHR: torch.Tensor, kv_a_NX: torch.Tensor, w_C: torch.Tensor, eps: float, cos_PR: torch.Tensor,
                 sin_PR: torch.Tensor, positions_N: torch.Tensor, slots_N: torch.Tensor, c_SX: torch.Tensor,
                 interleave: bool, c_scale_S: torch.Tensor | None = None) -> None:
    """MLA's per-token work between the input projection and attention: the latent kv_a[:, :C] RMS-normalized,
    the shared rope key kv_a[:, C:] rotated, both written to the token's cache row (c_SX[slot] = [latent | k_pe];
    fp8: the row, in kv_a's dtype, quantized with one scale to c_scale_S[slot]), and the queries' rope part q_pe
    rotated in place. One kernel on CUDA (five launches otherwise)."""
    if _KERNELS:
        from paraseek.infer import kernels

        return kernels.mla_prepare_(q_pe_NHR, kv_a_NX, w_C, eps, cos_PR, sin_PR, positions_N, slots_N, c_SX,
                                    interleave, c_scale_S)
    C = w_C.shape[0]
    latent_NC = rms_norm(kv_a_NX[:, :C], w_C, eps)
    k_pe_N1R = kv_a_NX[:, C:].unsqueeze(1)
    rope_(q_pe_NHR, cos_PR, sin_PR, positions_N, interleave)
    rope_(k_pe_N1R, cos_PR, sin_PR, positions_N, interleave)
    if c_scale_S is not None:
        kv_fp8.write_rows_(c_SX, c_scale_S, slots_N, torch.cat([latent_NC.to(kv_a_NX.dtype), k_pe_N1R[:, 0]], dim=-1))
    else:
        c_SX.index_copy_(0, slots_N, torch.cat([latent_NC, k_pe_N1R[:, 0]], dim=-1).to(c_SX.dtype))


# ---- paged decode attention ------------------------------------------------------------------------------------------
def _gather_context(cache_S_: torch.Tensor, block_tables_BM: torch.Tensor, context_lens_B: torch.Tensor,
                    block_size: int, scale_S_: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's cached rows [B, T, ...] (T = the longest context; fp8: dequantized, in fp32) and the [B, T]
    mask of valid ones."""
    T = int(context_lens_B.max())
    pos_T = torch.arange(T, device=cache_S_.device)
    blocks_BT = block_tables_BM.long().gather(1, (pos_T // block_size).expand(len(block_tables_BM), T))
    slots_BT = blocks_BT * block_size + pos_T % block_size
    valid_BT = pos_T < context_lens_B[:, None]
    slots_BT = slots_BT.clamp(min=0) * valid_BT
    if scale_S_ is not None:
        return kv_fp8.dequantize_rows(cache_S_[slots_BT], scale_S_[slots_BT], torch.float32), valid_BT
    return cache_S_[slots_BT], valid_BT


def paged_decode_gqa(q_BHD: torch.Tensor, k_SGD: torch.Tensor, v_SGD: torch.Tensor, block_tables_BM: torch.Tensor,
                     context_lens_B: torch.Tensor, block_size: int, scale: float,
                     k_scale_SG: torch.Tensor | None = None, v_scale_SG: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence against its paged K/V (its context_lens_B[b] cached tokens, the new one
    included). Query head h reads kv head h // (H / G). fp8: K and V are x_q * scale, in fp32."""
    if _KERNELS:
        from paraseek.infer import kernels

        return kernels.paged_decode_gqa(q_BHD, k_SGD, v_SGD, block_tables_BM, context_lens_B, block_size, scale,
                                        k_scale_SG, v_scale_SG)
    k_BTGD, valid_BT = _gather_context(k_SGD, block_tables_BM, context_lens_B, block_size, k_scale_SG)
    v_BTGD, _ = _gather_context(v_SGD, block_tables_BM, context_lens_B, block_size, v_scale_SG)
    B, H, D = q_BHD.shape
    G = k_BTGD.shape[2]
    q_BGhD = q_BHD.view(B, G, H // G, D).float()
    s_BGhT = torch.einsum("bghd,btgd->bght", q_BGhD, k_BTGD.float()) * scale
    s_BGhT = s_BGhT.masked_fill(~valid_BT[:, None, None, :], float("-inf"))
    o_BGhD = torch.einsum("bght,btgd->bghd", s_BGhT.softmax(-1), v_BTGD.float())
    return o_BGhD.reshape(B, H, D).to(q_BHD.dtype)


def paged_decode_mla(q_lat_BHC: torch.Tensor, q_pe_BHR: torch.Tensor, c_SX: torch.Tensor, block_tables_BM: torch.Tensor,
                     context_lens_B: torch.Tensor, block_size: int, scale: float,
                     c_scale_S: torch.Tensor | None = None) -> torch.Tensor:
    """MLA's absorbed decode (DeepSeek-V2 paper, sec. 2.1.2 and appendix C): one KV head shared by all H query
    heads, key = [latent C | rope key R] and value = the latent C, so score = q_lat.c + q_pe.k_pe. Returns the
    attention-weighted latent [B, H, C], which W_UV then maps to each head's value. fp8: rows are x_q * scale."""
    if _KERNELS:
        from paraseek.infer import kernels

        return kernels.paged_decode_mla(q_lat_BHC, q_pe_BHR, c_SX, block_tables_BM, context_lens_B, block_size, scale,
                                        c_scale_S)
    C = q_lat_BHC.shape[-1]
    c_BTX, valid_BT = _gather_context(c_SX, block_tables_BM, context_lens_B, block_size, c_scale_S)
    c_BTX = c_BTX.float()
    s_BHT = (torch.einsum("bhc,btc->bht", q_lat_BHC.float(), c_BTX[..., :C])
             + torch.einsum("bhr,btr->bht", q_pe_BHR.float(), c_BTX[..., C:])) * scale
    s_BHT = s_BHT.masked_fill(~valid_BT[:, None, :], float("-inf"))
    return torch.einsum("bht,btc->bhc", s_BHT.softmax(-1), c_BTX[..., :C]).to(q_lat_BHC.dtype)
