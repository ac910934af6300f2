"""Triton kernels for the many-adapter LoRA delta of one projection (infer/lora.py, `LoRALinear`): each token reads
only its own slot's A and B, as Punica's BGMV does (Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving", sec. 4:
batched gather matrix-vector products), in two launches per projection whatever its number of fused pieces.

Layouts (lora.py's): X = L*R columns, slot l's in l*R .. l*R + R (zeros past the adapter's rank); A of piece p in rows
p*X .. (p+1)*X of a_PXI [P*X, I]; B of all pieces in b_OX [O, X], piece p's in its rows of the fused output
(starts_P: where each piece's rows begin). idx_N [N]: each token's slot, -1 for the base model.

  shrink   grid (N, P, S): token n's x [I] against the R rows of its slot's A of piece p, the input cut in S splits
           of SPLIT_I columns (so a step of few tokens still fills the GPU); fp32 partial sums to a workspace
           [N, P, S, R]. A base token (slot -1) reads nothing and writes zeros.
  expand_  grid (N, O / BLOCK_O): token n's partials summed over the S splits (fp32), rounded to the slots' dtype
           (as the torch path's x A^T is), then y[n, o] += xa[n, piece(o)] . B[o, slot's R columns] in fp32, rounded
           once to y's dtype (as addmm rounds). A base token's rows are not touched.

Bytes per projection: every token reads its slot's A (P*R*I) and B (O*R) once, mostly from L2 when tokens share
slots: N*R*(P*I + O) elements, against the torch path's L*R*(P*I + O) read once for the whole step but computed for
every slot (and 2 + P launches: the masked shrink GEMM, torch.where, one addmm per piece). The only difference in
numbers from the torch path is the order of the fp32 sums. No host syncs, shapes fixed by the tensors' shapes: the
kernels run inside the decode CUDA graphs, reading the slots and idx_N as they are at replay.

`shrink_reference` and `expand_reference_` are the same contract in plain torch (CPU, tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paraseek.infer.kernels import _pow2  # also makes Triton's interpreter usable on CPU (TRITON_INTERPRET=1)

SPLIT_I = 1024  # input columns per shrink program: 4 programs per token and piece at I = 4096
BLOCK_I = 256  # the shrink's inner tile [R, BLOCK_I]
BLOCK_O = 128  # output rows per expand program
MAX_PIECES = 3  # q|k|v


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, idx_ptr, ws_ptr, stride_x, stride_a, I, X, R,
                   P: tl.constexpr, S: tl.constexpr, SPLIT_I: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_I: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    s = tl.program_id(2)
    slot = tl.load(idx_ptr + n).to(tl.int64)
    offs_R = tl.arange(0, BLOCK_R)
    mask_R = offs_R < R
    acc_RI = tl.zeros((BLOCK_R, BLOCK_I), dtype=tl.float32)
    if slot >= 0:
        rows_R = p * X + slot * R + offs_R
        for i0 in range(s * SPLIT_I, (s + 1) * SPLIT_I, BLOCK_I):
            offs_I = i0 + tl.arange(0, BLOCK_I)
            mask_I = offs_I < I
            x_I = tl.load(x_ptr + n * stride_x + offs_I, mask=mask_I, other=0.0).to(tl.float32)
            a_RI = tl.load(a_ptr + rows_R[:, None] * stride_a + offs_I[None, :],
                           mask=mask_R[:, None] & mask_I[None, :], other=0.0).to(tl.float32)
            acc_RI += a_RI * x_I[None, :]
    tl.store(ws_ptr + ((n * P + p) * S + s) * R + offs_R, tl.sum(acc_RI, 1), mask=mask_R)


@triton.jit
def _expand_kernel(y_ptr, ws_ptr, b_ptr, idx_ptr, stride_y, stride_b, O, R, start1, start2,
                   P: tl.constexpr, S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(idx_ptr + n).to(tl.int64)
    if slot >= 0:
        offs_O = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        mask_O = offs_O < O
        offs_R = tl.arange(0, BLOCK_R)
        mask_R = offs_R < R
        b_OR = tl.load(b_ptr + offs_O[:, None] * stride_b + slot * R + offs_R[None, :],
                       mask=mask_O[:, None] & mask_R[None, :], other=0.0).to(tl.float32)
        piece_O = (offs_O >= start1).to(tl.int32) + (offs_O >= start2).to(tl.int32)
        delta_O = tl.zeros((BLOCK_O,), dtype=tl.float32)
        for k in tl.static_range(P):
            xa_R = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for s in tl.static_range(S):
                xa_R += tl.load(ws_ptr + ((n * P + k) * S + s) * R + offs_R, mask=mask_R, other=0.0)
            xa_R = xa_R.to(b_ptr.dtype.element_ty).to(tl.float32)  # x A^T rounded as the torch path's
            delta_O = tl.where(piece_O == k, tl.sum(b_OR * xa_R[None, :], 1), delta_O)
        y_O = tl.load(y_ptr + n * stride_y + offs_O, mask=mask_O, other=0.0).to(tl.float32)
        tl.store(y_ptr + n * stride_y + offs_O, (y_O + delta_O).to(y_ptr.dtype.element_ty), mask=mask_O)


def _check(a_PXI: torch.Tensor, n_pieces: int, rank: int) -> None:
    if not 1 <= n_pieces <= MAX_PIECES:
        raise ValueError(f"lora kernels: {n_pieces} pieces (1 to {MAX_PIECES} are served)")
    if a_PXI.shape[0] % (n_pieces * rank) or not a_PXI.is_contiguous():
        raise ValueError(f"lora kernels: A {tuple(a_PXI.shape)} is not {n_pieces} contiguous pieces of rank {rank}")


def shrink(x_NI: torch.Tensor, a_PXI: torch.Tensor, idx_N: torch.Tensor, n_pieces: int, rank: int) -> torch.Tensor:
    """fp32 partials [N, P, S, R] of x[n] A_{p, idx[n]}^T over S input splits (zeros for idx -1): sum over dim 2."""
    _check(a_PXI, n_pieces, rank)
    N, I = x_NI.shape
    if x_NI.stride(-1) != 1:
        x_NI = x_NI.contiguous()
    S = triton.cdiv(I, SPLIT_I)
    ws_NPSR = torch.empty((N, n_pieces, S, rank), device=x_NI.device, dtype=torch.float32)
    if N > 0:
        _shrink_kernel[(N, n_pieces, S)](x_NI, a_PXI, idx_N, ws_NPSR, x_NI.stride(0), a_PXI.stride(0), I,
                                         a_PXI.shape[0] // n_pieces, rank, P=n_pieces, S=S, SPLIT_I=SPLIT_I,
                                         BLOCK_R=_pow2(rank), BLOCK_I=min(BLOCK_I, _pow2(I)), num_warps=4)
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
        _expand_kernel[(N, triton.cdiv(O, BLOCK_O))](y_NO, ws_NPSR, b_OX, idx_N, y_NO.stride(0), b_OX.stride(0), O,
                                                    R, bounds[0], bounds[1], P=P, S=S, BLOCK_R=_pow2(R),
                                                    BLOCK_O=BLOCK_O, num_warps=4)
    return y_NO


# ---- the same contract in plain torch ---------------------------------------------------------------------------------
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
