"""What a LoRA run adapts, in pure Python (the planner and the config checks use it without torch): the target names,
their resolution against one architecture (with did-you-mean for typos), and the exact shape of every adapter.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3): a frozen weight W [O, I] gets a
trainable update (alpha / r) * B A with A [r, I] and B [O, r], so h = W x + (alpha / r) B A x. The modules
(models/lora.py) are applied from outside the model, as parallelism is.

Targets, by the checkpoint's module names:
  attention      q_proj, k_proj, v_proj, o_proj (MHA/GQA); q_a_proj, q_b_proj (or q_proj without q_lora),
                 kv_a_proj_with_mqa, kv_b_proj, o_proj (MLA)
  gate_proj, up_proj, down_proj   the dense MLPs (dense models, and the first_k_dense_replace layers of MoE models)
  shared_experts the shared experts' three projections
  experts        the routed experts' three projections: one adapter per expert, stacked [E, r, I] / [E, O, r] and
                 run as grouped GEMMs like the experts themselves (so it shards with --ep)
  attention, mlp, all  shorthands: the attention projections, the three dense-MLP projections, every target the
                 model has (QLoRA, Dettmers et al. 2023, sec. 4: adapting every linear layer is what matches full
                 fine-tuning)
The MTP modules get no adapters: under LoRA they stay frozen, and their loss (--mtp-layers, train/mtp.py) trains the
main layers' adapters through them.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass

from paraseek.errors import UserError
from paraseek.models.args import ModelArgs

MHA = ("q_proj", "k_proj", "v_proj", "o_proj")
MLA = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = ("q_proj", "k_proj", "v_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj") + MLP + (
    "shared_experts", "experts")
SHORTHANDS = ("attention", "mlp", "all")


@dataclass(frozen=True)
class LoRASpec:
    rank: int  # r
    alpha: float  # the update is scaled by alpha / r
    targets: tuple[str, ...]  # resolved against the model: names from TARGETS, in TARGETS order

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def attention_targets(args: ModelArgs) -> tuple[str, ...]:
    if not args.is_mla:
        return MHA
    q = ("q_a_proj", "q_b_proj") if args.q_lora_rank else ("q_proj",)
    return q + ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def model_targets(args: ModelArgs) -> tuple[str, ...]:
    """The targets this architecture has (in TARGETS order)."""
    has = set(attention_targets(args))
    if any(not args.is_moe_layer(i) for i in range(args.n_layers)):
        has |= set(MLP)
    if args.n_routed_experts and args.n_shared_experts:
        has.add("shared_experts")
    if args.n_routed_experts:
        has.add("experts")
    return tuple(t for t in TARGETS if t in has)


def resolve_targets(args: ModelArgs, text: str, model: str) -> tuple[str, ...]:
    """`--lora-targets` (comma-separated names and shorthands; "" = all) -> the targets, or one UserError naming the
    unknown name (with the closest known one) or the target this model does not have (with those it has)."""
    have = model_targets(args)
    names = [n.strip() for n in (text or "all").split(",") if n.strip()]
    if not names:
        raise UserError("--lora-targets is empty; give names such as attention,mlp,experts or all")
    chosen: set[str] = set()
    for name in names:
        if name in SHORTHANDS:
            want = set({"all": have, "attention": attention_targets(args), "mlp": MLP}[name])
        elif name in TARGETS:
            want = {name}
        else:
            close = difflib.get_close_matches(name, TARGETS + SHORTHANDS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UserError(f"--lora-targets: unknown target {name!r}{hint} (known: {', '.join(TARGETS + SHORTHANDS)})")
        missing = [t for t in TARGETS if t in want - set(have)]
        if missing:
            what = {"experts": "routed experts", "shared_experts": "shared experts"}.get(missing[0], missing[0])
            raise UserError(f"--lora-targets {name}: {model} has no {what} (its targets: {', '.join(have)})")
        chosen |= want
    return tuple(t for t in TARGETS if t in chosen)


@dataclass(frozen=True)
class Adapted:
    """One adapted weight: our module name (the checkpoint's, without `model.`), its in/out features and the number
    of stacked experts (0 for an nn.Linear)."""

    name: str  # e.g. layers.0.self_attn.q_a_proj, layers.1.mlp.experts.gate_proj (one stacked projection)
    in_features: int
    out_features: int
    experts: int = 0

    def params(self, rank: int) -> int:
        return max(self.experts, 1) * rank * (self.in_features + self.out_features)


def adapted(args: ModelArgs, spec: LoRASpec, layers: Iterable[int] | None = None) -> list[Adapted]:
    """Every weight the spec adapts in `layers` (default all), in module order."""
    a, out = args, []
    qk, H = a.qk_head_dim, a.n_heads
    if a.is_mla:
        attn = {"q_proj": (a.dim, H * qk), "q_a_proj": (a.dim, a.q_lora_rank), "q_b_proj": (a.q_lora_rank, H * qk),
                "kv_a_proj_with_mqa": (a.dim, a.kv_lora_rank + a.qk_rope_head_dim),
                "kv_b_proj": (a.kv_lora_rank, H * (a.qk_nope_head_dim + a.v_head_dim)),
                "o_proj": (H * a.v_head_dim, a.dim)}
    else:
        kv = a.n_kv_heads * a.head_dim
        attn = {"q_proj": (a.dim, H * a.head_dim), "k_proj": (a.dim, kv), "v_proj": (a.dim, kv),
                "o_proj": (H * a.head_dim, a.dim)}
    targets = set(spec.targets)
    for i in layers if layers is not None else range(a.n_layers):
        for name in attention_targets(a):
            if name in targets:
                out.append(Adapted(f"layers.{i}.self_attn.{name}", *attn[name]))
        if not a.is_moe_layer(i):
            mlp = {"gate_proj": (a.dim, a.inter_dim), "up_proj": (a.dim, a.inter_dim), "down_proj": (a.inter_dim, a.dim)}
            out += [Adapted(f"layers.{i}.mlp.{n}", *mlp[n]) for n in MLP if n in targets]
            continue
        F = a.moe_inter_dim
        if "experts" in targets:
            shapes = {"gate_proj": (a.dim, F), "up_proj": (a.dim, F), "down_proj": (F, a.dim)}
            out += [Adapted(f"layers.{i}.mlp.experts.{n}", *shapes[n], a.n_routed_experts) for n in MLP]
        if "shared_experts" in targets:
            S = F * a.n_shared_experts
            shapes = {"gate_proj": (a.dim, S), "up_proj": (a.dim, S), "down_proj": (S, a.dim)}
            out += [Adapted(f"layers.{i}.mlp.shared_experts.{n}", *shapes[n]) for n in MLP]
    return out


def adapter_params(args: ModelArgs, spec: LoRASpec, layers: Iterable[int] | None = None) -> int:
    """Trainable parameters of the adapters: r (I + O) per adapted weight, times E for the routed experts."""
    return sum(w.params(spec.rank) for w in adapted(args, spec, layers))


def lora_spec(rank: int, alpha: float, targets: str, args: ModelArgs, model: str) -> LoRASpec | None:
    """The run's LoRA from its flags (--lora-rank, --lora-alpha, --lora-targets); None when rank is 0 (LoRA off).
    alpha 0 means alpha = r: scaling 1, Hu et al. sec. 4.1's "we set alpha to the first r we try"."""
    if not rank:
        return None
    return LoRASpec(rank, float(alpha or rank), resolve_targets(args, targets, model))
