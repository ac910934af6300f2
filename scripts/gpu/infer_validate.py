"""The inference measurements on a GPU machine in one run: the engine's GPU tests, `paraseek bench-infer` on the
R1-Distill-Llama-8B, R1-Distill-Qwen-1.5B and DeepSeek-V2-Lite shapes (random bf16 weights), 512 concurrent
2,048-token prompts on a quarter of the GPU, and the baselines (HF `generate`, gpt-fast; their scripts in the folder
--anchors names) in the same run.

    python scripts/gpu/infer_validate.py GROUP[,GROUP...] --out DIR [--anchors DIR]

Groups: cases (bench-infer on each case of $BENCH_CASES), tests, llama8b, llama8b_latency, llama8b_sampled, qwen,
qwen_all, v2lite_all, v3cut_latency, v2lite, v3cut (V3's first 6 layers), v3deep (V3's architecture at 27 layers of
reduced width; V3DEEP_PROFILE=1 adds its batch-1 profile), profiles (scripts/gpu/decode_profile.py per case,
this code and .baseline/'s), tune (the fused-MoE configs), gemv (the decode GEMV's configs), attn_tune (the
paged decode attention's launch configs), stress, hf (HF generate on the same requests, 8B and 1.5B;
hf8b, hfqwen one each), hfv2 (HF on V2-Lite), hfstatic, gptfast, serve (`paraseek serve` under `paraseek bench-serve`,
then SIGTERM, then the engine offline at the same concurrency), serve2048 and serve1024 (the same with
--max-batched-tokens 2048 or 1024), soak (tests/serve/test_soak.py for $SOAK_S seconds, default 300), serve_profile
(the server's CPU per streamed token by thread, and py-spy's samples at concurrency 32: carry py-spy's wheel in .whl),
fp8 (V3's first 6 layers as an FP8 checkpoint, FP8 kept against dequantized bf16), fp8_8b (the 8B shape with
--quantization fp8 against bf16), lora (scripts/gpu/bench_lora_decode.py: a decode step of 64 sequences on the 8B shape with 8 rank-16 LoRA adapters
against the base model, graphs on), spec (speculative decoding: a V3-shaped model cut to fit, trained with
--mtp-layers 1 on the bundled corpus and exported; batch-1 accept rate and speedup with --speculative mtp at K = 1, 2,
3 and ngram on repeated passages, and throughput at 32 and 128 concurrent requests with and without it).
All results go to DIR/summary.json (the device returns at most 8 files: one JSON, the test log, the plots); the
last lines printed are the table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))  # groups that import paraseek here (spec) run from a checkout too
# src first, then whatever the caller put on the path (the serve extra's wheels, installed with --target)
ENV = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1",
           PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p))
PY = sys.executable
LLAMA, QWEN, V2LITE = "deepseek-r1-distill-llama-8b", "deepseek-r1-distill-qwen-1.5b", "deepseek-v2-lite"
if os.environ.get("INFER_VALIDATE_TINY") == "1":  # a CPU dry run of this script's plumbing with tiny models
    LLAMA, QWEN, V2LITE = "tiny-dense", "tiny-dense", "tiny-moe"


_DEADLINE = time.time() + float(os.environ.get("INFER_DEADLINE_S", "1e9"))  # the whole run's: cut a run, keep the rest


def sh(argv: list[str], timeout: int, env: dict | None = None) -> tuple[int, str]:
    t0 = time.time()
    timeout = max(1, min(timeout, int(_DEADLINE - t0)))
    try:
        r = subprocess.run(argv, env=env or ENV, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = 124, (e.stdout or b"").decode(errors="replace"), (e.stderr or b"").decode(errors="replace")
    print(f"  [{time.time() - t0:.0f} s, rc {rc}] {' '.join(Path(x).name if '/' in x else x for x in argv[1:])[:170]}",
          flush=True)
    if rc:
        print("\n".join((out + err).splitlines()[-12:]), flush=True)
    return rc, out + ("\n" + err if err else "")


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


def group_tests(out: Path, anchors: str) -> list[dict]:
    rc, text = sh([PY, "-m", "pytest", "-q", "-x", "-m", "gpu", *(os.environ.get("INFER_TESTS") or
                   "tests/gpu/test_infer_kernels.py tests/gpu/test_infer_gpu.py").split()],
                  int(os.environ.get("INFER_TESTS_TIMEOUT", "240")))
    (out / "tests.txt").write_text(text)
    return [{"name": "gpu tests", "rc": rc, "summary": text.strip().splitlines()[-1] if text.strip() else ""}]


def group_llama8b(out: Path, anchors: str) -> list[dict]:
    """The 8B shape at default flags: batch-1 latency, the offline workload, decode at 1, 8, 64, 256 sequences (the
    runs scripts/planner/infer_predictions.py predicts)."""
    return [bench(out, "llama8b", LLAMA, "--concurrency", "1,8,64,256")]


def group_llama8b_sampled(out: Path, anchors: str) -> list[dict]:
    """The 8B offline workload sampled at temperature 0.8, top-p 0.95 (beside the greedy one of `llama8b`)."""
    return [bench(out, "llama8b-sampled", LLAMA, "--workloads", "throughput", "--temperature", "0.8", "--top-p", "0.95")]


def group_qwen_all(out: Path, anchors: str) -> list[dict]:
    return [bench(out, "qwen", QWEN, "--concurrency", "1,8,64,256")]


def group_v2lite_all(out: Path, anchors: str) -> list[dict]:
    """V2-Lite at default flags (500 requests offline, decode at 1, 8, 64, 256), then 64 sequences of 2,048 + 128."""
    return [bench(out, "v2lite", V2LITE, "--concurrency", "1,8,64,256", "--num-requests", "500"),
            bench(out, "v2lite-2048", V2LITE, "--workloads", "concurrency", "--concurrency", "64",
                  "--concurrency-input", "2048", "--concurrency-output", "128")]


def group_v3cut_latency(out: Path, anchors: str) -> list[dict]:
    return [bench(out, "v3cut-latency", "deepseek-v3", "--layers", "6", "--workloads", "latency")]


def group_llama8b_latency(out: Path, anchors: str) -> list[dict]:
    return [bench(out, "llama8b-latency", LLAMA, "--workloads", "latency")]


def group_qwen(out: Path, anchors: str) -> list[dict]:
    return [bench(out, "qwen", QWEN, "--workloads", "latency,throughput")]


def group_v2lite(out: Path, anchors: str) -> list[dict]:
    r = bench(out, "v2lite", V2LITE, "--workloads", "latency,throughput,concurrency", "--num-requests", "500",
              "--concurrency", "64", "--concurrency-input", "2048", "--concurrency-output", "128")
    rc, text = sh([PY, "-m", "paraseek", "plan", "--mode", "infer", "--model", V2LITE, "--gpus", "1", "--gpu-type",
                   "H200", "--seq-len", str(r.get("engine", {}).get("max_model_len", 32768)), "--json"], 120)
    try:
        r["plan_infer"] = json.loads(text[text.find("{"):text.rfind("}") + 1])
    except json.JSONDecodeError:
        r["plan_infer"] = None
    return [r]


def group_v3cut(out: Path, anchors: str) -> list[dict]:
    """DeepSeek-V3's config cut to its first 6 layers (3 dense + 3 MoE: 256 experts top-8, noaux_tc, MLA with
    q_lora), the layer shapes V3 and R1 run, on one GPU."""
    return [bench(out, "v3cut", "deepseek-v3", "--layers", "6", "--workloads", "latency,throughput,concurrency",
                  "--num-requests", "300", "--concurrency", "64", "--concurrency-input", "2048",
                  "--concurrency-output", "128")]


def group_v3deep(out: Path, anchors: str) -> list[dict]:
    """V3's architecture at 27 layers of reduced width (hidden 2048, 16 heads, experts of width 512, 256 of them
    top-8, noaux_tc, MLA with q_lora): the fixed cost per layer that V3 and R1 pay 61 times a token."""
    from paraseek.models.args import preset_config

    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="v3deep-"))  # not under DIR: the device returns a few files only
    cfg = dict(preset_config("deepseek-v3"), num_hidden_layers=27, hidden_size=2048, num_attention_heads=16,
               intermediate_size=5632, moe_intermediate_size=512, q_lora_rank=768, num_nextn_predict_layers=0)
    cfg.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    rows = [bench(out, "v3deep", str(folder), "--workloads", "latency,concurrency", "--concurrency", "64",
                  "--concurrency-input", "2048", "--concurrency-output", "128")]
    if os.environ.get("V3DEEP_PROFILE") == "1":  # where its batch-1 step goes, kernel by kernel
        rows += profile_cases(out, f"{folder}:1:128", ROOT, "profile")
    return rows


def group_cases(out: Path, anchors: str) -> list[dict]:
    """bench-infer on each case of $BENCH_CASES: `NAME MODEL FLAG...` separated by `;` (random weights), e.g.
    "v2lite-t8k deepseek-v2-lite --workloads throughput --num-requests 500 --max-batched-tokens 8192"."""
    rows = []
    for case in filter(None, (c.strip() for c in os.environ.get("BENCH_CASES", "").split(";"))):
        name, model, *flags = case.split()
        rows.append(bench(out, name, model, *flags, timeout=300))
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


def group_fp8(out: Path, anchors: str) -> list[dict]:
    """DeepSeek-V3's config cut to 6 layers (3 dense + 3 MoE) written as an FP8 folder by
    scripts/write_fp8_checkpoint.py (random weights, V3's names and 128x128 block scales), served with its FP8 blocks
    kept and from its dequantized bf16 load (--quantization none): weight memory, batch-1 decode ms/token, offline
    throughput of 300 requests, and the final logits' relative L2 between the two."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="v3fp8-")) / "v3-6layers-fp8"  # not under DIR: ~17 GB
    v3, layers, device = ("tiny-moe", "3", "cpu") if V2LITE == "tiny-moe" else ("deepseek-v3", "6", "cuda")
    rc, text = sh([PY, "scripts/write_fp8_checkpoint.py", v3, str(folder), "--random-weights", "--layers", layers,
                   "--mtp-layers", "0", "--device", device], 420)
    if rc:
        return [{"name": "fp8 write", "rc": rc, "summary": text.strip().splitlines()[-1] if text.strip() else ""}]
    return _fp8_compare(out, "v3cut", str(folder), ["--quantization", "fp8"], ["--quantization", "none"])


def group_fp8_8b(out: Path, anchors: str) -> list[dict]:
    """The R1-Distill-Llama-8B shape (random bf16 weights) quantized on load (--quantization fp8) against bf16."""
    return _fp8_compare(out, "llama8b", LLAMA, ["--random-weights", "--quantization", "fp8"], ["--random-weights"])


def profile_cases(out: Path, cases: str, src: Path, name: str) -> list[dict]:
    """scripts/gpu/decode_profile.py (this checkout's script) on the code of `src` for each case MODEL:BATCH:INPUT[:LAYERS]
    (LAYERS: bench-infer's --layers): engine step vs replay and the top kernels of one replay, one file per case."""
    lines = []
    env = dict(ENV, PYTHONPATH=str(src / "src"))
    for case in cases.split(","):
        model, batch, inp, *layers = case.split(":")
        flags = ["--layers", layers[0]] if layers else []
        # 128 sequences at most: fewer graphs to capture; the profiled batch's graph is the same.
        rc, text = sh([PY, str(ROOT / "scripts/gpu/decode_profile.py"), model, "--batch", batch, "--input", inp,
                       "--max-num-seqs", str(max(128, int(batch))), *flags], 240, env)
        short = {LLAMA: "llama8b", QWEN: "qwen", V2LITE: "v2lite", "deepseek-v3": "v3cut"}.get(model, Path(model).name)
        (out / f"{name}-{short}-b{batch}.txt").write_text(text)
        lines += [l for l in text.splitlines() if l.startswith("PROFILE")] or [f"PROFILE {case} rc {rc}"]
    return [{"name": name, "rc": 0, "lines": lines}]


def group_profiles(out: Path, anchors: str) -> list[dict]:
    """Decode profiles of this code ($PROFILE_CASES) and, when .baseline/ holds an earlier checkout
    (`git archive REV src | tar -x -C .baseline`), of that code ($PROFILE_BASELINE_CASES): before/after in one run."""
    rows = profile_cases(out, os.environ.get("PROFILE_CASES", f"{V2LITE}:1:128,{V2LITE}:64:2048"), ROOT, "profile")
    if (ROOT / ".baseline/src").is_dir() and os.environ.get("PROFILE_BASELINE_CASES"):
        rows += profile_cases(out, os.environ["PROFILE_BASELINE_CASES"], ROOT / ".baseline", "profile-before")
    return rows


def group_tune(out: Path, anchors: str) -> list[dict]:
    """The fused-MoE tile configs for V2-Lite's and V3's expert shapes (scripts/gpu/tune_fused_moe.py --write)."""
    shapes = os.environ.get("TUNE_SHAPES", "v2-lite v3").split()
    rc, text = sh([PY, "scripts/gpu/tune_fused_moe.py", "--shapes", *shapes, "--write"], 420)
    (out / "tune.txt").write_text(text)
    (out / "moe_configs.json").write_text((ROOT / "src/paraseek/infer/moe_configs.json").read_text())
    return [{"name": "tune", "rc": rc, "lines": text.strip().splitlines()[-30:]}]


def group_gemv(out: Path, anchors: str) -> list[dict]:
    """The decode GEMV's configs against cuBLAS at one row ($GEMV_MODELS, default the 8B, V2-Lite and V3 shapes):
    scripts/gpu/bench_gemv.py --tune --write, then the written src/paraseek/infer/gemv_configs.json."""
    models = os.environ.get("GEMV_MODELS", "r1-distill-llama-8b deepseek-v2-lite deepseek-v3").split()
    rc, text = sh([PY, "scripts/gpu/bench_gemv.py", "--models", *models, "--m", *os.environ.get("GEMV_M", "1").split(),
                   "--tune", "--write"], 420)
    (out / "gemv-tune.txt").write_text(text)
    cfg = ROOT / "src/paraseek/infer/gemv_configs.json"
    (out / "gemv_configs.json").write_text(cfg.read_text())
    return [{"name": "gemv tune", "rc": rc, "lines": text.strip().splitlines()[-40:]}]


def group_attn_tune(out: Path, anchors: str) -> list[dict]:
    """The paged decode attention kernels' launch configs (scripts/gpu/tune_decode_attention.py --quick)."""
    rc, text = sh([PY, "scripts/gpu/tune_decode_attention.py", "--quick"], 300)
    (out / "attn-tune.txt").write_text(text)
    return [{"name": "attention tune", "rc": rc, "lines": [l for l in text.splitlines() if l.startswith("TUNE")]}]


def group_stress(out: Path, anchors: str) -> list[dict]:
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


def group_hf8b(out: Path, anchors: str) -> list[dict]:
    return [hf(out, "hf-llama8b", "--preset", LLAMA, "--batch", "64", "--requests", "64")]


def group_hfqwen(out: Path, anchors: str) -> list[dict]:
    return [hf(out, "hf-qwen", "--preset", QWEN, "--batch", "64", "--requests", "64")]


def group_hf(out: Path, anchors: str) -> list[dict]:
    return group_hf8b(out, anchors) + group_hfqwen(out, anchors)


def group_hfv2(out: Path, anchors: str) -> list[dict]:
    return [hf(out, "hf-v2lite", "--preset", V2LITE, "--batch", "64", "--fixed", "2048:16", timeout=200)]


def group_serve(out: Path, anchors: str, server_flags: tuple[str, ...] = (), seed: int = 1) -> list[dict]:
    """`paraseek serve` (8B shape, random weights) under `paraseek bench-serve`: concurrency 1, 8, 32, 64 and a
    request-rate sweep, 512-token prompts and 128 output tokens; then SIGTERM and its exit code."""
    # A seed per invocation (each sweep point draws its own prompts too): no run finds another's prompts in
    # the server's prefix cache; each run reports the hit rate it got.
    results = _serve(out, list(server_flags),
                     [["--max-concurrency", "1", "--num-prompts", "8", "--seed", str(seed)],
                      ["--max-concurrency", "32", "--sweep", "8,32,64", "--num-prompts", "128", "--seed",
                       str(seed + 1), "--plot", str(out / "serve-concurrency.png")],
                      ["--sweep", "8,32", "--num-prompts", "128", "--slo-ttft-ms", "250", "--slo-tpot-ms",
                       "50", "--seed", str(seed + 2)]])
    # The engine offline at the same concurrency and lengths: what the server's throughput is compared with.
    results.append(bench(out, "offline-c32", LLAMA, "--workloads", "throughput", "--num-requests", "128",
                         "--input-len", "512", "--output-len", "128", "--max-num-seqs", "32"))
    return results


def group_serve_structured(out: Path, anchors: str) -> list[dict]:
    """What structured outputs and tool calls cost the server: concurrency 32, the serve group's lengths, free text
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


def group_serve2048(out: Path, anchors: str) -> list[dict]:
    """The serve group with 2048 tokens per step instead of 8192 (new seeds: nothing in the cache from a run
    before)."""
    return group_serve(out, anchors, ("--max-batched-tokens", "2048"), seed=11)


def group_serve1024(out: Path, anchors: str) -> list[dict]:
    """The serve group with 1024 tokens per step (new seeds)."""
    return group_serve(out, anchors, ("--max-batched-tokens", "1024"), seed=21)


def group_soak(out: Path, anchors: str) -> list[dict]:
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


def group_serve_profile(out: Path, anchors: str) -> list[dict]:
    """Where the server's time goes at concurrency 32 (the serve group's lengths): each server thread's CPU seconds
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


