"""Inference planning: per TP degree, the largest batch x context that fits and the predicted decode/prefill speed.

Memory per GPU, as the engine (infer/engine.py) sizes its KV pool: of gpu_memory_utilization x the GPU's memory,
take the weights / tp (norms, MLA's low-rank down-projections and the router whole; the embedding whole, the head
split by vocabulary), the CUDA context, the CUDA graphs' pool (the largest decode step's workspace), and the
largest step's workspace with the engine's 10% margin -- a
max_batched_tokens prefill through one layer at a time (the residual stream, the fused projections' outputs, the
attention output, the MLP's gate|up and its product; MoE: K routed copies of each token), plus the sampler's fp32
logits of max_num_seqs rows (a few copies: softmax, sort for top-p) -- and the rest is KV cache. KV cache per token
per layer: 2 x n_kv_heads x head_dim (K and V, split over tp; replicated when tp > n_kv_heads) or, for MLA
(DeepSeek-V2/V3), the compressed latent kv_lora_rank + the shared RoPE key qk_rope_head_dim (V2 paper sec. 2.1.2),
which is not split by heads and so is held whole on every tp rank; 2 bytes a value, or with --kv-cache-dtype fp8 one
byte plus a 4-byte scale per row (a token's latent, or one kv head's K or V). Speed (decode steps, prefill, offline
runs) is infer_speed.py's: the engine's kernels priced one by one at measured rates, its continuous batching replayed
(the decode kernels' cache reads priced at 2 bytes a value whatever the cache dtype: fp8 decode is not yet measured).
"""

from __future__ import annotations

from dataclasses import dataclass

from paraseek.models.args import ModelArgs
from paraseek.planner import infer_speed
from paraseek.planner.memory import ALLOCATOR_FRACTION, BF16, CUDA_CONTEXT, FP32, GiB, model_terms
from paraseek.planner.plan import Cluster
from paraseek.planner.search import divisors

WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}  # fp16: GPUs without bf16 (V100, T4), `--dtype float16` to serve
# The engine's --kv-cache-dtype: auto (the weights' 16-bit dtype) or fp8 (e4m3 values, one fp32 scale per cache row:
# infer/kv_fp8.py's SCALE_BYTES, copied: the planner does not import the engine).
KV_CACHE_DTYPES, KV_FP8_SCALE_BYTES = ("auto", "fp8"), 4
# The engine's defaults (infer/engine.EngineConfig): the step's token budget, the decode batch, the memory share.
MAX_BATCHED_TOKENS, MAX_NUM_SEQS, GPU_MEMORY_UTILIZATION = 8192, 256, 0.9
# `paraseek generate` and `bench-infer` (offline) on GPUs of at least 70 GiB other than A100: vLLM's offline
# defaults (its LLM class: 1,024 sequences, 16,384 tokens a step); `serve` keeps MAX_NUM_SEQS.
OFFLINE_LARGE_GPU_GIB, OFFLINE_MAX_NUM_SEQS, OFFLINE_MAX_BATCHED_TOKENS = 70, 1024, 16384
# The sampler's peak per logit, in fp32 copies: the fp32 logits, top-k's and top-p's sorts (values and int64
# indices), the softmax, the cumulative sum, the noise. 8 (32 B a logit) puts the KV pool within 0.1-1.8% of the
# engine's on every shape of benchmarks/2026-12-04/bench-infer-fused-moe-all-shapes.json (4 left the 1.5B at 512
# sequences and 25% of the GPU 6.6% above it).
SAMPLER_LOGIT_COPIES = 8
# infer/sampling.py's SAMPLE_CHUNK_LOGITS (copied: that module imports torch): the sampler takes the rows of a large
# batch a chunk of at most this many logits at a time, so its peak is that chunk's copies, not the batch's.
SAMPLE_CHUNK_LOGITS = 2**25
WORKSPACE_MARGIN = 1.1  # the engine keeps 10% of the measured workspace in reserve
# infer/kernels.py's split-KV partitions: PARTITION, MAX_PARTITIONS, and SHORT_PARTITION up to SHORT_CONTEXT tokens
DECODE_PARTITION, DECODE_MAX_PARTITIONS, DECODE_SHORT_PARTITION, DECODE_SHORT_CONTEXT = 256, 64, 64, 512


