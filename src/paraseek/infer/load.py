"""What MODEL names for `generate`/`serve`: an HF folder (its weights and tokenizer), a paraseek training checkpoint
(the model it trained and the tokenizer it trained with), or a preset with random weights (benchmarks). Resolved
without loading a weight, so bad input costs one line before anything big happens."""

from __future__ import annotations

from pathlib import Path

from paraseek.errors import UserError
from paraseek.models.args import resolve_model
from paraseek.models.checkpoint_read import ModelSource, checkpoint_source, checkpoint_step, load_checkpoint_model


def resolve_source(spec: str, *, random_weights: bool = False, tokenizer: str | None = None) -> ModelSource:
    path = Path(spec)
    tok = Path(tokenizer) if tokenizer else None
    if tok is not None and not tok.exists():
        raise UserError(f"--tokenizer {tokenizer}: no such file or folder")
    if path.is_dir() and not (path / "config.json").is_file():
        step = checkpoint_step(path)
        if step is None:
            raise UserError(f"{spec}: neither an HF model folder (no config.json) nor a paraseek checkpoint folder "
                            f"(no step-N/trainer_state.json)")
        if random_weights:
            raise UserError(f"--random-weights: {spec} is a training checkpoint, whose weights are used; leave out "
                            f"--random-weights (it is for a preset or an HF folder's architecture)")
        return checkpoint_source(spec, step, tok)
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
    return load_checkpoint_model(src, dtype, device)


def load_tokenizer(src, chat_template: str | None = None):
    """MODEL's tokenizer (None when it has none), through the loader every command uses (models/tokenizer.py);
    `chat_template`: a Jinja file replacing the one the source names."""
    if src.tokenizer is None:
        return None
    from paraseek.models.tokenizer import load_text_tokenizer

    return load_text_tokenizer(src.tokenizer, chat_template or src.chat_template)
