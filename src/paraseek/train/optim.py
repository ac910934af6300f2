"""The optimizer side of a training step: AdamW as the engine builds it, the learning-rate schedule, the one global
gradient clip, and the token loss every run minimizes."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from paraseek.train.config import TrainConfig


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with fp32 master weights (betas 0.9/0.95 as DeepSeek trains: V2 paper sec. 3.1.2, V3 report sec.
    4.2): fused on CUDA (one kernel for the whole update, the gradient clip included, see clip_grad_norm), foreach
    on the CPU and for offloaded state."""
    on_gpu = device.type == "cuda" and not cfg.cpu_offload
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay,
                             fused=on_gpu, foreach=None if on_gpu else True)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to cfg.lr over warmup_steps, then cosine/linear decay to lr * min_lr_ratio, or constant; past
    cfg.steps (a resumed run that trains longer and keeps the original schedule) it stays at the end's value."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(1, cfg.warmup_steps)
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.lr_schedule == "linear":
        return floor + (cfg.lr - floor) * (1 - progress)
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


SCHEDULE_FIELDS = ("lr", "warmup_steps", "lr_schedule", "min_lr_ratio", "steps")  # what lr_at reads


def schedule_of(cfg: TrainConfig) -> dict:
    return {name: getattr(cfg, name) for name in SCHEDULE_FIELDS}


def resumed_schedule(cfg: TrainConfig, trainer_state: dict | None) -> TrainConfig:
    """The configuration lr_at follows after --resume: the schedule of the run that wrote the checkpoint, so that a
    resume with another --steps (or --lr) does not move the learning rate of the steps to come, unless
    --lr-schedule-reset asks for this command's (Megatron-LM's --use-checkpoint-opt_param-scheduler and
    --override-opt_param-scheduler, the same two choices)."""
    if not trainer_state or cfg.lr_schedule_reset:
        return cfg
    saved = trainer_state.get("lr_schedule") or trainer_state.get("config") or {}
    return dataclasses.replace(cfg, **{k: saved[k] for k in SCHEDULE_FIELDS if k in saved})


def token_loss(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Sum of the token cross-entropies, in fp32. With vocab-sharded DTensor logits (the TP head's output) call it,
    and run backward, inside tensor.loss_context(True) (torch's loss_parallel): each rank computes log-softmax on its
    V / tp columns with a max and a sum all-reduced over tp, never the whole [B, T, V], and gets a replicated DTensor
    scalar back (tensor.full_value for a plain one)."""
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), labels_BT.flatten(), reduction="sum")


@torch.no_grad()
def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None = None,
                   fused_optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """The global L2 gradient norm of the whole model, the same on every rank, and clipping to max_norm if > 0 (as
    torch's clip_grad_norm_: gradients times min(1, max_norm / (norm + 1e-6))).

    Gradients may be DTensors on several meshes and placements (with EP the routed experts' on (expert_dp, ep),
    everything else's on the dp mesh; TP's 2-D (dp, tp) ones), which DTensor ops refuse to mix: one norm per (mesh,
    placements), each made whole with full_tensor, then combined. `pp_group`: each pp rank holds other layers, so
    the squared norms are summed over it. `fused_optimizer`: a fused Adam/AdamW about to step (and no GradScaler):
    the clip is handed to it as the `grad_scale` its kernel divides every gradient by -- the attribute torch's
    GradScaler sets -- instead of a pass of its own over the gradients (read + write of every fp32 gradient, ~1% of
    an 8B model's step)."""
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    norms = []
    for group in groups.values():  # the same order on every rank (parameter order): the collectives line up
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0, foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    if pp_group is not None:
        total_sq = total.square()
        dist.all_reduce(total_sq, group=pp_group)
        total = total_sq.sqrt()
    if max_norm > 0 and fused_optimizer is not None:
        # clip_grads_with_norm_ multiplies by min(1, max_norm / (total + 1e-6)); dividing by its inverse is the same.
        fused_optimizer.grad_scale = ((total.float() + 1e-6) / max_norm).clamp(min=1.0)
    elif max_norm > 0:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
