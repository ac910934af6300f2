"""Checkpoints with torch Distributed Checkpoint: model and optimizer (sharded, layout-free: a checkpoint written by
one plan loads into another), plus trainer state (step, data position, RNG) as JSON.

Atomic: everything is written into `step-NNNNNN.tmp/`, renamed to `step-NNNNNN/` once all ranks finished, and only
then `latest` is replaced (os.replace) -- a crash mid-save leaves the previous checkpoint the newest one.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def latest_checkpoint(root: str | Path) -> Path | None:
    root = Path(root)
    latest = root / "latest"
    if not latest.is_file():
        return None
    path = root / latest.read_text().strip()
    return path if (path / "trainer_state.json").is_file() else None


def save_checkpoint(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], model_keys=None) -> Path:
    """`model_keys(name) -> bool`: only those model tensors are saved (a LoRA run's adapters; its frozen base is
    the --init-from folder the trainer state names)."""
    root = Path(root)
    final, tmp = _step_dir(root, step), root / f"step-{step:06d}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if model_keys is not None:
        model_sd = {k: v for k, v in model_sd.items() if model_keys(k)}
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    # RNG per rank (used by dropout-free models only for data-independent randomness; kept for exactness).
    rng = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
    rngs: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, rng)
    if rank == 0:
        state = dict(trainer_state, step=step, rng_states=rngs)
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = root / "latest.tmp"
        latest_tmp.write_text(final.name + "\n")
        os.replace(latest_tmp, root / "latest")
    dist.barrier()
    return final


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    model_keys=None) -> dict[str, Any]:
    """Load model + optimizer into the current (possibly different) layout; returns the trainer state.
    `model_keys`: the model tensors the checkpoint holds (as save_checkpoint was given); the others stay as they are."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if model_keys is not None:
        model_sd = {k: v for k, v in model_sd.items() if model_keys(k)}
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=model_keys is None))
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    rngs = trainer_state.get("rng_states") or []
    rank = dist.get_rank()
    if rank < len(rngs) and rngs[rank]:  # same rank count: restore exactly; otherwise the seed already set is used
        raw = base64.b64decode(rngs[rank])
        torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    return trainer_state


def full_model_state(model: nn.Module, leaders: list[int] | None = None) -> dict[str, torch.Tensor]:
    """The whole model's state dict on rank 0's CPU (gathered from shards); empty on other ranks.

    With pipeline stages (`leaders`: the first rank of each stage, rank 0 among them) each stage is gathered tensor
    by tensor over its own ranks (one whole tensor on the GPU at a time) onto its leader's CPU, and the leaders send
    their stages to rank 0 over a gloo group."""
    if leaders is None:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    pp, rank = len(leaders), dist.get_rank()
    to_rank0 = dist.new_group(leaders, backend="gloo")  # every rank takes part in creating it
    stage: dict[str, torch.Tensor] = {}
    for name, t in get_model_state_dict(model).items():
        whole = t.full_tensor() if isinstance(t, DTensor) else t  # a collective over the stage's ranks
        if rank in leaders:
            stage[name] = whole.detach().cpu()
        del whole
    if rank not in leaders:
        return {}
    stages: list | None = [None] * pp if rank == 0 else None
    dist.gather_object(stage, stages, dst=0, group=to_rank0)
    return {k: v for sd in stages for k, v in sd.items()} if stages else {}
