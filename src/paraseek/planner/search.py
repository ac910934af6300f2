"""Enumerate plans, price them, rank them by predicted tokens/s, and say why the others lost.

Pruning (why it is safe): activation checkpointing is tried from the least recompute up and the first mode that
fits with memory headroom is kept (more recompute only costs time); CPU offload is tried for a mesh only when nothing
fits without it (it only costs time); torch.compile is priced wherever the engine runs it, eager only where it does
not or when asked (every compile term of the model is a saving of time and memory, so an eager twin never ranks
higher); per mesh (dp_replicate, dp_shard, tp, pp, ep) only the fastest variant is kept, so the ranking shows
different ways to cut the machine rather than 20 micro-batch sizes of the same one.

Memory headroom: a plan whose predicted peak is above MEMORY_HEADROOM of the GPU's memory fits, but ranks below every
plan with room (the caching allocator's fragmentation makes such runs slow, below), unless none has room.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paraseek.errors import UserError
from paraseek.models.args import ModelArgs
from paraseek.models.lora_spec import LoRASpec
from paraseek.planner.cost import StepTime, step_time
from paraseek.parallel.dims import ParallelDims, fp8_experts_problem, rank_chunks
from paraseek.planner.memory import GiB, Memory, memory, model_terms
from paraseek.planner.plan import AC_MODES, Cluster, Plan

HOST_USABLE = 0.9  # of host memory, for offloaded states (the OS, data loaders and pinned buffers need the rest)
MAX_MICRO_BATCH = 64
# The caching allocator's fragmentation, measured on H200s (140.4 GiB; docs/planner.md, "Memory headroom"): runs whose
# allocated peak was at most 117.8 GiB (84%) ran at speed; from 122.7 GiB (87%) on, four runs lost 13-29% of their
# tokens/s to the allocator freeing and retrying. The boundary, ~120 GiB allocated, is
# 88% of the GPU in the planner's terms (its total adds the CUDA context and the allocator allowance to the
# allocated peak: 1.02 x 120.2 + 1.5 GiB = 124 GiB).
MEMORY_HEADROOM = 0.88


@dataclass
class Evaluated:
    plan: Plan
    memory: Memory
    time: StepTime | None
    tokens_per_s_per_gpu: float = 0.0
    mfu: float = 0.0
    reason: str = ""  # why it does not fit ("" if it does)
    note: str = ""  # for a fitting plan: why it needs CPU offload
    tight: bool = False  # fits, but above MEMORY_HEADROOM of the GPU's memory (ranks below every plan with room)
    overflow: tuple = (0.0, 0.0)  # (tighter, sum) of need / capacity for GPU and host memory: closeness to fitting


@dataclass
class Rejected:
    plan: Plan | None  # the closest variant of the mesh, None for a structural reason
    mesh: dict
    reason: str
    memory: Memory | None = None
    overflow: tuple = (float("inf"), float("inf"))  # need / capacity (see Evaluated): the sort key


@dataclass
class SearchResult:
    model: str
    model_args: ModelArgs
    cluster: Cluster
    seq_len: int
    global_batch_size: int
    plans: list[Evaluated] = field(default_factory=list)  # best first, one per mesh
    rejected: list[Rejected] = field(default_factory=list)
    evaluated: int = 0  # candidate plans priced

    @property
    def why_none(self) -> str:
        """One line on why nothing fits: the model states against all GPU and host memory, then the closest miss."""
        c = self.cluster
        states = 16 * model_terms_total(self.model_args) / GiB
        gpu_total, host_total = c.memory_gib * c.n_gpus, c.host_memory_gib * c.nodes * HOST_USABLE
        head = (f"model states alone (fp32 params + grads + AdamW moments, 16 B x {states / 16 * GiB / 1e9:,.1f}B "
                f"params) are {states:,.0f} GiB")
        if states > gpu_total:
            head += f" > the {c.n_gpus} GPUs' {gpu_total:,.0f} GiB"
            head += (f" and > {host_total:,.0f} GiB usable host memory (offload)" if states > host_total
                     else f" (offload to {host_total:,.0f} GiB of host memory would hold them)")
        closest = self.rejected[0].reason if self.rejected else "no mesh is possible"
        return f"{head}; closest: {closest}"


def model_terms_total(args: ModelArgs) -> int:
    return model_terms(args, args.max_seq_len).total_params


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _schedules(a: ModelArgs, pp: int, engine_only: bool = False) -> list[tuple[str, int]]:
    """The (schedule, virtual stages) the planner prices for pp ranks; ParallelDims.problem then says which run."""
    if pp == 1:
        return [("none", 1)]
    out = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("Interleaved1F1B", 4)]
    # ZBVZeroBubble runs in the engine (CPU loss-equivalence tests) and DualPipeV through the same torch pipelining
    # path; neither has been measured on GPUs yet: --plan auto does not pick them.
    return out if engine_only else out + [("ZBVZeroBubble", 2), ("DualPipeV", 2)]


def evaluate(args: ModelArgs, c: Cluster, plan: Plan, seq_len: int, global_batch_size: int,
             with_time: bool = True) -> Evaluated:
    """Memory, fit and (if it fits) time of one plan."""
    t = model_terms(args, seq_len)
    mem = memory(t, c, plan, global_batch_size)
    cap, host_cap = c.memory_gib * GiB, c.host_memory_gib * GiB * HOST_USABLE
    over = (mem.total / cap, mem.host_per_node / host_cap)
    ev = Evaluated(plan, mem, None, overflow=(max(over), sum(over)))
    why = []
    if mem.total > cap:
        top = sorted(((v, k) for k, v in mem.items.items()), reverse=True)[:2]
        why.append(f"needs {mem.total / GiB:,.1f} GiB/GPU > {c.memory_gib:.1f} GiB ("
                   + ", ".join(f"{k.replace('_', ' ')} {v / GiB:.1f}" for v, k in top) + ")")
    if mem.host_per_node > host_cap:
        why.append(f"the offloaded states need {mem.host_per_node / GiB:,.0f} GiB of host memory per node > "
                   f"{host_cap / GiB:,.0f} GiB usable")
    ev.reason = "; ".join(why)
    ev.tight = not ev.reason and mem.total > MEMORY_HEADROOM * cap
    if ev.reason or not with_time:
        return ev
    ev.time = step_time(t, c, plan, global_batch_size)
    tokens = global_batch_size * seq_len
    ev.tokens_per_s_per_gpu = tokens / ev.time.total / plan.world
    ev.mfu = t.flops_per_token * ev.tokens_per_s_per_gpu / (c.peak_tflops * 1e12)
    return ev


def _mesh(plan: Plan) -> dict:
    return {"dp_replicate": plan.dp_replicate, "dp_shard": plan.dp_shard, "tp": plan.tp, "pp": plan.pp, "ep": plan.ep}


def _rank_key(e: Evaluated) -> tuple[bool, float, float]:
    """Plans with memory headroom first, then the fastest, then (at equal speed) the one with more room."""
    return (not e.tight, e.tokens_per_s_per_gpu, -e.memory.total)


def _best_of_mesh(args: ModelArgs, c: Cluster, base: Plan, seq_len: int, gbs: int, engine_only: bool = False,
                  compile: bool | None = None) -> tuple[Evaluated | None, Evaluated | None, int, str]:
    """(best fitting variant, closest non-fitting variant, variants priced, why no variant runs) of one mesh.
    Each variant is first held against the engine's rules (ParallelDims.problem); the closest miss's reason also
    says why the same mesh fails without offload, when offload was the closest. compile: None prices compiled
    variants where the engine compiles them and eager ones elsewhere; True or False only those."""
    local = gbs // base.dp
    mbs_options = [d for d in divisors(local) if d <= MAX_MICRO_BATCH]
    if base.pp > 1:
        reshard_options = [False]  # pipelining keeps params gathered across micro-batches anyway
    elif base.dp_shard > 1:
        reshard_options = [True, False]
    else:
        reshard_options = [True]  # DDP or one data-parallel rank: nothing to reshard
    best = tight = None
    closest: dict[bool, Evaluated] = {}
    n, why_not = 0, ""
    for offload in (False, True):
        for schedule, v in _schedules(args, base.pp, engine_only):
            # Compiled where the engine compiles it (never slower in the model: module docstring), else eager.
            candidates = [base.replace(pp_schedule=schedule, pp_virtual_stages=v, cpu_offload=offload,
                                       compile=compiled, precision=c.precision)
                          for compiled in ((True, False) if compile is None else (compile,))]
            whys = [x.problem(args, seq_len, engine=engine_only) for x in candidates]
            variant = next((x for x, why in zip(candidates, whys, strict=True) if not why), None)
            if variant is None:
                why_not = why_not or whys[0]
                continue
            for mbs in mbs_options:
                m = local // mbs
                if why := variant.batch_problem(m):
                    why_not = why_not or why
                    continue
                fits_any = False
                for reshard in reshard_options:
                    for ac in AC_MODES:
                        plan = variant.replace(micro_batch_size=mbs, activation_checkpointing=ac,
                                               reshard_after_forward=reshard)
                        ev = evaluate(args, c, plan, seq_len, gbs)
                        n += 1
                        if not ev.reason:
                            fits_any = True
                            if best is None or _rank_key(ev) > _rank_key(best):
                                best = ev
                            # More recompute would only be slower -- except selective under compile, whose
                            # elementwise recompute costs COMPILE_ELEM_TRAFFIC (fitted to 0): as fast, less memory.
                            if not ev.tight and not (plan.compile and ac == "none"):
                                break
                            continue
                        if offload not in closest or ev.overflow < closest[offload].overflow:
                            closest[offload] = ev
                if not fits_any:
                    break  # memory grows with the micro-batch size: larger ones won't fit either
        if best is not None and not best.tight:
            break  # offload only when nothing fits with headroom without it
        tight = best
    if best is not None and best.plan.cpu_offload:
        if tight is not None:
            best.note = (f"CPU offload: without it the best plan needs {tight.memory.total / GiB:,.1f} GiB/GPU, above "
                         f"the {MEMORY_HEADROOM:.0%} memory headroom of {c.memory_gib:.1f} GiB")
        elif False in closest:
            best.note = f"CPU offload: without it the closest plan {closest[False].reason}"
    if not closest:
        return best, None, n, why_not
    miss = min(closest.values(), key=lambda e: e.overflow)
    if miss.plan.cpu_offload and False in closest:
        miss.reason = f"{closest[False].reason}; with CPU offload: {miss.reason}"
    return best, miss, n, why_not


def search(args: ModelArgs, c: Cluster, seq_len: int, global_batch_size: int, model: str = "",
           engine_only: bool = False, compile: bool | None = None, document_mask: bool = False,
           fp8: str = "off", fp8_experts: bool = False, lora: LoRASpec | None = None,
           mtp_layers: int = 0) -> SearchResult:
    """Every mesh of c.n_gpus GPUs, its best variant, ranked by memory headroom, then predicted tokens/s per GPU.
    engine_only ranks only what `paraseek train` runs (ParallelDims.problem with the engine's rules, the same check
    the CLI makes before a launch); without it the planner also prices the compositions the engine does not run, and
    ZBVZeroBubble. compile: None = compiled wherever the engine compiles, True / False = only compiled / eager.
    `document_mask`: the data is packed with document masks (Plan.document_mask); `fp8`: every plan with this --fp8
    recipe (Plan.fp8), refused on a GPU type without float8 tensor cores; `fp8_experts`: with it, the routed experts
    in float8 too (Plan.fp8_experts; Hopper GPU types, MoE models); `lora`: every plan trains these adapters
    on a frozen base (Plan.lora), which the engine runs without tp or pp; `mtp_layers`: every plan trains that many
    multi-token-prediction depths (Plan.mtp_layers, `paraseek train --mtp-layers`)."""
    if fp8 != "off" and not c.gpu.has_fp8:
        raise UserError(f"--fp8: {c.gpu.name} has no float8 tensor cores (Ada and Hopper GPUs do); plan without it")
    if fp8_experts:
        capability = (9, 0) if c.gpu.hopper else (8, 9)  # past the has_fp8 check: Hopper (9.0) or Ada (8.9)
        if why := (fp8_experts_problem(fp8, "cuda", capability)
                   or ("" if args.n_routed_experts else "--fp8-experts on: this model has no routed experts")):
            raise UserError(why)
    if seq_len <= 0:
        raise UserError(f"--seq-len must be positive, got {seq_len}")
    if mtp_layers < 0:
        raise UserError(f"--mtp-layers must be 0 or more MTP depths, got {mtp_layers}")
    if mtp_layers >= seq_len:  # train/mtp.py's rule
        raise UserError(f"--mtp-layers {mtp_layers}: depth k predicts the token k + 1 ahead, and a --seq-len {seq_len} "
                        f"window has no target that far; use --mtp-layers {seq_len - 1} or fewer")
    if global_batch_size <= 0:
        raise UserError(f"--global-batch-size must be positive, got {global_batch_size}")
    if seq_len > args.max_seq_len:
        raise UserError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings {args.max_seq_len}")
    N, G = c.n_gpus, c.gpus_per_node
    dps = {N // (tp * pp) for tp in divisors(N) for pp in divisors(N // tp) if tp <= G and pp <= args.n_layers}
    if not any(global_batch_size % dp == 0 for dp in dps):
        raise UserError(f"--global-batch-size {global_batch_size} cannot be divided over any data-parallel size "
                        f"of {N} GPUs; use a multiple of {min(dps)}")
    moe = args.n_routed_experts > 0
    res = SearchResult(model, args, c, seq_len, global_batch_size)

    def reject(reason: str, **mesh) -> None:
        res.rejected.append(Rejected(None, mesh, reason))

    for tp in divisors(N):
        if tp > G:
            reject(f"tp {tp} > {G} GPUs per node: TP's per-layer collectives would cross nodes", tp=tp)
            continue
        if why := ParallelDims(tp=tp).problem(args, seq_len):  # heads, widths, vocabulary: the same for every mesh
            reject(why, tp=tp)
            continue
        for pp in divisors(N // tp):
            if lora is not None and (tp > 1 or pp > 1):
                reject("LoRA runs with FSDP2/HSDP, DDP and --ep, not --tp or --pp", tp=tp, pp=pp)
                continue
            if pp > args.n_layers:
                reject(f"pp {pp} > {args.n_layers} layers", tp=tp, pp=pp)
                continue
            dp = N // (tp * pp)
            if global_batch_size % dp:
                reject(f"global batch {global_batch_size} is not divisible by data-parallel size {dp}", tp=tp, pp=pp)
                continue
            for dp_shard in divisors(dp):
                eps = [e for e in divisors(dp_shard) if args.n_routed_experts % e == 0] if moe else [1]
                for ep in eps:
                    base = Plan(dp_replicate=dp // dp_shard, dp_shard=dp_shard, tp=tp, pp=pp, ep=ep,
                                document_mask=document_mask, fp8=fp8, fp8_experts=fp8_experts, lora=lora,
                                mtp_layers=mtp_layers)
                    best, closest, n, why_not = _best_of_mesh(args, c, base, seq_len, global_batch_size, engine_only,
                                                              compile)
                    res.evaluated += n
                    if best is not None:
                        res.plans.append(best)
                    elif closest is not None:
                        res.rejected.append(Rejected(closest.plan, _mesh(base), closest.reason, closest.memory,
                                                     closest.overflow))
                    elif why_not:
                        reject(why_not, **_mesh(base))
    res.plans.sort(key=_rank_key, reverse=True)
    # Closest to fitting first; structural reasons last.
    res.rejected.sort(key=lambda r: r.overflow)
    return res


def best_plan(args: ModelArgs, c: Cluster, seq_len: int, global_batch_size: int,
              compile: bool | None = None, document_mask: bool = False, fp8: str = "off",
              fp8_experts: bool = False, lora: LoRASpec | None = None, mtp_layers: int = 0) -> Evaluated:
    """The first plan of the ranking that the engine runs (what `paraseek train --plan auto` runs): with memory
    headroom if any, the predicted-fastest. Raises UserError with the closest miss's reason when nothing fits."""
    res = search(args, c, seq_len, global_batch_size, engine_only=True, compile=compile,
                 document_mask=document_mask, fp8=fp8, fp8_experts=fp8_experts, lora=lora, mtp_layers=mtp_layers)
    if not res.plans:
        why = res.rejected[0].reason if res.rejected else "no mesh is possible"
        raise UserError(f"no parallel plan fits {c.n_gpus} x {c.gpu.name}: closest: {why}")
    return res.plans[0]


