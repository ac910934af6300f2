"""Checkpoints with torch Distributed Checkpoint: model and optimizer (sharded, layout-free: a checkpoint written by
one plan loads into another), plus trainer state (step, data position, RNG, lr schedule, fp16 loss scale) as JSON.

Atomic: everything is written into `step-NNNNNN.tmp/`, renamed to `step-NNNNNN/` once all ranks finished, and only
then `latest` is replaced (os.replace) -- a process killed at any moment leaves every complete step complete and the
previous one the newest (tests/dist/checkpoint_drill.py kills saves at random moments). Reading trusts nothing:
`latest_checkpoint` (models/checkpoint_read.py, the reader export, generate and serve share) takes the newest step
whose trainer state, DCP metadata and every shard file the metadata names are whole, and says what it skipped.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict

from paraseek.errors import UserError
from paraseek.models.checkpoint_read import (checkpoint_problem, has_checkpoints, latest_checkpoint,
                                               needed_checkpoint, step_folders, step_of)

def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())  # DCP fsyncs its shards; this file must not be the one a power cut loses


def _discard(path: Path) -> None:
    """Remove a step folder so that no moment leaves half of it under its name: renamed first (to a name that is
    not its save's step-N.tmp, which may hold the new copy of that step)."""
    doomed = path.with_name(path.name + ".old.tmp")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _first_failure(e: CheckpointException) -> str:
    """DCP's CheckpointException (a BaseException) carries every rank's traceback: the first exception's first
    sentence (torch.load's advice that follows it, to load with weights_only=False, is not for a damaged file)."""
    for exc, _ in e.failures.values():
        return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0].split('. ')[0]}"
    return str(e).splitlines()[0]


def save_checkpoint(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], model_keys=None, *, keep_last: int = 0, scaler=None) -> Path:
    """Write step `step` (a collective). `model_keys(name) -> bool`: only those model tensors are saved (a LoRA
    run's adapters; its frozen base is the --init-from folder the trainer state names). `keep_last` > 0 then removes
    the older step folders but the newest keep_last - 1 complete ones; `scaler` (fp16's GradScaler) has its scale and
    growth tracker saved with the trainer state. A save that fails (a full disk, a folder gone read-only) removes its
    partial step-N.tmp and raises one RuntimeError that says what failed and which checkpoint is still the newest:
    nothing complete is touched before the new step is."""
    root = Path(root)
    try:
        return _save(root, step, model, optimizer, trainer_state, model_keys, keep_last, scaler)
    except (OSError, CheckpointException) as e:
        if dist.get_rank() == 0:
            shutil.rmtree(root / f"step-{step:06d}.tmp", ignore_errors=True)
        why = _first_failure(e) if isinstance(e, CheckpointException) else f"{type(e).__name__}: {e}"
        kept = latest_checkpoint(root)
        raise RuntimeError(f"checkpoint step {step} could not be written to {root} ({why}); "
                           + (f"the newest complete checkpoint, {kept}, is kept" if kept else
                              "no earlier checkpoint of this run exists")) from e


