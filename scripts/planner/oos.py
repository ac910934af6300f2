"""Out-of-sample check of the planner's torch.compile terms: compiled plans that no fit saw (other models, micro-batch
sizes, checkpointing modes, sequence lengths, gradient accumulation, tp and pp), predicted before they are measured.

    python scripts/planner/oos.py --write benchmarks/predictions/compiled-oos.json   # on any machine, no GPU
    python scripts/planner/oos.py --run benchmarks/predictions/compiled-oos.json --out DIR   # on nvidia-h200-x2
    python scripts/planner/oos.py --list 1gpu --write benchmarks/predictions/compiled-oos-1gpu.json   # one H200

--write prices every command of OOS with the planner exactly as `paraseek bench` does for its own prediction (the
command through train's parser and config, TrainConfig.to_plan, planner.evaluate on the datasheet H200 with
--nproc GPUs per node) and writes the commands and the predictions. --run runs each command from that file (the
commands as written, `{models}` replaced by a folder holding the v2lite14 config) and writes DIR/compiled-oos.json
with measured and predicted numbers and the errors side by side; a run that fails is recorded with its exit code.
About 1 minute per run (compile, 3 warm-up and 5 measured steps): about 12 minutes for all of them, or two runs of
`--only 0-5` and `--only 6-11`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

BENCH = "paraseek bench --json --device cuda --warmup 3 --steps 5 --seq-len {seq} --nproc {n}"
V2LITE14 = "{models}/v2lite14"  # DeepSeek-V2-Lite cut to 14 layers (config only, random init), as validate.py's
# (name, GPUs, seq, flags): none of these was measured compiled before the predictions were written.
OOS = [
    ("7b 1gpu none+compile mbs1 accum2", 1, 4096, "--model deepseek-llm-7b --global-batch-size 2 --micro-batch-size 1 "
     "--activation-checkpointing none --compile"),
    ("7b 1gpu none+compile mbs2 (the planner's 85% plan)", 1, 4096, "--model deepseek-llm-7b --global-batch-size 2 "
     "--micro-batch-size 2 --activation-checkpointing none --compile"),
    ("7b fsdp none+compile mbs1", 2, 4096, "--model deepseek-llm-7b --global-batch-size 2 --micro-batch-size 1 "
     "--activation-checkpointing none --compile"),
    ("7b fsdp full+compile mbs4", 2, 4096, "--model deepseek-llm-7b --global-batch-size 8 --micro-batch-size 4 "
     "--activation-checkpointing full --compile"),
    ("7b seq8192 fsdp selective+compile mbs1 zero2", 2, 8192, "--model deepseek-llm-7b --global-batch-size 2 "
     "--micro-batch-size 1 --activation-checkpointing selective --compile --reshard-after-forward false"),
    ("llama-8b fsdp selective+compile mbs2 accum2 zero2", 2, 4096, "--model deepseek-r1-distill-llama-8b "
     "--global-batch-size 8 --micro-batch-size 2 --activation-checkpointing selective --compile "
     "--reshard-after-forward false"),
    ("qwen-7b fsdp selective+compile mbs2 zero2", 2, 4096, "--model deepseek-r1-distill-qwen-7b --global-batch-size 4 "
     "--micro-batch-size 2 --activation-checkpointing selective --compile --reshard-after-forward false"),
    ("qwen-1.5b fsdp none+compile mbs4", 2, 4096, "--model deepseek-r1-distill-qwen-1.5b --global-batch-size 8 "
     "--micro-batch-size 4 --activation-checkpointing none --compile"),
    ("v2lite14 fsdp full+compile mbs2", 2, 4096, f"--model {V2LITE14} --global-batch-size 4 --micro-batch-size 2 "
     "--activation-checkpointing full --compile"),
    ("v2lite14 fsdp selective+compile mbs4 zero2", 2, 4096, f"--model {V2LITE14} --global-batch-size 8 "
     "--micro-batch-size 4 --activation-checkpointing selective --compile --reshard-after-forward false"),
    ("7b tp2 selective+compile mbs2", 2, 4096, "--model deepseek-llm-7b --global-batch-size 2 --micro-batch-size 2 "
     "--activation-checkpointing selective --compile --tp 2"),
    ("7b pp2 1F1B selective+compile mbs1", 2, 4096, "--model deepseek-llm-7b --global-batch-size 4 "
     "--micro-batch-size 1 --activation-checkpointing selective --compile --pp 2 --pp-schedule 1F1B"),
]


# One H200 (nvidia-h200): --plan auto runs beside the hand-picked flags (the 7B's hand-picked flags are the auto plan
# itself: `paraseek plan` ranks them first), then compiled runs of other shapes. Only the first (the 7B's mbs-2
# selective plan) was in a fit.
OOS_1GPU = [
    ("7b --plan auto gbs2 (= the hand-picked mbs2 selective+compile; in the fit)", 1, 4096,
     "--model deepseek-llm-7b --global-batch-size 2 --plan auto"),
    ("qwen-1.5b --plan auto gbs8 (mbs8 selective+compile)", 1, 4096,
     "--model deepseek-r1-distill-qwen-1.5b --global-batch-size 8 --plan auto"),
    ("qwen-1.5b hand gbs8 mbs4 none+compile", 1, 4096, "--model deepseek-r1-distill-qwen-1.5b --global-batch-size 8 "
     "--micro-batch-size 4 --activation-checkpointing none --compile"),
    ("v2lite6 --plan auto gbs4 (mbs4 selective+compile)", 1, 4096, "--model {models}/v2lite6 --global-batch-size 4 "
     "--plan auto"),
    ("v2lite6 hand gbs4 mbs2 none+compile (the best measured v2lite6 flags, accum 2)", 1, 4096,
     "--model {models}/v2lite6 --global-batch-size 4 --micro-batch-size 2 --activation-checkpointing none --compile"),
    ("llama-8b 16 layers seq8192 selective+compile mbs1", 1, 8192, "--model {models}/llama8b16 --global-batch-size 1 "
     "--micro-batch-size 1 --activation-checkpointing selective --compile"),
    ("llama-8b 16 layers selective+compile mbs2", 1, 4096, "--model {models}/llama8b16 --global-batch-size 2 "
     "--micro-batch-size 2 --activation-checkpointing selective --compile"),
    ("qwen-7b 14 layers selective+compile mbs2", 1, 4096, "--model {models}/qwen7b14 --global-batch-size 2 "
     "--micro-batch-size 2 --activation-checkpointing selective --compile"),
    ("qwen-1.5b seq8192 none+compile mbs2", 1, 8192, "--model deepseek-r1-distill-qwen-1.5b --global-batch-size 2 "
     "--micro-batch-size 2 --activation-checkpointing none --compile"),
]


def compiled(name: str, seq: int, model: str, gbs: int, mbs: int, ac: str) -> tuple[str, int, int, str]:
    """A compiled 1-GPU run of the later sets, as the lists hold it: (name, GPUs, seq, flags)."""
    return (name, 1, seq, f"--model {model} --global-batch-size {gbs} --micro-batch-size {mbs} "
                          f"--activation-checkpointing {ac} --compile")


# One H200 again (2026-12-02), after GEMM_HALF_K was fitted on the runs above: shapes, sequence lengths and
# micro-batches none of the fits saw, the same models cut to other depths, --plan auto at other batches.
OOS_1GPU_B = [
    compiled("7b seq2048 mbs4 selective+compile", 2048, "deepseek-llm-7b", 4, 4, "selective"),
    compiled("7b 12 layers mbs2 none+compile", 4096, "{models}/ds7b12", 2, 2, "none"),
    compiled("qwen-1.5b seq2048 mbs8 none+compile", 2048, "deepseek-r1-distill-qwen-1.5b", 8, 8, "none"),
    compiled("qwen-1.5b mbs2 none+compile gbs2", 4096, "deepseek-r1-distill-qwen-1.5b", 2, 2, "none"),
    ("qwen-1.5b seq8192 --plan auto gbs4", 1, 8192, "--model deepseek-r1-distill-qwen-1.5b --global-batch-size 4 "
     "--plan auto"),
    compiled("qwen-7b 14 layers seq8192 mbs1 selective+compile", 8192, "{models}/qwen7b14", 1, 1, "selective"),
    compiled("llama-8b 12 layers mbs2 none+compile", 4096, "{models}/llama8b12", 2, 2, "none"),
    compiled("v2lite8 mbs2 selective+compile", 4096, "{models}/v2lite8", 2, 2, "selective"),
    compiled("v2lite6 seq8192 mbs1 none+compile", 8192, "{models}/v2lite6", 2, 1, "none"),
]
# A third set (2026-12-02, no planner change since the second): its memory criterion is named as the planner's items
# (its total less the CUDA context and the allocator's fragmentation) against max_memory_allocated.
OOS_1GPU_C = [
    compiled("7b seq1024 mbs8 selective+compile", 1024, "deepseek-llm-7b", 8, 8, "selective"),
    compiled("7b 16 layers mbs2 none+compile", 4096, "{models}/ds7b16", 2, 2, "none"),
    compiled("qwen-1.5b mbs6 none+compile", 4096, "deepseek-r1-distill-qwen-1.5b", 6, 6, "none"),
    compiled("qwen-1.5b seq16384 mbs1 selective+compile", 16384, "deepseek-r1-distill-qwen-1.5b", 1, 1, "selective"),
    compiled("qwen-7b 10 layers mbs2 none+compile", 4096, "{models}/qwen7b10", 2, 2, "none"),
    compiled("qwen-7b 14 layers seq2048 mbs4 none+compile", 2048, "{models}/qwen7b14", 4, 4, "none"),
    compiled("llama-8b 16 layers seq2048 mbs4 selective+compile", 2048, "{models}/llama8b16", 4, 4, "selective"),
    compiled("v2lite4 mbs4 none+compile", 4096, "{models}/v2lite4", 4, 4, "none"),
    compiled("v2lite10 mbs1 selective+compile gbs2", 4096, "{models}/v2lite10", 2, 1, "selective"),
]
# A fourth set, written after the memory model split the head's backward from the blocks' (memory.py: head_backward)
# and before any of it ran; the criterion as the third's.
OOS_1GPU_D = [
    compiled("7b 24 layers mbs2 selective+compile", 4096, "{models}/ds7b24", 2, 2, "selective"),
    compiled("7b 8 layers mbs4 none+compile", 4096, "{models}/ds7b8", 4, 4, "none"),
    compiled("qwen-1.5b mbs4 none+compile gbs4", 4096, "deepseek-r1-distill-qwen-1.5b", 4, 4, "none"),
    compiled("qwen-1.5b seq2048 mbs16 selective+compile", 2048, "deepseek-r1-distill-qwen-1.5b", 16, 16, "selective"),
    compiled("qwen-7b 14 layers mbs1 none+compile gbs2", 4096, "{models}/qwen7b14", 2, 1, "none"),
    compiled("llama-8b 8 layers mbs4 none+compile", 4096, "{models}/llama8b8", 4, 4, "none"),
    compiled("llama-8b 16 layers seq8192 mbs1 none+compile", 8192, "{models}/llama8b16", 1, 1, "none"),
    compiled("v2lite6 mbs2 selective+compile gbs2", 4096, "{models}/v2lite6", 2, 2, "selective"),
    compiled("v2lite12 mbs1 none+compile", 4096, "{models}/v2lite12", 1, 1, "none"),
]
# A fifth set (2026-12-03), no planner change since the fourth: its criterion as the third's. Three MoE runs
# without checkpointing at 4,096 tokens or fewer a step, the regime of the fourth set's one miss (V2-Lite cut to 12
# layers at micro-batch 1, host-bound), beside dense shapes, depths and micro-batches no set has run.
OOS_1GPU_E = [
    compiled("7b 20 layers mbs2 none+compile", 4096, "{models}/ds7b20", 2, 2, "none"),
    compiled("7b mbs1 selective+compile gbs1", 4096, "deepseek-llm-7b", 1, 1, "selective"),
    compiled("qwen-1.5b mbs3 selective+compile gbs3", 4096, "deepseek-r1-distill-qwen-1.5b", 3, 3, "selective"),
    compiled("qwen-1.5b seq8192 mbs1 none+compile", 8192, "deepseek-r1-distill-qwen-1.5b", 1, 1, "none"),
    compiled("qwen-7b 12 layers mbs2 selective+compile", 4096, "{models}/qwen7b12", 2, 2, "selective"),
    compiled("llama-8b 10 layers mbs3 none+compile", 4096, "{models}/llama8b10", 3, 3, "none"),
    compiled("v2lite8 mbs1 none+compile", 4096, "{models}/v2lite8", 1, 1, "none"),
    compiled("v2lite10 mbs2 none+compile", 4096, "{models}/v2lite10", 2, 2, "none"),
    compiled("v2lite12 seq2048 mbs2 none+compile", 2048, "{models}/v2lite12", 2, 2, "none"),
]
# A sixth set (2026-12-03), no planner change since the fourth, written after the fifth set's MoE misses were traced
# to a fresh compile's slower host (FSDP2's reduce-scatter copy-in) and before any of it ran; the criterion as
# the third's. Shapes, depths and micro-batches no set has run, two MoE runs without checkpointing among them.
OOS_1GPU_F = [
    compiled("7b 12 layers mbs4 selective+compile", 4096, "{models}/ds7b12", 4, 4, "selective"),
    compiled("7b 16 layers seq2048 mbs4 selective+compile", 2048, "{models}/ds7b16", 4, 4, "selective"),
    compiled("qwen-1.5b mbs5 none+compile", 4096, "deepseek-r1-distill-qwen-1.5b", 5, 5, "none"),
    compiled("qwen-7b 10 layers seq8192 mbs1 none+compile", 8192, "{models}/qwen7b10", 1, 1, "none"),
    compiled("llama-8b 12 layers mbs2 selective+compile", 4096, "{models}/llama8b12", 2, 2, "selective"),
    compiled("llama-8b 8 layers seq2048 mbs8 none+compile", 2048, "{models}/llama8b8", 8, 8, "none"),
    compiled("v2lite6 mbs4 selective+compile", 4096, "{models}/v2lite6", 4, 4, "selective"),
    compiled("v2lite10 mbs1 none+compile", 4096, "{models}/v2lite10", 1, 1, "none"),
    compiled("v2lite8 seq2048 mbs4 none+compile", 2048, "{models}/v2lite8", 4, 4, "none"),
]
LISTS = {"2gpu": OOS, "1gpu": OOS_1GPU, "1gpu-b": OOS_1GPU_B, "1gpu-c": OOS_1GPU_C, "1gpu-d": OOS_1GPU_D,
         "1gpu-e": OOS_1GPU_E, "1gpu-f": OOS_1GPU_F}
CUTS = {  # name -> (preset, layers): the configs of models_folder
    "ds7b8": ("deepseek-llm-7b", 8), "ds7b12": ("deepseek-llm-7b", 12), "ds7b16": ("deepseek-llm-7b", 16),
    "ds7b20": ("deepseek-llm-7b", 20), "ds7b24": ("deepseek-llm-7b", 24),
    "llama8b8": ("deepseek-r1-distill-llama-8b", 8), "llama8b10": ("deepseek-r1-distill-llama-8b", 10),
    "llama8b12": ("deepseek-r1-distill-llama-8b", 12),
    "llama8b16": ("deepseek-r1-distill-llama-8b", 16),
    "qwen7b10": ("deepseek-r1-distill-qwen-7b", 10), "qwen7b12": ("deepseek-r1-distill-qwen-7b", 12),
    "qwen7b14": ("deepseek-r1-distill-qwen-7b", 14),
    "v2lite4": ("deepseek-v2-lite", 4), "v2lite6": ("deepseek-v2-lite", 6), "v2lite8": ("deepseek-v2-lite", 8),
    "v2lite10": ("deepseek-v2-lite", 10), "v2lite12": ("deepseek-v2-lite", 12), "v2lite14": ("deepseek-v2-lite", 14),
}


def models_folder(root: Path) -> Path:
    """A folder of configs (random init) of presets cut to fewer layers (CUTS), as validate.py writes them."""
    from paraseek.models.args import preset_config

    for name, (preset, layers) in CUTS.items():
        path = root / name
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({**preset_config(preset), "num_hidden_layers": layers}, indent=1))
    return root


def command(n: int, seq: int, flags: str) -> str:
    return f"{BENCH.format(seq=seq, n=n)} {flags}"


def predict(cmd: str, models: Path) -> dict:
    """The planner's prediction for a bench command, as bench computes it (train/launch.py: _predict) on H200s."""
    from paraseek.cli import build_parser
    from paraseek.models import resolve_model
    from paraseek.planner import evaluate, make_cluster
    from paraseek.train.config import resolve_defaults
    from paraseek.train.flags import from_namespace
    from paraseek.train.validate import validate

    argv = shlex.split(cmd.replace("{models}", str(models)))
    ns = build_parser().parse_args(argv[1:])
    cfg = resolve_defaults(from_namespace(ns), cuda_available=True, gpu_count=ns.nproc)
    args = resolve_model(cfg.model)[0]
    cluster = make_cluster("H200", cfg.world_size, gpus_per_node=cfg.nproc)
    if cfg.plan == "auto":  # what train/launch.py: apply_auto_plan picks on an H200
        from paraseek.planner import best_plan

        cfg = cfg.with_plan(best_plan(args, cluster, cfg.seq_len, cfg.global_batch_size,
                                      document_mask=cfg.doc_mask == "true", fp8=cfg.fp8,
                                      fp8_experts=cfg.fp8_experts == "on", lora=cfg.lora_for(args)).plan)
    validate(cfg, cuda_available=True, gpu_count=ns.nproc)
    ev = evaluate(args, cluster, cfg.to_plan(), cfg.seq_len, cfg.global_batch_size)
    return {"plan": " ".join(cfg.to_plan().flags()), "fits": not ev.reason, "tight": ev.tight, "memory_gib": round(ev.memory.total / 2**30, 2),
            "step_time_s": round(ev.time.total, 4) if ev.time else None,
            "tokens_per_s_per_gpu": round(ev.tokens_per_s_per_gpu, 1),
            "memory_breakdown_gib": {k: round(v / 2**30, 3) for k, v in ev.memory.items.items() if v},
            "step_time_breakdown_s": {k: round(v, 4) for k, v in ev.time.items.items() if v} if ev.time else {}}


