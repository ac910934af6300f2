#!/usr/bin/env python3
"""Launch configs of the paged decode attention kernels (paraseek.infer.kernels: MLA's latent attention and GQA)
measured on this GPU: for each case (heads, widths, batch, context), every config of a small grid timed against the
current default, with its achieved bandwidth and its error against the plain-torch reference.

    python3 scripts/gpu/tune_decode_attention.py [--cases v2lite,v3,llama8b] [--quick]

A config is (PARTITION: tokens per split-KV partition, BLOCK_N: tokens per tile, num_warps, num_stages); the short
contexts' partitions (SHORT_PARTITION up to SHORT_CONTEXT tokens) are swept apart at batch 1. The cache holds the
cases' blocks in a random order (paged, as a long-running engine leaves them) and is several times the 60 MB L2.
Bytes counted: each sequence's cached rows once (MLA: (C + R) x 2 B a token; GQA: 2 x G x D x 2 B) plus the fp32
partials written and read back by the combine pass. Prints one line per case: the default, the best, and the top 3.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "src"))

import torch  # noqa: E402
import triton  # noqa: E402

from paraseek.infer import kernels, ops  # noqa: E402

# (name, kind, heads, kv heads or 1, width C or D, rope R, batch, context)
CASES = {
    "v2lite": [("v2lite", "mla", 16, 1, 512, 64, b, t) for b, t in ((1, 384), (64, 2176), (256, 1024), (512, 700))],
    "v3": [("v3", "mla", 128, 1, 512, 64, b, t) for b, t in ((1, 384), (64, 2176))],
    "llama8b": [("llama8b", "gqa", 32, 8, 128, 0, b, t) for b, t in ((1, 384), (256, 512))],
}


def make_case(kind, H, G, C, R, B, T, block_size=16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = triton.cdiv(T, block_size)
    n_blocks = B * blocks_per_seq + 1
    bt = (torch.randperm(n_blocks - 1, generator=g, device="cuda")[:B * blocks_per_seq] + 1).view(B, -1).int()
    ctx = torch.full((B,), T, dtype=torch.int32, device="cuda")
    S = n_blocks * block_size
    bf = torch.bfloat16
    if kind == "mla":
        cache = torch.randn(S, C + R, generator=g, device="cuda", dtype=bf)
        q_lat = torch.randn(B, H, C, generator=g, device="cuda", dtype=bf)
        q_pe = torch.randn(B, H, R, generator=g, device="cuda", dtype=bf)
        scale = (128 + R) ** -0.5
        fn = lambda: kernels.paged_decode_mla(q_lat, q_pe, cache, bt, ctx, block_size, scale)  # noqa: E731
        ref = lambda: ops.paged_decode_mla(q_lat.float(), q_pe.float(), cache.float(), bt, ctx, block_size, scale)  # noqa: E731
        row_bytes, out_width = (C + R) * 2, C
    else:
        k = torch.randn(S, G, C, generator=g, device="cuda", dtype=bf)
        v = torch.randn(S, G, C, generator=g, device="cuda", dtype=bf)
        q = torch.randn(B, H, C, generator=g, device="cuda", dtype=bf)
        scale = C ** -0.5
        fn = lambda: kernels.paged_decode_gqa(q, k, v, bt, ctx, block_size, scale)  # noqa: E731
        ref = lambda: ops.paged_decode_gqa(q.float(), k.float(), v.float(), bt, ctx, block_size, scale)  # noqa: E731
        row_bytes, out_width = 2 * G * C * 2, C
    return fn, ref, B * T * row_bytes, B * H * out_width


def timed(fn, reps_ms=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    return triton.testing.do_bench(g.replay, rep=reps_ms, return_mode="median") / 10


def grid(kind, quick):
    if quick:  # 16 configs
        return list(itertools.product([256, 1024], [16, 32] if kind == "mla" else [32, 64], [4, 8], [2, 3]))
    block_n = [16, 32, 64] if kind == "mla" else [32, 64, 128]
    return list(itertools.product([256, 512, 1024], block_n, [4, 8], [1, 2, 3]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="v2lite,v3,llama8b")
    ap.add_argument("--quick", action="store_true", help="a smaller grid")
    a = ap.parse_args()
    base_mla, base_gqa, base_part = kernels._mla_config, kernels._gqa_config, kernels.PARTITION
    for name in a.cases.split(","):
        for case in CASES[name]:
            _, kind, H, G, C, R, B, T = case
            fn, ref, kv_bytes, out_elems = make_case(kind, H, G, C, R, B, T)
            want = ref().float()
            kernels.PARTITION, kernels._mla_config, kernels._gqa_config = base_part, base_mla, base_gqa
            t_default = timed(fn)
            rows = []
            for part, bn, w, st in grid(kind, a.quick):
                kernels.PARTITION = part
                if kind == "mla":
                    bh = base_mla(H, 512, 2)["BLOCK_H"]
                    kernels._mla_config = lambda *_, c=dict(BLOCK_H=bh, BLOCK_N=bn, num_warps=w, num_stages=st): c
                else:
                    kernels._gqa_config = lambda *_, c=dict(BLOCK_N=bn, num_warps=w, num_stages=st): c
                try:
                    got = fn().float()
                    err = ((got - want).norm() / want.norm()).item()
                    t = timed(fn)
                except Exception as e:  # a config that does not fit (shared memory, registers)
                    rows.append((float("inf"), part, bn, w, st, float("nan"), type(e).__name__))
                    continue
                rows.append((t, part, bn, w, st, err, ""))
            kernels.PARTITION, kernels._mla_config, kernels._gqa_config = base_part, base_mla, base_gqa
            rows.sort()
            best = rows[0]
            gbs = lambda ms: kv_bytes / (ms * 1e-3) / 1e9  # noqa: E731
            top = "; ".join(f"P{p} N{bn} w{w} s{st} {t * 1e3:.1f} us err {e:.1e}" for t, p, bn, w, st, e, _ in rows[:3])
            print(f"TUNE {kind} {name} H={H} G={G} B={B} T={T}: default {t_default * 1e3:.1f} us "
                  f"({gbs(t_default):,.0f} GB/s) | best {best[0] * 1e3:.1f} us ({gbs(best[0]):,.0f} GB/s, "
                  f"{t_default / best[0]:.2f}x) | {top}", flush=True)


if __name__ == "__main__":
    main()
