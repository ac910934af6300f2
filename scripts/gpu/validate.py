"""Training measurements on the GPU machine, one command per group, results as one table and one JSON file.

    python scripts/gpu/validate.py GROUP[,GROUP...] --out DIR [--anchors DIR]

Groups (each runs in under 10 minutes on 2x H200; BENCHMARKS.md cites the command of each table):
  loss  real-shaped models (DeepSeek-LLM-7B and DeepSeek-V2-Lite widths, 4 layers) from one saved bf16
        initialization, 20 steps on the bundled corpus: 1 GPU vs FSDP2, tp=2, pp=2 (dense) and ep=2, pp=2 (MoE);
        the max relative loss difference to the 1-GPU curve, tokens/s/GPU and peak memory of each.
  plan  `paraseek bench` of >= 8 (model, plan) runs on 1 and 2 GPUs: 7B FSDP with and without checkpointing at
        two micro-batch sizes, V2-Lite (14 layers) FSDP and EP=2, 7B tp=2 and pp=2; the planner's prediction
        beside each measurement, with the errors.
  llama the HF + FSDP2 baseline of --anchors (llama3-8b shape) and paraseek on deepseek-r1-distill-llama-8b.
  scale 7B weak scaling 1 -> 2 GPUs (same per-GPU batch), and the 16k / 32k sequence runs on 2 GPUs.
  v2lite the HF + FSDP2 baseline on the V2-Lite shape (14 layers) at micro-batch 2 and 4, paraseek's best plan at
        each.
  final llama-8b and 7B best plans against the baseline in the same run.
  weak  7B weak scaling 1 -> 2 GPUs with parameters kept gathered (same flags on both).
  llama_zero2  the llama-8b no-AC + compile run with parameters kept gathered from forward to backward.
  push  llama-8b at micro-batch 3 and 4, 7B weak scaling with parameters kept gathered, 7B selective mbs1 again.
  holdout  four plans outside the fit of the planner's host-overhead constants (out-of-sample check).
  holdout2  five eager plans outside every fit of the planner (predictions committed first: predict_holdout2.py).
  loss_chunks  llama-8b's best plan with and without --loss-chunks 8, and micro-batch 3 with it.
  attn  MLA attention through each SDPA kernel (flash with v padded, cuDNN, memory-efficient), and the host syncs left in a V2-Lite
        forward+backward, by source line.
  v2lite_push  V2-Lite compiled without checkpointing: params kept gathered, EP=2, mbs 2 and 4, one profiled step.
  profile one profiled step of V2-Lite (14 layers) FSDP and of 7B tp=2: top kernels, CPU ops, host syncs.
  fp8tests  tests/gpu/test_fp8_gpu.py.
  fp8smoke  the 7B width cut to 4 layers (seq 4096, mbs 2, selective + compile) in bf16 and under --fp8 tensorwise
        and rowwise.
  fp8peer  TorchTitan (--anchors' torchtitan_peer.sh ds7b, compiled) in float8 tensorwise and rowwise, then
        DeepSeek-LLM-7B with its best bf16 flags, and with --fp8 tensorwise and rowwise added.
  fp8llama  the Llama-3.1-8B shape cut to 16 layers (to fit one GPU), the same flags, bf16 and both recipes.
  fp8parity  500 steps (seq 2048) of the 7B width cut to 4 layers from one seeded bf16 initialization on the bundled corpus,
        bf16 vs each recipe: the curves (JSONL under --out) and the gap of the last 50 steps' mean loss
        (PARITY_RECIPES=off,tensorwise for fewer; bf16 first).
  tp2compile  the 7B width cut to 4 layers on all GPUs: FSDP2 vs tp=N, eager, compiled and compiled with --fp8
        tensorwise.
  moehost  a compiled MoE run the planner missed out of sample (V2-Lite cut to 12 layers, mbs 1, compiled, no AC: 0.30-0.36 s
        measured, 0.23 predicted, as with selective AC): none with a cold and then a warm compile cache, selective,
        none with Python's GC off; per-step times, graph breaks and recompiles, and what the host was in while the
        GPU idled (one profiled step each).
  coldwarm  the fifth out-of-sample set's missed run (V2-Lite cut to 8 layers, mbs 1, compiled, no AC) three times:
        a fresh compile cache, the same cache again, and a fresh cache compiled in-process (no compile workers).
  gccause, hostsample, mallocvar  the fresh-compile slowdown of compiled MoE runs: the same V2-Lite runs with the
        garbage collector's time per step and gc.freeze on and off; with every Python thread of the training process
        sampled; under glibc malloc tunables. They ran before the launcher set GLIBC_TUNABLES: put
        GLIBC_TUNABLES= (empty, glibc's defaults) in a variant's env to see the slowdown again.
  fp8moe  DeepSeek-V2-Lite cut to 6 layers (compile, mbs 2 and 4, or FP8MOE_MBS=8,16; no AC, or FP8MOE_AC):
        bf16, --fp8 tensorwise (the projections fp8_pays takes; experts bf16), and with --fp8-experts on. The
        planner's --fp8-experts term is fitted on its runs (docs/planner.md, FP8).
  fp8moeparity  fp8parity on the V2-Lite width cut to 4 layers, every fp8 run with --fp8-experts on (PARITY_EXPERTS=off:
                the routed experts in bf16).
  mtp   multi-token prediction on one GPU: the 7B width cut to 4 layers and V2-Lite cut to 4 layers (configs only,
        seq 4096, global batch 4, synthetic data, eager), each trained 10 steps with the flags of `paraseek plan
        --gpus 1 --gpu-type H200 --compile false --mtp-layers 1`'s first plan, with and without --mtp-layers 1; the
        plan's prediction for both (its "mtp" entry is the same plan priced without the modules) beside each, step
        time and peak allocated memory with the errors (~4 minutes on one H200).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
MODELS = Path(os.environ.get("VALIDATE_MODELS", "/tmp/validate-models"))  # big folders stay out of --out
# src first, then whatever the caller put on the path (wheels installed with --target: torchao, the serve extra)
ENV = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1",
           PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
CORPUS = str(ROOT / "src" / "paraseek" / "assets" / "corpus")
N = torch.cuda.device_count()


@contextlib.contextmanager
def extra_env(env: dict[str, str]):
    """ENV with `env` added for the runs inside the block (a compile cache of their own, a sitecustomize)."""
    saved = dict(ENV)
    ENV.update(env)
    try:
        yield
    finally:
        ENV.clear()
        ENV.update(saved)


def sh(argv: list[str], timeout: int) -> tuple[int, str]:
    t0 = time.time()
    try:
        r = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        rc, text = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    print(f"  [{time.time() - t0:.0f} s, rc {rc}] {' '.join(argv[3:])[:160]}", flush=True)
    if rc:
        print("\n".join(text.splitlines()[-8:]), flush=True)
    return rc, text


def folder(name: str, preset: str, layers: int, weights: bool) -> str:
    """An HF folder of `preset` cut to `layers` layers: config only (random init per run) or with one seeded bf16
    initialization that every plan loads."""
    from paraseek.models import build_model, save_pretrained
    from paraseek.models.args import ModelArgs, preset_config

    path = MODELS / name
    if (path / "config.json").exists():
        return str(path)
    cfg = {**preset_config(preset), "num_hidden_layers": layers}
    if not weights:
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps(cfg, indent=1))
        return str(path)
    torch.manual_seed(1234)
    model = build_model(ModelArgs.from_hf_config(cfg), "cuda", torch.bfloat16)
    save_pretrained(model, path)
    del model
    torch.cuda.empty_cache()
    return str(path)


def train_run(out: Path, name: str, nproc: int, argv: list[str], timeout: int = 240) -> dict:
    jsonl = out / f"{name}.jsonl"
    jsonl.unlink(missing_ok=True)
    rc, text = sh([sys.executable, "-m", "paraseek", "train", "--device", "cuda", "--nproc", str(nproc),
                   "--metrics-jsonl", str(jsonl), "--log-every", "5", *argv], timeout)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    steps = [r for r in rows if "event" not in r]
    tail = steps[2:] or steps
    tps = sorted(r["tokens_per_s_per_gpu"] for r in tail)
    return {"name": name, "rc": rc, "gpus": nproc, "losses": [r["loss"] for r in steps],
            "tokens_per_s_per_gpu": tps[len(tps) // 2] if tps else None,
            "mem_peak_gib": max((r["mem_peak_gib"] for r in steps), default=None)}


def bench_run(name: str, nproc: int, argv: list[str], timeout: int = 300) -> dict:
    rc, text = sh([sys.executable, "-m", "paraseek", "bench", "--json", "--device", "cuda", "--nproc", str(nproc),
                   "--warmup", "3", "--steps", "5", *argv], timeout)
    m = re.search(r'^\{\s*"runs".*', text, re.S | re.M)
    rows = json.loads(text[m.start():text.rindex("}") + 1])["runs"] if rc == 0 and m else []
    r = {"name": name, "rc": rc, **(rows[-1] if rows else {}), "runs": rows}
    print(f"    {name}: {r.get('tokens_per_s_per_gpu')} tokens/s/GPU, MFU {r.get('mfu')}, {r.get('mem_peak_gib')} GiB",
          flush=True)
    return r


def baseline(anchors: str, argv: list[str], timeout: int = 300) -> dict:
    rc, text = sh(["torchrun", "--standalone", f"--nproc_per_node={N}", f"{anchors}/hf_fsdp2_baseline.py", *argv],
                  timeout)
    line = next((ln for ln in text.splitlines() if ln.startswith("RESULT")), "")
    fields = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
    return {"name": "baseline " + " ".join(argv), "rc": rc, "result": line, **fields}


def group_loss(out: Path) -> list[dict]:
    dense = folder("dense4", "deepseek-llm-7b", 4, weights=True)
    moe = folder("moe4", "deepseek-v2-lite", 4, weights=True)
    common = ["--data", CORPUS, "--seq-len", "2048", "--global-batch-size", "8", "--micro-batch-size", "1",
              "--steps", "20", "--lr", "3e-4", "--warmup-steps", "2", "--lr-schedule", "constant"]
    runs = []
    for model, plans in ((dense, [("1gpu", 1, []), ("fsdp2", 2, []), ("tp2", 2, ["--tp", "2"]),
                                  ("pp2", 2, ["--pp", "2", "--pp-schedule", "1F1B"])]),
                         (moe, [("1gpu", 1, []), ("ep2", 2, ["--ep", "2"]),
                                ("pp2", 2, ["--pp", "2", "--pp-schedule", "Interleaved1F1B"])])):
        ref = None
        for name, n, plan in plans:
            r = train_run(out, f"{Path(model).name}-{name}", n, ["--init-from", model, *common, *plan])
            ref = ref or r["losses"]
            if r["losses"] and ref:
                r["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
            runs.append(r)
    return runs


def group_plan(out: Path) -> list[dict]:
    v2 = folder("v2lite14", "deepseek-v2-lite", 14, weights=False)
    seq = ["--seq-len", "4096"]
    specs = [
        ("7b fsdp full-AC mbs2", 2, ["--model", "deepseek-llm-7b", "--global-batch-size", "4", "--micro-batch-size", "2",
                                     "--activation-checkpointing", "full"]),
        ("7b fsdp selective mbs2", 2, ["--model", "deepseek-llm-7b", "--global-batch-size", "4", "--micro-batch-size",
                                       "2", "--activation-checkpointing", "selective"]),
        ("7b fsdp selective mbs1", 2, ["--model", "deepseek-llm-7b", "--global-batch-size", "2", "--micro-batch-size",
                                       "1", "--activation-checkpointing", "selective"]),
        ("7b fsdp no-AC mbs1", 2, ["--model", "deepseek-llm-7b", "--global-batch-size", "2", "--micro-batch-size", "1"]),
        ("7b 1gpu selective mbs2", 1, ["--model", "deepseek-llm-7b", "--global-batch-size", "2", "--micro-batch-size",
                                       "2", "--activation-checkpointing", "selective"]),
        ("v2lite14 fsdp selective mbs2", 2, ["--model", v2, "--global-batch-size", "4", "--micro-batch-size", "2",
                                             "--activation-checkpointing", "selective"]),
        ("v2lite14 ep2 selective mbs2", 2, ["--model", v2, "--global-batch-size", "4", "--micro-batch-size", "2",
                                            "--activation-checkpointing", "selective", "--ep", "2"]),
        ("7b tp2 selective mbs2", 2, ["--model", "deepseek-llm-7b", "--global-batch-size", "2", "--micro-batch-size",
                                      "2", "--activation-checkpointing", "selective", "--tp", "2"]),
        ("7b pp2 1F1B selective mbs1", 2, ["--model", "deepseek-llm-7b", "--global-batch-size", "4",
                                           "--micro-batch-size", "1", "--activation-checkpointing", "selective",
                                           "--pp", "2"]),
    ]
    return [bench_run(name, n, [*seq, *argv]) for name, n, argv in specs]


def group_llama(out: Path, anchors: str) -> list[dict]:
    llama = ["--model", "deepseek-r1-distill-llama-8b", "--seq-len", "4096", "--global-batch-size", str(2 * N),
             "--micro-batch-size", "2", "--compile"]
    return [baseline(anchors, ["--model", "llama3-8b", "--seq", "4096", "--mbs", "2", "--ac", "1"]),
            bench_run("llama-8b selective+compile mbs2", N, [*llama, "--activation-checkpointing", "selective"]),
            bench_run("llama-8b no-AC+compile mbs2", N, [*llama, "--activation-checkpointing", "none"])]


def group_llama_zero2(out: Path) -> list[dict]:
    llama = ["--model", "deepseek-r1-distill-llama-8b", "--seq-len", "4096", "--global-batch-size", str(2 * N),
             "--micro-batch-size", "2", "--compile", "--reshard-after-forward", "false"]
    return [bench_run("llama-8b no-AC+compile mbs2 zero2", N, [*llama, "--activation-checkpointing", "none"])]


def group_push(out: Path) -> list[dict]:
    """Larger micro-batches with parameters kept gathered (llama), ZeRO-2-style weak scaling (7B), and a repeat of
    the 7B selective mbs1 plan run."""
    zero2 = ["--compile", "--reshard-after-forward", "false", "--seq-len", "4096"]
    llama = ["--model", "deepseek-r1-distill-llama-8b", *zero2]
    return [
        bench_run("llama-8b no-AC+compile mbs3 zero2", N, [*llama, "--micro-batch-size", "3", "--global-batch-size",
                                                           str(3 * N), "--activation-checkpointing", "none"]),
        bench_run("llama-8b selective+compile mbs4 zero2", N, [*llama, "--micro-batch-size", "4",
                                                               "--global-batch-size", str(4 * N),
                                                               "--activation-checkpointing", "selective"]),
        bench_run("7b weak scaling 1,2 selective+compile mbs2 zero2", N,
                  ["--model", "deepseek-llm-7b", *zero2, "--micro-batch-size", "2", "--global-batch-size", "2",
                   "--activation-checkpointing", "selective", "--scaling", f"1,{N}"], timeout=420),
        bench_run("7b fsdp selective mbs1 (repeat)", 2, ["--model", "deepseek-llm-7b", "--seq-len", "4096",
                                                         "--global-batch-size", "2", "--micro-batch-size", "1",
                                                         "--activation-checkpointing", "selective"]),
    ]


def group_holdout(out: Path) -> list[dict]:
    """Plans the planner's host-overhead constants were not fitted on (the fit used the `plan` group)."""
    v2 = folder("v2lite14", "deepseek-v2-lite", 14, weights=False)
    seq = ["--seq-len", "4096"]
    return [
        bench_run("v2lite14 fsdp no-AC mbs1", 2, [*seq, "--model", v2, "--global-batch-size", "2",
                                                  "--micro-batch-size", "1"]),
        bench_run("v2lite14 ep2 full-AC mbs2", 2, [*seq, "--model", v2, "--global-batch-size", "4",
                                                   "--micro-batch-size", "2", "--activation-checkpointing", "full",
                                                   "--ep", "2"]),
        bench_run("7b tp2 full-AC mbs1", 2, [*seq, "--model", "deepseek-llm-7b", "--global-batch-size", "2",
                                             "--micro-batch-size", "1", "--activation-checkpointing", "full",
                                             "--tp", "2"]),
        bench_run("7b pp2 Interleaved1F1B selective mbs2", 2, [*seq, "--model", "deepseek-llm-7b",
                                                               "--global-batch-size", "4", "--micro-batch-size", "2",
                                                               "--activation-checkpointing", "selective", "--pp", "2",
                                                               "--pp-schedule", "Interleaved1F1B"]),
    ]