def write(path: Path, which: str) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "src"], capture_output=True, text=True, cwd=ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        models = models_folder(Path(tmp))
        runs = [{"name": name, "gpus": n, "command": command(n, seq, flags),
                 "predicted": predict(command(n, seq, flags), models)} for name, n, seq, flags in LISTS[which]]
    doc = {"what": "planner predictions for compiled runs outside every fit (scripts/planner/compiled_fit.py), "
                   "written before they ran; check them with scripts/planner/oos.py --run",
           "written": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "planner_commit": commit.stdout.strip() + ("+uncommitted" if dirty.stdout.strip() else ""),
           "machine": "nvidia-h200-x2 (2x H200, 2 GPUs per node; the 1-GPU runs use one of them)" if which == "2gpu"
           else "nvidia-h200 (one H200)",
           "measured_memory": "torch.cuda.max_memory_allocated, against the planner's total as BENCHMARKS.md compares"
           if which == "1gpu" else "the criterion: the planner's total less the CUDA context against "
           "torch.cuda.max_memory_reserved (the allocator's peak holdings: what an OOM is decided on); also reported: "
           "the planner's items without context and fragmentation against max_memory_allocated" if which == "1gpu-b"
           else "the criterion: the planner's items (its total less the CUDA context and the allocator's "
           "fragmentation) against torch.cuda.max_memory_allocated; also reported: the total less the context against "
           "max_memory_reserved",
           "models": "{models}/NAME: a preset's config cut to fewer layers (oos.py: CUTS, written by --run)",
           "runs": runs}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    for r in runs:
        p = r["predicted"]
        print(f"{r['name']}: predicted {p['memory_gib']:.1f} GiB, step {p['step_time_s']} s, "
              f"{p['tokens_per_s_per_gpu']:,.0f} tok/s/GPU{' (above the headroom)' if p['tight'] else ''}")


