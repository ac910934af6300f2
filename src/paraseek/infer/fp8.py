"""FP8 block-quantized projections: DeepSeek-V3's weight format kept in FP8, activations quantized on the fly.

The format (V3 technical report sec. 3.3.2, "fine-grained quantization"; models/hf.py reads and writes it): a weight
W [O, I] is float8 e4m3 values W_q with one fp32 scale per 128 x 128 block, s_w [ceil(O/128), ceil(I/128)] (the
checkpoints' `weight_scale_inv`), W = W_q * s_w blockwise. Activations are quantized per token in groups of 128
channels (1 x 128): s_x = amax / 448 (e4m3's largest finite value), x_q = x / s_x, as the report's (and DeepSeek-V3's
inference/kernel.py) act_quant does. The product is then

    y[t, n] = sum over channel groups g of  s_x[t, g] * s_w[n / 128, g] * (sum_{k in g} x_q[t, k] W_q[n, k]),

the 128-wide partial sums accumulated in fp32 and scaled once per group (the report's promotion to fp32 every 128
elements). Where it runs:
  - sm90 (H100, H200), bf16 activations: torch._scaled_mm with 1 x 128 activation scales and 128 x 128 weight
    scales (cuBLASLt's VEC128 x BLK128x128 scaling; cuBLASLt >= 12.9, as torch's own tests require, and sm90 only:
    on sm100 cuBLASLt has 1-D block scales alone, aten's ScaledBlas.cpp says). Layouts it takes (its
    is_blockwise_*_scaling): mat2 = W_q.t() (column-major), scale_a [N, G] "outer-dim-major" (stride (1, N)),
    scale_b [G, ceil(O/128)] with stride (1, L4), L4 = G rounded up to a multiple of 4 (16-byte aligned rows of
    the block scales); O a multiple of 16 and (here) I of 128. A small product against the reference decides at
    load whether this torch/cuBLASLt takes it (`gemm_backend`).
  - other GPUs with FP8 tensor cores (sm89 Ada, sm100/sm120 Blackwell, where cuBLASLt has no 2-D block scales),
    and sm90 shapes cuBLASLt refuses: the Triton kernel of fp8_kernels.py, the same sums.
  - CPU (tests): `block_mm_reference`, the same quantization of x and the product in fp32 from dequantized values.
GPUs without FP8 (V100, T4, A100) and CPU by default load FP8 checkpoints dequantized instead (infer/weights.py).

Shape legend: N tokens, I / K a linear's input channels, O output channels, G = ceil(I / 128) channel groups.
"""

from __future__ import annotations

import functools

import torch

from paraseek.infer.linear import Linear
from paraseek.models.hf import E4M3, E4M3_MAX, FP8_BLOCK, SCALE_FLOOR, dequantize_fp8, quantize_fp8  # noqa: F401

BLOCK = FP8_BLOCK[0]


