"""`parallelize`: the fixed order in which a model (or one pipeline stage) still on the meta device becomes this rank's
part of the plan -- TorchTitan's order, each step before the ones that wrap what it changes:

    EP       routed experts sharded over the ep group (expert.py); first, as it replaces each MoE's experts module
    LoRA     the base frozen (stored in the compute dtype) and adapters added (models/lora.py), sharded over the ep
             group like the experts they adapt; before FSDP2, which then shards the adapters and their gradients
    FP8      the block projections as torchao float8 linears (fp8.py); before TP, whose styles then shard the
             float8 linears as they would nn.Linear (the filter sees the whole projections' shapes), and before AC,
             compile and FSDP2, which then all-gathers their weights in float8 (tensorwise, without TP)
    TP       tensor + sequence parallelism over the tp group (tensor.py), on the plain blocks
    AC       activation checkpointing of each block (full or selective)
    compile  torch.compile of each block
    FSDP2    per block, then the root, over (dp_replicate, dp_shard) -- HSDP when dp_replicate > 1 -- with the EP
             experts over the dp ranks outside their EP group; under DDP nothing here: `apply_ddp` wraps the
             materialized model

It returns what it did that the step needs (`Parallelized`), so nothing travels through module attributes or the
model. Materializing and initializing come after (train/build.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from paraseek.models.deepseek import Transformer
from paraseek.models.lora import apply_lora
from paraseek.models.lora_spec import LoRASpec
from paraseek.parallel.expert import apply_expert_fsdp, apply_expert_parallel
from paraseek.parallel.mesh import ParallelMesh
from paraseek.parallel.tensor import apply_tensor_parallel
from paraseek.parallel.dims import float8_all_gather

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Parallelized:
    """What `parallelize` did to one model or stage."""

    # Modules whose own parameters get partial gradients over tp (MLA's shared down-projections; the router and
    # routed experts under SP): `tensor.reduce_tp_grads` sums them after the step's last backward.
    tp_partial: list[nn.Module] = field(default_factory=list)
    # Hidden states between pipeline stages hold T / seq_shards positions (tp under sequence parallelism).
    seq_shards: int = 1
    fp8_precompute: bool = False  # tensorwise under FSDP2: fp8.precompute_scales after each optimizer step


def parallelize(model: Transformer, mesh: ParallelMesh, *, precision: str, activation_checkpointing: str = "none",
                compile: bool = False, reshard_after_forward: bool = True, cpu_offload: bool = False,
                lora: LoRASpec | None = None, fp8: str = "off", fp8_experts: bool = False) -> Parallelized:
    """EP -> LoRA -> FP8 -> TP -> AC -> compile -> FSDP2 on `model` in place (see the module docstring)."""
    dims, done = mesh.dims, Parallelized()
    if mesh.ep is not None:
        apply_expert_parallel(model, mesh.ep)
    if lora is not None:
        apply_lora(model, lora, base_dtype=DTYPES[precision])
    if fp8 != "off":
        from paraseek.parallel.fp8 import apply_fp8

        gather = float8_all_gather(dims, fp8)
        apply_fp8(model, fp8, float8_all_gather=gather, experts=fp8_experts)
        done.fp8_precompute = gather
    if mesh.tp is not None:
        done.tp_partial = apply_tensor_parallel(model, mesh.tp, dims.sequence_parallel)
        done.seq_shards = dims.tp if dims.sequence_parallel else 1
    apply_activation_checkpointing(model, activation_checkpointing)
    if compile:
        apply_compile(model)
    if not dims.ddp:
        # Pipelining runs several micro-batches through a stage before their backward: resharding after each
        # forward would all-gather the stage's parameters once per micro-batch (TorchTitan keeps them too). Without
        # pipelining, keeping them gathered saves all-gathers; with one data-parallel rank there are none to save,
        # only the memory of a second (bf16) copy, so the flag is ignored there.
        keep_gathered = dims.pp > 1 or (not reshard_after_forward and dims.dp > 1)
        apply_fsdp(model, mesh, precision, not keep_gathered, cpu_offload)
    return done


# Ops whose outputs selective checkpointing keeps: the matmuls and attention (costly to recompute); everything
# elementwise (norms, SiLU, RoPE, residual adds) is recomputed in the backward pass. Under --fp8 the projections'
# _scaled_mm is recomputed, as in TorchTitan's list; a run that kept it (and the casts' abs-maxes) was no faster
# (BENCHMARKS.md, fp8: not yet measured in isolation).
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.all_to_all_single.default,  # expert dispatch: never redo communication
}
if hasattr(torch.ops.aten, "_grouped_mm"):
    _SAVE_OPS.add(torch.ops.aten._grouped_mm.default)
if hasattr(torch.ops.aten, "_scaled_grouped_mm"):  # the routed experts under --fp8-experts (models/fp8_grouped.py)
    _SAVE_OPS.add(torch.ops.aten._scaled_grouped_mm.default)


# A low-rank product is recomputed: a matmul whose contraction k is at most 64 and at most 1/8 of its output width N.
# That is LoRA's B (models/lora.py: [T, r] @ [r, O], and the experts' grouped one): it costs r/I of its base
# projection to redo, while keeping its [T, O] output holds a second copy of every adapted projection's output. On
# R1-Distill-Qwen-1.5B at 8,192 tokens per micro-batch that copy is 10.6 GiB (computed), and the H200 run with it
# saved peaked about 11 GiB above what the model states alone explain. (The ratio keeps the tiny test models'
# 64-wide projections saved, as a real model's are.)
_LOW_RANK_MAX_K, _LOW_RANK_MIN_WIDENING = 64, 8
_MATMULS = {torch.ops.aten.mm.default, getattr(torch.ops.aten, "_grouped_mm", torch.ops.aten.mm).default}


def _is_low_rank_product(op, args) -> bool:
    if op not in _MATMULS:
        return False
    k, n = args[0].shape[-1], args[1].shape[-1]
    return k <= _LOW_RANK_MAX_K and _LOW_RANK_MIN_WIDENING * k <= n


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if _is_low_rank_product(op, args):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """full: keep only each block's input; selective: keep matmul/attention outputs, recompute the rest. The MTP
    modules' blocks too."""
    if mode == "none":
        return

    def wrap(block: nn.Module) -> nn.Module:
        if mode == "full":
            return checkpoint_wrapper(block, preserve_rng_state=False)
        return checkpoint_wrapper(block, preserve_rng_state=False,
                                  context_fn=lambda: create_selective_checkpoint_contexts(_selective_policy))

    for key, block in list(model.layers.items()):
        model.layers[key] = wrap(block)
    for mtp in model.mtp:
        mtp.block = wrap(mtp.block)


