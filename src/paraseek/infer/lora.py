"""Many LoRA adapters served at once, each request on its own (Punica, Chen et al. 2023; S-LoRA, Sheng et al. 2023;
vLLM's --max-loras): one base model, adapters chosen per request by name.

Slots. Every adapted projection of the inference model holds `max_loras` adapter slots of rank `max_rank`, allocated
once: A_all [L*R, I] (slot l's A in rows l*R..l*R+r, zero rows past its rank r) and B_all [O, L*R] (its B, already
multiplied by its scaling alpha / r, in the same columns). Loading an adapter copies into a free slot, so the CUDA
graphs captured at start read the same buffers whatever is loaded, and unloading frees the slot.

The batched delta (exact, static shapes). Each token of a step carries its request's slot (-1: the base model). For
one projection y = x W^T of N tokens, the update of every token by its own adapter (LoRA, Hu et al. 2021, eq. 3:
y += (alpha / r) x A^T B^T) is two GEMMs over all slots at once:
    xa [N, L*R] = x A_all^T, with every column of another slot than the token's set to zero,
    y += xa B_all^T,
so a token's row of xa holds x A_l^T in its own slot's R columns and zeros elsewhere, and xa B_all^T = x A_l^T B_l^T.
A base token's row is all zeros: its output is exactly the base output. The zeros are selected (torch.where), not
multiplied in, so no value of another slot can reach a token (0 x inf would be NaN); B is checked finite at load.
The extra bytes a step reads are L*R*(I + O) per adapted hub module; its extra FLOPs 2*N*L*R*(I + O). This is the
plain-torch path (CPU, and the reference): 2 + n launches per projection of n fused pieces (below).

On CUDA with the platform's kernels on (infer/lora_kernels.py, after Punica's BGMV and SGMV) each token meets only
its own slot's A and B, in two launches per projection whatever its pieces: a shrink of every piece at once (x A_p^T
over the token's R rows, fp32 partial sums over cuts of the input so that few tokens still fill the GPU) and an
expand that sums them, rounds x A^T to the slots' dtype as the torch path does, and adds the slot's B_p into the
piece's rows of y in place (fp32, one rounding, as addmm). Programs are (slot, block of up to 64 tokens): one
reads its slot's A (n*R*I) and B (O*R) once for the tokens of its block on that slot and returns at once when there
are none, so a decode step of up to 64 tokens reads at most the torch path's L*R*(n*I + O) (only the slots in use;
the products run over the whole token block for each slot in use, as the torch path's over every slot, which is
cheap next to the launches saved). Base tokens read nothing and their rows are not written.
The numbers differ from the torch path's only in the order of the fp32 sums. MLA's kv_b (`LatentLoRA`, below) has
one kernel for each of its two decode forms (one launch instead of four, one rounding fewer) and keeps the torch
path for the prefill keys. Measured with the torch path on one H200 (scripts/gpu/bench_lora_decode.py, the 8B shape, 64
decode sequences, 8 rank-16 adapters, ~15 extra launches a layer): 8.60 ms a step against the base's 6.14 ms (1.40x,
while the extra bytes are 4.5%).

Fused projections (q|k|v, gate|up, MLA's q_a|kv_a): each hub module is one "piece" with its own A_all, stacked for
one GEMM x A^T [N, n*L*R] over the n pieces (masked alike), and its B_all in the rows of its part of the fused output
(one B_all [O, L*R] without zeros), so the B side is one GEMM per piece into its columns of y. A block-structured
B_all [O, n*L*R] would make that one GEMM, reading n times as many values, most of them zeros. Tensor parallelism
cuts the adapters as the weights are cut (infer/model.py): a column-parallel weight's B by output rows, a
row-parallel weight's A by input columns (the partial deltas are summed by the all-reduce that already follows
o_proj and down_proj).

MLA's kv_b is read as W_UK and W_UV (absorbed decode) and expanded for prefill, so its adapter is applied in each of
those three forms (`LatentLoRA`); the latent cache holds kv_a's output, which does not depend on kv_b, and kv_a's own
adapter is separated by the prefix-cache key (each adapter's prompts have their own cached blocks).

Routed and shared experts are not adapted here: their weights run inside the fused-MoE kernels, where a per-token
adapter does not fit; such an adapter is refused at load in one line (its merged model serves).

PEFT folders: adapter_config.json and adapter_model.safetensors as `paraseek export --export-adapter` and PEFT write
them (tensors `base_model.model.model.layers.N.<module>.lora_A.weight` [r, I] and `.lora_B.weight` [O, r]).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from paraseek.errors import UserError
from paraseek.infer import ops


class AdapterNotFound(UserError):
    """A request names an adapter that is not loaded (the server's 404)."""

    status = 404


# ---- reading a PEFT folder -------------------------------------------------------------------------------------
def served_shapes(args) -> dict[str, tuple[int, int]]:
    """(in, out) of every hub module whose adapters are served (our names: layers.0.self_attn.q_proj): the attention
    projections and the dense MLPs (models/lora_spec.py's targets without the experts)."""
    from paraseek.models.lora_spec import LoRASpec, adapted, model_targets

    targets = tuple(t for t in model_targets(args) if t not in ("experts", "shared_experts"))
    return {w.name: (w.in_features, w.out_features) for w in adapted(args, LoRASpec(1, 1.0, targets))}


_KEY = re.compile(r"^base_model\.model\.model\.(layers\.(\d+)\.(.+))\.lora_([AB])\.weight$")


@dataclass
class Adapter:
    """One adapter read from its folder: per adapted hub module (our names: layers.0.self_attn.q_proj), A [r, I] and
    B [O, r] already multiplied by the module's scaling, fp32 on the CPU."""

    path: str
    rank: int  # the largest rank of its modules
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _pattern_value(patterns: dict, name: str, default):
    """PEFT's alpha_pattern lookup (peft.utils.other.get_pattern_key): the first key that matches the end of the
    module's name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def read_adapter(path: str | Path, args, max_rank: int) -> Adapter:
    """A PEFT LoRA folder checked against the model `args` and the slots' rank: one UserError naming what is wrong
    (not a folder, not LoRA, a format this server does not serve, a module the model does not have, a shape that is
    not the module's, a rank above max_rank, values that are not finite)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    if not folder.exists():
        raise AdapterNotFound(f"{path}: no such adapter folder")
    cfg_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not folder.is_dir() or not cfg_file.is_file():
        raise UserError(f"{path}: not a PEFT adapter folder (no adapter_config.json)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{cfg_file}: peft_type {cfg.get('peft_type') if isinstance(cfg, dict) else cfg!r} is not "
                        "LORA; only LoRA adapters are served")
    for key, off, why in (("use_dora", False, "DoRA"), ("fan_in_fan_out", False, "fan_in_fan_out (Conv1D) weights"),
                          ("modules_to_save", None, "modules_to_save (whole replaced modules)"),
                          ("bias", "none", "trained biases"), ("layers_to_transform", None, "layers_to_transform")):
        if cfg.get(key) not in (off, None, [], "none"):
            raise UserError(f"{cfg_file}: {why} are not served (only plain LoRA: B A added to a weight)")
    if not weights_file.is_file():
        other = " (adapter_model.bin: save it as safetensors)" if (folder / "adapter_model.bin").is_file() else ""
        raise UserError(f"{path}: no adapter_model.safetensors{other}")
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{weights_file}: cannot be read ({str(e)[:200]})") from None
    shapes = served_shapes(args)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise UserError(f"{weights_file}: tensor {key!r} is not a LoRA A or B of a decoder layer's module; only "
                            "adapters of the layers' projections are served (not embeddings or the head)")
        name, module = m.group(1), m.group(3)
        if module.startswith(("mlp.experts", "mlp.shared_experts")):
            what = "shared" if "shared" in module else "routed"
            raise UserError(f"{path}: adapters of the {what} experts ({name}) are not served (they run inside the "
                            "fused-MoE kernels); serve the merged model (paraseek export --merge-lora), or train "
                            "with --lora-targets attention,mlp")
        if name not in shapes:
            raise UserError(f"{path}: {name} is not a module of this model (a LoRA of another architecture?)")
        pairs.setdefault(name, {})[m.group(4)] = t
    if not pairs:
        raise UserError(f"{weights_file}: holds no LoRA tensors")
    alpha, rslora = cfg.get("lora_alpha", cfg.get("r", 8)), bool(cfg.get("use_rslora", False))
    out = Adapter(str(path), 0)
    for name, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise UserError(f"{weights_file}: {name} has lora_{'A' if 'A' in ab else 'B'} without its pair")
        a, b = ab["A"].float(), ab["B"].float()
        I, O = shapes[name]
        r = a.shape[0]
        if a.shape != (r, I) or b.shape != (O, r):
            raise UserError(f"{weights_file}: {name} has A {tuple(a.shape)} and B {tuple(b.shape)}; this model "
                            f"needs A [r, {I}] and B [{O}, r] (an adapter of another model?)")
        if r > max_rank:
            raise UserError(f"{path}: rank {r} ({name}) is above --max-lora-rank {max_rank}; restart with "
                            f"--max-lora-rank {r} or more")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise UserError(f"{weights_file}: {name} holds values that are not finite")
        a_alpha = _pattern_value(cfg.get("alpha_pattern"), f"model.{name}", alpha)
        scaling = a_alpha / (r ** 0.5 if rslora else r)
        out.weights[name] = (a, b * scaling)
        out.rank = max(out.rank, r)
    return out


# ---- the slots -------------------------------------------------------------------------------------------------
@dataclass
class Piece:
    """One hub target inside an inference Linear: rows [start, start + rows) of its (local) output, and how this tp
    rank cuts the hub adapter (B by output rows for a column-parallel weight, A by input columns for a row-parallel
    one; whole when the weight is not cut)."""

    target: str  # e.g. self_attn.q_proj
    start: int
    rows: int
    take_a: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
    take_b: Callable[[torch.Tensor], torch.Tensor] = lambda t: t


class LoRASlots:
    """The adapter buffers of one tp rank's model and the step's token -> slot map (set by `begin`)."""

    def __init__(self, max_loras: int, max_rank: int, args, device, dtype):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.args, self.device, self.dtype = args, device, dtype
        self.modules: list = []  # LoRALinear and LatentLoRA
        self.idx_N: torch.Tensor | None = None
        self._shapes = served_shapes(args) if args is not None else {}
        self._b = None
        self._masks: dict = {}
        self._cols = torch.arange(max_loras * max_rank, device=device) // max_rank  # [L*R]: each column's slot

    # the step
    def begin(self, b) -> None:
        """The step's per-token slots b.lora [N] (None: no token of the step uses an adapter)."""
        self.idx_N, self._b, self._masks = getattr(b, "lora", None), b, {}

    def mask(self) -> torch.Tensor:
        """[N, L*R] bool: column j belongs to the token's slot (computed once a step, for every projection)."""
        m = self._masks.get("tokens")
        if m is None:
            m = self._masks["tokens"] = self._cols == self.idx_N[:, None]
        return m

    def key_mask(self) -> torch.Tensor:
        """[K, L*R] bool for the keys of the step's prefill chunks (each key carries its chunk's slot)."""
        m = self._masks.get("keys")
        if m is None:
            b = self._b
            first = self.idx_N[b.cu_q[:-1].long() + b.n_decode]  # each chunk's slot: its first query token's
            idx_K = torch.repeat_interleave(first, (b.cu_k[1:] - b.cu_k[:-1]).long(), output_size=b.k_slots.numel())
            m = self._masks["keys"] = self._cols == idx_K[:, None]
        return m

    # the buffers
    def wrap(self, base, layer: int, pieces: list[Piece]) -> LoRALinear:
        shapes = self._shapes
        I = pieces[0].take_a(torch.empty((1, shapes[f"layers.{layer}.{pieces[0].target}"][0]), device="meta")).shape[1]
        for p in pieces:  # the pieces tile the local output, as the weight was built
            o_hub = shapes[f"layers.{layer}.{p.target}"][1]
            assert p.take_b(torch.empty((o_hub, 1), device="meta")).shape[0] == p.rows, (layer, p)
        assert sum(p.rows for p in pieces) == base.out_features, (layer, pieces)
        lin = LoRALinear(base, self, layer, pieces, I)
        self.modules.append(lin)
        return lin

    def targets(self) -> set[str]:
        """The hub modules (our names) whose adapters these slots serve."""
        return {f"layers.{m.layer}.{p.target}" for m in self.modules for p in m.pieces}

    def load(self, slot: int, adapter: Adapter) -> None:
        """Copy an adapter into `slot` (every module of the slot first cleared: modules it does not adapt add 0)."""
        missing = sorted(set(adapter.weights) - self.targets())
        if missing:
            raise UserError(f"{adapter.path}: {missing[0]} is not adapted by this server's model")
        rank = max((a.shape[0] for a, _ in adapter.weights.values()), default=0)
        if rank > self.max_rank:  # it would spill into the next slot
            raise UserError(f"{adapter.path}: rank {rank} is above --max-lora-rank {self.max_rank}")
        with torch.no_grad():
            for m in self.modules:
                m.load(slot, adapter.weights)

    def nbytes(self) -> int:
        return sum(m.nbytes_lora() for m in self.modules)


class LoRALinear:
    """A Linear (any weight format: it only calls the base projection) plus the slots' batched delta. X = L*R
    columns: slot l's are l*R .. l*R + r; A of piece p in rows p*X .. (p+1)*X of a_PXI."""

    def __init__(self, base, slots: LoRASlots, layer: int, pieces: list[Piece], in_features: int):
        self.base, self.slots, self.layer, self.pieces = base, slots, layer, pieces
        X = slots.max_loras * slots.max_rank
        self.a_PXI = torch.zeros((len(pieces) * X, in_features), device=slots.device, dtype=slots.dtype)
        self.b_OX = torch.zeros((base.out_features, X), device=slots.device, dtype=slots.dtype)
        self.starts = [p.start for p in pieces]

    def __call__(self, x_NI: torch.Tensor) -> torch.Tensor:
        y_NO = self.base(x_NI)
        if self.slots.idx_N is None:
            return y_NO
        if ops.kernels_on():  # two launches whatever the pieces, each token reading its own slot only
            from paraseek.infer import lora_kernels

            idx_N, R = self.slots.idx_N, self.slots.max_rank
            ws_NPSR = lora_kernels.shrink(x_NI, self.a_PXI, idx_N, len(self.pieces), R)
            return lora_kernels.expand_(y_NO, ws_NPSR, self.b_OX, idx_N, self.starts)
        m_NX = self.slots.mask()
        if len(self.pieces) == 1:
            return y_NO.addmm_(torch.where(m_NX, F.linear(x_NI, self.a_PXI), 0), self.b_OX.t())
        N, X = x_NI.shape[0], m_NX.shape[1]
        xa_NPX = torch.where(m_NX[:, None, :], F.linear(x_NI, self.a_PXI).view(N, len(self.pieces), X), 0)
        for k, p in enumerate(self.pieces):  # each piece's B into its columns of y
            rows = slice(p.start, p.start + p.rows)
            y_NO[:, rows].addmm_(xa_NPX[:, k], self.b_OX[rows].t())
        return y_NO

    def __getattr__(self, name):  # out_features, w, ... of the base projection
        if name == "base":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)

    def nbytes(self) -> int:
        return self.base.nbytes() + self.nbytes_lora()

    def nbytes_lora(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a_PXI, self.b_OX))

    def load(self, slot: int, weights: dict) -> None:
        R, X = self.slots.max_rank, self.b_OX.shape[1]
        c0 = slot * R
        self.b_OX[:, c0:c0 + R] = 0
        for k, p in enumerate(self.pieces):
            a_rows = slice(k * X + c0, k * X + c0 + R)
            self.a_PXI[a_rows] = 0
            ab = weights.get(f"layers.{self.layer}.{p.target}")
            if ab is None:
                continue
            a, b = p.take_a(ab[0]), p.take_b(ab[1])
            r = a.shape[0]
            self.a_PXI[k * X + c0:k * X + c0 + r] = a.to(self.a_PXI)
            self.b_OX[p.start:p.start + p.rows, c0:c0 + r] = b.to(self.b_OX)


