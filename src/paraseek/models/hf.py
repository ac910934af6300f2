"""HF model folders in and out: config.json + single or sharded safetensors, tensor by tensor.

Our parameter names are the hub's without the `model.` prefix, except that routed experts are stacked
([E, out, in], one grouped GEMM) where the hub stores one Linear per expert, and that V3's MTP layers
(`model.layers.{n_layers + k}`: enorm, hnorm, eh_proj, shared_head.norm and the block's own names, plus copies of
the embedding and the head) live in `mtp.{k}` -- for every family: a Llama or Qwen2 model trained with
--mtp-layers is written in V3's layout too, with num_nextn_predict_layers in its config.json. FP8 block-quantized
weights (`weight_scale_inv`) are dequantized on load.
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


def dequantize_fp8(w_OI: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """DeepSeek-V3 FP8 weights: e4m3 values times one fp32 scale per [128, 128] block (scale_inv [ceil(O/128),
    ceil(I/128)])."""
    O, I = w_OI.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:O].repeat_interleave(block[1], 1)[:, :I]
    return w_OI.float() * s


class _Files:
    """Open safetensors handles, one per file, kept while loading."""

    def __init__(self) -> None:
        self.handles: dict[Path, Any] = {}

    def get(self, path: Path, key: str) -> torch.Tensor:
        if path not in self.handles:
            self.handles[path] = safe_open(path, framework="pt", device="cpu")
        return self.handles[path].get_tensor(key)


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
    quant = cfg.get("quantization_config") or {}
    block = tuple(quant.get("weight_block_size", (128, 128)))
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
        if scale_key in files:
            src = dequantize_fp8(src, opened.get(files[scale_key], scale_key), block)
        dst = targets[name]
        want = tuple(dst.shape) if expert is None else tuple(dst.shape[1:])
        if tuple(src.shape) != want:
            raise UserError(f"{path.name}: tensor {key!r} has shape {tuple(src.shape)}, the config implies {want}")
        copy_local(dst, src, expert)
        filled.add((name, expert))
    missing = sorted(expected - filled, key=str)
    left = {name for name, _ in missing if fresh_mtp and name.startswith("mtp.")}
    missing = [(name, e) for name, e in missing if name not in left]
    if missing:
        name, expert = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        what = name if expert is None else f"{name}[expert {expert}]"
        raise UserError(f"{folder}: the checkpoint lacks {what}{more}")
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