# Plans outside every fit of the planner's constants (models, sequence lengths and micro-batches not in `plan`/`holdout`),
# eager. Their predictions are printed by predict_holdout2.py and committed before the group runs.
HOLDOUT2 = [
    ("llama-8b fsdp full-AC mbs2", 2, dict(model="deepseek-r1-distill-llama-8b", seq=4096, gbs=4, mbs=2, ac="full")),
    ("qwen-7b fsdp selective mbs1", 2, dict(model="deepseek-r1-distill-qwen-7b", seq=4096, gbs=2, mbs=1,
                                            ac="selective")),
    ("7b seq8192 fsdp selective mbs1", 2, dict(model="deepseek-llm-7b", seq=8192, gbs=2, mbs=1, ac="selective")),
    ("qwen-1.5b fsdp no-AC mbs4", 2, dict(model="deepseek-r1-distill-qwen-1.5b", seq=4096, gbs=8, mbs=4, ac="none")),
    ("v2lite14 fsdp full-AC mbs4", 2, dict(model="deepseek-v2-lite", layers=14, seq=4096, gbs=8, mbs=4, ac="full")),
]


def group_holdout2(out: Path) -> list[dict]:
    runs = []
    for name, n, s in HOLDOUT2:
        model = folder(f"v2lite{s['layers']}", s["model"], s["layers"], weights=False) if s.get("layers") else s["model"]
        runs.append(bench_run(name, n, ["--model", model, "--seq-len", str(s["seq"]), "--global-batch-size",
                                        str(s["gbs"]), "--micro-batch-size", str(s["mbs"]),
                                        "--activation-checkpointing", s["ac"]]))
    return runs


