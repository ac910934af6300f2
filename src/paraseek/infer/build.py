"""The replica's Engine from the engine flags: the weights in their format (this rank's tp share), the tokenizer,
the KV cache, LoRA slots and the speculative drafter, each mistake one line before a weight is read."""

from __future__ import annotations

import argparse
import time

from paraseek.errors import UserError
from paraseek.infer.flags import engine_config, lora_modules, resolve_offline_defaults
from paraseek.infer.load import load_tokenizer
from paraseek.infer.ranks import Placement


def build_engine(ns: argparse.Namespace, src, pl: Placement, log=print):
    """Load the weights (this rank's tp share), size the cache, capture graphs: the replica's Engine."""
    import torch

    from paraseek.infer import kv_fp8
    from paraseek.infer.engine import Engine
    from paraseek.infer.load import load_model
    from paraseek.infer.model import InferenceModel
    from paraseek.infer.platform import for_device

    if ns.max_num_seqs is None or ns.max_batched_tokens is None:  # an offline command's defaults, not yet resolved
        log(resolve_offline_defaults(ns, pl.device))
    platform = for_device(pl.device)
    dtype = {"auto": platform.dtype, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "float32": torch.float32}[ns.dtype]
    platform.check_dtype(dtype)
    kv_refusal = kv_fp8.refusal(ns.kv_cache_dtype, pl.device)
    if kv_refusal:  # before any weight is read (the engine checks again)
        raise UserError(kv_refusal)
    fp8, block, why = weight_format(getattr(ns, "quantization", "auto"), src, pl.device)
    t0 = time.perf_counter()
    check_speculative(ns, src)
    mtp = getattr(ns, "speculative", None) == "mtp"
    dp_attention = getattr(ns, "dp_attention", False)
    if src.kind == "hf":  # each rank reads its share of the safetensors, slice by slice
        model = InferenceModel.from_folder(src.path, src.args, pl.tp_group, dtype=dtype, device=pl.device,
                                           block=block, fp8=fp8, mtp=mtp, ep=getattr(ns, "ep", 1), tp=ns.tp,
                                           dp_attention=dp_attention)
    else:  # the whole training model, then laid out for inference with this rank's tp share (the rest is freed)
        model = InferenceModel.from_training(load_model(src, dtype=dtype, device=pl.device, seed=ns.seed),
                                             pl.tp_group, fp8=fp8, mtp=mtp, ep=getattr(ns, "ep", 1), tp=ns.tp,
                                             dp_attention=dp_attention)
    if pl.device.startswith("cuda"):
        torch.cuda.empty_cache()
    load_s = time.perf_counter() - t0
    log(f"weights: {model.weights}" + (f"; {why}" if why else ""))
    tokenizer = load_tokenizer(src)
    # dp-attention: every rank drives its own requests (nothing broadcast); its gloo group agrees on each step
    groups = dict(dp_group=pl.meta_group) if dp_attention else dict(tp_group=pl.tp_group, meta_group=pl.meta_group)
    engine = Engine(model, engine_config(ns), tokenizer=tokenizer, log=log, lora_modules=lora_modules(ns), **groups)
    engine.report.extra["load_s"] = load_s
    # `paraseek plan --mode infer`'s prediction of the KV pool, beside its measured size: given by paraseek/cli.py
    # (planner/infer.py: planned_kv_tokens), since infer/ does not import the planner
    plan_kv_tokens = getattr(ns, "plan_kv_tokens", None)
    if pl.device.startswith("cuda") and plan_kv_tokens is not None:
        engine.report.extra["planned_tokens"] = plan_kv_tokens(engine)
    return engine


def weight_format(quantization: str, src, device: str) -> tuple[bool, tuple[int, int] | None, str]:
    """(FP8 projections?, the checkpoint's FP8 block or None, why -- for the log line) under --quantization; a
    combination that cannot run is one line, before any weight is read."""
    from paraseek.infer.fp8 import BLOCK, has_fp8
    from paraseek.models.args import read_hf_config
    from paraseek.models.hf import fp8_block_size

    block = None
    if src.kind == "hf":
        block = fp8_block_size(read_hf_config(src.path), src.path / "config.json")
    fp8_device = has_fp8(device)
    if quantization == "fp8":
        if block is not None and block != (BLOCK, BLOCK):
            raise UserError(f"--quantization fp8: {src.path}'s FP8 weights have {list(block)} blocks and the FP8 "
                            f"GEMMs take [{BLOCK}, {BLOCK}]; leave out --quantization to serve them dequantized")
        return True, block, "--quantization fp8" + ("" if fp8_device else " on CPU (slow: for tests)")
    if block is None:
        return False, None, ""
    if quantization == "none":
        return False, block, "an FP8 checkpoint, dequantized (--quantization none)"
    if block != (BLOCK, BLOCK):
        return False, block, f"an FP8 checkpoint of {list(block)} blocks, dequantized (the FP8 GEMMs take 128x128)"
    if not fp8_device:
        where = "on CPU" if not str(device).startswith("cuda") else "(this GPU has no FP8 tensor cores: sm89+)"
        return False, block, f"an FP8 checkpoint, dequantized {where}; --quantization fp8 keeps FP8"
    return True, block, "an FP8 checkpoint, kept in FP8"


def check_speculative(ns: argparse.Namespace, src) -> None:
    """--speculative mtp needs the model's MTP layer: one line before any weight is read when it has none. A
    training checkpoint holds the modules its run trained (its trainer state says how many)."""
    if getattr(ns, "speculative", None) != "mtp":
        return
    from paraseek.infer.engine import no_mtp_module

    held = src.args.n_mtp_layers
    if src.kind == "hf":
        from paraseek.models.weights import held_mtp_modules

        held = held_mtp_modules(src.args, src.path)
    elif src.kind == "checkpoint":
        from paraseek.models.checkpoint_read import with_run_mtp_modules

        src.args = with_run_mtp_modules(src, src.path).args
        held = src.args.n_mtp_layers
    if not held:
        raise UserError(no_mtp_module(src.spec))


def check_lora_modules(ns: argparse.Namespace, args, flag: str) -> None:
    """Read every adapter given at start now, so that a bad folder costs one line before the model loads."""
    from paraseek.infer.lora import read_adapter

    cfg = engine_config(ns)
    if len(lora_modules(ns)) > cfg.max_loras:
        raise UserError(f"{flag}: {len(lora_modules(ns))} adapters but --max-loras {cfg.max_loras}: raise --max-loras")
    for name, path in lora_modules(ns).items():
        try:
            read_adapter(path, args, cfg.max_lora_rank)
        except UserError as e:
            raise UserError(f"{flag} {name}={path}: {e}") from None
