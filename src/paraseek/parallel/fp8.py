"""FP8 training with torchao's float8 linears (the optional extra `paraseek[fp8]`; torchao 0.17 for torch 2.11).

DeepSeek-V3 trained in FP8 (its report, section 3.3): the matmuls of the projections in float8 with fine-grained
scales, everything numerically delicate in higher precision. The recipes (torchao's, `--fp8 NAME`):

    tensorwise     one scale per tensor, computed from its max each step; under FSDP2 with a shard > 1 the weights are
                   all-gathered in float8 (half the bytes of bf16) and their scales precomputed once per step after the
                   optimizer (`precompute_scales`). The fastest; the coarsest scales.
    rowwise        one scale per row (of activations, weights and gradients; torchao rounds each to a power of
                   two), a slower scaled GEMM, no float8 all-gather. Finer scales, yet measured further from bf16
                   than tensorwise on one H200 (BENCHMARKS.md, FP8 training: +3.1% vs +0.07-0.2% after 500 steps).
    rowwise-gw-hp  rowwise, with the weight-gradient GEMM kept in high precision (torchao's rowwise_with_gw_hp).

What is converted (`fp8_filter`): the nn.Linear of the attention and MLP projections (dense MLPs and shared
experts) whose in and out features are multiples of 16, what the float8 GEMM (torch._scaled_mm) requires. The output
head, the MoE router, the embedding and the norms are not nn.Linear projections of a block and stay in the training
precision, as in DeepSeek-V3; the routed experts (grouped weights) stay in it too for now.

On a GPU this needs float8 tensor cores (compute capability 8.9: Ada, Hopper and newer). On CPU it is refused,
except for tests: PARASEEK_FP8_EMULATE=1 runs torchao's emulation (the same casts and scales, matmuls in high
precision; no speed-up), which is how the CPU suite checks the wiring and the loss.
"""

from __future__ import annotations

import dataclasses
import os

from torch import nn

from paraseek.planner.dims import ParallelDims, fp8_engine_problem

RECIPES = ("tensorwise", "rowwise", "rowwise-gw-hp")
_TORCHAO_NAME = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise-gw-hp": "rowwise_with_gw_hp"}
_BLOCK_PARENTS = ("self_attn", "mlp", "shared_experts")  # the projections of a block
MIN_CAPABILITY = (8, 9)


def emulated() -> bool:
    return os.environ.get("PARASEEK_FP8_EMULATE") == "1"


def fp8_problem(recipe: str, device: str, capability: tuple[int, int] | None, dims: ParallelDims, *,
                lora: bool) -> str | None:
    """Why `--fp8 recipe` cannot run here, or None. Checked before launch; what it composes with is the planner's
    rule (planner/dims.py: fp8_engine_problem), so `plan` never ranks what this refuses."""
    if recipe == "off":
        return None
    if device == "cpu" and not emulated():
        return "--fp8 needs a GPU with float8 tensor cores (compute capability 8.9+: Ada, Hopper); on CPU leave it out"
    if device == "cuda" and capability is not None and tuple(capability) < MIN_CAPABILITY:
        return (f"--fp8 needs float8 tensor cores (compute capability 8.9+: Ada, Hopper); this GPU has "
                f"{capability[0]}.{capability[1]}; leave it out (bf16 is this GPU's fastest)")
    if problem := fp8_engine_problem(dims, lora):
        return problem
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


def _config(recipe: str, float8_all_gather: bool):
    from torchao.float8 import Float8LinearConfig

    cfg = Float8LinearConfig.from_recipe_name(_TORCHAO_NAME[recipe])
    return dataclasses.replace(cfg, enable_fsdp_float8_all_gather=float8_all_gather, emulate=emulated())


def apply_fp8(model: nn.Module, recipe: str, float8_all_gather: bool) -> None:
    """Swap the filtered linears of `model` (on the meta device, before AC, compile and FSDP2 wrap it) for torchao's
    float8 linears; `float8_all_gather` (tensorwise, FSDP2 with a shard > 1) casts the weights before FSDP2 gathers
    them, instead of inside each linear."""
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(model, config=_config(recipe, float8_all_gather), module_filter_fn=fp8_filter)


def precompute_scales(model: nn.Module) -> None:
    """Tensorwise under FSDP2: every float8 weight's scale for the next step's all-gather, in one pass after the
    optimizer step (instead of one small reduction per weight inside each all-gather)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