def apply_compile(model: Transformer) -> None:
    """torch.compile each block in place (module.compile keeps parameter names, so checkpoints don't change), the
    MTP modules' blocks too."""
    for block in [*model.layers.values(), *(mtp.block for mtp in model.mtp)]:
        block.compile()


def apply_fsdp(model: Transformer, mesh: ParallelMesh, precision: str, reshard_after_forward: bool,
               cpu_offload: bool) -> None:
    """FSDP2 per block, then the root (embedding, final norm, head), over mesh.fsdp (HSDP when it is 2-D). Mixed
    precision: compute in `precision`, keep fp32 master weights, reduce gradients in fp32. With expert parallelism
    the EP-sharded experts are wrapped first, over mesh.expert_dp."""
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)
    kw: dict = dict(mp_policy=mp)
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    if mesh.expert_dp is not None:
        apply_expert_fsdp(model, mesh.expert_dp, mesh.dims.dp, reshard_after_forward=reshard_after_forward, **kw)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block is resharded by the root's backward anyway; keeping it gathered saves one all-gather.
        fully_shard(block, mesh=mesh.fsdp, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1, **kw)
    for mtp in model.mtp:
        fully_shard(mtp, mesh=mesh.fsdp, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, mesh=mesh.fsdp, reshard_after_forward=reshard_after_forward, **kw)


def apply_ddp(model: nn.Module, mesh: ParallelMesh, device: torch.device, grad_compression: str) -> nn.Module:
    """DDP over dp_replicate (after materializing), with torch's bf16 or PowerSGD communication hooks."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    group = mesh.dp_replicate.get_group()
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, process_group=group,
        broadcast_buffers=False,
    )
    if grad_compression == "bf16":
        ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
    elif grad_compression.startswith("powersgd:"):
        rank = int(grad_compression.split(":")[1])
        # Error feedback on, warm-start on: torch's defaults; start compressing after 10 plain iterations.
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=rank, start_powerSGD_iter=10)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp
