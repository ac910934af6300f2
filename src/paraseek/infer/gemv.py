"""Decode projections y = x W^T (+ b) for a few rows of x: a Triton kernel that streams the weight once, and the
plain-torch reference with the same contract.

Contract: x [M, K] with M <= 16 rows (a decode step's tokens), W [N, K] row-major (the layout `linear.Linear` holds),
optional bias [N]; x and W share a dtype (bf16 or fp16 in the model, fp32 too for the tests); products accumulated
in fp32, the bias added in fp32, one rounding to x's dtype at the end.

Count first. Such a product reads N K s bytes of weight (s = 2 in bf16; x, b and y add (M K + N + M N) s, well under
1% at the model's shapes) and does 2 M N K FLOPs: M FLOPs per weight byte in bf16. An H200's ridge point is near 190
FLOPs/byte (about 800 TFLOP/s of measured bf16 matmul over 4.2 TB/s of HBM copy rate), so at M <= 16 the product is
bound by reading W more than 10x over, and its floor is N K s / HBM rate: 8.0 us for a 4096 x 4096 o_proj.

The kernel. Grid (cdiv(N, BLOCK_N), SPLIT_K): a program reads BLOCK_N rows of W over its share of K in
[BLOCK_N, BLOCK_K] tiles (each row contiguous in memory) and multiplies each tile with x's rows padded to 16 through
tl.dot as w [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, 16] -- the weight as the wide operand and x as the 16-wide one, as
cuBLAS's decode GEMMs do (tiles "128x8"); num_stages tiles of W are in flight per program (software pipelining).
W's rows past N re-read a valid row and are not stored, so W's loads need no mask along N.

Why split-K. HBM delivers its rate only with enough bytes requested at once: by Little's law, 4.2 TB/s x about
1 us of loaded latency is some 4 MB in flight over the chip, ~32 KB per SM of 132. A matrix with few rows has few
BLOCK_N blocks -- a 2112 x 7168 input projection is 66 blocks of 32 rows for 132 SMs -- so SMs sit idle or hold too
few loads. Cutting K into SPLIT_K ranges multiplies the programs. Each range writes its fp32 partial sums to a
workspace [SPLIT_K, M, N], and a second kernel adds them in a fixed order (range 0, 1, ...), adds the bias and
rounds: no atomics, so a result is the same bits on every run. The cost is SPLIT_K x M x 4 B written and read back
per row of W (mostly in L2), against K s bytes of the row itself (at SPLIT_K = 8, M = 16: 512 B against 8 KB for
K = 4096 in bf16), and one more launch (cuBLAS's split-K reduce took 1.7 us a call in the 8B batch-1 profile):
split-K pays only where the grid is otherwise too small.

gemv_configs.json holds the tile configs, per GPU (its CUDA device name), per shape and per row bucket, measured by
scripts/gpu/bench_gemv.py --tune --write against cuBLAS (F.linear):
    {"NVIDIA H200": {"N=6144,K=4096": {"source": "...", "configs": {"1": {"BLOCK_N": .., "BLOCK_K": .., "SPLIT_K": ..,
                                                                        "num_warps": .., "num_stages": ..}, ...}}}}
Bucket b of M_BUCKETS holds the config for M rows when b is the smallest bucket >= M. The file lists a GPU, shape
and bucket only where the kernel measured at least 3% faster than F.linear there: no entry means cuBLAS is at least
as fast (or it was not measured on this GPU), `dispatch_config` returns None and `Linear` keeps F.linear. The configs
are measured in bf16; fp16 reads the same bytes and uses them too; other dtypes never dispatch.

CUDA-graph capturable: no host syncs, no autotuning; the grid and the workspace depend on the shapes and the config.
Runs under TRITON_INTERPRET=1 on CPU tensors in fp32 and fp16 (the interpreter cannot run bf16), which is how it is
tested without a GPU.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from paraseek.infer import kernels  # noqa: F401  (patches Triton's interpreter under TRITON_INTERPRET=1)
from paraseek.infer.kernels import _dot_precision, _pow2

CONFIG_FILE = Path(__file__).with_name("gemv_configs.json")
CONFIG_KEYS = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")
M_BUCKETS = (1, 2, 4, 8, 16)
MAX_ROWS = M_BUCKETS[-1]  # x's rows are one 16-row operand of tl.dot
DISPATCH_DTYPES = (torch.bfloat16, torch.float16)  # the dtypes the configs were measured for (2-byte weights)


def gemv_reference(x_MK: torch.Tensor, w_NK: torch.Tensor, b_N: torch.Tensor | None = None) -> torch.Tensor:
    """The contract in plain torch: fp32 products and sums, the bias added in fp32, one rounding to x's dtype."""
    y_MN = x_MK.float() @ w_NK.float().t()
    if b_N is not None:
        y_MN = y_MN + b_N.float()
    return y_MN.to(x_MK.dtype)


