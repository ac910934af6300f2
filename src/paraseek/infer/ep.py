"""Serving expert parallelism (`--ep N`, as SGLang and vLLM serve DeepSeek-V3): the routed experts split by expert
index over the N ranks of a model replica, rank r holding experts [r E/N, (r + 1) E/N) whole. The rest follows
--tp: with tp 1 attention, the dense MLPs and the shared experts are replicated on every rank; with --tp N --ep N
(the same N ranks) attention goes by heads and the shared experts by width as under tp alone, only the routed
experts by expert.

Dispatch and combine, in their simplest correct decode form: every rank routes every token of the step (its
inputs are the same on every rank, so is its choice), runs only its own experts' slots -- the others' slots get
weight 0 (`local_slots`) -- and the ranks' partial sums are added by one all-reduce: the one tp already does after
the MoE when tp == ep, and under tp 1 the MoE layer's own (its replicated shared experts added after it, once).
Why this form: a decode step's batch is small (tens to hundreds of tokens), so moving the whole [N, D] activation
through one all-reduce costs about what an all-to-all would, in one collective with no data-dependent sizes --
nothing to read back to the host, so a step stays one CUDA graph. An all-to-all form (DeepEP's, SGLang's
--enable-deepep-moe) pays off at large batches and across nodes: each rank would send a token only to the ranks
holding its experts (K of E slots instead of the whole row to everyone), and skip the other ranks' slots instead
of weighting them 0; it needs per-rank counts exchanged first (sizes known only on the device), per-rank receive
buffers padded to a bound to stay in a graph, and a second all-to-all to bring the expert outputs back.
"""

from __future__ import annotations

import torch

from paraseek.errors import UserError
from paraseek.models.args import ModelArgs


def check_ep(a: ModelArgs, tp: int, ep: int) -> None:
    """The engine's ep rules, before any weight loads: one line for what cannot be split."""
    if ep < 1:
        raise UserError(f"--ep must be >= 1, got {ep}")
    if ep == 1:
        return
    if not a.n_routed_experts:
        raise UserError(f"--ep {ep}: the model is dense (no routed experts to split); use --tp instead")
    if a.n_routed_experts % ep:
        raise UserError(f"--ep {ep} does not divide the model's {a.n_routed_experts} routed experts")
    if tp > 1 and tp != ep:
        raise UserError(f"--tp {tp} with --ep {ep}: with both above 1 they must be equal (the same ranks split "
                        "attention by heads and the experts by index)")


def model_ranks(tp: int, ep: int) -> int:
    """Processes (GPUs) of one model replica: tp or ep ranks, the same ones when both are given."""
    return max(tp, ep)


def local_slots(weights_NK: torch.Tensor, idx_NK: torch.Tensor, first: int,
                n_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's global choice -> this rank's slots: expert e in [first, first + n_local) becomes local
    expert e - first with its weight; any other expert's slot gets weight 0 and local expert 0 (a valid index the
    fused kernels and the grouped form compute and then drop: at decode the cost is one more expert's weights read
    at most, where spreading the dropped slots would read more). Elementwise, no host sync (CUDA graphs)."""
    local_NK = idx_NK - first
    mine_NK = (local_NK >= 0) & (local_NK < n_local)
    return (torch.where(mine_NK, weights_NK, torch.zeros_like(weights_NK)),
            torch.where(mine_NK, local_NK, torch.zeros_like(local_NK)).to(idx_NK.dtype))
