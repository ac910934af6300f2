"""Pipeline parallelism through `torch.distributed.pipelining`: the model is cut into pp x v stages by cost, each
pp rank builds only its stages (on the meta device, before TP / checkpointing / compile / FSDP2), and one of torch's
schedules runs the micro-batches.

The cut: `planner.memory.partition` -- the same function the planner prices plans with, whose chunks and per-layer
costs train/build.py passes in (parallel/ imports no planner) -- splits the layers into contiguous chunks that balance
training FLOPs per token (dense and MoE layers, MLA and attention at this sequence length, the output head and its
loss riding on the last chunk), not layer counts; a DeepSeek-V3 head costs about 1.5 layers. The embedding computes
nothing worth balancing and goes with the first chunk. V3's MTP modules live on the last stage, beside the head they
share; when they train (--mtp-layers), every stage before the last passes the embedding's output on beside the hidden
states ([h; embedding] on the last dim: two tensors' worth between stages), since the last stage holds no embedding,
and the gradient of the MTP loss flows back to the embedding the same way.

Stage s of rank r: looped schedules give rank r the stages r, r + pp, r + 2pp, ... (`parallel.dims.rank_chunks`);
ZBVZeroBubble gives it r and 2pp - 1 - r (the V shape). Each stage is a `Transformer` that keeps only its layers (the
ModuleDict keeps the global layer indices, so parameter names -- and checkpoints -- are those of the whole model):
the first holds the embedding, the last the final norm and head; the others take and return hidden states.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from paraseek.models.args import ModelArgs
from paraseek.models.deepseek import Transformer
from paraseek.parallel.dims import rank_chunks


@dataclass(frozen=True)
class StageSpec:
    index: int  # 0 .. n_stages - 1, in model order
    layers: tuple[int, ...]  # global layer indices
    first: bool
    last: bool
    cost: float  # the planner's training FLOPs per token of the stage (head included on the last)


def stage_specs(chunks: tuple[tuple[int, int], ...], layer_costs: list[float]) -> list[StageSpec]:
    """The stages of a split: `chunks` the contiguous layer ranges [start, end) in model order, `layer_costs` each
    layer's cost (the caller, train/build.py, takes both from planner.memory: partition and layer_cost)."""
    return [StageSpec(index=s, layers=tuple(range(a, b)), first=s == 0, last=s == len(chunks) - 1,
                      cost=sum(layer_costs[a:b]))
            for s, (a, b) in enumerate(chunks)]


def rank_stages(pp_rank: int, pp: int, v: int, schedule: str) -> list[int]:
    """The stage indices pp rank `pp_rank` holds, in model order (parallel/dims.py: rank_chunks)."""
    return sorted(rank_chunks(pp, v, schedule)[pp_rank])


def describe(specs: list[StageSpec], pp: int, v: int, schedule: str, mtp: int = 0) -> str:
    """The per-stage estimates the split balanced, for the run's header (`mtp`: the MTP modules the last stage
    trains, which the split does not price)."""
    mean = sum(s.cost for s in specs) / len(specs)
    owner = {s: r for r in range(pp) for s in rank_stages(r, pp, v, schedule)}
    lines = [f"pipeline: {len(specs)} stages on {pp} ranks ({schedule}), cut by the planner's cost per token "
             f"(mean {mean / 1e9:.3g} GFLOP/token):"]
    for s in specs:
        span = f"layer {s.layers[0]}" if len(s.layers) == 1 else f"layers {s.layers[0]}-{s.layers[-1]}"
        parts = (["embedding"] if s.first else []) + [span] + \
                (["norm + head + loss"] if s.last else []) + \
                ([f"{mtp} MTP module{'s' if mtp > 1 else ''}"] if s.last and mtp else [])
        lines.append(f"  stage {s.index} (pp rank {owner[s.index]}): {', '.join(parts)}: "
                     f"{s.cost / 1e9:.3g} GFLOP/token ({s.cost / mean:.2f}x mean)")
    return "\n".join(lines)


def build_stage(args: ModelArgs, spec: StageSpec) -> Transformer:
    """A meta-device Transformer holding only `spec`'s layers (+ embedding on the first, norm/head/MTP on the last)."""
    with torch.device("meta"):
        stage = Transformer(args)
    keep = {str(i) for i in spec.layers}
    for key in [k for k in stage.layers if k not in keep]:
        del stage.layers[key]
    if not spec.first:
        stage.embed_tokens = None
    if not spec.last:
        stage.norm = None
        stage.lm_head = None
        stage.mtp = nn.ModuleList()
    return stage


