"""HF model folders in and out: config.json + single or sharded safetensors, tensor by tensor.

Our parameter names are the hub's without the `model.` prefix, except that routed experts are stacked
([E, out, in], one grouped GEMM) where the hub stores one Linear per expert, and that V3's MTP layers
(`model.layers.{n_layers + k}`: enorm, hnorm, eh_proj, shared_head.norm and the block's own names, plus copies of
the embedding and the head) live in `mtp.{k}` -- for every family: a Llama or Qwen2 model trained with
--mtp-layers is written in V3's layout too, with num_nextn_predict_layers in its config.json.

FP8 block-quantized checkpoints (DeepSeek-V3/R1 as they ship; config.json's quantization_config {"quant_method":
"fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}) store each decoder linear weight W [O, I] as float8 e4m3
values with `<name>_scale_inv`, one fp32 scale per block: W = W_e4m3 * scale_inv blockwise (DeepSeek-V3's
inference/kernel.py weight_dequant). `load_state_into` dequantizes them; `HubTensors` reads any slice of a folder's
tensors, e4m3 values and scales as stored, for the inference model's sharded loading (infer/weights.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from paraseek.errors import UserError
from paraseek.models.args import ModelArgs, read_hf_config
from paraseek.models.deepseek import Gate, Transformer
from paraseek.models.init import copy_local
from paraseek.models.weights import weight_files

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
            "shared_head.norm.weight": "norm.weight"}
# V3 stores copies of the embedding and output head in its MTP layer; they are shared with the main model.
_MTP_SHARED = {"embed_tokens.weight", "shared_head.head.weight"}


def hub_to_ours(key: str, n_layers: int) -> tuple[str, int | None] | None:
    """Hub tensor name -> (our name, expert index or None); None for tensors we derive instead of store."""
    if key.endswith("rotary_emb.inv_freq"):
        return None
    m = _LAYER.match(key)
    if not m:
        return (key[len("model."):] if key.startswith("model.") else key), None
    layer, rest = int(m.group(1)), m.group(2)
    if layer >= n_layers:
        k = layer - n_layers
        if rest in _MTP_SHARED:
            return None
        if rest in _MTP_OWN:
            return f"mtp.{k}.{_MTP_OWN[rest]}", None
        prefix = f"mtp.{k}.block"
    else:
        prefix = f"layers.{layer}"
    e = _EXPERT.match(rest)
    if e:
        return f"{prefix}.mlp.experts.{e.group(2)}", int(e.group(1))
    return f"{prefix}.{rest}", None


def ours_to_hub(state: dict[str, torch.Tensor], args: ModelArgs) -> Iterator[tuple[str, torch.Tensor]]:
    """(hub name, tensor) for every tensor of the hub format, experts split, MTP copies written out."""
    own = {v: k for k, v in _MTP_OWN.items()}
    for name, t in state.items():
        if name.startswith("mtp."):
            k, rest = name.split(".", 2)[1:]
            hub_prefix = f"model.layers.{args.n_layers + int(k)}"
            if rest in own:
                yield f"{hub_prefix}.{own[rest]}", t
                continue
            rest = rest[len("block."):]
        elif name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            hub_prefix = f"model.layers.{i}"
        elif name == "lm_head.weight":
            yield name, t
            continue
        else:
            yield f"model.{name}", t
            continue
        if rest.startswith("mlp.experts."):
            proj = rest.rsplit(".", 1)[1]
            for e in range(t.shape[0]):
                yield f"{hub_prefix}.mlp.experts.{e}.{proj}.weight", t[e]
        else:
            yield f"{hub_prefix}.{rest}", t
    head = state["embed_tokens.weight"] if args.tie_embeddings else state["lm_head.weight"]
    for k in range(args.n_mtp_layers):
        hub_prefix = f"model.layers.{args.n_layers + k}"
        yield f"{hub_prefix}.embed_tokens.weight", state["embed_tokens.weight"]
        yield f"{hub_prefix}.shared_head.head.weight", head


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from model.safetensors.index.json or the single model.safetensors."""
    single = weight_files(folder, hint=" (only config.json); use the preset name to get random init")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {key: folder / fname for key, fname in json.loads(index.read_text())["weight_map"].items()}
    files: dict[str, Path] = {}
    for f in single:
        with safe_open(f, framework="pt") as st:
            files.update({key: f for key in st.keys()})
    return files


