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
from paraseek.models.lora_spec import LoRASpec, lora_spec


@dataclass
class ModelSource:
    kind: str  # "hf" | "checkpoint" | "random"
    spec: str
    args: ModelArgs
    path: Path | None  # the HF folder, or the checkpoint's step folder
    tokenizer: Path | None  # a folder or tokenizer.json; None: token-id prompts only
    tokenizer_why: str  # where the tokenizer came from, for the first log line
    # A checkpoint of a LoRA run: its adapters, trained on the frozen base `base` (the run's --init-from folder).
    lora: LoRASpec | None = None
    base: Path | None = None
    # A checkpoint's run trained with this --chat-template file (None: the tokenizer folder's template).
    chat_template: Path | None = None


def _checkpoint_step(folder: Path) -> Path | None:
    """The newest complete step folder of a training checkpoint folder (or the folder itself if it is one)."""
    from paraseek.train.checkpoint import needed_checkpoint

    if (folder / "trainer_state.json").is_file() and (folder / ".metadata").is_file():
        return folder
    return needed_checkpoint(folder, "the run was stopped before its first save completed, or the folder was "
                             "damaged since", warn=lambda line: print(f"paraseek: warning: {line}", file=sys.stderr))


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
        if random_weights:
            raise UserError(f"--random-weights: {spec} is a training checkpoint, whose weights are used; leave out "
                            f"--random-weights (it is for a preset or an HF folder's architecture)")
        return _from_checkpoint(spec, step, tok)
    if path.is_dir() or "/" in spec or spec.startswith("."):
        args, _, folder = resolve_model(spec)  # the folder's config.json; one line if it is broken
        if not random_weights:
            from paraseek.models.weights import weight_files

            weight_files(folder, hint="; add --random-weights to run its architecture with random weights "
                         "(benchmarks)")
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
    lora = lora_spec(cfg.get("lora_rank", 0), cfg.get("lora_alpha", 0.0), cfg.get("lora_targets", ""), args, model_spec)
    template = Path(cfg["chat_template"]) if cfg.get("chat_template") and tok is not None else None
    if template is not None and not template.is_file():
        raise UserError(f"{step}: its run's --chat-template {template} is gone; the checkpoint's chat format needs it")
    return ModelSource("checkpoint", spec, args, step, tok, why, lora, folder, template)


def load_model(src: ModelSource, *, dtype, device, seed: int = 0):
    """The whole training model on `device` in `dtype` (InferenceModel.from_training then takes this rank's share).
    The engine reads an HF folder by slices instead (InferenceModel.from_folder); this reads it whole."""
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


def _load_checkpoint(src: ModelSource, dtype, device, merge_lora: bool = True):
    """The checkpoint's model. A LoRA run's checkpoint holds the adapters only: they are put on its base folder's
    weights, merged into them (the plain model generate, serve and export run) or, with merge_lora=False, as LoRA
    modules (models/lora.py), in fp32."""
    import torch

    from paraseek.models.deepseek import Transformer, _keep_fp32_buffers

    if src.lora is not None:
        from paraseek.models.hf import load_pretrained
        from paraseek.models.lora import apply_lora, merge_state

        model = load_pretrained(src.base, dtype=torch.float32, device=device)
        adapters = read_adapters(src, device)
        if merge_lora:
            model.load_state_dict(merge_state({**model.state_dict(), **adapters}, src.lora))
        else:
            apply_lora(model, src.lora)
            model.load_state_dict({**model.state_dict(), **adapters})
    else:
        with torch.device("meta"):
            model = Transformer(src.args)
        model.to_empty(device=device)
        state = {"model": model.state_dict()}
        _dcp_load(src, state)
        model.load_state_dict(state["model"])
    model.init_buffers(torch.device(device))
    model.to(dtype)
    _keep_fp32_buffers(model)
    return model.eval()


def _dcp_load(src: ModelSource, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(src.path))
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise UserError(f"{src.path}: cannot load the model from this checkpoint ({first[:200]})") from None


def read_adapters(src: ModelSource, device="cpu") -> dict:
    """A LoRA checkpoint's adapters as whole fp32 tensors by our names (without the base, which is never read)."""
    import torch

    from paraseek.models.deepseek import Transformer
    from paraseek.models.lora import apply_lora, is_adapter

    with torch.device("meta"):  # the adapters' names and shapes, from the run's spec
        model = Transformer(src.args)
    apply_lora(model, src.lora)
    adapters = {n: torch.empty(t.shape, dtype=torch.float32, device=device)
                for n, t in model.state_dict().items() if is_adapter(n)}
    _dcp_load(src, {"model": adapters})
    return adapters
