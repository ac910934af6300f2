"""Triton kernels for the many-adapter LoRA delta of one projection (infer/lora.py, `LoRALinear`): each token meets
only its own slot's A and B (Punica, Chen et al. 2023, sec. 4: gathered per-token products, BGMV; SGMV's
grouping of the tokens of one adapter), in two launches per projection whatever its number of fused pieces.

Layouts (lora.py's): X = L*R columns, slot l's in l*R .. l*R + R (zeros past the adapter's rank); A of piece p in rows
p*X .. (p+1)*X of a_PXI [P*X, I]; B of all pieces in b_OX [O, X], piece p's in its rows of the fused output
(starts: where each piece's rows begin). idx_N [N]: each token's slot, -1 for the base model.

  Programs are (slot l, block of BLOCK_N tokens, ...): a program loads slot l's weights once and applies them to
  the tokens of its block whose slot is l (tl.dot over the block, the other tokens' rows loaded as zeros and never
  stored: a row of a product depends on its own token only, so no value of another slot reaches a token). A
  program whose block holds no token of its slot returns before loading anything, so idle slots cost no bytes
  and no token reads another slot's weights. Without sorting the tokens (SGMV's segments), the tokens of one slot
  need not be contiguous; the price is L programs per token block, most of them returning at once.
  shrink   grid (L, N / BLOCK_N, P * S): x [I] of the block's tokens against the R rows of the slot's A of piece
           p, the input cut in S splits of SPLIT_I columns (so a step of few tokens still fills the GPU); fp32
           partial sums to a workspace [N, P, S, R] (a base token's rows are not written).
  expand_  grid (L, N / BLOCK_N, O / BLOCK_O): the partials summed over the S splits (fp32), rounded to the slots'
           dtype (as the torch path's x A^T is), times B's R columns of the slot for the block's rows of y (fp32,
           each row with its piece's x A^T), added to y in place with one rounding to y's dtype (as addmm rounds).
           A base token's rows are not touched.

Bytes per projection: each slot used by a token block reads its A (P*R*I) and B (O*R) once per block; at most
N / BLOCK_N blocks, so a decode step of up to 64 tokens reads each used slot once, as the torch path reads every
slot once. The products run over the whole token block for each slot in use (rows of other tokens are zeros), as
the torch path's run over all L slots for every token. The only difference in numbers from the torch path is the
order of the fp32 sums. No host syncs, grids fixed by the tensors' shapes: the kernels run inside the decode CUDA
graphs, reading the slots and idx_N as they are at replay.

`shrink_reference` and `expand_reference_` are the same contract in plain torch (CPU, tests). MLA's kv_b read
absorbed has its own two kernels at the end (same program layout), held to LatentLoRA's torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Importing kernels also makes Triton's interpreter usable on CPU (TRITON_INTERPRET=1).
from paraseek.infer.kernels import _dot_precision, _pow2

SPLIT_I = 512  # input columns per shrink program: q|k|v at I = 4096, 8 slots, 64 tokens makes 8 x 3 x 8 = 192
BLOCK_I = 128  # the shrink's inner tile of x [BLOCK_N, BLOCK_I] and A^T [BLOCK_I, R]
BLOCK_O = 128  # output rows per expand program
MAX_BLOCK_N = 64  # tokens per program: a decode step of 64 sequences reads each slot's A and B once
MAX_PIECES = 3  # q|k|v


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, idx_ptr, ws_ptr, N, stride_x, stride_a, I, X, R,
                   P: tl.constexpr, S: tl.constexpr, SPLIT_I: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr, PRECISION: tl.constexpr):
    slot = tl.program_id(0)
    offs_N = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    p = tl.program_id(2) // S
    s = tl.program_id(2) % S
    mine_N = tl.load(idx_ptr + offs_N, mask=offs_N < N, other=-1) == slot
    if tl.max(mine_N.to(tl.int32), 0) > 0:  # a slot no token of the block uses reads nothing
        offs_R = tl.arange(0, BLOCK_R)
        mask_R = offs_R < R
        rows_R = (p * X + slot * R + offs_R).to(tl.int64)
        acc_NR = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
        for i0 in range(s * SPLIT_I, tl.minimum((s + 1) * SPLIT_I, I), BLOCK_I):
            offs_I = i0 + tl.arange(0, BLOCK_I)
            mask_I = offs_I < I
            # Other tokens' rows load zeros and are not stored: a row of the product depends on its own x only.
            x_NI = tl.load(x_ptr + offs_N[:, None].to(tl.int64) * stride_x + offs_I[None, :],
                           mask=mine_N[:, None] & mask_I[None, :], other=0.0)
            a_IR = tl.load(a_ptr + rows_R[None, :] * stride_a + offs_I[:, None],
                           mask=mask_R[None, :] & mask_I[:, None], other=0.0)
            acc_NR = tl.dot(x_NI, a_IR, acc_NR, input_precision=PRECISION)
        ws_NR = ws_ptr + ((offs_N[:, None].to(tl.int64) * P + p) * S + s) * R + offs_R[None, :]
        tl.store(ws_NR, acc_NR, mask=mine_N[:, None] & mask_R[None, :])


@triton.jit
def _expand_kernel(y_ptr, ws_ptr, b_ptr, idx_ptr, N, stride_y, stride_b, O, R, start1, start2,
                   P: tl.constexpr, S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_O: tl.constexpr, PRECISION: tl.constexpr):
    slot = tl.program_id(0)
    offs_N = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mine_N = tl.load(idx_ptr + offs_N, mask=offs_N < N, other=-1) == slot
    if tl.max(mine_N.to(tl.int32), 0) > 0:
        offs_O = tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)
        mask_O = offs_O < O
        offs_R = tl.arange(0, BLOCK_R)
        mask_R = offs_R < R
        b_RO = tl.load(b_ptr + offs_O[None, :].to(tl.int64) * stride_b + slot * R + offs_R[:, None],
                       mask=mask_R[:, None] & mask_O[None, :], other=0.0)
        piece_O = (offs_O >= start1).to(tl.int32) + (offs_O >= start2).to(tl.int32)
        rows_N = offs_N[:, None].to(tl.int64)
        delta_NO = tl.zeros((BLOCK_N, BLOCK_O), dtype=tl.float32)
        for k in tl.static_range(P):
            xa_NR = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
            for s in tl.static_range(S):
                xa_NR += tl.load(ws_ptr + ((rows_N * P + k) * S + s) * R + offs_R[None, :],
                                 mask=mine_N[:, None] & mask_R[None, :], other=0.0)
            xa_NR = xa_NR.to(b_ptr.dtype.element_ty)  # x A^T rounded as the torch path's
            d_NO = tl.dot(xa_NR, b_RO, input_precision=PRECISION)
            delta_NO = tl.where(piece_O[None, :] == k, d_NO, delta_NO)
        y_NO = y_ptr + rows_N * stride_y + offs_O[None, :]
        mask_NO = mine_N[:, None] & mask_O[None, :]
        y = tl.load(y_NO, mask=mask_NO, other=0.0).to(tl.float32)
        tl.store(y_NO, (y + delta_NO).to(y_ptr.dtype.element_ty), mask=mask_NO)


def _block_n(N: int) -> int:
    return max(16, min(MAX_BLOCK_N, _pow2(N)))  # tl.dot needs 16


def _block_r(R: int) -> int:
    return max(16, _pow2(R))


def _check(a_PXI: torch.Tensor, n_pieces: int, rank: int) -> None:
    if not 1 <= n_pieces <= MAX_PIECES:
        raise ValueError(f"lora kernels: {n_pieces} pieces (1 to {MAX_PIECES} are served)")
    if a_PXI.shape[0] % (n_pieces * rank) or not a_PXI.is_contiguous():
        raise ValueError(f"lora kernels: A {tuple(a_PXI.shape)} is not {n_pieces} contiguous pieces of rank {rank}")


def shrink(x_NI: torch.Tensor, a_PXI: torch.Tensor, idx_N: torch.Tensor, n_pieces: int, rank: int) -> torch.Tensor:
    """fp32 partials [N, P, S, R] of x[n] A_{p, idx[n]}^T over S input splits: sum over dim 2 (rows of idx -1 are
    not written: expand_ does not read them)."""
    _check(a_PXI, n_pieces, rank)
    N, I = x_NI.shape
    if x_NI.stride(-1) != 1:
        x_NI = x_NI.contiguous()
    S, X = triton.cdiv(I, SPLIT_I), a_PXI.shape[0] // n_pieces
    ws_NPSR = torch.empty((N, n_pieces, S, rank), device=x_NI.device, dtype=torch.float32)
    if N > 0:
        bn = _block_n(N)
        _shrink_kernel[(X // rank, triton.cdiv(N, bn), n_pieces * S)](
            x_NI, a_PXI, idx_N, ws_NPSR, N, x_NI.stride(0), a_PXI.stride(0), I, X, rank, P=n_pieces, S=S,
            SPLIT_I=SPLIT_I, BLOCK_N=bn, BLOCK_R=_block_r(rank), BLOCK_I=BLOCK_I,
            PRECISION=_dot_precision(x_NI.dtype), num_warps=4)
    return ws_NPSR


def expand_(y_NO: torch.Tensor, ws_NPSR: torch.Tensor, b_OX: torch.Tensor, idx_N: torch.Tensor,
            starts: list[int]) -> torch.Tensor:
    """y[n, piece p's rows] += round(sum_s ws[n, p, s]) B_{p, idx[n]}^T in place (rows of idx -1 untouched)."""
    N, P, S, R = ws_NPSR.shape
    O = y_NO.shape[1]
    if len(starts) != P or starts[0] != 0 or y_NO.stride(-1) != 1 or b_OX.stride(-1) != 1:
        raise ValueError(f"lora kernels: pieces starting at {starts} for {P} pieces, or an output or B whose last "
                         "dim is not contiguous")
    bounds = list(starts[1:]) + [O] * (MAX_PIECES - P)
    if N > 0:
        bn = _block_n(N)
        _expand_kernel[(b_OX.shape[1] // R, triton.cdiv(N, bn), triton.cdiv(O, BLOCK_O))](
            y_NO, ws_NPSR, b_OX, idx_N, N, y_NO.stride(0), b_OX.stride(0), O, R, bounds[0], bounds[1], P=P, S=S,
            BLOCK_N=bn, BLOCK_R=_block_r(R), BLOCK_O=BLOCK_O, PRECISION=_dot_precision(b_OX.dtype), num_warps=4)
    return y_NO


# ---- the same contract in plain torch --------------------------------------------------------------------------
def shrink_reference(x_NI: torch.Tensor, a_PXI: torch.Tensor, idx_N: torch.Tensor, n_pieces: int,
                     rank: int) -> torch.Tensor:
    """[N, P, 1, R] fp32: x[n] A_{p, idx[n]}^T, each token's own slot's rows gathered (zeros for idx -1)."""
    N, I = x_NI.shape
    a_PLRI = a_PXI.view(n_pieces, -1, rank, I)
    own_NPRI = a_PLRI[:, idx_N.long().clamp(min=0)].transpose(0, 1).float()
    xa_NPR = torch.einsum("npri,ni->npr", own_NPRI, x_NI.float())
    return torch.where((idx_N >= 0)[:, None, None], xa_NPR, 0).unsqueeze(2)


def expand_reference_(y_NO: torch.Tensor, ws_NPSR: torch.Tensor, b_OX: torch.Tensor, idx_N: torch.Tensor,
                      starts: list[int]) -> torch.Tensor:
    N, P, _, R = ws_NPSR.shape
    O = y_NO.shape[1]
    xa_NPR = ws_NPSR.sum(2).to(b_OX.dtype).float()
    own_NOR = b_OX.view(O, -1, R)[:, idx_N.long().clamp(min=0)].transpose(0, 1).float()
    piece_O = torch.bucketize(torch.arange(O, device=y_NO.device), torch.tensor(starts[1:], device=y_NO.device),
                              right=True)
    delta_NO = torch.einsum("nor,nor->no", own_NOR, xa_NPR[:, piece_O])
    y_NO.copy_(torch.where((idx_N >= 0)[:, None], y_NO.float() + delta_NO, y_NO.float()).to(y_NO.dtype))
    return y_NO


# ---- MLA's kv_b, read absorbed (lora.py's LatentLoRA) ---------------------------------------------------------------
# Both run at decode on the step's first n tokens, one program per (slot, block of tokens, head), one launch each
# (the torch path: a batched GEMM, torch.where, a GEMM and an add). kv_b's B is b_OX [H*(nope+V), X]: head h's
# W_UK rows h*(nope+V) .. + nope, then its W_UV rows. x A^T-like intermediates are rounded to the slots' dtype as the
# torch path's are; the result is added to the output in fp32 and rounded once (the torch path rounds its product,
# then the sum: one rounding fewer here).
@triton.jit
def _latent_absorb_kernel(q_lat_ptr, q_ptr, b_ptr, a_ptr, idx_ptr, n, stride_lh, stride_ln, stride_qn, stride_qh,
                          stride_b, stride_a, C, NOPE, V, R, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PRECISION: tl.constexpr):
    slot = tl.program_id(0)
    offs_N = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.program_id(2).to(tl.int64)
    mine_N = tl.load(idx_ptr + offs_N, mask=offs_N < n, other=-1) == slot
    if tl.max(mine_N.to(tl.int32), 0) > 0:
        rows_N = offs_N[:, None].to(tl.int64)
        offs_D = tl.arange(0, BLOCK_D)
        offs_R = tl.arange(0, BLOCK_R)
        mask_R = offs_R < R
        q_ND = tl.load(q_ptr + rows_N * stride_qn + h * stride_qh + offs_D[None, :],
                       mask=mine_N[:, None] & (offs_D[None, :] < NOPE), other=0.0)
        b_DR = tl.load(b_ptr + (h * (NOPE + V) + offs_D[:, None]) * stride_b + slot * R + offs_R[None, :],
                       mask=(offs_D[:, None] < NOPE) & mask_R[None, :], other=0.0)
        t_NR = tl.dot(q_ND, b_DR, input_precision=PRECISION).to(a_ptr.dtype.element_ty)
        for c0 in range(0, C, BLOCK_C):
            offs_C = c0 + tl.arange(0, BLOCK_C)
            a_RC = tl.load(a_ptr + (slot * R + offs_R[:, None]) * stride_a + offs_C[None, :],
                           mask=mask_R[:, None] & (offs_C[None, :] < C), other=0.0)
            out_NC = q_lat_ptr + h * stride_lh + rows_N * stride_ln + offs_C[None, :]
            mask_NC = mine_N[:, None] & (offs_C[None, :] < C)
            q_lat = tl.load(out_NC, mask=mask_NC, other=0.0).to(tl.float32)
            q_lat += tl.dot(t_NR, a_RC, input_precision=PRECISION)
            tl.store(out_NC, q_lat.to(q_lat_ptr.dtype.element_ty), mask=mask_NC)


@triton.jit
def _latent_value_kernel(o_ptr, o_lat_ptr, a_ptr, b_ptr, idx_ptr, n, stride_on, stride_oh, stride_ln, stride_lh,
                         stride_a, stride_b, C, NOPE, V, R, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PRECISION: tl.constexpr):
    slot = tl.program_id(0)
    offs_N = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.program_id(2).to(tl.int64)
    mine_N = tl.load(idx_ptr + offs_N, mask=offs_N < n, other=-1) == slot
    if tl.max(mine_N.to(tl.int32), 0) > 0:
        rows_N = offs_N[:, None].to(tl.int64)
        offs_R = tl.arange(0, BLOCK_R)
        mask_R = offs_R < R
        t_NR = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            offs_C = c0 + tl.arange(0, BLOCK_C)
            lat_NC = tl.load(o_lat_ptr + rows_N * stride_ln + h * stride_lh + offs_C[None, :],
                             mask=mine_N[:, None] & (offs_C[None, :] < C), other=0.0)
            a_CR = tl.load(a_ptr + (slot * R + offs_R[None, :]) * stride_a + offs_C[:, None],
                           mask=mask_R[None, :] & (offs_C[:, None] < C), other=0.0)
            t_NR = tl.dot(lat_NC, a_CR, t_NR, input_precision=PRECISION)
        offs_V = tl.arange(0, BLOCK_V)
        b_RV = tl.load(b_ptr + (h * (NOPE + V) + NOPE + offs_V[None, :]) * stride_b + slot * R + offs_R[:, None],
                       mask=mask_R[:, None] & (offs_V[None, :] < V), other=0.0)
        d_NV = tl.dot(t_NR.to(b_ptr.dtype.element_ty), b_RV, input_precision=PRECISION)
        out_NV = o_ptr + rows_N * stride_on + h * stride_oh + offs_V[None, :]
        mask_NV = mine_N[:, None] & (offs_V[None, :] < V)
        o = tl.load(out_NV, mask=mask_NV, other=0.0).to(tl.float32)
        tl.store(out_NV, (o + d_NV).to(o_ptr.dtype.element_ty), mask=mask_NV)


LATENT_BLOCK_C = 128  # latent columns per step of the loops (C = 512 in DeepSeek V2/V3)


def latent_absorb_q_(q_lat_HnC: torch.Tensor, q_nope_nHD: torch.Tensor, b_OX: torch.Tensor, a_XC: torch.Tensor,
                     idx_N: torch.Tensor, V: int, rank: int) -> None:
    """q_lat[h, t] += (q_nope[t, h] B_uk,h,slot(t)) A_slot(t) for the first n tokens (slot -1: untouched)."""
    H, n, C = q_lat_HnC.shape
    nope = q_nope_nHD.shape[2]
    if q_lat_HnC.stride(-1) != 1 or q_nope_nHD.stride(-1) != 1:
        raise ValueError("lora kernels: the latent query and q_nope need a contiguous last dim")
    if n > 0:
        bn = _block_n(n)
        _latent_absorb_kernel[(a_XC.shape[0] // rank, triton.cdiv(n, bn), H)](
            q_lat_HnC, q_nope_nHD, b_OX, a_XC, idx_N, n, q_lat_HnC.stride(0), q_lat_HnC.stride(1),
            q_nope_nHD.stride(0), q_nope_nHD.stride(1), b_OX.stride(0), a_XC.stride(0), C, nope, V, rank,
            BLOCK_N=bn, BLOCK_D=_pow2(max(nope, 16)), BLOCK_R=_block_r(rank), BLOCK_C=LATENT_BLOCK_C,
            PRECISION=_dot_precision(a_XC.dtype), num_warps=4)


def latent_value_(o_NHV: torch.Tensor, o_lat_nHC: torch.Tensor, a_XC: torch.Tensor, b_OX: torch.Tensor,
                  idx_N: torch.Tensor, nope: int, rank: int) -> None:
    """o[t, h] += (o_lat[t, h] A_slot(t)^T) B_uv,h,slot(t)^T for the first n tokens (slot -1: untouched)."""
    n, H, C = o_lat_nHC.shape
    V = o_NHV.shape[2]
    if o_NHV.stride(-1) != 1 or o_lat_nHC.stride(-1) != 1:
        raise ValueError("lora kernels: the attention output and its latent need a contiguous last dim")
    if n > 0:
        bn = _block_n(n)
        _latent_value_kernel[(a_XC.shape[0] // rank, triton.cdiv(n, bn), H)](
            o_NHV, o_lat_nHC, a_XC, b_OX, idx_N, n, o_NHV.stride(0), o_NHV.stride(1), o_lat_nHC.stride(0),
            o_lat_nHC.stride(1), a_XC.stride(0), b_OX.stride(0), C, nope, V, rank, BLOCK_N=bn,
            BLOCK_V=_pow2(max(V, 16)), BLOCK_R=_block_r(rank), BLOCK_C=LATENT_BLOCK_C,
            PRECISION=_dot_precision(a_XC.dtype), num_warps=4)
