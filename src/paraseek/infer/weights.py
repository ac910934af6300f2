"""One tensor-parallel rank's share of a model's weights, read by name from where they are: a training model
(models/deepseek.py: a training checkpoint, random weights) or an HF folder's safetensors, slice by slice.

The inference model's layers (infer/model.py) say what they keep -- which tensor, cut along which dim, in which
units -- as `Part`s of a `Share`; a source only answers "rows (or columns) [a, b) of this tensor". So the layout
rules live once, in the layers, for every source, and the safetensors source reads only this rank's slices, tensor
by tensor into the layers' own buffers: peak memory is the rank's share plus about one tensor. Names are the hub's
without `model.`, routed experts one tensor each (`layers.3.mlp.experts.17.gate_proj.weight`), as checkpoints
store them.

Formats. Each projection is built either in the model's dtype or, with `fp8`, as FP8 128 x 128 blocks (infer/fp8.py):
  - an FP8 checkpoint's blocks are kept as stored (no requantization) wherever the rank's cut and the fused
    projection's row offsets fall on block edges -- for DeepSeek-V3/R1 at tp 1-16 that is everywhere;
  - a cut through FP8 blocks (a tp share that is not a multiple of 128 rows) is dequantized instead: this rank's
    rows of W_e4m3 * scale_inv, exactly what the checkpoint means, rounded once to the model's dtype;
  - a bf16/fp32 source is quantized once, on load, on the rank's device (`--quantization fp8`).
Without `fp8` FP8 checkpoints load dequantized (GPUs without FP8 tensor cores, CPU). `Share.summary` says what came
of it for the log line.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from paraseek.infer.fp8 import BLOCK, E4M3, Fp8Linear, backend_line, dequantize_fp8, quantize_fp8
from paraseek.infer.linear import Linear


@dataclass(frozen=True)
class Part:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of the tensor `name`; length None: to the end."""

    name: str
    dim: int = 0
    start: int = 0
    length: int | None = None


def share_range(size: int, rank: int, tp: int, unit: int = 1) -> tuple[int, int]:
    """(start, length) of tp rank `rank`'s contiguous 1/tp of `size` rows, in whole units of `unit` rows (one head,
    one expert row...): the one cutting rule of serving tensor parallelism."""
    per = size // unit // tp * unit
    return rank * per, per


def shard(t: torch.Tensor, rank: int, tp: int, dim: int = 0, unit: int = 1) -> torch.Tensor:
    """This rank's share of a tensor's `dim` (share_range), as a view."""
    return t.narrow(dim, *share_range(t.shape[dim], rank, tp, unit))