def groups(n: int) -> int:
    return -(-n // BLOCK)


def has_fp8(device) -> bool:
    """FP8 tensor cores: CUDA compute capability 8.9 (Ada) and newer."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


# ---- activations ----------------------------------------------------------------------------------------------------
def quantize_1x128(x_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, per group of 128 channels: (x_q [N, K] e4m3, s_x [N, G] fp32) with x ~ x_q * s_x, s_x = amax / 448.
    s_x is laid out outer-dim-major (stride (1, N)), the layout torch._scaled_mm takes. On CUDA one Triton kernel;
    this plain-torch form is the reference (the kernel computes the same fp32 amax, division and rounding)."""
    if x_NK.is_cuda:
        from paraseek.infer import fp8_kernels

        return fp8_kernels.quantize_1x128(x_NK)
    N, K = x_NK.shape
    G = groups(K)
    x32 = x_NK.float()
    if G * BLOCK != K:  # a ragged last group: zeros do not change its amax
        x32 = torch.nn.functional.pad(x32, (0, G * BLOCK - K))
    x_NGB = x32.view(N, G, BLOCK)
    s_NG = x_NGB.abs().amax(dim=-1).clamp_min(SCALE_FLOOR) / E4M3_MAX
    q_NK = (x_NGB / s_NG[..., None]).view(N, G * BLOCK)[:, :K].to(E4M3)
    return q_NK, s_NG.t().contiguous().t()


def dequantize_1x128(q_NK: torch.Tensor, s_NG: torch.Tensor) -> torch.Tensor:
    """x_q * s_x in fp32 [N, K]."""
    return q_NK.float() * s_NG.repeat_interleave(BLOCK, dim=1)[:, :q_NK.shape[1]]


def block_mm_reference(xq_NK: torch.Tensor, xs_NG: torch.Tensor, wq_OK: torch.Tensor, ws_OG: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """y = dequantize(x) dequantize(W)^T in fp32, rounded once to out_dtype: the plain-torch form of the product."""
    return (dequantize_1x128(xq_NK, xs_NG) @ dequantize_fp8(wq_OK, ws_OG).t()).to(out_dtype)


# ---- the projection -------------------------------------------------------------------------------------------------
class Fp8Linear(Linear):
    """y = x W^T (+ b) with W held as e4m3 [O, I] and its 128 x 128 block scales [ceil(O/128), ceil(I/128)]: one tp
    rank's weight in DeepSeek-V3's format. The output has x's dtype; the bias is added after the product."""

    def __init__(self, q_OI: torch.Tensor, s_OG: torch.Tensor, b_O: torch.Tensor | None = None):
        super().__init__(q_OI, b_O)
        self.scale = s_OG
        O, I = q_OI.shape
        self.backend = gemm_backend(q_OI.device, O, I)
        if self.backend == "cublaslt":
            self.scale_b = _cublaslt_weight_scale(s_OG)

    def __call__(self, x_NI: torch.Tensor) -> torch.Tensor:
        xq_NI, xs_NG = quantize_1x128(x_NI)
        if self.backend == "cublaslt" and x_NI.dtype == torch.bfloat16:
            y_NO = torch._scaled_mm(xq_NI, self.w.t(), xs_NG, self.scale_b, out_dtype=x_NI.dtype)
        elif self.backend != "reference":  # Triton; also cuBLASLt's weights under fp16/fp32 activations
            from paraseek.infer import fp8_kernels

            y_NO = fp8_kernels.block_mm(xq_NI, xs_NG, self.w, self.scale, x_NI.dtype)
        else:
            y_NO = block_mm_reference(xq_NI, xs_NG, self.w, self.scale, x_NI.dtype)
        return y_NO if self.b is None else y_NO.add_(self.b)

    def nbytes(self) -> int:
        """Bytes a step reads: the e4m3 weight, its block scales (and the bias)."""
        return super().nbytes() + self.scale.numel() * self.scale.element_size()

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(self.w, self.scale).to(dtype)


def _cublaslt_weight_scale(s_OG: torch.Tensor) -> torch.Tensor:
    """The weight's block scales as torch._scaled_mm's scale_b for mat2 = W_q.t() [I, O]: [G, ceil(O/128)] with
    stride (1, L4), the rows of s_OG padded to L4 = G rounded up to 4 (cuBLASLt reads 16-byte aligned rows)."""
    Ob, G = s_OG.shape
    L4 = -(-G // 4) * 4
    padded = s_OG.new_zeros(Ob, L4)
    padded[:, :G] = s_OG
    return padded[:, :G].t()


def gemm_backend(device, O: int, I: int) -> str:
    """"cublaslt", "triton" or "reference" for an [O, I] FP8 weight on `device` (see the module docstring)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "reference"
    # Inner dims in whole scale groups (a ragged last group of K is the Triton kernel's to mask), outputs in 16s.
    if (torch.cuda.get_device_capability(device)[0] == 9 and O % 16 == 0 and I % BLOCK == 0
            and _scaled_mm_takes_blocks(device.index if device.index is not None else torch.cuda.current_device())):
        return "cublaslt"
    return "triton"


@functools.lru_cache(maxsize=None)
def _scaled_mm_takes_blocks(device_index: int) -> bool:
    """Does this torch + cuBLASLt run a blockwise-scaled torch._scaled_mm, and agree with the reference? (torch
    < 2.10, or cuBLASLt < 12.9, refuse these scales; a wrong layout would give wrong numbers, not an error.)"""
    dev = torch.device("cuda", device_index)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(20, 384, device=dev, generator=g, dtype=torch.bfloat16)
    w = torch.randn(272, 384, device=dev, generator=g) * 0.05
    wq, ws = quantize_fp8(w)
    xq, xs = quantize_1x128(x)
    try:
        got = torch._scaled_mm(xq, wq.t(), xs, _cublaslt_weight_scale(ws), out_dtype=torch.bfloat16).float()
    except (RuntimeError, TypeError):
        return False
    want = block_mm_reference(xq, xs, wq, ws, torch.float32)
    return bool(((got - want).norm() / want.norm()).item() < 1e-2)  # bf16 output: 2^-8 relative


def backend_line(device) -> str:
    """Which GEMM the FP8 projections of this device run, for the weights' log line."""
    device = torch.device(device)
    if device.type != "cuda":
        return "plain-torch reference GEMMs (CPU)"
    b = gemm_backend(device, BLOCK, BLOCK)
    return ("cuBLASLt blockwise-scaled GEMMs (torch._scaled_mm)" if b == "cublaslt"
            else "Triton block-FP8 GEMMs") + ", Triton block-FP8 fused MoE"
