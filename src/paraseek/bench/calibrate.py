"""`paraseek bench --calibrate`: the rates the planner prices work at, measured on this machine's GPU 0.

What is measured (defaults: DeepSeek-LLM-7B's linears and attention, DeepSeek-V2-Lite's experts, a micro-batch of
2 x 4096 tokens), each the median of `reps` calls after `warmup` calls, timed with CUDA events:
  gemm       bf16 GEMMs of a 7B layer's linears, forward (x @ w.T) and both backward layouts (dy @ w for the input
             gradient, dy.T @ x for the weight gradient), plus the doctor's 8192^3 square one. The best is the
             planner's `matmul_tflops` (the achievable GEMM ceiling); the layer's linears together (FLOPs over
             time, each weight as often as the layer has it) over that ceiling are `eff.linear`.
  attention  torch SDPA, causal, forward+backward, at MHA head dim 128 and MLA's q/k 192 / v 128; FLOPs counted
             on the causal half (as planner/memory.py counts them). Rate over the ceiling = `eff.attention` (the
             mean of the two: the planner has one factor for every model).
  grouped    the MoE experts' three GEMMs forward+backward through `models.deepseek.grouped_mm` (the engine's
             call: torch._grouped_mm on Hopper+ in bf16, else the per-expert loop), tokens spread evenly.
             cost.py scales `eff.grouped` by rows / (rows + GROUPED_HALF_ROWS) for rows per expert, so the
             measured ratio is divided by that factor at the measured rows: the planner then reproduces this
             measurement at this shape.
  hbm        a device-to-device copy, bytes read plus written (the doctor's convention), the planner's `hbm_gbps`.
Collective bus bandwidths are the doctor's (hardware/probe.py); run.py takes them from the profile.

The functions take a device and `Shapes` so that the unit tests run them on the CPU with tiny sizes (fp32 there).

Shape suffixes: models/deepseek.py's legend (M the rows of a GEMM, Q/U the q/k and v head dims).
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any, Callable

import torch
import torch.nn.functional as F

from paraseek.hardware.probe import ProbeConfig

SCHEMA = "paraseek.calibration/1"


@dataclass(frozen=True)
class Shapes:
    """What is measured. Defaults: DeepSeek-LLM-7B (dim 4096, FFN 11008, 32 heads of 128), V2-Lite's MoE (64
    experts of width 1408 on dim 2048, top-6), MLA's head dims (q/k 192 = 128 nope + 64 rope, v 128)."""

    tokens: int = 8192  # rows of the dense GEMMs: one micro-batch of 2 x 4096 tokens
    dim: int = 4096
    ffn: int = 11008
    square: int = ProbeConfig.matmul_n  # the doctor's n^3 GEMM, comparable with its matmul_tflops
    batch: int = 2
    heads: int = 32
    seq: int = 4096
    head_dim: int = 128
    mla_qk_dim: int = 192
    mla_v_dim: int = 128
    experts: int = 64
    expert_dim: int = 2048
    expert_inter: int = 1408
    top_k: int = 6
    expert_tokens: int = 8192  # 8192 x 6 / 64 = 768 rows per expert
    copy_bytes: int = ProbeConfig.hbm_bytes  # capped at 1/8 of the GPU's memory, as the doctor does
    warmup: int = 5  # past cuBLAS heuristics, autotuning and clock ramp-up
    reps: int = 20


# For the unit tests: every measurement runs in milliseconds on a CPU.
TINY = Shapes(tokens=64, dim=32, ffn=48, square=64, batch=1, heads=2, seq=32, head_dim=16, mla_qk_dim=24,
              mla_v_dim=16, experts=4, expert_dim=32, expert_inter=24, top_k=2, expert_tokens=64,
              copy_bytes=1 << 20, warmup=2, reps=5)


def _dtype(device: torch.device) -> torch.dtype:
    # bf16 is what training runs; V100 (sm70) has none, so fp16 there, as the planner's datasheet rate assumes.
    # On the CPU (tests only) fp32: CPU bf16 kernels are slow and say nothing about a GPU.
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16


def _sig(x: float) -> float:
    """4 significant digits: readable in the JSON, and never rounds a tiny CPU rate to 0."""
    return float(f"{x:.4g}")