@dataclass
class InferPlan:
    tp: int
    replicas: int  # model copies on the cluster (n_gpus / tp)
    weights_gib: float  # per GPU
    kv_bytes_per_token: float  # per GPU, all layers
    free_gib: float  # left for the KV cache after weights, workspace, context
    max_batch: int  # sequences of seq_len that fit
    max_context: int  # tokens of one sequence that fit (not capped by max_position_embeddings)
    batch: int  # the batch the speed is predicted at (the asked one, or the largest that fits when none was asked)
    decode_tokens_per_s_per_gpu: float  # at `batch` sequences of seq_len tokens
    prefill_tokens_per_s_per_gpu: float  # steps full of seq_len-token prompts (one prompt in chunks if longer)
    reason: str = ""  # why nothing (or not the asked batch) fits at this tp
    speed: dict | None = None  # infer_speed.predict's report, when asked for


def engine_defaults(c: Cluster) -> tuple[int, int]:
    """(max_num_seqs, max_batched_tokens) that `paraseek generate` and `bench-infer` run with on these GPUs."""
    if c.memory_gib >= OFFLINE_LARGE_GPU_GIB and not c.gpu.name.startswith("A100"):
        return OFFLINE_MAX_NUM_SEQS, OFFLINE_MAX_BATCHED_TOKENS
    return MAX_NUM_SEQS, MAX_BATCHED_TOKENS


