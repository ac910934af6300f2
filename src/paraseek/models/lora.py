"""LoRA adapters (Hu et al. 2021, eq. 3: h = W x + (alpha / r) B A x, W frozen, A and B trained), applied from
outside the model the way parallelism is (parallel/parallelize.py runs `apply_lora` after EP, before AC, compile and
FSDP2); models/lora_spec.py says what the targets are.

The adapted modules keep their parameters and names: each adapted nn.Linear becomes a `LoRALinear` (its class
swapped in place, as torch.nn.utils.parametrize and FSDP2's fully_shard swap classes) holding `lora_A` [r, I] and
`lora_B` [O, r] beside its `weight`; the routed experts (plain or expert-parallel) get stacked `lora_A.<proj>`
[E, r, I] and `lora_B.<proj>` [E, O, r] that run as two more grouped GEMMs per projection, sharded over the EP group
like the expert weights. So checkpoint names, the HF loader and the per-block FSDP2 units do not change; the
adapters are the parameters whose names hold `.lora_A.` / `.lora_B.`.

Initialization: A Gaussian and B zero (Hu et al. sec. 4.1), so a run starts exactly at the base model. A's std is
that of nn.Linear's default init, 1 / sqrt(3 I), which PEFT uses for A too: learning rates of PEFT recipes carry over.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from paraseek.models.deepseek import Experts, Transformer, grouped_mm
from paraseek.models.lora_spec import MLP, LoRASpec


def is_adapter(name: str) -> bool:
    """Is `name` (a parameter's, a state dict's or a checkpoint's key) a LoRA adapter tensor?"""
    return ".lora_A." in name or ".lora_B." in name


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class LoRALinear(nn.Linear):
    """nn.Linear plus its low-rank update: y = x W^T + b + scaling * (x A^T) B^T."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    scaling: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.lora_B(self.lora_A(x)) * self.scaling


class _LoRAExperts:
    """Mixed into the routed experts' class (Experts, or expert parallelism's): every stacked projection gets
    scaling * B_e A_e x for the rows of expert e, as two grouped GEMMs over the same expert counts."""

    lora_A: nn.ParameterDict
    lora_B: nn.ParameterDict
    scaling: float

    def project(self, name, x_MI, counts_E, use_grouped):
        y_MO = super().project(name, x_MI, counts_E, use_grouped)
        a_ERI, b_EOR = _local(self.lora_A[name]), _local(self.lora_B[name])  # this rank's experts under EP
        # torch._grouped_mm wants 16-byte-aligned strides: with a rank that is not a multiple of 8 (bf16) the
        # exact per-expert loop runs the adapter instead.
        grouped = use_grouped if a_ERI.shape[1] % 8 == 0 else False
        h_MR = grouped_mm(x_MI, a_ERI, counts_E, grouped)
        return y_MO + grouped_mm(h_MR, b_EOR, counts_E, grouped) * self.scaling


_EXPERT_CLASSES: dict[type, type] = {}


def _lora_experts_class(base: type) -> type:
    if base not in _EXPERT_CLASSES:
        _EXPERT_CLASSES[base] = type(f"LoRA{base.__name__}", (_LoRAExperts, base), {})
    return _EXPERT_CLASSES[base]


def _stacked_like(w: torch.Tensor, shape_rest: tuple[int, ...]) -> nn.Parameter:
    """A trainable fp32 [E, *shape_rest] tensor placed as the expert weight `w` is: plain, or a DTensor sharded over
    the experts like an expert-parallel weight (this rank holds its E / ep experts)."""
    local_w = _local(w)
    local = torch.empty((local_w.shape[0], *shape_rest), device=local_w.device, dtype=torch.float32)
    if isinstance(w, DTensor):
        local = DTensor.from_local(local, w.device_mesh, w.placements, run_check=False)
    return nn.Parameter(local)


@torch.no_grad()
def apply_lora(model: Transformer, spec: LoRASpec, base_dtype: torch.dtype | None = None) -> list[str]:
    """Freeze every parameter of `model` (a whole model or a pipeline stage; meta device or real, after expert
    parallelism, before activation checkpointing, compile and FSDP2), then add the adapters of `spec` to its main
    layers. `base_dtype`: the frozen weights are stored in it (the compute dtype: a weight that is never updated needs
    no fp32 master copy); the adapters are fp32 master weights as every trained parameter. Returns the adapted module
    names. Tensor parallelism is refused before a run starts (train/validate.py): its plans shard whole modules."""
    for m in model.modules():
        for pname, p in list(m.named_parameters(recurse=False)):
            frozen = p.detach() if base_dtype is None else p.detach().to(base_dtype)
            setattr(m, pname, nn.Parameter(frozen, requires_grad=False))
    targets, done = set(spec.targets), []
    for key, block in model.layers.items():
        linears = [(f"self_attn.{n}", getattr(block.self_attn, n)) for n in spec.targets if hasattr(block.self_attn, n)]
        mlp = block.mlp
        if not hasattr(mlp, "experts"):  # a dense MLP
            linears += [(f"mlp.{n}", getattr(mlp, n)) for n in MLP if n in targets]
        else:
            if "shared_experts" in targets and mlp.shared_experts is not None:
                linears += [(f"mlp.shared_experts.{n}", getattr(mlp.shared_experts, n)) for n in MLP]
            if "experts" in targets:
                _adapt_experts(mlp.experts, spec)
                done.append(f"layers.{key}.mlp.experts")
        for name, linear in linears:
            _adapt_linear(linear, spec)
            done.append(f"layers.{key}.{name}")
    return done


def _adapt_linear(linear: nn.Linear, spec: LoRASpec) -> None:
    if type(linear) is not nn.Linear:
        raise TypeError(f"LoRA adapts plain nn.Linear modules, not {type(linear).__name__}")
    device = linear.weight.device
    linear.__class__ = LoRALinear
    linear.lora_A = nn.Linear(linear.in_features, spec.rank, bias=False, device=device, dtype=torch.float32)
    linear.lora_B = nn.Linear(spec.rank, linear.out_features, bias=False, device=device, dtype=torch.float32)
    linear.scaling = spec.scaling


def _adapt_experts(experts: Experts, spec: LoRASpec) -> None:
    experts.__class__ = _lora_experts_class(type(experts))
    experts.lora_A, experts.lora_B = nn.ParameterDict(), nn.ParameterDict()
    for name in MLP:
        w = getattr(experts, name)  # [E, O, I]
        O, I = w.shape[1:]
        experts.lora_A[name] = _stacked_like(w, (spec.rank, I))
        experts.lora_B[name] = _stacked_like(w, (O, spec.rank))
    experts.scaling = spec.scaling


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int, device: torch.device | None = None) -> None:
    """A ~ N(0, 1 / (3 I)), B = 0 (see the module docstring), each adapter tensor from its own (seed, name) generator
    and one per expert (models/init.py): every layout starts from the same adapters."""
    from paraseek.models.init import init_weights

    shapes = {n: t.shape for n, t in model.state_dict().items() if is_adapter(n)}

    def rule(name: str) -> tuple[str, float]:
        if ".lora_B." in name:
            return "zeros", 0.0
        return "normal", 1.0 / math.sqrt(3 * shapes[name][-1])

    init_weights(model, rule, seed, device, select=is_adapter)


@torch.no_grad()
def merge_state(state: dict[str, torch.Tensor], spec: LoRASpec) -> dict[str, torch.Tensor]:
    """A whole (unsharded) state dict with adapters -> the plain model's: W + scaling * B A for every adapted weight
    (per expert for the stacked ones), computed in fp32 and stored in W's dtype; the adapters dropped."""
    out = {n: t for n, t in state.items() if not is_adapter(n)}
    for name, a in state.items():
        if ".lora_A." not in name:
            continue
        b = state[name.replace(".lora_A.", ".lora_B.")]
        owner, _, proj = name.partition(".lora_A.")
        target = f"{owner}.weight" if proj == "weight" else f"{owner}.{proj}"  # Linear / stacked experts
        w = out[target]
        out[target] = (w.float() + spec.scaling * (b.float() @ a.float())).to(w.dtype)
    return out


