"""Inference planning: per serving layout, the largest batch x context that fits and the predicted decode/prefill speed.

Layouts (`layouts`): the engine's --tp k, and on MoE models whose routed experts k divides, --ep k alone (attention,
dense MLPs, shared experts and head whole on every rank, E/k routed experts each), --tp k --ep k (the same k ranks:
attention by heads, E/k routed experts whole) and --ep k --dp-attention (each rank runs attention, the dense MLPs
and the shared experts for its own requests, the MoE layers expert-parallel over every rank's tokens).

Memory per GPU, as the engine (infer/engine.py) sizes its KV pool: of gpu_memory_utilization x the GPU's memory,
take the rank's weights (`rank_weight_bytes`: tensor by tensor as infer/model.py lays them out), the CUDA context,
the CUDA graphs' pool (the largest decode step's workspace), and the largest step's workspace with the engine's 10%
margin -- a max_batched_tokens prefill through one layer at a time (the residual stream, the fused projections'
outputs, the attention output, the MLP's gate|up and its product; MoE: K routed copies of each token; under
dp-attention a rank's share of the step through attention, every rank's through the MoE), plus the sampler's fp32
logits of max_num_seqs rows (a few copies: softmax, sort for top-p) -- and the rest is KV cache. KV cache per token
per layer: 2 x n_kv_heads x head_dim (K and V, split over tp; replicated when tp > n_kv_heads) or, for MLA
(DeepSeek-V2/V3), the compressed latent kv_lora_rank + the shared RoPE key qk_rope_head_dim (V2 paper sec. 2.1.2),
which is not split by heads and so is held whole on every tp rank; 2 bytes a value, or with --kv-cache-dtype fp8 one
byte plus a 4-byte scale per row (a token's latent, or one kv head's K or V). A model copy's cache: one rank's when
attention is replicated or split by heads (every rank holds every request), its ranks' together under dp-attention
(each rank its own requests). Speed (decode steps, prefill, offline runs) is infer_speed.py's: the engine's kernels
priced one by one at measured rates, its collectives at the cluster's link rates, its continuous batching replayed
(the decode kernels' cache reads priced at 2 bytes a value whatever the cache dtype: fp8 decode is not yet measured).
"""

from __future__ import annotations

from dataclasses import dataclass

from paraseek.models.args import ModelArgs
from paraseek.planner import infer_speed
from paraseek.planner.infer_speed import Layout, rank_step_tokens
from paraseek.planner.memory import ALLOCATOR_FRACTION, BF16, CUDA_CONTEXT, FP32, GiB
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
# infer/fp8.py's BLOCK (models/hf.py's FP8_BLOCK): an FP8 weight keeps one fp32 scale per 128 x 128 block.
FP8_BLOCK = 128


@dataclass
class InferPlan:
    layout: Layout
    replicas: int  # model copies on the cluster (n_gpus / the layout's ranks)
    weights_gib: float  # per GPU
    kv_bytes_per_token: float  # per GPU, all layers
    free_gib: float  # left for the KV cache after weights, workspace, context
    max_batch: int  # sequences of seq_len that fit in one model copy
    max_context: int  # tokens of one sequence that fit: one GPU's cache (not capped by max_position_embeddings)
    kv_tokens: int  # tokens one model copy caches: one GPU's, or under dp-attention its ranks' together
    batch: int  # the batch the speed is predicted at (the asked one, or the largest that fits when none was asked)
    decode_tokens_per_s_per_gpu: float  # at `batch` sequences of seq_len tokens
    prefill_tokens_per_s_per_gpu: float  # steps full of seq_len-token prompts (one prompt in chunks if longer)
    reason: str = ""  # why nothing (or not the asked batch) fits in this layout
    speed: dict | None = None  # infer_speed.predict's report, when asked for
    command: str = ""  # the `paraseek serve` command that runs it (planner/report.py's serve_command)

    @property
    def tp(self) -> int:
        return self.layout.tp