def stop_server(server: subprocess.Popen, timeout: int) -> int | str:
    """SIGTERM (the server drains and exits), then its exit code; killed if it has not exited within `timeout` s."""
    server.send_signal(signal.SIGTERM)
    try:
        return server.wait(timeout)
    except subprocess.TimeoutExpired:
        server.kill()
        return f"killed after {timeout} s"


def _serve_row(r: dict) -> str:
    t = r.get("ttft_ms", {})
    p = r.get("tpot_ms", {})
    return (f"c={r.get('max_concurrency')} rate={r.get('request_rate')}: {r.get('output_throughput', 0):,.0f} out tok/s, "
            f"TTFT p50 {t.get('p50') or 0:.0f} p99 {t.get('p99') or 0:.0f} ms, TPOT p50 {p.get('p50') or 0:.1f} ms, "
            f"prefix hits {r.get('prefix_cache_hit_rate', float('nan')):.0%}")


def group_hfstatic(out: Path, anchors: str) -> list[dict]:
    rc, text = sh([PY, f"{anchors}/hf_generate_baseline.py", "--model", "llama8b", "--modes", "static",
                   "--batches", "32"], 400)
    (out / "hfstatic.txt").write_text(text)
    return [{"name": "hf static (anchors)", "rc": rc, "lines": [l for l in text.splitlines() if l.startswith("HFGEN")]}]


