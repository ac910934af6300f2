"""Time per training step of a plan, itemized.

Compute: exact training FLOPs per token of each pp rank's layers (stats.py's counts, split by how TP shards them),
each kind of op at its own achievable rate: linears at matmul_tflops x linear, routed experts at x grouped,
attention's causal half at x attention, elementwise kernels as bytes over HBM bandwidth. Communication: collectives
priced with nccl-tests' bus-bandwidth factors (all-reduce 2(n-1)/n, all-gather / reduce-scatter / all-to-all
(n-1)/n of the full buffer) at the busbw of the link level their group spans, plus a per-call latency.
Pipeline: (m + bubble) x the slowest rank's micro-batch time, the bubble per schedule (Narayanan et al. 2021 for
1F1B and interleaving, Qi et al. 2024 for zero bubble). FSDP/HSDP traffic overlaps compute except the first
prefetch and whatever exceeds the compute it hides behind.
Tensor parallelism is the engine's with sequence parallelism (its default): routed experts are replicated on every
tp rank, each running them on its own T / tp tokens, so per rank they cost 1/tp of the expert FLOPs but on smaller
grouped GEMMs, and their partial gradients (with the router's and MLA's replicated down-projections') are all-reduced
over tp once per step after backward (`reduce_tp_grads`), on the critical path.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from paraseek.models.args import ModelArgs
from paraseek.models.lora_spec import LoRASpec, adapted, model_targets
from paraseek.parallel.dims import float8_all_gather, fp8_pays
from paraseek.planner.memory import (BF16, FP32, MOE_IMBALANCE, ModelTerms, RankShare,
                                     compiled_ac_saves_fp8_expert_outputs, compiled_loss, hot_ranks, rank_shares)
from paraseek.planner.plan import Cluster, Plan

ALPHA_INTRA_S, ALPHA_INTER_S = 10e-6, 20e-6  # per collective: launch + latency (inter-node grows with log2 n)
A2A_EFFICIENCY = 0.7  # all-to-all reaches less of the busbw than rings do (many small peer messages)
OVERLAP_PENALTY = 0.1  # compute slows by this share of the communication it hides (SMs and HBM are shared)
ELEM_TRAFFIC = 7.0  # HBM bytes moved by eager elementwise kernels per byte they save for backward
LOSS_TRAFFIC = 16.0  # HBM bytes per logit for the cross-entropy forward and backward
# FSDP2's own work per unsharded param per gather and per reduce (casts, copy-in/out, fp32 reduce buffers), as HBM
# bytes: ~12 ns/param per micro-batch on 2 H200s (paraseek train, 7B, BENCHMARKS.md); on one GPU it is twice that.
FSDP_COPY_BYTES = (10.0, 30.0)
# HBM bytes per local param of the optimizer step: fused AdamW with the clip folded into its kernel (train/optim.py,
# since e11229f). Fitted as 48 B when the clip was a pass of its own (7B on one H200: 82 ms), which read and wrote
# every fp32 gradient (8 B) that the folded clip does not.
OPTIM_BYTES = 40.0
# fp16 (GradScaler): unscale_ reads and writes the grads, and the clip is a pass of its own again (no grad_scale
# handed to the fused kernel with a scaler): 2 x 8 B more. From the code, not measured.
FP16_OPTIM_EXTRA_BYTES = 16.0
FULL_AC_RECOMPUTE = 1.2  # full checkpointing's extra forward: +18% on a 7B layer, +34% on a V2-Lite MoE layer
CPU_ADAM_GBPS = 50.0  # host bytes/s per node a CPU AdamW sustains (offload), shared by the node's ranks
CPU_ADAM_BYTES = 28.0  # read param, grad, 2 moments; write param, 2 moments (fp32)
PCIE_EFFICIENCY = 0.8
EP_CALL_OVERHEAD_S = 1e-3  # per all-to-all: split sizes go to the host first (a sync that drains the launch queue)
MOE_LAYER_OVERHEAD_S = 1.5e-3  # per MoE layer per micro-batch: ~40 small routing/permutation kernels, fwd + bwd
GROUPED_HALF_ROWS = 450  # rows per expert at which grouped GEMMs reach half their top rate (V2-Lite layer on H200)
# reduce_tp_grads: torch.cat reads and writes the grads into one flat buffer, the copy back reads and writes them again
TP_GRAD_COPY_TRAFFIC = 4.0
PP_ACTION_OVERHEAD_S = 0.5e-3  # per forward or backward of a chunk: the schedule's p2p waits and Python dispatch
# ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", the V schedule of zero-bubble pipelining)
# fills the bubble with the weight-gradient passes; a third of an interleaved (v=2) bubble left over is our estimate of
# the imperfect filling, not a measurement yet (--plan auto does not pick ZBVZeroBubble).
ZB_BUBBLE_SHARE = 1 / 3
# DualPipeV (DeepSeek's DualPipe cut in half; torch's ScheduleDualPipeV): bubble (PP/2 - 1)(F&B + B - 3W) over its
# PP = 2pp stages (deepseek-ai/DualPipe README, "Pipeline Bubbles and Memory Usage Comparison"), with a stage's
# forward F, full backward B = 2F and weight-gradient pass W = F (the zero-bubble papers' equal thirds; Qi et al.
# 2024) and F&B = F + B: (pp - 1) 2F, against a rank's micro-batch of 2 (F + B) = 6F: (pp - 1) / 3 micro-batches.
# Without overlap_fb, torch runs the paired chunks back to back, which is what F&B = F + B prices.
DUALPIPEV_BUBBLE = 1 / 3

# ---- the peers' overlap (Plan's peer features: priced for published runs, planner/published.py) -------------------
# Async TP (Wang et al. 2023, "Overlap Communication with Dependent Computation via Decomposition"; TorchTitan's
# async TP, Megatron-Core's --tp-comm-overlap): each all-gather / reduce-scatter is cut into tp pieces, each piece's
# GEMM runs while the next piece moves, so the first piece of every collective stays exposed (1/tp of it), as does
# whatever the GEMMs cannot cover; the hidden part slows them by OVERLAP_PENALTY, as FSDP's does.
# DualPipe's overlapped forward-backward (DeepSeek-V3 report, sec. 3.2.2): the all-to-all and pipeline sends of one
# chunk run behind the other chunk's compute, and 20 of the H800's 132 SMs do the communication meanwhile, so the
# compute runs on the other 112.
OVERLAP_FB_SM_SHARE = 20 / 132
# DeepEP's dispatch (deepseek-ai/DeepEP, docs/legacy.md, "Normal kernels": H800 with CX7 400 Gb/s NICs, ~50 GB/s;
# V3's setting of 4096 tokens, 7168 hidden, top-4 groups, top-8 experts): 51 / 50 GB/s of RDMA bandwidth for dispatch
# / combine at EP 64, i.e. the NIC's line rate, where NCCL's rings reach 0.8 of it (Cluster.inter_busbw_gbps): 1.25x.
DEEPEP_RDMA_OVER_RING = 1 / 0.8
# Inside a node it measured 153 / 158 GB/s over NVLink (EP 8): the planner's H800 NVLink busbw (0.77 x 200 GB/s =
# 154 GB/s), so the NVLink side is priced at Cluster.intra_busbw_gbps.
FP8_DISPATCH_BYTES = 1 + 4 / 128  # V3 dispatches fp8 activations with an fp32 scale per 128 (report sec. 3.3)
# Megatron-LM 2021's attention (Narayanan et al. 2021, sec. 4.2: a batched GEMM writes the scores, one fused
# scale-mask-softmax kernel, dropout, then the GEMM with v): HBM bytes per score element, fp16, from those kernels:
# forward: written 2, softmax read 2 + write 2, dropout read 2 + write 2 + its mask 1, read by the second GEMM 2 (13);
# backward: the probabilities' grad written 2, dropout's backward read 2 + mask 1 + write 2, softmax's backward read
# 2 + 2 and write 2, read by the two GEMMs of q's and k's grads 2 + 2 (17). Checkpointing runs the forward again.
SCORE_BYTES = {"forward": 13.0, "backward": 17.0}
# Host (CPU) seconds per block per micro-batch, forward + backward, of eager PyTorch: Python, the dispatcher and
# ~100-300 kernel launches per block. The GPU only runs ahead while the host launches faster than it computes; with
# few tokens per micro-batch, MoE routing, DTensor's per-op dispatch under TP or selective checkpointing's Python
# policy on every op, the host sets the pace. Fitted to the 14 eager 2x H200 runs of 2026-11-30 (BENCHMARKS.md).
HOST_BLOCK_S = {"dense": 8.6e-3, "moe": 19.4e-3}
HOST_FSDP_BLOCK_S = 2.4e-3  # FSDP2's all-gather / reduce-scatter hooks per block when dp_shard > 1
HOST_EP_S = 9.6e-3  # per MoE block with EP: split sizes to the host (a sync per all-to-all) and the a2a bookkeeping
HOST_AC_FACTOR = {"none": 1.0, "full": 4 / 3, "selective": 1.55}
HOST_TP_FACTOR = 3.66  # DTensor dispatch on every op of a tensor-parallel block

# torch.compile (--compile): every block one graph (parallel/parallelize.py), the loss too without tp/pp
# (train/loop.py). Fitted to the compiled runs of the current engine (docs/planner.md, "torch.compile": which runs,
# which were held out, the errors; scripts/planner/compiled_fit.py refits them):
# linears and routed experts reach this factor more of their eager in-training rate: 0.73 -> 0.85 of the GEMM
# ceiling for linears, below the 0.96 that the bare kernels reach (bench --calibrate on 2x H200,
# benchmarks/2026-11-30/h200-calibrated-profile.json): the launch gaps and
# the unfused kernels between the GEMMs, which the eager rates absorb, mostly go.
COMPILE_GEMM_GAIN = 1.17
# HBM bytes per saved-activation byte of the fused elementwise kernels (eager: ELEM_TRAFFIC). The fit puts it at its
# bound, 0: on these runs the fused kernels' time cannot be told apart from the GEMMs' (both grow with the tokens),
# so COMPILE_GEMM_GAIN carries it; a term of its own so that a wider set of runs can move it.
COMPILE_ELEM_TRAFFIC = 0.0
COMPILE_SINGLE_RANK = 0.65  # FSDP2's copies on a 1-rank mesh relative to a sharded one (eager: 2)
# The compiled loss reads the bf16 logits in forward and backward and writes their bf16 grad: 6 B per logit (eager
# LOSS_TRAFFIC: the fp32 copy and log-softmax too). From the kernels' reads and writes, not fitted.
COMPILED_LOSS_TRAFFIC = 6.0


# --fp8: the converted block projections' GEMMs run FP8_LINEAR_SPEEDUP times faster than bf16's, and their casts
# move FP8_CAST_BYTES per element of each one's input and output gradient at the memory rate (fp8_terms): a
# bf16 read for the abs-max, another for the cast, a float8 write and its transposed copy for the weight gradient,
# 2 + 2 + 1 + 1 = 6 B for each of the two, 12 B from the kernels. Fitted by least squares on our one-H200 runs
# (compiled, seq 4096; docs/planner.md, "FP8"): tensorwise's factor and the bytes (11) on the 7B and the Llama-3.1-8B
# shape at mbs 2 and DeepSeek-V2-Lite cut to 6 layers at mbs 2-32 (2048 wide: casts weigh 2.3x as much there),
# rowwise's factor on the 7B and Llama with those bytes; rowwise-gw-hp keeps the weight-gradient third in bf16:
# 1 / (2/3 / 1.33 + 1/3), derived, with the same bytes (its transposed copies stay bf16: an overestimate).
FP8_LINEAR_SPEEDUP = {"off": 1.0, "tensorwise": 1.76, "rowwise": 1.33, "rowwise-gw-hp": 1.20}
FP8_CAST_BYTES = 11.0
FP8 = 1  # bytes per param of a float8 all-gather
# --fp8-experts: the routed experts' forward and input-gradient GEMMs in float8 (torch._scaled_grouped_mm, rowwise
# scales; the weight gradient stays bf16), the quantizing kernels included. Their rate against bf16's grouped GEMM at
# the same rows: FP8_GROUPED_SPEEDUP x (rows + GROUPED_HALF_ROWS) / (rows + FP8_GROUPED_HALF_ROWS), slower below
# ~1,470 rows per expert and up to 1.75x with many. Fitted on DeepSeek-V2-Lite cut to 6 layers on one H200
# (compiled, no checkpointing, seq 4096, micro-batch 2-16 = 768-6,144 rows), the step-time ratio of `--fp8
# tensorwise --fp8-experts on` to `--fp8 tensorwise` (benchmarks/2026-12-03/fp8-v2lite6-*.json; docs/planner.md, "FP8").
FP8_GROUPED_SPEEDUP = 1.75
FP8_GROUPED_HALF_ROWS = 1890

# Tensorwise's float8 all-gather (FSDP2 with a shard > 1) casts each rank's fp32 shard in FSDP2's eager pre-gather
# hook, every gather: a scale multiply, a clamp and a convert (4+4, 4+4, 4+1 = 21 B a parameter), in place of the
# cast fused into the compiled linear (a bf16 read, its abs-max read, a float8 write: 5 B). From the kernels, not
# fitted; on one rank it comes to 15.7 B measured (7B: 15,106 vs 16,530 tokens/s with and without it in one run,
# benchmarks/2026-12-02/fp8-7b-tensorwise-vs-torchtitan.json).
FP8_GATHER_CAST_BYTES = 21 - 5


@functools.lru_cache(maxsize=64)
def fp8_terms(a: ModelArgs, recipe: str) -> tuple[float, float]:
    """What `--fp8 recipe` converts of the block projections (attention, dense MLPs, shared experts), as
    models/lora_spec.adapted lists them and parallel/fp8.py's filter takes them (multiples of 16 where fp8_pays):
    - share: the share of their GEMM FLOPs run in float8. 1 on DeepSeek-LLM-7B; V2-Lite under rowwise only its dense
      layer's gate/up.
    - cast_elems: the elements the casts touch per token per block-projection GEMM FLOP. Each converted projection
      casts its input (k) and its output gradient (n) each step, against 6 k n FLOPs forward and backward over all
      of them: 2 / 6 / 4096 for a 4096-square projection, and narrower ones cast more per FLOP."""
    if recipe == "off":
        return 0.0, 0.0
    targets = tuple(t for t in model_targets(a) if t != "experts")
    shapes = [(w.in_features, w.out_features) for w in adapted(a, LoRASpec(1, 1.0, targets))]
    paid = [(k, n) for k, n in shapes if k % 16 == 0 and n % 16 == 0 and fp8_pays(recipe, k, n)]
    total = sum(k * n for k, n in shapes)
    return sum(k * n for k, n in paid) / total, sum(k + n for k, n in paid) / (6 * total)


# Linear efficiency (Efficiency.linear, COMPILE_GEMM_GAIN) was fitted on 4096-wide models. A narrower model runs
# its projections as GEMMs with a shorter reduction dimension K = dim (every forward projection but the MLP's
# down, half of the backward ones), where each output tile's fixed cost (prologue, epilogue, the wave's tail) is a
# larger share: modelled as a rate K / (K + GEMM_HALF_K), relative to K = 4096; no gain is assumed above 4096 (not
# measured).
GEMM_HALF_K = 450.0  # fitted: scripts/planner/compiled_fit.py --fit-width, on the 13 compiled current-engine runs
GEMM_REF_K = 4096


def width_efficiency(dim: int) -> float:
    """The linears' rate at model width `dim` relative to the 4096-wide models their efficiency was fitted on."""
    k = min(dim, GEMM_REF_K)
    return (k / (k + GEMM_HALF_K)) / (GEMM_REF_K / (GEMM_REF_K + GEMM_HALF_K))