# ---- kernels --------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    # W's rows past N re-read row N - 1 (no mask on W's loads; those products are never stored). x's rows past M
    # are masked instead: masked lanes read nothing, so at M = 1 a tile of x costs one row, not 16.
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    mask_m = offs_m < M
    k_start = pid_k * K_SPLIT  # K_SPLIT is a multiple of BLOCK_K
    k_end = tl.minimum(k_start + K_SPLIT, K)
    w_tile = w_ptr + rows_n[:, None] * stride_wn + (k_start + offs_k)[None, :]
    x_tile = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
    acc_NM = tl.zeros([BLOCK_N, 16], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:  # K % BLOCK_K == 0: every tile is whole
            w_NK = tl.load(w_tile)
            x_MK = tl.load(x_tile, mask=mask_m[:, None], other=0.0)
        else:  # only the tile that crosses K is partial (a range's end inside K is a multiple of BLOCK_K)
            mask_k = k0 + offs_k < K
            w_NK = tl.load(w_tile, mask=mask_k[None, :], other=0.0)
            x_MK = tl.load(x_tile, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        acc_NM = tl.dot(w_NK, tl.trans(x_MK), acc_NM, input_precision=DOT_PREC)
        w_tile += BLOCK_K
        x_tile += BLOCK_K

    mask_NM = (offs_n < N)[:, None] & mask_m[None, :]
    if SPLIT:  # this K range's partial sums, [SPLIT_K, M, N] fp32
        tl.store(ws_ptr + (pid_k * M + offs_m[None, :]) * N + offs_n[:, None], acc_NM, mask=mask_NM)
    else:
        if HAS_BIAS:
            acc_NM += tl.load(b_ptr + rows_n).to(tl.float32)[:, None]
        tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc_NM.to(y_ptr.dtype.element_ty),
                 mask=mask_NM)


@triton.jit(do_not_specialize=["M"])
def _split_k_reduce_kernel(ws_ptr, b_ptr, y_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK: tl.constexpr):
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):  # a fixed order: the same bits on every run
        acc += tl.load(ws_ptr + (s * M + m) * N + offs_n, mask=mask_n, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


def _workspace(split_k: int, M: int, N: int, device: torch.device) -> torch.Tensor:
    """The split-K partials, [SPLIT_K, M, N] fp32 (every element is written before it is read)."""
    return torch.empty((split_k, M, N), device=device, dtype=torch.float32)


def check_config(cfg: dict) -> dict:
    """The config's five values as ints, or ValueError naming the one that is wrong."""
    missing = [k for k in CONFIG_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"gemv: config {cfg} lacks {', '.join(missing)}")
    cfg = {k: int(cfg[k]) for k in CONFIG_KEYS}
    for k in ("BLOCK_N", "BLOCK_K"):
        if cfg[k] < 16 or cfg[k] & (cfg[k] - 1):
            raise ValueError(f"gemv: {k}={cfg[k]} must be a power of two >= 16 (tl.dot)")
    if not 1 <= cfg["SPLIT_K"] <= 64:
        raise ValueError(f"gemv: SPLIT_K={cfg['SPLIT_K']} must be in [1, 64]")
    if cfg["num_warps"] not in (1, 2, 4, 8, 16) or cfg["num_stages"] < 1:
        raise ValueError(f"gemv: num_warps={cfg['num_warps']} must be a power of two <= 16 and num_stages="
                         f"{cfg['num_stages']} >= 1")
    return cfg


def split_k_ranges(K: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(K_SPLIT, ranges): K cut into ranges of K_SPLIT elements, a multiple of BLOCK_K, so that no range is empty
    (fewer than SPLIT_K ranges when K holds fewer BLOCK_K tiles)."""
    k_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    return k_split, triton.cdiv(K, k_split)


def gemv(x_MK: torch.Tensor, w_NK: torch.Tensor, b_N: torch.Tensor | None, config: dict,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b), [M, N] in x's dtype, with the given tile config (`dispatch_config`'s, or any that
    `check_config` accepts); written into `out` ([M, N], x's dtype, last dim contiguous) when given."""
    if x_MK.dim() != 2 or w_NK.dim() != 2 or x_MK.shape[1] != w_NK.shape[1]:
        raise ValueError(f"gemv: x {tuple(x_MK.shape)} and W {tuple(w_NK.shape)} are not [M, K] and [N, K]")
    M, K = x_MK.shape
    N = w_NK.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"gemv: x has {M} rows, at most {MAX_ROWS} (decode); larger products belong to F.linear")
    if x_MK.dtype != w_NK.dtype:
        raise ValueError(f"gemv: x ({x_MK.dtype}) and W ({w_NK.dtype}) must share a dtype")
    if w_NK.stride(1) != 1:
        raise ValueError("gemv: W must be row-major (its rows contiguous)")
    if b_N is not None and (b_N.shape != (N,) or b_N.stride(0) != 1):
        raise ValueError(f"gemv: bias {tuple(b_N.shape)} must be a contiguous [{N}]")
    if out is None:
        out = torch.empty((M, N), device=x_MK.device, dtype=x_MK.dtype)
    elif out.shape != (M, N) or out.dtype != x_MK.dtype or out.stride(1) != 1:
        raise ValueError(f"gemv: out must be [{M}, {N}] in {x_MK.dtype} with contiguous rows")
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.copy_(gemv_reference(x_MK, w_NK, b_N))
    cfg = check_config(config)
    x_MK = x_MK if x_MK.stride(1) == 1 else x_MK.contiguous()
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    k_split, splits = split_k_ranges(K, bk, cfg["SPLIT_K"])
    ws = _workspace(splits, M, N, x_MK.device) if splits > 1 else out  # out: a placeholder, never written as ws
    b_arg = b_N if b_N is not None else out  # a placeholder when HAS_BIAS is off
    _gemv_kernel[(triton.cdiv(N, bn), splits)](
        x_MK, w_NK, b_arg, out, ws, M, N, K, k_split, x_MK.stride(0), w_NK.stride(0), out.stride(0),
        HAS_BIAS=b_N is not None, SPLIT=splits > 1, EVEN_K=K % bk == 0, BLOCK_N=bn, BLOCK_K=bk,
        DOT_PREC=_dot_precision(x_MK.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if splits > 1:
        block = min(_pow2(N), 1024)
        _split_k_reduce_kernel[(M, triton.cdiv(N, block))](ws, b_arg, out, M, N, out.stride(0), SPLIT_K=splits,
                                                           HAS_BIAS=b_N is not None, BLOCK=block,
                                                           num_warps=4 if block >= 512 else 1)
    return out


# ---- tile configs -------------------------------------------------------------------------------------------------
def config_key(N: int, K: int) -> str:
    return f"N={N},K={K}"


def m_bucket(M: int) -> int:
    """The smallest bucket >= M (M in 1..MAX_ROWS)."""
    return next(b for b in M_BUCKETS if M <= b)


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str:
    """The config file's name for a device: CUDA's device name ("NVIDIA H200"), else the device type ("cpu")."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


@functools.lru_cache(maxsize=1)
def _config_file() -> dict:
    if not CONFIG_FILE.is_file():
        return {}
    return json.loads(CONFIG_FILE.read_text())


@functools.lru_cache(maxsize=None)
def gemv_config(gpu: str, N: int, K: int, M: int) -> dict | None:
    """The file's config on this GPU for W [N, K] and M rows (its bucket's), or None where the file has none: there
    cuBLAS measured at least as fast. Cached: `Linear` asks on every call outside the CUDA graphs."""
    if not 1 <= M <= MAX_ROWS:
        return None
    entry = _config_file().get(gpu, {}).get(config_key(N, K)) or {}
    cfg = entry.get("configs", {}).get(str(m_bucket(M)))
    return check_config(cfg) if cfg is not None else None


def dispatch_config(x: torch.Tensor, w_NK: torch.Tensor, b_N: torch.Tensor | None) -> dict | None:
    """The config to run `gemv` with for this product, or None for F.linear: x 2-D with 1..16 rows, x, W (and b)
    of one measured dtype, W row-major, and a file entry for this GPU, shape and row bucket."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.dtype not in DISPATCH_DTYPES:
        return None
    if w_NK.dtype != x.dtype or (b_N is not None and b_N.dtype != x.dtype) or w_NK.stride(1) != 1:
        return None
    return gemv_config(device_name(x.device), w_NK.shape[0], w_NK.shape[1], x.shape[0])


def format_config_file(data: dict) -> str:
    """gemv_configs.json's text: one line per row bucket, so a diff after tuning shows what changed."""
    lines = ["{"]
    for g, (gpu, shapes) in enumerate(data.items()):
        lines.append(f"  {json.dumps(gpu)}: {{")
        for i, (key, entry) in enumerate(shapes.items()):
            lines.append(f"    {json.dumps(key)}: {{")
            lines.append(f"      \"source\": {json.dumps(entry.get('source', ''))},")
            lines.append("      \"configs\": {")
            table = sorted(entry["configs"].items(), key=lambda kv: int(kv[0]))
            for j, (bucket, cfg) in enumerate(table):
                body = ", ".join(f"{json.dumps(k)}: {int(cfg[k])}" for k in CONFIG_KEYS)
                lines.append(f"        {json.dumps(str(bucket))}: {{{body}}}" + ("," if j < len(table) - 1 else ""))
            lines.append("      }")
            lines.append("    }" + ("," if i < len(shapes) - 1 else ""))
        lines.append("  }" + ("," if g < len(data) - 1 else ""))
    lines.append("}")
    return "\n".join(lines) + "\n"
