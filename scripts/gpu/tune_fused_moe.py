#!/usr/bin/env python3
"""Tile configs of the fused MoE decode kernels (paraseek.infer.moe_kernels) measured on this GPU, and the sorted
grouped-GEMM path of the training model timed beside them, so the crossover between the two is measured.

    python3 scripts/gpu/tune_fused_moe.py                          # V2-Lite and V3 expert shapes: print the tables
    python3 scripts/gpu/tune_fused_moe.py --shapes v2-lite --write # merge the best configs into moe_configs.json
    python3 scripts/gpu/tune_fused_moe.py --shapes E=66,ns=2,F=704,D=2048,K=6 --tokens 1 8 64

Per shape (E routed + ns shared experts of width F, model width D, K routed experts per token) and token count:
random bf16 weights (the stacked w13 [E + ns, 2F, D] / w2 [E + ns, D, F] layout), random fp32 router logits routed
by the real `route` (the preset's score function and top-k method), then every config of a small grid (8 or 16
per token count: BLOCK_M from the mean slots per expert, 8 (BLOCK_N, BLOCK_K, num_warps, num_stages)) timed as a
CUDA-graph replay of fused_moe (align + gate|up + down + combine; the router is timed apart). Columns:
  fused us         the best config's time; GB/s: bytes of the expert weights the step touches (distinct experts
                   hit, routed + shared, x 3 F D x 2 B) per second; %HBM against --hbm-tbs (H200: 4.8 TB/s)
  grouped us       models.deepseek.MoE's path after its router: argsort, counts, gather, three grouped GEMMs
                   (models.deepseek.grouped_mm on torch._grouped_mm), the fp32 weighted sum, plus the dense
                   shared MLP; a CUDA-graph replay where it captures ('*': plain launches otherwise)
  route us         the route kernel, then the plain-torch reference (both from fp32 logits)
  rel err          fused (best config) against the grouped path, max|a - b| / max|b| (both bf16)
Replays reuse the same weights without flushing L2; the default shapes touch more expert bytes than an H200's 50 MB
of L2 from the first token on (V2-Lite: 17 MB an expert, 8 experts a token), so the GB/s are HBM's.
V2-Lite's shape takes 1-2 minutes on one H200 (most of it compiling the grid's kernels), V3's a few more (its
weights are 23 GB; the grouped path holds a second copy).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "src"))

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
PRESETS = {"v2-lite": "deepseek-v2-lite", "v2": "deepseek-v2", "v3": "deepseek-v3"}
# (BLOCK_N, BLOCK_K, num_warps, num_stages) tried with each BLOCK_M. Narrow column blocks give decode more programs
# (few tiles at small batch, so the grid is wide only along the columns); deeper K steps and more stages keep more
# weight bytes in flight per program.
INNER = [(32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4),
         (64, 256, 4, 3), (128, 64, 4, 4), (128, 128, 4, 3), (128, 128, 8, 3)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--shapes", nargs="+", default=["v2-lite", "v3"],
                   help="presets (v2-lite, v2, v3) or E=..,ns=..,F=..,D=..,K=.. (greedy softmax routing)")
    p.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    p.add_argument("--write", action="store_true",
                   help="merge the best configs into src/paraseek/infer/moe_configs.json")
    p.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM bandwidth for the %%HBM column (TB/s)")
    p.add_argument("--rep-ms", type=int, default=10, help="replay time per measurement (ms)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def shape_of(spec: str) -> dict:
    """A preset's expert shape and routing, or an explicit E=..,ns=..,F=..,D=..,K=.. (greedy softmax)."""
    if spec in PRESETS:
        from paraseek.models.args import resolve_model

        a = resolve_model(PRESETS[spec])[0]
        return dict(name=spec, E=a.n_routed_experts, ns=a.n_shared_experts, F=a.moe_inter_dim, D=a.dim,
                    K=a.n_activated_experts,
                    route=dict(score_func=a.score_func, topk_method=a.topk_method, n_group=a.n_group,
                               topk_group=a.topk_group, top_k=a.n_activated_experts, norm_topk_prob=a.norm_topk_prob,
                               scaling=a.routed_scaling_factor))
    try:
        kv = {k.strip(): int(v) for k, v in (part.split("=") for part in spec.split(","))}
        E, ns, F_, D, K = kv["E"], kv.get("ns", 0), kv["F"], kv["D"], kv["K"]
    except (KeyError, ValueError):
        raise SystemExit(f"--shapes {spec!r}: expected a preset ({', '.join(PRESETS)}) or E=..,ns=..,F=..,D=..,K=..")
    return dict(name=spec, E=E, ns=ns, F=F_, D=D, K=K,
                route=dict(score_func="softmax", topk_method="greedy", n_group=1, topk_group=1, top_k=K,
                           norm_topk_prob=False, scaling=1.0))