# ---- sources ---------------------------------------------------------------------------------------------------------
class ModelWeights:
    """A training model's tensors (models/deepseek.Transformer, on its device and in its dtype) by hub name. Its
    layers are dropped as the inference model takes them (`release`): afterwards the training model is empty."""

    _EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")

    def __init__(self, model):
        self.model = model

    def _tensor(self, name: str) -> torch.Tensor:
        layer = name.split(".")[1] if name.startswith("layers.") else ""
        if layer.isdigit() and int(layer) >= self.model.args.n_layers:  # an MTP module's, by the hub's name
            from paraseek.models.hf import hub_to_ours

            ours, expert = hub_to_ours(f"model.{name}", self.model.args.n_layers)
            t = self._get(ours)
            return t if expert is None else t[expert]
        m = self._EXPERT.match(name)
        if m:
            return self.model.get_parameter(f"{m.group(1)}.{m.group(3)}")[int(m.group(2))]
        return self._get(name)

    def _get(self, name: str) -> torch.Tensor:
        try:
            return self.model.get_parameter(name)
        except AttributeError:
            return self.model.get_buffer(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensor(name).shape)

    def block(self, name: str) -> tuple[int, int] | None:
        return None  # a training model holds plain (dequantized) weights

    def read(self, name: str, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
        t = self._tensor(name).detach()
        return t if dim is None else t.narrow(dim, start, t.shape[dim] - start if length is None else length)

    def release(self, prefix: str) -> None:
        key = prefix.removeprefix("layers.")
        if prefix.startswith("layers.") and key in self.model.layers:
            del self.model.layers[key]  # frees the training layer's weights (the inference layer holds its own)


class FolderWeights:
    """An HF folder's tensors (models/hf.HubTensors: checked against the architecture before anything is read)."""

    def __init__(self, folder: str | Path, args, block: tuple[int, int] | None, map_budget: int = 1 << 30):
        from paraseek.models.hf import HubTensors

        self.tensors = HubTensors(folder, map_budget)
        self.tensors.check(args, block)
        self._block = block

    @staticmethod
    def _key(name: str) -> str:
        return name if name == "lm_head.weight" else f"model.{name}"

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors.shape(self._key(name))

    def block(self, name: str) -> tuple[int, int] | None:
        """The FP8 weight block of `name`, None if it is not FP8 (then it has no scale)."""
        return self._block if self._key(name) + "_scale_inv" in self.tensors else None

    def read(self, name: str, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
        return self.tensors.read(self._key(name), dim, start, length)

    def read_scale(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        return self.tensors.read(self._key(name) + "_scale_inv", dim, start, length)

    def release(self, prefix: str) -> None:
        pass

    def close(self) -> None:
        self.tensors.close()


# ---- this rank's share --------------------------------------------------------------------------------------------
class Share:
    """The vocabulary of the inference model's layout rules -- `part` (this rank's contiguous share of a dim),
    `tensor`, `linear`, `experts` -- over a source, for tp rank `rank` of `tp`, building on `device` in `dtype`.
    Under expert parallelism (infer/ep.py) the MoE layers also read `ep_rank` of `ep` (which routed experts are
    this rank's) and `ep_group` (None unless tp is 1: then the MoE layer adds its ranks' sums itself)."""

    def __init__(self, source, rank: int, tp: int, dtype: torch.dtype, device, fp8: bool = False,
                 ep_rank: int = 0, ep: int = 1, ep_group=None):
        self.src, self.rank, self.tp, self.dtype, self.device, self.fp8 = source, rank, tp, dtype, device, fp8
        self.ep_rank, self.ep, self.ep_group = ep_rank, ep, ep_group
        self.counts: Counter = Counter()  # projections (and expert layers) by how they were built

    # -- what a layer keeps
    def shape(self, name: str) -> tuple[int, ...]:
        return self.src.shape(name)

    def part(self, name: str, dim: int = 0, unit: int = 1, within: tuple[int, int] | None = None) -> Part:
        """This rank's contiguous 1/tp of `dim` in whole units of `unit` rows (one head, one expert row...), of the
        range within = (offset, size) of that dim (default: all of it)."""
        offset, size = within if within is not None else (0, self.shape(name)[dim])
        start, length = share_range(size, self.rank, self.tp, unit)
        return Part(name, dim, offset + start, length)

    def whole(self, name: str) -> Part:
        return Part(name)

    # -- building
    def tensor(self, p: Part, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The part as a plain tensor on the device (FP8 values dequantized) in `dtype` (default the model's)."""
        return self._plain(p, dtype or self.dtype)

    def linear(self, parts: list[Part], bias: list[Part] | torch.Tensor | None = None) -> Linear:
        """A projection whose weight is `parts` stacked along rows (fused q|k|v, gate|up...), each a [rows, in]
        matrix; `bias` parts are concatenated the same way (or a ready bias tensor)."""
        if isinstance(bias, list):
            bias = torch.cat([self.tensor(b) for b in bias])
        mode = self._mode([parts])
        self.counts[mode] += 1
        if mode == "plain":
            return Linear(self._stack(parts), bias)
        q, s = self._fp8_matrix(parts, mode)
        return Fp8Linear(q, s, bias)

    def experts(self, w13: list[list[Part]], w2: list[Part]):
        """Stacked expert weights for the fused-MoE kernels: w13 [E', 2F, D] (each expert's gate rows then up rows)
        and w2 [E', D, F], each expert read in turn into the stacks (peak: the stacks plus one expert). Returns
        (w13, w13_scale, w2, w2_scale); the scales are None unless FP8 ([E', ceil(2F/128), ceil(D/128)] and
        [E', ceil(D/128), ceil(F/128)])."""
        mode = self._mode(w13 + [[p] for p in w2])
        self.counts[f"{mode} experts"] += 1
        out = []
        for matrices in (w13, [[p] for p in w2]):
            first = self._rows(matrices[0])
            shape = (len(matrices), first[0], first[1])
            if mode == "plain":
                w = torch.empty(shape, dtype=self.dtype, device=self.device)
                for e, parts in enumerate(matrices):
                    w[e] = self._stack(parts)
                out += [w, None]
            else:
                q = torch.empty(shape, dtype=E4M3, device=self.device)
                s = torch.empty((shape[0], -(-shape[1] // BLOCK), -(-shape[2] // BLOCK)), dtype=torch.float32,
                                device=self.device)
                for e, parts in enumerate(matrices):
                    q[e], s[e] = self._fp8_matrix(parts, mode)
                out += [q, s]
        return tuple(out)

    def release(self, prefix: str) -> None:
        self.src.release(prefix)

    def summary(self) -> str:
        """What the projections became, for the engine's log line."""
        c = self.counts
        lin = lambda m: c[m] + c[f"{m} experts"]  # noqa: E731
        if not self.fp8:
            return (f"{str(self.dtype).removeprefix('torch.')} ({c['plain']} projections, {c['plain experts']} "
                    f"expert layers)")
        parts = []
        if lin("keep"):
            parts.append(f"{c['keep']} projections and {c['keep experts']} expert layers kept in the checkpoint's "
                         "FP8 blocks")
        if lin("quantize"):
            parts.append(f"{c['quantize']} projections and {c['quantize experts']} expert layers quantized to FP8 "
                         "128x128 blocks on load")
        if lin("plain"):
            parts.append(f"{c['plain']} projections and {c['plain experts']} expert layers in "
                         f"{str(self.dtype).removeprefix('torch.')} (their tp cut splits the checkpoint's FP8 "
                         "blocks: dequantized)")
        return "FP8 e4m3: " + "; ".join(parts) + f"; {backend_line(self.device)}"

    # -- internals
    def _full(self, p: Part) -> tuple[int, int, int]:
        """(start, length, the dim's size) of the part."""
        size = self.shape(p.name)[p.dim]
        return p.start, size - p.start if p.length is None else p.length, size

    def _rows(self, parts: list[Part]) -> tuple[int, int]:
        """The [rows, cols] of parts stacked along rows."""
        rows, cols = 0, None
        for p in parts:
            shape = list(self.shape(p.name))
            shape[p.dim] = self._full(p)[1]
            rows += shape[0]
            cols = shape[1]
        return rows, cols

    def _mode(self, groups: list[list[Part]]) -> str:
        """"plain", "keep" (the checkpoint's FP8 blocks as they are) or "quantize" (from a plain source)."""
        if not self.fp8:
            return "plain"
        fp8 = [self.src.block(p.name) is not None for parts in groups for p in parts]
        if not any(fp8):
            return "quantize"
        if all(fp8) and all(self._keeps_blocks(parts) for parts in groups):
            return "keep"
        return "plain"  # a cut through the checkpoint's blocks (or plain and FP8 parts in one matrix): dequantized

    def _keeps_blocks(self, parts: list[Part]) -> bool:
        """The stacked parts are whole 128 x 128 blocks of their tensors (a ragged last block only at a tensor's
        edge), and every part but the last is a whole number of block rows, so one grid covers the stack."""
        for i, p in enumerate(parts):
            if self.src.block(p.name) != (BLOCK, BLOCK):
                return False
            start, length, size = self._full(p)
            if start % BLOCK or (length % BLOCK and start + length != size):
                return False
            if i < len(parts) - 1 and self._rows([p])[0] % BLOCK:
                return False
        return True

    def _stack(self, parts: list[Part]) -> torch.Tensor:
        rows, cols = self._rows(parts)
        if len(parts) == 1:
            return self._plain(parts[0], self.dtype)
        w = torch.empty((rows, cols), dtype=self.dtype, device=self.device)
        r = 0
        for p in parts:
            t = self._plain(p, self.dtype)
            w[r:r + t.shape[0]] = t
            r += t.shape[0]
        return w

    def _fp8_matrix(self, parts: list[Part], mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        if mode == "quantize":
            return quantize_fp8(self._stack(parts))
        rows, cols = self._rows(parts)
        q = torch.empty((rows, cols), dtype=E4M3, device=self.device)
        s = torch.empty((-(-rows // BLOCK), -(-cols // BLOCK)), dtype=torch.float32, device=self.device)
        r = 0
        for p in parts:
            start, length, _ = self._full(p)
            n = self._rows([p])[0]
            sb = -(-length // BLOCK)
            q[r:r + n] = self.src.read(p.name, p.dim, start, length)
            s[r // BLOCK:r // BLOCK + -(-n // BLOCK)] = self.src.read_scale(p.name, p.dim, start // BLOCK, sb)
            r += n
        return q, s

    def _plain(self, p: Part, dtype: torch.dtype) -> torch.Tensor:
        block = self.src.block(p.name)
        if block is None:
            raw = self.src.read(p.name, p.dim, p.start, p.length)
            t = raw.to(device=self.device, dtype=dtype)
            # Without a conversion `to` returns the source's own memory: a view of a training model's tensor or of a
            # file's mapping (safetensors' slices are views of it). Keeping that would keep the whole tensor, or the
            # mapping with every page read through it, alive: copy.
            return t.clone(memory_format=torch.contiguous_format) if t.data_ptr() == raw.data_ptr() else t
        # FP8: the whole blocks covering the part, dequantized on the device, then the part cut from them.
        start, length, size = self._full(p)
        b = block[p.dim]
        a0, a1 = start // b * b, min(-(-(start + length) // b) * b, size)
        q = self.src.read(p.name, p.dim, a0, a1 - a0).to(self.device)
        s = self.src.read_scale(p.name, p.dim, a0 // b, -(-(a1 - a0) // b)).to(self.device)
        return dequantize_fp8(q, s, block).narrow(p.dim, start - a0, length).to(dtype).contiguous()
