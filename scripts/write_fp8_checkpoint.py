"""Write an HF model folder in DeepSeek-V3's FP8 format: every decoder linear weight (models.hf.is_fp8_weight) as
float8 e4m3 with its `weight_scale_inv` (one fp32 scale per 128 x 128 block, amax / 448 as V3's recipe), the rest
(embedding, head, norms, router, its bias, MTP's eh_proj) as the source has them, and config.json's
quantization_config {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]} -- the tensor names, dtypes and config that DeepSeek-V3/R1 ship with.

    python scripts/write_fp8_checkpoint.py SRC OUT [--layers N] [--mtp-layers N] [--random-weights] [--seed S]
        [--device cpu|cuda] [--max-shard-gib G]

SRC is an HF folder of bf16/fp16/fp32 weights (its tensors are quantized, one at a time; its tokenizer and
generation_config.json are copied), or, with --random-weights, a preset name or a folder's config.json (its
architecture with random weights, drawn per tensor as paraseek's own initialization draws them: std 0.02, the
residual projections scaled down, norms ones). --layers keeps the first N decoder layers (a large model cut to fit
one GPU with its layers' shapes intact); the MTP layers (num_nextn_predict_layers, or --mtp-layers) follow them.
Memory: one tensor plus one shard (--max-shard-gib, default 4). The tests write tiny V3-shaped folders with it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from paraseek.errors import UserError
from paraseek.models.args import ModelArgs, preset_config, read_hf_config
from paraseek.models.hf import FP8_BLOCK, HubTensors, hub_to_ours, is_fp8_weight, ours_to_hub, quantize_fp8
from paraseek.seeding import derive_seed

QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": list(FP8_BLOCK)}
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def random_tensors(args: ModelArgs, seed: int, device: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(hub name, tensor) of the architecture with random weights: bf16, the routing bias fp32. Each tensor drawn from
    its own generator seeded by (seed, its name, its expert), so the MTP layer's copies of the embedding and the head
    equal the main ones."""
    from paraseek.models.deepseek import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    for hub, t in ours_to_hub(model.state_dict(), args):
        mapped = hub_to_ours(hub, args.n_layers)
        if mapped is None:  # the MTP layer's copies of the embedding and the head
            head = "embed_tokens.weight" if args.tie_embeddings else "lm_head.weight"
            mapped = ("embed_tokens.weight" if hub.endswith("embed_tokens.weight") else head, None)
        name, expert = mapped
        kind, std = model.init_rule(name)
        dtype = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        if kind == "normal":
            g = torch.Generator(device=device).manual_seed(derive_seed(seed, name, expert))
            x = torch.empty(tuple(t.shape), device=device).normal_(0.0, std, generator=g)
        else:
            x = (torch.ones if kind == "ones" else torch.zeros)(tuple(t.shape), device=device)
        yield hub, x.to(dtype)


