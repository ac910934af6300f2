"""What serving LoRA adapters costs a decode step, on the GPU machine: the replay of one captured decode step (CUDA
graphs) of B sequences on the base model alone, on the same model with adapter slots but every request on the base,
and with the requests spread over A different adapters of rank R (infer/lora.py: every slot's A and B are read by
every step, so the cost is that of the slots, not of how many are in use).

    python scripts/gpu/bench_lora_decode.py [--model deepseek-r1-distill-llama-8b] [--batch 64] [--adapters 8]
                                            [--rank 16] [--context 512] [--reps 200] [--torch-lora]

Random bf16 weights of the model's shape (--random-weights) and random adapters on every projection the slots serve
(attention and dense MLPs). Prints one line starting with LORA (a JSON object: ms per replayed step of each variant,
their ratios to the base, and the roofline's ratio from the bytes a step reads: weights + slots over weights).
The adapters run through the LoRA kernels (infer/lora_kernels.py: two launches per projection) where the platform's
kernels are on; --torch-lora runs them through the plain-torch masked path instead (2 + pieces launches per
projection), everything else unchanged, for the comparison ("lora_path" in the line says which).
On CPU (no graphs) it runs the eager step instead, as a dry run of the plumbing with a tiny model.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import types

import numpy as np
import torch

from paraseek.cli import build_parser
from paraseek.infer import lora
from paraseek.infer.build import build_engine
from paraseek.infer.ranks import place
from paraseek.infer.load import resolve_source
from paraseek.infer.lora import Adapter
from paraseek.infer.sampling import SamplingParams


def random_adapter(engine, rank: int, seed: int) -> Adapter:
    """Rank-`rank` adapters of every module the engine's slots serve (our names), B scaled small (values do not
    change the timing; finite ones keep the outputs meaningful)."""
    from paraseek.models.lora_spec import LoRASpec, adapted, model_targets

    args = engine.args
    g = torch.Generator().manual_seed(seed)
    targets = tuple(t for t in model_targets(args) if t not in ("experts", "shared_experts"))
    served = engine.loras.slots.targets()
    out = Adapter(f"random-{seed}", rank)
    for w in adapted(args, LoRASpec(rank, rank, targets)):
        if w.name in served:
            out.weights[w.name] = (torch.randn(rank, w.in_features, generator=g) / w.in_features ** 0.5,
                                   torch.randn(w.out_features, rank, generator=g) * 0.01)
    return out


def decode_batch(engine, batch: int, context: int, loras: list[str | None]):
    """Run `batch` requests of `context` prompt tokens until every one decodes; the last decode-only step's inputs."""
    seen = []
    run = engine.runner.run

    def spy(hb, *rest):  # the runner's other argument (decode rows' input sources) passed through
        seen.append(hb)
        return run(hb, *rest)

    engine.runner.run = spy
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
    for i in range(batch):
        engine.add_request(f"r{i}", [(7 * i + j) % 1000 + 1 for j in range(context)], params, lora=loras[i])
    while engine.has_work():
        engine.step()
    engine.runner.run = run
    hb = next(h for h in reversed(seen) if h.n_decode == len(h.ids) == batch)
    hb.ids = np.where(hb.ids < 0, 0, hb.ids)  # tokens the overlapped steps patched in on the device: any valid id
    return hb


def time_step(engine, hb, reps: int) -> float:
    cuda = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(10):
        engine.runner.run(hb)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        engine.runner.run(hb)
    sync()
    return 1e3 * (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="deepseek-r1-distill-llama-8b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--torch-lora", action="store_true", help="adapters through the plain-torch masked path")
    a = ap.parse_args()
    if a.torch_lora:  # only LoRALinear sees the kernels off; the base model keeps them
        lora.ops = types.SimpleNamespace(kernels_on=lambda: False)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    max_len = a.context + 128
    blocks = a.batch * (-(-max_len // 16)) + 8
    flags = [a.model, "--random-weights", "--max-num-seqs", str(a.batch), "--max-model-len", str(max_len),
             "--num-kv-blocks", str(blocks)]
    out = {"model": a.model, "batch": a.batch, "adapters": a.adapters, "rank": a.rank, "context": a.context,
           "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}

    def engine_with(*extra):
        ns = build_parser().parse_args(["bench-infer", *flags, *extra])
        return build_engine(ns, resolve_source(ns.model, random_weights=True, tokenizer=None), place(ns, dev),
                            log=lambda *x, **k: None)

    engine = engine_with()
    hb = decode_batch(engine, a.batch, a.context, [None] * a.batch)
    out["graph"] = engine.runner.graph_key(hb)
    out["base_ms"] = time_step(engine, hb, a.reps)
    weights = sum(engine.runner.model.decode_bytes()[k] for k in ("dense", "routed"))
    del engine, hb
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()

    engine = engine_with("--max-loras", str(a.adapters), "--max-lora-rank", str(a.rank))
    out["lora_path"] = "kernels" if lora.ops.kernels_on() else "torch"
    t0 = time.perf_counter()
    for i in range(a.adapters):
        engine.load_lora(f"a{i}", f"random-{i}", random_adapter(engine, a.rank, i))
    if dev == "cuda":
        torch.cuda.synchronize()
    out["load_s_per_adapter"] = (time.perf_counter() - t0) / a.adapters
    hb = decode_batch(engine, a.batch, a.context, [None] * a.batch)
    out["slots_idle_ms"] = time_step(engine, hb, a.reps)
    names = [f"a{i % a.adapters}" for i in range(a.batch)]  # every adapter, batch / adapters sequences each
    hb = decode_batch(engine, a.batch, a.context, names)
    assert hb.lora is not None and len(set(hb.lora.tolist())) == a.adapters
    out["graph_lora"] = engine.runner.graph_key(hb)
    out["lora_ms"] = time_step(engine, hb, a.reps)
    slot_bytes = engine.loras.slots.nbytes()
    out["ratio_lora"] = out["lora_ms"] / out["base_ms"]
    out["ratio_slots_idle"] = out["slots_idle_ms"] / out["base_ms"]
    out["slot_gib"] = slot_bytes / 2**30
    out["roofline_ratio"] = (weights + slot_bytes) / weights  # decode reads every weight and every slot once
    print("LORA " + json.dumps(out), flush=True)
    print(f"decode step of {a.batch} sequences ({a.model}, {out['device']}): base {out['base_ms']:.3f} ms, "
          f"{a.adapters} rank-{a.rank} adapters {out['lora_ms']:.3f} ms ({out['ratio_lora']:.3f}x), slots with "
          f"base requests only {out['slots_idle_ms']:.3f} ms ({out['ratio_slots_idle']:.3f}x); bytes roofline "
          f"{out['roofline_ratio']:.3f}x", flush=True)


if __name__ == "__main__":
    main()
