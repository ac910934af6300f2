"""Inference measurements on a GPU machine, as named suites (scripts/gpu/suites.py runs them; BENCHMARKS.md,
"Reproducing", lists each one with the table it feeds). `paraseek bench-infer` runs on random bf16 weights of the
R1-Distill-Llama-8B, R1-Distill-Qwen-1.5B, DeepSeek-V2-Lite and DeepSeek-V3 shapes at the engine's default flags.

    python scripts/gpu/infer_validate.py SUITE[,SUITE...] --out DIR [--anchors DIR]

Suites (one GPU):
  tests            the engine's GPU tests ($INFER_TESTS, default tests/gpu/test_infer_kernels.py and test_infer_gpu.py).
  llama8b          the 8B shape: batch-1 latency, 1,000 requests offline, decode at 1, 8, 64 and 256 sequences.
  llama8b_sampled  the 8B offline workload at temperature 0.8, top-p 0.95, each request seeded.
  qwen             the 1.5B shape: the same workloads as llama8b.
  v2lite           V2-Lite: the same with 500 requests, then decode at 64 sequences of 2,048 + 128 tokens.
  v3cut            V3's config cut to its first 6 layers (3 dense + 3 MoE of 256 experts top-8, MLA with q_lora):
                   batch-1 latency, 300 requests offline, decode at 64 sequences of 2,048 + 128 tokens.
  v3deep           V3's architecture at 27 layers of reduced width: batch-1 latency and decode at 64 x 2,048
                   (V3DEEP_PROFILE=1 adds its batch-1 profile).
  gptfast          [peer: gpt-fast] compiled batch-1 decode of the 8B shape (gptfast_decode_peer.py), 128 + 256 tokens.
  hf               transformers' `generate` (scripts/gpu/hf_requests_baseline.py) on the first 64 of the offline
                   requests of the 8B and 1.5B shapes, and on 64 sequences of 2,048 tokens of V2-Lite.
  profiles         scripts/gpu/decode_profile.py per case of $PROFILE_CASES (MODEL:BATCH:INPUT[:LAYERS], default
                   V2-Lite at 1 x 128 and 64 x 2,048): engine step against graph replay, the top kernels of a replay.
  tune             the fused-MoE tile configs of V2-Lite's and V3's experts (scripts/gpu/tune_fused_moe.py --write).
  gemv             the decode GEMV's configs against cuBLAS at one row (scripts/gpu/bench_gemv.py --tune --write).
  attn_tune        the paged decode attention's launch configs (scripts/gpu/tune_decode_attention.py --quick).
  lora             a decode step of 64 sequences of the 8B shape with 8 rank-16 adapters against the base model
                   (scripts/gpu/bench_lora_decode.py).
  fp8_8b           the 8B shape quantized to FP8 blocks on load against bf16: weights, batch-1 decode, 300 requests
                   offline, the final logits' relative L2.
  stress           the 1.5B shape, 512 concurrent prompts of 2,048 tokens on a quarter of the GPU.
  spec             speculative decoding: a V3-shaped model cut to fit, trained with --mtp-layers 1 on the bundled
                   corpus ($SPEC_TRAIN_STEPS, default 300) and exported; batch-1 accept rate and speedup with mtp at
                   K = 1, 2, 3 and ngram on repeated passages, and 32 and 128 concurrent requests with and without.
  serve1024, serve2048, serve8192
                   `paraseek serve` (8B shape) at --max-batched-tokens 1024 (the default), 2048 or 8192 under
                   `paraseek bench-serve`: concurrency 1, 8, 32, 64 and Poisson 8 and 32 requests/s, 512-token prompts,
                   128 output tokens; SIGTERM and its exit code; the engine offline at concurrency 32.
  serve_structured free text against response_format json_schema and tools with tool_choice required, concurrency 32.
  serve_profile    the server's CPU per streamed token by thread (from /proc) at concurrency 32, and py-spy's samples
                   when py-spy is installed.
  soak             tests/serve/test_soak.py for $SOAK_S seconds (default 300).
INFER_VALIDATE_TINY=1 runs the plumbing on CPU with the tiny presets (spec, lora, serve_structured, fp8_8b).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from suites import ENV, PY, ROOT, main, sh, stop_server

sys.path.insert(0, str(ROOT / "src"))  # suites that import paraseek here (spec) run from a checkout too
LLAMA, QWEN, V2LITE = "deepseek-r1-distill-llama-8b", "deepseek-r1-distill-qwen-1.5b", "deepseek-v2-lite"
if os.environ.get("INFER_VALIDATE_TINY") == "1":  # a CPU dry run of this script's plumbing with tiny models
    LLAMA, QWEN, V2LITE = "tiny-dense", "tiny-dense", "tiny-moe"


def bench(out: Path, name: str, model: str, *flags: str, timeout: int = 240, random_weights: bool = True) -> dict:
    plot = ["--plot", str(out / f"{name}.png")] if os.environ.get("BENCH_PLOTS", "1") == "1" else []
    weights = ["--random-weights"] if random_weights else []
    rc, text = sh([PY, "-m", "paraseek", "bench-infer", model, *weights, "--json", *plot, *flags], timeout)
    start = text.find("{\n")
    try:
        r = json.loads(text[start:text.rfind("}") + 1]) if start >= 0 else {}
    except json.JSONDecodeError:
        r = {}
    r.update(name=name, rc=rc, stderr_tail="\n".join(l for l in text.splitlines() if not l.startswith((" ", "{", "}")))[-2000:])
    return r


def group_tests(out: Path) -> list[dict]:
    rc, text = sh([PY, "-m", "pytest", "-q", "-x", "-m", "gpu", *(os.environ.get("INFER_TESTS") or
                   "tests/gpu/test_infer_kernels.py tests/gpu/test_infer_gpu.py").split()],
                  int(os.environ.get("INFER_TESTS_TIMEOUT", "240")))
    (out / "tests.txt").write_text(text)
    return [{"name": "gpu tests", "rc": rc, "summary": text.strip().splitlines()[-1] if text.strip() else ""}]


def group_llama8b(out: Path) -> list[dict]:
    """The 8B shape at default flags: batch-1 latency, the offline workload, decode at 1, 8, 64, 256 sequences (the
    runs scripts/planner/infer_predictions.py predicts)."""
    return [bench(out, "llama8b", LLAMA, "--concurrency", "1,8,64,256")]


def group_llama8b_sampled(out: Path) -> list[dict]:
    """The 8B offline workload sampled at temperature 0.8, top-p 0.95 (beside the greedy one of `llama8b`)."""
    return [bench(out, "llama8b-sampled", LLAMA, "--workloads", "throughput", "--temperature", "0.8", "--top-p", "0.95")]


def group_qwen(out: Path) -> list[dict]:
    return [bench(out, "qwen", QWEN, "--concurrency", "1,8,64,256")]


def group_v2lite(out: Path) -> list[dict]:
    """V2-Lite at default flags (500 requests offline, decode at 1, 8, 64, 256), then 64 sequences of 2,048 + 128."""
    return [bench(out, "v2lite", V2LITE, "--concurrency", "1,8,64,256", "--num-requests", "500"),
            bench(out, "v2lite-2048", V2LITE, "--workloads", "concurrency", "--concurrency", "64",
                  "--concurrency-input", "2048", "--concurrency-output", "128")]


def group_v3cut(out: Path) -> list[dict]:
    """DeepSeek-V3's config cut to its first 6 layers (3 dense + 3 MoE: 256 experts top-8, noaux_tc, MLA with
    q_lora), the layer shapes V3 and R1 run, on one GPU."""
    return [bench(out, "v3cut", "deepseek-v3", "--layers", "6", "--workloads", "latency,throughput,concurrency",
                  "--num-requests", "300", "--concurrency", "64", "--concurrency-input", "2048",
                  "--concurrency-output", "128")]


def group_v3deep(out: Path) -> list[dict]:
    """V3's architecture at 27 layers of reduced width (hidden 2048, 16 heads, experts of width 512, 256 of them
    top-8, noaux_tc, MLA with q_lora): the fixed cost per layer that V3 and R1 pay 61 times a token."""
    from paraseek.models.args import preset_config

    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="v3deep-"))  # not under DIR: model folders stay out of the results
    cfg = dict(preset_config("deepseek-v3"), num_hidden_layers=27, hidden_size=2048, num_attention_heads=16,
               intermediate_size=5632, moe_intermediate_size=512, q_lora_rank=768, num_nextn_predict_layers=0)
    cfg.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    rows = [bench(out, "v3deep", str(folder), "--workloads", "latency,concurrency", "--concurrency", "64",
                  "--concurrency-input", "2048", "--concurrency-output", "128")]
    if os.environ.get("V3DEEP_PROFILE") == "1":  # where its batch-1 step goes, kernel by kernel
        rows += profile_cases(out, f"{folder}:1:128", "profile")
    return rows


# Final logits of two weight formats of one model: every position of 8 prompts of 128 random tokens, each prefilled
# through the engine's runner; argv: MODEL, then a JSON list of the two sides' flags.
_FP8_LOGITS = r"""
import json, sys, numpy as np, torch
from paraseek.cli import build_parser
from paraseek.infer.build import build_engine
from paraseek.infer.ranks import Placement
from paraseek.infer.load import resolve_source
from paraseek.infer.runner import HostBatch
model, sides = sys.argv[1], json.loads(sys.argv[2])
def logits(flags):
    ns = build_parser().parse_args(["generate", model, "--num-kv-blocks", "256", "--block-size", "16", *flags])
    src = resolve_source(model, random_weights="--random-weights" in flags)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = build_engine(ns, src, Placement(device=device), log=lambda *a, **k: print(*a, file=sys.stderr))
    out = []
    for b in range(8):
        ids = np.random.default_rng(b).integers(0, engine.args.vocab_size, 128)
        n, blocks = 128, np.arange(1 + 8 * b, 9 + 8 * b)
        slots = blocks[np.arange(n) // 16] * 16 + np.arange(n) % 16
        p = np.arange(n)
        out.append(engine.runner.run(HostBatch(ids, p, slots, 0, np.zeros((0, 1), np.int32), np.zeros(0, np.int32),
                                               [(n, n)], slots, p)).float().cpu())
    del engine
    if device == "cuda":
        torch.cuda.empty_cache()
    return torch.cat(out)
a, b = logits(sides[0]), logits(sides[1])
print("FP8LOGITS " + json.dumps({"rel_l2": ((a - b).norm() / b.norm()).item(),
                                 "argmax_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}))
"""


def _fp8_side(out: Path, name: str, model: str, *flags: str) -> dict:
    """bench-infer of MODEL (batch-1 latency and offline throughput) with these weight flags."""
    short = ["--input-len", "16:64", "--output-len", "8:32"] if V2LITE == "tiny-moe" else []  # the CPU dry run
    rc, text = sh([PY, "-m", "paraseek", "bench-infer", model, "--json", "--workloads", "latency,throughput",
                   "--num-requests", "300", *short, *flags], 300)
    start = text.find("{\n")
    try:
        r = json.loads(text[start:text.rfind("}") + 1]) if start >= 0 else {}
    except json.JSONDecodeError:
        r = {}
    r.update(name=name, rc=rc, weights_line=next((l for l in text.splitlines() if l.startswith("weights:")), ""))
    return r


def _fp8_compare(out: Path, name: str, model: str, fp8_flags: list[str], base_flags: list[str]) -> list[dict]:
    results = [_fp8_side(out, f"{name}-fp8", model, *fp8_flags), _fp8_side(out, f"{name}-bf16", model, *base_flags)]
    rc, text = sh([PY, "-c", _FP8_LOGITS, model, json.dumps([fp8_flags, base_flags])], 300)
    line = next((l for l in text.splitlines() if l.startswith("FP8LOGITS ")), None)
    logit = json.loads(line[10:]) if line else {}
    (out / f"{name}-logits.txt").write_text(text[-4000:])
    summary = []
    for r in results:
        lat, tput, kv = r.get("latency", {}), r.get("throughput", {}), r.get("kv_cache", {})
        summary.append(f"{r['name']}: weights {kv.get('weights_gib', float('nan')):.2f} GiB, B1 "
                       f"{lat.get('ms_per_token', float('nan')):.2f} ms/token, "
                       f"{tput.get('output_tokens_per_s', float('nan')):,.0f} out tok/s")
    summary.append(f"final logits rel L2 {logit.get('rel_l2', float('nan')):.4f}, argmax agree "
                   f"{logit.get('argmax_agree', float('nan')):.1%} (rc {rc})")
    return results + [{"name": f"{name} summary", "rc": rc, "lines": summary, "logits": logit}]


def group_fp8_8b(out: Path) -> list[dict]:
    """The R1-Distill-Llama-8B shape (random bf16 weights) quantized on load (--quantization fp8) against bf16."""
    return _fp8_compare(out, "llama8b", LLAMA, ["--random-weights", "--quantization", "fp8"], ["--random-weights"])


def profile_cases(out: Path, cases: str, name: str) -> list[dict]:
    """scripts/gpu/decode_profile.py for each case MODEL:BATCH:INPUT[:LAYERS] (LAYERS: bench-infer's --layers): engine
    step vs replay and the top kernels of one replay, one file per case."""
    lines = []
    for case in cases.split(","):
        model, batch, inp, *layers = case.split(":")
        flags = ["--layers", layers[0]] if layers else []
        # 128 sequences at most: fewer graphs to capture; the profiled batch's graph is the same.
        rc, text = sh([PY, str(ROOT / "scripts/gpu/decode_profile.py"), model, "--batch", batch, "--input", inp,
                       "--max-num-seqs", str(max(128, int(batch))), *flags], 240)
        short = {LLAMA: "llama8b", QWEN: "qwen", V2LITE: "v2lite", "deepseek-v3": "v3cut"}.get(model, Path(model).name)
        (out / f"{name}-{short}-b{batch}.txt").write_text(text)
        lines += [l for l in text.splitlines() if l.startswith("PROFILE")] or [f"PROFILE {case} rc {rc}"]
    return [{"name": name, "rc": 0, "lines": lines}]


def group_profiles(out: Path) -> list[dict]:
    return profile_cases(out, os.environ.get("PROFILE_CASES", f"{V2LITE}:1:128,{V2LITE}:64:2048"), "profile")


def group_tune(out: Path) -> list[dict]:
    """The fused-MoE tile configs for V2-Lite's and V3's expert shapes (scripts/gpu/tune_fused_moe.py --write)."""
    shapes = os.environ.get("TUNE_SHAPES", "v2-lite v3").split()
    rc, text = sh([PY, "scripts/gpu/tune_fused_moe.py", "--shapes", *shapes, "--write"], 420)
    (out / "tune.txt").write_text(text)
    (out / "moe_configs.json").write_text((ROOT / "src/paraseek/infer/moe_configs.json").read_text())
    return [{"name": "tune", "rc": rc, "lines": text.strip().splitlines()[-30:]}]


def group_gemv(out: Path) -> list[dict]:
    """The decode GEMV's configs against cuBLAS at one row ($GEMV_MODELS, default the 8B, V2-Lite and V3 shapes):
    scripts/gpu/bench_gemv.py --tune --write, then the written src/paraseek/infer/gemv_configs.json."""
    models = os.environ.get("GEMV_MODELS", "r1-distill-llama-8b deepseek-v2-lite deepseek-v3").split()
    rc, text = sh([PY, "scripts/gpu/bench_gemv.py", "--models", *models, "--m", *os.environ.get("GEMV_M", "1").split(),
                   "--tune", "--write"], 420)
    (out / "gemv-tune.txt").write_text(text)
    cfg = ROOT / "src/paraseek/infer/gemv_configs.json"
    (out / "gemv_configs.json").write_text(cfg.read_text())
    return [{"name": "gemv tune", "rc": rc, "lines": text.strip().splitlines()[-40:]}]


def group_attn_tune(out: Path) -> list[dict]:
    """The paged decode attention kernels' launch configs (scripts/gpu/tune_decode_attention.py --quick)."""
    rc, text = sh([PY, "scripts/gpu/tune_decode_attention.py", "--quick"], 300)
    (out / "attn-tune.txt").write_text(text)
    return [{"name": "attention tune", "rc": rc, "lines": [l for l in text.splitlines() if l.startswith("TUNE")]}]


def group_stress(out: Path) -> list[dict]:
    """Many long prompts on little memory: R1-Distill-Qwen-1.5B, 512 concurrent requests of 2,048-token prompts."""
    # At 25% of the GPU (35 GiB) the pool holds fewer tokens than 512 x 2,176: the scheduler must preempt.
    return [bench(out, "stress", QWEN, "--workloads", "throughput", "--num-requests", "512", "--input-len", "2048",
                  "--output-len", "128", "--max-num-seqs", "512", "--gpu-memory-utilization", "0.25")]


def hf(out: Path, name: str, *flags: str, timeout: int = 150) -> dict:
    rc, text = sh([PY, "scripts/gpu/hf_requests_baseline.py", *flags], timeout)
    line = next((l for l in text.splitlines() if l.startswith("HFREQ ")), None)
    r = json.loads(line[6:]) if line else {}
    r.update(name=name, rc=rc)
    return r


def group_hf(out: Path) -> list[dict]:
    return [hf(out, "hf-llama8b", "--preset", LLAMA, "--batch", "64", "--requests", "64"),
            hf(out, "hf-qwen", "--preset", QWEN, "--batch", "64", "--requests", "64"),
            hf(out, "hf-v2lite", "--preset", V2LITE, "--batch", "64", "--fixed", "2048:16", timeout=200)]


def serve_sweep(out: Path, tokens_per_step: int, seed: int) -> list[dict]:
    """`paraseek serve` (8B shape, random weights) at --max-batched-tokens `tokens_per_step` under `paraseek
    bench-serve`: concurrency 1, 8, 32, 64 and a request-rate sweep, 512-token prompts and 128 output tokens; then
    SIGTERM and its exit code."""
    # A seed per invocation (each sweep point draws its own prompts too): no run finds another's prompts in
    # the server's prefix cache; each run reports the hit rate it got.
    results = _serve(out, ["--max-batched-tokens", str(tokens_per_step)],
                     [["--max-concurrency", "1", "--num-prompts", "8", "--seed", str(seed)],
                      ["--max-concurrency", "32", "--sweep", "8,32,64", "--num-prompts", "128", "--seed",
                       str(seed + 1), "--plot", str(out / "serve-concurrency.png")],
                      ["--sweep", "8,32", "--num-prompts", "128", "--slo-ttft-ms", "250", "--slo-tpot-ms",
                       "50", "--seed", str(seed + 2)]])
    # The engine offline at the same concurrency and lengths: what the server's throughput is compared with.
    results.append(bench(out, "offline-c32", LLAMA, "--workloads", "throughput", "--num-requests", "128",
                         "--input-len", "512", "--output-len", "128", "--max-num-seqs", "32"))
    return results


def group_serve_structured(out: Path) -> list[dict]:
    """What structured outputs and tool calls cost the server: concurrency 32, serve_sweep's lengths, free text
    against response_format json_schema and against chat with tools and tool_choice required (bench-serve
    --structured), on one server; the throughput ratio of each to free text. Random weights: the grammar, not the
    model, shapes each output, and every request runs to its output length or its grammar's end."""
    n = "64" if LLAMA == "tiny-dense" else "256"
    base = ["--max-concurrency", "32", "--num-prompts", n, "--endpoint", "chat"]
    # A random-weights preset has no tokenizer and no chat template: the bundled tokenizer and the shipped R1 tools
    # template (its tool-call format is what the parser reads back).
    assets = ROOT / "src/paraseek/assets"
    server = ["--tokenizer", str(assets / "tokenizer/tokenizer.json"),
              "--chat-template", str(assets / "chat_templates/deepseek_r1_tools.jinja")]
    # a seed each: no run finds another's prompts in the prefix cache
    results = _serve(out, server, [base + ["--seed", "31"], base + ["--seed", "32", "--structured", "json"],
                                   base + ["--seed", "33", "--structured", "tools"]],
                     lengths=("32", "16") if LLAMA == "tiny-dense" else ("512", "128"))
    runs = results[-1].get("runs", [])
    if len(runs) == 3 and runs[0].get("output_throughput"):
        free = runs[0]["output_throughput"]
        results.append({"name": "structured cost", "rc": 0, "summary": "; ".join(
            f"{what}: {r['output_throughput']:,.0f} out tok/s = {r['output_throughput'] / free:.1%} of free text "
            f"({r.get('completed', '?')} completed, {r.get('output_tokens', '?')} output tokens)"
            for what, r in zip(("free text", "json_schema", "tools required"), runs))})
    return results


def group_soak(out: Path) -> list[dict]:
    """tests/serve/test_soak.py on the GPU machine for SOAK_S seconds (default 300; CI runs it for 30): a steady rate
    above the server's capacity; the queue bound, /health, no lost request and flat memory are the test's asserts."""
    seconds = os.environ.get("SOAK_S", "300")
    argv = [PY, "-m", "pytest", "-q", "-s", "tests/serve/test_soak.py"]
    t0 = time.time()
    r = subprocess.run(argv, env={**ENV, "PARASEEK_SOAK_S": seconds}, capture_output=True, text=True, cwd=ROOT,
                       timeout=int(seconds) + 240)
    text = r.stdout + r.stderr
    (out / "soak.txt").write_text(text)
    lines = [ln for ln in text.splitlines() if ln.startswith("soak:") or " passed" in ln or " failed" in ln]
    return [{"name": f"serve soak {seconds} s", "rc": r.returncode, "seconds": round(time.time() - t0),
             "summary": " | ".join(lines)[-400:]}]


def group_serve_profile(out: Path) -> list[dict]:
    """Where the server's time goes at concurrency 32 (serve_sweep's lengths): each server thread's CPU seconds
    per streamed token (from /proc), and py-spy's samples of the server by thread and function (py-spy from the
    carried wheels, if there)."""
    return _serve(out, [], [["--max-concurrency", "32", "--num-prompts", "256", "--seed", "8"]], profile=True)


def _thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of `pid`: the main thread (HTTP, asyncio) apart from all the others (the engine
    thread and torch's)."""
    tck, cpu = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        fields = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        name = "main thread (HTTP)" if int(tid) == pid else "other threads (engine, torch)"
        cpu[name] = cpu.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tck
    return cpu


def _pyspy_digest(raw: Path, top: int = 25) -> list[str]:
    """py-spy's raw (collapsed) stacks: samples per thread, then the frames most often on the stack per thread."""
    from collections import Counter

    threads, frames, leaves = Counter(), Counter(), Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        parts = stack.split(";")
        threads[parts[0]] += int(n)
        leaves[(parts[0], parts[-1])] += int(n)
        for f in set(parts[1:]):
            frames[(parts[0], f)] += int(n)
    lines = [f"{n} samples: {t}" for t, n in threads.most_common()]
    for t, total in threads.most_common(2):
        # inclusive, without the frames under which the thread always is (its entry point), then self time
        lines += [f"  {t[:40]} incl {n} {f}" for (tt, f), n in frames.most_common()
                  if tt == t and n < 0.95 * total][:top]
        lines += [f"  {t[:40]} self {n} {f}" for (tt, f), n in leaves.most_common() if tt == t][:top]
    return lines


def _serve(out: Path, server_flags: list[str], bench_flags: list[list[str]], profile: bool = False,
           lengths: tuple[str, str] = ("512", "128")) -> list[dict]:
    import shutil
    import urllib.request

    port = 8100
    log = open(out / "serve.log", "w")
    t0 = time.time()
    server = subprocess.Popen([PY, "-m", "paraseek", "serve", LLAMA, "--random-weights", "--port", str(port),
                               "--served-model-name", "llama8b", *server_flags], env=ENV, cwd=ROOT, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    ready = False
    while time.time() - t0 < 150 and server.poll() is None:
        try:
            ready = urllib.request.urlopen(url + "/health", timeout=2).status == 200
        except OSError:
            ready = False
        if ready:
            break
        time.sleep(1)
    results = [{"name": "serve start", "rc": 0 if ready else 1, "summary": f"ready after {time.time() - t0:.0f} s"}]
    runs = []
    if ready:
        common = ["--input-len", lengths[0], "--output-len", lengths[1], "--json", "--model", "llama8b"]
        for flags in bench_flags:
            spy = shutil.which("py-spy") or next((str(p) for p in Path("/tmp/site/bin").glob("py-spy")), None)
            if profile and spy:
                spy = subprocess.Popen([spy, "record", "--pid", str(server.pid), "--threads", "--format", "raw",
                                        "--rate", "200", "-o", str(out / "serve-pyspy.raw")],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            cpu0 = _thread_cpu_s(server.pid) if profile else {}
            rc, text = sh([PY, "-m", "paraseek", "bench-serve", url, *common, *flags], 240)
            cpu1 = _thread_cpu_s(server.pid) if profile else {}
            try:
                runs += json.loads(text[text.find("{"):text.rfind("}") + 1])["runs"]
            except (json.JSONDecodeError, KeyError):
                results.append({"name": "bench-serve", "rc": rc, "summary": text.strip().splitlines()[-1][:200]})
            if profile and runs:
                tokens = runs[-1]["output_throughput"] * runs[-1]["duration_s"]
                per_token = {k: 1e3 * (cpu1[k] - cpu0.get(k, 0.0)) / tokens for k in cpu1}
                results.append({"name": "serve CPU ms per streamed token", "rc": rc, "summary": "; ".join(
                    f"{k}: {v:.3f}" for k, v in per_token.items())})
            if profile and isinstance(spy, subprocess.Popen):
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                spy.wait(30)
                raw = out / "serve-pyspy.raw"
                if raw.exists():
                    (out / "serve-pyspy.txt").write_text("\n".join(_pyspy_digest(raw)))
                    raw.unlink()  # large; the digest is what comes back
    code = stop_server(server, 90)
    log.close()
    results.append({"name": "serve SIGTERM", "rc": 0 if code == 0 else 1, "summary": f"exit code {code}"})
    results.append({"name": "serve runs " + " ".join(server_flags), "rc": 0, "runs": runs,
                    "summary": "; ".join(_serve_row(r) for r in runs)})
    print(results[-1]["summary"], flush=True)
    return results


def _serve_row(r: dict) -> str:
    t = r.get("ttft_ms", {})
    p = r.get("tpot_ms", {})
    return (f"c={r.get('max_concurrency')} rate={r.get('request_rate')}: {r.get('output_throughput', 0):,.0f} out tok/s, "
            f"TTFT p50 {t.get('p50') or 0:.0f} p99 {t.get('p99') or 0:.0f} ms, TPOT p50 {p.get('p50') or 0:.1f} ms, "
            f"prefix hits {r.get('prefix_cache_hit_rate', float('nan')):.0%}")


def group_gptfast(out: Path, anchors: str) -> list[dict]:
    rc, text = sh([PY, f"{anchors}/gptfast_decode_peer.py", "--batches", "1", "--modes", "compile", "--new-tokens",
                   "256", "--prompt-len", "128", "--samples", "3"], 480)
    (out / "gptfast.txt").write_text(text)
    return [{"name": "gpt-fast", "rc": rc, "lines": [l for l in text.splitlines() if l.startswith("GPTFAST")]}]


def group_lora(out: Path) -> list[dict]:
    tiny = ["--context", "64", "--batch", "8", "--reps", "5"] if os.environ.get("INFER_VALIDATE_TINY") == "1" else []
    rc, text = sh([PY, str(ROOT / "scripts/gpu/bench_lora_decode.py"), "--model", LLAMA, *tiny], 900)
    (out / "lora.txt").write_text(text)
    lines = text.splitlines()
    found = next((l for l in lines if l.startswith("LORA ")), None)
    r = json.loads(found[len("LORA "):]) if found else {}
    return [{**r, "name": "lora", "rc": rc, "lines": [l for l in lines if l.startswith("decode step of")]}]


# Speculative decoding's expected speedup (Leviathan et al. 2023, sec. 3): with each draft accepted with probability
# a (independently) and K drafts a step, a verification step delivers E = (1 - a^(K+1)) / (1 - a) tokens. Decode is
# memory-bound, so the target's step over K + 1 positions costs about one decode step (it reads the same weights
# once); if each draft costs c decode steps (the MTP layer: its one block and the head, about (1 + head) / (L + head)
# of a step for L layers -- 1/62 of V3's layers plus a second read of the head; prompt lookup: ~0, on the host), then
#     speedup = E / (1 + K c)
# e.g. V3's reported 85-90% of its drafts accepted: of its one MTP draft (K = 1, c ~ 0.05): E = 1.85-1.9, speedup 1.76-1.81 --
# the 1.8x TPS of the V3 report (sec. 5.4.3). Measured rows below put each run's own a beside it. Speculative
# steps also give up the overlapped host work and (MTP) the CUDA graphs, which this formula does not count.
def expected_speedup(a: float, k: int, c: float) -> float:
    tokens = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
    return tokens / (1 + k * c)


def group_spec(out: Path) -> list[dict]:
    """Speculative decoding on a V3-shaped model cut to fit (MLA with q_lora, noaux_tc MoE, one MTP layer) trained
    here for $SPEC_TRAIN_STEPS (default 300) steps on the bundled corpus with --mtp-layers 1, so that its drafts
    mean something, and exported: bench-infer at batch 1 (prompts from the corpus) without speculation, with
    --speculative mtp at K = 1, 2, 3, and with ngram on prompts that repeat a passage (against the same prompts
    without it): the accept rate, the time per output token and the speedup beside expected_speedup's; then the
    throughput of 32 and 128 concurrent requests with and without speculation."""
    import tempfile

    from paraseek.models.args import preset_config
    from paraseek.train.corpus import BUNDLED_CORPUS

    work = Path(tempfile.mkdtemp(prefix="spec-"))  # not under DIR: model folders stay out of the results
    cfg = dict(preset_config("deepseek-v3"), num_hidden_layers=8, first_k_dense_replace=1, hidden_size=1024,
               num_attention_heads=16, intermediate_size=2816, moe_intermediate_size=256, n_routed_experts=64,
               num_experts_per_tok=6, q_lora_rank=384, vocab_size=2048, max_position_embeddings=4096,
               num_nextn_predict_layers=1)
    cfg.pop("quantization_config", None)
    tiny = os.environ.get("INFER_VALIDATE_TINY") == "1"  # the plumbing on CPU: tiny-moe, a few steps, short runs
    if tiny:
        cfg = dict(preset_config("tiny-moe"), num_nextn_predict_layers=1)
    (work / "v3spec").mkdir()
    (work / "v3spec" / "config.json").write_text(json.dumps(cfg))
    model = work / "v3spec-trained"
    steps = os.environ.get("SPEC_TRAIN_STEPS", "5" if tiny else "300")
    seq, batch, micro = ("64", "4", "2") if tiny else ("1024", "16", "8")
    rc, text = sh([PY, "-m", "paraseek", "train", "--device", "cpu" if tiny else "cuda", "--nproc", "1", "--model",
                   str(work / "v3spec"), "--data", str(BUNDLED_CORPUS), "--seq-len", seq, "--global-batch-size", batch,
                   "--micro-batch-size", micro, "--steps", steps, "--mtp-layers", "1", "--export-hf", str(model),
                   "--checkpoint-dir", str(work / "ckpt")], 1500)
    steps_done = [l for l in text.splitlines() if l.startswith("step ")][-1:]  # loss and mtp loss at the end
    results = [{"name": "spec-train", "rc": rc, "lines": steps_done + [l for l in text.splitlines()
                                                                       if l.startswith("done:")]}]
    if rc:
        return results
    text_file = str(sorted(BUNDLED_CORPUS.glob("*.txt"))[0])
    lat = ["--workloads", "latency", "--latency-input", "32" if tiny else "256", "--latency-output",
           "16" if tiny else "256", "--reps", "1" if tiny else "3", "--prompt-text", text_file]

    def run(name: str, *flags: str) -> dict:
        return bench(out, name, str(model), *lat, *flags, timeout=300, random_weights=False)

    def compare(base: dict, r: dict, k: int, c: float) -> dict:
        spec = r.get("latency", {}).get("speculative") or {}
        tpot0, tpot = base.get("latency", {}).get("tpot_ms"), r.get("latency", {}).get("tpot_ms")
        a = spec.get("accepted_per_position", [None])[0]
        r["speedup"] = tpot0 / tpot if tpot0 and tpot else None
        rate = spec.get("accept_rate")
        r["expected_speedup"] = expected_speedup(rate, k, c) if rate is not None else None
        fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
        r["lines"] = [f"K={k} accepted {fmt(rate, '.1%')} (first draft {fmt(a, '.1%')}), "
                      f"{fmt(spec.get('mean_accepted_length'), '.2f')} tokens/step, TPOT {fmt(tpot, '.2f')} ms vs "
                      f"{fmt(tpot0, '.2f')} ms: {fmt(r['speedup'], '.2f')}x (expected "
                      f"{fmt(r['expected_speedup'], '.2f')}x at a draft cost of {c:.2f} steps)"]
        return r

    base = run("spec-none")
    results.append(base)
    c_mtp = 2 / (cfg["num_hidden_layers"] + 2)  # the MTP block and the head again, against L blocks and the head
    for k in (1, 2, 3):
        results.append(compare(base, run(f"spec-mtp-k{k}", "--speculative", "mtp", "--num-speculative-tokens", str(k)),
                               k, c_mtp))
    rep = ["--prompt-repeat", "2"]
    base_rep = run("spec-none-repeat", *rep)
    results.append(base_rep)
    results.append(compare(base_rep, run("spec-ngram-k3", *rep, "--speculative", "ngram", "--num-speculative-tokens",
                                         "3"), 3, 0.0))
    conc = ["--workloads", "concurrency", "--concurrency", "4,8" if tiny else "32,128", "--concurrency-input",
            "32" if tiny else "512", "--concurrency-output", "16" if tiny else "256", "--prompt-text", text_file]
    for name, flags in (("spec-c-none", []), ("spec-c-mtp-k1", ["--speculative", "mtp"]),
                        ("spec-c-ngram-k3", ["--speculative", "ngram", "--num-speculative-tokens", "3"]),
                        # Speculating at every batch size (the default --speculative-max-batch 16 makes the runs
                        # above plain steps at 32 and 128): the speculative step's own cost.
                        ("spec-c-mtp-k1-all", ["--speculative", "mtp", "--speculative-max-batch", "128"]),
                        ("spec-c-ngram-k3-all", ["--speculative", "ngram", "--num-speculative-tokens", "3",
                                                 "--speculative-max-batch", "128"])):
        r = bench(out, name, str(model), *conc, *flags, timeout=400, random_weights=False)
        r["lines"] = [f"c{c['concurrency']}: {c['output_tokens_per_s']:,.0f} out tok/s"
                      + (f", accepted {c['speculative']['accept_rate'] or 0:.1%}, plain steps "
                         f"{c['speculative'].get('plain_steps', 0):,}" if c.get("speculative") else "")
                      for c in r.get("concurrency", [])]
        results.append(r)
    return results


def row(r: dict) -> str:
    name = r.get("name")
    if "lines" in r:
        return f"{name:14} rc {r['rc']} " + " | ".join(" ".join(l.split()) for l in r["lines"])
    if "summary" in r:
        return f"{name:14} rc {r['rc']} {r['summary']}"
    if "output_tokens_per_s" in r:
        return (f"{name:14} rc {r['rc']} HF {r.get('mode')} B={r.get('batch')} {r['requests']} req: "
                f"{r['output_tokens_per_s']:,.0f} out tok/s, decode {r.get('decode_tokens_per_s') or 0:,.0f} tok/s, "
                f"peak {r.get('peak_memory_gib', 0):.1f} GiB")
    parts = [f"{name:14} rc {r.get('rc')}"]
    kv = r.get("kv_cache", {})
    if kv:
        parts.append(f"KV {kv.get('tokens', 0):,} tok")
    if "latency" in r:
        lat = r["latency"]
        parts.append(f"B1 {lat['ms_per_token']:.2f} ms/tok (roof {lat['roofline_ms_per_token']:.2f}) TTFT "
                     f"{lat['ttft_ms']:.0f} ms")
    if "throughput" in r:
        t = r["throughput"]
        parts.append(f"tput {t['output_tokens_per_s']:,.0f} out tok/s in {t['wall_s']:.0f} s (roof "
                     f"{t['roofline_fraction']:.0%}) preempt {t['preemptions']} peak {t.get('peak_memory_gib') or 0:.1f} GiB")
    for c in r.get("concurrency", []):
        parts.append(f"c{c['concurrency']} {c['decode_ms_per_step']:.1f} ms ({c['decode_tokens_per_s']:,.0f} tok/s)")
    if r.get("plan_infer"):
        parts.append("plan " + json.dumps(r["plan_infer"].get("plans", r["plan_infer"]))[:160])
    return " | ".join(parts)


SUITES = {
    "tests": (group_tests, ()),
    "llama8b": (group_llama8b, ()),
    "llama8b_sampled": (group_llama8b_sampled, ()),
    "qwen": (group_qwen, ()),
    "v2lite": (group_v2lite, ()),
    "v3cut": (group_v3cut, ()),
    "v3deep": (group_v3deep, ()),
    "gptfast": (group_gptfast, ("gptfast_decode_peer.py",)),
    "hf": (group_hf, ()),
    "profiles": (group_profiles, ()),
    "tune": (group_tune, ()),
    "gemv": (group_gemv, ()),
    "attn_tune": (group_attn_tune, ()),
    "lora": (group_lora, ()),
    "fp8_8b": (group_fp8_8b, ()),
    "stress": (group_stress, ()),
    "spec": (group_spec, ()),
    "serve1024": (lambda out: serve_sweep(out, 1024, seed=21), ()),
    "serve2048": (lambda out: serve_sweep(out, 2048, seed=11), ()),
    "serve8192": (lambda out: serve_sweep(out, 8192, seed=1), ()),
    "serve_structured": (group_serve_structured, ()),
    "serve_profile": (group_serve_profile, ()),
    "soak": (group_soak, ()),
}

if __name__ == "__main__":
    main(__doc__, SUITES, row)