class LatentLoRA:
    """MLA's kv_b adapter (B [H*(nope+V), r] by heads, A [r, C]) in the three forms kv_b is read (infer/model.py,
    LatentAttention): absorbed into the decode query (q_nope B_uk A), applied to the attended latent (o_lat A^T
    B_uv^T), and added to the prefill chunks' expanded keys and values."""

    target = "self_attn.kv_b_proj"

    def __init__(self, slots: LoRASlots, layer: int, H: int, nope: int, V: int, C: int, take_b):
        self.slots, self.layer, self.nope, self.V = slots, layer, nope, V
        self.pieces = [Piece(self.target, 0, H * (nope + V), take_b=take_b)]
        X = slots.max_loras * slots.max_rank
        self.a_XC = torch.zeros((X, C), device=slots.device, dtype=slots.dtype)
        self.b_OX = torch.zeros((H * (nope + V), X), device=slots.device, dtype=slots.dtype)
        v = self.b_OX.view(H, nope + V, X)
        self.b_uk_HDX, self.b_uv_HXV = v[:, :nope], v[:, nope:].transpose(1, 2)

    def absorb_q_(self, q_lat_HnC: torch.Tensor, q_nope_nHD: torch.Tensor) -> None:
        """q_lat += q_nope (B_uk A) per head: [H, n, nope] @ [H, nope, X], masked, @ [X, C]."""
        if self.slots.idx_N is None:
            return
        if ops.kernels_on():  # one launch: each token its own slot's B_uk and A
            from paraseek.infer import lora_kernels

            return lora_kernels.latent_absorb_q_(q_lat_HnC, q_nope_nHD, self.b_OX, self.a_XC, self.slots.idx_N,
                                                 self.V, self.slots.max_rank)
        n = q_nope_nHD.shape[0]
        t_HnX = torch.where(self.slots.mask()[:n], torch.bmm(q_nope_nHD.transpose(0, 1), self.b_uk_HDX), 0)
        q_lat_HnC.add_(torch.matmul(t_HnX, self.a_XC))

    def value_(self, o_NHV: torch.Tensor, o_lat_nHC: torch.Tensor) -> None:
        """o[:n] += o_lat (B_uv A)^T per head: [n, H, C] @ [C, X], masked, then [H, n, X] @ [H, X, V]."""
        if self.slots.idx_N is None:
            return
        if ops.kernels_on():  # one launch: each token its own slot's A and B_uv
            from paraseek.infer import lora_kernels

            return lora_kernels.latent_value_(o_NHV, o_lat_nHC, self.a_XC, self.b_OX, self.slots.idx_N, self.nope,
                                              self.slots.max_rank)
        n = o_lat_nHC.shape[0]
        t_nHX = torch.where(self.slots.mask()[:n, None, :], torch.matmul(o_lat_nHC, self.a_XC.t()), 0)
        o_NHV[:n] += torch.bmm(t_nHX.transpose(0, 1), self.b_uv_HXV).transpose(0, 1)

    def expand_(self, kv_KO: torch.Tensor, ctx_KC: torch.Tensor) -> torch.Tensor:
        """The prefill chunks' keys and values through kv_b: + ctx A^T B^T, each key with its chunk's adapter."""
        if self.slots.idx_N is None:
            return kv_KO
        xa_KX = torch.where(self.slots.key_mask(), F.linear(ctx_KC, self.a_XC), 0)
        return kv_KO.addmm_(xa_KX, self.b_OX.t())

    def nbytes_lora(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a_XC, self.b_OX))

    def load(self, slot: int, weights: dict) -> None:
        R = self.slots.max_rank
        cols = slice(slot * R, (slot + 1) * R)
        self.a_XC[cols] = 0
        self.b_OX[:, cols] = 0
        ab = weights.get(f"layers.{self.layer}.{self.target}")
        if ab is not None:
            a, b = ab[0], self.pieces[0].take_b(ab[1])
            self.a_XC[slot * R:slot * R + a.shape[0]] = a.to(self.a_XC)
            self.b_OX[:, slot * R:slot * R + a.shape[0]] = b.to(self.b_OX)


