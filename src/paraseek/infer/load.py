"""What MODEL names for `generate`/`serve`: an HF folder (its weights and tokenizer), a paraseek training checkpoint
(the model it trained and the tokenizer it trained with), or a preset with random weights (benchmarks). Resolved
without loading a weight, so bad input costs one line before anything big happens."""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from paraseek.errors import UserError
from paraseek.models.args import ModelArgs, resolve_model


@dataclass
class ModelSource:
    kind: str  # "hf" | "checkpoint" | "random"
    spec: str
    args: ModelArgs
    path: Path | None  # the HF folder, or the checkpoint's step folder
    tokenizer: Path | None  # a folder or tokenizer.json; None: token-id prompts only
    tokenizer_why: str  # where the tokenizer came from, for the first log line


def _checkpoint_step(folder: Path) -> Path | None:
    """The newest complete step folder of a training checkpoint folder (or the folder itself if it is one)."""
    from paraseek.train.checkpoint import latest_checkpoint

    if (folder / "trainer_state.json").is_file() and (folder / ".metadata").is_file():
        return folder
    return latest_checkpoint(folder, warn=lambda line: print(f"paraseek: warning: {line}", file=sys.stderr))


def resolve_source(spec: str, *, random_weights: bool = False, tokenizer: str | None = None) -> ModelSource:
    path = Path(spec)
    tok = Path(tokenizer) if tokenizer else None
    if tok is not None and not tok.exists():
        raise UserError(f"--tokenizer {tokenizer}: no such file or folder")
    if path.is_dir() and not (path / "config.json").is_file():
        step = _checkpoint_step(path)
        if step is None:
            raise UserError(f"{spec}: neither an HF model folder (no config.json) nor a paraseek checkpoint folder "
                            f"(no step-N/trainer_state.json)")
        return _from_checkpoint(spec, step, tok)
    if path.is_dir() or "/" in spec or spec.startswith("."):
        args, _, folder = resolve_model(spec)  # the folder's config.json; one line if it is broken
        has_weights = any(folder.glob("*.safetensors"))
        if not has_weights and not random_weights:
            raise UserError(f"{spec}: no *.safetensors weights in the folder; add --random-weights to run its "
                            f"architecture with random weights (benchmarks)")
        if tok is None and (folder / "tokenizer.json").is_file():
            tok, why = folder, f"the model folder's ({folder / 'tokenizer.json'})"
        else:
            why = f"--tokenizer {tok}" if tok else "none (the folder has no tokenizer.json): token-id prompts only"
        return ModelSource("random" if random_weights else "hf", spec, args, folder, tok, why)
    args, _, _ = resolve_model(spec)  # a preset: one line if unknown
    if not random_weights:
        raise UserError(f"{spec} is a preset, which has no weights: give an HF model folder or a paraseek checkpoint, "
                        f"or add --random-weights to benchmark the architecture with random weights")
    why = f"--tokenizer {tok}" if tok else "none (a preset has none): token-id prompts only"
    return ModelSource("random", spec, args, None, tok, why)


def _from_checkpoint(spec: str, step: Path, tok: Path | None) -> ModelSource:
    try:
        state = json.loads((step / "trainer_state.json").read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{step / 'trainer_state.json'}: not valid JSON ({e.msg}); the checkpoint is damaged") from None
    cfg = state.get("config") or {}
    model_spec = cfg.get("init_from") or cfg.get("model")
    if not model_spec:
        raise UserError(f"{step / 'trainer_state.json'}: names no model; the checkpoint was not written by paraseek train")
    args, _, folder = resolve_model(model_spec)
    why = f"--tokenizer {tok}" if tok else ""
    if tok is None:
        from paraseek.train.data import BUNDLED_TOKENIZER

        if cfg.get("tokenizer"):
            tok, why = Path(cfg["tokenizer"]), f"the one it was trained with ({cfg['tokenizer']})"
        elif folder is not None and (folder / "tokenizer.json").is_file():
            tok, why = folder, f"its --init-from folder's ({folder})"
        elif cfg.get("data") and cfg.get("data") != "synthetic":
            tok, why = BUNDLED_TOKENIZER, f"the one it was trained with (the bundled {BUNDLED_TOKENIZER.name})"
        else:
            why = "none (trained on synthetic tokens): token-id prompts only"
    return ModelSource("checkpoint", spec, args, step, tok, why)


def load_model(src: ModelSource, *, dtype, device, seed: int = 0):
    """The whole model on `device` in `dtype` (tensor parallelism then cuts it, infer/tp.py)."""
    import torch

    from paraseek.models import build_model, load_pretrained

    if src.kind == "hf":
        return load_pretrained(src.path, dtype=dtype, device=device).eval()
    if src.kind == "random":
        torch.manual_seed(seed)
        if torch.device(device).type == "cuda":
            torch.cuda.manual_seed(seed)
        # Hub-like scale (0.02); the bench only needs the shapes and the work, not meaningful text.
        return build_model(src.args, device, dtype).eval()
    return _load_checkpoint(src, dtype, device)


def _load_checkpoint(src: ModelSource, dtype, device):
    import torch
    import torch.distributed.checkpoint as dcp

    from paraseek.models.deepseek import Transformer, _keep_fp32_buffers

    with torch.device("meta"):
        model = Transformer(src.args)
    model.to_empty(device=device)
    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(src.path))
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise UserError(f"{src.path}: cannot load the model from this checkpoint ({first[:200]})") from None
    model.load_state_dict(state["model"])
    model.init_buffers(torch.device(device))
    model.to(dtype)
    _keep_fp32_buffers(model)
    return model.eval()
