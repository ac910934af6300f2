"""Weight initialization that does not depend on the parallel plan.

Every parameter and persistent buffer is drawn from its own generator, seeded by (the run's seed, its checkpoint
name) -- one generator per expert for the stacked routed experts, which the hub stores one tensor each -- on the
compute device, whole, and each rank keeps its part of it: the rows of its FSDP2 shard, its tp slice, its EP experts,
its pipeline stage's layers. So one process and every layout start from the same weights, as if a checkpoint of
them were loaded shard by shard (`models.hf.load_state_into` copies the same way; peak extra memory is one tensor,
or one expert's matrix). DTensor's own random-number tracker (torch.distributed.tensor._random) gives sharded
DTensors this property on CUDA only, and does not cover the plain tensors that TP, EP and DDP leave.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from paraseek.seeding import derive_seed

STACKED_EXPERTS = ".mlp.experts."  # [E, out, in] tensors: one draw per expert, as the hub stores them


@torch.no_grad()
def init_weights(model: nn.Module, rule, seed: int, device: torch.device | None = None, select=None) -> None:
    """Fill every tensor of model.state_dict() in place (those whose name `select(name)` accepts, if given):
    `rule(name) -> (kind, std)` with kind "normal", "ones" or "zeros" says how; the draw for (seed, name[, expert]) is
    the same whatever part of it this rank holds."""
    for name, dst in model.state_dict().items():
        if select is not None and not select(name):
            continue
        kind, std = rule(name)
        on = device if device is not None else _local(dst).device
        for expert in range(dst.shape[0]) if STACKED_EXPERTS in name else [None]:
            if expert is not None and not holds_expert(dst, expert):
                continue
            shape = tuple(dst.shape[1:] if expert is not None else dst.shape)
            if kind == "normal":
                g = torch.Generator(device=on).manual_seed(derive_seed(seed, name, expert))
                src = torch.empty(shape, device=on).normal_(0.0, std, generator=g)
            else:
                src = (torch.ones if kind == "ones" else torch.zeros)(shape, device=on)
            copy_local(dst, src, expert)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def holds_expert(dst: torch.Tensor, expert: int) -> bool:
    """Does this rank hold row `expert` of the stacked tensor `dst` (all of them unless it is a DTensor)?"""
    if not isinstance(dst, DTensor):
        return True
    shape, offset = compute_local_shape_and_global_offset(dst.shape, dst.device_mesh, dst.placements)
    return offset[0] <= expert < offset[0] + shape[0]


@torch.no_grad()
def copy_local(dst: torch.Tensor, src: torch.Tensor, expert: int | None = None) -> None:
    """Copy the part of the full tensor `src` (expert row `expert` of a stacked tensor, if given) that this rank
    holds: all of it for a plain tensor, the local shard for a DTensor (FSDP2/TP/EP), with no communication."""
    if not isinstance(dst, DTensor):
        (dst if expert is None else dst[expert]).copy_(src)
        return
    shape, offset = compute_local_shape_and_global_offset(dst.shape, dst.device_mesh, dst.placements)
    local = dst.to_local()
    if expert is not None:
        if not offset[0] <= expert < offset[0] + shape[0]:
            return
        local, shape, offset = local[expert - offset[0]], shape[1:], offset[1:]
    local.copy_(src[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
