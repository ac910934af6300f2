"""This rank's model, in the order no rank ever holds the whole model: build on the meta device (only this rank's
pipeline stages) -> parallelize (parallel/parallelize.py) -> materialize -> initialize (the same weights under every
plan, models/init.py) or load an HF folder -> (DDP); then `resume` puts a checkpoint's model, optimizer and data
position in place."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from torch import nn

from paraseek.models import resolve_model
from paraseek.models.args import ModelArgs
from paraseek.models.checkpoint_read import latest_checkpoint
from paraseek.models.deepseek import Transformer
from paraseek.models.hf import load_state_into
from paraseek.models.lora import init_adapters, is_adapter
from paraseek.models.lora_spec import LoRASpec
from paraseek.models.weights import held_mtp_modules
from paraseek.parallel.mesh import ParallelMesh
from paraseek.parallel.parallelize import apply_ddp, parallelize
from paraseek.parallel.pipeline import StageSpec, build_stage, rank_stages, stage_specs, whole_model_view
from paraseek.planner.memory import layer_cost, model_terms, partition
from paraseek.train import mtp as mtp_flags
from paraseek.train.checkpoint import load_checkpoint
from paraseek.train.config import TrainConfig
from paraseek.train.loader import DataLoader


@dataclass
class Model:
    """This rank's part of the model and what parallelizing it returned."""

    args: ModelArgs
    parts: list[Transformer]  # this rank's pipeline stages, in model order (the whole model without pp)
    stage_ids: list[int]
    specs: list[StageSpec] | None  # every stage's layers and cost (pp > 1)
    inner: Transformer  # the model as named parameters (checkpoints, telemetry): one view over the stages
    model: nn.Module  # what runs forward without pp: inner, or DDP around it
    tp_partial: list[nn.Module]  # modules whose parameters' gradients are partial over tp (reduce_tp_grads)
    seq_shards: int  # hidden states between stages hold T / seq_shards positions
    lora: LoRASpec | None = None  # the adapters trained on the frozen model (--lora-rank)
    fp8_precompute: bool = False  # --fp8 tensorwise under FSDP2: float8 scales precomputed after each step
    mtp_depth: int = 0  # the MTP depths trained (--mtp-layers); args.n_mtp_layers the modules held
    mtp_held: int = 0  # the MTP modules the model came with (the others, up to mtp_depth, created fresh)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def build(cfg: TrainConfig, mesh: ParallelMesh, device: torch.device) -> Model:
    torch.manual_seed(cfg.seed)  # torch's global generator, for whatever draws from it (nothing in the model does)
    args, _, _ = resolve_model(cfg.init_from or cfg.model)
    held = held_mtp_modules(args, cfg.init_from or None)
    depth = mtp_flags.depth_of(cfg.mtp_layers, held)
    args = mtp_flags.run_args(args, held, depth)
    lora = cfg.lora_for(args)
    dims = mesh.dims
    specs, stage_ids = None, [0]
    if dims.pp > 1:
        t = model_terms(args, cfg.seq_len)
        specs = stage_specs(partition(t, dims.n_stages), [layer_cost(t, i) for i in range(args.n_layers)])
        stage_ids = rank_stages(mesh.pp_rank, dims.pp, dims.pp_virtual_stages, dims.pp_schedule)
        parts = [build_stage(args, specs[sid]) for sid in stage_ids]
    else:
        with torch.device("meta"):
            parts = [Transformer(args)]
    tp_partial, seq_shards = [], 1
    for sid, part in zip(stage_ids, parts):
        # The MTP modules the run does not train are kept (checkpoints, export) frozen, so the optimizer holds no
        # state for them; the trained ones run in every forward (Transformer.mtp_depth, on every pipeline stage).
        part.mtp_depth = depth
        for module in list(part.mtp)[depth:]:
            module.requires_grad_(False)
        done = parallelize(part, mesh, precision=cfg.precision, activation_checkpointing=cfg.activation_checkpointing,
                           compile=cfg.compile, reshard_after_forward=cfg.reshard_after_forward,
                           cpu_offload=cfg.cpu_offload, lora=lora, fp8=cfg.fp8,
                           fp8_experts=cfg.fp8_experts == "on")
        tp_partial += done.tp_partial
        seq_shards = done.seq_shards
        part.to_empty(device="cpu" if cfg.cpu_offload else device)
        if cfg.init_from:
            fresh = load_state_into(part, cfg.init_from, stage=dims.pp > 1, fresh_mtp=True)
            part.init_buffers(device)
            if fresh:  # MTP modules the folder has no weights for: from the same (seed, name) draws as any other
                part.init_weights(device=device, seed=cfg.seed, select=fresh.__contains__)
        else:  # every tensor from its own (seed, name) generator: each layout starts from one process's weights
            part.init_weights(device=device, seed=cfg.seed)
        if lora is not None:  # the loader leaves the adapters alone
            init_adapters(part, cfg.seed, device)
    inner = parts[0] if dims.pp == 1 else whole_model_view(args, parts)
    model = apply_ddp(inner, mesh, device, cfg.grad_compression) if dims.ddp else inner
    return Model(args, parts, stage_ids, specs, inner, model, tp_partial, seq_shards, lora, done.fp8_precompute,
                 depth, held)


def resume(cfg: TrainConfig, inner: Transformer, optimizer: torch.optim.Optimizer, loader: DataLoader, scaler,
           is_main: bool) -> dict | None:
    """The newest complete checkpoint's model, optimizer, loss scale and data position (--resume); returns its trainer
    state with "path" added, or None for a start at step 0. The launcher has checked the folder already
    (checkpoint.prepare_checkpoint_dir: what was skipped, a damaged or foreign folder), so this is quiet."""
    state = None
    if cfg.resume:
        path = latest_checkpoint(cfg.checkpoint_dir)
        if path is None:
            if is_main:
                print(f"no checkpoint in {cfg.checkpoint_dir} yet: starting from step 0", flush=True)
        else:
            saved = json.loads((path / "trainer_state.json").read_text()).get("mtp_depth", 0)
            mtp_flags.check_resume(saved, inner.mtp_depth, path)
            # A LoRA checkpoint holds the adapters only; the frozen base came from --init-from (build).
            state = dict(load_checkpoint(path, inner, optimizer, scaler, model_keys=is_adapter if cfg.lora_rank else None),
                         path=str(path))
            loader.load_state_dict(state["data"])
            if is_main:
                print(f"resumed from {path} at step {state['step']}", flush=True)
    if state is None:
        loader.load_state_dict({"position": 0})
    return state
