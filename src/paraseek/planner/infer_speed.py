"""Inference speed: the engine's steps priced kernel by kernel, and its continuous batching replayed step by step.

A step is the kernels infer/model.py's forward launches for that step's tokens (counted per layer in `step_ops`,
kernel by kernel as the decode profiles list them), each priced as
    latency + max(bytes / (hbm x HBM rate), FLOPs / (gemm x GEMM rate))
and the fused-MoE kernels as latency + bytes / ... + FLOPs / ... (their tiles load, then multiply: the two add up in
the measured timings, see KERNELS). HBM rate and GEMM rate are the cluster's (c.hbm_gbps, c.matmul_tflops: a doctor
profile's measured ones, else the datasheet's times the generation's efficiency); the latencies and fractions are
KERNELS below, fitted on one H200. A step is one rank's: its layout (`Layout`: tp, ep, dp-attention) says which
weights and rows its kernels read, and its collectives (`collective_seconds`) are priced as training's, at the
cluster's bus bandwidth (planner/cost.py's collective).

The host: a decode-only step replays a CUDA graph of the whole forward; any step with a prefill chunk runs eagerly,
each operation issued from Python. The engine builds and launches step k+1 while the GPU runs step k (overlapped
greedy steps, infer/engine.py), so a step lasts max(GPU time, host time) (their sum when a replica has several
ranks, where the engine reads each step back first), the host's being HOST's per-step and per-sequence costs and,
for an eager step, its host calls (counted in `step_ops`) and decode rows.

Offline workloads (`bench-infer`'s throughput and concurrency runs) are replayed through the scheduler's rules
(infer/scheduler.py: decodes first, then prefill chunks, then admissions in order under max_batched_tokens and
max_num_seqs, KV blocks allocated as tokens are computed, preemption of the newest request when blocks run out) and
each step priced as above.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from paraseek.models.args import ModelArgs


@dataclass(frozen=True)
class KernelClass:
    latency_s: float  # per launch: its time with no work (inside a CUDA graph; an eager launch adds HOST's)
    hbm: float = 1.0  # fraction of c.hbm_gbps its bytes move at (above 1: it only reads; a copy reads and writes)
    gemm: float = 1.0  # fraction of c.matmul_tflops its FLOPs run at
    serial: bool = False  # bytes and FLOPs add up instead of overlapping


# Per-kernel-class terms, fitted on one H200: fractions of the planner's H200 rates (c.hbm_gbps 4,080 GB/s,
# c.matmul_tflops 791 TFLOP/s; the runs below measured a 4,134-4,222 GB/s copy and a 752-795 TFLOP/s GEMM).
# Files under benchmarks/:
#   small     norms, rope + cache write, silu, the split-KV combine, route, align, the MoE combine, casts, copies:
#             2.2 us, the median of 2026-12-01/decode-profile-8b-b1.txt (rms_norm 2.1 us, rope 2.4, combine 1.8,
#             silu 1.5, split-K reduce 1.7) and 2026-12-04/v2lite-decode-profile-b1-fused-moe-aligned.txt (1.8,
#             3.1, 2.7, 2.4, 2.1, 3.4, 1.5: a V2-Lite MoE layer's 11 small kernels sum to 23.5 us, priced 24.2);
#             their bytes (large batches, prefill) at the copy rate.
#   gemm      the projections (cuBLAS): 3.8 us + bytes at 1.07 x 4,080 = 4.35 TB/s, the least-squares line through
#             the 8B profile's gate|up 56.3 us (235 MB), down 31.4 (117 MB, with its split-K reduce), q|k|v 15.5
#             (50 MB), o 12.6 (34 MB), head 244 (1,051 MB) and the V2-Lite profile's head 104.7 (419 MB), in_proj +
#             o 12.1 (23 MB), W_UK / W_UV 3.5 / 3.2 (2 MB), dense gate|up 24.8 (90 MB), down 14.8 (45 MB). FLOPs at
#             0.80 of the GEMM rate: the 8B's decode at 256 sequences
#             (2026-12-01/bench-infer-8b-vs-hf-generate.json, concurrency rows: 13.14 ms a step, priced 13.2) and its
#             offline run, whose prefills are compute-bound (same file: 9,312 output tokens/s, priced 9,115).
#   moe       the fused-MoE gate|up and down kernels (infer/moe_kernels.py) over the experts some token routes to
#             and the shared ones, loads and multiplies in turn: 2026-12-04/fused-moe-tuning-v2lite-h200.txt
#             (router + route + align + both kernels + combine, 1 to 512 tokens: 55.8 to 528.2 us) is priced
#             within 7% at every size: bytes at 4.53 TB/s (from 1 to 64 tokens, 138 MB to 1,142 MB) and FLOPs at
#             285 TFLOP/s (from 64 to 512 tokens), 4.5 us a kernel (the V2-Lite profile's 25.5 + 14.0 us at
#             batch 1).
#   grouped   the sorted grouped GEMMs (torch._grouped_mm) beyond infer/model.py's FUSED_MAX_SLOTS: the touched
#             experts' bytes, then FLOPs at 0.50 of the GEMM rate, fitted to V2-Lite's prefill of 64 prompts of
#             2,048 tokens (2026-12-04/bench-infer-fused-moe-all-shapes.json, the concurrency row: its wall time
#             less its decode steps, 139 ms a step of 8,192 tokens); fused-moe-tuning's sorted path at 512 tokens
#             (578 us, the training layer's) is priced 11% lower.
#   decode_*  the paged split-KV decode kernel (infer/kernels.py) over K/V (GQA) or the latent (MLA): 8.6 us, with
#             its combine's 2.2, from the profiles at batch 1 (8B: 9.3 + 1.8 us; V2-Lite: 8.3 + 2.7); GQA at
#             0.86 x 4,080 = 3.5 TB/s and MLA (H=16 heads a program: the latent read once per 16) at 0.54 = 2.2 TB/s,
#             the rates infer/kernels.py's docstring measured at B=32 x 4K (GQA) and B=128 x 2K (MLA); V2-Lite's
#             64 x 2,048 decode (bench-infer-fused-moe-all-shapes.json: 11.64 ms a step) is priced 11.4. MLA's
#             FLOPs (scores over C + R, values over C, per head) at 0.14 of the GEMM rate: the same docstring's
#             H=128 at B=64 x 2K, 334 us for 36.5 GFLOP (compute-bound from 64 heads on: DeepSeek-V3's 128).
#   gemv      the decode GEMV kernel (infer/gemv.py) on the shapes and row buckets infer/gemv_configs.json lists for
#             the GPU (where it measured faster than cuBLAS): 4.2 us + bytes at 1.10 x 4,080 = 4.49 TB/s, the line
#             through its one-row times in 2026-12-04/gemv-tune-h200.txt (the 8B's q|k|v 15.4 us for 50 MB and
#             gate|up 56.5 us for 235 MB; its other 8 shapes, 34 MB to 1,051 MB, within 6% of the line). In the same
#             file cuBLAS ran 4-21% slower on those shapes than the kernel.
#   prefill_attn  flash attention's varlen forward over the chunks' causal pairs: not fitted (no prefill attention
#             was timed alone; it is at most a few % of these workloads' prefill FLOPs): half of the GEMM rate.
KERNELS = {
    "small": KernelClass(2.2e-6, hbm=1.0),
    "gemm": KernelClass(3.8e-6, hbm=1.07, gemm=0.80),
    "gemv": KernelClass(4.2e-6, hbm=1.10, gemm=0.80),
    "moe": KernelClass(4.5e-6, hbm=1.11, gemm=0.36, serial=True),
    "grouped": KernelClass(10e-6, hbm=1.11, gemm=0.50, serial=True),
    "decode_gqa": KernelClass(8.6e-6, hbm=0.86),
    "decode_mla": KernelClass(8.6e-6, hbm=0.54, gemm=0.14),
    "prefill_attn": KernelClass(10e-6, hbm=1.0, gemm=0.50),
}


@dataclass(frozen=True)
class HostCosts:
    step_s: float  # per step: scheduling, the step's inputs to the device, the sampled tokens back
    eager_step_s: float  # per eager step besides its calls: its host arrays built, pinned and copied
    seq_s: float  # per running sequence per step: its scheduling, input rows, block table, delivery
    eager_seq_s: float  # per decode row of an eager step, beyond its calls
    call_s: float  # per host call of an eager step (step_ops' count: kernel launches, allocations, views)
    first_token_s: float  # a request's first token after its prefill step: the next step's launch, the read-back


# Host terms, fitted on 2026-12-04/bench-infer-fused-moe-all-shapes.json unless said. call_s and the intercept
# step_s + eager_step_s + first_token_s = 2.85 ms: the two times to first token of a lone 128-token prompt (the
# 1.5B's 12.2 ms for 654 host calls, V2-Lite's 19.8 ms for 1,186; host-bound: their kernels take 2.1 and 9.7 ms).
# seq_s, eager_seq_s and the split of the intercept: the offline runs at 256 sequences, where most eager steps
# (prefill chunks beside 256 decodes) are host-bound (the 1.5B: 14.8 s, 1,422 steps, 528 of them eager, priced
# 15.7 s; V2-Lite: 18.5 s, 917 steps, priced 17.5 s), and the 1.5B at 1,024 sequences
# (2026-12-01/bench-infer-1.5b-vs-hf-generate-and-stress.json, older code: 7.36 s, priced 6.85 s). step_s: not seen
# (every measured graph step was GPU-bound); the order of the profile's engine step less its replay at batch 1
# (2026-12-01/bench-infer-8b-decode-profile-and-serve.json: 4.94 - 4.67 ms).
HOST = HostCosts(step_s=0.3e-3, eager_step_s=2.0e-3, seq_s=12e-6, eager_seq_s=20e-6, call_s=14.3e-6,
                 first_token_s=0.55e-3)

# Between two kernels of a CUDA graph: (replay - the kernels' sum) / kernels, 8B (4.72 - 4.58 ms) / 392 = 0.37 us
# (2026-12-01/decode-profile-8b-b1.txt), V2-Lite (2.68 - 2.53 ms) / 495 = 0.29 us (2026-12-04/v2lite-decode-profile-
# b1-fused-moe-aligned.txt).
GRAPH_GAP_S = 0.33e-6

# infer/model.py's FUSED_MAX_SLOTS (copied: that module imports torch): token-expert slots up to which a MoE layer
# runs the fused kernels (Hopper); beyond, the sorted grouped GEMMs.
FUSED_MAX_SLOTS = 4096


def graph_batch(n: int, max_num_seqs: int) -> int:
    """The captured batch a decode step of n sequences replays (copied from infer/engine.py's _graph_batch_sizes,
    which imports torch: 1, 2, 4, 8, then every 16 up to 256, every 32 up to 1,024, and max_num_seqs)."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return next((s for s in sizes if s >= n and s < max_num_seqs), max_num_seqs)