def candidates(n_tokens: int, slots_per_token: int, n_experts: int) -> list[dict]:
    mean = n_tokens * slots_per_token / n_experts
    block_ms = [16] if mean <= 8 else ([16, 32] if mean <= 32 else [32, 64])
    return [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
            for bm in block_ms for bn, bk, w, s in INNER]


def short(cfg: dict) -> str:
    return "M{BLOCK_M} N{BLOCK_N} K{BLOCK_K} w{num_warps} s{num_stages}".format(**cfg)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F
    import triton.testing

    from paraseek.infer import moe, moe_kernels, ops
    from paraseek.models.deepseek import grouped_mm

    if not torch.cuda.is_available():
        print("tune_fused_moe: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    gpu = torch.cuda.get_device_name(dev)

    def bench(fn) -> tuple[float, bool]:
        """Median microseconds of fn as a CUDA-graph replay (True), or as plain launches where it does not
        capture (False)."""
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=args.rep_ms, return_mode="median") * 1e3, True
        except Exception:  # noqa: BLE001 (a path that cannot be captured is still timed)
            torch.cuda.synchronize()
            return triton.testing.do_bench(fn, rep=args.rep_ms, return_mode="median") * 1e3, False

    def rel(a, b) -> float:
        a, b = a.float(), b.float()
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    results: dict[str, dict] = {}
    for spec in args.shapes:
        sh = shape_of(spec)
        E, ns, F_, D, K = sh["E"], sh["ns"], sh["F"], sh["D"], sh["K"]
        Et, KS = E + ns, K + ns
        t_shape = time.time()
        gen = torch.Generator(device=dev).manual_seed(args.seed)
        w13 = torch.randn(Et, 2 * F_, D, device=dev, dtype=dtype, generator=gen).mul_(D ** -0.5)
        w2 = torch.randn(Et, D, F_, device=dev, dtype=dtype, generator=gen).mul_(F_ ** -0.5)
        # The training model's layout for the grouped path: separate [E, F, D] gate / up, [E, D, F] down, and the
        # shared experts as one dense MLP of width ns x F.
        gate, up, down = w13[:E, :F_].contiguous(), w13[:E, F_:].contiguous(), w2[:E].contiguous()
        sg = w13[E:, :F_].reshape(ns * F_, D)
        su = w13[E:, F_:].reshape(ns * F_, D)
        sd = w2[E:].permute(1, 0, 2).reshape(D, ns * F_)
        bias = (torch.randn(E, device=dev, generator=gen) * 0.05) if sh["route"]["topk_method"] == "noaux_tc" else None
        expert_bytes = 3 * F_ * D * w13.element_size()

        def grouped(x, w, idx):
            N = x.shape[0]
            flat = idx.reshape(-1).long()
            order = torch.argsort(flat, stable=True)
            counts = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
            xs = x[order // K]
            h = F.silu(grouped_mm(xs, gate, counts, True)) * grouped_mm(xs, up, counts, True)
            y = grouped_mm(h, down, counts, True)
            y_slots = torch.empty_like(y)
            y_slots[order] = y
            out = (y_slots.view(N, K, D).float() * w.unsqueeze(-1)).sum(1).to(x.dtype)
            if ns:
                out = out + F.linear(F.silu(F.linear(x, sg)) * F.linear(x, su), sd)
            return out

        print(f"\n## {sh['name']}: E={E}+{ns} shared, F={F_}, D={D}, K={K}, {sh['route']['topk_method']} "
              f"{sh['route']['score_func']}, bf16, {gpu}\n")
        print("| tokens | best config | fused us | GB/s | %HBM | grouped us | fused speedup "
              "| route us (kernel / torch) | rel err |")
        print("|---|---|---|---|---|---|---|---|---|")
        best_of: dict[str, dict] = {}
        for N in args.tokens:
            x = torch.randn(N, D, device=dev, dtype=dtype, generator=gen)
            logits = torch.randn(N, E, device=dev, generator=gen)
            w, idx = moe_kernels.route(logits, bias, **sh["route"])
            touched = (int(idx.unique().numel()) + ns) * expert_bytes
            timings = []
            for cfg in candidates(N, KS, Et):
                try:
                    us, _ = bench(lambda cfg=cfg: moe_kernels.fused_moe(x, w13, w2, w, idx, ns, cfg))
                except Exception as exc:  # noqa: BLE001 (a config that does not compile here is skipped)
                    print(f"<!-- {short(cfg)}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]} -->")
                    continue
                timings.append((us, cfg))
            if not timings:
                print(f"| {N} | (no config ran) | | | | | | | |")
                continue
            us, cfg = min(timings, key=lambda t: t[0])
            best_of[str(N)] = cfg
            g_us, g_graph = bench(lambda: grouped(x, w, idx))
            r_us, _ = bench(lambda: moe_kernels.route(logits, bias, **sh["route"]))
            ops.use_kernels(False)  # moe.route: the plain-torch reference
            rt_us, _ = bench(lambda: moe.route(logits, bias, **sh["route"]))
            err = rel(moe_kernels.fused_moe(x, w13, w2, w, idx, ns, cfg), grouped(x, w, idx))
            gbs = touched / (us * 1e-6) / 1e9
            print(f"| {N} | {short(cfg)} | {us:.1f} | {gbs:.0f} | {100 * gbs / (args.hbm_tbs * 1e3):.0f}% | "
                  f"{g_us:.1f}{'' if g_graph else '*'} | {g_us / us:.2f}x | {r_us:.1f} / {rt_us:.1f} | "
                  f"{err:.1e}{' (!)' if err > 3e-2 else ''} |", flush=True)
        results[moe.config_key(Et, F_, D)] = best_of
        print(f"\n{sh['name']}: {time.time() - t_shape:.0f} s")
        del w13, w2, gate, up, down, sg, su, sd
        torch.cuda.empty_cache()

    if args.write:
        data = json.loads(moe.CONFIG_FILE.read_text()) if moe.CONFIG_FILE.is_file() else {}
        moe.CONFIG_FILE.write_text(moe.format_config_file(merge(data, results, gpu, datetime.date.today())))
        print(f"\nwrote {moe.CONFIG_FILE}")
    return 0


def merge(data: dict, results: dict[str, dict], gpu: str, day: datetime.date) -> dict:
    """The config file's contents with the measured token counts of each shape replaced (the others kept)."""
    for key, best_of in results.items():
        if not best_of:
            continue
        entry = data.setdefault(key, {"source": "", "configs": {}})
        entry["configs"].update(best_of)
        entry["source"] = (f"scripts/gpu/tune_fused_moe.py on {gpu}, bf16, {day.isoformat()} (token counts "
                           f"{', '.join(best_of)})")
    return data


if __name__ == "__main__":
    sys.exit(main())