def median_seconds(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int) -> float:
    """Median seconds of one call of fn after `warmup` untimed calls. On CUDA every call sits between its own
    pair of events, all queued without a host sync in between, so launch gaps between calls are not counted."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda.synchronize(device)
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) / 1e3 for start, end in events)


def gemm_rates(device: torch.device, s: Shapes) -> list[dict[str, Any]]:
    """TFLOP/s of each GEMM of a transformer layer's linears (M tokens, weight [O, I]) in the layouts autograd runs
    them, `fwd` x @ w.T, `dgrad` dy @ w (the input's gradient) and `wgrad` dy.T @ x (the weight's), and of the
    square one. `count`: how many weights of that shape one layer has (q, k, v, o; gate, up; down)."""
    dtype = _dtype(device)
    M, D, Fd = s.tokens, s.dim, s.ffn
    out = []

    def run(name: str, layout: str, a: torch.Tensor, b: torch.Tensor, count: int) -> None:
        sec = median_seconds(lambda: a @ b, device, s.warmup, s.reps)
        m, k, n = a.shape[0], a.shape[1], b.shape[1]
        out.append({"name": name, "layout": layout, "m": m, "n": n, "k": k, "count": count, "ms": _sig(sec * 1e3),
                    "tflops": _sig(2 * m * n * k / sec / 1e12)})

    for name, (O, I), count in (("q/k/v/o", (D, D), 4), ("gate/up", (Fd, D), 2), ("down", (D, Fd), 1)):
        # random data: zeros (and other constant data) run measurably faster on tensor cores
        x_MI = torch.randn(M, I, device=device, dtype=dtype)
        w_OI = torch.randn(O, I, device=device, dtype=dtype)
        dy_MO = torch.randn(M, O, device=device, dtype=dtype)
        run(name, "fwd", x_MI, w_OI.t(), count)
        run(name, "dgrad", dy_MO, w_OI, count)
        run(name, "wgrad", dy_MO.t(), x_MI, count)
        del x_MI, w_OI, dy_MO
    n = s.square
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    run("square", "a @ b", a, b, 0)  # the doctor's
    return out


def attention_tflops(device: torch.device, batch: int, heads: int, seq: int, qk_dim: int, v_dim: int,
                     warmup: int, reps: int) -> float:
    """Causal SDPA forward+backward TFLOP/s, counting the causal half of the score and value matmuls:
    3 (fwd + 2x bwd) x 2 x B x H x T^2 x (d_qk + d_v) / 2, the planner's count (planner/memory.py attn_flops)."""
    dtype = _dtype(device)
    B, H, T = batch, heads, seq
    q_BHTQ = torch.randn(B, H, T, qk_dim, device=device, dtype=dtype, requires_grad=True)
    k_BHTQ = torch.randn(B, H, T, qk_dim, device=device, dtype=dtype, requires_grad=True)
    v_BHTU = torch.randn(B, H, T, v_dim, device=device, dtype=dtype, requires_grad=True)
    do_BHTU = torch.randn(B, H, T, v_dim, device=device, dtype=dtype)

    def step() -> None:
        o_BHTU = F.scaled_dot_product_attention(q_BHTQ, k_BHTQ, v_BHTU, is_causal=True)
        torch.autograd.grad(o_BHTU, (q_BHTQ, k_BHTQ, v_BHTU), do_BHTU)  # grads returned, not accumulated

    sec = median_seconds(step, device, warmup, reps)
    return 3 * 2 * B * H * T * T * (qk_dim + v_dim) / 2 / sec / 1e12