def touched_experts(n_tokens: int, top_k: int, n_experts: int) -> float:
    """Expected routed experts some token of n_tokens picks, each token picking top_k of n_experts uniformly:
    E x (1 - (1 - K/E)^n)."""
    return n_experts * (1 - (1 - top_k / n_experts) ** n_tokens) if n_experts else 0.0


@dataclass(frozen=True)
class Layout:
    """How the engine splits one model replica over its GPUs (its --tp, --ep, --dp-attention; infer/tp.py, infer/ep.py):
    tp cuts attention by heads and the dense MLPs, shared experts and vocabulary by width; ep > 1 gives each rank
    E/ep routed experts whole (tp is 1, or the same ranks: tp == ep); dp_attention (ep > 1, tp 1) has each rank run
    attention, the dense MLPs and the shared experts for its own requests over its own cache, the tokens of every
    rank gathered into the MoE layers and their outputs scattered back."""

    tp: int = 1
    ep: int = 1
    dp_attention: bool = False

    @staticmethod
    def of(x: Layout | int) -> Layout:
        """A tp degree alone is the tp layout."""
        return x if isinstance(x, Layout) else Layout(x)

    @property
    def ranks(self) -> int:
        """GPUs of one replica (infer/ep.py's model_ranks)."""
        return max(self.tp, self.ep)

    @property
    def attn_dp(self) -> int:
        """Request groups of one replica, each with its own cache and scheduler: its ranks under dp-attention."""
        return self.ep if self.dp_attention else 1

    @property
    def name(self) -> str:
        return f"tp{self.tp}" + (f" ep{self.ep}" if self.ep > 1 else "") + (" dp-attn" if self.dp_attention else "")

    def flags(self) -> list[str]:
        """The engine's flags for it (`paraseek serve`, `generate`)."""
        return ((["--tp", str(self.tp)] if self.tp > 1 else []) + (["--ep", str(self.ep)] if self.ep > 1 else [])
                + (["--dp-attention"] if self.dp_attention else []))