def explain(args: ModelArgs, c: Cluster, ev: Evaluated, seq_len: int, global_batch_size: int) -> str:
    """Why this plan, in one line: what compile gains over its eager twin, why its checkpointing (the mode with less
    recompute at the same micro-batch: what it needs), its memory against the headroom, why offload."""
    p, cap = ev.plan, c.memory_gib * GiB
    parts = []

    def need(e: Evaluated) -> str:
        if e.reason:
            return f"needs {e.memory.total / GiB:,.1f} GiB > {c.memory_gib:.1f}"
        return f"needs {e.memory.total / GiB:,.1f} GiB, above the {MEMORY_HEADROOM:.0%} headroom"

    if p.compile:
        eager = evaluate(args, c, p.replace(compile=False), seq_len, global_batch_size)
        gain = (f"+{ev.tokens_per_s_per_gpu / eager.tokens_per_s_per_gpu - 1:.0%} over eager" if not eager.reason
                else f"eager {need(eager)}")
        fitted = "" if c.gpu.name == "H200" else f"; its terms are fitted on H200s, not measured on {c.gpu.name}"
        parts.append(f"compile: {gain} (predicted{fitted})")
    elif why := p.replace(compile=True).problem(args, seq_len):
        parts.append(f"eager: {why}")
    else:
        parts.append("eager (compile not priced: --compile false)")
    if p.activation_checkpointing != "none":
        less = AC_MODES[AC_MODES.index(p.activation_checkpointing) - 1]
        alt = evaluate(args, c, p.replace(activation_checkpointing=less), seq_len, global_batch_size)
        if alt.reason or alt.tight:
            parts.append(f"AC {p.activation_checkpointing}: {less} at micro-batch {p.micro_batch_size} {need(alt)}")
        elif alt.tokens_per_s_per_gpu <= ev.tokens_per_s_per_gpu:  # compiled selective: its recompute is fused
            parts.append(f"AC {p.activation_checkpointing}: as fast as {less} (predicted), "
                         f"{(alt.memory.total - ev.memory.total) / GiB:.1f} GiB less")
    share = ev.memory.total / cap
    parts.append(f"memory {share:.0%} of {c.memory_gib:.0f} GiB" + (
        f": above the {MEMORY_HEADROOM:.0%} headroom (the allocator fragments there), but no plan with room fits"
        if ev.tight else ""))
    if p.precision == "fp16":
        parts.append(f"fp16: {c.gpu.name} has no bf16")
    if ev.note:
        parts.append(ev.note)
    return "; ".join(parts)


