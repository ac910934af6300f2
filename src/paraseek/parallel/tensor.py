"""Tensor parallelism with sequence parallelism through PyTorch's DTensor TP API (TorchTitan's plan, adapted to MLA
and DeepSeekMoE).

Megatron-LM's layout (Shoeybi et al. 2019, sec. 3): column-parallel q/k/v (or MLA's up-projections) and gate/up,
row-parallel o and down, so each block costs one all-reduce in forward and one in backward per sub-layer. With
sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2) the all-reduce becomes a reduce-scatter + all-gather
pair and everything between two sub-layers (norms, residual adds, the routed experts here) runs on T / tp tokens.
The vocabulary is sharded too: the embedding row-wise (each rank owns V / tp rows) and the output head
column-wise, whose logits stay sharded on V and go straight into `loss_parallel()` -- the [B, T, V] logits of a
102k-129k vocabulary are never gathered whole.

Layouts (tp ranks of one dp rank all see the same batch; S = sequence-sharded Shard(1), R = replicated):

    embed_tokens   RowwiseParallel      ids R -> h S (SP) or R
    *norm          SequenceParallel     S -> S (SP only; without SP the norms are plain modules on R)
    self_attn      q,k,v colwise / o rowwise (GQA); MLA: q_proj|q_b_proj, kv_b_proj colwise, o_proj rowwise,
                   q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm replicated (the latent is shared)
    mlp (dense)    gate/up colwise, down rowwise
    mlp (MoE)      shared experts as a dense MLP on all tokens; router + routed experts replicated and run on
                   this rank's T / tp tokens (SP) -- each rank routes its own tokens -- or on all tokens (no SP)
    lm_head        ColwiseParallel      h S|R -> logits Shard(-1), a DTensor for loss_parallel()
    mtp.k          block as above; enorm, hnorm, eh_proj and norm SequenceParallel (token-wise, replicated weights);
                   the embedding's output gathered (S -> R) for the shift by k (in backward the shifted gradient
                   is gathered and each rank keeps its own positions' part)

Gradients of replicated parameters. A replicated parameter that only sees this rank's tokens (SP norms, the router
and routed experts) or only this rank's heads (MLA's shared down-projections, whose output feeds the local heads)
gets a partial gradient; the true one is the sum over tp. The norms are Replicate DTensors, whose gradient comes
back as a Partial DTensor that FSDP2 reduces on its own. The router, the routed experts and MLA's replicated
modules stay plain parameters (the routing code indexes, sorts and splits by counts: it runs on local tensors):
`apply_tensor_parallel` returns these modules, and `reduce_tp_grads(model, partial, tp_mesh)` sums their gradients
over tp -- after the last backward of a step, before clipping (it also reduces the norms' Partial gradients where no
FSDP2 did).

The loss: inside `torch.distributed.tensor.parallel.loss_parallel()`, forward *and* backward,
`F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")` on the vocab-sharded DTensor logits
(labels a plain tensor, the same on every tp rank) returns a replicated DTensor scalar (train/optim.py:token_loss).

Order: parallel/parallelize.py (EP -> float8 linears -> TP -> activation checkpointing -> torch.compile -> FSDP2 on
the dp sub-mesh of the same DeviceMesh, tp its innermost dim), on a model still on the meta device. The styles shard
torchao's float8 linears (--fp8) as they do nn.Linear, their weights DTensors; tensorwise scales are the whole
tensor's (tests/dist/test_fp8_training.py: the dense model's step-1 loss and gradients equal one process's).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from paraseek.models.deepseek import MLA, MLP, Attention, Block, MoE, Transformer

class _ReplicateKeepPartialGrad(torch.autograd.Function):
    """A local tensor, equal on every tp rank, as a Replicate DTensor for a column-parallel layer, whose gradient
    comes back as this rank's summand (the Partial DTensor's local part) instead of being all-reduced there.

    Used inside MLA, where the replicated down-projections and the shared RoPE key feed only this rank's heads:
    their gradients are all partial, and the sum over tp happens once, where the attention input was gathered."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh) -> DTensor:  # type: ignore[override]
        return DTensor.from_local(x, mesh, (Replicate(),), run_check=False)

    @staticmethod
    def backward(ctx, grad: DTensor):  # type: ignore[override]
        # A column-parallel matmul's input gradient is Partial: its local tensor is this rank's summand. No branch
        # on the placements: torch.compile traces this backward once with the forward output's (Replicate) ones.
        return (grad.to_local() if isinstance(grad, DTensor) else grad), None