def kv_bytes_per_token(a: ModelArgs, tp: int, kv_cache_dtype: str = "auto") -> float:
    """One token's cache bytes on one tp rank, all layers. auto: bf16/fp16. fp8 (infer/kv_fp8.py's format): one e4m3
    byte per value and one fp32 scale per row (MLA: the latent row; MHA/GQA: each kv head's K and each one's V)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    fp8 = kv_cache_dtype == "fp8"
    if a.is_mla:
        values = a.kv_lora_rank + a.qk_rope_head_dim
        return a.n_layers * (values + KV_FP8_SCALE_BYTES if fp8 else BF16 * values)
    kv_heads = max(a.n_kv_heads / tp, 1)  # replicated when tp > kv heads
    return a.n_layers * 2 * kv_heads * (a.head_dim + KV_FP8_SCALE_BYTES if fp8 else BF16 * a.head_dim)


def step_workspace_bytes(a: ModelArgs, tp: int, max_batched_tokens: int = MAX_BATCHED_TOKENS,
                         max_num_seqs: int = MAX_NUM_SEQS, seq_len: int = 0) -> float:
    """The largest step's transient memory on one tp rank (the engine measures it with a profiling step: the
    largest prefill, then the largest decode batch with sampling; the peak is the larger of the two)."""
    D, Dh = a.dim, a.head_dim
    if a.is_mla:
        H = a.n_heads / tp
        proj = (a.q_lora_rank + a.kv_lora_rank + a.qk_rope_head_dim + H * a.qk_head_dim
                + 2 * H * (a.qk_nope_head_dim + a.v_head_dim)) + H * a.v_head_dim
    else:
        H, G = a.n_heads / tp, max(a.n_kv_heads / tp, 1)
        proj = (H + 2 * G) * Dh * 2 + H * Dh  # the fused output, the gathered context K/V, the attention output
    mlp = 3 * a.inter_dim / tp  # gate|up and their product
    if a.n_routed_experts:
        K = a.n_activated_experts
        moe = K * (2 * D + 3 * a.moe_inter_dim / tp) + 3 * a.moe_inter_dim * a.n_shared_experts / tp + K * D * 2
        mlp = max(mlp, moe)
    per_token = BF16 * (3 * D + proj + mlp)
    rows = min(max_num_seqs, max(1, SAMPLE_CHUNK_LOGITS // a.vocab_size))  # sampled a chunk of rows at a time
    logits = max_num_seqs * a.vocab_size * BF16 + rows * a.vocab_size * FP32 * SAMPLER_LOGIT_COPIES
    return max(max_batched_tokens * per_token, decode_workspace_bytes(a, tp, max_num_seqs, seq_len) + logits)


def decode_workspace_bytes(a: ModelArgs, tp: int, max_num_seqs: int, seq_len: int) -> float:
    """The paged decode kernels' split-KV partials at max_num_seqs sequences of seq_len tokens' block tables (fp32,
    one row per head and partition: infer/kernels.py's PARTITION tokens each, at most MAX_PARTITIONS), which the
    widest CUDA graph keeps: [B, H, P, C] for MLA's latent, [B, H, P, D] for GQA, plus the log-sum-exps."""
    partitions = max(min(DECODE_MAX_PARTITIONS, -(-seq_len // DECODE_PARTITION)),
                     -(-min(seq_len, DECODE_SHORT_CONTEXT) // DECODE_SHORT_PARTITION))
    if partitions <= 1:
        return 0.0
    H = a.n_heads / tp
    width = a.kv_lora_rank if a.is_mla else a.head_dim
    return max_num_seqs * H * partitions * (width + 1) * FP32


def plan_inference(a: ModelArgs, c: Cluster, seq_len: int, batch: int | None = None,
                   weight_dtype: str = "bf16", gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
                   max_batched_tokens: int = MAX_BATCHED_TOKENS, max_num_seqs: int = MAX_NUM_SEQS,
                   kv_cache_dtype: str = "auto") -> list[InferPlan]:
    t = model_terms(a, seq_len)
    wb = WEIGHT_BYTES[weight_dtype]
    out = []
    for tp in divisors(min(c.n_gpus, c.gpus_per_node)):
        if a.n_heads % tp or (not a.is_mla and a.n_kv_heads % tp and tp % a.n_kv_heads):
            continue
        L = t.layers
        # The embedding stays whole on every tp rank; the head is split by vocabulary (infer/tp.py).
        head = t.head if not a.tie_embeddings else a.vocab_size * a.dim
        dense = sum(x.params_split / tp + x.params_whole for x in L) + t.embedding + head / tp + t.final_norm
        experts = sum(x.params_experts for x in L) / tp
        weights = wb * (dense + experts)
        kv = kv_bytes_per_token(a, tp, kv_cache_dtype)
        # The largest step's workspace with the engine's margin, and beside it the CUDA graphs' private pool, which
        # keeps the largest decode forward's (its split-KV partials) for the engine's life, and their logits buffer.
        graphs = decode_workspace_bytes(a, tp, max_num_seqs, seq_len) + max_num_seqs * a.vocab_size * BF16
        workspace = WORKSPACE_MARGIN * step_workspace_bytes(a, tp, max_batched_tokens, max_num_seqs, seq_len) + graphs
        cap = c.memory_gib * GiB
        fixed = weights + workspace + CUDA_CONTEXT + ALLOCATOR_FRACTION * cap  # the engine's allowance for fragmentation
        free = gpu_memory_utilization * cap - fixed
        max_batch = int(free // (kv * seq_len)) if free > 0 else 0
        max_context = int(free // kv) if free > 0 else 0
        b = batch or max_batch
        ip = InferPlan(tp, c.n_gpus // tp, weights / GiB, kv, free / GiB, max_batch, max_context, b, 0.0, 0.0)
        if max_batch < 1:
            ip.reason = (f"weights {weights / GiB:,.1f} GiB + workspace {workspace / GiB:.1f} GiB leave "
                         f"{max(free, 0) / GiB:.1f} GiB < one sequence of {seq_len} tokens' KV cache "
                         f"({kv * seq_len / GiB:.2f} GiB)")
            out.append(ip)
            continue
        if b > max_batch:  # reported, not capped: the engine would preempt, and a server would queue or OOM
            ip.reason = (f"batch {b} per model copy does not fit: at most {max_batch} sequences of {seq_len} tokens "
                         f"({free / GiB:.1f} GiB for the KV cache after weights {weights / GiB:.1f} GiB and workspace "
                         f"{workspace / GiB:.1f} GiB, {kv * seq_len / GiB:.3f} GiB per sequence)")
            out.append(ip)
            continue
        ip.decode_tokens_per_s_per_gpu = b / infer_speed.decode_step_seconds(a, c, tp, wb, b, seq_len,
                                                                              max_num_seqs) / tp
        ip.prefill_tokens_per_s_per_gpu = infer_speed.prefill_tokens_per_s(a, c, tp, wb, seq_len,
                                                                           max_batched_tokens) / tp
        out.append(ip)
    return out


def planned_kv_tokens(engine) -> int | None:
    """What `paraseek plan --mode infer` predicts for the engine's KV pool on this GPU with its settings (the same
    formulas, on the measured memory): printed beside the pool's size, so that a wrong planner shows. paraseek/cli.py
    hands it to generate, serve and bench-infer (infer/build.py: build_engine): the engine does not depend on the
    planner."""
    import dataclasses as dc

    import torch

    from paraseek.hardware.specs import spec_for_device_name
    from paraseek.planner.plan import make_cluster

    spec = spec_for_device_name(torch.cuda.get_device_name(engine.device))
    if spec is None or engine.runner.tp != engine.tp:  # the planner prices tp layouts, not ep ones
        return None
    total = engine.report.total_gib
    cluster = dc.replace(make_cluster(spec.name, engine.tp, gpus_per_node=engine.tp), memory_gib=total)
    cfg = engine.cfg
    rows = [r for r in plan_inference(engine.args, cluster, engine.max_model_len, None, "bf16",
                                      cfg.gpu_memory_utilization, cfg.max_batched_tokens, cfg.max_num_seqs,
                                      kv_cache_dtype=cfg.kv_cache_dtype)
            if r.tp == engine.tp and not r.reason]
    return rows[0].max_context if rows else None