def engine_defaults(c: Cluster) -> tuple[int, int]:
    """(max_num_seqs, max_batched_tokens) that `paraseek generate` and `bench-infer` run with on these GPUs."""
    if c.memory_gib >= OFFLINE_LARGE_GPU_GIB and not c.gpu.name.startswith("A100"):
        return OFFLINE_MAX_NUM_SEQS, OFFLINE_MAX_BATCHED_TOKENS
    return MAX_NUM_SEQS, MAX_BATCHED_TOKENS


def tp_divides(a: ModelArgs, tp: int, ep: int = 1) -> bool:
    """Does the engine split this model at tp (infer/tp.py's check_tp, copied): the heads, the kv heads (or tp a
    multiple of them), the dense and shared experts' widths, and the routed experts' unless ep splits them by index."""
    if tp == 1:
        return True
    if a.n_heads % tp or (not a.is_mla and a.n_kv_heads % tp and tp % a.n_kv_heads):
        return False
    widths = [a.inter_dim]
    if a.n_routed_experts:
        widths += [a.moe_inter_dim] if ep == 1 else []
        widths += [a.moe_inter_dim * a.n_shared_experts] if a.n_shared_experts else []
    return all(w % tp == 0 for w in widths)


def layouts(a: ModelArgs, n_gpus: int) -> list[Layout]:
    """The layouts the engine runs on a replica of k GPUs, k dividing n_gpus (infer/tp.py's and infer/ep.py's
    rules): tp k; and on a MoE model whose routed experts k divides, ep k alone (tp 1), with dp-attention, and with
    tp k (both above 1 only when equal)."""
    out = []
    for k in divisors(n_gpus):
        if tp_divides(a, k):
            out.append(Layout(k))
        if k > 1 and a.n_routed_experts and a.n_routed_experts % k == 0:
            out.append(Layout(1, k))
            if tp_divides(a, k, k):
                out.append(Layout(k, k))
            out.append(Layout(1, k, dp_attention=True))
    return out


