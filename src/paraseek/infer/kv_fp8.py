"""The FP8 KV cache format (`--kv-cache-dtype fp8`): every cache row in float8 e4m3 with one fp32 scale.

A row is what one token writes for one layer: MLA's [latent C | rope key R] (576 values on DeepSeek-V2/V3), or one
kv head's K or V (D values) for MHA/GQA. Per row, s = amax / 448 (e4m3's largest finite value) and x_q = x / s
rounded to e4m3 (round to nearest even), the recipe of the V3 report's activation quantization (sec. 3.3.2) applied to
a whole row; x ~ x_q * s. The rope key shares the latent's scale: e4m3 keeps 3 mantissa bits for every value within
2^14 of the row's amax, so a smaller rope part loses no relative precision to the latent.

Bytes per token and layer: MLA C + R + 4 (580 against bf16's 1,152: 1.99x the tokens); GQA 2 x G x (D + 4) (at
D = 128, 264 B per kv head against 512: 1.94x). Error per value: |x - x_q s| <= max(|x| / 16, s / 1024) (half a
unit in the last place of a 3-bit mantissa; e4m3's subnormal step is 2^-9).

Scales are written with the values, by the cache-write ops (prefill and decode alike); the paged decode kernels
read e4m3 and fold the scale into the scores and the probabilities (infer/kernels.py); prefill attention reads the
context dequantized to the model's dtype (KVCache.context_*).
"""

from __future__ import annotations

import torch

from paraseek.models.hf import E4M3, E4M3_MAX, SCALE_FLOOR

KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype
SCALE_BYTES = 4  # one fp32 scale per row


def quantize_rows(x_RX: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows over the last dim -> (x_q [..., X] e4m3, s [...] fp32) with x ~ x_q * s, s = amax / 448 (an all-zero
    row gets SCALE_FLOOR / 448 and quantizes to zeros)."""
    x32 = x_RX.float()
    s_R = x32.abs().amax(dim=-1).clamp_min(SCALE_FLOOR) / E4M3_MAX
    return (x32 / s_R[..., None]).to(E4M3), s_R


def dequantize_rows(q_RX: torch.Tensor, s_R: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x_q * s in fp32, rounded once to dtype."""
    return (q_RX.float() * s_R[..., None]).to(dtype)


def write_rows_(cache_S_: torch.Tensor, scale_S_: torch.Tensor, slots_N: torch.Tensor, x_N_: torch.Tensor) -> None:
    """Quantize rows x (the last dim) and copy them and their scales to the cache's slots (index_copy_ has no e4m3
    form on CPU: the bytes are copied)."""
    q, s = quantize_rows(x_N_)
    cache_S_.view(torch.uint8).index_copy_(0, slots_N, q.view(torch.uint8))
    scale_S_.index_copy_(0, slots_N, s)


def refusal(kv_cache_dtype: str, device) -> str | None:
    """Why this device cannot hold an fp8 cache (one line), or None. e4m3 conversions in the kernels need compute
    capability 8.9 (Ada, Hopper and newer); the CPU runs the plain-torch reference."""
    if kv_cache_dtype != "fp8":
        return None
    device = torch.device(device)
    if device.type == "cuda":
        cc = torch.cuda.get_device_capability(device)
        if cc < (8, 9):
            return (f"--kv-cache-dtype fp8: {torch.cuda.get_device_name(device)} (compute capability "
                    f"{cc[0]}.{cc[1]}) has no e4m3 support (8.9+: Ada, Hopper); leave out --kv-cache-dtype")
    return None
