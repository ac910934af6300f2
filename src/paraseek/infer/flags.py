"""The engine and sampling flags `paraseek generate`, `paraseek serve` and `paraseek bench-infer` share, and what
they become: the EngineConfig, the LoRA adapters given at start, each request's default SamplingParams."""

from __future__ import annotations

import argparse
import json
from typing import Any

from paraseek.errors import UserError


def add_engine_arguments(p: argparse.ArgumentParser, max_batched_tokens: int | None = None,
                         max_batched_tokens_why: str = "", offline: bool = False) -> None:
    """MODEL and the engine's flags; `max_batched_tokens`: this command's own default for --max-batched-tokens;
    `offline`: --max-num-seqs and --max-batched-tokens default to infer.config.offline_defaults on the GPU found."""
    p.add_argument("model", help="an HF model folder (config.json + *.safetensors + tokenizer), a paraseek training "
                   "checkpoint folder (its newest complete step), or a preset name with --random-weights")
    g = p.add_argument_group("model and parallelism")
    g.add_argument("--random-weights", action="store_true",
                   help="random weights of the architecture (benchmarks; no checkpoint needed)")
    g.add_argument("--tokenizer", help="a tokenizer.json or a folder holding one (default: the model folder's, or the "
                   "one a checkpoint was trained with)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="weights and activations (default: bfloat16 on GPUs of sm80 and newer, float16 on older "
                   "ones, float32 on CPU)")
    g.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="default: cuda when available")
    g.add_argument("--quantization", default="auto", choices=["auto", "fp8", "none"],
                   help="the weights' format. auto (default): an FP8 checkpoint (DeepSeek-V3/R1's 128x128 blocks) "
                   "keeps its FP8 weights on GPUs with FP8 (compute capability 8.9+) and loads dequantized to "
                   "--dtype elsewhere; other checkpoints as stored. fp8: every decoder projection and expert in FP8 "
                   "128x128 blocks, a bf16 checkpoint (or --random-weights) quantized on load, activations "
                   "quantized per token in groups of 128 (GPUs with FP8; on CPU a slow plain-torch reference). "
                   "none: FP8 checkpoints dequantized to --dtype")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs per model replica (default 1)")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel GPUs per model replica: the routed experts "
                   "split by expert index, each GPU holding E/N of them whole (default 1). Alone: attention and "
                   "the shared experts replicated on each GPU; with --tp N (the same N): attention by heads, "
                   "the shared experts by width")
    g.add_argument("--dp-attention", action="store_true", help="with --ep N: each of the N GPUs runs attention, "
                   "the dense layers, the shared experts and sampling for its own requests, with its own KV cache "
                   "(N x the requests of replicated attention); the MoE layers gather every GPU's tokens, and the "
                   "GPUs step together. Pays where the replicated latent cache limits the batch (large batches of "
                   "DeepSeek-V3); attention at tp 1, so not with --tp (docs/inference.md)")
    g.add_argument("--dp", type=int, default=1, help="model replicas (data parallel), each on max(--tp, --ep) GPUs "
                   "(default 1)")
    g.add_argument("--seed", type=int, default=0, help="random weights' seed and the default sampling seed base")
    e = p.add_argument_group("engine")
    d = _engine_defaults()
    e.add_argument("--max-model-len", type=int, help="prompt + output tokens per sequence (default: the model's "
                   "max_position_embeddings, at most 32768)")
    e.add_argument("--block-size", type=int, default=d.block_size, help=f"tokens per KV block (default {d.block_size})")
    if offline:
        from paraseek.infer.config import OFFLINE_LARGE, OFFLINE_LARGE_GPU_GIB, OFFLINE_SMALL

        big = f"on GPUs of {OFFLINE_LARGE_GPU_GIB} GiB or more other than the A100"
        e.add_argument("--max-num-seqs", type=int, help=f"running sequences at most (default {OFFLINE_LARGE[0]:,} "
                       f"{big}, {OFFLINE_SMALL[0]} elsewhere: vLLM's offline defaults)")
        e.add_argument("--max-batched-tokens", type=int, help=f"tokens per step; bounds the prefill workspace "
                       f"(default {OFFLINE_LARGE[1]:,} {big}, {OFFLINE_SMALL[1]:,} elsewhere)")
    else:
        e.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                       help=f"running sequences at most (default {d.max_num_seqs})")
        step_tokens = max_batched_tokens or d.max_batched_tokens
        e.add_argument("--max-batched-tokens", type=int, default=step_tokens,
                       help=f"tokens per step; bounds the prefill workspace (default {step_tokens}"
                       f"{max_batched_tokens_why})")
    e.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help=f"share of GPU memory for weights, workspace and KV cache (default {d.gpu_memory_utilization})")
    e.add_argument("--num-kv-blocks", type=int, help="exact KV pool size in blocks (overrides the memory rule)")
    e.add_argument("--kv-cache-gib", type=float, default=d.kv_cache_gib,
                   help=f"CPU only: memory for the KV cache (default {d.kv_cache_gib})")
    e.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=["auto", "fp8"],
                   help="auto (default): the KV cache in the model's dtype; fp8: e4m3 with one fp32 scale per token "
                   "row, ~1.9-2x the tokens (GPUs of compute capability 8.9+, or CPU; docs/inference.md)")
    e.add_argument("--no-prefix-caching", action="store_true", help="do not share cached prompt blocks")
    e.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    sp = p.add_argument_group("speculative decoding (exact: greedy outputs are plain greedy's, sampled outputs keep "
                              "the model's distribution; docs/serve.md)")
    from paraseek.infer.config import SPEC_DEFAULT_TOKENS, SPEC_MAX_BATCH, SPEC_NGRAM_MAX, SPEC_NGRAM_MIN

    sp.add_argument("--speculative", choices=["mtp", "ngram"],
                    help="draft tokens and verify them in one forward: mtp, with the model's own multi-token-"
                    "prediction module (DeepSeek-V3's MTP layer, or one trained with paraseek train --mtp-layers 1; "
                    "steps run eagerly); ngram, by prompt lookup (the tokens that followed an earlier occurrence of "
                    "the sequence's last tokens; no extra model)")
    sp.add_argument("--num-speculative-tokens", type=int, metavar="K",
                    help=f"drafts per request and step (default {SPEC_DEFAULT_TOKENS['mtp']} with mtp: V3's module "
                    f"predicts one token ahead, and further drafts reuse it; {SPEC_DEFAULT_TOKENS['ngram']} with "
                    "ngram)")
    sp.add_argument("--ngram-min", type=int, metavar="N", help=f"ngram: the shortest suffix looked up (default "
                    f"{SPEC_NGRAM_MIN})")
    sp.add_argument("--ngram-max", type=int, metavar="N", help=f"ngram: the longest suffix looked up; the longest "
                    f"that occurred earlier proposes (default {SPEC_NGRAM_MAX})")
    sp.add_argument("--speculative-max-batch", type=int, metavar="N",
                    help=f"speculate while at most N requests run; above N, steps are plain decode steps (default "
                    f"{SPEC_MAX_BATCH}: on an H100 both drafters cost throughput at 32 concurrent requests; "
                    "docs/inference.md)")
    lo = p.add_argument_group("LoRA adapters (several at once, each request on its own; docs/serve.md)")
    lo.add_argument("--enable-lora", action="store_true",
                    help="allocate adapter slots (implied by the adapter and slot flags): adapters can be loaded "
                    "while serving")
    lo.add_argument("--max-loras", type=int, help=f"adapters loaded at once (default {DEFAULT_MAX_LORAS} when LoRA is "
                    "on); every slot is read by every decode step, used or not")
    lo.add_argument("--max-lora-rank", type=int,
                    help=f"the largest adapter rank the slots hold (default {_engine_defaults().max_lora_rank}); "
                    "larger adapters are refused")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("sampling (defaults: the model folder's generation_config.json, else greedy)")
    s.add_argument("--max-new-tokens", "--max-tokens", dest="max_tokens", type=int, default=128,
                   help="new tokens per prompt at most (default 128)")
    s.add_argument("--min-tokens", type=int, default=0, help="no stop token before this many new tokens")
    s.add_argument("--temperature", type=float, help="0 = greedy")
    s.add_argument("--top-p", type=float)
    s.add_argument("--top-k", type=int)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--sampling-seed", type=int, help="per-request seed (prompt i gets seed + i)")
    s.add_argument("--stop", action="append", default=[], help="a stop string (repeatable); not part of the output")
    s.add_argument("--stop-token-ids", type=_token_ids, default=[],
                   help="comma-separated token ids that end a sequence, besides the model's end token")
    s.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-new-tokens (benchmarks)")
    s.add_argument("--logprobs", type=int, help="also return the chosen token's and the N most likely log-probabilities")
    s.add_argument("--json-schema", metavar="FILE.json", help="constrain every output to this JSON schema "
                   "(grammar-constrained decoding with xgrammar; after a prompt that opens <think>, as R1's chat "
                   "template does, the JSON follows the reasoning)")


