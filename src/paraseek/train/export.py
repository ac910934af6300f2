"""`paraseek export CHECKPOINT_DIR OUT_DIR [--step N]`: a training checkpoint as an HF folder that transformers and
`paraseek generate`/`serve` load, with the tokenizer the run trained with (never another one chosen silently) and a
config.json whose bos/eos ids are that tokenizer's."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from paraseek.errors import UserError, check_writable

# Files of a tokenizer folder that travel with it (transformers reads them; chat_template.jinja is how transformers 5
# writes the template).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def check_out_folder(out: str | Path, *, overwrite: bool = False, label: str = "",
                     fix: str = "choose another folder or add --overwrite") -> None:
    """The one rule of a folder an HF model is written to (`paraseek export`'s OUT_DIR, train's --export-hf): a new
    or empty folder, or with `overwrite` one whose files may be replaced; never a file; and one this user can write."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{label}{out} is a file; give a folder to write the model into")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"{label}{out} exists and is not empty; {fix}")
    check_writable(label.strip() or "OUT_DIR", str(out), folder=True)


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, step: int | None = None, dtype: str = "bfloat16",
                      overwrite: bool = False, merge_lora: bool = False, export_adapter: bool = False,
                      log=print) -> Path:
    import torch

    from paraseek.models import save_pretrained
    from paraseek.models.checkpoint_read import (checkpoint_source, checkpoint_step, load_checkpoint_model,
                                                   with_run_mtp_modules)

    folder, out = Path(checkpoint), Path(out)
    if not folder.is_dir():
        raise UserError(f"{folder}: no such folder")
    if step is not None:
        step_dir = folder / f"step-{step:06d}"
        if not (step_dir / "trainer_state.json").is_file() or not (step_dir / ".metadata").is_file():
            have = sorted(p.name for p in folder.glob("step-*") if (p / "trainer_state.json").is_file())
            raise UserError(f"{folder}: no complete checkpoint for step {step} (complete: {', '.join(have) or 'none'})")
    else:
        step_dir = checkpoint_step(folder)
        if step_dir is None:
            raise UserError(f"{folder}: not a paraseek checkpoint folder (no step-N/trainer_state.json)")
    check_out_folder(out, overwrite=overwrite)
    if out.resolve() in (folder.resolve(), step_dir.resolve(), step_dir.resolve().parent):
        raise UserError(f"{out} is the checkpoint folder itself; write the HF folder somewhere else")
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    src = with_run_mtp_modules(checkpoint_source(str(folder), step_dir, None), step_dir)
    _check_lora_choice(src, step_dir, merge_lora, export_adapter)
    tok = model_tokenizer(src.tokenizer, src.args, src.chat_template) if src.tokenizer is not None else None
    if export_adapter:
        from paraseek.models.checkpoint_read import read_adapters
        from paraseek.models.lora import save_peft_adapter

        log(f"export: the LoRA adapters of {step_dir} ({dtype}) -> {out} (PEFT format, on the base {src.base}); "
            f"tokenizer: {src.tokenizer_why}")
        save_peft_adapter(read_adapters(src), src.args, src.lora, out, base_model=str(src.base.resolve()),
                          dtype=torch_dtype)
        if tok is not None:
            _write_tokenizer(Path(src.tokenizer), tok, out, src.args.max_seq_len, src.chat_template is not None)
        return out
    merged = " with its LoRA adapters merged" if src.lora else ""
    log(f"export: {step_dir} ({src.args.model_type}, {dtype}){merged} -> {out}; tokenizer: {src.tokenizer_why}")
    model = load_checkpoint_model(src, torch.float32, "cpu").to(torch_dtype)
    save_pretrained(model, out)
    if tok is not None:
        write_tokenizer(Path(src.tokenizer), tok, out, src.args.max_seq_len, src.chat_template is not None)
    else:
        log("export: the run trained on synthetic tokens and has no tokenizer; the folder holds the model only")
    return out


def _check_lora_choice(src, step_dir: Path, merge_lora: bool, export_adapter: bool) -> None:
    """A LoRA checkpoint is written one of two ways, never a silently chosen one; a plain one has no adapters."""
    if merge_lora and export_adapter:
        raise UserError("--merge-lora and --export-adapter write different folders: choose one")
    if src.lora is None and (merge_lora or export_adapter):
        flag = "--merge-lora" if merge_lora else "--export-adapter"
        raise UserError(f"{flag}: {step_dir} holds no LoRA adapters (its run had no --lora-rank)")
    if src.lora is not None and not (merge_lora or export_adapter):
        raise UserError(f"{step_dir} holds LoRA adapters (r={src.lora.rank} on {','.join(src.lora.targets)}): add "
                        "--merge-lora for an HF folder with them merged into the weights, or --export-adapter for a "
                        "PEFT adapter folder")


