"""Benchmark = the training engine itself on synthetic tokens: warm-up steps, then the median of the measured steps,
per GPU count for weak scaling (the per-GPU batch stays fixed, the global batch grows with the GPUs).
`--calibrate` instead measures the rates the planner prices work at (bench/calibrate.py) into a hardware profile."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

from paraseek.errors import UserError, check_plot


def register(subparsers: argparse._SubParsersAction) -> None:
    from paraseek.train.flags import add_arguments

    p = subparsers.add_parser(
        "bench", help="measure tokens/s/GPU, MFU, memory and weak scaling of a plan (synthetic data)",
        description="Run `paraseek train` on synthetic tokens for --warmup + --steps steps and report the median of "
        "the measured steps: tokens/s/GPU, MFU, peak memory, and the planner's prediction (on known GPUs). "
        "--scaling 1,2,... repeats it per GPU count with the per-GPU batch fixed (weak scaling). Takes every "
        "`paraseek train` flag for the plan.",
    )
    add_arguments(p)
    p.add_argument("--warmup", type=int, default=3, help="steps not measured (default 3)")
    p.add_argument("--scaling", metavar="N,N,...", help="GPU (process) counts for weak scaling, e.g. 1,2")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--plot", metavar="FILE.png", help="with --scaling: throughput and efficiency vs GPUs (matplotlib)")
    p.add_argument("--calibrate", action="store_true",
                   help="instead of a run: measure GEMM, attention, grouped-GEMM and memory rates on GPU 0 (and, "
                   "without --hardware, the links as `paraseek doctor` does) into the profile the planner reads")
    p.add_argument("--save", metavar="PROFILE.json",
                   help="with --calibrate: write the profile here (default: add the calibration to --hardware)")
    p.add_argument("--serve", metavar="URL", help="instead of a training run: load the OpenAI-compatible server at "
                   "URL and report TTFT, TPOT, ITL and throughput; the same as `paraseek bench-serve URL` and its "
                   "flags (see `paraseek bench-serve --help`)")
    p.set_defaults(func=run_bench)


def serve_alias(argv: list[str]) -> list[str]:
    """`paraseek bench --serve URL FLAGS` (vLLM's spelling, as in `vllm bench serve`) as `paraseek bench-serve
    URL FLAGS`; any other command line unchanged."""
    if not argv or argv[0] != "bench":
        return argv
    rest = argv[1:]
    for i, arg in enumerate(rest):
        if arg == "--serve" and i + 1 < len(rest):
            return ["bench-serve", rest[i + 1], *rest[:i], *rest[i + 2:]]
        if arg.startswith("--serve="):
            return ["bench-serve", arg.split("=", 1)[1], *rest[:i], *rest[i + 1:]]
    return argv


def _counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--scaling {text!r}: expected comma-separated process counts such as 1,2,4") from None
    if not counts or min(counts) <= 0:
        raise UserError(f"--scaling {text!r}: counts must be positive")
    return sorted(set(counts))


@contextlib.contextmanager
def _stdout_to_stderr(active: bool) -> Iterator[None]:
    """--json: stdout carries one document; what runs meanwhile (workers inherit fd 1, NCCL_DEBUG prints to it)
    writes to stderr instead."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _measure(cfg, warmup: int, workdir: Path, quiet_stdout: bool) -> dict[str, Any]:
    from paraseek.train.launch import prepare, launch

    jsonl = workdir / f"bench-{cfg.nproc}.jsonl"
    cfg = dataclasses.replace(cfg, data="synthetic", steps=warmup + cfg.steps, metrics_jsonl=str(jsonl),
                              run_dir=str(workdir / f"run-{cfg.nproc}"), checkpoint_dir="", export_hf="",
                              tensorboard="")
    cfg, predicted = prepare(cfg, with_prediction=True)
    with _stdout_to_stderr(quiet_stdout):
        rc = launch(cfg)
    if rc != 0:
        raise UserError(f"the benchmark run on {cfg.nproc} process(es) failed (its message is above)")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    steps = [r for r in rows if "event" not in r and r["step"] > warmup]
    median = statistics.median
    mfus = [r["mfu"] for r in steps if r.get("mfu") is not None]
    return {
        "gpus": cfg.world_size, "model": cfg.init_from or cfg.model, "seq_len": cfg.seq_len,
        "global_batch_size": cfg.global_batch_size, "micro_batch_size": cfg.micro_batch_size,
        "dp_replicate": cfg.dp_replicate, "dp_shard": cfg.dp_shard, "tp": cfg.tp, "ep": cfg.ep, "pp": cfg.pp,
        "pp_schedule": cfg.pp_schedule if cfg.pp > 1 else "none",
        "activation_checkpointing": cfg.activation_checkpointing, "compile": cfg.compile, "precision": cfg.precision,
        "measured_steps": len(steps),
        "step_time_s": median(r["step_time_s"] for r in steps),
        "tokens_per_s_per_gpu": median(r["tokens_per_s_per_gpu"] for r in steps),
        "mfu": median(mfus) if mfus else None,
        "mem_peak_gib": max(r["mem_peak_gib"] for r in steps),
        "mem_peak_reserved_gib": max((r["mem_peak_reserved_gib"] for r in steps if "mem_peak_reserved_gib" in r),
                                     default=None),  # CUDA only
        "predicted": predicted,
    }


# The train flags whose values a benchmark replaces (_measure): refused rather than silently not used.
_NOT_USED = ("data", "metrics_jsonl", "run_dir", "checkpoint_dir", "export_hf", "tensorboard")


def run_bench(ns: argparse.Namespace) -> int:
    from paraseek.train.flags import from_namespace

    if ns.calibrate:
        return run_calibrate(ns)
    if ns.save:
        raise UserError("--save goes with --calibrate: it names the hardware profile the calibration is written to")
    if ns.warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {ns.warmup}")
    base = from_namespace(ns)
    for name in _NOT_USED:
        if getattr(ns, name, None) is not None:
            raise UserError(f"--{name.replace('_', '-')}: paraseek bench runs on synthetic tokens and keeps no "
                            "output of its runs (it reports them, or --json); leave it out, or use paraseek train")
    counts = _counts(ns.scaling) if ns.scaling else None
    check_plot(ns.plot)
    import torch

    from paraseek.models import flops_per_token, resolve_model

    if base.steps == 100 and ns.steps is None:  # train's default is a long run; a benchmark wants a short one
        base = dataclasses.replace(base, steps=10)
    cuda = torch.cuda.is_available() and base.device != "cpu"
    counts = counts or [base.nproc or (torch.cuda.device_count() if cuda else 2)]
    first = counts[0]
    per_rank_batch = base.global_batch_size // first if ns.scaling else None
    ceiling = _matmul_ceiling(base.hardware)  # a bad profile fails here, not after the runs
    flops_tok = flops_per_token(resolve_model(base.init_from or base.model)[0], base.seq_len)
    rows = []
    with tempfile.TemporaryDirectory(prefix="paraseek-bench-") as tmp:
        for n in counts:
            cfg = dataclasses.replace(base, nproc=n, dp_shard=-1 if ns.dp_shard is None else base.dp_shard)
            if per_rank_batch is not None:
                cfg = dataclasses.replace(cfg, global_batch_size=max(1, per_rank_batch) * n)
            rows.append(_measure(cfg, ns.warmup, Path(tmp), quiet_stdout=ns.json))
    for row in rows:
        row["weak_scaling_efficiency"] = row["tokens_per_s_per_gpu"] / rows[0]["tokens_per_s_per_gpu"]
        # MFU against what this machine's GEMMs reach (the datasheet peak is not reachable: ~80% of it on H200)
        row["matmul_ceiling_tflops"] = ceiling
        row["mfu_vs_ceiling"] = flops_tok * row["tokens_per_s_per_gpu"] / (ceiling * 1e12) if ceiling else None
    if ns.plot:
        _plot(rows, ns.plot)
    if ns.json:
        print(json.dumps({"runs": rows}, indent=2))
    else:
        _print(rows)
    return 0


def _matmul_ceiling(hardware: str | None) -> float | None:
    """The measured bf16 GEMM ceiling in TFLOP/s of a hardware profile: `paraseek bench --calibrate`'s best GEMM, else
    the doctor's 8192^3 one (plan.load_profile's rule); None without a profile."""
    if not hardware:
        return None
    from paraseek.planner.plan import load_profile

    return load_profile(hardware).matmul_tflops


def _print(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="paraseek bench (median of measured steps; synthetic tokens)")
    for col in ("GPUs", "plan", "step s", "tokens/s/GPU", "MFU", "of ceiling", "peak GiB", "efficiency",
                "predicted tok/s/GPU, GiB"):
        table.add_column(col, justify="right")
    for r in rows:
        plan = f"dp {r['dp_replicate']}x{r['dp_shard']}" + (f" tp {r['tp']}" if r["tp"] > 1 else "") + \
            (f" ep {r['ep']}" if r["ep"] > 1 else "") + f" mbs {r['micro_batch_size']} AC {r['activation_checkpointing']}"
        p = r["predicted"]
        table.add_row(str(r["gpus"]), plan, f"{r['step_time_s']:.3f}", f"{r['tokens_per_s_per_gpu']:,.0f}",
                      f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "-",
                      f"{r['mfu_vs_ceiling'] * 100:.1f}%" if r["mfu_vs_ceiling"] is not None else "-",
                      f"{r['mem_peak_gib']:.1f}",
                      f"{r['weak_scaling_efficiency'] * 100:.1f}%",
                      f"{p['tokens_per_s_per_gpu']:,.0f}, {p['memory_gib']:.1f}" if p else "-")
    Console().print(table)


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    """Throughput and weak-scaling efficiency vs GPUs; with the planner's predictions (known GPUs), also the
    predicted memory and step-time breakdowns per GPU count as stacked bars, the measured totals marked on them."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    gpus = [r["gpus"] for r in rows]
    predicted = all(r["predicted"] for r in rows)
    fig, axes = plt.subplots(1, 4 if predicted else 2, figsize=(22 if predicted else 10, 4))
    a, b = axes[0], axes[1]
    a.plot(gpus, [r["tokens_per_s_per_gpu"] for r in rows], "o-", label="measured")
    if predicted:
        a.plot(gpus, [r["predicted"]["tokens_per_s_per_gpu"] for r in rows], "s--", label="predicted")
    a.set(xlabel="GPUs", ylabel="tokens/s/GPU", title=rows[0]["model"])
    a.legend()
    b.plot(gpus, [r["weak_scaling_efficiency"] * 100 for r in rows], "o-")
    b.set(xlabel="GPUs", ylabel="weak-scaling efficiency (%)", ylim=(0, 110))
    if predicted:
        _stacked(axes[2], rows, "memory_breakdown_gib", "mem_peak_gib", "GiB per GPU", "memory (predicted items)")
        _stacked(axes[3], rows, "step_time_breakdown_s", "step_time_s", "seconds per step",
                 "step time (predicted, exposed)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", file=sys.stderr)


def _stacked(ax, rows: list[dict[str, Any]], breakdown: str, measured: str, ylabel: str, title: str) -> None:
    """One bar per GPU count stacking the predicted items (largest first), a black marker at the measured total."""
    x = list(range(len(rows)))
    keys = {k for r in rows for k in r["predicted"][breakdown]}
    largest = {k: max(r["predicted"][breakdown].get(k, 0.0) for r in rows) for k in keys}
    names = sorted((k for k, v in largest.items() if v > 0), key=lambda k: -largest[k])
    bottom = [0.0] * len(rows)
    for name in names:
        heights = [r["predicted"][breakdown].get(name, 0.0) for r in rows]
        ax.bar(x, heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.plot(x, [r[measured] for r in rows], "k_", markersize=30, markeredgewidth=3, label="measured")
    ax.set_xticks(x, [str(r["gpus"]) for r in rows])
    ax.set(xlabel="GPUs", ylabel=ylabel, title=title)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def run_calibrate(ns: argparse.Namespace) -> int:
    """Measure (calibrate.py), add the section to the profile (--hardware's, or one measured here as the doctor
    does, which brings the NCCL busbw when there is more than one GPU), write it, and show what was measured."""
    import torch

    from paraseek.bench.calibrate import calibrate
    from paraseek.hardware import probe
    from paraseek.hardware.doctor import measure_profile
    from paraseek.hardware.profile import add_calibration, load_profile, save_profile
    from paraseek.hardware.specs import spec_for_device_name

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise UserError("--calibrate measures GPUs; no CUDA device is visible")
    if probe.launched():
        raise UserError("--calibrate measures one machine by itself: run it without torchrun (for several nodes, "
                        "run `paraseek doctor --save P.json` under torchrun, then `paraseek bench --calibrate "
                        "--hardware P.json` on one node)")
    hardware = getattr(ns, "hardware", None) or None
    target = ns.save or hardware
    # Checked before minutes of measuring, not after.
    if ns.save and not Path(ns.save).resolve().parent.is_dir():
        raise UserError(f"--save {ns.save}: the folder {Path(ns.save).parent} does not exist")
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    if hardware:
        base = load_profile(hardware, required=("gpu_name",))
        mine, theirs = spec_for_device_name(name), spec_for_device_name(str(base["gpu_name"]))
        if mine and theirs and mine.name != theirs.name:
            raise UserError(f"--hardware {hardware} describes {base['gpu_name']} GPUs but this machine's GPU is "
                            f"{name}; calibrate on the machine it describes, or leave out --hardware")
    with _stdout_to_stderr(ns.json):
        if not hardware:
            print("measuring GPUs and links as `paraseek doctor` does ...", file=sys.stderr)
            base, errors = measure_profile()
            for e in errors:
                print(f"warning: {e['what']}: {e['error']}", file=sys.stderr)
        print(f"calibrating on {name} (GPU {device.index}; CUDA_VISIBLE_DEVICES picks it) ...", file=sys.stderr)
        section = calibrate(device)
    profile = add_calibration(base, section)
    if target:
        save_profile(target, profile)
    if ns.json:
        print(json.dumps({"profile": target, "calibration": section,
                          "intra_node_busbw_gbps": profile.get("intra_node_busbw_gbps"),
                          "inter_node_busbw_gbps": profile.get("inter_node_busbw_gbps")}, indent=2))
        return 0
    _print_calibration(section, profile)
    print(f"hardware profile written to {target}; the planner uses it with `paraseek plan --hardware {target}`"
          if target else "not saved: add --save PROFILE.json to keep it for the planner")
    return 0


