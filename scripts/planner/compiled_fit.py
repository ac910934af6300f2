"""The planner's torch.compile terms against every measured compiled run (docs/planner.md, "torch.compile").

    python scripts/planner/compiled_fit.py                 # the errors of planner/cost.py's constants, run by run
    python scripts/planner/compiled_fit.py --fit           # refit COMPILE_GEMM_GAIN, COMPILE_ELEM_TRAFFIC and
                                                           # COMPILE_SINGLE_RANK on the 'fit' runs (grid search)
    python scripts/planner/compiled_fit.py --fit-width     # refit GEMM_HALF_K (the linears' width term) alone

The out-of-sample predictions for runs not measured yet: scripts/planner/oos.py.

RUNS holds every compiled `paraseek bench` run recorded in benchmarks/2026-11-30/*.json (and one 1-GPU run of
the 7B whose raw output is not kept, ONE_GPU_7B), read from the JSON files, then the 9 runs of
benchmarks/2026-12-01/compiled-oos-1gpu-measured.json (the out-of-sample check of 2026-12-01, fitted on since:
GEMM_HALF_K), each marked with its use:
  fit       the current engine (since e11229f: the loss compiled, the gradient clip folded into the fused AdamW);
  held-out  before e11229f, priced as that engine ran (the loss eager, the clip a pass of its own over the
            gradients), and not used in the fit: the out-of-sample check of the fitted terms;
  excluded  with the reason (memory-bound runs, an attention kernel the engine no longer runs, --loss-chunks).
Measured memory is torch.cuda.max_memory_allocated; the planner's total is compared with it as BENCHMARKS.md does.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from paraseek.models.args import ModelArgs, preset_config  # noqa: E402
from paraseek.planner import Plan, evaluate, make_cluster  # noqa: E402
from paraseek.planner import cost, memory  # noqa: E402

DATA = ROOT / "benchmarks" / "2026-11-30"
PRE = "before e11229f"
# (file, group, index in the group, index in its "runs" list, engine, use)
RUNS = [
    ("train-llama8b-7b-vs-hf-fsdp2.json", "final", 1, 0, "current", "fit"),
    ("train-llama8b-7b-vs-hf-fsdp2.json", "final", 3, 0, "current", "fit"),
    ("train-v2lite14-mbs4-vs-hf-fsdp2.json", "v2lite_mbs4", 1, 0, "current", "fit"),
    ("one-gpu 7b", None, None, None, "current", "fit"),
    ("train-llama8b-compiled-and-profiles.json", "llama", 1, 0, PRE, "held-out"),
    ("train-llama8b-compiled-and-profiles.json", "llama", 2, 0, PRE, "held-out"),
    ("train-llama8b-zero2-7b-scaling-long-sequences.json", "llama_zero2", 0, 0, PRE, "held-out"),
    ("train-llama8b-zero2-7b-scaling-long-sequences.json", "scale", 0, 0, PRE, "held-out"),
    ("train-llama8b-zero2-7b-scaling-long-sequences.json", "scale", 0, 1, PRE, "held-out"),
    ("train-llama8b-7b-near-memory-limit.json", "push", 2, 1, PRE, "held-out"),
    ("train-v2lite14-zero2-and-ep2.json", "v2lite_push", 0, 0, PRE, "held-out"),
    ("train-v2lite14-zero2-and-ep2.json", "v2lite_push", 1, 0, PRE, "held-out"),
    ("train-v2lite14-zero2-and-ep2.json", "v2lite_push", 2, 0, PRE, "held-out"),
    ("train-v2lite14-zero2-and-ep2.json", "v2lite_push", 3, 0, PRE, "held-out"),
    ("train-v2lite14-vs-hf-fsdp2-and-7b-weak-scaling.json", "v2lite", 1, 0, PRE, "held-out"),
    ("train-v2lite14-vs-hf-fsdp2-and-7b-weak-scaling.json", "v2lite", 3, 0, PRE, "held-out"),
    ("train-v2lite14-vs-hf-fsdp2-and-7b-weak-scaling.json", "weak", 0, 0, PRE, "held-out"),
    ("train-v2lite14-vs-hf-fsdp2-and-7b-weak-scaling.json", "weak", 0, 1, PRE, "held-out"),
    ("train-llama8b-loss-chunks.json", "loss_chunks", 0, 0, PRE, "held-out"),
    ("train-llama8b-7b-near-memory-limit.json", "push", 0, 0, PRE,
     "excluded: memory-bound (131.9 GiB allocated, 29% below mbs 2)"),
    ("train-llama8b-7b-near-memory-limit.json", "push", 1, 0, PRE, "excluded: memory-bound (133.9 GiB allocated)"),
    ("train-llama8b-7b-near-memory-limit.json", "push", 2, 0, PRE,
     "excluded: memory-bound, and --reshard-after-forward false still kept a second bf16 copy on one GPU then "
     "(ignored with one data-parallel rank since)"),
    ("train-v2lite14-padded-mla-attention.json", "v2lite", 1, 0, PRE,
     "excluded: MLA's v zero-padded to 192 (dropped since)"),
    ("train-v2lite14-padded-mla-attention.json", "v2lite", 2, 0, PRE,
     "excluded: MLA's v zero-padded to 192 (dropped since)"),
    ("train-v2lite14-padded-mla-attention.json", "v2lite", 3, 0, PRE,
     "excluded: MLA's v zero-padded to 192 (dropped since)"),
    ("train-llama8b-loss-chunks.json", "loss_chunks", 1, 0, PRE, "excluded: --loss-chunks (not priced)"),
    ("train-llama8b-loss-chunks.json", "loss_chunks", 2, 0, PRE, "excluded: --loss-chunks (not priced)"),
]
# `paraseek bench` on one H200 (nvidia-h200), deepseek-llm-7b, seq 4096, global batch 2, mbs 2,
# --activation-checkpointing selective --compile: 12,455 tokens/s/GPU at 106.2 GiB (its console output; no raw file).
ONE_GPU_7B = {"name": "7b 1gpu selective+compile mbs2", "gpus": 1, "model": "deepseek-llm-7b",
            "seq_len": 4096, "global_batch_size": 2, "micro_batch_size": 2, "dp_replicate": 1, "dp_shard": 1,
            "tp": 1, "ep": 1, "pp": 1, "activation_checkpointing": "selective", "compile": True,
            "step_time_s": 2 * 4096 / 12455, "mem_peak_gib": 106.2}
FITTED = ("COMPILE_GEMM_GAIN", "COMPILE_ELEM_TRAFFIC", "COMPILE_SINGLE_RANK")
OOS_1GPU = ROOT / "benchmarks" / "2026-12-01" / "compiled-oos-1gpu-measured.json"


def load_oos_1gpu() -> list[dict]:
    """The first set of 1-GPU out-of-sample runs as fit runs: the model and sequence length from oos.py's list, the plan
    from the flags the run was predicted with (--plan auto's pick included)."""
    sys.path.insert(0, str(ROOT / "scripts" / "planner"))
    import oos

    spec = {name: (seq, flags) for name, _, seq, flags in oos.OOS_1GPU}
    runs = []
    for row in json.loads(OOS_1GPU.read_text()):
        seq, flags = spec[row["name"]]
        argv = shlex.split(flags + " " + row["predicted"]["plan"])
        flag = {k: v for k, v in zip(argv, argv[1:], strict=False) if k.startswith("--")}
        model = flag["--model"].removeprefix("{models}/")
        runs.append({"name": row["name"], "gpus": 1, "model": oos.CUTS.get(model, model), "seq_len": seq,
                     "global_batch_size": int(flag["--global-batch-size"]),
                     "micro_batch_size": int(flag["--micro-batch-size"]), "dp_replicate": 1, "dp_shard": 1, "tp": 1,
                     "ep": 1, "pp": 1, "activation_checkpointing": flag["--activation-checkpointing"],
                     "compile": "--compile" in argv, "reshard_after_forward": True,
                     "step_time_s": row["measured"]["step_time_s"], "mem_peak_gib": row["measured"]["mem_peak_gib"],
                     "source": OOS_1GPU.name, "engine": "current", "use": "fit"})
    return runs


def load(spec: tuple) -> dict:
    file, group, i, j, engine, use = spec
    if file == "one-gpu 7b":
        run = dict(ONE_GPU_7B)
    else:
        row = json.loads((DATA / file).read_text())[group][i]
        run = dict((row.get("runs") or [row])[j])
        run["name"] = row["name"]
    # validate.py names the runs with --reshard-after-forward false "zero2" (bench's JSON has no field for it)
    run.update(source=file, engine=engine, use=use, reshard_after_forward="zero2" not in run["name"])
    return run


def model_args(name: str | tuple[str, int]) -> ModelArgs:
    if isinstance(name, tuple):  # oos.py's CUTS: (preset, layers)
        return ModelArgs.from_hf_config({**preset_config(name[0]), "num_hidden_layers": name[1]})
    if name.endswith("v2lite14"):  # validate.py's DeepSeek-V2-Lite cut to 14 layers (the HF + FSDP2 baseline's shape)
        return ModelArgs.from_hf_config({**preset_config("deepseek-v2-lite"), "num_hidden_layers": 14})
    return ModelArgs.from_hf_config(preset_config(name))


@contextlib.contextmanager
def engine(version: str):
    """Price as the engine of `version` ran: before e11229f the loss was eager under --compile and the clip read
    and wrote every gradient (OPTIM_BYTES was 48)."""
    saved = (memory.COMPILED_LOSS_BYTES_PER_LOGIT, memory.COMPILED_LOGIT_GRAD_BYTES, cost.COMPILED_LOSS_TRAFFIC,
             cost.OPTIM_BYTES)
    if version == PRE:
        memory.COMPILED_LOSS_BYTES_PER_LOGIT, memory.COMPILED_LOGIT_GRAD_BYTES = (memory.LOSS_BYTES_PER_LOGIT,
                                                                                 memory.LOGIT_GRAD_BYTES)
        cost.COMPILED_LOSS_TRAFFIC, cost.OPTIM_BYTES = cost.LOSS_TRAFFIC, 48.0
    try:
        yield
    finally:
        (memory.COMPILED_LOSS_BYTES_PER_LOGIT, memory.COMPILED_LOGIT_GRAD_BYTES, cost.COMPILED_LOSS_TRAFFIC,
         cost.OPTIM_BYTES) = saved


def plan_of(run: dict) -> Plan:
    return Plan(dp_replicate=run["dp_replicate"], dp_shard=run["dp_shard"], tp=run["tp"], ep=run["ep"],
                micro_batch_size=run["micro_batch_size"], activation_checkpointing=run["activation_checkpointing"],
                reshard_after_forward=run["reshard_after_forward"], compile=run["compile"])


def predict(run: dict):
    # validate.py ran on nvidia-h200-x2 (2 GPUs per node), the one-GPU 7B run on nvidia-h200
    cluster = make_cluster("H200", run["gpus"], gpus_per_node=run["gpus"])
    with engine(run["engine"]):
        return evaluate(model_args(run["model"]), cluster, plan_of(run), run["seq_len"], run["global_batch_size"])


def errors(runs: list[dict]) -> list[tuple[dict, float, float]]:
    """(run, step-time error, memory error), prediction / measurement - 1."""
    out = []
    for run in runs:
        ev = predict(run)
        out.append((run, ev.time.total / run["step_time_s"] - 1, ev.memory.total / 2**30 / run["mem_peak_gib"] - 1))
    return out


def rms(xs: list[float]) -> float:
    return math.sqrt(sum(x * x for x in xs) / len(xs)) if xs else 0.0


def fit(runs: list[dict]) -> dict:
    """Least squares on log(predicted / measured step time) over the fit runs: a grid, refined twice around its best."""
    lo = {"COMPILE_GEMM_GAIN": 1.0, "COMPILE_ELEM_TRAFFIC": 0.0, "COMPILE_SINGLE_RANK": 0.5}
    hi = {"COMPILE_GEMM_GAIN": 1.6, "COMPILE_ELEM_TRAFFIC": 7.0, "COMPILE_SINGLE_RANK": 2.0}
    saved = {k: getattr(cost, k) for k in FITTED}
    best = None
    try:
        for _ in range(3):
            axes = [[lo[k] + (hi[k] - lo[k]) * i / 12 for i in range(13)] for k in FITTED]
            for values in itertools.product(*axes):
                for k, v in zip(FITTED, values, strict=True):
                    setattr(cost, k, v)
                loss = sum(math.log(1 + t) ** 2 for _, t, _ in errors(runs))
                if best is None or loss < best[0]:
                    best = (loss, dict(zip(FITTED, values, strict=True)))
            for k in FITTED:  # a finer grid around the best
                step = (hi[k] - lo[k]) / 12
                lo[k], hi[k] = max(lo[k], best[1][k] - 2 * step), min(hi[k], best[1][k] + 2 * step)
    finally:
        for k, v in saved.items():
            setattr(cost, k, v)
    return best[1]


def fit_width(runs: list[dict]) -> float:
    """Least squares on log(predicted / measured step time) over the fit runs for GEMM_HALF_K, every 25 up to 1,000."""
    saved, best = cost.GEMM_HALF_K, None
    try:
        for k in range(0, 1001, 25):
            cost.GEMM_HALF_K = float(k)
            loss = sum(math.log(1 + t) ** 2 for _, t, _ in errors(runs))
            if best is None or loss < best[0]:
                best = (loss, float(k))
    finally:
        cost.GEMM_HALF_K = saved
    return best[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fit", action="store_true", help="refit the compile constants on the 'fit' runs")
    p.add_argument("--fit-width", action="store_true", help="refit GEMM_HALF_K alone on the 'fit' runs")
    ns = p.parse_args()
    runs = [load(s) for s in RUNS] + load_oos_1gpu()
    if ns.fit_width:
        cost.GEMM_HALF_K = fit_width([r for r in runs if r["use"] == "fit"])
        print(f"fitted: GEMM_HALF_K = {cost.GEMM_HALF_K}")
    if ns.fit:
        best = fit([r for r in runs if r["use"] == "fit"])
        print("fitted: " + ", ".join(f"{k} = {v:.4f}" for k, v in best.items()))
        for k, v in best.items():
            setattr(cost, k, v)
    print("constants: " + ", ".join(f"{k} = {getattr(cost, k)}" for k in (*FITTED, "GEMM_HALF_K")))
    rows = errors([r for r in runs if not r["use"].startswith("excluded")])
    for use in ("fit", "held-out"):
        sel = [(r, t, m) for r, t, m in rows if r["use"] == use]
        print(f"\n{use} ({len(sel)} runs): step time RMS {rms([t for _, t, _ in sel]):.1%}, "
              f"memory RMS {rms([m for _, _, m in sel]):.1%}")
        for r, t, m in sel:
            print(f"  {r['source'][:22]:22s} {r['name'][:52]:52s} {r['gpus']} GPU  step {t:+6.1%}  memory {m:+6.1%}")
    print("\nexcluded:")
    for r in runs:
        if r["use"].startswith("excluded"):
            print(f"  {r['source'][:22]:22s} {r['name'][:52]:52s} {r['use'][10:]}")


if __name__ == "__main__":
    main()
