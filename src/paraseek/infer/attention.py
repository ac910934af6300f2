"""Attention over the paged cache for the prefill chunks of a step: every chunk's queries against its whole context
(the cached prefix plus the chunk itself, gathered from the cache into one packed [K, G, D] tensor), causal with the
mask aligned to the bottom right (query i of a chunk of n sees the first context - n + i + 1 keys).

On CUDA in bf16/fp16 this is one varlen FlashAttention-2 call for all chunks of the step (Dao 2023; torch's own
`_flash_attention_forward` with cumulative sequence lengths, the kernel SDPA uses); elsewhere, one SDPA call per
chunk with an explicit mask (the reference). Decodes (one query per sequence) go to ops.paged_decode_*.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


USE_FLASH = True  # tests turn it off to compare with the reference loop


def _flash_ok(q: torch.Tensor, v: torch.Tensor) -> bool:
    return (USE_FLASH and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256
            and q.shape[-1] % 8 == 0 and hasattr(torch.ops.aten, "_flash_attention_forward"))


def prefill_attention(q_NHD: torch.Tensor, k_KGD: torch.Tensor, v_KGV: torch.Tensor, cu_q: torch.Tensor,
                      cu_k: torch.Tensor, max_q: int, max_k: int, lens: list[tuple[int, int]],
                      scale: float) -> torch.Tensor:
    """Packed queries [N, H, D] of several chunks and their packed contexts [K, G, D] / [K, G, V] (chunk i: queries
    cu_q[i]:cu_q[i+1], keys cu_k[i]:cu_k[i+1]; `lens` the same (n_q, n_k) pairs on the host) -> [N, H, V]."""
    H, G, Dv = q_NHD.shape[1], k_KGD.shape[1], v_KGV.shape[-1]
    if _flash_ok(q_NHD, v_KGV):
        D = q_NHD.shape[-1]
        if Dv != D:  # FlashAttention-2 needs one head dim: pad the values (MLA's 128 to its 192), slice after
            v_KGV = F.pad(v_KGV, (0, D - Dv))
        out = torch.ops.aten._flash_attention_forward(
            q_NHD, k_KGD, v_KGV, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)[0]
        return out[..., :Dv] if Dv != D else out
    out = q_NHD.new_empty((q_NHD.shape[0], H, Dv))
    q0 = k0 = 0
    for n_q, n_k in lens:
        q = q_NHD[q0:q0 + n_q].transpose(0, 1)  # [H, n_q, D]
        k = k_KGD[k0:k0 + n_k].transpose(0, 1)
        v = v_KGV[k0:k0 + n_k].transpose(0, 1)
        # Bottom-right causal: query i sits at context position n_k - n_q + i.
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=G != H)
        out[q0:q0 + n_q] = o.transpose(0, 1)
        q0, k0 = q0 + n_q, k0 + n_k
    return out