def _token_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids such as 2,32000, got {text!r}") from None


DEFAULT_MAX_LORAS = 8


def _engine_defaults():
    from paraseek.infer.config import EngineConfig

    return EngineConfig()


def resolve_offline_defaults(ns: argparse.Namespace, device: str) -> str:
    """Fill --max-num-seqs / --max-batched-tokens left unset with the offline defaults for this device; returns the
    line that says what the engine runs with."""
    from paraseek.infer.config import offline_defaults

    gib, name = None, ""
    if device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        gib, name = props.total_memory / 2**30, props.name
    seqs, tokens, why = offline_defaults(gib, name)
    chosen = []
    if ns.max_num_seqs is None:
        ns.max_num_seqs = seqs
        chosen.append("--max-num-seqs")
    if ns.max_batched_tokens is None:
        ns.max_batched_tokens = tokens
        chosen.append("--max-batched-tokens")
    line = f"engine: up to {ns.max_num_seqs:,} sequences, {ns.max_batched_tokens:,} tokens a step"
    return line + (f" ({why}; set {' and '.join(chosen)} to change)" if chosen else " (as given)")


def engine_config(ns: argparse.Namespace):
    from paraseek.infer.config import EngineConfig

    cfg = EngineConfig(block_size=ns.block_size, max_num_seqs=ns.max_num_seqs, max_batched_tokens=ns.max_batched_tokens,
                       max_model_len=ns.max_model_len, gpu_memory_utilization=ns.gpu_memory_utilization,
                       num_kv_blocks=ns.num_kv_blocks, kv_cache_gib=ns.kv_cache_gib, kv_cache_dtype=ns.kv_cache_dtype,
                       enable_prefix_caching=not ns.no_prefix_caching, enforce_eager=ns.enforce_eager, seed=ns.seed,
                       speculative=ns.speculative, num_speculative_tokens=ns.num_speculative_tokens,
                       ngram_min=ns.ngram_min, ngram_max=ns.ngram_max,
                       speculative_max_batch=ns.speculative_max_batch)
    if lora_enabled(ns):
        cfg.max_loras = ns.max_loras if ns.max_loras is not None else max(DEFAULT_MAX_LORAS, len(lora_modules(ns)))
        cfg.max_lora_rank = ns.max_lora_rank if ns.max_lora_rank is not None else cfg.max_lora_rank
        if cfg.max_loras < 1:
            raise UserError(f"--max-loras must be >= 1, got {cfg.max_loras}")
    cfg.validate()
    return cfg


