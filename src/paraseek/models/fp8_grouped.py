"""The routed experts' float8 grouped GEMM (`--fp8 RECIPE --fp8-experts on`; parallel/fp8.py turns it on).

models/deepseek.py's Experts call `fp8_grouped_mm` in place of grouped_mm: the forward and the input-gradient GEMMs
in float8 e4m3 with per-row scales (torch._scaled_grouped_mm; Hopper), the weight-gradient GEMM in bf16 (the
grouped GEMM's rows are there its contraction: per-group scales and a third cast would be needed). The kernel takes
only groups of a multiple of 16 rows: `pad_groups` says where each expert's rows go once padded with zero rows.

On CPU, PARASEEK_FP8_EMULATE=1 (the tests) runs the same casts and scales through fp32 GEMMs.
"""

from __future__ import annotations

import os

import torch


def emulated() -> bool:
    """PARASEEK_FP8_EMULATE=1: float8 on CPU for the tests (torchao's emulation for the linears, the fp32 GEMMs below
    for the experts): the same casts and scales, no speed-up."""
    return os.environ.get("PARASEEK_FP8_EMULATE") == "1"


E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def rowwise_fp8(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """t in float8 e4m3 with one scale per slice along `dim` (its abs-max maps to 448), and the inverse scales the
    scaled GEMM multiplies back in (float32, `dim` dropped). Scales are powers of two, as torchao's rowwise recipe
    rounds them: multiplying by one is exact, so only the cast to e4m3 rounds."""
    amax = t.abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    t_fp8 = (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return t_fp8, scale.reciprocal().squeeze(dim).contiguous()  # the kernel takes scales contiguous


def _scaled_grouped_mm(a_MK: torch.Tensor, b_EKN: torch.Tensor, a_inv_M: torch.Tensor, b_inv_EN: torch.Tensor,
                       counts_E: torch.Tensor) -> torch.Tensor:
    """Rows of a (float8, sorted by group, counts_E rows in group e) times group e's float8 b, each scaled back:
    torch._scaled_grouped_mm (a row-major, b column-major, bf16 out). Under PARASEEK_FP8_EMULATE (CPU tests) the
    same float8 values and scales through an fp32 loop over the groups."""
    if emulated():
        a = a_MK.float() * a_inv_M[:, None]
        b = b_EKN.float() * b_inv_EN[:, None, :]
        rows = a.split(counts_E.tolist(), dim=0)
        return torch.cat([r @ b[e] for e, r in enumerate(rows)], dim=0).to(torch.bfloat16)
    offs_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
    # Fast accumulation (the tensor cores' own, without cutlass's periodic promotion to fp32): 1.4x faster on
    # DeepSeek-V2-Lite's MoE layer at 8,192 tokens, and the errors against fp32 the same to 3 digits (BENCHMARKS.md,
    # "Float8 routed experts"). torchao's dense recipes take it for their forward GEMM.
    return torch._scaled_grouped_mm(a_MK, b_EKN, a_inv_M, b_inv_EN, offs=offs_E, out_dtype=torch.bfloat16,
                                    use_fast_accum=True)


def pad_groups(counts_E: torch.Tensor, n_rows: int, align: int = 16) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where the `n_rows` expert-sorted rows go once each expert's group is padded with zero rows to a multiple of
    `align`, which torch._scaled_grouped_mm requires of every group: (the padded row of each row [M], the padded
    groups' row counts [E], the padded row count). On the device with static shapes (no host sync, no recompile under
    torch.compile): the padded row count is a bound, sum_e ceil(c_e/16)*16 <= M + 15E rounded up to 16, not the
    data's; the last expert's group takes the slack (zero rows, so zero outputs and zero weight gradient)."""
    E = counts_E.shape[0]
    padded_E = (counts_E + align - 1) // align * align
    shift_E = (torch.cumsum(padded_E, 0) - padded_E) - (torch.cumsum(counts_E, 0) - counts_E)  # padded - unpadded start
    row_M = torch.arange(n_rows, dtype=counts_E.dtype, device=counts_E.device)
    expert_M = torch.searchsorted(torch.cumsum(counts_E, 0), row_M, right=True)  # rows are sorted by expert
    n_pad = (n_rows + E * (align - 1) + align - 1) // align * align
    padded_E = torch.cat([padded_E[:-1], (n_pad - padded_E[:-1].sum()).view(1)])
    return row_M + shift_E[expert_M], padded_E, n_pad


class _Fp8GroupedMM(torch.autograd.Function):
    """y = x @ w[e]^T per group, the forward and dx GEMMs in float8 with per-row scales, dw in bf16.

    Forward: x scaled per token row, w per output row of each expert (its rows along in_features are the GEMM's
    columns of b, column-major as the kernel takes them). Backward: dy per token row; w per input column of each
    expert, cast into the transposed layout (the second GEMM contracts over out_features). dw = dy^T x per group in
    bf16 from the saved bf16 x: the same GEMM as the bf16 path's weight gradient."""

    @staticmethod
    def forward(ctx, x_MI: torch.Tensor, w_EOI: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        x8_MI, x_inv_M = rowwise_fp8(x_MI.contiguous(), dim=-1)  # a row-major: the kernel's layout
        w8_EOI, w_inv_EO = rowwise_fp8(w_EOI, dim=-1)
        ctx.save_for_backward(x_MI, w_EOI, counts_E)
        return _scaled_grouped_mm(x8_MI, w8_EOI.transpose(-2, -1), x_inv_M, w_inv_EO, counts_E).to(x_MI.dtype)

    @staticmethod
    def backward(ctx, dy_MO: torch.Tensor):
        x_MI, w_EOI, counts_E = ctx.saved_tensors
        dy8_MO, dy_inv_M = rowwise_fp8(dy_MO.contiguous(), dim=-1)
        wt8_EIO, w_inv_EI = rowwise_fp8(w_EOI.transpose(-2, -1), dim=-1)  # per input column of w
        wt8_EIO = wt8_EIO.contiguous()  # b = w[e] [O, I] column-major: w^T's rows contiguous
        dx_MI = _scaled_grouped_mm(dy8_MO, wt8_EIO.transpose(-2, -1), dy_inv_M, w_inv_EI, counts_E).to(x_MI.dtype)
        if emulated():
            rows_x, rows_dy = x_MI.split(counts_E.tolist(), dim=0), dy_MO.split(counts_E.tolist(), dim=0)
            dw_EOI = torch.stack([g.t().float() @ r.float() for g, r in zip(rows_dy, rows_x)])
        else:  # torch._grouped_mm takes bf16 only
            offs_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
            dw_EOI = torch._grouped_mm(dy_MO.t().bfloat16(), x_MI.bfloat16(), offs=offs_E)
        return dx_MI, dw_EOI.to(w_EOI.dtype), None


def fp8_grouped_mm(x_MI: torch.Tensor, w_EOI: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """models/deepseek.py grouped_mm in float8 (the routed experts under --fp8): rows of x sorted by expert, counts_E
    rows for expert e (each a multiple of 16: pad_groups), times expert e's weight [O, I]."""
    return _Fp8GroupedMM.apply(x_MI, w_EOI, counts_E)