def grouped_rate(device: torch.device, s: Shapes) -> dict[str, Any]:
    """TFLOP/s of the routed experts' GEMMs (gate, up, down) forward+backward, as the engine runs them
    (models.deepseek.grouped_mm), with expert_tokens x top_k rows spread evenly over the experts (load imbalance
    is priced separately, cost.py's MOE_IMBALANCE). No SwiGLU in between: elementwise work is priced apart."""
    from paraseek.models.deepseek import _use_grouped_mm, grouped_mm

    dtype = _dtype(device)
    E, D, Fe = s.experts, s.expert_dim, s.expert_inter
    rows = s.expert_tokens * s.top_k // E  # per expert
    M = rows * E
    counts_E = torch.full((E,), rows, device=device, dtype=torch.int64)
    x_MD = torch.randn(M, D, device=device, dtype=dtype, requires_grad=True)
    w_gate_EFD = (torch.randn(E, Fe, D, device=device, dtype=dtype) * D**-0.5).requires_grad_(True)
    w_up_EFD = (torch.randn(E, Fe, D, device=device, dtype=dtype) * D**-0.5).requires_grad_(True)
    w_down_EDF = (torch.randn(E, D, Fe, device=device, dtype=dtype) * Fe**-0.5).requires_grad_(True)
    dy_MD = torch.randn(M, D, device=device, dtype=dtype)
    du_MF = torch.randn(M, Fe, device=device, dtype=dtype)

    def step() -> None:
        g_MF = grouped_mm(x_MD, w_gate_EFD, counts_E)
        u_MF = grouped_mm(x_MD, w_up_EFD, counts_E)
        y_MD = grouped_mm(g_MF, w_down_EDF, counts_E)
        # u's gradient is fed directly (no elementwise product), so the three GEMMs' backward is all that runs
        torch.autograd.grad((y_MD, u_MF), (x_MD, w_gate_EFD, w_up_EFD, w_down_EDF), (dy_MD, du_MF))

    sec = median_seconds(step, device, s.warmup, s.reps)
    flops = 3 * 2 * M * 3 * Fe * D  # (fwd + 2x bwd) x 2 x rows x three [Fe, D] GEMMs
    return {"impl": "torch._grouped_mm" if _use_grouped_mm(x_MD) else "per-expert loop", "experts": E, "dim": D,
            "inter": Fe, "top_k": s.top_k, "tokens": s.expert_tokens, "rows_per_expert": rows, "ms": _sig(sec * 1e3),
            "tflops": _sig(flops / sec / 1e12)}


def copy_gbps(device: torch.device, nbytes: int, warmup: int, reps: int) -> float:
    """Device-memory bandwidth of a copy, bytes read plus written (probe.measure_compute's convention)."""
    if device.type == "cuda":
        nbytes = min(nbytes, torch.cuda.get_device_properties(device).total_memory // 8)
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    sec = median_seconds(lambda: y.copy_(x), device, warmup, reps)
    return 2 * nbytes / sec / 1e9


def calibrate(device: torch.device, s: Shapes = Shapes()) -> dict[str, Any]:
    """The profile's "calibration" section: every measurement, and the rates the planner uses (`matmul_tflops`,
    `hbm_gbps`, `efficiency`: linear, attention, grouped), which plan.load_profile reads."""
    from paraseek.planner.cost import GROUPED_HALF_ROWS

    if device.type == "cuda":
        torch.cuda.set_device(device)  # events record on the current device's stream
    gemm = gemm_rates(device, s)
    best = max(r["tflops"] for r in gemm)
    layer = [r for r in gemm if r["count"]]
    # The layer's linears as they run: total FLOPs over total time, each shape as often as the layer has it.
    linear = (sum(r["count"] * 2 * r["m"] * r["n"] * r["k"] for r in layer)
              / sum(r["count"] * r["ms"] / 1e3 for r in layer) / 1e12)
    attention = []
    for name, qk, v in (("MHA", s.head_dim, s.head_dim), ("MLA", s.mla_qk_dim, s.mla_v_dim)):
        t = attention_tflops(device, s.batch, s.heads, s.seq, qk, v, s.warmup, s.reps)
        attention.append({"name": name, "batch": s.batch, "heads": s.heads, "seq": s.seq, "qk_dim": qk, "v_dim": v,
                          "tflops": _sig(t), "ratio": _sig(t / best)})
    grouped = grouped_rate(device, s)
    rows = grouped["rows_per_expert"]
    # cost.py prices experts at eff.grouped x rows / (rows + GROUPED_HALF_ROWS): undo that factor at this shape.
    grouped["ratio"] = _sig(grouped["tflops"] / best)
    grouped_eff = grouped["ratio"] / (rows / (rows + GROUPED_HALF_ROWS))
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the copy's two buffers need the room
    hbm = copy_gbps(device, s.copy_bytes, s.warmup, s.reps)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "source": "paraseek bench --calibrate",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": str(_dtype(device)).removeprefix("torch."),
        "shapes": asdict(s),
        # the rates the planner reads
        "matmul_tflops": best,
        "hbm_gbps": _sig(hbm),
        # fractions of the ceiling: at most 1 (more is timing noise, seen on loaded CPUs, never a faster kernel)
        "efficiency": {
            "linear": _sig(min(1.0, linear / best)),
            "attention": _sig(min(1.0, statistics.mean(a["ratio"] for a in attention))),
            "grouped": _sig(min(1.0, grouped_eff)),
        },
        # what they come from
        "gemm": gemm,
        "gemm_median_tflops": _sig(statistics.median(r["tflops"] for r in gemm)),
        "linear_tflops": _sig(linear),
        "attention": attention,
        "grouped": grouped,
    }