def rank_step_tokens(lay: Layout, max_batched_tokens: int) -> int:
    """The tokens one rank's step takes at most. Under dp-attention the ranks share the replica's budget, as SGLang
    divides its chunked-prefill size by the dp size: a rank takes max_batched_tokens / ep, so the MoE layers' gathered
    step stays max_batched_tokens rows (their workspace that of replicated attention's step)."""
    return max(1, max_batched_tokens // lay.attn_dp)


@dataclass
class StepShape:
    """One engine step: n_decode one-token rows over contexts summing to decode_ctx, and prefill chunks (queries,
    keys = the chunk's whole context so far)."""

    n_decode: int = 0
    decode_ctx: int = 0
    chunks: list[tuple[int, int]] = field(default_factory=list)
    graph_rows: int = 0  # a CUDA-graph step: the captured batch (padding rows included); 0 = eager

    @property
    def n_tokens(self) -> int:
        return max(self.graph_rows, self.n_decode + sum(q for q, _ in self.chunks))


@functools.lru_cache(maxsize=None)
def gemv_shapes(gpu: str) -> frozenset:
    """(N, K, row bucket) of the projections infer/gemv_configs.json gives the decode GEMV on this GPU type (the file is
    keyed by CUDA device names, e.g. "NVIDIA H200" for "H200"); read as JSON, without torch."""
    import json
    from pathlib import Path

    path = Path(__file__).parents[1] / "infer" / "gemv_configs.json"  # data only: the planner imports no infer code
    data = json.loads(path.read_text()) if path.is_file() else {}
    out = set()
    for device, shapes in data.items():
        if device.split()[-1] != gpu:
            continue
        for key, entry in shapes.items():
            n, k = (int(part.split("=")[1]) for part in key.split(","))
            out.update((n, k, int(bucket)) for bucket in entry.get("configs", {}))
    return frozenset(out)


def _bucket(rows: int) -> int:
    return next(b for b in (1, 2, 4, 8, 16) if b >= rows)


def step_ops(a: ModelArgs, tp: Layout | int, wb: float, s: StepShape,
             gemv: frozenset = frozenset()) -> list[tuple[str, str, int, int, float, float]]:
    """(name, kernel class, kernels launched, host calls when eager, bytes, FLOPs) of every operation of a step on one
    rank of the layout (a tp degree: tp alone), summed over the layers: infer/model.py's forward with the Triton
    kernels on. Under dp-attention `s` is the rank's own rows, and its MoE layers take every rank's (ep x its rows:
    the ranks are alike, the gathered rows padded to the largest rank's). Under ep the routed experts are the rank's
    E/ep whole (every token's K slots computed, the other ranks' ones on local expert 0 weighted 0: infer/ep.py's
    local_slots), the shared experts their own MLP (width n_shared x F / tp) beside the fused launch. Decode: q|k|v
    (MLA: the fused input projection, the W_UK and W_UV products around the latent attention), rope + cache write, the
    split-KV decode and its combine, o, two fused add+norms, gate|up, silu, down; MoE: the router's cast and GEMM,
    route, then align + fused gate|up + fused down + combine, or the sorted grouped path beyond FUSED_MAX_SLOTS.
    Prefill chunks: the context's K/V gathered, flash attention (MLA: the latents expanded through kv_b). Host calls
    count what an eager step's Python issues for the op (the kernels, their output allocations, views, slices and
    the checks around them, read off the forward), which a CUDA graph replays without."""
    lay = Layout.of(tp)
    tp = lay.tp
    N, nd, ctx = s.n_tokens, s.n_decode, s.decode_ctx
    npre = sum(q for q, _ in s.chunks)
    pairs = sum(q * k - q * (q - 1) / 2 for q, k in s.chunks)  # causal query-key pairs of the chunks
    kctx = sum(k for _, k in s.chunks)
    n_sample = s.graph_rows or nd + len(s.chunks)
    D, B2 = a.dim, 2  # activations and the cache are bf16
    ops: list[tuple[str, str, int, int, float, float]] = []
    L = a.n_layers

    def op(name, kind, launches, host, nbytes=0.0, flops=0.0, layers=L):
        if layers:
            ops.append((name, kind, launches * layers, host * layers, nbytes * layers, flops * layers))

    def linear(name, n_in, n_out, rows=N, layers=L, bias=False, host=1):
        kind = "gemv" if rows <= 16 and wb == 2 and (n_out, n_in, _bucket(rows)) in gemv else "gemm"
        op(name, kind, 1, host, wb * n_in * n_out + B2 * rows * (n_in + n_out) + (B2 * n_out if bias else 0),
           2 * rows * n_in * n_out, layers)

    # ---- attention ----
    H = a.n_heads // tp
    if a.is_mla:
        C, R, nope, V, qk = a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim, a.v_head_dim, a.qk_head_dim
        linear("in_proj", D, (a.q_lora_rank or H * qk) + C + R, host=3)  # + split, view
        if a.q_lora_rank:
            op("q_a_norm", "small", 1, 2, B2 * N * a.q_lora_rank * 2)
            linear("q_b", a.q_lora_rank, H * qk)
        op("mla_prepare", "small", 1, 3, B2 * N * (C + R + H * R) * 2)  # + q_pe slice, the output's allocation
        if nd:
            op("w_uk", "gemm", 1, 3, wb * H * nope * C + B2 * nd * H * (nope + C), 2 * nd * H * nope * C)
            reads = -(-H // (64 if H >= 64 else 16))  # the latent is read once per program of 16 (64) heads
            op("decode_attention", "decode_mla", 1, 5, B2 * ctx * (C + R) * reads, 2 * ctx * H * (C + R + C))
            op("decode_combine", "small", 1, 2, 4 * 2 * nd * H * C)
            op("w_uv", "gemm", 1, 3, wb * H * C * V + B2 * nd * H * (C + V), 2 * nd * H * C * V)
            op("decode_out_copy", "small", 1, 1, B2 * nd * H * V * 2)
        if s.chunks:  # expanded: the context's latents through kv_b to per-head keys and values
            op("context_gather", "small", 1, 2, B2 * kctx * (C + R) * 2)
            op("kv_b", "gemm", 1, 2, wb * C * H * (nope + V) + B2 * kctx * (C + H * (nope + V)),
               2 * kctx * C * H * (nope + V))
            op("k_concat", "small", 2, 5, B2 * kctx * H * qk * 2)  # rope key broadcast to the heads, cat; v padded
            op("prefill_attention", "prefill_attn", 1, 3, B2 * (npre * H * (qk + V) + kctx * H * (qk + V)),
               2 * pairs * H * (qk + V))
            op("prefill_out_copy", "small", 1, 2, B2 * npre * H * V * 2)
        linear("o", H * V, D, host=2)
    else:
        G, Dh = max(a.n_kv_heads // tp, 1), a.head_dim
        linear("qkv", D, (H + 2 * G) * Dh, bias=a.qkv_bias, host=3)  # + the q slice and view
        op("rope_write_kv", "small", 1, 1, B2 * N * (H + 2 * G) * Dh * 2)
        if nd:
            op("decode_attention", "decode_gqa", 1, 6, B2 * ctx * 2 * G * Dh, 4 * ctx * H * Dh)
            op("decode_combine", "small", 1, 1, 4 * 2 * nd * H * Dh)
        if s.chunks:
            op("context_gather", "small", 2, 3, B2 * kctx * G * Dh * 2)
            op("prefill_attention", "prefill_attn", 1, 2, B2 * (npre * H * Dh * 2 + kctx * 2 * G * Dh),
               2 * pairs * H * 2 * Dh)
            op("prefill_out_copy", "small", 1 + (nd > 0), 3 + 2 * (nd > 0), B2 * N * H * Dh * 2)
        linear("o", H * Dh, D, bias=a.o_bias, host=2)
    op("add_rms_norm", "small", 2, 4, B2 * N * D * 3 * 2)
    # ---- MLP / MoE ----
    moe_layers = sum(a.is_moe_layer(i) for i in range(L))
    dense_layers = L - moe_layers
    F = a.inter_dim // tp
    linear("gate_up", D, 2 * F, layers=dense_layers)
    op("silu_mul", "small", 1, 2, B2 * N * 3 * F, layers=dense_layers)
    linear("down", F, D, layers=dense_layers)
    if moe_layers:
        E, K, ns = a.n_routed_experts, a.n_activated_experts, a.n_shared_experts
        M = N * lay.attn_dp  # the MoE layers' rows: every rank's under dp-attention
        op("router_cast", "small", 1, 1, M * D * (B2 + 4), layers=moe_layers)
        op("router", "gemm", 1, 1, 4 * D * E + 4 * M * (D + E), 2 * M * D * E, layers=moe_layers)
        op("route", "small", 1, 4, 4 * M * E, layers=moe_layers)
        if lay.ep > 1:
            Fm, Kt, El = a.moe_inter_dim, K, E // lay.ep
            # This rank's experts some token picked, and local expert 0, which takes the other ranks' slots.
            read = wb * 3 * Fm * D * (1 + (El - 1) * touched_experts(M, K, E) / E)
            if ns:  # the shared experts' own MLP, on the rank's own rows, added after the routed sum
                Fs, rows = ns * a.moe_inter_dim // tp, s.n_tokens
                linear("shared_gate_up", D, 2 * Fs, rows=rows, layers=moe_layers)
                op("shared_silu_mul", "small", 1, 2, B2 * rows * 3 * Fs, layers=moe_layers)
                linear("shared_down", Fs, D, rows=rows, layers=moe_layers)
                op("shared_add", "small", 1, 1, B2 * rows * D * 3, layers=moe_layers)
        else:  # the shared experts ride in the fused launch as n_shared more experts of every token
            Fm, Kt = a.moe_inter_dim // tp, K + ns
            read = wb * 3 * Fm * D * (ns + touched_experts(M, K, E))  # the weights of the experts some token picked
        if M * Kt <= FUSED_MAX_SLOTS:
            op("moe_align", "small", 1, 5, 4 * M * Kt * 2, layers=moe_layers)
            op("moe_gate_up", "moe", 1, 2, read * 2 / 3 + B2 * M * Kt * (D + Fm), 2 * M * Kt * D * 2 * Fm,
               layers=moe_layers)
            op("moe_down", "moe", 1, 2, read / 3 + B2 * M * Kt * Fm + 4 * M * Kt * D, 2 * M * Kt * Fm * D,
               layers=moe_layers)
            op("moe_combine", "small", 1, 2, 4 * M * Kt * D + B2 * M * D, layers=moe_layers)
        else:  # argsort, counts, gather, grouped gate|up, silu, grouped down, scatter, weighted sum
            op("moe_grouped_gemm", "grouped", 2, 6, read + B2 * M * Kt * (D + 3 * Fm + D),
               2 * M * Kt * 3 * Fm * D, layers=moe_layers)
            op("moe_sort_gather_sum", "small", 9, 24, B2 * M * Kt * (2 * D + 3 * Fm + 2 * D) + 4 * M * Kt * D * 2,
               layers=moe_layers)
    # ---- outside the layers ----
    op("embedding_norm", "small", 2, 2, B2 * N * D * 3, layers=1)
    op("final_norm", "small", 1, 1 + (not s.graph_rows), B2 * n_sample * D * 2, layers=1)
    vocab = -(-a.vocab_size // tp)
    linear("head", D, vocab, rows=n_sample, layers=1)
    # The step's inputs to the device (an eager step: each array pinned, then copied; a graph step fills pinned
    # twins), the previous step's tokens patched in, the argmax and its copy back.
    op("inputs", "small", 5, 30 if not s.graph_rows else 14, layers=1)
    op("argmax", "small", 1, 3, B2 * n_sample * vocab, layers=1)
    return ops


def op_seconds(c, kind: str, nbytes: float, flops: float, launches: int) -> float:
    k = KERNELS[kind]
    mem = nbytes / (k.hbm * c.hbm_gbps * 1e9)
    comp = flops / (k.gemm * c.matmul_tflops * 1e12)
    return launches * (k.latency_s + GRAPH_GAP_S) + (mem + comp if k.serial else max(mem, comp))


def collective_seconds(a: ModelArgs, c, lay: Layout, rows: int) -> float:
    """A step's collectives on one rank of the layout, `rows` its own rows, bf16 activations of width D, priced as
    training's (cost.collective: the cluster's bus bandwidth for a group of that size, plus a latency):
      tp > 1: Megatron's two all-reduces a layer of [rows, D] (infer/model.py's _all_reduce; under tp == ep the
        routed and shared sums ride in the one after the MoE);
      ep > 1 at tp 1: one all-reduce of [rows, D] a MoE layer (MoELayer.forward's, the ranks' routed sums);
      dp-attention: a MoE layer all-gathers every rank's rows, [ep x rows, D], and reduce-scatters its outputs back."""
    from paraseek.planner.cost import collective

    moe_layers = sum(a.is_moe_layer(i) for i in range(a.n_layers))
    row = 2 * a.dim
    if lay.tp > 1:
        return 2 * a.n_layers * collective(c, rows * row, 1, lay.tp, "all_reduce")
    if lay.dp_attention:
        full = lay.ep * rows * row
        return moe_layers * (collective(c, full, 1, lay.ep, "all_gather")
                             + collective(c, full, 1, lay.ep, "reduce_scatter"))
    return moe_layers * collective(c, rows * row, 1, lay.ep, "all_reduce")


def step_seconds(a: ModelArgs, c, tp: Layout | int, wb: float, s: StepShape, running: int = 0,
                 breakdown: dict | None = None) -> float:
    """One step's duration on a rank of the layout (a tp degree: tp alone): max(its kernels' GPU time (+ its
    collectives), the host's time to build and launch it), or their sum when the replica has several ranks."""
    lay = Layout.of(tp)
    gpu = calls = 0.0
    for name, kind, n, host, nbytes, flops in step_ops(a, lay, wb, s, gemv_shapes(c.gpu.name)):
        t = op_seconds(c, kind, nbytes, flops, n)
        gpu += t
        calls += host
        if breakdown is not None:
            breakdown[name] = breakdown.get(name, 0.0) + t
    if lay.ranks > 1:
        comm = collective_seconds(a, c, lay, s.n_tokens)
        gpu += comm
        if breakdown is not None:
            breakdown["collectives"] = comm
    host = HOST.step_s + HOST.seq_s * (running or s.n_decode + len(s.chunks))
    if not s.graph_rows:
        host += HOST.eager_step_s + HOST.call_s * calls + HOST.eager_seq_s * s.n_decode
    if breakdown is not None:
        breakdown["gpu_s"], breakdown["host_s"] = gpu, host
    # One process overlaps a step's host work with the previous step's GPU time; with several ranks the engine reads
    # each step back before building the next (engine.step), so the two add up.
    return max(gpu, host) if lay.ranks == 1 else gpu + host


def decode_step_seconds(a: ModelArgs, c, tp: Layout | int, wb: float, batch: int, context: int, max_num_seqs: int,
                        breakdown: dict | None = None) -> float:
    """A decode-only step of `batch` sequences of `context` tokens each (the new one included), as a CUDA graph
    (under dp-attention `batch` is each rank's own)."""
    s = StepShape(batch, batch * context, [], graph_batch(batch, max(max_num_seqs, batch)))
    return step_seconds(a, c, tp, wb, s, batch, breakdown)


def prefill_seconds(a: ModelArgs, c, tp: Layout | int, wb: float, prompt_len: int, max_batched_tokens: int) -> float:
    """One prompt alone, in chunks of a rank's step tokens (rank_step_tokens), each an eager step."""
    step_tokens = rank_step_tokens(Layout.of(tp), max_batched_tokens)
    total, done = 0.0, 0
    while done < prompt_len:
        q = min(step_tokens, prompt_len - done)
        done += q
        total += step_seconds(a, c, tp, wb, StepShape(0, 0, [(q, done)]), 1)
    return total


def prefill_tokens_per_s(a: ModelArgs, c, tp: Layout | int, wb: float, prompt_len: int,
                         max_batched_tokens: int) -> float:
    """Prompt tokens a second of one replica with a queue of prompt_len-token prompts: steps of step_tokens //
    prompt_len whole prompts (one prompt in chunks when it is longer than a step); under dp-attention every rank
    prefills its own at once."""
    lay = Layout.of(tp)
    step_tokens = rank_step_tokens(lay, max_batched_tokens)
    if prompt_len >= step_tokens:
        return lay.attn_dp * prompt_len / prefill_seconds(a, c, lay, wb, prompt_len, max_batched_tokens)
    k = step_tokens // prompt_len
    return lay.attn_dp * k * prompt_len / step_seconds(a, c, lay, wb, StepShape(0, 0, [(prompt_len, prompt_len)] * k),
                                                       k)


# ---- continuous batching --------------------------------------------------------------------------------------------
@dataclass
class Replay:
    steps: list[tuple[StepShape, int]]  # each step and the sequences running in it
    first_token_step: list[int]  # per request, the step that sampled its first token
    preemptions: int


def replay(prompts: list[int], outputs: list[int], max_num_seqs: int, max_batched_tokens: int, kv_tokens: int,
           block_size: int = 16, overlapped: bool = True) -> Replay:
    """The steps infer/scheduler.py makes for these requests, all queued at once (offline). With the engine's
    overlapped steps (one process) a request whose last token was sampled holds its slot and blocks until the next
    step has been scheduled (its token is read back after that step's launch); without (tp > 1) it ends with the
    step. Requests are (prompt tokens, output tokens) forced to their length (ignore_eos); no prefix-cache hits
    (random prompts)."""
    import numpy as np

    n = len(prompts)
    P, O = np.asarray(prompts, dtype=np.int64), np.asarray(outputs, dtype=np.int64)
    comp = np.zeros(n, np.int64)  # tokens whose K/V are cached
    gen = np.zeros(n, np.int64)  # tokens sampled (the last may still be on the device)
    blocks = np.zeros(n, np.int64)
    last = np.zeros(n, bool)  # the request's last token is in flight: not scheduled, finished after this step
    first = [-1] * n
    free = kv_tokens // block_size
    waiting = list(range(n))[::-1]  # a stack: the next request to admit is waiting[-1]
    running: list[int] = []
    steps: list[tuple[StepShape, int]] = []
    preemptions = 0
    bs = block_size

    def preempt(r: int) -> None:
        nonlocal free, preemptions
        running.remove(r)
        free += int(blocks[r])
        blocks[r], comp[r] = 0, 0
        preemptions += 1
        if last[r]:  # its last token is read back after this step's launch: it finishes from the waiting queue
            last[r] = False
        else:
            waiting.append(r)

    def make_room(r: int, k: int, scheduled: set[int]) -> bool:
        """Blocks for k more of r's tokens, preempting the newest running requests not yet scheduled in this step
        (r itself, last) until they are free; False when r itself went."""
        while k > free:
            victim = next((v for v in reversed(running) if v not in scheduled), None)
            if victim is None:
                break
            preempt(victim)
            if victim == r:
                return False
        return k <= free

    while waiting or running:
        budget = max_batched_tokens
        run = np.asarray(running, dtype=np.int64)
        rem = P[run] + gen[run] - comp[run]
        dec = run[(rem == 1) & ~last[run]][:budget]
        need = np.maximum(-(-(comp[dec] + 1) // bs) - blocks[dec], 0)
        before = preemptions
        if need.sum() > free:  # one request at a time, as the scheduler goes
            kept: set[int] = set()
            for r, k in zip(dec.tolist(), need.tolist()):
                if r in running and make_room(r, k, kept):
                    free -= k
                    blocks[r] += k
                    kept.add(r)
            dec = np.asarray([r for r in dec.tolist() if r in kept], dtype=np.int64)
        else:
            free -= int(need.sum())
            blocks[dec] += need
        budget -= len(dec)
        chunks, sampled = [], []
        scheduled = set(dec.tolist())
        for r in run[rem > 1].tolist():
            if budget == 0:
                break
            q = min(int(P[r] + gen[r] - comp[r]), budget)
            k = max(0, -(-(comp[r] + q) // bs) - int(blocks[r]))
            if r not in running or not make_room(r, k, scheduled):
                continue
            free -= k
            blocks[r] += k
            scheduled.add(r)
            chunks.append((q, int(comp[r]) + q))
            sampled.append((r, q))
            budget -= q
        preempted = preemptions > before
        while waiting and budget > 0 and not preempted and len(running) < max_num_seqs:
            r = waiting[-1]
            q = min(int(P[r] + gen[r] - comp[r]), budget)
            k = -(-q // bs)
            if k > free:
                break
            waiting.pop()
            free -= k
            blocks[r] = k
            running.append(r)
            chunks.append((q, q))
            sampled.append((r, q))
            budget -= q
        if not len(dec) and not chunks:  # everything running has its last token in flight
            done = [r for r in running if last[r]]
            if not done:
                from paraseek.errors import UserError

                r = waiting[-1]
                raise UserError(f"a request of {int(P[r] + O[r]):,} tokens cannot be run with a KV cache of "
                                f"{kv_tokens:,} tokens")
        else:
            graph = graph_batch(len(dec), max_num_seqs) if not chunks and len(dec) <= max_num_seqs else 0
            steps.append((StepShape(len(dec), int((comp[dec] + 1).sum()), chunks, graph), len(running)))
            done = [r for r in running if last[r]]  # read back after this step's launch
            comp[dec] += 1
            gen[dec] += 1
            for r, q in sampled:
                comp[r] += q
                if comp[r] == P[r] + gen[r]:
                    gen[r] += 1
            for r in [*dec.tolist(), *(r for r, _ in sampled)]:
                if gen[r] and first[r] < 0:
                    first[r] = len(steps) - 1
            last[dec] = gen[dec] >= O[dec]
            for r, _ in sampled:
                last[r] = gen[r] >= O[r]
            if not overlapped:  # read back before the next step is scheduled
                done = [r for r in running if last[r]]
        for r in done:
            running.remove(r)
            free += int(blocks[r])
            blocks[r] = 0
            last[r] = False
    return Replay(steps, first, preemptions)


# ---- workloads ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """`bench-infer`'s throughput workload: `requests` prompts of lengths uniform in input_len, outputs forced to
    lengths uniform in output_len, drawn as bench/infer.py's sample_requests draws them (prompt lengths, then output
    lengths, from numpy's default_rng(seed)), so the same seed gives the same lengths."""

    requests: int = 1000
    input_len: tuple[int, int] = (64, 1024)
    output_len: tuple[int, int] = (64, 512)
    seed: int = 0

    def lengths(self) -> tuple[list[int], list[int]]:
        import numpy as np

        rng = np.random.default_rng(self.seed)
        (a, b), (c, d) = self.input_len, self.output_len
        return rng.integers(a, b + 1, size=self.requests).tolist(), rng.integers(c, d + 1, size=self.requests).tolist()


def run_requests(a: ModelArgs, c, tp: Layout | int, wb: float, prompts: list[int], outputs: list[int],
                 max_num_seqs: int, max_batched_tokens: int, kv_tokens: int) -> dict:
    """An offline run of these requests (all queued at once) on one replica, or under dp-attention on one rank of it
    (its own requests, its own cache of kv_tokens; the other ranks alike): its steps replayed and priced, in
    bench-infer's throughput fields. `decode_ms_per_step`: the median step that decodes every request at once and
    nothing else (bench-infer's concurrency rows)."""
    lay = Layout.of(tp)
    rp = replay(prompts, outputs, max_num_seqs, rank_step_tokens(lay, max_batched_tokens), kv_tokens,
                overlapped=lay.ranks == 1)
    ends, t, eager, full = [], 0.0, 0, []
    for st, running in rp.steps:
        dt = step_seconds(a, c, lay, wb, st, running)
        t += dt
        ends.append(t)
        eager += not st.graph_rows
        if st.n_decode == len(prompts) and not st.chunks:
            full.append(dt)
    ttft = sorted(ends[i] + HOST.first_token_s for i in rp.first_token_step)
    n_in, n_out = sum(prompts), sum(outputs)
    out = {"requests": len(prompts), "input_tokens": n_in, "output_tokens": n_out, "wall_s": t,
           "output_tokens_per_s": n_out / t, "total_tokens_per_s": (n_in + n_out) / t, "steps": len(rp.steps),
           "eager_steps": eager, "preemptions": rp.preemptions, "median_ttft_s": ttft[len(ttft) // 2]}
    if full:
        step = sorted(full)[len(full) // 2]
        out.update(decode_ms_per_step=step * 1e3, decode_tokens_per_s=len(prompts) / step)
    return out


def predict(a: ModelArgs, c, tp: Layout | int, wb: float, kv_tokens: int, *, context_len: int,
            batch_sizes: list[int], prompt_len: int, workload: Workload | None, max_num_seqs: int,
            max_batched_tokens: int, replicas: int = 1) -> dict:
    """What `plan --mode infer` reports per layout (a tp degree: tp alone): decode steps at each batch size (of one
    model copy) at context_len (and the batch-1 ms per token), one prompt's time to first token and the prefill rate
    at prompt_len, and the offline workload's throughput (the requests split over the request groups, every n-th to
    each: the model copies, and under dp-attention each copy's ranks). `kv_tokens`: one rank's cache, the copy's
    under replicated attention, its own requests' under dp-attention, whose batches split evenly over the ranks."""
    lay = Layout.of(tp)
    groups = replicas * lay.attn_dp
    decode = []
    for b in batch_sizes:
        bd: dict = {}
        mine = -(-b // lay.attn_dp)  # the rank's own sequences
        step = decode_step_seconds(a, c, lay, wb, mine, context_len, max_num_seqs, bd)
        decode.append({"batch": b, "context": context_len, "ms_per_step": step * 1e3, "tokens_per_s": b / step,
                       "host_bound": bd["host_s"] > bd["gpu_s"],
                       "fits": mine <= max_num_seqs and mine * context_len <= kv_tokens})
    bd1: dict = {}
    b1 = decode_step_seconds(a, c, lay, wb, 1, context_len, max_num_seqs, bd1)
    out = {
        "engine": {"max_num_seqs": max_num_seqs, "max_batched_tokens": max_batched_tokens, "kv_tokens": kv_tokens},
        "layout": lay.name,
        "batch1_ms_per_token": b1 * 1e3,
        "batch1_step_ms_by_op": {k.removesuffix("_s"): v * 1e3 for k, v in bd1.items()},  # and its gpu, host
        "decode": decode,
        "prefill": {"prompt_len": prompt_len,
                    "ttft_ms": (prefill_seconds(a, c, lay, wb, prompt_len, max_batched_tokens) + HOST.first_token_s)
                    * 1e3,
                    "tokens_per_s": prefill_tokens_per_s(a, c, lay, wb, prompt_len, max_batched_tokens)},
    }
    if workload is not None:
        prompts, outputs = workload.lengths()
        out["offline"] = off = {"requests": workload.requests, "input_len": list(workload.input_len),
                                "output_len": list(workload.output_len)}
        longest = max(p + o for p, o in zip(prompts, outputs))
        if longest > kv_tokens:  # the engine refuses such a request
            off["reason"] = f"a request of {longest:,} tokens does not fit the KV cache of {kv_tokens:,} tokens"
        else:
            mine = run_requests(a, c, lay, wb, prompts[::groups], outputs[::groups], max_num_seqs,
                                max_batched_tokens, kv_tokens)
            # per_model_copy: one request group's run (under dp-attention one rank's share of a copy)
            off.update(per_model_copy=mine, output_tokens_per_s=mine["output_tokens_per_s"] * groups)
    return out


def terms() -> dict:
    """The fitted terms, for the JSON report."""
    return {"kernels": {k: vars(v) for k, v in KERNELS.items()}, "host": vars(HOST), "graph_gap_s": GRAPH_GAP_S,
            "fused_max_slots": FUSED_MAX_SLOTS}