def attach(model, max_loras: int, max_rank: int) -> LoRASlots:
    """Give every projection of the inference model its adapter slots (the model's Linears wrapped in place, MLA's
    kv_b its LatentLoRA); the model then runs each token's adapter from the step's `lora` field."""
    import torch.distributed as dist

    from paraseek.infer.model import DenseAttention, DenseMLP, LatentAttention
    from paraseek.infer.weights import shard

    a, tp = model.args, model.tp
    rank = dist.get_rank(model.tp_group) if model.tp_group is not None else 0
    slots = LoRASlots(max_loras, max_rank, a, model.device, model.dtype)

    def cut(unit: int = 1, dim: int = 0):
        return lambda t: shard(t, rank, tp, dim, unit)

    for i, L in enumerate(model.layers):
        at = L.attn
        if isinstance(at, DenseAttention):
            D, H, G = at.D, at.H, at.G
            if a.n_kv_heads % tp == 0:
                kv = cut(D)
            else:  # fewer kv heads than ranks: this rank's one kv head, as the weight was cut
                h = rank * a.n_kv_heads // tp
                kv = lambda t, h=h: t[h * D:(h + 1) * D]  # noqa: E731
            at.qkv = slots.wrap(at.qkv, i, [Piece("self_attn.q_proj", 0, H * D, take_b=cut(D)),
                                            Piece("self_attn.k_proj", H * D, G * D, take_b=kv),
                                            Piece("self_attn.v_proj", (H + G) * D, G * D, take_b=kv)])
            at.o = slots.wrap(at.o, i, [Piece("self_attn.o_proj", 0, at.o.out_features, take_a=cut(D, 1))])
        elif isinstance(at, LatentAttention):
            qk = at.nope + at.R
            first = (Piece("self_attn.q_a_proj", 0, at.q_lora) if at.q_lora
                     else Piece("self_attn.q_proj", 0, at.H * qk, take_b=cut(qk)))
            at.in_proj = slots.wrap(at.in_proj, i, [first, Piece("self_attn.kv_a_proj_with_mqa", first.rows,
                                                                  at.C + at.R)])
            if at.q_lora:
                at.q_b = slots.wrap(at.q_b, i, [Piece("self_attn.q_b_proj", 0, at.H * qk, take_b=cut(qk))])
            at.kv_b_lora = LatentLoRA(slots, i, at.H, at.nope, at.V, at.C, cut(at.nope + at.V))
            slots.modules.append(at.kv_b_lora)
            at.o = slots.wrap(at.o, i, [Piece("self_attn.o_proj", 0, at.o.out_features, take_a=cut(at.V, 1))])
        m = L.mlp
        if isinstance(m, DenseMLP):
            Fl = m.gate_up.out_features // 2
            m.gate_up = slots.wrap(m.gate_up, i, [Piece("mlp.gate_proj", 0, Fl, take_b=cut()),
                                                  Piece("mlp.up_proj", Fl, Fl, take_b=cut())])
            m.down = slots.wrap(m.down, i, [Piece("mlp.down_proj", 0, m.down.out_features, take_a=cut(1, 1))])
    model.lora = slots
    return slots