def group_gptfast(out: Path, anchors: str) -> list[dict]:
    rc, text = sh([PY, f"{anchors}/gptfast_decode_peer.py", "--batches", "1", "--modes", "compile", "--new-tokens",
                   "256", "--prompt-len", "128", "--samples", "3"], 480)
    (out / "gptfast.txt").write_text(text)
    return [{"name": "gpt-fast", "rc": rc, "lines": [l for l in text.splitlines() if l.startswith("GPTFAST")]}]


def group_lora(out: Path, anchors: str) -> list[dict]:
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


def group_spec(out: Path, anchors: str) -> list[dict]:
    """Speculative decoding on a V3-shaped model cut to fit (MLA with q_lora, noaux_tc MoE, one MTP layer) trained
    here for $SPEC_TRAIN_STEPS (default 300) steps on the bundled corpus with --mtp-layers 1, so that its drafts
    mean something, and exported: bench-infer at batch 1 (prompts from the corpus) without speculation, with
    --speculative mtp at K = 1, 2, 3, and with ngram on prompts that repeat a passage (against the same prompts
    without it): the accept rate, the time per output token and the speedup beside expected_speedup's; then the
    throughput of 32 and 128 concurrent requests with and without speculation."""
    import tempfile

    from paraseek.models.args import preset_config
    from paraseek.train.corpus import BUNDLED_CORPUS

    work = Path(tempfile.mkdtemp(prefix="spec-"))  # not under DIR: the device returns a few files only
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("groups")
    ap.add_argument("--out", required=True)
    ap.add_argument("--anchors", default=str(ROOT / ".anchors"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for g in a.groups.split(","):
        print(f"== {g}", flush=True)
        results += globals()[f"group_{g}"](out, a.anchors)
        (out / "summary.json").write_text(json.dumps(results, indent=1, default=str))  # kept if the run is cut short
    print("\n".join(row(r) for r in results), flush=True)


if __name__ == "__main__":
    main()
