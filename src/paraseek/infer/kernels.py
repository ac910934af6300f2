"""Triton kernels for the hot-path ops of `ops.py`: same names, same arguments, same semantics and output dtypes as
the plain-torch reference there (shape legend in ops.py's docstring). `ops.use_kernels(True)` routes to these.

Every function is CUDA-graph capturable: no host syncs, grids and workspaces sized from tensor shapes only, and no
autotuning (each config is a fixed function of the shapes). All of them also run under TRITON_INTERPRET=1 on CPU
tensors in fp32, which is how they are tested without a GPU.

Norms, SwiGLU, RoPE: one program per row (per token, and per tile of heads for RoPE); fp32 math, one rounding at
the end, except where the reference rounds in between on purpose (RMSNorm rounds the normalized x to x's dtype
before the weight, add_rms_norm rounds the residual sum to the residual's dtype).

Paged decode attention (one query token per sequence) is flash-decoding (Dao, Haziza, Massa, Sizov 2023: split the
KV sequence, attend to each split in parallel, combine the partial results by their log-sum-exp), each split with
the online softmax (Milakov & Gimelshein 2018: a running max and sum, rescaling the accumulator when the max grows).

  Layouts. q_BHD / q_lat_BHC / q_pe_BHR may be strided views (last dim contiguous). K/V caches k_SGD, v_SGD
  ([S, G, D]) and the MLA cache c_SX ([S, C + R]: latent, then rope key) hold token i of sequence b at slot
  block_tables_BM[b, i // block_size] * block_size + i % block_size. Each program computes its tokens' slots from
  the block table, one token at a time, so any block_size works, also one smaller than the token tile.

  Programs. Grid (B, head tiles, partitions). A GQA program takes ALL the query heads of one kv head (the group,
  padded to 16 rows for tl.dot), so each K/V row is read once per group; an MLA program takes 16 query heads, or
  64 from H=64 on (its one kv head is shared by all), so the latent is read once per 16 (64) heads. Scores and the
  softmax run in fp32 with exp2 (log2(e) folded into the scale); P is rounded to the cache's dtype for the P.V
  product, as in flash attention. A partition writes its normalized partial output and its log2-sum-exp to an
  fp32 workspace [B, H, partitions, D]; a second kernel, one program per (sequence, head), combines them.

  Partitions. Sequence b is cut into partitions of L_b = PARTITION * cdiv(ctx_b, PARTITION * MAX_PARTITIONS)
  tokens: exactly PARTITION (256) tokens up to MAX_PARTITIONS (64) * 256 = 16K tokens of context, longer beyond.
  The grid holds min(MAX_PARTITIONS, cdiv(M * block_size, PARTITION)) partitions, from shapes only; a program whose
  partition starts at or beyond ctx_b returns before loading anything, and the combine reads only the valid ones.
  Why 256: a decode step is bound by reading K/V, and the GPU (132 SMs on an H200) needs several programs per SM to
  keep enough loads in flight. At small batch the only parallelism is along the context, so partitions must be
  short; but each partition also writes and re-reads a partial (heads x D x 4 B, twice), which must stay small
  next to its K/V read (256 tokens x D x 2 B x 2 for GQA in bf16: 128 KB at D=128 against 4 KB of partials for a
  group of 4 heads; 295 KB of MLA cache against 64 KB for 16 heads of C=512). 256 tokens makes 16 programs per
  kv head at 4K context and keeps the partials near 3% (GQA) to 20% (MLA) of the traffic. The cap bounds the
  workspace (B x H x 64 x D x 4 B) whatever the block tables' capacity. L_b depends on ctx_b and constants alone,
  never on B or M, so a sequence's result does not depend on the batch it runs in (batch invariance). When the
  grid has a single partition (capacity <= 256 tokens) the attention kernel writes the output directly.

  Measured on one H200 (bf16, CUDA-graph replays, block tables of 32K tokens' capacity, K/V bytes read per second):
  GQA H=32 G=8 D=128: 3.5 TB/s at B=32 x 4K context (154 us), 2.4 TB/s at B=1 x 32K (55 us), 20 us at B=1 x 4K;
  MLA C=512 R=64 H=16: 2.2 TB/s at B=128 x 2K (137 us), 1.9 TB/s at B=32 x 4K, 32 us at B=1 x 4K; H=128 reads the
  cache twice per 128 heads and runs at 0.45 TB/s of distinct cache bytes (B=64 x 2K, 334 us). Partitions of 512
  were 4-9% faster at large batch but 1.3x (GQA) and 1.5x (MLA) slower at B=1 x 4K; partitions of 128 were 3-17%
  slower at large batch and faster only for MLA at B=1 x 4K (25 us): 256 is the compromise.

  FP8 caches (infer/kv_fp8.py: e4m3 rows, one fp32 scale each; KV_FP8=True): the same programs load e4m3 tiles,
  widen them exactly to q's dtype in registers, and fold each row's scale into its scores (q.(k_q s) = s (q.k_q))
  and into P for the P.V product (sum_t p_t s_t v_q,t; the running sum l stays unscaled), so nothing is dequantized
  in memory; tiles are sized as for a cache in q's dtype. The write kernels (rope_write_kv_, mla_prepare_) quantize
  each row as kv_fp8.quantize_rows does, with IEEE division (tl.math.div_rn).

  Short contexts (at most SHORT_CONTEXT = 512 tokens) use partitions of SHORT_PARTITION = 64 tokens instead,
  still a function of ctx alone, for GQA and MLA alike (MLA at batch 1 over 128 + 256 tokens: two 256-token
  partitions took 22 us a layer on DeepSeek-V2-Lite's shape, one program per partition). Measured on the 8B shape (32 layers, H=32 G=8 D=128), CUDA-graph replays
  (scripts/gpu/decode_profile.py, 2026-12-01): batch 1 at 128 + 256 tokens 4.67 -> 4.52 ms per step (the kernel
  9.3 us a layer at 256-token partitions: 16 programs, latency-bound); batch 256 at 256 + 256 tokens 11.8 -> 12.9
  ms (+9%: partials and the combine pass for contexts that were one partition). Partitions of 128 gave 4.57 and
  12.1 ms. They serve batch-1 latency; long contexts are unchanged.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from paraseek.infer import kv_fp8


def _interpreter_numpy_compat() -> None:
    """Triton 3.6's interpreter holds every scalar as a NumPy array of shape (1,) and makes Python ints of them with
    int(array), which NumPy 2.4 turned into a TypeError: any `range` with a runtime bound fails. Convert the one
    element explicitly instead. Only under TRITON_INTERPRET=1 (the CPU test path); a no-op if the internals moved."""
    try:
        from triton.runtime import interpreter
        patch_tensor = interpreter._patch_lang_tensor
    except (ImportError, AttributeError):
        return
    if getattr(patch_tensor, "_int_of_one_element", False):
        return

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._int_of_one_element = True
    interpreter._patch_lang_tensor = patched


def _interpreter_e4m3_rounding() -> None:
    """Triton 3.6's interpreter rounds fp32 -> e4m3 half up and drops the carry into the exponent (127.9 -> 64,
    100 -> 104, 1000 -> 256); the GPU's cvt.rn.satfinite rounds to nearest even and saturates at 448, as torch's
    conversion does. Convert fp32 -> e4m3 with torch instead. Only under TRITON_INTERPRET=1 (the CPU test path)."""
    try:
        from triton.runtime import interpreter
        convert = interpreter._convert_float
    except (ImportError, AttributeError):
        return
    if getattr(convert, "_e4m3_by_torch", False):
        return

    def patched(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype == tl.float32:
            import numpy as np

            x = torch.from_numpy(np.ascontiguousarray(input, dtype=np.float32))
            return x.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return convert(input, input_dtype, output_dtype, rounding_mode)

    patched._e4m3_by_torch = True
    interpreter._convert_float = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_numpy_compat()
    _interpreter_e4m3_rounding()

# The FP8 KV cache's quantization constants (infer/kv_fp8.py), as compile-time constants of the write kernels.
KV_SCALE_FLOOR = tl.constexpr(kv_fp8.SCALE_FLOOR)
KV_E4M3_MAX = tl.constexpr(kv_fp8.E4M3_MAX)

# Paged-decode partitioning (see the module docstring for why these values).
PARTITION = 256  # tokens per partition up to MAX_PARTITIONS * PARTITION tokens of context
MAX_PARTITIONS = 64  # bounds the grid, the fp32 workspace and the combine's loop
# Contexts (GQA and MLA) of at most SHORT_CONTEXT tokens are cut into partitions of SHORT_PARTITION instead (0: off): at
# batch 1 a 384-token context in 256-token partitions is 16 programs for 132 SMs, bound by latency, not by HBM.
SHORT_PARTITION = 64
SHORT_CONTEXT = 512


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A [rows, last] view of t (no copy: the in-place ops must write t itself)."""
    return t if t.dim() == 2 else t.view(-1, t.shape[-1])


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 operands would default to tf32 on the GPU (10-bit mantissa): the fp32 contract wants full precision.
    return "ieee" if dtype == torch.float32 else "tf32"