# ---- names -> slots ----------------------------------------------------------------------------------------------
@dataclass
class Loaded:
    name: str
    path: str
    slot: int
    rank: int
    salt: bytes  # the prefix-cache key's seed: a prompt's blocks under this adapter are this adapter's only
    running: int = 0  # requests added and not finished


class LoRARegistry:
    """The engine's loaded adapters by name, each in one slot."""

    def __init__(self, slots: LoRASlots):
        self.slots = slots
        self.by_name: dict[str, Loaded] = {}
        self.by_slot: dict[int, Loaded] = {}
        self._loads = 0

    def check_new(self, name: str) -> None:
        if not name or not isinstance(name, str):
            raise UserError("an adapter needs a non-empty name")
        if name in self.by_name:
            raise UserError(f"the LoRA adapter {name!r} is already loaded (from {self.by_name[name].path}); unload it "
                            "first to load another under this name")
        if len(self.by_slot) >= self.slots.max_loras:
            raise UserError(f"all {self.slots.max_loras} adapter slots (--max-loras) are in use "
                            f"({', '.join(sorted(self.by_name))}): unload one first")

    def add(self, name: str, adapter: Adapter) -> Loaded:
        self.check_new(name)
        slot = min(set(range(self.slots.max_loras)) - set(self.by_slot))
        self.slots.load(slot, adapter)
        self._loads += 1
        salt = hashlib.sha256(f"lora\0{name}\0{self._loads}".encode()).digest()  # a reload is a new key
        self.by_name[name] = self.by_slot[slot] = Loaded(name, adapter.path, slot, adapter.rank, salt)
        return self.by_name[name]

    def get(self, name: str) -> Loaded:
        if name not in self.by_name:
            have = ", ".join(sorted(self.by_name)) or "none"
            raise AdapterNotFound(f"no LoRA adapter named {name!r} is loaded (loaded: {have})")
        return self.by_name[name]

    def remove(self, name: str) -> Loaded:
        """Unload: refused while requests of the adapter run (they would lose it mid-sequence)."""
        one = self.get(name)
        if one.running:
            raise UserError(f"the LoRA adapter {name!r} has {one.running} unfinished request"
                            f"{'s' if one.running > 1 else ''}; unload it once they are done")
        del self.by_name[name], self.by_slot[one.slot]
        return one