@dataclass
class StepTime:
    items: dict  # name -> seconds (exposed on the critical path)
    total: float


def collective(c: Cluster, nbytes: float, stride: int, size: int, kind: str) -> float:
    """Seconds for one collective over `size` ranks `stride` apart moving a buffer of `nbytes` (the full tensor)."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    busbw, inter = c.busbw(stride, size, ring=kind != "all_to_all")
    factor = 2 * (size - 1) / size if kind == "all_reduce" else (size - 1) / size
    if kind == "all_to_all":
        busbw *= A2A_EFFICIENCY
    alpha = ALPHA_INTER_S * max(1.0, math.log2(size)) if inter else ALPHA_INTRA_S
    return nbytes * factor / busbw + alpha


def all_to_all(c: Cluster, nbytes: float, stride: int, size: int) -> float:
    """Seconds for one all-to-all over `size` ranks `stride` apart, each rank sending `nbytes` spread evenly over the
    group (itself included): what goes to ranks in other nodes leaves through this GPU's NIC share, what stays in the
    node crosses NVLink, both at once; at A2A_EFFICIENCY of either rate (many small peer messages)."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    per_node = max(1, min(size, c.gpus_per_node // stride))  # the group's ranks in one node
    local, remote = nbytes * (per_node - 1) / size, nbytes * (size - per_node) / size
    seconds = max(local / (c.intra_busbw_gbps * 1e9), remote / (c.inter_busbw_gbps * 1e9)) / A2A_EFFICIENCY
    return seconds + (ALPHA_INTER_S * math.log2(size) if remote else ALPHA_INTRA_S)


