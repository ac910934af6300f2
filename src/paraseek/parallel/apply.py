"""The parallelize order, applied to a model still on the meta device (TorchTitan's order):
activation checkpointing -> torch.compile per block -> FSDP2 per block + root (or DDP after materializing).
Tensor/expert/pipeline parallelism slot in before checkpointing (see DESIGN.md)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from paraseek.models.deepseek import Transformer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_mesh(device_type: str, dp_replicate: int, dp_shard: int, ep: int = 1, tp: int = 1, pp: int = 1) -> DeviceMesh:
    """One named mesh. pp is the outermost dimension (stages exchange only activations, point to point: the
    cheapest traffic crosses the slowest links), then dp_replicate, then dp_shard, so a node's ranks share a shard
    group and HSDP reduce-scatters inside the node and all-reduces across nodes. With expert parallelism dp_shard
    is built as (dp_shard_mod_ep, ep) -- EP groups are `ep` consecutive ranks -- and flattened back into "dp_shard"
    for FSDP2 (DeviceMesh._flatten: in torch 2.11 and 2.13 alike). tp is the innermost dim, so a tensor-parallel
    group is `tp` consecutive ranks (one NVLink island)."""
    tp_dims = ((tp,), ("tp",)) if tp > 1 else ((), ())
    pp_dims = ((pp,), ("pp",)) if pp > 1 else ((), ())
    if ep == 1:
        return init_device_mesh(device_type, pp_dims[0] + (dp_replicate, dp_shard) + tp_dims[0],
                                mesh_dim_names=pp_dims[1] + ("dp_replicate", "dp_shard") + tp_dims[1])
    mesh = init_device_mesh(device_type, pp_dims[0] + (dp_replicate, dp_shard // ep, ep) + tp_dims[0],
                            mesh_dim_names=pp_dims[1] + ("dp_replicate", "dp_shard_mod_ep", "ep") + tp_dims[1])
    mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
    return mesh


# Ops whose outputs selective checkpointing keeps: the matmuls and attention (costly to recompute); everything
# elementwise (norms, SiLU, RoPE, residual adds) is recomputed in the backward pass.
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


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """full: keep only each block's input; selective: keep matmul/attention outputs, recompute the rest."""
    if mode == "none":
        return
    for key, block in list(model.layers.items()):
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(
                block, preserve_rng_state=False,
                context_fn=lambda: create_selective_checkpoint_contexts(_selective_policy),
            )
        model.layers[key] = wrapped


def apply_compile(model: Transformer) -> None:
    """torch.compile each block in place (module.compile keeps parameter names, so checkpoints don't change)."""
    for block in model.layers.values():
        block.compile()


def apply_fsdp(model: Transformer, mesh: DeviceMesh, precision: str, reshard_after_forward: bool, cpu_offload: bool,
               expert_dp_mesh: DeviceMesh | None = None) -> None:
    """FSDP2 per block, then the root (embedding, final norm, head). With dp_replicate > 1 the 2-D mesh makes it HSDP.
    Mixed precision: compute in `precision`, keep fp32 master weights, reduce gradients in fp32. With expert
    parallelism the EP-sharded experts are wrapped first, over the dp ranks outside their EP group."""
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)
    dp_mesh = mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]
    kw = dict(mesh=dp_mesh, mp_policy=mp)
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    if expert_dp_mesh is not None:
        from paraseek.parallel.expert import apply_expert_fsdp

        dp_size = mesh["dp_replicate"].size() * mesh["dp_shard"].size()
        expert_kw = {k: v for k, v in kw.items() if k != "mesh"}
        apply_expert_fsdp(model, expert_dp_mesh, dp_size, reshard_after_forward=reshard_after_forward, **expert_kw)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block is resharded by the root's backward anyway; keeping it gathered saves one all-gather.
        fully_shard(block, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1, **kw)
    for mtp in model.mtp:
        fully_shard(mtp, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kw)


def apply_ddp(model: nn.Module, mesh: DeviceMesh, device: torch.device, grad_compression: str) -> nn.Module:
    """DDP over the replicate dimension (after materializing), with torch's bf16 or PowerSGD communication hooks."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    group = mesh["dp_replicate"].get_group()
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
