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

Data-parallel attention (`--ep N --dp-attention`, as SGLang serves DeepSeek-V3 with --enable-dp-attention): the N
ranks each run attention, the dense layers, the shared experts, embedding, head and sampling for their own requests
only, each with its own engine (scheduler, sampler, latent KV cache: a rank's cache holds its requests alone, N
times the requests of the replicated form, whose every rank caches every request). Only the MoE layers are shared:
each rank's tokens are all-gathered ([P, D] from every rank, P the step's padded row count), every rank routes all
N x P gathered tokens and computes its own experts' slots of them (`local_slots`, as above), and one reduce-scatter
sums the partial outputs and hands each rank back its own P rows; the shared experts then run on the rank's own
tokens. The collectives move N x P rows where the replicated form's all-reduce moves the whole batch: the same
volume, but attention's work and cache are split N ways instead of repeated N times. It pays where MLA's latent
cache, replicated on every rank, limits the batch (SGLang's case for V3 at large batches); at small batches a step
waits for the busiest rank, and with one request in flight the other ranks run padding.

The one host sync of a step: every MoE layer is a collective, so the ranks step in lockstep and the gathered size
must be the same everywhere. Before each step the ranks all-reduce (max) four small integers on the host's gloo
group -- whether they have work, their token count, whether their step must run eagerly, whether they are asked
to stop -- and every rank pads its MoE input to that most tokens (`pad_rows`), or with CUDA graphs replays the
graph of the bucket that count falls in (its padding rows are the graph's own). A rank with no tokens runs one
padding decode row (the padding block's slot, no logits sampled) so that its MoE layers still take part. Nothing
inside the forward reads a size back from the device: a decode step stays one CUDA graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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


def pad_rows(h_ND: torch.Tensor, rows: int) -> torch.Tensor:
    """dp-attention: this rank's step padded with zero rows to the step's agreed `rows` (the most tokens any rank
    has); the padding rows route somewhere and their outputs are dropped."""
    N = h_ND.shape[0]
    return h_ND if rows <= N else torch.cat([h_ND, h_ND.new_zeros((rows - N, h_ND.shape[1]))])


def gather_rows(h_PD: torch.Tensor, group) -> torch.Tensor:
    """Every rank's [P, D] rows, rank order: [ranks x P, D] (one all-gather; the same P on every rank)."""
    out_GD = h_PD.new_empty((dist.get_world_size(group) * h_PD.shape[0], h_PD.shape[1]))
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13
    all_gather(out_GD, h_PD.contiguous(), group=group)
    return out_GD


def scatter_sums(y_GD: torch.Tensor, group) -> torch.Tensor:
    """The ranks' partial [ranks x P, D] outputs summed, this rank's P rows of the sum (one reduce-scatter)."""
    out_PD = y_GD.new_empty((y_GD.shape[0] // dist.get_world_size(group), y_GD.shape[1]))
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # torch < 2.13
    reduce_scatter(out_PD, y_GD.contiguous(), group=group)
    return out_PD