def run(path: Path, out: Path, only: str) -> None:
    doc = json.loads(path.read_text())
    lo, hi = (int(x) for x in only.split("-")) if only else (0, len(doc["runs"]) - 1)
    out.mkdir(parents=True, exist_ok=True)
    models = models_folder(out / "models")
    deadline = time.time() + float(os.environ.get("OOS_DEADLINE_S", "1e9"))  # a time limit: keep what ran
    results = []
    for i, r in enumerate(doc["runs"]):
        if not lo <= i <= hi:
            continue
        argv = [sys.executable, "-m", "paraseek", *shlex.split(r["command"].replace("{models}", str(models)))[1:]]
        t0 = time.time()
        if t0 > deadline - 30:
            print(f"skipped (the call's deadline): {r['name']}", flush=True)
            continue
        try:
            p = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=deadline - t0,
                               env={**os.environ, "NCCL_NVLS_ENABLE": "0", "PYTHONPATH": str(ROOT / "src")})
        except subprocess.TimeoutExpired:
            print(f"cut at the call's deadline: {r['name']}", flush=True)
            continue
        m = re.search(r'^\{\s*"runs".*', p.stdout, re.S | re.M)
        measured = json.loads(p.stdout[m.start():p.stdout.rindex("}") + 1])["runs"][-1] if p.returncode == 0 and m \
            else {}
        row = {"name": r["name"], "rc": p.returncode, "seconds": round(time.time() - t0), "predicted": r["predicted"]}
        if measured:
            pred = r["predicted"]
            row["measured"] = {k: measured.get(k) for k in ("step_time_s", "tokens_per_s_per_gpu", "mem_peak_gib",
                                                            "mem_peak_reserved_gib", "mfu", "micro_batch_size",
                                                            "activation_checkpointing",
                                                            "compile")}
            row["step_time_error"] = pred["step_time_s"] / measured["step_time_s"] - 1 if pred["step_time_s"] else None
            row["memory_error"] = pred["memory_gib"] / measured["mem_peak_gib"] - 1
            # like for like: max_memory_allocated counts neither the CUDA context nor the allocator's fragmentation
            allocated = pred["memory_gib"] - sum(pred["memory_breakdown_gib"].get(k, 0.0)
                                                 for k in ("cuda_context", "allocator_overhead"))
            row["memory_error_allocated"] = allocated / measured["mem_peak_gib"] - 1
            # the allocator's view: the planner's total less the CUDA context against max_memory_reserved
            if measured.get("mem_peak_reserved_gib"):
                held = pred["memory_gib"] - pred["memory_breakdown_gib"].get("cuda_context", 0.0)
                row["memory_error_reserved"] = held / measured["mem_peak_reserved_gib"] - 1
        else:
            row["tail"] = (p.stdout + p.stderr)[-2000:]
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "tail"}), flush=True)
        (out / "compiled-oos.json").write_text(json.dumps(results, indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", metavar="FILE.json", help="price the OOS commands and write them with the predictions")
    p.add_argument("--run", metavar="FILE.json", help="run the commands of a predictions file (GPU machine)")
    p.add_argument("--out", default="/tmp/compiled-oos", help="with --run: where the results go")
    p.add_argument("--only", default="", help="with --run: a range of run indices, e.g. 0-5")
    p.add_argument("--list", default="2gpu", choices=sorted(LISTS), help="with --write: which runs (default 2gpu)")
    a = p.parse_args()
    if a.write:
        write(Path(a.write), a.list)
    elif a.run:
        run(Path(a.run), Path(a.out), a.only)
    else:
        p.error("give --write FILE.json or --run FILE.json")


if __name__ == "__main__":
    main()