# ---- norms and activations -----------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, stride_x, stride_res, stride_y, E, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_E: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: rows x stride may pass 2^31 elements in a long prefill
    offs_E = tl.arange(0, BLOCK_E)
    mask_E = offs_E < E
    x_E = tl.load(x_ptr + row * stride_x + offs_E, mask=mask_E, other=0.0)
    if HAS_RESIDUAL:
        # residual += x, rounded to the residual's dtype as the reference's add_ does; the same thread loads and
        # stores each element, so the in-place update is race-free.
        r_E = tl.load(res_ptr + row * stride_res + offs_E, mask=mask_E, other=0.0)
        x_E = (r_E.to(tl.float32) + x_E.to(tl.float32)).to(r_E.dtype)
        tl.store(res_ptr + row * stride_res + offs_E, x_E, mask=mask_E)
    x32_E = x_E.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32_E * x32_E, axis=0) / E + eps)
    # The reference rounds the normalized row to x's dtype before the weight: keep that rounding.
    n_E = (x32_E * rstd).to(x_E.dtype).to(tl.float32)
    w_E = tl.load(w_ptr + offs_E, mask=mask_E, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs_E, (w_E * n_E).to(y_ptr.dtype.element_ty), mask=mask_E)


def _norm_warps(block: int) -> int:
    # About 16-32 elements a thread: enough bytes in flight per thread without spilling.
    return 4 if block <= 2048 else (8 if block <= 8192 else 16)


def _rms_norm_launch(x_NE: torch.Tensor, residual_NE: torch.Tensor | None, w_E: torch.Tensor,
                     eps: float) -> torch.Tensor:
    E = x_NE.shape[-1]
    x2 = _rows(x_NE if x_NE.stride(-1) == 1 else x_NE.contiguous())
    if residual_NE is not None:
        if residual_NE.stride(-1) != 1:
            raise ValueError("add_rms_norm: the residual must have a contiguous last dim (it is updated in place)")
        r2 = _rows(residual_NE)
        out_dtype = torch.promote_types(w_E.dtype, residual_NE.dtype)
    else:
        r2 = x2  # unused (HAS_RESIDUAL=False)
        out_dtype = torch.promote_types(w_E.dtype, x_NE.dtype)
    w_E = w_E if w_E.stride(0) == 1 else w_E.contiguous()
    y2 = torch.empty(x2.shape, device=x_NE.device, dtype=out_dtype)
    if x2.shape[0] > 0:
        block = _pow2(E)
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, w_E, y2, x2.stride(0), r2.stride(0), y2.stride(0), E, eps,
                                          HAS_RESIDUAL=residual_NE is not None, BLOCK_E=block,
                                          num_warps=_norm_warps(block))
    return y2.view(x_NE.shape)


