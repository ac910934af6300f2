"""The weight files of an HF model folder, checked without reading a tensor or importing torch: every file
model.safetensors.index.json lists (or every *.safetensors), each with a readable header and as long as the header
says. A folder without weights or with a broken download costs one line before anything is loaded."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from paraseek.errors import UserError

_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


def weight_files(folder: str | Path, hint: str = "") -> list[Path]:
    """The folder's safetensors files, each checked (`hint` ends the message of a folder with none)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UserError(f"{index}: not a safetensors index (no weight_map); download it again") from None
        files = [folder / name for name in names]
        for f in files:
            if not f.is_file():
                raise UserError(f"{index}: lists {f.name}, which is missing from the folder")
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise UserError(f"{folder}: no *.safetensors weights in the folder{hint}")
    for f in files:
        if why := _problem(f):
            raise UserError(f"{f}: not a complete safetensors file ({why}); the download may have been cut short: "
                            "download it again")
    return files


def _problem(path: Path) -> str:
    """Why `path` is not a whole safetensors file ("" if it is): its header, and its size against the header."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes"
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            return "no readable header"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return "no readable header"
    if not isinstance(header, dict):
        return "no readable header"
    try:
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, IndexError):
        return "no readable header"
    if 8 + n + end > size:
        return f"{size:,} of {8 + n + end:,} bytes"
    return ""


def tensor_names(folder: str | Path) -> set[str]:
    """The names of the tensors an HF folder's weights hold (its index's weight_map, or each file's header), read
    without torch; after weight_files has checked the files."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            names |= set(json.loads(f.read(n))) - {"__metadata__"}
    return names


def held_mtp_modules(args, folder: str | Path | None = None) -> int:
    """The MTP modules a model starts with: its config's num_nextn_predict_layers, or for an HF folder only those
    whose weights it holds (model.layers.{num_hidden_layers + k}: transformers saves V3 without them). No torch."""
    if folder is None or not args.n_mtp_layers:
        return args.n_mtp_layers
    layers = {int(m.group(1)) for name in tensor_names(folder) if (m := re.match(r"model\.layers\.(\d+)\.", name))}
    k = 0
    while k < args.n_mtp_layers and args.n_layers + k in layers:
        k += 1
    return k