def _print_calibration(cal: dict[str, Any], profile: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from paraseek.hardware.specs import spec_for_device_name
    from paraseek.planner.plan import make_cluster

    best = cal["matmul_tflops"]

    def rate(x: float) -> str:  # CPU test rates are tiny: keep their digits
        return f"{x:,.1f}" if x >= 10 else f"{x:.3g}"

    table = Table(title=f"calibration: {cal['device']}, torch {cal['torch']}, {cal['dtype']}, median of "
                        f"{cal['shapes']['reps']}")
    for col in ("kernel", "shape", "TFLOP/s", "of best"):
        table.add_column(col, justify="left" if col in ("kernel", "shape") else "right")
    for r in cal["gemm"]:
        table.add_row(f"GEMM {r['name']} {r['layout']}", f"{r['m']}x{r['n']}x{r['k']}", rate(r["tflops"]),
                      f"{r['tflops'] / best:.2f}")
    table.add_row("GEMM median", "", rate(cal["gemm_median_tflops"]), "")
    table.add_row("a layer's linears", "time-weighted", rate(cal["linear_tflops"]),
                  f"{cal['efficiency']['linear']:.2f}")
    for a in cal["attention"]:
        table.add_row(f"SDPA causal fwd+bwd {a['name']}", f"B{a['batch']} H{a['heads']} T{a['seq']} "
                      f"d{a['qk_dim']}/{a['v_dim']}", rate(a["tflops"]), f"{a['ratio']:.2f}")
    g = cal["grouped"]
    table.add_row(f"experts fwd+bwd{'' if g['impl'] == 'torch._grouped_mm' else ' (loop)'}",
                  f"{g['experts']}x{g['dim']}x{g['inter']}, {g['rows_per_expert']} rows", rate(g["tflops"]),
                  f"{g['ratio']:.2f}")
    Console().print(table)
    print(f"HBM copy (read + write): {cal['hbm_gbps']:,.0f} GB/s")
    # What the planner now uses, against the datasheet defaults it used before.
    spec = spec_for_device_name(cal["device"])
    d = make_cluster(spec.name, 1) if spec else None
    e = cal["efficiency"]

    def was(x: float | None, fmt: str) -> str:
        return f" (default {x:{fmt}})" if x is not None else ""

    print(f"planner rates: matmul {rate(best)} TFLOP/s{was(d and d.matmul_tflops, '.0f')}, "
          f"linear {e['linear']:.2f}{was(d and d.eff.linear, '.2f')}, "
          f"attention {e['attention']:.2f}{was(d and d.eff.attention, '.2f')}, "
          f"grouped {e['grouped']:.2f}{was(d and d.eff.grouped, '.2f')}, "
          f"HBM {cal['hbm_gbps']:,.0f} GB/s{was(d and d.hbm_gbps, ',.0f')}")
    intra, inter = profile.get("intra_node_busbw_gbps"), profile.get("inter_node_busbw_gbps")
    print("NCCL all_reduce busbw (the doctor's): " + (f"{intra:.0f} GB/s in a node" if intra else "not measured in "
          "a node (one GPU)") + (f", {inter:.0f} GB/s across nodes" if inter else ""))