def lora_modules(ns: argparse.Namespace) -> dict[str, str]:
    """The adapters to load at start: serve's --lora-modules, generate's --lora (parsed into ns.lora_modules)."""
    return getattr(ns, "lora_modules", None) or {}


def lora_enabled(ns: argparse.Namespace) -> bool:
    return bool(getattr(ns, "enable_lora", False) or lora_modules(ns) or getattr(ns, "max_loras", None) is not None
                or getattr(ns, "max_lora_rank", None) is not None)


def parse_lora_modules(items: list[str], flag: str) -> dict[str, str]:
    """NAME=PATH items (or vLLM's JSON form {"name": ..., "path": ...}) -> {name: path}; one line per mistake."""
    out: dict[str, str] = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                d = json.loads(item)
            except json.JSONDecodeError as e:
                raise UserError(f"{flag} {item!r}: not valid JSON ({e.msg})") from None
            name, path = (d.get("name"), d.get("path")) if isinstance(d, dict) else (None, None)
        else:
            name, _, path = item.partition("=")
        if not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path.strip():
            raise UserError(f"{flag} {item!r}: give NAME=PATH (an adapter name and its PEFT folder)")
        if name in out:
            raise UserError(f"{flag}: the adapter name {name!r} is given twice")
        out[name.strip()] = path.strip()
    return out


def generation_defaults(src) -> tuple[dict[str, Any], str]:
    """Sampling defaults from the model folder's generation_config.json (as HF generate and vLLM read it)."""
    folder = src.path if src.kind in ("hf", "random") and src.path is not None else None
    f = folder / "generation_config.json" if folder else None
    if f is None or not f.is_file():
        return {"temperature": 0.0}, "greedy (no generation_config.json)"
    try:
        gc = json.loads(f.read_text())
    except json.JSONDecodeError:
        raise UserError(f"{f}: not valid JSON") from None
    if not gc.get("do_sample", False):
        return {"temperature": 0.0}, f"greedy ({f.name}: do_sample false)"
    out = {k: gc[k] for k in ("temperature", "top_p", "top_k") if gc.get(k) is not None}
    return out, f"{', '.join(f'{k} {v}' for k, v in out.items())} (from {f.name})"


def sampling_params(ns: argparse.Namespace, defaults: dict[str, Any]):
    from paraseek.infer.sampling import SamplingParams

    pick = lambda name, fallback: getattr(ns, name) if getattr(ns, name) is not None else defaults.get(name, fallback)  # noqa: E731
    return SamplingParams(
        max_tokens=ns.max_tokens, min_tokens=ns.min_tokens, temperature=float(pick("temperature", 1.0)),
        top_p=float(pick("top_p", 1.0)), top_k=int(pick("top_k", 0)), min_p=ns.min_p,
        repetition_penalty=ns.repetition_penalty, frequency_penalty=ns.frequency_penalty,
        presence_penalty=ns.presence_penalty, seed=ns.sampling_seed, stop=list(ns.stop),
        stop_token_ids=list(ns.stop_token_ids), ignore_eos=ns.ignore_eos, logprobs=ns.logprobs).validate()
