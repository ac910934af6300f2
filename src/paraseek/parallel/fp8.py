"""FP8 training with torchao's float8 linears (the optional extra `paraseek[fp8]`; torchao 0.17 for torch 2.11).

DeepSeek-V3 trained in FP8 (its report, section 3.3): the matmuls of the projections in float8 with fine-grained
scales, everything numerically delicate in higher precision. The recipes (torchao's, `--fp8 NAME`):

    tensorwise     one scale per tensor, computed from its max each step; under FSDP2 the weights are all-gathered
                   in float8 (half the bytes of bf16) and their scales precomputed once per step after the optimizer
                   (`precompute_scales`). The fastest; the coarsest scales.
    rowwise        one scale per row (of activations, weights and gradients): closer to bf16 numerically, a slower
                   scaled GEMM, no float8 all-gather.
    rowwise-gw-hp  rowwise, with the weight-gradient GEMM kept in high precision (torchao's rowwise_with_gw_hp).

What is converted (`fp8_filter`): the nn.Linear of the attention and MLP projections (dense MLPs and shared
experts) whose in and out features are multiples of 16, what the float8 GEMM (torch._scaled_mm) requires. The output
head, the MoE router, the embedding and the norms are not nn.Linear projections of a block and stay in the training
precision, as in DeepSeek-V3.

The routed experts (stacked [E, out, in] weights, one grouped GEMM per projection) run torchao's float8 grouped GEMM
(torch._scaled_grouped_mm; models/deepseek.py grouped_mm, token groups padded to 16 rows) under every recipe, and
always rowwise: it is the one scaling torchao's grouped GEMM has (one scale per row of the tokens, per output column
of each expert's weight, per group in the weight gradient). It needs Hopper (sm90: the kernel has no Ada or CPU
version), dims that are multiples of 16, and torchao's moe_training module; otherwise the experts stay in the
training precision (`fp8_experts` says which).

On a GPU this needs float8 tensor cores (compute capability 8.9: Ada, Hopper and newer). On CPU it is refused,
except for tests: PARASEEK_FP8_EMULATE=1 runs torchao's emulation (the same casts and scales, matmuls in high
precision; no speed-up), which is how the CPU suite checks the wiring and the loss.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

from paraseek.models.deepseek import Experts

RECIPES = ("tensorwise", "rowwise", "rowwise-gw-hp")
_TORCHAO_NAME = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise-gw-hp": "rowwise_with_gw_hp"}
_BLOCK_PARENTS = ("self_attn", "mlp", "shared_experts")  # the projections of a block
MIN_CAPABILITY = (8, 9)


def emulated() -> bool:
    return os.environ.get("PARASEEK_FP8_EMULATE") == "1"


def fp8_problem(recipe: str, device: str, capability: tuple[int, int] | None, *, tp: int, pp: int, lora: bool,
                ddp: bool) -> str | None:
    """Why `--fp8 recipe` cannot run here, or None. Checked before launch."""
    if recipe == "off":
        return None
    if device == "cpu" and not emulated():
        return "--fp8 needs a GPU with float8 tensor cores (compute capability 8.9+: Ada, Hopper); on CPU leave it out"
    if device == "cuda" and capability is not None and tuple(capability) < MIN_CAPABILITY:
        return (f"--fp8 needs float8 tensor cores (compute capability 8.9+: Ada, Hopper); this GPU has "
                f"{capability[0]}.{capability[1]}; leave it out (bf16 is this GPU's fastest)")
    for flag, on in (("--tp", tp > 1), ("--pp", pp > 1), ("--lora-rank", lora)):
        if on:
            return f"--fp8 with {flag} is not supported yet; leave one of them out"
    if ddp:
        return "--fp8 runs with FSDP2 (--dp-shard > 1 or one process), not with DDP (--dp-shard 1 over replicas)"
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "--fp8 needs torchao: pip install 'paraseek[fp8]'"
    return None


def fp8_filter(module: nn.Module, fqn: str) -> bool:
    """True for the nn.Linear that become float8 linears: a block's attention and MLP projections whose shapes the
    float8 GEMM takes (both dims multiples of 16)."""
    if not isinstance(module, nn.Linear):
        return False
    parent = fqn.split(".")[-2] if "." in fqn else ""
    return parent in _BLOCK_PARENTS and module.in_features % 16 == 0 and module.out_features % 16 == 0


def fp8_experts() -> bool:
    """Whether `apply_fp8` puts the routed experts on the float8 grouped GEMM here: a Hopper GPU and torchao's
    kernels. Never under PARASEEK_FP8_EMULATE: torchao emulates its float8 linears on CPU, not the grouped GEMM
    (Triton kernels and torch._scaled_grouped_mm only), so the CPU runs keep the experts on the ordinary path."""
    if emulated() or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return False
    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm  # noqa: F401
    except ImportError:
        return False
    return True


def experts_filter(module: nn.Module) -> bool:
    """True for routed experts whose GEMMs the float8 grouped GEMM takes: model and expert dims multiples of 16."""
    return isinstance(module, Experts) and all(d % 16 == 0 for d in module.gate_proj.shape[1:])


def _config(recipe: str, fsdp: bool):
    from torchao.float8 import Float8LinearConfig

    cfg = Float8LinearConfig.from_recipe_name(_TORCHAO_NAME[recipe])
    return dataclasses.replace(cfg, enable_fsdp_float8_all_gather=fsdp and recipe == "tensorwise",
                               emulate=emulated())


def apply_fp8(model: nn.Module, recipe: str, fsdp: bool, experts: bool | None = None) -> None:
    """Swap the filtered linears of `model` (on the meta device, before AC, compile and FSDP2 wrap it) for torchao's
    float8 linears, and put the filtered routed experts (after expert parallelism: its experts are `Experts` too) on
    the float8 rowwise grouped GEMM, whatever the recipe. `experts`: None where `fp8_experts()` says so."""
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(model, config=_config(recipe, fsdp), module_filter_fn=fp8_filter)
    experts = fp8_experts() if experts is None else experts
    for m in model.modules():
        if experts and experts_filter(m):
            m.fp8_grouped = True


def precompute_scales(model: nn.Module) -> None:
    """Tensorwise under FSDP2: every float8 weight's scale for the next step's all-gather, in one pass after the
    optimizer step (instead of one small reduction per weight inside each all-gather)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