def model_tokenizer(source: str | Path, args, chat_template: str | None = None):
    """The tokenizer a run trained with (its --chat-template replacing the folder's, if it had one), refused when it
    has more tokens than the model's vocabulary."""
    from paraseek.models.tokenizer import load_text_tokenizer

    tok = load_text_tokenizer(source, chat_template or None)
    if tok.vocab_size > args.vocab_size:
        raise UserError(f"the tokenizer {source} has {tok.vocab_size:,} tokens but the model's vocabulary is "
                        f"{args.vocab_size:,}: it is not the model's tokenizer")
    return tok


def write_tokenizer(source: Path, tok, out: Path, max_len: int, replaced_template: bool = False) -> None:
    """Beside an exported model's weights: the tokenizer's files, and bos/eos ids in config.json and
    generation_config.json that agree with it (both writers of HF folders, `paraseek export` and train's
    --export-hf, call this)."""
    _write_tokenizer(source, tok, out, max_len, replaced_template)
    config = json.loads((out / "config.json").read_text())
    config.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.stop_token_ids or tok.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _write_tokenizer(source: Path, tok, out: Path, max_len: int, replaced_template: bool = False) -> None:
    """Copy the tokenizer's files; a bare tokenizer.json gets a tokenizer_config.json naming its special tokens, so
    that transformers' AutoTokenizer uses it as it is (PreTrainedTokenizerFast) with the same bos/eos."""
    folder = source if source.is_dir() else source.parent
    tok_file = source / "tokenizer.json" if source.is_dir() else source
    shutil.copy(tok_file, out / "tokenizer.json")
    copied = False
    if source.is_dir():
        for name in TOKENIZER_FILES[1:]:
            if (folder / name).is_file():
                shutil.copy(folder / name, out / name)
                copied = copied or name == "tokenizer_config.json"
    if copied and replaced_template:  # the run's --chat-template, not the folder's, is the model's chat format
        config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
        config["chat_template"] = tok.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        (out / "chat_template.jinja").unlink(missing_ok=True)  # transformers 5 would prefer it to the config's
    if not copied:
        name = tok.tok.id_to_token
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len}
        if tok.bos_token_id is not None:
            config["bos_token"] = name(tok.bos_token_id)
        if tok.eos_token_id is not None:
            config["eos_token"] = name(tok.eos_token_id)
        if tok.chat_template:
            config["chat_template"] = tok.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def cmd_export(ns: argparse.Namespace) -> int:
    export_checkpoint(ns.checkpoint, ns.out, step=ns.step, dtype=ns.dtype, overwrite=ns.overwrite,
                      merge_lora=ns.merge_lora, export_adapter=ns.export_adapter)
    print(f"exported {'a PEFT adapter' if ns.export_adapter else 'an HF'} folder to {Path(ns.out).resolve()}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="a training checkpoint as an HF folder (weights, config, the tokenizer it trained with)",
        description="Write the newest complete step of a `paraseek train --checkpoint-dir` folder (or --step N) as an "
        "HF model folder: safetensors and config.json that transformers loads, the tokenizer the run trained with "
        "(tokenizer.json, tokenizer_config.json with its special tokens and chat template) and bos/eos ids that "
        "agree with it. `paraseek generate`/`serve` take the folder directly.")
    p.add_argument("checkpoint", help="a --checkpoint-dir folder (or one of its step-N folders)")
    p.add_argument("out", help="the HF folder to write (must be new or empty, unless --overwrite)")
    p.add_argument("--step", type=int, help="the step to export (default: the newest complete one)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="weights' dtype (default bfloat16; training keeps fp32 masters)")
    p.add_argument("--overwrite", action="store_true", help="replace what OUT holds")
    p.add_argument("--merge-lora", action="store_true",
                   help="a LoRA run's checkpoint: an HF folder with the adapters merged into the base weights")
    p.add_argument("--export-adapter", action="store_true",
                   help="a LoRA run's checkpoint: a PEFT adapter folder (adapter_config.json, adapter_model."
                   "safetensors) that peft.PeftModel.from_pretrained loads onto the base (the run's --init-from)")
    p.set_defaults(func=cmd_export)