def rms_norm(x_NE: torch.Tensor, w_E: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm_launch(x_NE, None, w_E, eps)


def add_rms_norm(x_NE: torch.Tensor, residual_NE: torch.Tensor, w_E: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm_launch(x_NE, residual_NE, w_E, eps)


@triton.jit
def _silu_mul_kernel(gu_ptr, h_ptr, stride_gu, stride_h, F, BLOCK_F: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_F = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask_F = offs_F < F
    g_F = tl.load(gu_ptr + row * stride_gu + offs_F, mask=mask_F, other=0.0).to(tl.float32)
    u_F = tl.load(gu_ptr + row * stride_gu + F + offs_F, mask=mask_F, other=0.0).to(tl.float32)
    h_F = g_F * tl.sigmoid(g_F) * u_F  # one rounding (the reference rounds silu(gate) first)
    tl.store(h_ptr + row * stride_h + offs_F, h_F.to(h_ptr.dtype.element_ty), mask=mask_F)


def silu_mul(gu_N2F: torch.Tensor) -> torch.Tensor:
    F2 = gu_N2F.shape[-1]
    if F2 % 2:
        raise ValueError(f"silu_mul: the last dim ({F2}) must be even ([gate | up])")
    F = F2 // 2
    gu2 = _rows(gu_N2F if gu_N2F.stride(-1) == 1 else gu_N2F.contiguous())
    h2 = torch.empty((gu2.shape[0], F), device=gu_N2F.device, dtype=gu_N2F.dtype)
    if gu2.shape[0] > 0 and F > 0:
        block = min(_pow2(F), 1024)
        _silu_mul_kernel[(gu2.shape[0], triton.cdiv(F, block))](gu2, h2, gu2.stride(0), h2.stride(0), F,
                                                                BLOCK_F=block, num_warps=4)
    return h2.view(*gu_N2F.shape[:-1], F)


# ---- RoPE -----------------------------------------------------------------------------------------------------------
@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, stride_xn, stride_xh, stride_cp, stride_sp, H, HALF,
                 INTERLEAVE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs_H = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_J = tl.arange(0, BLOCK_HALF)  # pair index j < R/2, padded to a power of two
    mask_J = offs_J < HALF
    mask_HJ = (offs_H < H)[:, None] & mask_J[None, :]

    pos = tl.load(pos_ptr + n).to(tl.int64)
    cos_J = tl.load(cos_ptr + pos * stride_cp + offs_J, mask=mask_J, other=0.0).to(tl.float32)
    sin_J = tl.load(sin_ptr + pos * stride_sp + offs_J, mask=mask_J, other=0.0).to(tl.float32)

    row_H = x_ptr + n * stride_xn + offs_H.to(tl.int64) * stride_xh
    if INTERLEAVE:
        x1_off = 2 * offs_J
        x2_off = 2 * offs_J + 1
    else:
        x1_off = offs_J
        x2_off = offs_J + HALF
    x1_HJ = tl.load(row_H[:, None] + x1_off[None, :], mask=mask_HJ, other=0.0).to(tl.float32)
    x2_HJ = tl.load(row_H[:, None] + x2_off[None, :], mask=mask_HJ, other=0.0).to(tl.float32)
    o1_HJ = x1_HJ * cos_J[None, :] - x2_HJ * sin_J[None, :]
    o2_HJ = x2_HJ * cos_J[None, :] + x1_HJ * sin_J[None, :]
    # In place: the outputs go to the half-split positions, which (interleaved) are not the positions this thread
    # loaded. The barrier makes every load of this program complete before any store; heads never straddle programs.
    tl.debug_barrier()
    tl.store(row_H[:, None] + offs_J[None, :], o1_HJ.to(x_ptr.dtype.element_ty), mask=mask_HJ)
    tl.store(row_H[:, None] + (offs_J + HALF)[None, :], o2_HJ.to(x_ptr.dtype.element_ty), mask=mask_HJ)


def rope_(x_NHR: torch.Tensor, cos_PR: torch.Tensor, sin_PR: torch.Tensor, positions_N: torch.Tensor,
          interleave: bool) -> None:
    N, H, R = x_NHR.shape
    if R % 2:
        raise ValueError(f"rope_: the rope dim ({R}) must be even")
    if x_NHR.stride(-1) != 1:
        raise ValueError("rope_: x must have a contiguous last dim (it is rotated in place)")
    if N == 0 or H == 0 or R == 0:
        return None
    cos_PR = cos_PR if cos_PR.stride(-1) == 1 else cos_PR.contiguous()
    sin_PR = sin_PR if sin_PR.stride(-1) == 1 else sin_PR.contiguous()
    half = R // 2
    block_half = _pow2(half)
    block_h = min(_pow2(H), max(1, 2048 // block_half))  # up to 2048 pairs a program
    rope_warps = 4 if block_h * block_half >= 1024 else (2 if block_h * block_half >= 256 else 1)
    _rope_kernel[(N, triton.cdiv(H, block_h))](
        x_NHR, cos_PR, sin_PR, positions_N, x_NHR.stride(0), x_NHR.stride(1), cos_PR.stride(0), sin_PR.stride(0),
        H, half, INTERLEAVE=bool(interleave), BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=rope_warps)
    return None


@triton.jit
def _rope_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, kv_ptr, scale_ptr, stride_n, stride_cp,
                          stride_sp, stride_ks, stride_k2, stride_kg, stride_ss, stride_s2, H, G, HALF,
                          KV_FP8: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # Heads of one token: [0, H) queries, [H, H + G) keys, [H + G, H + 2G) values, each D = 2 * HALF wide.
    # Queries and keys are rotated (half-split) and stored back; keys and values also go to the token's cache slot.
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    mask_j = j < HALF
    valid = (h < H + 2 * G)[:, None] & mask_j[None, :]
    rotate = (h < H + G)[:, None]
    pos = tl.load(pos_ptr + n).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cp + j, mask=mask_j, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_sp + j, mask=mask_j, other=0.0).to(tl.float32)[None, :]
    row = qkv_ptr + n * stride_n + h.to(tl.int64)[:, None] * (2 * HALF)
    x1 = tl.load(row + j[None, :], mask=valid, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + j[None, :], mask=valid, other=0.0).to(tl.float32)
    o1 = tl.where(rotate, x1 * cos - x2 * sin, x1).to(qkv_ptr.dtype.element_ty)
    o2 = tl.where(rotate, x2 * cos + x1 * sin, x2).to(qkv_ptr.dtype.element_ty)
    tl.debug_barrier()  # every load of this program before any in-place store
    tl.store(row + j[None, :], o1, mask=valid & rotate)
    tl.store(row + HALF + j[None, :], o2, mask=valid & rotate)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    is_v = h >= H + G
    g = tl.where(is_v, h - H - G, h - H).to(tl.int64)
    kv_half = tl.where(is_v, 1, 0).to(tl.int64)
    dst = kv_ptr + slot * stride_ks + kv_half[:, None] * stride_k2 + g[:, None] * stride_kg
    to_cache = valid & (h >= H)[:, None]
    if KV_FP8:
        # Each cache head's row (its D values, in the projection's dtype) quantized with one scale, as
        # kv_fp8.quantize_rows: s = max(amax, floor) / 448, x / s rounded to e4m3 (div_rn: IEEE division, as
        # torch's; Triton's `/` is approximate in fp32).
        a1 = o1.to(tl.float32)
        a2 = o2.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(a1), axis=1), tl.max(tl.abs(a2), axis=1))
        s_h = tl.math.div_rn(tl.maximum(amax, KV_SCALE_FLOOR), tl.full([BLOCK_H], KV_E4M3_MAX, tl.float32))
        s_hj = tl.broadcast_to(s_h[:, None], (BLOCK_H, BLOCK_HALF))
        tl.store(dst + j[None, :], tl.math.div_rn(a1, s_hj).to(kv_ptr.dtype.element_ty), mask=to_cache)
        tl.store(dst + HALF + j[None, :], tl.math.div_rn(a2, s_hj).to(kv_ptr.dtype.element_ty), mask=to_cache)
        tl.store(scale_ptr + slot * stride_ss + kv_half * stride_s2 + g, s_h, mask=(h >= H) & (h < H + 2 * G))
    else:
        tl.store(dst + j[None, :], o1.to(kv_ptr.dtype.element_ty), mask=to_cache)
        tl.store(dst + HALF + j[None, :], o2.to(kv_ptr.dtype.element_ty), mask=to_cache)


def rope_write_kv_(qkv_NX: torch.Tensor, n_heads: int, n_kv_heads: int, cos_PR: torch.Tensor, sin_PR: torch.Tensor,
                   positions_N: torch.Tensor, slots_N: torch.Tensor, kv_S2GD: torch.Tensor,
                   kv_scale_S2G: torch.Tensor | None = None) -> None:
    N, X = qkv_NX.shape
    H, G = n_heads, n_kv_heads
    D = X // (H + 2 * G)
    if qkv_NX.stride(-1) != 1 or D % 2 or kv_S2GD.stride(-1) != 1:
        raise ValueError("rope_write_kv_: the projection and the cache need a contiguous last dim, D even")
    fp8 = kv_scale_S2G is not None
    if fp8 and kv_scale_S2G.stride(-1) != 1:
        raise ValueError("rope_write_kv_: the scales need a contiguous last dim")
    if N == 0:
        return None
    cos_PR = cos_PR if cos_PR.stride(-1) == 1 else cos_PR.contiguous()
    sin_PR = sin_PR if sin_PR.stride(-1) == 1 else sin_PR.contiguous()
    half = D // 2
    block_half = _pow2(half)
    block_h = min(_pow2(H + 2 * G), max(1, 2048 // block_half))
    warps = 4 if block_h * block_half >= 1024 else (2 if block_h * block_half >= 256 else 1)
    scale = kv_scale_S2G if fp8 else kv_S2GD  # unused without fp8
    _rope_write_kv_kernel[(N, triton.cdiv(H + 2 * G, block_h))](
        qkv_NX, cos_PR, sin_PR, positions_N, slots_N, kv_S2GD, scale, qkv_NX.stride(0), cos_PR.stride(0),
        sin_PR.stride(0), kv_S2GD.stride(0), kv_S2GD.stride(1), kv_S2GD.stride(2),
        scale.stride(0) if fp8 else 0, scale.stride(1) if fp8 else 0, H, G, half,
        KV_FP8=fp8, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=warps)
    return None


@triton.jit
def _mla_prepare_kernel(q_ptr, kva_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, c_ptr, scale_ptr,
                        stride_qn, stride_qh, stride_kn, stride_cp, stride_sp, stride_cs, H, C, HALF, eps,
                        INTERLEAVE: tl.constexpr, KV_FP8: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_HALF: tl.constexpr):
    # One token: its latent normalized (as _rms_norm_kernel: fp32, rounded to the input's dtype, then the weight),
    # its rope key and all H query rope parts rotated (as _rope_kernel), the cache row written.
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    offs_C = tl.arange(0, BLOCK_C)
    mask_C = offs_C < C
    x_C = tl.load(kva_ptr + n * stride_kn + offs_C, mask=mask_C, other=0.0)
    x32_C = x_C.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32_C * x32_C, axis=0) / C + eps)
    w_C = tl.load(w_ptr + offs_C, mask=mask_C, other=0.0).to(tl.float32)
    lat_C = w_C * (x32_C * rstd).to(x_C.dtype).to(tl.float32)
    if not KV_FP8:
        tl.store(c_ptr + slot * stride_cs + offs_C, lat_C.to(c_ptr.dtype.element_ty), mask=mask_C)

    pos = tl.load(pos_ptr + n).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    mask_j = j < HALF
    cos_J = tl.load(cos_ptr + pos * stride_cp + j, mask=mask_j, other=0.0).to(tl.float32)
    sin_J = tl.load(sin_ptr + pos * stride_sp + j, mask=mask_j, other=0.0).to(tl.float32)
    if INTERLEAVE:
        x1_off = 2 * j
        x2_off = 2 * j + 1
    else:
        x1_off = j
        x2_off = j + HALF
    # The rope key: read from kv_a, written to the cache in half-split order (kv_a itself is not needed after).
    k_row = kva_ptr + n * stride_kn + C
    k1 = tl.load(k_row + x1_off, mask=mask_j, other=0.0).to(tl.float32)
    k2 = tl.load(k_row + x2_off, mask=mask_j, other=0.0).to(tl.float32)
    c_row = c_ptr + slot * stride_cs + C
    if KV_FP8:
        # The row [latent | rope key] rounded to kv_a's dtype (the values a cache in the model's dtype would hold),
        # then quantized with one scale, as kv_fp8.quantize_rows (IEEE division, as torch's).
        lat_C = lat_C.to(x_C.dtype).to(tl.float32)
        r1 = (k1 * cos_J - k2 * sin_J).to(x_C.dtype).to(tl.float32)
        r2 = (k2 * cos_J + k1 * sin_J).to(x_C.dtype).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(lat_C), axis=0), tl.maximum(tl.max(tl.abs(r1), axis=0),
                                                                   tl.max(tl.abs(r2), axis=0)))
        s = tl.math.div_rn(tl.maximum(amax, KV_SCALE_FLOOR), KV_E4M3_MAX)
        s_C = s + tl.zeros([BLOCK_C], tl.float32)
        s_J = s + tl.zeros([BLOCK_HALF], tl.float32)
        tl.store(c_ptr + slot * stride_cs + offs_C, tl.math.div_rn(lat_C, s_C).to(c_ptr.dtype.element_ty),
                 mask=mask_C)
        tl.store(c_row + j, tl.math.div_rn(r1, s_J).to(c_ptr.dtype.element_ty), mask=mask_j)
        tl.store(c_row + HALF + j, tl.math.div_rn(r2, s_J).to(c_ptr.dtype.element_ty), mask=mask_j)
        tl.store(scale_ptr + slot, s)
    else:
        tl.store(c_row + j, (k1 * cos_J - k2 * sin_J).to(c_ptr.dtype.element_ty), mask=mask_j)
        tl.store(c_row + HALF + j, (k2 * cos_J + k1 * sin_J).to(c_ptr.dtype.element_ty), mask=mask_j)

    # The queries' rope parts, in place, in tiles of heads.
    for h0 in range(0, H, BLOCK_H):
        offs_H = h0 + tl.arange(0, BLOCK_H)
        mask_HJ = (offs_H < H)[:, None] & mask_j[None, :]
        row_H = q_ptr + n * stride_qn + offs_H.to(tl.int64) * stride_qh
        x1 = tl.load(row_H[:, None] + x1_off[None, :], mask=mask_HJ, other=0.0).to(tl.float32)
        x2 = tl.load(row_H[:, None] + x2_off[None, :], mask=mask_HJ, other=0.0).to(tl.float32)
        o1 = x1 * cos_J[None, :] - x2 * sin_J[None, :]
        o2 = x2 * cos_J[None, :] + x1 * sin_J[None, :]
        tl.debug_barrier()  # every load of this tile before its in-place stores
        tl.store(row_H[:, None] + j[None, :], o1.to(q_ptr.dtype.element_ty), mask=mask_HJ)
        tl.store(row_H[:, None] + (j + HALF)[None, :], o2.to(q_ptr.dtype.element_ty), mask=mask_HJ)