def rank_weight_bytes(a: ModelArgs, lay: Layout, weight_dtype: str = "bf16") -> float:
    """Bytes of the weights one rank of the layout holds, tensor by tensor as infer/model.py builds them (its
    InferenceModel.build: the main layers, no MTP module). tp cuts q (or q_b), kv_b and o by heads, the dense MLPs,
    the shared experts and the routed experts (unless ep) by width, the head by vocabulary (ceil(V / tp) rows, the
    last rank's padded); MLA's fused input projection (q_a or q, and kv_a), the norms, the fp32 router and the
    embedding stay whole. Under ep a rank holds E / ep routed experts whole and the shared experts as their own MLP;
    otherwise the shared experts are stacked after the routed ones. FP8 (`fp8`): every projection and expert e4m3
    with one fp32 scale per 128 x 128 block (infer/weights.py's Share.linear and Share.experts, blocks kept from the
    checkpoint or quantized on load: the same shapes); the norms, embedding, head and MLA's kv_b (dequantized for
    its absorbed form) stay in the 16-bit dtype. (On Hopper each FP8 projection also keeps cuBLASLt's padded copy
    of its scales: about 0.02% of its bytes, left out.)"""
    fp8, half = weight_dtype == "fp8", BF16  # the 16-bit dtype: bf16 or fp16 (also beside FP8 projections)
    tp, D = lay.tp, a.dim
    blocks = lambda n: -(-n // FP8_BLOCK)  # noqa: E731

    def linear(rows: int, cols: int) -> float:  # a projection's weight [rows, cols]
        return rows * cols + FP32 * blocks(rows) * blocks(cols) if fp8 else half * rows * cols

    def mlp(width: int) -> float:  # SwiGLU: gate|up [2 x width, D] and down [D, width]
        return linear(2 * width, D) + linear(D, width)

    H = a.n_heads // tp
    if a.is_mla:
        C, R, qk = a.kv_lora_rank, a.qk_rope_head_dim, a.qk_head_dim
        attn = (linear((a.q_lora_rank or H * qk) + C + R, D) + half * C
                + (linear(H * qk, a.q_lora_rank) + half * a.q_lora_rank if a.q_lora_rank else 0)
                + half * H * (a.qk_nope_head_dim + a.v_head_dim) * C + linear(D, H * a.v_head_dim))
    else:
        G, Dh = (a.n_kv_heads // tp if a.n_kv_heads % tp == 0 else 1), a.head_dim  # fewer kv heads: one each
        attn = (linear((H + 2 * G) * Dh, D) + (half * (H + 2 * G) * Dh if a.qkv_bias else 0)
                + linear(D, H * Dh) + (half * D if a.o_bias else 0))
    E, F, ns = a.n_routed_experts, a.moe_inter_dim, a.n_shared_experts
    if lay.ep > 1:
        experts = E // lay.ep * mlp(F) + (mlp(ns * F // tp) if ns else 0)
    else:
        experts = (E + ns) * mlp(F // tp) if E else 0
    moe = FP32 * E * D + (FP32 * E if a.topk_method == "noaux_tc" else 0) + experts  # the fp32 router (and bias)
    total = sum(half * 2 * D + attn + (moe if a.is_moe_layer(i) else mlp(a.inter_dim // tp)) for i in range(a.n_layers))
    head = (0 if a.tie_embeddings else a.vocab_size) if tp == 1 else -(-a.vocab_size // tp)  # tied at tp 1: one tensor
    return total + half * (a.vocab_size * D + head * D + D)  # the embedding, the head, the final norm


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


def step_workspace_bytes(a: ModelArgs, tp: Layout | int, max_batched_tokens: int = MAX_BATCHED_TOKENS,
                         max_num_seqs: int = MAX_NUM_SEQS, seq_len: int = 0) -> float:
    """The largest step's transient memory on one rank of the layout (a tp degree: tp alone; the engine measures it
    with a profiling step: the largest prefill, then the largest decode batch with sampling; the peak is the larger
    of the two). Under dp-attention the rank's own rows (rank_step_tokens) go through attention and the dense MLPs,
    every rank's through the MoE layers."""
    lay = Layout.of(tp)
    tp = lay.tp
    own = rank_step_tokens(lay, max_batched_tokens)
    D, Dh = a.dim, a.head_dim
    if a.is_mla:
        H = a.n_heads / tp
        proj = (a.q_lora_rank + a.kv_lora_rank + a.qk_rope_head_dim + H * a.qk_head_dim
                + 2 * H * (a.qk_nope_head_dim + a.v_head_dim)) + H * a.v_head_dim
    else:
        H, G = a.n_heads / tp, max(a.n_kv_heads / tp, 1)
        proj = (H + 2 * G) * Dh * 2 + H * Dh  # the fused output, the gathered context K/V, the attention output
    mlp = own * 3 * a.inter_dim / tp  # gate|up and their product
    if a.n_routed_experts:
        K, F = a.n_activated_experts, a.moe_inter_dim
        routed = F if lay.ep > 1 else F / tp  # ep: whole experts
        moe = K * (2 * D + 3 * routed) + 3 * F * a.n_shared_experts / tp + K * D * 2
        mlp = max(mlp, own * lay.attn_dp * moe)
    prefill = BF16 * (own * (3 * D + proj) + mlp)
    rows = min(max_num_seqs, max(1, SAMPLE_CHUNK_LOGITS // a.vocab_size))  # sampled a chunk of rows at a time
    logits = max_num_seqs * a.vocab_size * BF16 + rows * a.vocab_size * FP32 * SAMPLER_LOGIT_COPIES
    return max(prefill, decode_workspace_bytes(a, tp, max_num_seqs, seq_len) + logits)


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
    """Every layout the engine runs on replicas within a node (`layouts`): a rank's memory, the KV cache that is
    left, and the speed at `batch` sequences per model copy (or the most that fit)."""
    wb = WEIGHT_BYTES[weight_dtype]
    out = []
    for lay in layouts(a, min(c.n_gpus, c.gpus_per_node)):
        tp, n = lay.tp, lay.attn_dp
        weights = rank_weight_bytes(a, lay, weight_dtype)
        kv = kv_bytes_per_token(a, tp, kv_cache_dtype)  # attention's tp: under ep at tp 1 the whole cache
        # The largest step's workspace with the engine's margin, and beside it the CUDA graphs' private pool, which
        # keeps the largest decode forward's (its split-KV partials) for the engine's life, and their logits buffer.
        graphs = decode_workspace_bytes(a, tp, max_num_seqs, seq_len) + max_num_seqs * a.vocab_size * BF16
        workspace = WORKSPACE_MARGIN * step_workspace_bytes(a, lay, max_batched_tokens, max_num_seqs, seq_len) + graphs
        cap = c.memory_gib * GiB
        fixed = weights + workspace + CUDA_CONTEXT + ALLOCATOR_FRACTION * cap  # the engine's allowance for fragmentation
        free = gpu_memory_utilization * cap - fixed
        # One rank's cache holds every request of its copy (replicated attention) or only its own (dp-attention:
        # a copy holds n ranks' caches, a sequence lives in one).
        per_rank = int(free // (kv * seq_len)) if free > 0 else 0
        max_context = int(free // kv) if free > 0 else 0
        max_batch = n * per_rank
        b = batch or max_batch
        ip = InferPlan(lay, c.n_gpus // lay.ranks, weights / GiB, kv, free / GiB, max_batch, max_context,
                       n * max_context, b, 0.0, 0.0)
        if max_batch < 1:
            ip.reason = (f"weights {weights / GiB:,.1f} GiB + workspace {workspace / GiB:.1f} GiB leave "
                         f"{max(free, 0) / GiB:.1f} GiB < one sequence of {seq_len} tokens' KV cache "
                         f"({kv * seq_len / GiB:.2f} GiB)")
            out.append(ip)
            continue
        if b > max_batch:  # reported, not capped: the engine would preempt, and a server would queue or OOM
            ip.reason = (f"batch {b} per model copy does not fit: at most {max_batch} sequences of {seq_len} tokens "
                         f"({free / GiB:.1f} GiB for the KV cache after weights {weights / GiB:.1f} GiB and workspace "
                         f"{workspace / GiB:.1f} GiB, {kv * seq_len / GiB:.3f} GiB per sequence"
                         + (f", {n} GPUs' caches" if n > 1 else "") + ")")
            out.append(ip)
            continue
        step = infer_speed.decode_step_seconds(a, c, lay, wb, -(-b // n), seq_len, max_num_seqs)
        ip.decode_tokens_per_s_per_gpu = b / step / lay.ranks
        ip.prefill_tokens_per_s_per_gpu = infer_speed.prefill_tokens_per_s(a, c, lay, wb, seq_len,
                                                                           max_batched_tokens) / lay.ranks
        out.append(ip)
    return out


def planned_kv_tokens(engine) -> int | None:
    """What `paraseek plan --mode infer` predicts for the engine's KV pool on this GPU with its settings (the same
    formulas, on the measured memory): printed beside the pool's size, so that a wrong planner shows. paraseek/cli.py
    hands it to generate, serve and bench-infer (infer/build.py: build_engine): the engine does not depend on the
    planner. The layout is read off the engine's model: its tp (attention's) and ep, over the replica's ranks."""
    import dataclasses as dc

    import torch

    from paraseek.hardware.specs import spec_for_device_name
    from paraseek.planner.plan import make_cluster

    spec = spec_for_device_name(torch.cuda.get_device_name(engine.device))
    if spec is None:
        return None
    model = engine.runner.model
    lay = Layout(model.tp, model.ep, getattr(model, "dp_attention", False))
    if lay.ranks != engine.tp:  # a replica of ranks the planner does not lay out
        return None
    weight_dtype = ("fp8" if model.weights.startswith("FP8") else
                    "fp16" if model.dtype == torch.float16 else "bf16")
    total = engine.report.total_gib
    cluster = dc.replace(make_cluster(spec.name, lay.ranks, gpus_per_node=lay.ranks), memory_gib=total)
    cfg = engine.cfg
    rows = [r for r in plan_inference(engine.args, cluster, engine.max_model_len, None, weight_dtype,
                                      cfg.gpu_memory_utilization, cfg.max_batched_tokens, cfg.max_num_seqs,
                                      kv_cache_dtype=cfg.kv_cache_dtype)
            if r.layout == lay and not r.reason]
    return rows[0].max_context if rows else None  # one GPU's pool, as the engine's line counts it