def _save(root: Path, step: int, model, optimizer, trainer_state, model_keys, keep_last: int, scaler) -> Path:
    final, tmp = _step_dir(root, step), root / f"step-{step:06d}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        for stale in root.glob("step-*.tmp"):  # saves that did not finish (a killed run): never complete
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if model_keys is not None:
        model_sd = {k: v for k, v in model_sd.items() if model_keys(k)}
    # (DCP's CheckpointException is a BaseException, not an Exception: save_checkpoint turns it into a RuntimeError
    # the loop's one-line failure report takes)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    # RNG per rank (used by dropout-free models only for data-independent randomness; kept for exactness).
    rng = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
    rngs: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, rng)
    if rank == 0:
        state = dict(trainer_state, step=step, rng_states=rngs)
        if scaler is not None:
            state["grad_scaler"] = scaler.state_dict()
        _write_durably(tmp / "trainer_state.json", json.dumps(state, indent=1))
        if final.exists():  # a damaged folder of this step, which resuming skipped
            _discard(final)
        os.replace(tmp, final)
        _write_durably(root / "latest.tmp", final.name + "\n")
        os.replace(root / "latest.tmp", root / "latest")
        if keep_last > 0:  # only now, with the new step complete and named: keep the newest complete ones
            older = [p for p in step_folders(root) if step_of(p) < step]
            complete = [p for p in older if checkpoint_problem(p) is None]
            kept = complete[-(keep_last - 1):] if keep_last > 1 else []
            for path in older:  # damaged ones too: resuming would only skip them
                if path not in kept:
                    _discard(path)
    dist.barrier()
    return final


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scaler=None,
                    model_keys=None) -> dict[str, Any]:
    """Load model + optimizer into the current (possibly different) layout; returns the trainer state. A checkpoint
    DCP cannot read is one UserError on every rank (the same one: every rank sees the same failure list).
    `model_keys`: the model tensors the checkpoint holds (as save_checkpoint was given); the others stay as they are."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if model_keys is not None:
        model_sd = {k: v for k, v in model_sd.items() if model_keys(k)}
    state = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as e:
        raise UserError(f"{path}: the checkpoint could not be read ({_first_failure(e)}); it is damaged or was "
                        f"written for another model: move that step folder away to resume from the one before") \
            from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=model_keys is None))
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    if scaler is not None and trainer_state.get("grad_scaler"):
        scaler.load_state_dict(trainer_state["grad_scaler"])
    rngs = trainer_state.get("rng_states") or []
    rank = dist.get_rank()
    if rank < len(rngs) and rngs[rank]:  # same rank count: restore exactly; otherwise the seed already set is used
        raw = base64.b64decode(rngs[rank])
        torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    return trainer_state


def _dims(shape: tuple[int, ...]) -> str:
    return " x ".join(map(str, shape)) or "a scalar"


def model_mismatch(path: Path, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """How the checkpoint at `path` differs from a model with these parameter names and (global) shapes -- another
    model, another vocabulary -- or None when it holds exactly them. Read from DCP's metadata, nothing loaded."""
    metadata = FileSystemReader(str(path)).read_metadata()
    saved = {key[len("model."):]: tuple(m.size) for key, m in metadata.state_dict_metadata.items()
             if key.startswith("model.") and hasattr(m, "size")}
    for name, shape in shapes.items():
        if name in saved and saved[name] != tuple(shape):
            return f"{name} is {_dims(saved[name])} there and {_dims(shape)} here"
    missing, extra = sorted(set(shapes) - set(saved)), sorted(set(saved) - set(shapes))
    if missing or extra:
        parts = [f"{len(missing)} of this model's tensors are not in it (e.g. {missing[0]})" if missing else "",
                 f"{len(extra)} of its tensors are not in this model (e.g. {extra[0]})" if extra else ""]
        return "; ".join(p for p in parts if p)
    return None


def prepare_checkpoint_dir(cfg, model_shapes: Callable[[], dict[str, tuple[int, ...]]], *, owner: bool = True,
                           log: Callable[[str], None] = print, warn: Callable[[str], None] | None = None) -> int:
    """The --checkpoint-dir rules, checked before any worker starts (the launcher; under torchrun every rank, with
    `owner` on rank 0 only: it alone removes files); returns the step the run continues from (0: a fresh start).

    - without --resume, a folder that holds checkpoints is refused: --resume continues them, --overwrite removes them
      and starts from step 0;
    - with --resume, a new or empty folder (no step folder, no `latest`) starts from step 0 -- the same command then
      serves the first launch and every restart, as job schedulers requeue jobs -- with a warning that names the
      folder looked in (a misspelt path would otherwise start over unnoticed), while a folder whose checkpoints
      are all damaged is refused, and so is a checkpoint of another model (names and shapes from `model_shapes()`).
    Damaged newer steps that --resume skips are reported through `warn`."""
    if not cfg.checkpoint_dir:  # (validate refuses the folder's flags without it)
        return 0
    root = Path(cfg.checkpoint_dir)
    if root.exists() and not root.is_dir():
        raise UserError(f"--checkpoint-dir {root}: not a folder")
    if cfg.resume and cfg.overwrite:
        raise UserError("--resume continues the checkpoints in --checkpoint-dir and --overwrite deletes them: "
                        "give one of the two")
    held = has_checkpoints(root)
    if cfg.resume:
        path = needed_checkpoint(root, "move the damaged folders away, or start again from step 0 with --overwrite "
                                       "instead of --resume", warn, prefix="--resume: ")
        if path is None:
            if warn:
                what = "an empty folder" if root.is_dir() else "no such folder yet: it is made"
                warn(f"no checkpoint found in {root.absolute()} ({what}); starting from step 0 (a run meant to be "
                     f"continued has its checkpoints elsewhere)")
            return 0
        if why := model_mismatch(path, model_shapes()):
            written = json.loads((path / "trainer_state.json").read_text()).get("config") or {}
            source = written.get("init_from") or written.get("model")
            raise UserError(f"--resume: {path} holds another model{f' ({source})' if source else ''} than "
                            f"{cfg.init_from or cfg.model}: {why}; point --checkpoint-dir at this model's checkpoints")
        return step_of(path)
    if not held:
        return 0
    newest = step_folders(root)
    if not cfg.overwrite:
        which = f" (newest {newest[-1].name})" if newest else ""
        raise UserError(f"--checkpoint-dir {root} already holds checkpoints{which}: add --resume to continue from "
                        f"the newest, or --overwrite to start again from step 0 (removes them), or choose another folder")
    if owner:
        for path in newest:
            _discard(path)
        (root / "latest").unlink(missing_ok=True)
        log(f"--overwrite: removed {len(newest)} checkpoint(s) from {root}")
    return 0


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