def mtp_cost(args: ModelArgs, c: Cluster, ev: Evaluated, seq_len: int, global_batch_size: int) -> dict:
    """What the plan's MTP modules add ({} without them): their depth, the pp rank holding them (the one with the
    last stage), and the step time and peak memory per GPU over the same plan priced without them."""
    p = ev.plan
    if not p.mtp_layers or ev.time is None:
        return {}
    without = evaluate(args, c, p.replace(mtp_layers=0), seq_len, global_batch_size)
    added = ev.time.total - without.time.total if without.time else 0.0
    holder = next(r for r, held in enumerate(rank_chunks(p.pp, p.pp_virtual_stages, p.pp_schedule))
                  if p.n_stages - 1 in held)
    return {"depth": p.mtp_layers, "pp_rank": holder, "step_time_s": added, "step_share": added / ev.time.total,
            "memory_gib": (ev.memory.total - without.memory.total) / GiB}


def describe_mtp(cost: dict, pp: int) -> str:
    """mtp_cost in one line."""
    d = cost["depth"]
    where = f"on pp rank {cost['pp_rank']} (the last stage, beside the head)" if pp > 1 else "beside the head"
    return (f"MTP: {d} depth{'s' if d > 1 else ''} {where}: {cost['step_share']:.1%} of the step "
            f"(+{cost['step_time_s']:.3f} s), +{cost['memory_gib']:.2f} GiB/GPU at the peak (predicted)")


