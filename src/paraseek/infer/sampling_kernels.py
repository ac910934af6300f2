"""Triton kernel of sampling.py's keyed draw: the exponential race argmax_v p_v / E_v over every row of a batch in
one launch, each E_v ~ Exp(1) computed from (the row's seed, its output position, v) by a stateless hash -- the
same integers and floats as the plain-torch reference `sampling.uniform_noise` / `sampling.race_reference`.

  grid (rows, vocabulary blocks): each program hashes its block's indices (splitmix64, `_mix64`), turns the top 24
  bits into u in (0, 1), E = -log u (libdevice's logf, as torch's CUDA log), and writes the block's largest
  p / E and the first index that has it; a torch argmax over the blocks' maxima (the first block wins a tie) then
  picks the row's token, the first index of the row's maximum, as torch.argmax over the whole row.

Runs under TRITON_INTERPRET=1 on CPU tensors (tests/gpu/test_sampling_kernels.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from paraseek.infer import kernels  # noqa: F401  (patches Triton's interpreter under TRITON_INTERPRET=1)

BLOCK_V = 4096
# Triton's interpreter has no libdevice: there tl.log (NumPy's, as torch's CPU log to the last bit in the tests).
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _log(x):
    """Natural log as torch's CUDA log computes it (libdevice's logf, not Triton's approximate log)."""
    if INTERPRET:
        return tl.log(x)
    else:
        return libdevice.log(x)


@triton.jit
def _mix64(z):
    """splitmix64's output function (Steele, Lea, Flood 2014; Vigna's constants) on uint64."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _uniform(seed_ptr, position_ptr, row, offs):
    """u in (0, 1) for vocabulary indices `offs` of `row`: ((mix64(key + v * GOLDEN) >> 40) + 0.5) / 2^24 with
    key = mix64(mix64(seed) + position)."""
    seed = tl.load(seed_ptr + row).to(tl.uint64, bitcast=True)
    position = tl.load(position_ptr + row).to(tl.uint64, bitcast=True)
    key = _mix64(_mix64(seed) + position)
    z = _mix64(key + offs.to(tl.uint64) * 0x9E3779B97F4A7C15)
    return ((z >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)


@triton.jit
def _race_kernel(p_ptr, seed_ptr, position_ptr, best_ptr, best_idx_ptr, stride_p, V, NBLOCKS,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    p = tl.load(p_ptr + row * stride_p + offs, mask=mask, other=0.0).to(tl.float32)
    e = -_log(_uniform(seed_ptr, position_ptr, row, offs))
    # IEEE division (torch's; Triton's `/` is approximate); p >= 0, so a masked lane never wins
    score = tl.where(mask, tl.div_rn(p, e), -1.0)
    best = tl.max(score, axis=0)
    best_idx = tl.min(tl.where(score == best, offs, V), axis=0)  # the first index of the maximum
    tl.store(best_ptr + row * NBLOCKS + blk, best)
    tl.store(best_idx_ptr + row * NBLOCKS + blk, best_idx.to(tl.int64))


@triton.jit
def _uniform_kernel(u_ptr, seed_ptr, position_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tl.store(u_ptr + row * V + offs, _uniform(seed_ptr, position_ptr, row, offs), mask=offs < V)


def race(probs_BV: torch.Tensor, seed_B: torch.Tensor, position_B: torch.Tensor) -> torch.Tensor:
    """[B] int64 tokens: argmax_v probs_BV[b, v] / E(seed_B[b], position_B[b], v) (probs unnormalized, >= 0)."""
    B, V = probs_BV.shape
    nblocks = triton.cdiv(V, BLOCK_V)
    best_BN = torch.empty((B, nblocks), device=probs_BV.device, dtype=torch.float32)
    best_idx_BN = torch.empty((B, nblocks), device=probs_BV.device, dtype=torch.int64)
    _race_kernel[(B, nblocks)](probs_BV, seed_B, position_B, best_BN, best_idx_BN, probs_BV.stride(0), V, nblocks,
                               BLOCK=BLOCK_V)
    return best_idx_BN.gather(1, best_BN.argmax(dim=-1, keepdim=True))[:, 0]


def uniform(seed_B: torch.Tensor, position_B: torch.Tensor, V: int) -> torch.Tensor:
    """[B, V] float32 u of the race's hash (what the kernel's noise is made from; the tests compare it)."""
    B = seed_B.shape[0]
    u_BV = torch.empty((B, V), device=seed_B.device, dtype=torch.float32)
    _uniform_kernel[(B, triton.cdiv(V, BLOCK_V))](u_BV, seed_B, position_B, V, BLOCK=BLOCK_V)
    return u_BV
