#!/usr/bin/env python3
"""The decode projections y = x W^T (+ b) at 1-16 rows: cuBLAS (F.linear) against paraseek.infer.gemv's Triton
kernel on this GPU, and the tile configs of gemv_configs.json measured.

    python3 scripts/gpu/bench_gemv.py                    # F.linear vs the kernel with the file's configs
    python3 scripts/gpu/bench_gemv.py --tune             # sweep a small grid of configs per shape and row count
    python3 scripts/gpu/bench_gemv.py --tune --write     # ... and store the winners in gemv_configs.json
    python3 scripts/gpu/bench_gemv.py --models deepseek-v3 --m 1 16
    python3 scripts/gpu/bench_gemv.py --dry-run --tune   # CPU: tiny shapes through Triton's interpreter

Shapes: every matrix a decode step multiplies by, at tp 1, for R1-Distill-Llama-8B, R1-Distill-Qwen-1.5B,
DeepSeek-V2-Lite and DeepSeek-V3 (MODELS below), in bf16, at M = 1, 2, 4, 8, 16 rows. Timing: each measurement is a
CUDA graph of --calls back-to-back products (20) rotating over enough copies of W that every call reads W from HBM
(the copies between two reads of one copy exceed 3x the L2, taken as at least 60 MB; a graph holds one call per
copy where that is more than 20, as for the 1.5B model's 4.7 MB o_proj), replayed until about --rep-ms of
replays are timed with CUDA events; the median replay / calls is the time of one product. GB/s = W's bytes / that
time. Before timing, each config's output is checked against F.linear's (max|a - b| / max|b| < 1e-2); a config that
fails is reported and not timed.

--tune sweeps per shape and row count: (BLOCK_N, BLOCK_K, num_warps, num_stages) from INNER, each with SPLIT_K = 1 and
the splits that still add programs where the grid is small (see `candidates`). --write stores, per GPU and shape, the
best config of each row bucket where it beat F.linear by >= 3% and removes the buckets where it did not: the file's
"no entry" means cuBLAS. The grid (268 configs over the 21 shapes, x 5 row counts) is sized for a --tune run of
all four models within about 4 minutes on one H200, most of it compiling the grid's kernels (not yet measured).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "src"))

# (matrix, N, K, bias) of each decode projection at tp 1 (the inference model's fused layouts: q|k|v, gate|up, MLA's
# q_a|kv_a input projection; V2-Lite has no q_lora, so its input projection is q (16 heads x 192) | kv_a (512 + 64)).
MODELS = {
    "r1-distill-llama-8b": [("q|k|v", 6144, 4096, False), ("o", 4096, 4096, False), ("gate|up", 28672, 4096, False),
                            ("down", 4096, 14336, False), ("head", 128256, 4096, False)],
    "r1-distill-qwen-1.5b": [("q|k|v", 2048, 1536, True), ("o", 1536, 1536, False), ("gate|up", 17920, 1536, False),
                             ("down", 1536, 8960, False), ("head", 151936, 1536, False)],
    "deepseek-v2-lite": [("q|kv_a", 3648, 2048, False), ("o", 2048, 2048, False), ("dense gate|up", 21888, 2048, False),
                         ("down", 2048, 10944, False), ("head", 102400, 2048, False)],
    "deepseek-v3": [("q_a|kv_a", 2112, 7168, False), ("q_b", 24576, 1536, False), ("o", 7168, 16384, False),
                    ("dense gate|up", 36864, 7168, False), ("down", 7168, 18432, False),
                    ("head", 129280, 7168, False)],
}
DRY_SHAPES = {"dry-run": [("a", 40, 256, True), ("b", 24, 200, False)]}
ROWS = [1, 2, 4, 8, 16]
# (BLOCK_N, BLOCK_K, num_warps, num_stages). A product at M <= 16 streams W, so what matters is the bytes of W each
# program keeps in flight (BLOCK_N x BLOCK_K x 2 B per stage x num_stages: 32-96 KB here, about what an SM needs at
# 4.2 TB/s) and the number of programs (N / BLOCK_N, times SPLIT_K): narrow row blocks (16, 32) give matrices with
# few rows enough programs without split-K; wide ones (64, 128) cut the per-program overhead on wide matrices.
INNER = [(16, 256, 4, 4), (16, 512, 4, 4), (32, 256, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 8, 3)]
DRY_INNER = [(16, 32, 4, 2), (32, 64, 4, 2)]
SPLITS = (1, 2, 4, 8, 16)
WAVES = 3  # split-K stops adding programs once the grid holds this many per SM
MIN_GAIN = 1.03  # --write stores a config only where F.linear takes >= 3% longer
TOL = 1e-2  # max|kernel - F.linear| / max|F.linear| in bf16


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                   help="whose decode projections to run (default: all four)")
    p.add_argument("--m", nargs="+", type=int, default=ROWS, help="rows of x (1-16; default 1 2 4 8 16)")
    p.add_argument("--tune", action="store_true", help="sweep the config grid (else the file's config, or a "
                                                       "starting config where the file has none)")
    p.add_argument("--write", action="store_true",
                   help="with --tune: store the winning configs (>= 3%% faster than F.linear) in --config-file")
    p.add_argument("--config-file", type=Path, default=None,
                   help="the config file to read and write (default: src/paraseek/infer/gemv_configs.json)")
    p.add_argument("--calls", type=int, default=20, help="products per CUDA graph (default 20)")
    p.add_argument("--rep-ms", type=float, default=5.0, help="replay time timed per measurement (ms, default 5)")
    p.add_argument("--l2-mb", type=float, default=60.0,
                   help="L2 size to defeat with weight copies (MB; the device's own if larger; default 60)")
    p.add_argument("--dry-run", action="store_true",
                   help="on CPU: tiny shapes, fp16, through Triton's interpreter, timed with the host clock "
                        "(checks the plumbing, measures nothing)")
    args = p.parse_args(argv)
    if args.write and not args.tune:
        p.error("--write stores what --tune measured: add --tune")
    if any(not 1 <= m <= 16 for m in args.m):
        p.error(f"--m {args.m}: rows must be in 1..16")
    if args.write and any(m not in ROWS for m in args.m):
        p.error(f"--write stores row buckets {ROWS}: --m must list only those")
    if args.calls < 1 or args.rep_ms <= 0:
        p.error("--calls and --rep-ms must be positive")
    return args


def candidates(N: int, K: int, sms: int, inner=INNER) -> list[dict]:
    """The tuning grid of one shape: each (BLOCK_N, BLOCK_K, warps, stages) with SPLIT_K = 1, and with each split s
    in SPLITS while the grid before it (N / BLOCK_N x s / 2 programs) held fewer than WAVES programs per SM and each
    K range keeps the pipeline full (at least num_stages tiles of BLOCK_K)."""
    out = []
    for bn, bk, warps, stages in inner:
        blocks = -(-N // bn)
        for s in SPLITS:
            if s == 1 or (blocks * s // 2 < WAVES * sms and K // s >= stages * bk):
                out.append(dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=s, num_warps=warps, num_stages=stages))
    return out


def starting_config(N: int, K: int, sms: int, inner=INNER) -> dict:
    """Where the file has no config and nothing is tuned: 64-row blocks (INNER's middle), split until the grid
    holds two programs per SM or the ranges get short."""
    bn, bk, warps, stages = inner[len(inner) // 2]
    split = 1
    while -(-N // bn) * split < 2 * sms and K // (2 * split) >= stages * bk and split < SPLITS[-1]:
        split *= 2
    return dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages)


def short(cfg: dict) -> str:
    return "N{BLOCK_N} K{BLOCK_K} s{SPLIT_K} w{num_warps} st{num_stages}".format(**cfg)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels are decorated for it
    import torch
    import torch.nn.functional as F

    from paraseek.infer import gemv

    if not args.dry_run and not torch.cuda.is_available():
        print("bench_gemv: needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    config_file = args.config_file or gemv.CONFIG_FILE
    file_data = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if args.dry_run:
        dev, dtype, sms, l2, inner, calls = torch.device("cpu"), torch.float16, 2, 0, DRY_INNER, 2
        shapes = [(model, *sh) for model, lst in DRY_SHAPES.items() for sh in lst]
        rows = [m for m in args.m if m <= 2]
    else:
        dev, dtype, calls = torch.device("cuda"), torch.bfloat16, args.calls
        props = torch.cuda.get_device_properties(dev)
        sms, l2, inner = props.multi_processor_count, max(props.L2_cache_size, args.l2_mb * 1e6), INNER
        shapes = [(model, *sh) for model in args.models for sh in MODELS[model]]
        rows = args.m
    gpu = gemv.device_name(dev)
    print(f"# bench_gemv on {gpu}: {sms} SMs, L2 {l2 / 1e6:.0f} MB, {str(dtype).removeprefix('torch.')}, "
          f"{calls} products per graph{', --tune' if args.tune else ''}", flush=True)

    def per_call_us(fn, n_calls: int) -> float:
        """Microseconds of one product: the median of timed replays of a graph of n_calls fn(i) (host clock in
        the dry run)."""
        if args.dry_run:
            t0 = time.perf_counter()
            for i in range(n_calls):
                fn(i)
            return (time.perf_counter() - t0) / n_calls * 1e6
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile, load and allocate before the capture
            for i in range(n_calls):
                fn(i)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(n_calls):
                fn(i)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        reps = max(3, min(100, int(args.rep_ms / max(start.elapsed_time(end), 1e-3))))
        times = []
        for _ in range(reps):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        del graph
        return statistics.median(times) * 1e3 / n_calls

    def rel(a, b) -> float:
        a, b = a.float(), b.float()
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    t_run = time.time()
    results = []  # one dict per (shape, M): see print_table
    for model, matrix, N, K, has_bias in shapes:
        t_shape = time.time()
        w_bytes = N * K * torch.finfo(dtype).bits // 8
        # Copies of W so that a copy is read again only after > 3 x L2 bytes of the others: from HBM every call.
        n_copies = 1 if args.dry_run else max(2, -(-int(3 * l2) // w_bytes) + 1)
        n_calls = max(calls, n_copies)
        gen = torch.Generator(device=dev).manual_seed(N * 131 + K)
        ws = [torch.randn(N, K, device=dev, dtype=dtype, generator=gen).mul_(K ** -0.5) for _ in range(n_copies)]
        b = torch.randn(N, device=dev, dtype=dtype, generator=gen) if has_bias else None
        file_entry = file_data.get(gpu, {}).get(gemv.config_key(N, K), {}).get("configs", {})
        for M in rows:
            x = torch.randn(M, K, device=dev, dtype=dtype, generator=gen)
            want = F.linear(x, ws[0], b)
            lin_us = per_call_us(lambda i: F.linear(x, ws[i % n_copies], b), n_calls)
            in_file = file_entry.get(str(gemv.m_bucket(M)))
            if args.tune:
                cands = candidates(N, K, sms, inner)
                if in_file is not None and gemv.check_config(in_file) not in cands:
                    cands.append(gemv.check_config(in_file))
                origin = "tuned"
            elif in_file is not None:
                cands, origin = [gemv.check_config(in_file)], "file"
            else:
                cands, origin = [starting_config(N, K, sms, inner)], "start"
            best = None
            for cfg in cands:
                try:
                    err = rel(gemv.gemv(x, ws[0], b, cfg), want)
                    if err >= TOL:
                        print(f"  {model} {matrix} M={M} {short(cfg)}: rel err {err:.1e} >= {TOL}: not timed")
                        continue
                    us = per_call_us(lambda i, cfg=cfg: gemv.gemv(x, ws[i % n_copies], b, cfg), n_calls)
                except Exception as exc:  # noqa: BLE001 (a config that does not compile or fit here is skipped)
                    print(f"  {model} {matrix} M={M} {short(cfg)}: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:120] if str(exc) else ''}")
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg)
            results.append(dict(model=model, matrix=matrix, N=N, K=K, M=M, w_bytes=w_bytes, linear_us=lin_us,
                                kernel_us=best[0] if best else None, cfg=best[1] if best else None, origin=origin))
            gbs = w_bytes / lin_us / 1e3
            line = f"  {model} {matrix} {N}x{K} M={M}: F.linear {lin_us:.1f} us ({gbs:.0f} GB/s)"
            if best:
                line += f", kernel {best[0]:.1f} us ({w_bytes / best[0] / 1e3:.0f} GB/s) {short(best[1])} [{origin}]"
            print(line, flush=True)
        print(f"  {model} {matrix}: {len(rows)} row counts in {time.time() - t_shape:.1f} s", flush=True)
        del ws, b
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    # The dry run's times measure the interpreter: it stores every best config, to exercise --write.
    min_gain = 0.0 if args.dry_run else MIN_GAIN
    print_table(results, args.tune, min_gain)
    print(f"\ntotal {time.time() - t_run:.0f} s")
    if args.write:
        merged = merge(file_data, results, gpu, datetime.date.today(), str(dtype).removeprefix("torch."), min_gain)
        config_file.write_text(gemv.format_config_file(merged))
        print(f"wrote {config_file}")
    return 0


def print_table(results: list[dict], tuned: bool, min_gain: float) -> None:
    """One row per shape and row count: F.linear's and the kernel's (best config's) time and GB/s of W, the
    speedup, the config, and whether --write stores it (tuned) or where the config came from (file, start)."""
    print("\n| model | matrix | N x K | M | F.linear us | GB/s | kernel us | GB/s | speedup | config | "
          + ("stored |" if tuned else "from |"))
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        head = (f"| {r['model']} | {r['matrix']} | {r['N']}x{r['K']} | {r['M']} | {r['linear_us']:.1f} | "
                f"{r['w_bytes'] / r['linear_us'] / 1e3:.0f} |")
        if r["kernel_us"] is None:
            print(head + " (no config ran) | | | | |")
            continue
        ratio = r["linear_us"] / r["kernel_us"]
        where = ("yes" if ratio >= min_gain else "no (cuBLAS)") if tuned else r["origin"]
        print(head + f" {r['kernel_us']:.1f} | {r['w_bytes'] / r['kernel_us'] / 1e3:.0f} | {ratio:.2f}x | "
              f"{short(r['cfg'])} | {where} |")


def merge(data: dict, results: list[dict], gpu: str, day: datetime.date, dtype: str, min_gain: float) -> dict:
    """The config file's contents with this GPU's measured (shape, row bucket) pairs replaced: the best config
    where F.linear took min_gain times as long or more, no entry where not; shapes and buckets not measured are
    kept."""
    from paraseek.infer import gemv

    shapes = data.setdefault(gpu, {})
    measured: dict[str, list[int]] = {}
    for r in results:
        key = gemv.config_key(r["N"], r["K"])
        entry = shapes.setdefault(key, {"source": "", "configs": {}})
        measured.setdefault(key, []).append(r["M"])
        if r["kernel_us"] is not None and r["linear_us"] / r["kernel_us"] >= min_gain:
            entry["configs"][str(r["M"])] = r["cfg"]
        else:
            entry["configs"].pop(str(r["M"]), None)
    for key, rows in measured.items():
        if shapes[key]["configs"]:
            shapes[key]["source"] = (f"scripts/gpu/bench_gemv.py --tune on {gpu}, {dtype}, {day.isoformat()} (last "
                                     f"measured rows {', '.join(map(str, rows))}; the buckets listed beat F.linear "
                                     f"by >= {100 * (min_gain - 1):.0f}%)")
        else:
            del shapes[key]
    if not shapes:
        del data[gpu]
    return data


if __name__ == "__main__":
    sys.exit(main())