def mla_prepare_(q_pe_NHR: torch.Tensor, kv_a_NX: torch.Tensor, w_C: torch.Tensor, eps: float, cos_PR: torch.Tensor,
                 sin_PR: torch.Tensor, positions_N: torch.Tensor, slots_N: torch.Tensor, c_SX: torch.Tensor,
                 interleave: bool, c_scale_S: torch.Tensor | None = None) -> None:
    N, H, R = q_pe_NHR.shape
    C = w_C.shape[0]
    if R % 2 or q_pe_NHR.stride(-1) != 1 or kv_a_NX.stride(-1) != 1 or c_SX.stride(-1) != 1:
        raise ValueError("mla_prepare_: q_pe, kv_a and the cache need a contiguous last dim, the rope dim even")
    if kv_a_NX.shape[1] != C + R or c_SX.shape[1] != C + R:
        raise ValueError(f"mla_prepare_: kv_a and the cache rows must be C + R = {C + R} wide")
    if N == 0:
        return None
    cos_PR = cos_PR if cos_PR.stride(-1) == 1 else cos_PR.contiguous()
    sin_PR = sin_PR if sin_PR.stride(-1) == 1 else sin_PR.contiguous()
    w_C = w_C if w_C.stride(0) == 1 else w_C.contiguous()
    half = R // 2
    block_half = _pow2(half)
    block_h = min(_pow2(H), max(1, 2048 // block_half))
    fp8 = c_scale_S is not None
    if fp8 and c_scale_S.stride(0) != 1:
        raise ValueError("mla_prepare_: the scales must be contiguous")
    _mla_prepare_kernel[(N,)](
        q_pe_NHR, kv_a_NX, w_C, cos_PR, sin_PR, positions_N, slots_N, c_SX, c_scale_S if fp8 else c_SX,
        q_pe_NHR.stride(0), q_pe_NHR.stride(1), kv_a_NX.stride(0), cos_PR.stride(0), sin_PR.stride(0), c_SX.stride(0),
        H, C, half, eps, INTERLEAVE=bool(interleave), KV_FP8=fp8, BLOCK_C=_pow2(C), BLOCK_H=block_h,
        BLOCK_HALF=block_half, num_warps=4)
    return None


# ---- paged decode attention ------------------------------------------------------------------------------------------
@triton.jit
def _partition_len(ctx, PARTITION: tl.constexpr, MAX_PARTITIONS: tl.constexpr, SHORT_PARTITION: tl.constexpr,
                   SHORT_CONTEXT: tl.constexpr):
    # PARTITION tokens up to MAX_PARTITIONS * PARTITION of context, then the smallest multiple of PARTITION that
    # keeps the count at MAX_PARTITIONS. A function of ctx and constants only: the attention and combine kernels
    # agree on it, and it does not depend on the batch.
    return tl.where(ctx <= SHORT_CONTEXT, SHORT_PARTITION, PARTITION * tl.cdiv(ctx, PARTITION * MAX_PARTITIONS))


@triton.jit
def _gqa_partition_kernel(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, ctx_ptr, o_ptr, lse_ptr,
        stride_qb, stride_qh, stride_ks, stride_kg, stride_vs, stride_vg, stride_kss, stride_vss, stride_btb,
        stride_ob, stride_oh, stride_op, stride_lb, stride_lh,
        qk_scale, QH, D,
        HEAD_TILES: tl.constexpr, BLOCK_SIZE: tl.constexpr, PARTITION: tl.constexpr, MAX_PARTITIONS: tl.constexpr,
        SHORT_PARTITION: tl.constexpr, SHORT_CONTEXT: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        DIRECT: tl.constexpr, DOT_PREC: tl.constexpr, KV_FP8: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1) // HEAD_TILES  # kv head
    tile = tl.program_id(1) % HEAD_TILES  # tile of its query heads (one tile unless the group exceeds BLOCK_QH)
    part = tl.program_id(2)

    ctx = tl.load(ctx_ptr + b)
    part_len = _partition_len(ctx, PARTITION, MAX_PARTITIONS, SHORT_PARTITION, SHORT_CONTEXT)
    start = part * part_len
    if start >= ctx:  # the grid covers the block tables' capacity; this partition is past the context
        return
    end = tl.minimum(start + part_len, ctx)

    offs_i = tile * BLOCK_QH + tl.arange(0, BLOCK_QH)  # index in the group
    mask_i = offs_i < QH
    offs_h = g * QH + offs_i  # query head
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q_hd = tl.load(q_ptr + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
                   mask=mask_i[:, None] & mask_d[None, :], other=0.0)

    m_h = tl.full([BLOCK_QH], float("-inf"), tl.float32)  # running max of the log2-scaled scores
    l_h = tl.zeros([BLOCK_QH], tl.float32)  # running sum of exp2(score - max)
    acc_hd = tl.zeros([BLOCK_QH, BLOCK_D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    k_base = k_ptr + g.to(tl.int64) * stride_kg
    v_base = v_ptr + g.to(tl.int64) * stride_vg
    for n0 in range(start, end, BLOCK_N):  # start is a multiple of BLOCK_N: every tile holds >= 1 valid token
        offs_t = n0 + tl.arange(0, BLOCK_N)
        mask_t = offs_t < end
        block_t = tl.load(bt_row + offs_t // BLOCK_SIZE, mask=mask_t, other=0)
        slot_t = block_t.to(tl.int64) * BLOCK_SIZE + offs_t % BLOCK_SIZE
        mask_td = mask_t[:, None] & mask_d[None, :]
        k_td = tl.load(k_base + slot_t[:, None] * stride_ks + offs_d[None, :], mask=mask_td, other=0.0)
        if KV_FP8:
            # e4m3 widens exactly to q's dtype; the row's scale multiplies its score (q.(k_q s) = s (q.k_q)).
            ks_t = tl.load(ks_ptr + slot_t * stride_kss + g, mask=mask_t, other=0.0)
            s_ht = tl.dot(q_hd, tl.trans(k_td.to(q_hd.dtype)), input_precision=DOT_PREC) * (ks_t * qk_scale)[None, :]
        else:
            s_ht = tl.dot(q_hd, tl.trans(k_td), input_precision=DOT_PREC) * qk_scale
        s_ht = tl.where(mask_t[None, :], s_ht, float("-inf"))
        m_new_h = tl.maximum(m_h, tl.max(s_ht, axis=1))
        alpha_h = tl.exp2(m_h - m_new_h)
        p_ht = tl.exp2(s_ht - m_new_h[:, None])
        l_h = l_h * alpha_h + tl.sum(p_ht, axis=1)
        v_td = tl.load(v_base + slot_t[:, None] * stride_vs + offs_d[None, :], mask=mask_td, other=0.0)
        if KV_FP8:
            # sum_t p_t (v_q,t s_t) = sum_t (p_t s_t) v_q,t: the value scales go into P (rounded to q's dtype, as P is).
            vs_t = tl.load(vs_ptr + slot_t * stride_vss + g, mask=mask_t, other=0.0)
            pv_hd = tl.dot((p_ht * vs_t[None, :]).to(q_hd.dtype), v_td.to(q_hd.dtype), input_precision=DOT_PREC)
        else:
            pv_hd = tl.dot(p_ht.to(v_td.dtype), v_td, input_precision=DOT_PREC)
        acc_hd = acc_hd * alpha_h[:, None] + pv_hd
        m_h = m_new_h

    o_hd = acc_hd / l_h[:, None]
    mask_hd = mask_i[:, None] & mask_d[None, :]
    o_row = o_ptr + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :]
    if DIRECT:
        tl.store(o_row, o_hd.to(o_ptr.dtype.element_ty), mask=mask_hd)
    else:
        tl.store(o_row + part * stride_op, o_hd, mask=mask_hd)
        tl.store(lse_ptr + b.to(tl.int64) * stride_lb + offs_h * stride_lh + part, m_h + tl.log2(l_h), mask=mask_i)


@triton.jit
def _mla_partition_kernel(
        ql_ptr, qp_ptr, c_ptr, cs_ptr, bt_ptr, ctx_ptr, o_ptr, lse_ptr,
        stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_cs, stride_btb,
        stride_ob, stride_oh, stride_op, stride_lb, stride_lh,
        qk_scale, H, C, R,
        BLOCK_SIZE: tl.constexpr, PARTITION: tl.constexpr, MAX_PARTITIONS: tl.constexpr,
        SHORT_PARTITION: tl.constexpr, SHORT_CONTEXT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
        DIRECT: tl.constexpr, DOT_PREC: tl.constexpr, KV_FP8: tl.constexpr):
    b = tl.program_id(0)
    part = tl.program_id(2)

    ctx = tl.load(ctx_ptr + b)
    part_len = _partition_len(ctx, PARTITION, MAX_PARTITIONS, SHORT_PARTITION, SHORT_CONTEXT)
    start = part * part_len
    if start >= ctx:
        return
    end = tl.minimum(start + part_len, ctx)

    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    ql_hc = tl.load(ql_ptr + b.to(tl.int64) * stride_qlb + offs_h[:, None] * stride_qlh + offs_c[None, :],
                    mask=mask_h[:, None] & mask_c[None, :], other=0.0)
    qp_hr = tl.load(qp_ptr + b.to(tl.int64) * stride_qpb + offs_h[:, None] * stride_qph + offs_r[None, :],
                    mask=mask_h[:, None] & mask_r[None, :], other=0.0)

    m_h = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_h = tl.zeros([BLOCK_H], tl.float32)
    acc_hc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    for n0 in range(start, end, BLOCK_N):
        offs_t = n0 + tl.arange(0, BLOCK_N)
        mask_t = offs_t < end
        block_t = tl.load(bt_row + offs_t // BLOCK_SIZE, mask=mask_t, other=0)
        slot_t = block_t.to(tl.int64) * BLOCK_SIZE + offs_t % BLOCK_SIZE
        row_t = c_ptr + slot_t * stride_cs
        # The latent is both the key's first C dims and the value: loaded once, used by both products.
        c_tc = tl.load(row_t[:, None] + offs_c[None, :], mask=mask_t[:, None] & mask_c[None, :], other=0.0)
        pe_tr = tl.load(row_t[:, None] + C + offs_r[None, :], mask=mask_t[:, None] & mask_r[None, :], other=0.0)
        if KV_FP8:
            # e4m3 widens exactly to q's dtype; the row's one scale multiplies its score and, in P, its value.
            cs_t = tl.load(cs_ptr + slot_t, mask=mask_t, other=0.0)
            c_tc = c_tc.to(ql_hc.dtype)
            pe_tr = pe_tr.to(qp_hr.dtype)
        s_ht = tl.dot(ql_hc, tl.trans(c_tc), input_precision=DOT_PREC)
        s_ht = tl.dot(qp_hr, tl.trans(pe_tr), s_ht, input_precision=DOT_PREC)
        if KV_FP8:
            s_ht = s_ht * (cs_t * qk_scale)[None, :]
        else:
            s_ht = s_ht * qk_scale
        s_ht = tl.where(mask_t[None, :], s_ht, float("-inf"))
        m_new_h = tl.maximum(m_h, tl.max(s_ht, axis=1))
        alpha_h = tl.exp2(m_h - m_new_h)
        p_ht = tl.exp2(s_ht - m_new_h[:, None])
        l_h = l_h * alpha_h + tl.sum(p_ht, axis=1)
        if KV_FP8:
            p_ht = p_ht * cs_t[None, :]  # only the numerator: l_h sums the unscaled probabilities
        acc_hc = acc_hc * alpha_h[:, None] + tl.dot(p_ht.to(c_tc.dtype), c_tc, input_precision=DOT_PREC)
        m_h = m_new_h

    o_hc = acc_hc / l_h[:, None]
    mask_hc = mask_h[:, None] & mask_c[None, :]
    o_row = o_ptr + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_c[None, :]
    if DIRECT:
        tl.store(o_row, o_hc.to(o_ptr.dtype.element_ty), mask=mask_hc)
    else:
        tl.store(o_row + part * stride_op, o_hc, mask=mask_hc)
        tl.store(lse_ptr + b.to(tl.int64) * stride_lb + offs_h * stride_lh + part, m_h + tl.log2(l_h), mask=mask_h)


@triton.jit
def _combine_partitions_kernel(o_part_ptr, lse_ptr, ctx_ptr, out_ptr,
                               stride_pb, stride_ph, stride_pp, stride_lb, stride_lh, stride_ob, stride_oh, DV,
                               PARTITION: tl.constexpr, MAX_PARTITIONS: tl.constexpr,
                               SHORT_PARTITION: tl.constexpr, SHORT_CONTEXT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr):
    """out[b, h] = sum_p 2^(lse_p - max) o_p / sum_p 2^(lse_p - max) over the valid partitions of sequence b."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    ctx = tl.load(ctx_ptr + b)
    n_parts = tl.cdiv(ctx, _partition_len(ctx, PARTITION, MAX_PARTITIONS, SHORT_PARTITION, SHORT_CONTEXT))  # the partitions that were written

    lse_row = lse_ptr + b * stride_lb + h * stride_lh
    offs_p = tl.arange(0, BLOCK_P)
    lse_p = tl.load(lse_row + offs_p, mask=offs_p < n_parts, other=float("-inf"))
    lse_max = tl.max(lse_p, axis=0)
    denom = tl.sum(tl.exp2(lse_p - lse_max), axis=0)

    offs_d = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < DV
    part_row = o_part_ptr + b * stride_pb + h * stride_ph + offs_d
    acc_d = tl.zeros([BLOCK_DV], tl.float32)
    for p in range(0, n_parts):
        w = tl.exp2(tl.load(lse_row + p) - lse_max)
        acc_d += w * tl.load(part_row + p * stride_pp, mask=mask_d, other=0.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, (acc_d / denom).to(out_ptr.dtype.element_ty),
             mask=mask_d)


def _short() -> tuple[int, int]:
    """(SHORT_PARTITION, SHORT_CONTEXT), the same rule for GQA and MLA, or off."""
    return (SHORT_PARTITION, SHORT_CONTEXT) if SHORT_PARTITION and SHORT_CONTEXT else (PARTITION, 0)


def _num_partitions(block_tables_BM: torch.Tensor, block_size: int, gqa: bool) -> int:
    """Partitions in the grid: enough for the block tables' capacity, at most MAX_PARTITIONS (shapes only)."""
    capacity = block_tables_BM.shape[1] * block_size
    n = min(MAX_PARTITIONS, triton.cdiv(capacity, PARTITION))
    short_partition, short_context = _short()
    if short_context:
        n = max(n, triton.cdiv(min(capacity, short_context), short_partition))
    return max(1, n)


def _check_block_size(block_size: int) -> None:
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"paged decode: block_size must be a power of two, got {block_size}")


def _combine(o_part_BHPD: torch.Tensor, lse_BHP: torch.Tensor, context_lens_B: torch.Tensor,
             out_BHD: torch.Tensor, gqa: bool) -> None:
    B, H, P, DV = o_part_BHPD.shape
    block_dv = _pow2(DV)
    _combine_partitions_kernel[(B, H)](
        o_part_BHPD, lse_BHP, context_lens_B, out_BHD,
        o_part_BHPD.stride(0), o_part_BHPD.stride(1), o_part_BHPD.stride(2), lse_BHP.stride(0), lse_BHP.stride(1),
        out_BHD.stride(0), out_BHD.stride(1), DV,
        PARTITION=PARTITION, MAX_PARTITIONS=MAX_PARTITIONS, SHORT_PARTITION=_short()[0],
        SHORT_CONTEXT=_short()[1], BLOCK_P=_pow2(P), BLOCK_DV=block_dv,
        num_warps=4 if block_dv >= 512 else (2 if block_dv >= 128 else 1))


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


LOG2E = 1.4426950408889634


def _gqa_config(block_d: int, itemsize: int) -> dict:
    """Token tile and launch config of the GQA partition kernel: K and V tiles of 64 tokens (16 KB each at D=128 in
    bf16), double-buffered; wider rows (fp32 in the tests) get shorter tiles to stay inside shared memory."""
    row_bytes = block_d * itemsize
    block_n = 64 if row_bytes <= 256 else (32 if row_bytes <= 512 else 16)
    return dict(BLOCK_N=block_n, num_warps=4, num_stages=2)


def _mla_config(H: int, block_c: int, itemsize: int) -> dict:
    """Head tile, token tile and launch config of the MLA partition kernel. 16 heads (tl.dot's minimum rows) at 4
    warps up to 63 heads; from 64 heads on, 64 heads a program at 8 warps, so the latent is read once per 64 heads
    rather than per 16 (1.4x faster at H=128 on an H200). Latent tiles of 32 tokens (32 KB at C=512 in bf16),
    double-buffered; fp32 (tests) gets 16-token tiles, single-buffered, to stay inside shared memory."""
    block_h = 64 if H >= 64 else 16
    num_warps = 8 if block_h == 64 else 4
    if block_c * itemsize <= 1024:
        return dict(BLOCK_H=block_h, BLOCK_N=32, num_warps=num_warps, num_stages=2)
    return dict(BLOCK_H=block_h, BLOCK_N=16, num_warps=num_warps, num_stages=1)


def paged_decode_gqa(q_BHD: torch.Tensor, k_SGD: torch.Tensor, v_SGD: torch.Tensor, block_tables_BM: torch.Tensor,
                     context_lens_B: torch.Tensor, block_size: int, scale: float,
                     k_scale_SG: torch.Tensor | None = None, v_scale_SG: torch.Tensor | None = None) -> torch.Tensor:
    _check_block_size(block_size)
    B, H, D = q_BHD.shape
    G = k_SGD.shape[1]
    if H % G:
        raise ValueError(f"paged_decode_gqa: {H} query heads are not a multiple of {G} kv heads")
    QH = H // G
    fp8 = k_scale_SG is not None
    if fp8 and (v_scale_SG is None or k_scale_SG.stride(1) != 1 or v_scale_SG.stride(1) != 1):
        raise ValueError("paged_decode_gqa: an fp8 cache needs K and V scales [S, G] with a contiguous last dim")
    q_BHD, k_SGD, v_SGD = (_last_dim_contiguous(t) for t in (q_BHD, k_SGD, v_SGD))
    block_tables_BM = _last_dim_contiguous(block_tables_BM)
    context_lens_B = context_lens_B.contiguous()
    out_BHD = torch.empty((B, H, D), device=q_BHD.device, dtype=q_BHD.dtype)
    if B == 0:
        return out_BHD

    block_qh = min(max(16, _pow2(QH)), 64)  # tl.dot needs >= 16 rows; larger groups take several tiles
    head_tiles = triton.cdiv(QH, block_qh)
    block_d = max(16, _pow2(D))
    cfg = _gqa_config(block_d, q_BHD.element_size())  # e4m3 tiles are widened to q's dtype in registers
    n_parts = _num_partitions(block_tables_BM, block_size, gqa=True)
    direct = n_parts == 1
    if direct:
        o_part, lse = out_BHD, out_BHD  # lse unused
        strides_o = (out_BHD.stride(0), out_BHD.stride(1), 0)
        strides_l = (0, 0)
    else:
        o_part = torch.empty((B, H, n_parts, D), device=q_BHD.device, dtype=torch.float32)
        lse = torch.empty((B, H, n_parts), device=q_BHD.device, dtype=torch.float32)
        strides_o = (o_part.stride(0), o_part.stride(1), o_part.stride(2))
        strides_l = (lse.stride(0), lse.stride(1))
    ks, vs = (k_scale_SG, v_scale_SG) if fp8 else (k_SGD, v_SGD)  # unused without fp8
    _gqa_partition_kernel[(B, G * head_tiles, n_parts)](
        q_BHD, k_SGD, v_SGD, ks, vs, block_tables_BM, context_lens_B, o_part, lse,
        q_BHD.stride(0), q_BHD.stride(1), k_SGD.stride(0), k_SGD.stride(1), v_SGD.stride(0), v_SGD.stride(1),
        ks.stride(0) if fp8 else 0, vs.stride(0) if fp8 else 0,
        block_tables_BM.stride(0), *strides_o, *strides_l,
        float(scale) * LOG2E, QH, D,
        HEAD_TILES=head_tiles, BLOCK_SIZE=block_size, PARTITION=PARTITION, MAX_PARTITIONS=MAX_PARTITIONS,
        SHORT_PARTITION=_short()[0], SHORT_CONTEXT=_short()[1], BLOCK_QH=block_qh, BLOCK_D=block_d, DIRECT=direct, DOT_PREC=_dot_precision(q_BHD.dtype), KV_FP8=fp8, **cfg)
    if not direct:
        _combine(o_part, lse, context_lens_B, out_BHD, gqa=True)
    return out_BHD


def paged_decode_mla(q_lat_BHC: torch.Tensor, q_pe_BHR: torch.Tensor, c_SX: torch.Tensor, block_tables_BM: torch.Tensor,
                     context_lens_B: torch.Tensor, block_size: int, scale: float,
                     c_scale_S: torch.Tensor | None = None) -> torch.Tensor:
    _check_block_size(block_size)
    B, H, C = q_lat_BHC.shape
    R = q_pe_BHR.shape[-1]
    if c_SX.shape[-1] != C + R:
        raise ValueError(f"paged_decode_mla: cache rows are {c_SX.shape[-1]} wide, expected C + R = {C + R}")
    fp8 = c_scale_S is not None
    if fp8 and c_scale_S.stride(0) != 1:
        raise ValueError("paged_decode_mla: the scales must be contiguous")
    q_lat_BHC, q_pe_BHR, c_SX = (_last_dim_contiguous(t) for t in (q_lat_BHC, q_pe_BHR, c_SX))
    block_tables_BM = _last_dim_contiguous(block_tables_BM)
    context_lens_B = context_lens_B.contiguous()
    out_BHC = torch.empty((B, H, C), device=q_lat_BHC.device, dtype=q_lat_BHC.dtype)
    if B == 0:
        return out_BHC

    block_c = max(16, _pow2(C))
    block_r = max(16, _pow2(R))
    # The tiles as for a cache in q's dtype: an e4m3 tile is widened to q's dtype in registers.
    cfg = _mla_config(H, block_c, q_lat_BHC.element_size())
    n_parts = _num_partitions(block_tables_BM, block_size, gqa=False)
    direct = n_parts == 1
    if direct:
        o_part, lse = out_BHC, out_BHC
        strides_o = (out_BHC.stride(0), out_BHC.stride(1), 0)
        strides_l = (0, 0)
    else:
        o_part = torch.empty((B, H, n_parts, C), device=q_lat_BHC.device, dtype=torch.float32)
        lse = torch.empty((B, H, n_parts), device=q_lat_BHC.device, dtype=torch.float32)
        strides_o = (o_part.stride(0), o_part.stride(1), o_part.stride(2))
        strides_l = (lse.stride(0), lse.stride(1))
    _mla_partition_kernel[(B, triton.cdiv(H, cfg["BLOCK_H"]), n_parts)](
        q_lat_BHC, q_pe_BHR, c_SX, c_scale_S if fp8 else c_SX, block_tables_BM, context_lens_B, o_part, lse,
        q_lat_BHC.stride(0), q_lat_BHC.stride(1), q_pe_BHR.stride(0), q_pe_BHR.stride(1), c_SX.stride(0),
        block_tables_BM.stride(0), *strides_o, *strides_l,
        float(scale) * LOG2E, H, C, R,
        BLOCK_SIZE=block_size, PARTITION=PARTITION, MAX_PARTITIONS=MAX_PARTITIONS,
        SHORT_PARTITION=_short()[0], SHORT_CONTEXT=_short()[1], BLOCK_C=block_c, BLOCK_R=block_r, DIRECT=direct, DOT_PREC=_dot_precision(q_lat_BHC.dtype), KV_FP8=fp8, **cfg)
    if not direct:
        _combine(o_part, lse, context_lens_B, out_BHC, gqa=False)
    return out_BHC