# ---- PEFT adapter folders ----------------------------------------------------------------------------------------
# PEFT (0.21) with transformers 5 rewrites the targets of a DeepSeek-V2/V3 config as its models were before
# transformers fused their routed experts: every target named gate_proj/up_proj/down_proj is taken for the routed
# experts (peft/utils/transformers_weight_conversion.py, _convert_peft_config_moe), so a dense MLP's or the shared
# experts' adapters named as target_modules would be moved onto the experts. Their weights are named as
# target_parameters instead (a LoRA on a 2-D parameter is PEFT's plain LoRA: B A added to the weight).
_PEFT_FUSED_EXPERTS = ("deepseek_v2", "deepseek_v3")


def peft_adapter(adapters: dict[str, torch.Tensor], args, spec: LoRASpec) -> tuple[dict[str, torch.Tensor], dict]:
    """Our adapters (whole tensors by our names) -> PEFT's (tensors by its saved names, the adapter_config.json
    fields). Names are transformers' modules: `base_model.model.model.layers.0.self_attn.q_a_proj.lora_A.weight`.

    Routed experts: transformers 5 holds them fused, gate_up_proj [E, 2F, D] (gate rows first) and down_proj
    [E, D, F], which PEFT adapts as target_parameters with A [E*r, I] (expert-major rows) and B [O, r*E] (rank-major
    columns, peft/tuners/lora/layer.py ParamWrapper.get_delta_weight). gate and up are one adapter of rank 2r with
    A = [A_gate; A_up] and B block-diagonal, so B A is exactly both updates; alpha is doubled with it to keep the
    scaling alpha / r (as PEFT's own conversion does). down_proj wraps gate_up_proj's wrapper (PEFT nests them in
    parameter order), so gate_up's adapter is saved under `experts.base_layer`."""
    tensors: dict[str, torch.Tensor] = {}
    modules, parameters = [], []
    param_mlp = args.model_type in _PEFT_FUSED_EXPERTS
    for name, a in adapters.items():
        if ".lora_A." not in name:
            continue
        owner, _, proj = name.partition(".lora_A.")
        b = adapters[name.replace(".lora_A.", ".lora_B.")]
        hub = f"model.{owner}"
        if proj == "weight":  # an nn.Linear
            if param_mlp and ".mlp." in owner:
                parameters.append(f"{hub}.weight")
            else:
                modules.append(hub)
            tensors[f"base_model.model.{hub}.lora_A.weight"] = a
            tensors[f"base_model.model.{hub}.lora_B.weight"] = b
        elif proj == "down_proj":
            E = a.shape[0]
            parameters.append(f"{hub}.down_proj")
            tensors[f"base_model.model.{hub}.lora_A.weight"] = a.reshape(E * spec.rank, -1)
            tensors[f"base_model.model.{hub}.lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], -1)
        elif proj == "gate_proj":
            a_up, b_up = adapters[f"{owner}.lora_A.up_proj"], adapters[f"{owner}.lora_B.up_proj"]
            E = a.shape[0]
            parameters.append(f"{hub}.gate_up_proj")
            tensors[f"base_model.model.{hub}.base_layer.lora_A.weight"] = torch.cat([a, a_up], 1).reshape(
                E * 2 * spec.rank, -1)
            b_bd = torch.stack([torch.block_diag(b[e], b_up[e]) for e in range(E)])  # [E, 2F, 2r]
            tensors[f"base_model.model.{hub}.base_layer.lora_B.weight"] = b_bd.permute(1, 2, 0).reshape(
                b_bd.shape[1], -1)
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    fused = {r".*\.gate_up_proj": 2 * spec.rank} if any(p.endswith("gate_up_proj") for p in parameters) else {}
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": alpha, "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "inference_mode": True, "target_modules": sorted(modules) or None, "target_parameters": sorted(parameters) or None,
        "rank_pattern": fused, "alpha_pattern": {k: 2 * alpha for k in fused},
    }
    return tensors, config


def save_peft_adapter(adapters: dict[str, torch.Tensor], args, spec: LoRASpec, folder, *, base_model: str,
                      dtype: torch.dtype = torch.bfloat16) -> None:
    """Write a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) that
    peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model), folder) loads."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    tensors, config = peft_adapter(adapters, args, spec)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config["base_model_name_or_path"] = base_model
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.detach().to("cpu", dtype).contiguous() for k, v in tensors.items()},
              str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