def group_loss_chunks(out: Path) -> list[dict]:
    """The chunked head loss (--loss-chunks) on the llama-8b shape: the best plan of 2026-11-30 with and without it,
    and the micro-batch it may make room for."""
    llama = ["--model", "deepseek-r1-distill-llama-8b", "--seq-len", "4096", "--compile", "--reshard-after-forward",
             "false", "--activation-checkpointing", "none"]
    return [bench_run(f"llama-8b no-AC+compile zero2 mbs{mbs}{' loss-chunks 8' if chunks else ''}", N,
                      [*llama, "--micro-batch-size", str(mbs), "--global-batch-size", str(mbs * N),
                       "--loss-chunks", str(chunks)])
            for mbs, chunks in ((2, 0), (2, 8), (3, 8))]


def group_scale(out: Path) -> list[dict]:
    seven = ["--model", "deepseek-llm-7b", "--micro-batch-size", "2", "--activation-checkpointing", "selective",
             "--compile"]
    runs = [bench_run("7b weak scaling 1,2 selective+compile mbs2", N,
                      [*seven, "--seq-len", "4096", "--global-batch-size", "2", "--scaling", f"1,{N}"], timeout=420)]
    for seq in (16384, 32768):
        runs.append(bench_run(f"7b seq {seq} full-AC mbs1", N, ["--model", "deepseek-llm-7b", "--seq-len", str(seq),
                                                                "--global-batch-size", str(N), "--micro-batch-size",
                                                                "1", "--activation-checkpointing", "full"]))
    return runs


def group_v2lite(out: Path, anchors: str) -> list[dict]:
    """The HF + FSDP2 baseline on the V2-Lite shape (14 layers) at micro-batch 2 (its published setting) and 4, and
    paraseek's best plan at each: no checkpointing, compiled, parameters kept gathered."""
    v2 = folder("v2lite14", "deepseek-v2-lite", 14, weights=False)
    runs = []
    for mbs in (2, 4):
        runs.append(baseline(anchors, ["--model", "deepseek-v2-lite", "--layers", "14", "--seq", "4096", "--mbs",
                                       str(mbs), "--ac", "1"]))
        runs.append(bench_run(f"v2lite14 no-AC+compile mbs{mbs} zero2", N,
                              ["--model", v2, "--seq-len", "4096", "--micro-batch-size", str(mbs),
                               "--global-batch-size", str(mbs * N), "--activation-checkpointing", "none",
                               "--compile", "--reshard-after-forward", "false"]))
    return runs