def folder_tensors(folder: Path, n_src: int, layers: int, mtp_layers: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(hub name, tensor) of an HF folder, its decoder layers cut to `layers` and its MTP layers renumbered after
    them (at most `mtp_layers`)."""
    tensors = HubTensors(folder)
    for key in sorted(tensors.meta):
        m = _LAYER.match(key)
        if m:
            i = int(m.group(1))
            if i >= n_src:  # an MTP layer: numbered after the decoder layers
                if i - n_src >= mtp_layers:
                    continue
                key_out = f"model.layers.{layers + i - n_src}.{m.group(2)}"
            elif i >= layers:
                continue
            else:
                key_out = key
        else:
            key_out = key
        yield key_out, tensors.read(key)
    tensors.close()


class ShardWriter:
    """safetensors shards of at most max_bytes each (model.safetensors, or model-0000i-of-0000n.safetensors with
    model.safetensors.index.json), written as they fill."""

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max_bytes = out, max_bytes
        self.shard: dict[str, torch.Tensor] = {}
        self.size = 0
        self.written: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.shard and self.size + nbytes > self.max_bytes:
            self._flush()
        self.shard[name] = t.detach().to("cpu").contiguous()
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        path = self.out / f"part-{len(self.written):05d}.safetensors.tmp"
        save_file(self.shard, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.shard)))
        self.shard, self.size = {}, 0

    def finish(self) -> None:
        if self.shard or not self.written:
            self._flush()
        n = len(self.written)
        weight_map = {}
        for i, (path, names) in enumerate(self.written):
            name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.out / name)
            weight_map.update({k: name for k in names})
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write(src: str, out: Path, *, layers: int | None = None, mtp_layers: int | None = None,
          random_weights: bool = False, seed: int = 0, device: str = "cpu", max_shard_bytes: int = 4 << 30) -> None:
    folder = Path(src) if Path(src).is_dir() else None
    if folder is None and not random_weights:
        raise UserError(f"{src}: a preset has no weights to quantize; add --random-weights (or give an HF folder)")
    cfg = dict(read_hf_config(folder) if folder is not None else preset_config(src))
    if folder is not None and not random_weights and cfg.get("quantization_config"):
        raise UserError(f"{folder} is already quantized (its config.json has a quantization_config): give its "
                        "bf16/fp32 weights, or --random-weights for its architecture")
    n_src = int(cfg.get("num_hidden_layers", 0))
    if layers is not None:
        if not 1 <= layers <= n_src:
            raise UserError(f"--layers must be in 1..{n_src} (the model's layers), got {layers}")
        cfg["num_hidden_layers"] = layers
    n_mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    if mtp_layers is not None:
        if mtp_layers < 0 or (not random_weights and mtp_layers > n_mtp):
            raise UserError(f"--mtp-layers must be in 0..{n_mtp} (the folder's MTP layers), got {mtp_layers}")
        n_mtp = mtp_layers
    if "num_nextn_predict_layers" in cfg or n_mtp:
        cfg["num_nextn_predict_layers"] = n_mtp
    cfg["quantization_config"] = dict(QUANTIZATION_CONFIG)
    cfg["torch_dtype"] = "bfloat16"
    args = ModelArgs.from_hf_config(cfg)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out}: exists and is not empty; give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    if random_weights:
        tensors = random_tensors(args, seed, device)
    else:
        tensors = folder_tensors(folder, n_src, args.n_layers, n_mtp)
    writer = ShardWriter(out, max_shard_bytes)
    for key, t in tensors:
        if is_fp8_weight(key):
            q, scale_inv = quantize_fp8(t.to(device))
            writer.add(key, q)
            writer.add(key + "_scale_inv", scale_inv)
        else:
            writer.add(key, t)
    writer.finish()
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if folder is not None:
        for name in COPIED:
            if (folder / name).is_file():
                shutil.copy(folder / name, out / name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="an HF folder of bf16/fp16/fp32 weights, or with --random-weights a preset or a folder")
    p.add_argument("out", type=Path, help="the folder to write (new or empty)")
    p.add_argument("--layers", type=int, help="keep the first N decoder layers")
    p.add_argument("--mtp-layers", type=int,
                   help="MTP layers to write (default: the config's num_nextn_predict_layers)")
    p.add_argument("--random-weights", action="store_true", help="random weights of SRC's architecture")
    p.add_argument("--seed", type=int, default=0, help="random weights' seed (default 0)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where tensors are drawn and quantized (default: cuda when available)")
    p.add_argument("--max-shard-gib", type=float, default=4.0, help="safetensors shard size (default 4 GiB)")
    ns = p.parse_args(argv)
    try:
        write(ns.src, ns.out, layers=ns.layers, mtp_layers=ns.mtp_layers, random_weights=ns.random_weights,
              seed=ns.seed, device=ns.device, max_shard_bytes=int(ns.max_shard_gib * 2**30))
    except UserError as e:
        print(f"write_fp8_checkpoint: {e}", file=sys.stderr)
        return 2
    print(f"wrote {ns.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