FP8_BLOCK = (128, 128)  # DeepSeek-V3's weight_block_size: the only block the FP8 GEMMs of infer/fp8.py take
E4M3 = torch.float8_e4m3fn  # the FP8 format of DeepSeek-V3's checkpoints
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_FLOOR = 1e-12  # the smallest amax a scale is made from: an all-zero block or row quantizes to zeros, not NaN


def dequantize_fp8(w_OI: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """DeepSeek-V3 FP8 weights: e4m3 values times one fp32 scale per [block[0], block[1]] block (scale_inv
    [..., ceil(O/b0), ceil(I/b1)]), in fp32. Leading dims (stacked experts) are kept."""
    O, I = w_OI.shape[-2:]
    s = scale_inv.float().repeat_interleave(block[0], -2)[..., :O, :].repeat_interleave(block[1], -1)[..., :I]
    return w_OI.float() * s


def quantize_fp8(w_OI: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse in DeepSeek-V3's recipe (technical report sec. 3.3.2, fine-grained quantization): per block,
    scale_inv = amax / 448 and W_e4m3 = W / scale_inv, so each block's largest magnitude maps to e4m3's largest
    finite value. -> (e4m3 [..., O, I], fp32 scale_inv [..., ceil(O/b0), ceil(I/b1)]). Leading dims are kept."""
    *lead, O, I = w_OI.shape
    b0, b1 = block
    Ob, Ib = -(-O // b0), -(-I // b1)
    w = w_OI.float()
    if Ob * b0 != O or Ib * b1 != I:  # ragged edge blocks: zeros do not change a block's amax
        w = torch.nn.functional.pad(w, (0, Ib * b1 - I, 0, Ob * b0 - O))
    blocks = w.view(*lead, Ob, b0, Ib, b1)
    scale_inv = blocks.abs().amax(dim=(-3, -1)).clamp_min(SCALE_FLOOR) / E4M3_MAX
    q = (blocks / scale_inv[..., :, None, :, None]).view(w.shape)[..., :O, :I].to(torch.float8_e4m3fn)
    return q, scale_inv


_FP8_WEIGHT = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(.+\.)?\w+_proj(_with_mqa)?\.weight$")


def is_fp8_weight(key: str) -> bool:
    """Is the hub tensor `key` one a DeepSeek-V3/R1 checkpoint stores in FP8: every decoder linear weight (attention
    q/q_a/q_b/kv_a_proj_with_mqa/kv_b/o_proj, k/v_proj of other families; every MLP, expert and shared-expert
    gate/up/down), not the embedding, the head, the norms, the router gate, its bias or MTP's eh_proj."""
    return bool(_FP8_WEIGHT.match(key))


def fp8_block_size(cfg: dict[str, Any], where: str | Path) -> tuple[int, int] | None:
    """The weight block of a config.json's FP8 quantization_config ((128, 128) for DeepSeek-V3/R1), None without
    one; a quantization this loader does not read is one line."""
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    where = f"{where}: quantization_config"
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise UserError(f"{where} has quant_method {method!r}: paraseek reads bf16/fp16/fp32 checkpoints and FP8 "
                        "block-quantized ones (quant_method \"fp8\", as DeepSeek-V3/R1 ship)")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise UserError(f"{where} has fmt {quant.get('fmt')!r}: the FP8 weights read are e4m3 (float8_e4m3fn)")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise UserError(f"{where} has activation_scheme {quant.get('activation_scheme')!r}: only \"dynamic\" "
                        "(activations quantized on the fly, per token) is read")
    block = quant.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise UserError(f"{where} has weight_block_size {block!r}: expected two positive integers such as "
                        "[128, 128] (per-block weight scales)")
    return int(block[0]), int(block[1])


def check_scale(key: str, dtype: torch.dtype | str, shape, scale_shape, block: tuple[int, int] | None,
                where: str) -> None:
    """An FP8 weight and its scale_inv agree with each other and with the config (one line otherwise): float8 values
    need a scale (and the config's block size), a scale needs float8 values, and it has one entry per block."""
    fp8 = str(dtype).removeprefix("torch.") in ("float8_e4m3fn", "F8_E4M3")
    if fp8 and scale_shape is None:
        raise UserError(f"{where}: {key!r} is float8_e4m3fn but its scale {key + '_scale_inv'!r} is missing; the "
                        "download may be incomplete")
    if scale_shape is None:
        return
    if not fp8:
        raise UserError(f"{where}: {key!r} has a scale {key + '_scale_inv'!r} but is stored as {dtype}, not "
                        "float8_e4m3fn")
    if block is None:
        raise UserError(f"{where}: {key!r} is float8_e4m3fn with a scale, but config.json has no quantization_config "
                        "saying its block size; add \"quantization_config\": {\"quant_method\": \"fp8\", "
                        "\"weight_block_size\": [128, 128]} if its blocks are 128x128")
    want = tuple(-(-n // b) for n, b in zip(tuple(shape)[-2:], block))
    if tuple(scale_shape) != want:
        raise UserError(f"{where}: {key + '_scale_inv'!r} has shape {tuple(scale_shape)}; {tuple(shape)} in blocks of "
                        f"{list(block)} needs {want}")


class _Files:
    """Open safetensors handles, one per file, kept while loading."""

    def __init__(self) -> None:
        self.handles: dict[Path, Any] = {}

    def get(self, path: Path, key: str) -> torch.Tensor:
        if path not in self.handles:
            self.handles[path] = safe_open(path, framework="pt", device="cpu")
        return self.handles[path].get_tensor(key)


_ITEMSIZE = {"F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1, "U8": 1, "I8": 1, "BF16": 2, "F16": 2, "I16": 2, "F32": 4,
             "I32": 4, "F64": 8, "I64": 8}


class HubTensors:
    """An HF folder's tensors by hub name, each read a slice at a time (safetensors' get_slice), as stored (float8
    e4m3 values and their fp32 `_scale_inv` included): a tensor-parallel rank reads the rows or columns it keeps
    and nothing else. Names, dtypes and shapes come from the files' headers, without reading a tensor.

    safetensors memory-maps a file while it is open, and the pages read through a mapping count in the process's
    resident memory until the mapping is closed. So a file is reopened once `map_budget` bytes have been read
    through its mapping: the host memory a load peaks at is what it keeps, plus about one tensor (a slice and the
    pages it was read from), plus at most map_budget of mapped pages."""

    def __init__(self, folder: str | Path, map_budget: int = 1 << 30):
        self.folder = Path(folder)
        self.map_budget = map_budget
        self.files = _tensor_files(self.folder)
        self.meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        for path in sorted(set(self.files.values())):
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    self.meta[key] = (sl.get_dtype(), tuple(sl.get_shape()))
        self._open: dict[Path, tuple[Any, int]] = {}  # file -> (handle, bytes read through it)

    def __contains__(self, key: str) -> bool:
        return key in self.meta

    def shape(self, key: str) -> tuple[int, ...]:
        return self.meta[key][1]

    def read(self, key: str, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
        """The whole tensor (dim None), or its [start, start + length) along `dim`, on the CPU as stored."""
        dtype, shape = self.meta[key]
        nbytes = _ITEMSIZE.get(dtype, 4)
        for n in shape:
            nbytes *= n
        # Rows of a row-major tensor are contiguous: a cut along dim 0 maps only its own pages; other cuts touch all.
        touched = nbytes * length // max(shape[0], 1) if dim == 0 and length is not None else nbytes
        path = self.files[key]
        handle, used = self._open.get(path, (None, 0))
        if handle is None or (used and used + touched > self.map_budget):
            self._open.pop(path, None)  # unmaps the old mapping (its pages leave the resident set)
            handle, used = safe_open(path, framework="pt", device="cpu"), 0
        self._open[path] = (handle, used + touched)
        sl = handle.get_slice(key)
        if dim is None:
            return sl[:]
        index = [slice(None)] * len(shape)
        index[dim] = slice(start, start + (shape[dim] - start if length is None else length))
        return sl[tuple(index)]

    def close(self) -> None:
        self._open.clear()

    def check(self, args: ModelArgs, block: tuple[int, int] | None, skip_mtp: bool = True) -> None:
        """The folder holds exactly the architecture's tensors, with the shapes its config implies and a consistent
        scale for every FP8 weight: one line naming the first that is wrong (load_state_into's checks, from the
        headers alone). `skip_mtp`: V3's multi-token-prediction layers are not looked at (the engine does not run
        them)."""
        with torch.device("meta"):
            whole = {n: tuple(t.shape) for n, t in Transformer(args).state_dict().items()}
        expected = {(n, e) for n, shape in whole.items()
                    for e in (range(shape[0]) if ".mlp.experts." in n else [None])
                    if not (skip_mtp and n.startswith("mtp."))}
        filled: set[tuple[str, int | None]] = set()
        for key, (dtype, shape) in sorted(self.meta.items()):
            if key.endswith("_scale_inv"):
                if key[:-len("_scale_inv")] not in self.meta:
                    raise UserError(f"{self.files[key].name}: scale {key!r} has no weight {key[:-len('_scale_inv')]!r}")
                continue
            mapped = hub_to_ours(key, args.n_layers)
            if mapped is None or (key == "lm_head.weight" and args.tie_embeddings):
                continue
            name, expert = mapped
            where = self.files[key].name
            if skip_mtp and name.startswith("mtp."):
                if int(name.split(".")[1]) >= args.n_mtp_layers:
                    raise UserError(f"{where}: unexpected tensor {key!r}: the config has {args.n_layers} layers and "
                                    f"{args.n_mtp_layers} MTP layers (num_nextn_predict_layers)")
                continue
            if name not in whole:
                raise UserError(f"{where}: unexpected tensor {key!r}, not part of this {args.model_type} model")
            want = whole[name] if expert is None else whole[name][1:]
            if shape != want:
                raise UserError(f"{where}: tensor {key!r} has shape {shape}, the config implies {want}")
            scale = self.meta.get(key + "_scale_inv")
            check_scale(key, dtype, shape, None if scale is None else scale[1], block, where)
            filled.add((name, expert))
        _lacks(self.folder, expected - filled)


def _lacks(folder: Path, missing: set[tuple[str, int | None]]) -> None:
    """One line naming the first of the (name, expert) tensors a folder lacks, and how many more."""
    if not missing:
        return
    missing_sorted = sorted(missing, key=str)
    name, expert = missing_sorted[0]
    more = f" (and {len(missing_sorted) - 1} more)" if len(missing_sorted) > 1 else ""
    what = name if expert is None else f"{name}[expert {expert}]"
    raise UserError(f"{folder}: the checkpoint lacks {what}{more}")


def load_state_into(model: Transformer, folder: str | Path, cfg: dict[str, Any] | None = None,
                    stage: bool = False, fresh_mtp: bool = False) -> set[str]:
    """Stream an HF folder's tensors into `model`'s (allocated) parameters, one tensor at a time. `stage`: the
    model is a pipeline stage holding part of the layers; the folder's other tensors are skipped. Tensors the
    architecture does not define (adapters added from outside) are left as they are. `fresh_mtp`: MTP modules the
    folder has no weights for are left as they are too (the caller initializes them). Returns the names left."""
    folder = Path(folder)
    cfg = cfg if cfg is not None else read_hf_config(folder)
    files = _tensor_files(folder)
    args = model.args
    block = fp8_block_size(cfg, folder / "config.json")
    with torch.device("meta"):  # the names of the whole model: a tensor outside it still means the wrong folder
        whole = set(Transformer(args).state_dict())
    # Only the architecture's own tensors come from the folder: what was added from outside (LoRA adapters,
    # models/lora.py) is initialized or loaded by its owner.
    targets = {n: t for n, t in model.state_dict().items() if n in whole}
    expected = {(n, e) for n, t in targets.items() for e in (range(t.shape[0]) if ".mlp.experts." in n else [None])}
    filled: set[tuple[str, int | None]] = set()
    opened = _Files()
    for key, path in sorted(files.items(), key=lambda kv: (str(kv[1]), kv[0])):
        if key.endswith("_scale_inv"):
            continue
        mapped = hub_to_ours(key, args.n_layers)
        if mapped is None or (key == "lm_head.weight" and args.tie_embeddings):
            continue
        name, expert = mapped
        if stage and name in whole and name not in targets:
            continue  # another pipeline stage's tensor
        if name not in targets:
            raise UserError(f"{path.name}: unexpected tensor {key!r}, not part of this {args.model_type} model")
        src = opened.get(path, key)
        scale_key = key + "_scale_inv"
        scale = opened.get(files[scale_key], scale_key) if scale_key in files else None
        check_scale(key, src.dtype, src.shape, None if scale is None else scale.shape, block, path.name)
        if scale is not None:
            src = dequantize_fp8(src, scale, block)
        dst = targets[name]
        want = tuple(dst.shape) if expert is None else tuple(dst.shape[1:])
        if tuple(src.shape) != want:
            raise UserError(f"{path.name}: tensor {key!r} has shape {tuple(src.shape)}, the config implies {want}")
        copy_local(dst, src, expert)
        filled.add((name, expert))
    missing = sorted(expected - filled, key=str)
    left = {name for name, _ in missing if fresh_mtp and name.startswith("mtp.")}
    _lacks(folder, {(name, e) for name, e in missing if name not in left})
    return left


def load_pretrained(
    path: str | Path, *, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
) -> Transformer:
    """Load an HF folder (config.json + safetensors) into a paraseek Transformer on `device` in `dtype`."""
    folder = Path(path)
    cfg = read_hf_config(folder)
    args = ModelArgs.from_hf_config(cfg)
    files = _tensor_files(folder)
    if args.n_mtp_layers and not any(
        (m := _LAYER.match(k)) and int(m.group(1)) >= args.n_layers for k in files
    ):
        args = args.replace(n_mtp_layers=0)  # e.g. saved by transformers, which drops the MTP layer
    with torch.device("meta"):
        model = Transformer(args)
    model.to(dtype)
    for m in model.modules():
        if isinstance(m, Gate) and m.e_score_correction_bias is not None:
            m.e_score_correction_bias.data = m.e_score_correction_bias.data.float()
    model.to_empty(device=device)
    load_state_into(model, folder, cfg)
    model.init_buffers(torch.device(device))
    for m in model.modules():
        if hasattr(m, "tokens_per_expert"):
            m.tokens_per_expert.zero_()
    return model


def save_pretrained(model: Transformer, path: str | Path, *, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write an HF folder transformers loads: hub config.json, safetensors (sharded with an index past
    max_shard_bytes), per-expert weights as the hub stores them. A sharded (DTensor) model is gathered."""
    save_hf_state({n: _full(t) for n, t in model.state_dict().items()}, model.args, path, max_shard_bytes=max_shard_bytes)


def save_hf_state(
    state: dict[str, torch.Tensor], args: ModelArgs, path: str | Path, *, max_shard_bytes: int = 5 * 2**30
) -> None:
    """Write a full (unsharded) paraseek state dict as an HF folder."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = state["embed_tokens.weight"].dtype
    cfg = args.to_hf_config(torch_dtype=str(dtype).removeprefix("torch."))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    plan: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in ours_to_hub(state, args):
        nbytes = t.numel() * t.element_size()
        if plan[-1] and size + nbytes > max_shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append((name, t))
        size += nbytes
    for old in folder.glob("model*.safetensors*"):
        old.unlink()
    total = 0
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(plan):
        fname = "model.safetensors" if len(plan) == 1 else f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        # Own storage per tensor: safetensors refuses tensors that share memory (stacked experts, tied copies).
        tensors = {n: t.detach().to("cpu").clone().contiguous() for n, t in shard}
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({n: fname for n in tensors})
        del tensors
    if len(plan) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _full(t: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else t
