#!/usr/bin/env python3
"""The routed experts in float8 (models/fp8_grouped.py, --fp8-experts on) against bf16 on one DeepSeek-V2-Lite-shaped
MoE layer: forward+backward time, compiled and eager, at several token counts, and the error of each against an fp32
copy of the layer (same weights, same routing).

    python3 scripts/gpu/bench_fp8_experts.py [--tokens 8192,32768] [--modes eager,compiled] [--json FILE]
    python3 scripts/gpu/bench_fp8_experts.py --profile 8192    # the top CUDA kernels of each, compiled
    python3 scripts/gpu/bench_fp8_experts.py --autotune ...    # inductor's max-autotune picks every GEMM's kernel

One table: tokens, mode, bf16 ms, fp8 ms, fp8 speed-up; then the errors (||a - ref|| / ||ref||) of the output, the
input gradient and the expert weight gradients, bf16 and fp8 side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "src"))

import torch  # noqa: E402

from paraseek.models.args import ModelArgs, preset_config  # noqa: E402
from paraseek.models.deepseek import MoE  # noqa: E402


def build(args: ModelArgs, fp8: bool, dtype: torch.dtype = torch.bfloat16) -> MoE:
    """The layer with N(0, 0.02) weights rounded to bf16 (so the fp32 reference holds the same values)."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        moe = MoE(args)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
    moe.to(torch.bfloat16).to(dtype)
    moe.experts.fp8 = fp8
    return moe


def fwd_bwd(moe, x: torch.Tensor, dy: torch.Tensor):
    x = x.detach().requires_grad_()
    for p in moe.parameters():
        p.grad = None
    y = moe(x)
    y.backward(dy)
    return y, x.grad


def time_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def profile(n: int) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    args = ModelArgs.from_hf_config(preset_config("deepseek-v2-lite"))
    x = torch.randn(1, n, args.dim, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(1, n, args.dim, device="cuda", dtype=torch.bfloat16) * 1e-3
    for fp8 in (False, True):
        moe = build(args, fp8)
        torch._dynamo.reset()
        run = torch.compile(moe)
        for _ in range(3):
            fwd_bwd(run, x, dy)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                fwd_bwd(run, x, dy)
            torch.cuda.synchronize()
        ms = time_ms(lambda: fwd_bwd(run, x, dy), 2, 10)
        print(f"== {'fp8' if fp8 else 'bf16'} experts, {n} tokens: {ms:.3f} ms fwd+bwd; 3 iterations:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=90))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="8192,32768")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--json")
    p.add_argument("--autotune", action="store_true",
                   help="inductor's max_autotune_gemm on: each GEMM, grouped ones included (inductor's Triton "
                        "grouped-GEMM templates against ATen's CUTLASS kernel), picked by timing")
    p.add_argument("--profile", type=int, default=0, metavar="TOKENS",
                   help="only profile 3 compiled fwd+bwd of bf16 and fp8 at TOKENS: the top CUDA kernels")
    a = p.parse_args()
    if a.autotune:
        from torch._inductor import config as inductor_config

        inductor_config.max_autotune_gemm = True
    if a.profile:
        return profile(a.profile)
    args = ModelArgs.from_hf_config(preset_config("deepseek-v2-lite"))
    rows, errors = [], []
    for n in map(int, a.tokens.split(",")):
        g = torch.Generator(device="cuda").manual_seed(n)
        x = torch.randn(n, args.dim, device="cuda", dtype=torch.bfloat16, generator=g)
        dy = torch.randn(n, args.dim, device="cuda", dtype=torch.bfloat16, generator=g) * 1e-3
        for mode in a.modes.split(","):
            ms = {}
            for variant in ("bf16", "fp8"):
                moe = build(args, variant == "fp8")
                torch._dynamo.reset()  # each token count compiled for its own static shape
                run = torch.compile(moe) if mode == "compiled" else moe
                ms[variant] = time_ms(lambda: fwd_bwd(run, x.view(1, n, -1), dy.view(1, n, -1)), a.warmup, a.iters)
                del moe, run
                torch.cuda.empty_cache()
            rows.append({"tokens": n, "mode": mode, "bf16_ms": ms["bf16"], "fp8_ms": ms["fp8"],
                         "speedup": ms["bf16"] / ms["fp8"]})
            print(f"| {n} | {mode} | {ms['bf16']:.3f} | {ms['fp8']:.3f} | {ms['bf16'] / ms['fp8']:.3f}x |", flush=True)
        # errors against fp32 (eager): the same weights and routing
        ref_moe = build(args, False, torch.float32)
        ref_moe.use_grouped_mm = False
        y_ref, dx_ref = fwd_bwd(ref_moe, x.float().view(1, n, -1), dy.float().view(1, n, -1))
        e = {"tokens": n}
        for tag in ("bf16", "fp8"):
            moe = build(args, tag == "fp8")
            y, dx = fwd_bwd(moe, x.view(1, n, -1), dy.view(1, n, -1))
            e[f"{tag}_out"], e[f"{tag}_dx"] = rel(y, y_ref), rel(dx, dx_ref)
            for name in ("gate_proj", "up_proj", "down_proj"):
                e[f"{tag}_d{name}"] = rel(getattr(moe.experts, name).grad, getattr(ref_moe.experts, name).grad)
            del moe
        errors.append(e)
        print(json.dumps(e), flush=True)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| tokens | mode | bf16 fwd+bwd ms | fp8 experts ms | speed-up |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['mode']} | {r['bf16_ms']:.3f} | {r['fp8_ms']:.3f} | {r['speedup']:.3f}x |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"timing": rows, "errors": errors, "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
