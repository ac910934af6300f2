#!/usr/bin/env python3
"""One DeepSeek-V2-Lite-shaped MoE layer, bf16: correctness of the grouped-matmul path against the exact per-expert
fallback (forward + backward), then forward+backward timings of both and of transformers' DeepseekV2Moe.

    python3 scripts/gpu/bench_moe_layer.py                       # on the GPU machine: 4 x 4096 tokens
    python3 scripts/gpu/bench_moe_layer.py --device cpu --batch 1 --seq 64 --iters 3 --warmup 1   # a smoke test

Prints markdown tables and one `CORRECTNESS: PASS|FAIL` line; exits 1 on FAIL (timings are still printed first).

Checks (all on the same weights and input, bf16 unless said):
  * layer: grouped vs fallback -- output, d(input), d(expert gate/up/down weights); the gate and shared-expert grads are
    reported, not gated. Pass: max|a-b| / max|b| < --tol (default 2e-2) for each, everything finite.
  * both against an fp32 copy of the layer run through the fallback (the routing is computed in fp32 from the same
    values in both, so it is identical): ||a-ref|| / ||ref||, for information.
  * the grouped_mm primitive with empty groups (experts that get no rows), after filling the allocator's free memory
    with NaN: the grouped output and grads must match the fallback and the grads of empty experts must be exactly 0.
  * transformers' layer with our weights copied in: its output against ours, for information (same function?).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "src"))

import torch  # noqa: E402

from paraseek.models.args import ModelArgs, preset_config  # noqa: E402
from paraseek.models.deepseek import MoE, grouped_mm  # noqa: E402

PRESET = "deepseek-v2-lite"


# ---- measures --------------------------------------------------------------------------------------------------------
def rel_maxabs(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max|a-b|, max|a-b| / max|b|) in fp32."""
    a, b = a.float(), b.float()
    d = (a - b).abs().max().item()
    return d, d / max(b.abs().max().item(), 1e-30)


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t.float()).all().item())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def poison_free_memory(device: torch.device, mib: int = 1024) -> None:
    """Fill memory the caching allocator will hand out next with NaN, so an output a kernel leaves unwritten shows."""
    if device.type != "cuda":
        return
    blocks = [torch.full((mib * (1 << 20) // 8,), float("nan"), dtype=torch.bfloat16, device=device) for _ in range(4)]
    del blocks  # back to the cache, NaN-filled


def build_moe(args: ModelArgs, device: torch.device, dtype: torch.dtype, seed: int) -> MoE:
    torch.manual_seed(seed)
    with torch.device(device):
        moe = MoE(args)
    moe.to(dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
    return moe


def fwd_bwd(moe: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    moe.zero_grad(set_to_none=True)
    xx = x.detach().clone().requires_grad_(True)
    out = moe(xx)
    out.backward(dy)
    res = {"out": out.detach(), "d_input": xx.grad.detach()}
    for name, p in moe.named_parameters():
        res["d_" + name] = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
    return res


CHECKED = ("out", "d_input", "d_experts.gate_proj", "d_experts.up_proj", "d_experts.down_proj")


# ---- correctness --------------------------------------------------------------------------------------------------------
def check_layer(moe: MoE, x: torch.Tensor, dy: torch.Tensor, tol: float, with_fp32: bool) -> tuple[bool, list[dict]]:
    moe.use_grouped_mm = True
    g = fwd_bwd(moe, x, dy)
    moe.use_grouped_mm = False
    f = fwd_bwd(moe, x, dy)
    moe.use_grouped_mm = None
    r = None
    if with_fp32:
        ref = copy.deepcopy(moe).float()
        ref.use_grouped_mm = False
        r = fwd_bwd(ref, x.float(), dy.float())
        del ref
    rows, ok = [], True
    for key in g:
        d, rel = rel_maxabs(g[key], f[key])
        fin = finite(g[key]) and finite(f[key])
        checked = key in CHECKED
        passed = fin and rel < tol
        if checked:
            ok &= passed
        row = dict(tensor=key, max_abs=d, rel_maxabs=rel, finite=fin, checked=checked, passed=passed)
        if r is not None:
            row["grouped_vs_fp32"] = rel_norm(g[key], r[key])
            row["fallback_vs_fp32"] = rel_norm(f[key], r[key])
        rows.append(row)
    return ok, rows


def check_primitive_empty_groups(device: torch.device, dtype: torch.dtype, tol: float) -> tuple[bool, dict]:
    """grouped_mm with experts that get no rows, against the fallback; grads of empty experts must be exactly 0."""
    gen = torch.Generator().manual_seed(1)
    counts = torch.tensor([0, 37, 0, 64, 5, 0, 100, 50, 0, 0, 17, 1], dtype=torch.int64)
    E, M, I, O = len(counts), int(counts.sum()), 2048, 1408
    x = torch.randn(M, I, generator=gen).to(device, dtype)
    w = (torch.randn(E, O, I, generator=gen) * 0.02).to(device, dtype)
    dy = torch.randn(M, O, generator=gen).to(device, dtype)
    res = {}
    for mode in (True, False):
        poison_free_memory(device)
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = grouped_mm(xx, ww, counts.to(device), use_grouped=mode)
        y.backward(dy)
        res[mode] = (y.detach(), xx.grad, ww.grad)
    empty = (counts == 0).nonzero().flatten().tolist()
    out = {"empty_experts": empty}
    ok = True
    for name, a, b in zip(("y", "dx", "dw"), res[True], res[False]):
        d, rel = rel_maxabs(a, b)
        out[name + "_rel_maxabs"] = rel
        ok &= finite(a) and rel < tol
    dw_empty = res[True][2][empty].float().abs().max().item()
    out["grouped_dw_of_empty_experts_max_abs"] = dw_empty
    ok &= dw_empty == 0.0
    out["passed"] = ok
    return ok, out


# ---- transformers' layer ----------------------------------------------------------------------------------------------
def build_hf(moe: MoE, device: torch.device, dtype: torch.dtype):
    import transformers
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    cfg = {k: v for k, v in preset_config(PRESET).items() if k != "auto_map"}
    config = transformers.DeepseekV2Config(**cfg)
    config._experts_implementation = "eager"
    with torch.device(device):
        hf = DeepseekV2Moe(config)
    hf.to(dtype)
    with torch.no_grad():
        for p in hf.parameters():  # normal(0, 0.02) everywhere, then our (also normal(0, 0.02)) weights copied in
            p.normal_(0.0, 0.02)
        e = moe.experts
        hf.gate.weight.copy_(moe.gate.weight)
        hf.experts.gate_up_proj.copy_(torch.cat([e.gate_proj, e.up_proj], dim=1))
        hf.experts.down_proj.copy_(e.down_proj)
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(hf.shared_experts, n).weight.copy_(getattr(moe.shared_experts, n).weight)
    return hf, config


# ---- timing -----------------------------------------------------------------------------------------------------------
def time_it(fn, device: torch.device, warmup: int, iters: int) -> list[float]:
    """Per-iteration ms: CUDA events around each iteration (host clock + sync on CPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    if device.type == "cuda":
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for s, e in evs:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in evs]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def bench(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, device, warmup: int, iters: int) -> dict:
    xx = x.detach().clone().requires_grad_(True)

    def step():
        module.zero_grad(set_to_none=True)
        xx.grad = None
        module(xx).backward(dy)

    def fwd():
        with torch.no_grad():
            module(x)

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t = time_it(step, device, warmup, iters)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    tf = time_it(fwd, device, warmup, iters)
    return dict(fwd_bwd_ms=statistics.median(t), fwd_bwd_min_ms=min(t), fwd_bwd_max_ms=max(t),
                fwd_ms=statistics.median(tf), peak_gib=peak, iters=iters)


def layer_flops(args: ModelArgs, n_tokens: int) -> float:
    """Forward FLOPs of the layer's matmuls: routed experts, shared experts, router."""
    D, F, K, S, E = args.dim, args.moe_inter_dim, args.n_activated_experts, args.n_shared_experts, args.n_routed_experts
    return 2 * n_tokens * (3 * D * F * K + 3 * D * F * S + D * E)


# ---- main -------------------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--tol", type=float, default=2e-2, help="max|grouped-fallback| / max|fallback| bound")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' layer")
    ap.add_argument("--no-fp32-ref", action="store_true")
    ap.add_argument("--json", default=None, help="also write all numbers here")
    a = ap.parse_args()

    device, dtype = torch.device(a.device), torch.bfloat16
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available (use --device cpu for a smoke test)")
        return 2
    info = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch=torch.__version__, python=platform.python_version(), host=platform.node(),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        capability=".".join(map(str, torch.cuda.get_device_capability(device))) if device.type == "cuda" else "-",
        cuda=torch.version.cuda, has_grouped_mm=hasattr(torch, "_grouped_mm"),
    )
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    print("## environment")
    for k, v in info.items():
        print(f"- {k}: {v}")

    args = ModelArgs.from_hf_config(preset_config(PRESET))
    B, T = a.batch, a.seq
    N = B * T
    print(f"\nlayer: {PRESET} MoE, dim {args.dim}, {args.n_routed_experts} routed experts (top-{args.n_activated_experts}) "
          f"of width {args.moe_inter_dim} + {args.n_shared_experts} shared, {args.score_func}/{args.topk_method}; "
          f"tokens {B} x {T} = {N}; bf16; fwd+bwd with a random bf16 dL/dy and the input requiring grad")

    moe = build_moe(args, device, dtype, seed=0)
    gen = torch.Generator().manual_seed(123)
    x = torch.randn(B, T, args.dim, generator=gen).to(device, dtype)
    dy = torch.randn(B, T, args.dim, generator=gen).to(device, dtype)

    # -- correctness
    t0 = time.perf_counter()
    ok_layer, rows = check_layer(moe, x, dy, a.tol, with_fp32=not a.no_fp32_ref)
    ok_prim, prim = check_primitive_empty_groups(device, dtype, a.tol)
    counts = moe.tokens_per_expert.clone()
    with torch.no_grad():
        true_counts = torch.bincount(moe.gate(x.view(-1, args.dim))[1].reshape(-1), minlength=args.n_routed_experts)
    tpe_exact = bool((counts.double() == true_counts.double()).all().item())
    print(f"\n## correctness: grouped (torch._grouped_mm) vs fallback (per-expert loop), bf16 ({time.perf_counter() - t0:.1f} s)")
    hdr = "| tensor | max abs diff | rel (max-abs) | finite | gated |"
    if not a.no_fp32_ref:
        hdr += " grouped vs fp32 (norm rel) | fallback vs fp32 (norm rel) |"
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for r in rows:
        line = (f"| {r['tensor']} | {r['max_abs']:.3e} | {r['rel_maxabs']:.3e} | {'yes' if r['finite'] else 'NO'} | "
                f"{('pass' if r['passed'] else 'FAIL') if r['checked'] else 'info'} |")
        if not a.no_fp32_ref:
            line += f" {r['grouped_vs_fp32']:.3e} | {r['fallback_vs_fp32']:.3e} |"
        print(line)
    print(f"\ngrouped_mm primitive with empty groups (experts {prim['empty_experts']} get no rows, free memory poisoned "
          f"with NaN): y rel {prim['y_rel_maxabs']:.3e}, dx rel {prim['dx_rel_maxabs']:.3e}, dw rel {prim['dw_rel_maxabs']:.3e}, "
          f"max|dw| of empty experts {prim['grouped_dw_of_empty_experts_max_abs']} -> {'pass' if prim['passed'] else 'FAIL'}")
    print(f"tokens per expert this batch: min {int(true_counts.min())}, max {int(true_counts.max())}; "
          f"moe.tokens_per_expert buffer dtype {counts.dtype}, equals the true counts: {tpe_exact}")

    # -- transformers' layer, same weights
    hf = hf_config = None
    if not a.no_hf and info["transformers"]:
        hf, hf_config = build_hf(moe, device, dtype)
        with torch.no_grad():
            moe.use_grouped_mm = True
            ours = moe(x)
            hf_config._experts_implementation = "eager"
            hf_eager = hf(x)
            hf_config._experts_implementation = "grouped_mm"
            hf_grouped = hf(x)
            moe.use_grouped_mm = None
        parity = {"hf_eager_vs_ours_grouped": rel_maxabs(hf_eager, ours)[1],
                  "hf_grouped_mm_vs_ours_grouped": rel_maxabs(hf_grouped, ours)[1]}
        print("transformers' DeepseekV2Moe with our weights, output vs ours (rel max-abs): "
              + ", ".join(f"{k} {v:.3e}" for k, v in parity.items()))
        info["hf_parity"] = parity
        del ours, hf_eager, hf_grouped

    # -- timing
    variants = [("paraseek MoE, grouped (torch._grouped_mm)", moe, dict(use_grouped_mm=True)),
                ("paraseek MoE, fallback (per-expert loop)", moe, dict(use_grouped_mm=False))]
    if hf is not None:
        variants += [("transformers DeepseekV2Moe, experts eager (standalone-layer default)", hf, dict(impl="eager")),
                     ("transformers DeepseekV2Moe, experts grouped_mm (from_pretrained default)", hf, dict(impl="grouped_mm"))]
    variants.append(("paraseek MoE, grouped (repeat, for spread)", moe, dict(use_grouped_mm=True)))
    flops = 3 * layer_flops(args, N)  # fwd + bwd (dX and dW): 3x the forward
    results = []
    for name, mod, how in variants:
        if "use_grouped_mm" in how:
            mod.use_grouped_mm = how["use_grouped_mm"]
        else:
            hf_config._experts_implementation = how["impl"]
        try:
            r = bench(mod, x, dy, device, a.warmup, a.iters)
        except Exception as exc:  # keep the other rows
            print(f"{name}: FAILED to run: {type(exc).__name__}: {exc}")
            continue
        r["name"] = name
        r["tflops"] = flops / (r["fwd_bwd_ms"] * 1e-3) / 1e12
        results.append(r)
        print(f"  timed {name}: fwd+bwd {r['fwd_bwd_ms']:.3f} ms, fwd {r['fwd_ms']:.3f} ms", flush=True)
    moe.use_grouped_mm = None

    ref_hf = next((r for r in results if "eager" in r["name"]), None)
    ref_hf_g = next((r for r in results if "experts grouped_mm" in r["name"]), None)
    print(f"\n## timing: {N} tokens ({B} x {T}), bf16, median of {a.iters} iters after {a.warmup} warm-up "
          f"({'CUDA events' if device.type == 'cuda' else 'host clock'}); fwd+bwd = {flops / 1e12:.2f} TFLOP of matmuls")
    print("| variant | fwd+bwd ms (median) | min / max ms | fwd only ms (no_grad) | fwd+bwd TFLOP/s | peak GiB "
          "| speedup vs HF eager | speedup vs HF grouped_mm |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        s1 = f"{ref_hf['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x" if ref_hf else "-"
        s2 = f"{ref_hf_g['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x" if ref_hf_g else "-"
        print(f"| {r['name']} | {r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_min_ms']:.3f} / {r['fwd_bwd_max_ms']:.3f} | "
              f"{r['fwd_ms']:.3f} | {r['tflops']:.1f} | {r['peak_gib']:.2f} | {s1} | {s2} |")

    ok = ok_layer and ok_prim
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(info=info, tokens=N, batch=B, seq=T, tol=a.tol, correctness=rows, primitive=prim,
                           tokens_per_expert_exact=tpe_exact, timing=results, passed=ok), fh, indent=1)
    worst = max(r["rel_maxabs"] for r in rows if r["checked"])
    print(f"\nCORRECTNESS: {'PASS' if ok else 'FAIL'} (layer: worst gated rel max-abs {worst:.3e} < {a.tol}: {ok_layer}; "
          f"empty-group primitive: {ok_prim})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