@dataclass
class ScalingRow:
    gpus: int
    result: SearchResult | None
    best: Evaluated | None
    global_batch_size: int = 0
    efficiency: float = 0.0  # tokens/s/GPU relative to the first count that has a plan
    reason: str = ""  # why no plan runs at this count
    note: str = ""  # why the efficiency is above 100%, when it is
    # Multi-node counts: the best plan whose data-parallel sharding spans the nodes (flat) and the best HSDP plan
    # (sharded inside a node, replicated across: the hierarchical fix), with their efficiencies.
    flat: Evaluated | None = None
    hsdp: Evaluated | None = None
    flat_efficiency: float = 0.0
    hsdp_efficiency: float = 0.0


def shards_across_nodes(p: Plan, gpus_per_node: int) -> bool:
    """The plan's FSDP (dp_shard) group spans nodes: its all-gathers and reduce-scatters go over the NICs."""
    return p.dp_shard > 1 and p.stride("dp_shard") * p.dp_shard > gpus_per_node


def is_hsdp(p: Plan, gpus_per_node: int) -> bool:
    """Sharded inside a node and replicated across nodes (only the all-reduce of gradient shards crosses them)."""
    return p.dp_replicate > 1 and p.dp_shard > 1 and not shards_across_nodes(p, gpus_per_node)