def group_weak(out: Path) -> list[dict]:
    """7B weak scaling 1 -> N GPUs, same flags and per-GPU batch (--reshard-after-forward false is a no-op on 1 GPU)."""
    return [bench_run(f"7b weak scaling 1,{N} selective+compile mbs2 zero2", N,
                      ["--model", "deepseek-llm-7b", "--seq-len", "4096", "--micro-batch-size", "2",
                       "--global-batch-size", "2", "--activation-checkpointing", "selective", "--compile",
                       "--reshard-after-forward", "false", "--scaling", f"1,{N}"], timeout=420)]


def group_final(out: Path, anchors: str) -> list[dict]:
    """The two dense shapes against the HF + FSDP2 baseline in the same run: llama-8b (no AC, compiled, params
    kept gathered) and the 7B (selective AC, compiled, params kept gathered), micro-batch 2 like the baseline."""
    runs = []
    for base_model, model, ac in (("llama3-8b", "deepseek-r1-distill-llama-8b", "none"),
                                  ("deepseek-7b", "deepseek-llm-7b", "selective")):
        runs.append(baseline(anchors, ["--model", base_model, "--seq", "4096", "--mbs", "2", "--ac", "1"]))
        runs.append(bench_run(f"{model} {ac}-AC+compile mbs2 zero2", N,
                              ["--model", model, "--seq-len", "4096", "--micro-batch-size", "2", "--global-batch-size",
                               str(2 * N), "--activation-checkpointing", ac, "--compile", "--reshard-after-forward",
                               "false"]))
    return runs


