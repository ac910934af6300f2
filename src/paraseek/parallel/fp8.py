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
experts) whose in and out features are multiples of 16, what the float8 GEMM (torch._scaled_mm) requires, and large
enough for float8 to pay (`fp8_pays`: torchao's thresholds; on DeepSeek-LLM-7B every projection is, on V2-Lite under
rowwise only the first, dense, layer's gate and up). The output head, the MoE router, the embedding and the norms
are not nn.Linear projections of a block and stay in the training precision, as in DeepSeek-V3.

With `--fp8-experts on` the routed experts ([E, out, in] weights, one grouped GEMM per projection) run
`fp8_grouped_mm` under any recipe: the forward and the input-gradient GEMMs in float8 with per-row scales
(torch._scaled_grouped_mm, Hopper only; each expert's rows padded to a multiple of 16), the weight-gradient GEMM in
bf16, as rowwise-gw-hp does for the projections. Per-row, because that is the scaling the grouped GEMM takes; bf16
weight gradients, because there each expert's token rows are the contraction (jagged per-group scales, a third
quantization pass). Off by default, because it pays only on big micro-batches: the float8 grouped GEMM is slower
than bf16's at a few hundred rows per expert. DeepSeek-V2-Lite cut to 6 layers on one H200 with --fp8 tensorwise:
0.95x bf16 at 8,192 tokens per micro-batch (768 rows per expert), 1.01x at 16,384, 1.07x at 32,768 and 1.15x at
65,536, with less memory (BENCHMARKS.md, FP8).

Under --tp the float8 linears are made first and the TP styles shard them (parallel/parallelize.py); tensorwise
then gathers bf16 weights (parallel/dims.py: float8_all_gather says why). Under TP the step-1 loss equals one
process's; the gradients differ slightly where a tensor is cast per rank before a sum over tp (MLA's replicated
latent projections get partial output gradients; measured 4.6e-4 in the grad norm, tests/dist/test_fp8_training.py).

On a GPU this needs float8 tensor cores (compute capability 8.9: Ada, Hopper and newer). On CPU it is refused,
except for tests: PARASEEK_FP8_EMULATE=1 runs torchao's emulation (the same casts and scales, matmuls in high
precision; no speed-up), which is how the CPU suite checks the wiring and the loss.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from paraseek.models.fp8_grouped import emulated
from paraseek.parallel.dims import ParallelDims, fp8_engine_problem, fp8_pays

RECIPES = ("tensorwise", "rowwise", "rowwise-gw-hp")
_TORCHAO_NAME = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise-gw-hp": "rowwise_with_gw_hp"}
_BLOCK_PARENTS = ("self_attn", "mlp", "shared_experts")  # the projections of a block
MIN_CAPABILITY = (8, 9)


def fp8_problem(recipe: str, device: str, capability: tuple[int, int] | None, dims: ParallelDims, *,
                lora: bool) -> str | None:
    """Why `--fp8 recipe` cannot run here, or None. Checked before launch; what it composes with is the planner's
    rule (parallel/dims.py: fp8_engine_problem), so `plan` never ranks what this refuses."""
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


def fp8_filter(module: nn.Module, fqn: str, recipe: str) -> bool:
    """True for the nn.Linear that become float8 linears: a block's attention and MLP projections whose shapes the
    float8 GEMM takes (both dims multiples of 16) and where it pays (parallel/dims.py: fp8_pays)."""
    if not isinstance(module, nn.Linear):
        return False
    parent = fqn.split(".")[-2] if "." in fqn else ""
    k, n = module.in_features, module.out_features
    # emulated (CPU tests) there is no speed to weigh: every projection the GEMM takes, so tiny models exercise casts
    return parent in _BLOCK_PARENTS and k % 16 == 0 and n % 16 == 0 and (emulated() or fp8_pays(recipe, k, n))


def _config(recipe: str, float8_all_gather: bool):
    from torchao.float8 import Float8LinearConfig

    cfg = Float8LinearConfig.from_recipe_name(_TORCHAO_NAME[recipe])
    return dataclasses.replace(cfg, enable_fsdp_float8_all_gather=float8_all_gather, emulate=emulated())


def apply_fp8(model: nn.Module, recipe: str, float8_all_gather: bool, experts: bool) -> None:
    """Swap the filtered linears of `model` (on the meta device, before AC, compile and FSDP2 wrap it) for torchao's
    float8 linears; `float8_all_gather` (tensorwise, FSDP2 with a shard > 1) casts the weights before FSDP2 gathers
    them, instead of inside each linear. `experts` (--fp8-experts on): the routed experts on `fp8_grouped_mm`."""
    from torchao.float8 import convert_to_float8_training

    from paraseek.models.deepseek import Experts

    convert_to_float8_training(model, config=_config(recipe, float8_all_gather),
                               module_filter_fn=lambda m, fqn: fp8_filter(m, fqn, recipe))
    for m in model.modules():
        if experts and isinstance(m, Experts) and all(d % 16 == 0 for d in m.gate_proj.shape[1:]):
            m.fp8 = True  # the float8 GEMM takes K and N that are multiples of 16


def precompute_scales(model: nn.Module) -> None:
    """Tensorwise under FSDP2: every float8 weight's scale for the next step's all-gather, in one pass after the
    optimizer step (instead of one small reduction per weight inside each all-gather)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
