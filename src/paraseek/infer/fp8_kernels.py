"""Triton kernels of infer/fp8.py: the per-token 1 x 128 activation quantization and the block-FP8 GEMM (same
contracts as the plain-torch forms there: `quantize_1x128`, `block_mm_reference`).

Both are CUDA-graph capturable (grids and outputs sized from shapes only). The GEMM runs under TRITON_INTERPRET=1
on CPU tensors (loads of float8 and tl.dot of float8 operands work in Triton 3.6's interpreter), which is how it is
tested without a GPU. The quantization kernel is tested on the GPU only: the interpreter's float32 -> float8e4nv
conversion rounds wrongly where the rounding carries into the exponent (31.76 becomes 16, not 32; Triton 3.6).

  quantize_1x128: one program per (token, group of 128 channels): amax in fp32, s = max(amax, floor) / 448,
    q = x / s rounded to e4m3 (round to nearest even, saturating), s stored [G, N] so that the returned [N, G]
    view is outer-dim-major as torch._scaled_mm reads it.
  block_mm: grid (row tiles, column tiles); each program steps over K by BLOCK_K (a divisor of 128, so a step
    never spans two scale groups), y += (x_q W_q^T over the step, fp32) * s_x[:, group] * s_w[column block, group],
    and writes y once in the output dtype -- DeepSeek-V3's w8a8 block GEMM (its inference/kernel.py fp8_gemm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paraseek.infer import kernels  # noqa: F401  (patches Triton's interpreter under TRITON_INTERPRET=1)
from paraseek.models.hf import E4M3, E4M3_MAX, FP8_BLOCK, SCALE_FLOOR  # not infer/fp8.py, which imports this module

BLOCK = FP8_BLOCK[0]


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, N, K, QMAX: tl.constexpr, FLOOR: tl.constexpr,
                     GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), axis=0), FLOOR) / QMAX
    tl.store(q_ptr + row * stride_q + offs, (x / s).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + g * N + row, s)


def quantize_1x128(x_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    N, K = x_NK.shape
    G = -(-K // BLOCK)
    q_NK = torch.empty((N, K), device=x_NK.device, dtype=E4M3)
    s_GN = torch.empty((G, N), device=x_NK.device, dtype=torch.float32)
    if N:
        x_NK = x_NK if x_NK.stride(-1) == 1 else x_NK.contiguous()
        _quantize_kernel[(N, G)](x_NK, q_NK, s_GN, x_NK.stride(0), q_NK.stride(0), N, K, QMAX=E4M3_MAX,
                                 FLOOR=SCALE_FLOOR, GROUP=BLOCK, num_warps=1)
    return q_NK, s_GN.t()


@triton.jit
def _block_mm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K,
                     stride_xm, stride_xsm, stride_xsg, stride_wn, stride_wsn, stride_wsg, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     GROUP: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # W [N, K] read as W^T tiles
    xs_rows = xs_ptr + offs_m * stride_xsm
    ws_rows = ws_ptr + (offs_n // GROUP) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x_mk = tl.load(x_rows, mask=mask_m[:, None], other=0.0)
            w_kn = tl.load(w_cols, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = offs_k < K - k0
            x_mk = tl.load(x_rows, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w_kn = tl.load(w_cols, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        g = k0 // GROUP
        xs_m = tl.load(xs_rows + g * stride_xsg, mask=mask_m, other=0.0)
        ws_n = tl.load(ws_rows + g * stride_wsg, mask=mask_n, other=0.0)
        acc += tl.dot(x_mk, w_kn) * xs_m[:, None] * ws_n[None, :]
        x_rows += BLOCK_K
        w_cols += BLOCK_K
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def block_config(M: int) -> dict:
    """Tiles by the row count (not tuned yet: a starting point). Decode (a few rows) is bound by reading W: narrow
    column tiles give more programs to spread the read over the SMs; prefill takes wider tiles."""
    block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
    return dict(BLOCK_M=block_m, BLOCK_N=64 if M <= 64 else 128, BLOCK_K=BLOCK, num_warps=4, num_stages=3)


def block_mm(xq_MK: torch.Tensor, xs_MG: torch.Tensor, wq_NK: torch.Tensor, ws_NG: torch.Tensor,
             out_dtype: torch.dtype, config: dict | None = None) -> torch.Tensor:
    M, K = xq_MK.shape
    N = wq_NK.shape[0]
    y_MN = torch.empty((M, N), device=xq_MK.device, dtype=out_dtype)
    if M == 0:
        return y_MN
    cfg = config or block_config(M)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if BLOCK % bk:
        raise ValueError(f"block_mm: BLOCK_K={bk} must divide the scale group of {BLOCK}")
    xq_MK = xq_MK if xq_MK.stride(-1) == 1 else xq_MK.contiguous()
    wq_NK = wq_NK if wq_NK.stride(-1) == 1 else wq_NK.contiguous()
    _block_mm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        xq_MK, xs_MG, wq_NK, ws_NG, y_MN, M, N, K, xq_MK.stride(0), xs_MG.stride(0), xs_MG.stride(1),
        wq_NK.stride(0), ws_NG.stride(0), ws_NG.stride(1), y_MN.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        EVEN_K=K % bk == 0, GROUP=BLOCK, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y_MN