def _colwise_keep_partial_grad(linear: nn.Linear, mesh: DeviceMesh) -> None:
    """ColwiseParallel's sharding (weight and bias Shard(0), local output Shard(-1)) but an input whose gradient
    stays this rank's partial summand (_ReplicateKeepPartialGrad) instead of ColwiseParallel's all-reduce. Written
    with distribute_module rather than an extra hook in front of ColwiseParallel's: torch 2.11's dynamo fails to
    build guards for prepended hooks."""

    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

    def input_fn(module: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
        x, *rest = args
        return (x if isinstance(x, DTensor) else _ReplicateKeepPartialGrad.apply(x, mesh), *rest)

    def output_fn(module: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        return out.to_local()

    distribute_module(linear, mesh, partition, input_fn, output_fn)


def _gather_attention_input(mesh: DeviceMesh, layout):
    """MLA's input pre-hook: the sequence shard (SP) or replicated input becomes the full local tensor; in backward
    the partial input gradient of this rank's heads is reduce-scattered (SP) or all-reduced over tp."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        x_dt = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (layout,), run_check=False)
        if layout != Replicate():
            x_dt = x_dt.redistribute(placements=(Replicate(),))
        return (x_dt.to_local(grad_placements=(Partial(),)), *rest)

    return hook


def _parallelize_attention(attn: Attention, mesh: DeviceMesh, seq: object) -> None:
    parallelize_module(attn, mesh, {
        "": PrepareModuleInput(input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)),
        "q_proj": ColwiseParallel(),
        "k_proj": ColwiseParallel(),
        "v_proj": ColwiseParallel(),
        "o_proj": RowwiseParallel(output_layouts=seq),
    })


def _parallelize_mla(attn: MLA, mesh: DeviceMesh, seq: object) -> list[nn.Module]:
    """Returns the replicated modules of the latent path, whose gradients are partial over tp."""
    parallelize_module(attn, mesh, {"o_proj": RowwiseParallel(output_layouts=seq)})
    attn.register_forward_pre_hook(_gather_attention_input(mesh, seq))
    for name in ("q_b_proj" if attn.q_lora_rank else "q_proj", "kv_b_proj"):
        _colwise_keep_partial_grad(getattr(attn, name), mesh)
    return [getattr(attn, name) for name in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")
            if hasattr(attn, name)]


def _parallelize_mlp(mlp: MLP, mesh: DeviceMesh, layout: object, out_layout: object) -> None:
    parallelize_module(mlp, mesh, {
        "": PrepareModuleInput(input_layouts=(layout,), desired_input_layouts=(Replicate(),)),
        "gate_proj": ColwiseParallel(),
        "up_proj": ColwiseParallel(),
        "down_proj": RowwiseParallel(output_layouts=out_layout),
    })


def _parallelize_moe(moe: MoE, mesh: DeviceMesh, sequence_parallel: bool) -> list[nn.Module]:
    """Returns the router and the routed experts under SP (each tp rank routes its own tokens through them: their
    gradients are partial over tp)."""
    partial = []
    if sequence_parallel:
        # The MoE works on this rank's tokens as a plain tensor: routing sorts and splits rows by expert counts.
        parallelize_module(moe, mesh, PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                                         use_local_output=True))
        partial = [moe.gate, moe.experts]
    if moe.shared_experts is not None:
        # MoE.forward hands the shared experts its flattened tokens [N, D]: with SP, this rank's N / tp rows
        # (Shard(0) of the rank-ordered concatenation), gathered for the column-parallel projections and
        # reduce-scattered back to the same rows.
        layout = Shard(0) if sequence_parallel else Replicate()
        _parallelize_mlp(moe.shared_experts, mesh, layout, layout)
    return partial


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool = True) -> list[nn.Module]:
    """Shard `model` in place over the 1-D `tp_mesh` (the "tp" sub-mesh of the run's DeviceMesh); before
    activation checkpointing, torch.compile and FSDP2, on the meta device or on real weights. Returns the modules
    whose own parameters get partial gradients over tp, for `reduce_tp_grads`.

    Tied embeddings are supported: the embedding's vocab-sharded weight serves as the column-parallel head.
    The MTP modules' blocks are sharded as the main blocks; their norms and eh_proj are token-wise and run on this
    rank's positions under SP (replicated weights, as the norms), and each module gathers the embedding's output,
    whose position i + k it combines with position i (MTPModule). tp must divide the model's heads, widths and
    vocabulary, and under SP the sequence length (parallel.dims.ParallelDims.check says so before a run starts)."""
    if tp_mesh.size() == 1:
        return []
    if any(not isinstance(b, Block) for b in [*model.layers.values(), *(m.block for m in model.mtp)]):
        raise ValueError("apply_tensor_parallel must run before activation checkpointing / compile wrap the blocks")
    seq = Shard(1) if sequence_parallel else Replicate()
    partial: list[nn.Module] = []
    if model.embed_tokens is not None:
        parallelize_module(model.embed_tokens, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=seq))
        model.embed_tokens.register_forward_hook(_sync_redistribute(seq), prepend=True)
    for block in model.layers.values():
        partial += _parallelize_block(block, tp_mesh, sequence_parallel)
    head_inputs = [model.norm] if model.norm is not None else []
    for mtp in model.mtp:
        partial += _parallelize_block(mtp.block, tp_mesh, sequence_parallel)
        head_inputs.append(mtp.norm)
        if sequence_parallel:
            # The embedding's output whole (all-gathered), for the shift by k; enorm then takes this rank's positions.
            parallelize_module(mtp, tp_mesh, PrepareModuleInput(
                input_layouts=(None, Shard(1), None, None), desired_input_layouts=(None, Replicate(), None, None),
                use_local_output=False))
            for norm in (mtp.enorm, mtp.hnorm):
                parallelize_module(norm, tp_mesh, SequenceParallel())
            # Token-wise too: replicated weight on this rank's positions, a plain tensor out for the block.
            parallelize_module(mtp.eh_proj, tp_mesh, SequenceParallel(use_local_output=True))
    for norm in head_inputs:
        if sequence_parallel:
            parallelize_module(norm, tp_mesh, SequenceParallel())
        if model.lm_head is None:
            # Tied: forward computes F.linear(h, embed_tokens.weight), a Shard(0) DTensor over the vocab; a
            # replicated DTensor h makes that a column-parallel matmul whose logits come out Shard(-1) with no
            # communication.
            parallelize_module(norm, tp_mesh, PrepareModuleOutput(
                output_layouts=seq, desired_output_layouts=Replicate(), use_local_output=False))
    if model.lm_head is not None:
        parallelize_module(model.lm_head, tp_mesh,
                           ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False))
    return partial


def _parallelize_block(block: Block, tp_mesh: DeviceMesh, sequence_parallel: bool) -> list[nn.Module]:
    """One block's TP plan; returns its modules whose gradients are partial over tp."""
    seq = Shard(1) if sequence_parallel else Replicate()
    partial: list[nn.Module] = []
    if sequence_parallel:
        parallelize_module(block.input_layernorm, tp_mesh, SequenceParallel())
        parallelize_module(block.post_attention_layernorm, tp_mesh, SequenceParallel())
    if isinstance(block.self_attn, MLA):
        partial += _parallelize_mla(block.self_attn, tp_mesh, seq)
    else:
        _parallelize_attention(block.self_attn, tp_mesh, seq)
    if isinstance(block.mlp, MoE):
        partial += _parallelize_moe(block.mlp, tp_mesh, sequence_parallel)
    else:
        _parallelize_mlp(block.mlp, tp_mesh, seq, seq)
    return partial


def _sync_redistribute(layout):
    """Forward hook ahead of RowwiseParallel's own: reduce the embedding's partial output synchronously. The style
    redistributes with async_op=True, and the resulting AsyncCollectiveTensor entering a torch.compile'd block
    loses its DTensor gradient on the way back (seen in torch 2.13: "'Tensor' object has no attribute
    '_local_tensor'" in Redistribute.backward)."""

    def hook(module: nn.Module, args: tuple, out: DTensor) -> DTensor:
        return out.redistribute(placements=(layout,)) if out.placements != (layout,) else out

    return hook


@torch.no_grad()
def reduce_tp_grads(model: nn.Module, partial: list[nn.Module], tp_mesh: DeviceMesh) -> None:
    """Finish the gradients of tensor-parallel replicated parameters; after the step's last backward, before
    clipping (and after FSDP2's reduce-scatter, which backward already ran).

    Sums over tp the gradients of the `partial` modules' own parameters (what apply_tensor_parallel returned), one
    all-reduce per dtype: their local gradient (a plain tensor, or FSDP2's dp shard, which every tp rank of a dp rank
    holds alike) is this rank's summand. Redistributes any remaining Partial DTensor gradient of `model` (SP norms
    when no FSDP2 reduced them) to its parameter's placements."""
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for m in partial:
        for p in m.parameters(recurse=False):
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad  # no_grad: the same storage
                buckets.setdefault((g.dtype, g.device), []).append(g)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=tp_mesh.get_group())
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))
    for p in model.parameters():
        if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def loss_context(tensor_parallel: bool):
    """`loss_parallel()` when the model is tensor-parallel, else a no-op; wrap forward, loss and backward in it."""
    return loss_parallel() if tensor_parallel else nullcontext()


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: the whole value of a DTensor (gathered if sharded, e.g. the replicated scalar loss_parallel's
    loss is), `t` itself otherwise."""
    return t.full_tensor() if isinstance(t, DTensor) else t


__all__ = ["apply_tensor_parallel", "reduce_tp_grads", "loss_context", "full_value"]