def node_limited_copies(a: ModelArgs, nodes: int) -> float:
    """Copies of a token that cross the network under DeepEP's dispatch: one per distinct remote node among its
    experts. Node-limited routing (V3: topk_group of n_group expert groups, a group per node when EP spans n_group
    nodes) keeps them on at most M nodes; with its K experts spread evenly over those, E[distinct] = M (1 - (1 -
    1/M)^K), and the token's own node, one of the `nodes` the EP group spans, is among them 1/nodes of the time."""
    K = a.n_activated_experts
    m = min(nodes, K)
    if a.n_group > 1 and a.topk_group < a.n_group:
        m = min(m, a.topk_group * max(1, math.ceil(nodes / a.n_group)))
    return m * (1 - (1 - 1 / m) ** K) * (1 - 1 / nodes)


def deepep_exchange(c: Cluster, a: ModelArgs, tokens: float, stride: int, size: int, elem_bytes: float) -> float:
    """Seconds for one dispatch or combine of `tokens` tokens (K copies of the hidden state each, `elem_bytes` per
    element) under DeepEP over an EP group of `size` ranks `stride` apart: the network carries node_limited_copies
    per token at the NIC's line rate, NVLink the K copies to the experts' GPUs at its full rate, both at once."""
    if size <= 1 or tokens <= 0:
        return 0.0
    per_node = max(1, min(size, c.gpus_per_node // stride))
    nodes = max(1, size // per_node)
    row = a.dim * elem_bytes * MOE_IMBALANCE
    nvlink = tokens * a.n_activated_experts * row * (per_node - 1) / per_node / (c.intra_busbw_gbps * 1e9)
    if nodes == 1:
        return nvlink + ALPHA_INTRA_S
    rdma = tokens * node_limited_copies(a, nodes) * row / (c.inter_busbw_gbps * 1e9 * DEEPEP_RDMA_OVER_RING)
    return max(rdma, nvlink) + ALPHA_INTER_S * math.log2(size)


def overlapped(comm: float, behind: float, pieces: int) -> float:
    """What stays exposed of `comm` seconds cut into `pieces` and overlapped with `behind` seconds of compute: the
    first piece, whatever the compute cannot cover, and OVERLAP_PENALTY of the hidden part."""
    return comm / pieces + max(0.0, comm - behind) + OVERLAP_PENALTY * min(comm, behind)


def ep_exchange(c: Cluster, a: ModelArgs, plan: Plan, tokens: float, dispatch_bytes: float, full: bool) -> float:
    """Seconds of one MoE layer's expert-parallel exchanges per micro-batch of `tokens` tokens: dispatch and combine,
    forward and backward (and the forward again under full checkpointing), each waiting on the host for its split
    sizes (EP_CALL_OVERHEAD_S). The engine's all-to-all moves `dispatch_bytes` per token (K bf16 copies, this tp
    rank's share of the tokens) with MOE_IMBALANCE; DeepEP (ep_dispatch "deepep") sends the dispatches (forward, and
    the gradients' in backward) in fp8 and the combines in bf16 (DeepSeek-V3 report, sec. 3.3)."""
    calls = 6 if full else 4
    stride, ep = plan.stride("ep"), plan.ep
    if plan.ep_dispatch == "deepep":
        local = tokens / plan.tp
        return (calls // 2) * (deepep_exchange(c, a, local, stride, ep, FP8_DISPATCH_BYTES)
                               + deepep_exchange(c, a, local, stride, ep, BF16)) + calls * EP_CALL_OVERHEAD_S
    return calls * (all_to_all(c, tokens * dispatch_bytes * MOE_IMBALANCE, stride, ep) + EP_CALL_OVERHEAD_S)


def bubble(plan: Plan) -> float:
    """Idle time of the slowest pp rank, in micro-batch times."""
    pp, v = plan.pp, plan.pp_virtual_stages
    if pp == 1:
        return 0.0
    if plan.pp_schedule in ("GPipe", "1F1B"):
        return pp - 1.0
    if plan.pp_schedule == "Interleaved1F1B":
        return (pp - 1) / v
    if plan.pp_schedule == "DualPipeV":
        return (pp - 1) * DUALPIPEV_BUBBLE
    return (pp - 1) / 2 * ZB_BUBBLE_SHARE  # ZBVZeroBubble


def host_time(s: RankShare, plan: Plan) -> float:
    """Host seconds per micro-batch to launch this pp rank's blocks (eager mode; see HOST_BLOCK_S). Compiled, a block
    launches its graph's few fused kernels, and what stays on the host is outside the graph: FSDP2's hooks and EP's
    syncs (not fitted: no compiled run measured so far was host-bound; a profiled compiled V2-Lite step kept the GPU
    busy 476 of 508 ms: benchmarks/2026-11-30/train-v2lite14-mbs4-compiled-profile-rank0.summary.json)."""
    if plan.compile:
        return s.n_moe * HOST_EP_S * (plan.ep > 1) + s.blocks * HOST_FSDP_BLOCK_S * (plan.dp_shard > 1)
    n_dense = s.blocks - s.n_moe
    per = (n_dense * HOST_BLOCK_S["dense"] + s.n_moe * HOST_BLOCK_S["moe"]) * (HOST_TP_FACTOR if plan.tp > 1 else 1.0)
    per += s.n_moe * HOST_EP_S * (plan.ep > 1) + s.blocks * HOST_FSDP_BLOCK_S * (plan.dp_shard > 1)
    return per * HOST_AC_FACTOR[plan.activation_checkpointing]


def step_time(t: ModelTerms, c: Cluster, plan: Plan, global_batch_size: int) -> StepTime:
    a, tp, ep = t.args, plan.tp, plan.ep
    eff = c.eff
    shares = rank_shares(t, tp, ep, plan.pp, plan.pp_virtual_stages, plan.pp_schedule, plan.mtp_layers)
    m = plan.n_microbatches(global_batch_size)
    tokens = plan.micro_batch_size * t.seq_len
    rate = c.matmul_tflops * 1e12
    hbm = c.hbm_gbps * 1e9
    gemm = COMPILE_GEMM_GAIN if plan.compile else 1.0
    elem_traffic = COMPILE_ELEM_TRAFFIC if plan.compile else ELEM_TRAFFIC
    loss_traffic = COMPILED_LOSS_TRAFFIC if compiled_loss(plan) else LOSS_TRAFFIC
    full, sel = plan.activation_checkpointing == "full", plan.activation_checkpointing == "selective"
    recompute = FULL_AC_RECOMPUTE if full else 1.0  # the forward again: ~1/5 of fwd+bwd time (backward is slower)
    act_bytes = tokens * BF16 * a.dim  # one activation tensor [mbs, seq, D] in bf16
    # Each group priced at the link it spans under the mesh order (ParallelDims.stride).
    tp_call = collective(c, act_bytes, plan.stride("tp"), tp, "all_gather")  # AG and RS of one buffer cost the same
    # Pipeline sends go at the pace of the slowest hop: over the NICs once the stages span nodes.
    # With MTP every stage before the last sends [h; embedding] (two activations' worth: parallel/pipeline.py).
    sent = act_bytes / tp * (2 if plan.mtp_layers else 1)
    p2p = sent / c.busbw(plan.stride("pp"), plan.pp, ring=False)[0] + ALPHA_INTRA_S if plan.pp > 1 else 0.0

    # Expert GEMMs get more rows per expert as EP gathers tokens from ep ranks, fewer under TP + SP (each tp rank
    # routes only its T / tp tokens to its whole replicated experts): small GEMMs are inefficient.
    rows = tokens / tp * ep * a.n_activated_experts / max(a.n_routed_experts, 1)
    grouped_eff = eff.grouped * rows / (rows + GROUPED_HALF_ROWS) if rows else 1.0
    # In units of the experts' bf16 forward+backward: --fp8-experts runs the forward (and its recompute) and the
    # input gradient, all but the weight-gradient third, at the float8 grouped GEMM's relative rate. Where full
    # checkpointing keeps their outputs instead (torch < 2.13, compiled: memory.py counts them), no recompute.
    expert_passes = recompute
    if plan.fp8_experts and rows:
        fp8_rate = FP8_GROUPED_SPEEDUP * (rows + GROUPED_HALF_ROWS) / (rows + FP8_GROUPED_HALF_ROWS)
        kept = full and plan.compile and compiled_ac_saves_fp8_expert_outputs()
        expert_passes = 1 / 3 + ((1.0 if kept else recompute) - 1 / 3) / fp8_rate
    # The slowest pp rank's micro-batch.
    worst: dict[str, float] = {}
    for r in hot_ranks(shares):
        s = shares[r]
        # --fp8: the block projections it converts speed up (the router, a tiny share, is counted with the rest); the
        # head stays bf16
        block, (share, cast_elems) = s.linear_flops - s.head_flops, fp8_terms(a, plan.fp8)
        linear = block * (share / FP8_LINEAR_SPEEDUP[plan.fp8] + 1 - share) + s.head_flops
        fp8_casts = tokens * block * cast_elems * FP8_CAST_BYTES / hbm
        attention = tokens * s.attn_flops * recompute / (rate * eff.attention)
        if plan.attention == "materialized":  # the whole square, and every score element through HBM
            scores = tokens * 2 * s.attn_flops / (6 * (a.qk_head_dim + a.attn_v_head_dim))
            passes = SCORE_BYTES["forward"] * (1 if plan.activation_checkpointing == "none" else 2)
            attention = 2 * attention + scores * (passes + SCORE_BYTES["backward"]) / hbm
        it = {
            "compute_linear": (tokens * linear * recompute / (rate * eff.linear * gemm * width_efficiency(a.dim))
                               + fp8_casts * recompute),
            "compute_experts": (tokens * s.expert_flops * MOE_IMBALANCE * expert_passes / (rate * grouped_eff * gemm)
                                + s.n_moe * MOE_LAYER_OVERHEAD_S),
            "compute_attention": attention,
            "compute_elementwise": (tokens * s.elem_bytes * elem_traffic * (4 / 3 if full or sel else 1.0)
                                    # the main loss, and each MTP depth's (never compiled)
                                    + (tokens * a.vocab_size / tp * (loss_traffic + s.mtp * LOSS_TRAFFIC)
                                       if s.last else 0.0)) / hbm,
            # SP: per block AG+RS around attention and MLP, forward and backward (+ forward again under full AC);
            # each head's input gathered; each MTP module gathers the embedding's output (and reduces its grad)
            "tp_comm": s.blocks * (12 if full else 8) * tp_call + ((4 + 6 * s.mtp) * tp_call if s.last else 0.0),
            "ep_all_to_all": s.n_moe * ep_exchange(c, a, plan, tokens, s.dispatch_max, full) if ep > 1 else 0.0,
            "pp_p2p": 2 * plan.pp_virtual_stages * (p2p + PP_ACTION_OVERHEAD_S) if plan.pp > 1 else 0.0,
        }
        if plan.shared_expert_overlap and it["ep_all_to_all"]:  # the exchanges behind the shared experts' GEMMs
            shared = s.n_moe * 18 * a.dim * a.moe_inter_dim * a.n_shared_experts / tp  # FLOPs per token, fwd + bwd
            shared_s = tokens * shared * recompute / (rate * eff.linear * gemm * width_efficiency(a.dim))
            a2a = it["ep_all_to_all"]
            it["ep_all_to_all"] = max(0.0, a2a - shared_s) + OVERLAP_PENALTY * min(a2a, shared_s)
        if plan.async_tp and it["tp_comm"]:  # each collective in tp pieces behind the block's GEMMs
            it["tp_comm"] = overlapped(it["tp_comm"], it["compute_linear"], tp)
        if plan.overlap_fb:  # DualPipe: this chunk's communication behind the paired chunk's compute
            compute = sum(v for k, v in it.items() if k.startswith("compute_"))
            comm = it["tp_comm"] + it["ep_all_to_all"] + it["pp_p2p"]
            slowed = compute / (1 - OVERLAP_FB_SM_SHARE)
            left = max(0.0, comm - slowed) / comm if comm else 0.0
            for k in ("tp_comm", "ep_all_to_all", "pp_p2p"):
                it[k] *= left
            it["comm_sm_share"] = slowed - compute
        # The GPU waits for the host when launching takes longer than computing (eager mode).
        it["host_bound"] = max(0.0, host_time(s, plan) - sum(it.values()))
        if sum(it.values()) > sum(worst.values()):
            worst = it
    t_mb = sum(worst.values())
    items = {k: v * m for k, v in worst.items()}
    device_mb = t_mb - worst["host_bound"]  # in the bubble the GPU waits for the other stages, not for its host
    items["pp_bubble"] = bubble(plan) * device_mb
    busy = t_mb * m + bubble(plan) * device_mb

    # FSDP: all-gather bf16 params, reduce-scatter fp32 grads; dense params over dp_shard, experts over dp_shard/ep.
    s = max(shares, key=lambda x: x.dense + x.experts)
    n_blocks = max(s.blocks, 1)
    dense, experts = s.dense, s.experts / ep

    # tensorwise --fp8 all-gathers the block projections in float8 where they are sharded (the root stays bf16)
    float8_gather = float8_all_gather(plan, plan.fp8)
    gathered = FP8 * (dense - s.root) + BF16 * s.root if float8_gather else BF16 * dense

    def fsdp_round(gathers: int) -> tuple[float, float]:
        """(all-gathers, reduce-scatters) of one round over this rank's blocks."""
        shard, expert_dp = plan.stride("dp_shard"), plan.stride("expert_dp")
        alpha = (n_blocks - 1) * (ALPHA_INTRA_S if plan.dp_shard > 1 else 0.0)
        return (gathers * (collective(c, gathered, shard, plan.dp_shard, "all_gather")
                           + collective(c, BF16 * experts, expert_dp, plan.dp_shard // ep, "all_gather") + alpha),
                collective(c, FP32 * dense, shard, plan.dp_shard, "reduce_scatter")
                + collective(c, FP32 * experts, expert_dp, plan.dp_shard // ep, "reduce_scatter") + alpha)

    def exposed(comm: float, behind: float) -> float:
        # The first prefetch cannot overlap; what exceeds the compute it hides behind is exposed; the hidden part
        # still slows compute a little.
        return comm / n_blocks + max(0.0, comm - behind) + OVERLAP_PENALTY * min(comm, behind)

    gathers = 1 if plan.keeps_params_gathered else 2
    rounds = 1 if plan.pp > 1 else m  # pipelining gathers and reduces once per step (grad sync deferred)
    gather, reduce = fsdp_round(gathers)
    if plan.dp_shard == 1:
        items["fsdp_comm"] = 0.0
    elif plan.pp > 1:
        # Pipelined, FSDP2 gathers each block once, at the first micro-batch's forward (prefetched behind it: a third
        # of a micro-batch), and reduce-scatters in the last micro-batch's backward only (the engine defers gradient
        # sync to it): behind that backward, two thirds of a micro-batch, not behind the whole step.
        items["fsdp_comm"] = exposed(gather, device_mb / 3) + exposed(reduce, device_mb * 2 / 3)
    else:
        items["fsdp_comm"] = m * exposed(gather + reduce, busy / m)
    # FSDP2 copies params into and out of its all-gather buffers and casts grads for the reduce, on every rank
    # and even on a 1-rank mesh: memory-bound work on the compute stream.
    # measured: FSDP2 on a 1-rank mesh costs twice as much per param in eager mode (COMPILE_SINGLE_RANK compiled)
    single = (COMPILE_SINGLE_RANK if plan.compile else 2.0) if plan.dp_shard == 1 else 1.0
    items["fsdp_copies"] = (single * rounds * (gathers * FSDP_COPY_BYTES[0] + FSDP_COPY_BYTES[1]) * (dense + experts)
                            / hbm if not plan.ddp else 0.0)
    items["fp8_gather_casts"] = (rounds * gathers * FP8_GATHER_CAST_BYTES * (dense - s.root) / plan.dp_shard / hbm
                                 if float8_gather else 0.0)
    owned = (s.dense + s.experts) / plan.dp_shard
    # HSDP/DDP: all-reduce of the (sharded) fp32 grads over dp_replicate, behind the last backward.
    ar = collective(c, FP32 * owned, plan.stride("dp_replicate"), plan.dp_replicate, "all_reduce")
    items["dp_allreduce"] = exposed(ar, t_mb * 2 / 3) if plan.dp_replicate > 1 else 0.0
    # TP: the partial fp32 grads of the tp-replicated params (router, routed experts / ep, MLA's latent path), dp
    # shards after FSDP2's reduce, summed over tp in one flat all-reduce after backward, nothing left to hide behind.
    partial = max(x.tp_partial for x in shares) / plan.dp_shard
    items["tp_grad_allreduce"] = (collective(c, FP32 * partial, plan.stride("tp"), tp, "all_reduce")
                                  + TP_GRAD_COPY_TRAFFIC * FP32 * partial / hbm) if tp > 1 and partial else 0.0
    if plan.cpu_offload:
        # Each gather copies the fp32 shard host->device; each reduce copies fp32 grads back (PCIe, per GPU).
        pcie = rounds * (gathers + 1) * FP32 * owned / (c.gpu.pcie_gbps * 1e9 * PCIE_EFFICIENCY)
        items["offload_pcie"] = exposed(pcie, busy)
        items["optimizer"] = c.gpus_per_node * owned * CPU_ADAM_BYTES / (CPU_ADAM_GBPS * 1e9)
    else:
        items["optimizer"] = owned * (OPTIM_BYTES + FP16_OPTIM_EXTRA_BYTES * (plan.precision == "fp16")) / hbm
    return StepTime(items, sum(items.values()))
