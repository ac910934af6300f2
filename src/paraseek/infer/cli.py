"""`paraseek generate`: offline batch generation through the engine; the engine and sampling flags it shares with
`paraseek serve` and `paraseek bench-infer`; the set-up of one process per GPU (tp x dp) those commands use."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from paraseek.errors import UserError

_WORKER_ENV = "PARASEEK_INFER_WORKER"


# ---- flags ----------------------------------------------------------------------------------------------------------
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


# ---- one process per GPU --------------------------------------------------------------------------------------------
@dataclass
class Placement:
    """Where this process sits: its replica and tp rank, the device, the groups (None when alone)."""

    rank: int = 0
    world: int = 1
    replica: int = 0
    tp_rank: int = 0
    device: str = "cpu"
    tp_group: Any = None
    meta_group: Any = None  # gloo, for the driver's step broadcast and small host-side collectives
    world_gloo: Any = None

    @property
    def driver(self) -> bool:
        return self.tp_rank == 0


def device_for(ns: argparse.Namespace) -> str:
    import torch

    if ns.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible")
    return "cuda" if ns.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"


def replica_gpus(ns: argparse.Namespace) -> int:
    """GPUs (processes) of one model replica: --tp's or --ep's, the same ones when both are given."""
    from paraseek.infer.ep import model_ranks

    return model_ranks(ns.tp, getattr(ns, "ep", 1))


def check_parallel(ns: argparse.Namespace, args, device: str) -> None:
    from paraseek.infer.ep import check_ep
    from paraseek.infer.tp import check_tp

    if getattr(ns, "quantization", "auto") == "fp8" and device == "cuda":
        import torch

        from paraseek.infer.fp8 import has_fp8

        if not has_fp8(device):
            major, minor = torch.cuda.get_device_capability()
            raise UserError(f"--quantization fp8: {torch.cuda.get_device_name()} (sm{major}{minor}) has no FP8 "
                            "tensor cores (they start at compute capability 8.9: L40S, H100, H200); leave out "
                            "--quantization to serve in --dtype")
    if ns.dp < 1:
        raise UserError(f"--dp must be >= 1, got {ns.dp}")
    ep = getattr(ns, "ep", 1)
    check_ep(args, ns.tp, ep)
    check_tp(args, ns.tp, ep)
    if getattr(ns, "dp_attention", False):
        if ep < 2:
            raise UserError("--dp-attention needs --ep N with N > 1: it spreads the requests over the expert-parallel "
                            "GPUs, each running attention for its own")
        if ns.tp > 1:
            raise UserError(f"--dp-attention with --tp {ns.tp}: attention runs at tp 1 under --dp-attention (each GPU "
                            "its own requests); leave out --tp")
        if getattr(ns, "speculative", None):
            raise UserError("--dp-attention with --speculative is not supported: leave one of them out")
    if ep > 1 and lora_enabled(ns):
        raise UserError(f"--ep {ep} with LoRA adapters: adapters are served with --tp only; leave out --ep")
    if device == "cuda":
        import torch

        n = torch.cuda.device_count()
        if replica_gpus(ns) * ns.dp > n:
            what = f"--ep {ep}" if ep > ns.tp else f"--tp {ns.tp}"
            raise UserError(f"{what} x --dp {ns.dp} = {replica_gpus(ns) * ns.dp} GPUs, but {n} "
                            f"{'is' if n == 1 else 'are'} visible")


def relaunch(nproc: int, argv: list[str]) -> int:
    """Run this very command again as `nproc` processes under torch.distributed.run (one per GPU), in this process
    so that a failed worker comes back as an exit code and one line."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name == "torch.distributed.run":
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ[_WORKER_ENV] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    try:
        run(get_args_parser().parse_args([f"--nproc-per-node={nproc}", "--standalone", "-m", "paraseek", *argv]))
        return 0
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        if 2 in codes:
            return 2
        rank, failure = e.get_first_failure()
        how = f"signal {-failure.exitcode}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        print(f"paraseek: rank {rank} failed first ({how}); all ranks were stopped", file=sys.stderr)
        return 1