def group_attn(out: Path) -> list[dict]:
    """MLA's attention (V2-Lite: 16 heads, q/k 192, v 128, 2 x 4096 tokens) forward+backward through each SDPA kernel
    (flash needs v zero-padded to 192; FLOPs counted unpadded), and the host syncs left in one forward+backward of a 2-layer V2-Lite model (where each one comes from)."""
    import traceback
    import warnings

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from paraseek.models import build_model
    from paraseek.models.args import ModelArgs, preset_config
    from paraseek.parallel.parallelize import apply_activation_checkpointing
    from paraseek.parallel.expert import enable_balance_loss

    B, H, T, K, V = 2, 16, 4096, 192, 128
    q, k = (torch.randn(B, H, T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(B, H, T, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(B, H, T, V, device="cuda", dtype=torch.bfloat16)
    flops = 3 * 2 * B * H * T * T * (K + V) / 2  # causal half, fwd + 2x bwd (the planner's count)
    variants = {"padded v, flash": ([SDPBackend.FLASH_ATTENTION], True),
                "unpadded, SDPA's default choice": (None, False),
                "unpadded, cuDNN": ([SDPBackend.CUDNN_ATTENTION], False),
                "unpadded, memory-efficient": ([SDPBackend.EFFICIENT_ATTENTION], False)}
    runs = []
    for name, (backends, padded) in variants.items():
        def step():
            with sdpa_kernel(backends) if backends else torch.enable_grad():
                vv = F.pad(v, (0, K - V)) if padded else v
                o = F.scaled_dot_product_attention(q, k, vv, is_causal=True, scale=K**-0.5)[..., :V]
                torch.autograd.grad(o, (q, k, v), do)
        try:
            times = []
            for i in range(25):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                step()
                b.record()
                torch.cuda.synchronize()
                if i >= 5:
                    times.append(a.elapsed_time(b))
            ms = sorted(times)[len(times) // 2]
            runs.append({"name": f"mla attention {name}", "ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)})
        except RuntimeError as e:
            runs.append({"name": f"mla attention {name}", "error": str(e).splitlines()[0][:160]})
        print(runs[-1], flush=True)

    cfg = {**preset_config("deepseek-v2-lite"), "num_hidden_layers": 2}
    model = build_model(ModelArgs.from_hf_config(cfg), "cuda", torch.bfloat16)
    enable_balance_loss(model)
    apply_activation_checkpointing(model, "selective")
    ids = torch.randint(0, cfg["vocab_size"], (2, 4096), device="cuda")
    F.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten()).backward()  # warm-up
    sites: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "paraseek" in f.filename or "torch" in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-3:])
        sites[where] = sites.get(where, 0) + 1

    torch.cuda.synchronize()
    old = warnings.showwarning
    warnings.showwarning = record
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        F.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten()).backward()
        torch.cuda.set_sync_debug_mode("default")
    warnings.showwarning = old
    runs.append({"name": "host syncs in one fwd+bwd of 2-layer V2-Lite (selective AC, balance loss)",
                 "count": sum(sites.values()), "sites": sites})
    print(json.dumps(runs[-1], indent=1), flush=True)
    return runs


def group_v2lite_push(out: Path) -> list[dict]:
    """V2-Lite (14 layers) compiled without checkpointing: parameters kept gathered, EP=2, and one profiled step of
    the mbs-4 plan (where the time goes once the host is no longer the bottleneck)."""
    v2 = folder("v2lite14", "deepseek-v2-lite", 14, weights=False)
    common = ["--model", v2, "--seq-len", "4096", "--activation-checkpointing", "none", "--compile"]

    def mbs(n: int) -> list[str]:
        return ["--micro-batch-size", str(n), "--global-batch-size", str(n * N)]

    runs = [bench_run("v2lite14 no-AC+compile mbs2 zero2", N, [*common, *mbs(2), "--reshard-after-forward", "false"]),
            bench_run("v2lite14 no-AC+compile mbs4 zero2", N, [*common, *mbs(4), "--reshard-after-forward", "false"]),
            bench_run("v2lite14 ep2 no-AC+compile mbs2", N, [*common, *mbs(2), "--ep", str(N)]),
            bench_run("v2lite14 ep2 no-AC+compile mbs4", N, [*common, *mbs(4), "--ep", str(N)])]
    run_dir = out / "profile-v2lite"
    r = train_run(out, "profile-v2lite", N, [*common, *mbs(4), "--data", "synthetic", "--steps", "5",
                                             "--profile-steps", "4:4", "--run-dir", str(run_dir)])
    trace = run_dir / "profile" / "rank0.json"
    r["name"] = "profile v2lite14 no-AC+compile mbs4"
    if trace.exists():
        r["digest"] = trace_digest(trace, top=25)
        print(json.dumps(r["digest"], indent=1), flush=True)
        trace.unlink()
    return [*runs, r]


def trace_digest(path: Path, top: int = 12) -> dict:
    """Where a profiled step's time went on rank 0: GPU kernels and CPU operators by total time, and the time the
    host spent blocked in synchronizing CUDA calls (each one drains the launch queue)."""
    events = [e for e in json.loads(path.read_text()).get("traceEvents", []) if e.get("ph") == "X"]

    def total(cat: str) -> list:
        acc: dict[str, float] = {}
        for e in events:
            if e.get("cat") == cat:
                acc[e["name"][:90]] = acc.get(e["name"][:90], 0.0) + e.get("dur", 0) / 1e3
        return sorted(acc.items(), key=lambda kv: -kv[1])[:top]

    syncs = [e for e in events if e.get("cat") == "cuda_runtime"
             and any(k in e["name"] for k in ("Synchronize", "cudaMemcpy"))]
    return {"kernels_ms": total("kernel"), "cpu_ops_ms": total("cpu_op"),
            "host_sync_ms": sum(e.get("dur", 0) for e in syncs) / 1e3, "host_sync_calls": len(syncs)}


def group_profile(out: Path) -> list[dict]:
    v2 = folder("v2lite14", "deepseek-v2-lite", 14, weights=False)
    runs = []
    for name, n, argv in (("v2lite14 fsdp selective mbs2", N, ["--model", v2, "--micro-batch-size", "2",
                                                              "--global-batch-size", str(2 * N),
                                                              "--activation-checkpointing", "selective"]),
                          ("7b tp2 selective mbs2", N, ["--model", "deepseek-llm-7b", "--micro-batch-size", "2",
                                                        "--global-batch-size", "2", "--tp", str(N),
                                                        "--activation-checkpointing", "selective"])):
        run_dir = out / f"profile-{len(runs)}"
        r = train_run(out, f"profile-{len(runs)}", n, [*argv, "--seq-len", "4096", "--data", "synthetic", "--steps",
                                                       "5", "--profile-steps", "4:4", "--run-dir", str(run_dir)])
        trace = run_dir / "profile" / "rank0.json"
        r["name"] = name
        if trace.exists():
            r["digest"] = trace_digest(trace)
            print(json.dumps(r["digest"], indent=1), flush=True)
            trace.unlink()  # hundreds of MB: the digest and the summary stay
        runs.append(r)
    return runs


SEVEN_BEST = ["--seq-len", "4096", "--micro-batch-size", "2", "--global-batch-size", str(2 * N),
              "--activation-checkpointing", "selective", "--compile"]  # the 7B's best flags on one H200


def torchtitan(anchors: str, name: str, flavor: str, *flags: str, timeout: int = 300) -> dict:
    """One TorchTitan peer run: its step-30 line (tps = tokens/s/GPU, MFU against 989 TFLOP/s)."""
    rc, text = sh(["bash", f"{anchors}/torchtitan_peer.sh", flavor, "--compile.enable", *flags], timeout)
    steps = [ln for ln in text.splitlines() if re.search(r"step: *\d+ ", ln)]
    last = steps[-1] if steps else ""
    num = lambda pat: (lambda m: float(m.group(1).replace(",", "")) if m else None)(re.search(pat, last))
    r = {"name": f"torchtitan {name}", "rc": rc, "tokens_per_s_per_gpu": num(r"tps: *([\d,]+)"),
         "mfu": num(r"mfu: *([\d.]+)%"), "loss": num(r"loss: *([\d.]+)"),
         "mem_peak_gib": num(r"memory: *([\d.]+)GiB"), "lines": steps}
    print(f"    {last[-200:]}", flush=True)
    return r


def group_fp8tests(out: Path) -> list[dict]:
    rc, text = sh([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu/test_fp8_gpu.py"], 420)
    (out / "fp8-tests.txt").write_text(text)
    return [{"name": "fp8 gpu tests", "rc": rc, "result": text.strip().splitlines()[-1] if text.strip() else ""}]


def group_fp8smoke(out: Path) -> list[dict]:
    runs = []
    cut = folder("ds7b4", "deepseek-llm-7b", 4, weights=False)
    for recipe in ("off", "tensorwise", "rowwise"):
        runs.append(bench_run(f"7b-4l fp8 {recipe}", N, ["--model", cut, *SEVEN_BEST, "--fp8", recipe]))
    return runs


def group_fp8peer(out: Path, anchors: str) -> list[dict]:
    fp8 = ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name"]
    runs = [torchtitan(anchors, "ds7b float8 tensorwise", "ds7b", *fp8, "tensorwise"),
            torchtitan(anchors, "ds7b float8 rowwise", "ds7b", *fp8, "rowwise")]
    for recipe in ("off", "tensorwise", "rowwise"):
        runs.append(bench_run(f"deepseek-llm-7b best bf16 flags, fp8 {recipe}", N,
                              ["--model", "deepseek-llm-7b", *SEVEN_BEST, "--fp8", recipe]))
    return runs


def group_fp8llama(out: Path) -> list[dict]:
    llama = folder("llama8b16", "deepseek-r1-distill-llama-8b", 16, weights=False)
    return [bench_run(f"llama-8b 16 layers selective+compile, fp8 {recipe}", N,
                      ["--model", llama, *SEVEN_BEST, "--fp8", recipe]) for recipe in ("off", "tensorwise", "rowwise")]


def group_tp2compile(out: Path) -> list[dict]:
    """fp8 with tp on 2 GPUs: the 7B width cut to 4 layers, FSDP2 over both vs tp=2, each eager, compiled,
    and compiled with --fp8 tensorwise (FSDP2's float8 all-gather; under tp bf16 gathers and float8 linears sharded
    by the TP styles), selective checkpointing, micro-batch 2, seq 4096: tokens/s/GPU side by side."""
    cut = folder("ds7b4", "deepseek-llm-7b", 4, weights=False)
    runs = []
    for tag, flags in (("eager", []), ("compiled", ["--compile"]),
                       ("compiled fp8 tensorwise", ["--compile", "--fp8", "tensorwise"])):
        common = ["--model", cut, "--seq-len", "4096", "--micro-batch-size", "2", "--activation-checkpointing",
                  "selective", *flags]
        runs.append(bench_run(f"7b-4l fsdp2 x{N} {tag}", N, [*common, "--global-batch-size", str(2 * N)]))
        runs.append(bench_run(f"7b-4l tp{N} {tag}", N, [*common, "--global-batch-size", "2", "--tp", str(N)]))
    return runs


def fp8parity_run(out: Path, recipe: str, name: str = "", moe: bool = False) -> dict:
    """One 500-step parity run (the 7B width cut to 4 layers, or with `moe` the V2-Lite width cut to 4 layers and
    --fp8-experts on, or PARITY_EXPERTS=off for the routed experts in bf16; seq 2048, from one seeded bf16
    initialization on the bundled corpus) and the mean loss of its last 50 steps."""
    init = (folder("v2lite4-init", "deepseek-v2-lite", 4, weights=True) if moe
            else folder("ds7b4-init", "deepseek-llm-7b", 4, weights=True))
    common = ["--init-from", init, "--data", CORPUS, "--seq-len", "2048", "--global-batch-size", "2",
              "--micro-batch-size", "2", "--steps", "500", "--lr", "3e-4", "--warmup-steps", "20",
              "--activation-checkpointing", "selective", "--compile", "--seed", "0"]
    experts = ["--fp8-experts", os.environ.get("PARITY_EXPERTS", "on")] if moe and recipe != "off" else []
    r = train_run(out, name or f"fp8parity-{'moe-' if moe else ''}{recipe}", 1,
                  [*common, "--fp8", recipe, *experts], timeout=300)
    tail = r["losses"][-50:]
    r["tail_loss"] = sum(tail) / len(tail) if tail else None
    r.pop("losses")
    return r


def group_fp8parity(out: Path, moe: bool = False) -> list[dict]:
    runs = [fp8parity_run(out, recipe, moe=moe)
            for recipe in os.environ.get("PARITY_RECIPES", "off,tensorwise,rowwise,rowwise-gw-hp").split(",")]
    ref = runs[0]["tail_loss"]
    for r in runs[1:]:
        if ref and r["tail_loss"]:
            r["max_rel_loss_diff"] = (r["tail_loss"] - ref) / ref
    return runs


def v2lite_mbs1(out: Path, name: str, layers: int, env: dict[str, str], steps: int, ac: str = "none",
                extra: tuple[str, ...] = (), timeout: int = 150) -> tuple[int, str, list[dict], float | None]:
    """`paraseek train` of V2-Lite cut to `layers`, seq 4096, micro-batch 1, compiled, synthetic data, with `env`
    added: exit code, output, the JSONL's step rows and the median step time from step 3 on."""
    model = folder(f"v2lite{layers}", "deepseek-v2-lite", layers, weights=False)
    jsonl = out / f"{name}.jsonl"
    with extra_env(env):
        rc, text = sh([sys.executable, "-m", "paraseek", "train", "--device", "cuda", "--nproc", "1", "--model", model,
                       "--seq-len", "4096", "--micro-batch-size", "1", "--global-batch-size", "1", "--compile",
                       "--activation-checkpointing", ac, "--data", "synthetic", "--steps", str(steps),
                       "--metrics-jsonl", str(jsonl), *extra], timeout)
    rows = [json.loads(ln) for ln in jsonl.read_text().splitlines()] if jsonl.exists() else []
    rows = [r for r in rows if "step_time_s" in r]
    times = sorted(r["step_time_s"] for r in rows[2:])
    return rc, text, rows, round(times[len(times) // 2], 3) if times else None


def group_moehost(out: Path) -> list[dict]:
    nogc = MODELS / "nogc"  # a sitecustomize that turns Python's garbage collector off in every process
    nogc.mkdir(parents=True, exist_ok=True)
    (nogc / "sitecustomize.py").write_text("import gc\ngc.disable()\n")
    cache = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/moehost-cache-a", "TORCH_LOGS": "graph_breaks,recompiles"}
    runs = []
    for name, ac, env in (("none cold cache", "none", cache), ("none warm cache", "none", cache),
                          ("selective", "selective", cache),
                          ("none gc off", "none", {**cache, "PYTHONPATH": f"{nogc}{os.pathsep}{ENV['PYTHONPATH']}"})):
        run_dir = out / f"moehost-{len(runs)}"
        rc, text, rows, _ = v2lite_mbs1(out, f"moehost-{len(runs)}", 12, env, 10, ac,
                                        ("--profile-steps", "9:9", "--run-dir", str(run_dir)), timeout=200)
        times = [round(r["step_time_s"], 3) for r in rows]
        step = sorted(times[2:8])[len(times[2:8]) // 2] if len(times) > 3 else None  # before the profiled step
        prof = [ln for ln in text.splitlines() if ln.startswith(("profile rank", "  top", "  while"))]
        (run_dir / "profile" / "rank0.json").unlink(missing_ok=True)  # hundreds of MB; the summary stays
        r = {"name": f"v2lite12 mbs1 {name}", "rc": rc, "step_times_s": times, "step_time_s": step, "profile": prof,
             "graph_breaks": text.count("Graph break"), "recompiles": text.count("Recompiling")}
        print(f"    {r['name']}: {times} graph breaks {r['graph_breaks']}, recompiles {r['recompiles']}", *prof,
              sep="\n", flush=True)
        runs.append(r)
    return runs


def group_coldwarm(out: Path) -> list[dict]:
    v2 = folder("v2lite8", "deepseek-v2-lite", 8, weights=False)
    argv = ["--model", v2, "--seq-len", "4096", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--activation-checkpointing", "none", "--compile"]
    runs = []
    for name, env in (("cold cache", {"TORCHINDUCTOR_CACHE_DIR": "/tmp/coldwarm-a"}),
                      ("warm cache", {"TORCHINDUCTOR_CACHE_DIR": "/tmp/coldwarm-a"}),
                      ("cold cache, compiled in-process", {"TORCHINDUCTOR_CACHE_DIR": "/tmp/coldwarm-b",
                                                           "TORCHINDUCTOR_COMPILE_THREADS": "1"})):
        with extra_env(env):
            runs.append(bench_run(f"v2lite8 mbs1 none+compile, {name}", 1, argv, timeout=110))
        print(f"      step {runs[-1].get('step_time_s')} s", flush=True)
    return runs


def group_gccause(out: Path) -> list[dict]:
    """Compiled MoE runs slow from a fresh compile: is it Python's garbage collector walking what the compile left
    on the heap? V2-Lite-8 (and -12) at mbs 1 without AC, 10 steps each, per-step GC seconds from the metrics: the
    engine's gc.freeze after step 1, the same with freeze made a no-op, the collector off, and a warm cache."""
    hooks = MODELS / "gchooks"
    for name, code in (("nofreeze", "import gc\ngc.freeze = lambda: None\n"), ("gcoff", "import gc\ngc.disable()\n")):
        (hooks / name).mkdir(parents=True, exist_ok=True)
        (hooks / name / "sitecustomize.py").write_text(code)
    path = lambda name: {"PYTHONPATH": f"{hooks / name}{os.pathsep}{ENV['PYTHONPATH']}"}
    runs = []
    for name, layers, env in (("cold cache, freeze", 8, {"TORCHINDUCTOR_CACHE_DIR": "/tmp/gc-a"}),
                              ("cold cache, no freeze", 8, {"TORCHINDUCTOR_CACHE_DIR": "/tmp/gc-b", **path("nofreeze")}),
                              ("cold cache, gc off", 8, {"TORCHINDUCTOR_CACHE_DIR": "/tmp/gc-c", **path("gcoff")}),
                              ("warm cache, no freeze", 8, {"TORCHINDUCTOR_CACHE_DIR": "/tmp/gc-a", **path("nofreeze")}),
                              ("cold cache, freeze", 12, {"TORCHINDUCTOR_CACHE_DIR": "/tmp/gc-d"}),
                              ("cold cache, no freeze", 12, {"TORCHINDUCTOR_CACHE_DIR": "/tmp/gc-e", **path("nofreeze")})):
        rc, text, rows, step = v2lite_mbs1(out, f"gccause-{len(runs)}", layers, env, 10)
        times = [round(r["step_time_s"], 3) for r in rows]
        gc_ms = [round(r.get("gc_s", 0) * 1e3, 1) for r in rows]
        r = {"name": f"v2lite{layers} mbs1 none {name}", "rc": rc, "step_times_s": times, "gc_ms": gc_ms,
             "step_time_s": step}
        if rc:
            r["tail"] = text[-1500:]
        print(f"    {r['name']}: rc {rc} step {r['step_time_s']} s {times}, gc ms {gc_ms}", flush=True)
        runs.append(r)
    return runs


SAMPLER = """
import collections, os, sys, threading, time
def _sample():
    jsonl, report = os.environ["SAMPLE_JSONL"], os.environ["SAMPLE_REPORT"]
    lines = lambda: sum(1 for _ in open(jsonl)) if os.path.exists(jsonl) else 0
    while lines() < 4:  # from step 4 on: compile and warm-up are over
        time.sleep(0.2)
    if "paraseek.train.loop" not in sys.modules:  # a compile worker, the launcher: not the training process
        return
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    where, inner, n = collections.Counter(), collections.Counter(), 0
    t_end = time.time() + 2.0
    while time.time() < t_end:  # every Python thread's innermost frames (the autograd engine's too), every 5 ms
        for tid, frame in sys._current_frames().items():
            if tid == me:
                continue
            stack = []
            while frame is not None and len(stack) < 4:
                stack.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}:{frame.f_code.co_name}")
                frame = frame.f_back
            who = names.get(tid, f"thread {tid}")
            where[who + ": " + " < ".join(stack)] += 1
            inner[who + ": " + stack[0].split(":", 1)[0] + ":" + stack[0].rsplit(":", 1)[1]] += 1
        n += 1
        time.sleep(0.005)
    with open(report, "w") as f:
        f.write(f"{n} samples; threads: {sorted(set(names.values()))}\\n")
        for fn, c in inner.most_common(20):
            f.write(f"{c / n:6.1%} {fn}\\n")
        for stack, c in where.most_common(30):
            f.write(f"{c / n:6.1%} {stack}\\n")
threading.Thread(target=_sample, daemon=True, name="paraseek-sampler").start()
"""


def sampled_run(out: Path, name: str, layers: int, env: dict[str, str]) -> dict:
    """V2-Lite cut to `layers` at mbs 1 without AC, 16 compiled steps, with every Python thread of the training
    process sampled every 5 ms for 2 s from step 4 on (SAMPLER, a sitecustomize thread)."""
    hook = MODELS / "sampler"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(SAMPLER)
    report = out / f"{name}.txt"
    rc, _, rows, step = v2lite_mbs1(out, name, layers, {**env, "PYTHONPATH": f"{hook}{os.pathsep}{ENV['PYTHONPATH']}",
                                                         "SAMPLE_JSONL": str(out / f"{name}.jsonl"),
                                                         "SAMPLE_REPORT": str(report)}, 16)
    return {"name": f"v2lite{layers} mbs1 none {name} {env}", "rc": rc,
            "step_times_s": [round(r["step_time_s"], 3) for r in rows], "step_time_s": step,
            "samples": report.read_text() if report.exists() else ""}


def group_hostsample(out: Path) -> list[dict]:
    """The fresh-compile slowdown of compiled MoE runs, where the host is: V2-Lite cut to SAMPLE_LAYERS (8), cold cache, warm
    cache, cold cache compiled in-process (the first SAMPLE_VARIANTS of them), each sampled (sampled_run)."""
    layers = int(os.environ.get("SAMPLE_LAYERS", "8"))
    variants = (("cold", {"TORCHINDUCTOR_CACHE_DIR": "/tmp/hs-a"}),
                ("warm", {"TORCHINDUCTOR_CACHE_DIR": "/tmp/hs-a"}),
                ("cold-inprocess", {"TORCHINDUCTOR_CACHE_DIR": "/tmp/hs-b", "TORCHINDUCTOR_COMPILE_THREADS": "1"}))
    runs = []
    for name, env in variants[:int(os.environ.get("SAMPLE_VARIANTS", "3"))]:
        runs.append(sampled_run(out, f"hostsample-{name}", layers, env))
        print(f"    {runs[-1]['name']}: rc {runs[-1]['rc']} step {runs[-1]['step_time_s']} s {runs[-1]['step_times_s']}",
              runs[-1]["samples"], sep="\n", flush=True)
    return runs


def group_mallocvar(out: Path) -> list[dict]:
    """hostsample found the fresh compile's extra host time in FSDP2's reduce-scatter copy-in (aten::_chunk_cat on the
    autograd thread: 53% of samples cold, 22% warm), whose host part builds and pins metadata of one int64 per 2 KiB
    of gradient. Is it glibc's malloc (arenas, trimming, mmap of the large vectors) in a heap the compile churned?
    V2-Lite-12, each with its own cold cache."""
    variants = (("cold", {"GLIBC_TUNABLES": ""}),  # glibc's defaults, as before the launcher set it
                ("cold-mmap32m-notrim", {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=33554432:"
                                                           "glibc.malloc.trim_threshold=4294967296"}),
                ("cold-arena1", {"GLIBC_TUNABLES": "glibc.malloc.arena_max=1"}),
                ("cold-mmap128k", {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}))
    runs = []
    for name, env in variants:
        r = sampled_run(out, f"malloc-{name}", 12, {"TORCHINDUCTOR_CACHE_DIR": f"/tmp/mv-{name}", **env})
        share = [ln.strip() for ln in r["samples"].splitlines() if "chunk_cat" in ln][:1]
        print(f"    {r['name']}: rc {r['rc']} step {r['step_time_s']} s {r['step_times_s']} {share}", flush=True)
        runs.append(r)
    return runs


def v2lite6_bench(name: str, mbs: int, flags: list[str], timeout: int = 300) -> dict:
    """`paraseek bench` of DeepSeek-V2-Lite cut to 6 layers (config only), seq 4096, micro-batch `mbs` on every GPU,
    no checkpointing (or FP8MOE_AC's mode), compiled, with `flags` (the --fp8 ones)."""
    v2 = folder("v2lite6", "deepseek-v2-lite", 6, weights=False)
    ac = os.environ.get("FP8MOE_AC", "none")  # none, selective or full
    return bench_run(name, N, ["--model", v2, "--seq-len", "4096", "--micro-batch-size", str(mbs),
                               "--global-batch-size", str(mbs * N), "--activation-checkpointing", ac, "--compile",
                               *flags], timeout)


def group_fp8moe(out: Path) -> list[dict]:
    ac = os.environ.get("FP8MOE_AC", "none")
    return [v2lite6_bench(f"v2lite-6l AC {ac}+compile mbs{mbs}, {' '.join(flags)}", mbs, flags)
            for mbs in map(int, os.environ.get("FP8MOE_MBS", "2,4").split(","))
            for flags in (["--fp8", "off"], ["--fp8", "tensorwise"], ["--fp8", "tensorwise", "--fp8-experts", "on"])]


MTP_MODELS = (("7b-4l", "ds7b4", "deepseek-llm-7b"), ("v2lite-4l", "v2lite4", "deepseek-v2-lite"))
MTP_SEQ, MTP_BATCH, MTP_STEPS = 4096, 4, 10


def mtp_predictions() -> list[dict]:
    """The plan half of the mtp group (runs on a CPU too): per model, `paraseek plan ... --mtp-layers 1 --json`'s first
    plan on one H200, its train flags, and the predicted step time and allocated peak with and without the modules."""
    from paraseek.planner.memory import ALLOCATOR_BASE, ALLOCATOR_FRACTION, CUDA_CONTEXT, GiB

    def allocated(total_gib: float) -> float:  # the planner's total less the CUDA context and allocator items
        return (total_gib - (CUDA_CONTEXT + ALLOCATOR_BASE) / GiB) / (1 + ALLOCATOR_FRACTION)

    out = []
    for name, cut, preset in MTP_MODELS:
        model = folder(cut, preset, 4, weights=False)
        rc, text = sh([sys.executable, "-m", "paraseek", "plan", "--model", model, "--gpus", "1", "--gpu-type", "H200",
                       "--seq-len", str(MTP_SEQ), "--global-batch-size", str(MTP_BATCH), "--compile", "false",
                       "--mtp-layers", "1", "--top", "1", "--json"], 300)
        if rc or "{" not in text:
            out.append({"name": name, "rc": rc or 1})
            continue
        best = json.JSONDecoder().raw_decode(text[text.index("{"):])[0]["plans"][0]
        argv = best["command"].split()
        mtp = best["mtp"]
        out.append({"name": name, "rc": 0, "model": model,
                    # the plan's train flags; --mtp-layers 1 comes last (Plan.flags), each run adds its own depth
                    "flags": argv[argv.index("--micro-batch-size"):argv.index("--mtp-layers")],
                    "predicted": {1: {"step_time_s": best["step_time_s"],
                                      "mem_gib": allocated(best["memory_gib_per_gpu"])},
                                  0: {"step_time_s": best["step_time_s"] - mtp["step_time_s"],
                                      "mem_gib": allocated(best["memory_gib_per_gpu"] - mtp["memory_gib"])}},
                    "mtp_step_share": mtp["step_share"]})
        print(f"    {name}: {' '.join(out[-1]['flags'])}; predicted {out[-1]['predicted']}", flush=True)
    return out


def group_mtp(out: Path) -> list[dict]:
    runs = []
    for pred in mtp_predictions():
        if pred["rc"]:
            runs.append(pred)
            continue
        for depth in (0, 1):
            argv = ["--model", pred["model"], "--seq-len", str(MTP_SEQ), "--global-batch-size", str(MTP_BATCH),
                    "--data", "synthetic", "--steps", str(MTP_STEPS), *pred["flags"]]
            r = train_run(out, f"mtp-{pred['name']}-d{depth}", 1, [*argv, "--mtp-layers", str(depth)], timeout=150)
            tps, p = r["tokens_per_s_per_gpu"], pred["predicted"][depth]
            r["step_time_s"] = round(MTP_BATCH * MTP_SEQ / tps, 4) if tps else None
            r["predicted"] = {k: round(v, 4) for k, v in p.items()}
            if r["step_time_s"]:
                r["step_time_error"] = round(p["step_time_s"] / r["step_time_s"] - 1, 4)
            if r["mem_peak_gib"]:
                r["mem_error"] = round(p["mem_gib"] / r["mem_peak_gib"] - 1, 4)
            r["flags"] = [*pred["flags"], "--mtp-layers", str(depth)]
            runs.append(r)
    print(f"    {'run':<22} {'step s':>8} {'pred':>8} {'err':>7}   {'GiB':>7} {'pred':>7} {'err':>7}")
    for r in runs:
        p = r.get("predicted") or {}
        num = lambda x, f: format(x, f) if x is not None else "-"  # noqa: E731
        print(f"    {r['name']:<22} {num(r.get('step_time_s'), '8.3f')} {num(p.get('step_time_s'), '8.3f')} "
              f"{num(r.get('step_time_error'), '+7.1%')}   {num(r.get('mem_peak_gib'), '7.2f')} "
              f"{num(p.get('mem_gib'), '7.2f')} {num(r.get('mem_error'), '+7.1%')}", flush=True)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("groups")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/validate"))
    p.add_argument("--anchors", default=str(ROOT / ".carry"))
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip())
    print(f"torch {torch.__version__}, {N} GPU(s), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    results = {}
    for g in a.groups.split(","):
        print(f"== {g}", flush=True)
        fn = {"loss": group_loss, "plan": group_plan, "scale": group_scale, "profile": group_profile,
              "llama_zero2": group_llama_zero2, "push": group_push, "holdout": group_holdout,
              "loss_chunks": group_loss_chunks, "attn": group_attn, "holdout2": group_holdout2, "weak": group_weak,
              "v2lite_push": group_v2lite_push, "fp8smoke": group_fp8smoke, "fp8tests": group_fp8tests,
              "fp8llama": group_fp8llama, "fp8parity": group_fp8parity, "fp8moe": group_fp8moe,
              "tp2compile": group_tp2compile, "moehost": group_moehost, "coldwarm": group_coldwarm,
              "gccause": group_gccause, "hostsample": group_hostsample,
              "mallocvar": group_mallocvar, "mtp": group_mtp,
              "fp8moeparity": lambda out: group_fp8parity(out, moe=True)}.get(g)
        results[g] = fn(out) if fn else {"llama": group_llama, "v2lite": group_v2lite,
                                          "final": group_final, "fp8peer": group_fp8peer}[g](out, a.anchors)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    for g, runs in results.items():
        print(f"== {g} results")
        for r in runs:
            keep = {k: r.get(k) for k in ("rc", "gpus", "tokens_per_s_per_gpu", "mfu", "mem_peak_gib", "step_time_s",
                                          "max_rel_loss_diff", "predicted", "weak_scaling_efficiency", "result",
                                          "loss", "tail_loss", "step_time_error", "mem_error")
                    if r.get(k) is not None}
            print(f"{r['name']}: {json.dumps(keep)}")


if __name__ == "__main__":
    main()