def whole_model_view(args: ModelArgs, stages: list[Transformer]) -> Transformer:
    """A Transformer whose submodules are this rank's stages' own modules (shared, not copied): its parameter names
    are the whole model's, so checkpointing, the optimizer's state dict and the telemetry see one model."""
    with torch.device("meta"):
        view = Transformer(args)
    view.layers = nn.ModuleDict({k: m for st in stages for k, m in st.layers.items()})
    firsts = [st for st in stages if st.embed_tokens is not None]
    lasts = [st for st in stages if st.norm is not None]
    view.embed_tokens = firsts[0].embed_tokens if firsts else None
    view.norm = lasts[0].norm if lasts else None
    view.lm_head = lasts[0].lm_head if lasts else None
    view.mtp = lasts[0].mtp if lasts else nn.ModuleList()
    view.mtp_depth = stages[0].mtp_depth
    return view


class Pipeline:
    """This rank's stages and torch's schedule; `step(inputs, labels)` runs forward and backward of every
    micro-batch and returns the losses the last stage computed (an empty list on other ranks). `seq_shards`: the
    hidden states between stages hold T / seq_shards positions (tensor parallelism's sequence sharding)."""

    def __init__(self, stages: list[Transformer], stage_ids: list[int], n: int, schedule: str, n_microbatches: int,
                 loss_fn, device: torch.device, group: dist.ProcessGroup, seq_shards: int = 1):
        # Imported here, as only pipelined runs need it: torch.distributed.pipelining imports torch._dynamo (~1 s
        # of a process's start; FSDP2 imports it too, DDP and the parent never do).
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

        self.has_first, self.has_last = 0 in stage_ids, n - 1 in stage_ids
        for st in stages:
            if st.embed_tokens is None and seq_shards > 1:
                st.register_forward_pre_hook(_whole_sequence_length(seq_shards), with_kwargs=True)
        pipe_stages = [PipelineStage(st, sid, n, device, group=group) for st, sid in zip(stages, stage_ids)]
        cls = get_schedule_class(schedule)
        # scale_grads=False: the loss is already normalized by the tokens per rank and step (see train.loop).
        if issubclass(cls, PipelineScheduleSingle):
            self.schedule = cls(pipe_stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
        else:
            self.schedule = cls(pipe_stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
        # By default the last stage keeps every micro-batch's logits and concatenates them at the end of step(): a
        # 102k-129k vocabulary makes that GiBs. Releases that have the switch get it turned off.
        params = inspect.signature(self.schedule.step).parameters
        self.step_kw = {"return_outputs": False} if "return_outputs" in params else {}

    def step(self, inputs_BT: torch.Tensor, labels_BT: torch.Tensor,
             positions_BT: torch.Tensor | None = None, mtp: bool = False) -> list[torch.Tensor]:
        """`positions_BT` (packed documents) goes to every stage as a keyword argument: torch's schedules split
        keyword inputs into micro-batches and hand them to each stage's forward, first or not. `mtp`: the labels go
        the same way (Transformer.forward's mtp_labels_BT), so that the last stage returns (logits, MTP losses)."""
        kw = {**self.step_kw, "mtp_labels_BT": labels_BT} if mtp else self.step_kw
        return self._run(self.schedule.step, inputs_BT, labels_BT, positions_BT, kw)

    def eval(self, inputs_BT: torch.Tensor, labels_BT: torch.Tensor,
             positions_BT: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Forward only (the schedule's eval): the losses of every micro-batch on the last stage."""
        return self._run(self.schedule.eval, inputs_BT, labels_BT, positions_BT, {})

    def _run(self, call, inputs_BT, labels_BT, positions_BT, kw: dict) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        args = (inputs_BT,) if self.has_first else ()
        if positions_BT is not None:
            kw = {**kw, "positions_BT": positions_BT}
        if self.has_last:
            call(*args, target=labels_BT, losses=losses, **kw)
        else:
            call(*args, **kw)
        return losses


def _whole_sequence_length(seq_shards: int):
    """A stage's forward pre-hook: the schedule calls a stage with its input alone, which for a stage after the
    first holds T / seq_shards positions; RoPE needs the whole sequence's length (Transformer.forward's seq_len)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, "seq_len": args[0].shape[1] * seq_shards}

    return hook