def spawn(nproc: int, argv: list[str]) -> int:
    """For a server: this command again as `nproc` local processes (rank i on GPU i), without torchrun's agent, so
    that SIGTERM/SIGINT reach rank 0 alone -- it drains, then tells the others to stop. Returns rank 0's exit code;
    a rank that dies first stops all of them with one line."""
    import signal
    import socket
    import subprocess
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), **{_WORKER_ENV: "1"})
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    procs = [subprocess.Popen([sys.executable, "-m", "paraseek", *argv],
                              env=dict(base, RANK=str(i), LOCAL_RANK=str(i))) for i in range(nproc)]

    def forward(sig, frame) -> None:
        if procs[0].poll() is None:
            procs[0].send_signal(sig)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
            if codes[0] is not None or failed is not None:
                break
            time.sleep(0.2)
        deadline = time.time() + 30
        for p in procs:  # the others end by themselves once rank 0 has told them; the stragglers are stopped
            while p.poll() is None and time.time() < deadline and failed is None:
                time.sleep(0.1)
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        if failed is not None and failed != 0:
            code = procs[failed].returncode
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            print(f"paraseek: rank {failed} failed first ({how}); all ranks were stopped", file=sys.stderr)
            return 2 if code == 2 else 1
        return procs[0].returncode
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def place(ns: argparse.Namespace, device: str) -> Placement:
    """Join the process group when launched as one of several processes; a replica's tp/ep ranks are consecutive."""
    if os.environ.get(_WORKER_ENV) != "1" or "RANK" not in os.environ:
        return Placement(device=device)
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if device == "cuda":
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        device = f"cuda:{local}"
    else:
        dist.init_process_group("gloo")
    tp = replica_gpus(ns)  # the replica's ranks: its group carries tp's and ep's collectives alike
    pl = Placement(rank, world, rank // tp, rank % tp, device)
    pl.world_gloo = dist.new_group(backend="gloo") if device != "cpu" else dist.group.WORLD
    for r in range(world // tp):  # every rank creates every group, in the same order
        ranks = list(range(r * tp, (r + 1) * tp))
        g = dist.new_group(ranks)
        mg = dist.new_group(ranks, backend="gloo") if device != "cpu" else g
        if r == pl.replica:
            pl.tp_group, pl.meta_group = (g, mg) if tp > 1 else (None, None)
    return pl


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
    if pl.device.startswith("cuda") and plan_kv_tokens is not None and not dp_attention:  # it prices tp layouts
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


def load_tokenizer(src):
    if src.tokenizer is None:
        return None
    from paraseek.models.tokenizer import load_text_tokenizer

    return load_text_tokenizer(src.tokenizer, src.chat_template)


# ---- generate -------------------------------------------------------------------------------------------------------
@dataclass
class Prompt:
    index: int
    id: str
    text: str | None  # as given (None for token-id prompts)
    token_ids: list[int]
    overrides: dict[str, Any]
    where: str  # "prompt 2" (the second --prompt) or "FILE.jsonl:7" (its line), for messages
    lora: str | None = None  # the LoRA adapter it runs on (--lora); None: the base model


def read_prompts(ns: argparse.Namespace, tokenizer, vocab_size: int) -> list[Prompt]:
    rows: list[tuple[str, dict[str, Any]]] = [(f"prompt {i + 1}", {"prompt": t}) for i, t in enumerate(ns.prompt or [])]
    if ns.prompts:
        from paraseek.errors import read_jsonl_objects

        rows += [(f"{ns.prompts}:{n}", row)
                 for n, row in read_jsonl_objects(ns.prompts, "prompt, prompt_token_ids or messages")]
    if not rows:
        raise UserError("nothing to generate: give --prompt TEXT (repeatable) or --prompts FILE.jsonl")
    from paraseek.infer.sampling import SamplingParams

    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    out = []
    for i, (where, row) in enumerate(rows):
        overrides = {k: v for k, v in row.items() if k in fields}
        if "max_new_tokens" in row:
            overrides["max_tokens"] = row["max_new_tokens"]
        unknown = set(row) - fields - {"prompt", "prompt_token_ids", "messages", "id", "max_new_tokens", "lora"}
        if unknown:
            raise UserError(f"{where}: unknown field {sorted(unknown)[0]!r} (prompt, prompt_token_ids, messages, id, "
                            f"lora, or a sampling field such as max_tokens, temperature)")
        lora = row.get("lora", getattr(ns, "lora_default", None))
        if lora is not None and lora not in lora_modules(ns):
            given = ", ".join(lora_modules(ns)) or "none"
            raise UserError(f"{where}: lora {lora!r} is not an adapter given with --lora NAME=PATH (given: {given})")
        if "prompt_token_ids" in row:
            ids = row["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise UserError(f"{where}: prompt_token_ids must be a list of integers")
            text = None
        else:
            if tokenizer is None:
                raise UserError(f"{where}: text prompts need a tokenizer and this model has none; give --tokenizer, "
                                f"or prompt_token_ids rows")
            if "messages" in row or ns.chat:
                messages = row.get("messages") or [{"role": "user", "content": row.get("prompt", "")}]
                try:
                    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
                    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                except UserError as e:
                    raise UserError(f"{where}: {e}") from None
            else:
                text = row.get("prompt")
                if not isinstance(text, str):
                    raise UserError(f"{where}: prompt must be a string")
                ids = tokenizer.encode(text)
        if not ids:
            raise UserError(f"{where}: the prompt is empty (no token to start from)")
        if bad := [t for t in ids if not 0 <= t < vocab_size]:
            raise UserError(f"{where}: token id {bad[0]} is not in the model's vocabulary (0 to {vocab_size - 1})")
        out.append(Prompt(i, str(row.get("id", i)), text, ids, overrides, where, lora))
    return out


def _generate_loras(ns: argparse.Namespace) -> None:
    """--lora NAME=PATH (repeatable) -> ns.lora_modules; a bare --lora PATH (named after its folder) is also the
    adapter of every prompt that names none (ns.lora_default)."""
    from pathlib import Path

    items, ns.lora_default = [], None
    for item in ns.lora or []:
        if "=" not in item:
            if ns.lora_default is not None:
                raise UserError(f"--lora {item}: only one adapter can be every prompt's (a bare PATH); name the "
                                "others (--lora NAME=PATH) and pick them with a prompt row's lora field")
            ns.lora_default = Path(item).name or item
            item = f"{ns.lora_default}={item}"
        items.append(item)
    ns.lora_modules = parse_lora_modules(items, "--lora")


def _json_schema(path: str, tokenizer) -> dict:
    """--json-schema FILE: a JSON schema object, compiled once here so that a bad one is one line."""
    from paraseek.infer import structured

    structured.require()
    if tokenizer is None:
        raise UserError("--json-schema needs the model's tokenizer; this model has none")
    try:
        schema = json.loads(open(path, encoding="utf-8").read())
    except OSError as e:
        raise UserError(f"--json-schema {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"--json-schema {path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(schema, (dict, bool)):
        raise UserError(f"--json-schema {path}: a JSON schema is an object")
    structured.Backend(tokenizer, tokenizer.vocab_size, []).compile({"type": "json_schema", "schema": schema})
    return schema


def cmd_generate(ns: argparse.Namespace) -> int:
    from paraseek.infer.load import resolve_source

    src = resolve_source(ns.model, random_weights=ns.random_weights, tokenizer=ns.tokenizer)
    device = device_for(ns)
    check_parallel(ns, src.args, device)
    batch_line = resolve_offline_defaults(ns, device)
    _generate_loras(ns)
    check_lora_modules(ns, src.args, "--lora")
    tokenizer = load_tokenizer(src)
    cfg = engine_config(ns)
    check_speculative(ns, src)
    defaults, why = generation_defaults(src)
    base = sampling_params(ns, defaults)
    given = [f"{k.replace('_', ' ')} {getattr(ns, k)}" for k in ("temperature", "top_p", "top_k") if getattr(ns, k) is not None]
    if given:  # the flags win over the folder's defaults: say what runs
        why = ("greedy" if base.greedy else ", ".join(given)) + " (flags)"
    prompts = read_prompts(ns, tokenizer, src.args.vocab_size)
    if ns.json_schema and ns.speculative:  # every prompt constrained: none would draft
        raise UserError("--speculative with --json-schema: a grammar-constrained output does not draft (its mask "
                        "follows each token it accepts); leave one of them out")
    schema = _json_schema(ns.json_schema, tokenizer) if ns.json_schema else None
    params = []
    max_len = cfg.context_length(src.args)
    for p in prompts:
        try:
            sp = dataclasses.replace(base, **p.overrides).validate()
        except (TypeError, UserError) as e:  # a row's own sampling field
            raise UserError(f"{p.where}: {e}") from None
        if ns.sampling_seed is not None and "seed" not in p.overrides:
            sp.seed = ns.sampling_seed + p.index
        if schema is not None:
            if sp.ignore_eos or sp.min_tokens:
                raise UserError(f"{p.where}: --json-schema ends each output where the JSON ends: leave out "
                                f"--ignore-eos and --min-tokens")
            sp.structured = {"type": "json_schema", "schema": schema,
                             "reasoning": bool(p.text and p.text.rstrip().endswith("<think>"))}
        if len(p.token_ids) + sp.max_tokens > max_len:
            raise UserError(f"{p.where} has {len(p.token_ids)} tokens; with {sp.max_tokens} new tokens that "
                            f"exceeds the context of {max_len} (--max-model-len, --max-new-tokens)")
        params.append(sp)
    world = replica_gpus(ns) * ns.dp
    if world > 1 and os.environ.get(_WORKER_ENV) != "1":
        return relaunch(world, sys.argv[1:] if ns.argv is None else ns.argv)
    pl = place(ns, device)
    say = print if pl.rank == 0 else (lambda *a, **k: None)
    say(f"generate: {src.spec} ({src.kind}), tokenizer: {src.tokenizer_why}; sampling: {why}; "
        f"{len(prompts)} prompt{'s' if len(prompts) != 1 else ''}, tp {ns.tp}{f' ep {ns.ep}' if ns.ep > 1 else ''}"
        f"{' dp-attention' if ns.dp_attention else ''} x dp {ns.dp} on {device}\n{batch_line}",
        file=sys.stderr, flush=True)
    engine = build_engine(ns, src, pl, log=lambda *a, **k: say(*a, file=sys.stderr, **k))
    if pl.rank == 0:
        print(engine.report.line(), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    if pl.driver or ns.dp_attention:  # dp-attention: every rank drives its own share of the prompts
        drivers, me = (pl.world, pl.rank) if ns.dp_attention else (ns.dp, pl.replica)
        mine = [p for p in prompts if p.index % drivers == me]
        reqs = engine.generate([p.token_ids for p in mine], [params[p.index] for p in mine],
                               progress=pl.rank == 0 and not ns.quiet, ids=[p.id + f"#{p.index}" for p in mine],
                               loras=[p.lora for p in mine])
        engine.shutdown()
        results = [_result(p, r, tokenizer, engine.drafter is not None) for p, r in zip(mine, reqs)]
    else:
        from paraseek.infer.engine import serve_worker

        serve_worker(engine.runner, pl.meta_group)
        results = []
    wall = time.perf_counter() - t0
    if pl.world > 1:
        import torch.distributed as dist

        gathered: list | None = [None] * pl.world if pl.rank == 0 else None
        dist.gather_object(results, gathered, dst=0, group=pl.world_gloo)
        if pl.rank != 0:
            return _exit(0, pl)
        results = sorted((x for part in gathered if part for x in part), key=lambda x: x["index"])
    n_out = sum(r["completion_tokens"] for r in results)
    for r in results:
        if ns.json:
            print(json.dumps(r, ensure_ascii=False), flush=True)
        else:
            head = r["prompt"] if r["prompt"] is not None else f"<{r['prompt_tokens']} token ids>"
            print(f"--- {r['id']}: {head!r}\n{r['text'] if r['text'] is not None else r['token_ids']}\n", flush=True)
    print(f"generate: {len(results)} prompts, {n_out:,} new tokens in {wall:.2f} s ({n_out / wall:,.1f} tokens/s"
          f"{', replica 0' if ns.dp > 1 else ''}); preemptions {engine.scheduler.num_preemptions}", file=sys.stderr)
    if engine.drafter is not None:
        print(f"generate: {spec_line(engine.drafter.stats.summary())}{' (replica 0)' if ns.dp > 1 else ''}",
              file=sys.stderr)
    return _exit(0, pl)


def spec_line(s: dict) -> str:
    """The accepted drafts of speculative decoding in one line (infer/spec.SpecStats.summary)."""
    plain = (f"; {s['plain_steps']:,} plain steps (more requests ran than --speculative-max-batch)"
             if s.get("plain_steps") else "")
    if not s["draft_tokens"]:
        return "speculative decoding: no drafts proposed" + plain
    per = ", ".join(f"{a:.0%}" if a is not None else "-" for a in s["accepted_per_position"])
    return (f"speculative decoding: {s['accepted_tokens']:,} of {s['draft_tokens']:,} drafts accepted "
            f"({s['accept_rate']:.1%}; by position {per}), {s['mean_accepted_length']:.2f} tokens per "
            f"verification step" + plain)


def _result(p: Prompt, r, tokenizer, speculative: bool = False) -> dict[str, Any]:
    if r.stream is not None:
        text = r.stream.text
    else:
        # Without stop strings "stop" is an end token, which has no text of its own (the engine's TextStream and the
        # server leave it out too); token_ids keep it.
        ids = r.output_ids[:-1] if r.finish_reason == "stop" else r.output_ids
        text = tokenizer.decode(ids, skip_special_tokens=r.params.skip_special_tokens) if tokenizer else None
    out = {"index": p.index, "id": p.id, "lora": p.lora, "prompt": p.text, "text": text, "token_ids": r.output_ids,
           "finish_reason": r.finish_reason, "prompt_tokens": r.num_prompt, "completion_tokens": r.num_output,
           "cached_prompt_tokens": r.num_cached_tokens, "preemptions": r.num_preemptions,
           "time_to_first_token_s": (r.first_token_time - r.arrival) if r.first_token_time else None,
           "latency_s": (r.finish_time - r.arrival) if r.finish_time else None}
    if speculative:
        out["draft_tokens"], out["accepted_draft_tokens"] = r.num_draft_tokens, r.num_accepted_tokens
    if r.params.logprobs is not None:
        out["logprobs"] = r.logprobs
        out["top_logprobs"] = [[[t, lp] for t, lp in row] for row in r.top_logprobs]
    return out


def _exit(rc: int, pl: Placement) -> int:
    if pl.world > 1:
        import torch.distributed as dist

        dist.barrier(group=pl.world_gloo)
        dist.destroy_process_group()
    return rc


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="offline batch generation through the inference engine (paged KV cache, continuous batching)",
        description="Generate for every prompt with the engine `paraseek serve` runs: paged KV cache sized from free "
        "memory, continuous batching with chunked prefill, prefix caching, CUDA graphs for decode steps, tensor "
        "parallel (--tp) and replicas (--dp). Prints each prompt's text, or with --json one JSON object per prompt "
        "(text, token_ids, finish_reason, token counts, timing).")
    add_engine_arguments(p, offline=True)
    add_sampling_arguments(p)
    src = p.add_argument_group("prompts")
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    src.add_argument("--prompts", metavar="FILE.jsonl", help="one object per line: prompt (text), prompt_token_ids, or "
                     "messages (a chat), plus optional id, lora (an adapter's name) and sampling fields (max_tokens, "
                     "temperature, ...)")
    src.add_argument("--chat", action="store_true", help="render --prompt texts as user messages with the model's "
                     "chat template")
    src.add_argument("--lora", action="append", metavar="NAME=PATH", help="a LoRA adapter (a PEFT folder, as `paraseek "
                     "export --export-adapter` writes) that --prompts rows run on with \"lora\": NAME (repeatable; "
                     "the others run on the base model); a bare PATH: the adapter of every prompt that names none")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_generate, argv=None)