def cross_node(e: Evaluated, c: Cluster, seq_len: int, global_batch_size: int) -> str:
    """Which of the plan's process groups cross nodes, at what busbw (Cluster.busbw: a ring over a node's p GPUs on
    p NIC shares, one share for one rank per node and for all-to-all and pipeline sends), and what their traffic
    leaves exposed per token, e.g. 'FSDP 16 over 2 nodes at 160.0 GB/s: 1.2 us/token'."""
    p = e.plan
    per_token = 1e6 * p.world / (global_batch_size * seq_len)  # seconds per step -> us per token per GPU
    out = []
    for label, group, size, item, ring in (("FSDP", "dp_shard", p.dp_shard, "fsdp_comm", True),
                                           ("replicas", "dp_replicate", p.dp_replicate, "dp_allreduce", True),
                                           ("EP", "ep", p.ep, "ep_all_to_all", False),
                                           ("PP", "pp", p.pp, "pp_p2p", False)):
        stride = p.stride(group)
        if size <= 1 or stride * size <= c.gpus_per_node:
            continue
        bw = c.busbw(stride, size, ring=ring)[0]
        nodes = -(-stride * size // c.gpus_per_node)
        out.append(f"{label} {size} over {nodes} nodes at {bw / 1e9:.1f} GB/s: "
                   f"{e.time.items.get(item, 0.0) * per_token:.1f} us/token")
    return ", ".join(out) or "nothing crosses nodes"


def _above_100_reason(base: ScalingRow, row: ScalingRow, e: Evaluated) -> str:
    """What makes plan `e` at a GPU count faster per GPU than the first count's: the plan's knobs that changed, and
    the time item per token that fell the most."""
    b = base.best
    bp, p = b.plan, e.plan
    changed = []
    if bp.cpu_offload and not p.cpu_offload:
        changed.append("no CPU offload (more GPUs hold the states)")
    if AC_MODES.index(p.activation_checkpointing) < AC_MODES.index(bp.activation_checkpointing):
        changed.append(f"less recompute (AC {p.activation_checkpointing}, {bp.activation_checkpointing} at "
                       f"{base.gpus})")
    if p.micro_batch_size > bp.micro_batch_size:
        changed.append(f"micro-batch {p.micro_batch_size} fits ({bp.micro_batch_size} at {base.gpus})")
    if (p.tp, p.pp) != (bp.tp, bp.pp):
        changed.append(f"tp {p.tp} x pp {p.pp} (tp {bp.tp} x pp {bp.pp} at {base.gpus})")
    # Seconds per token per GPU of each item: the one that fell the most.
    per_b = {k: v / (base.global_batch_size * row.result.seq_len / base.gpus) for k, v in b.time.items.items()}
    per_e = {k: v / (row.global_batch_size * row.result.seq_len / row.gpus) for k, v in e.time.items.items()}
    k = max(per_b, key=lambda x: per_b[x] - per_e.get(x, 0.0))
    changed.append(f"{k.replace('_', ' ')} per token {per_b[k] * 1e6:.1f} -> {per_e.get(k, 0.0) * 1e6:.1f} us"
                   + (" (the CPU optimizer's work per node shrinks as nodes are added)"
                      if k == "optimizer" and p.cpu_offload else ""))
    return "above 100%: " + "; ".join(changed)


def scaling(args: ModelArgs, c: Cluster, counts: list[int], seq_len: int, global_batch_size: int,
            model: str = "", weak: bool = True, engine_only: bool = True,
            compile: bool | None = None, document_mask: bool = False, fp8: str = "off",
            fp8_experts: bool = False, mtp_layers: int = 0) -> list[ScalingRow]:
    """The first-ranked plan at each GPU count, same model and node shape, ranked as `paraseek plan` ranks (only what
    `paraseek train` runs unless engine_only=False). weak: the per-GPU batch of the first count stays fixed (the
    global batch grows with the GPUs, as `paraseek bench --scaling` measures); else the global batch is fixed
    (strong scaling). Efficiency = tokens/s/GPU relative to the first count with a plan; above 100% a row says why.
    Multi-node counts also get the best flat-sharded and the best HSDP plan."""
    rows = []
    for n in counts:
        if n <= 0:
            raise UserError(f"--scaling: GPU counts must be positive, got {n}")
        if n > c.gpus_per_node and n % c.gpus_per_node:
            raise UserError(f"--scaling: {n} GPUs is not a whole number of {c.gpus_per_node}-GPU nodes")
        gbs = global_batch_size
        if weak:
            if global_batch_size * n % counts[0]:
                rows.append(ScalingRow(n, None, None, reason=f"weak scaling: the global batch {global_batch_size} x "
                                       f"{n} / {counts[0]} GPUs is not a whole number of sequences"))
                continue
            gbs = global_batch_size * n // counts[0]
        cn = c.with_gpus(n)
        try:
            res = search(args, cn, seq_len, gbs, model, engine_only=engine_only, compile=compile,
                         document_mask=document_mask, fp8=fp8, fp8_experts=fp8_experts, mtp_layers=mtp_layers)
        except UserError as e:  # e.g. the batch cannot be divided at this count: a row, not the end
            rows.append(ScalingRow(n, None, None, gbs, reason=str(e)))
            continue
        if not res.plans:
            why = res.rejected[0].reason if res.rejected else "no mesh is possible"
            rows.append(ScalingRow(n, res, None, gbs, reason=f"nothing fits: {why}"))
            continue
        row = ScalingRow(n, res, res.plans[0], gbs)
        if cn.nodes > 1:
            row.flat = next((e for e in res.plans if shards_across_nodes(e.plan, cn.gpus_per_node)), None)
            row.hsdp = next((e for e in res.plans if is_hsdp(e.plan, cn.gpus_per_node)), None)
        rows.append(row)
    base = next((r for r in rows if r.best is not None), None)
    for r in rows:
        if r.best is None or base is None:
            continue
        ref = base.best.tokens_per_s_per_gpu
        r.efficiency = r.best.tokens_per_s_per_gpu / ref
        r.flat_efficiency = r.flat.tokens_per_s_per_gpu / ref if r.flat else 0.0
        r.hsdp_efficiency = r.hsdp.tokens_per_s_per_gpu / ref if r.hsdp else 0.0
        r.note = "; ".join(f"{label}{_above_100_reason(base, r, e)}" for label, e, eff in (
            ("", r.best, r.efficiency), ("flat: ", r.flat, r.flat_efficiency), ("HSDP: ", r.hsdp, r.hsdp_efficiency))
            if e is not None and eff > 1.0005 and (label == "" or e is not r.best))
    return rows
