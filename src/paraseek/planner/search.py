"""Enumerate plans, price them, rank them by predicted tokens/s, and say why the others lost.

Pruning (why it is safe): activation checkpointing is tried from the least recompute up and the first mode that
fits is kept (more recompute only costs time); CPU offload is tried for a mesh only when nothing fits without it
(it only costs time); per mesh (dp_replicate, dp_shard, tp, pp, ep) only the fastest variant is kept, so the
ranking shows different ways to cut the machine rather than 20 micro-batch sizes of the same one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paraseek.errors import UserError
from paraseek.models.args import ModelArgs
from paraseek.planner.cost import StepTime, step_time
from paraseek.planner.dims import ParallelDims
from paraseek.planner.memory import GiB, Memory, memory, model_terms
from paraseek.planner.plan import AC_MODES, Cluster, Plan

HOST_USABLE = 0.9  # of host memory, for offloaded states (the OS, data loaders and pinned buffers need the rest)
MAX_MICRO_BATCH = 64


@dataclass
class Evaluated:
    plan: Plan
    memory: Memory
    time: StepTime | None
    tokens_per_s_per_gpu: float = 0.0
    mfu: float = 0.0
    reason: str = ""  # why it does not fit ("" if it does)
    note: str = ""  # for a fitting plan: why it needs CPU offload
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
    # ZBVZeroBubble runs in the engine (CPU loss-equivalence tests) but has not been measured on GPUs yet: --plan
    # auto does not pick it.
    return out if engine_only else out + [("ZBVZeroBubble", 2)]


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
    if ev.reason or not with_time:
        return ev
    ev.time = step_time(t, c, plan, global_batch_size)
    tokens = global_batch_size * seq_len
    ev.tokens_per_s_per_gpu = tokens / ev.time.total / plan.world
    ev.mfu = t.flops_per_token * ev.tokens_per_s_per_gpu / (c.peak_tflops * 1e12)
    return ev


def _mesh(plan: Plan) -> dict:
    return {"dp_replicate": plan.dp_replicate, "dp_shard": plan.dp_shard, "tp": plan.tp, "pp": plan.pp, "ep": plan.ep}


def _best_of_mesh(args: ModelArgs, c: Cluster, base: Plan, seq_len: int, gbs: int,
                  engine_only: bool = False) -> tuple[Evaluated | None, Evaluated | None, int, str]:
    """(fastest fitting variant, closest non-fitting variant, variants priced, why no variant runs) of one mesh.
    Each variant is first held against the engine's rules (ParallelDims.problem); the closest miss's reason also
    says why the same mesh fails without offload, when offload was the closest."""
    local = gbs // base.dp
    mbs_options = [d for d in divisors(local) if d <= MAX_MICRO_BATCH]
    if base.pp > 1:
        reshard_options = [False]  # pipelining keeps params gathered across micro-batches anyway
    elif base.dp_shard > 1:
        reshard_options = [True, False]
    else:
        reshard_options = [True]  # DDP: nothing to reshard
    best = None
    closest: dict[bool, Evaluated] = {}
    n, why_not = 0, ""
    for offload in (False, True):
        for schedule, v in _schedules(args, base.pp, engine_only):
            variant = base.replace(pp_schedule=schedule, pp_virtual_stages=v, cpu_offload=offload)
            if why := variant.problem(args, seq_len, cpu_offload=offload, engine=engine_only):
                why_not = why_not or why
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
                            if best is None or ev.tokens_per_s_per_gpu > best.tokens_per_s_per_gpu:
                                best = ev
                            break  # more recompute would only be slower
                        if offload not in closest or ev.overflow < closest[offload].overflow:
                            closest[offload] = ev
                if not fits_any:
                    break  # memory grows with the micro-batch size: larger ones won't fit either
        if best is not None:
            break  # offload only when nothing fits without it
    if best is not None and best.plan.cpu_offload and False in closest:
        best.note = f"CPU offload: without it the closest plan {closest[False].reason}"
    if not closest:
        return best, None, n, why_not
    miss = min(closest.values(), key=lambda e: e.overflow)
    if miss.plan.cpu_offload and False in closest:
        miss.reason = f"{closest[False].reason}; with CPU offload: {miss.reason}"
    return best, miss, n, why_not


def search(args: ModelArgs, c: Cluster, seq_len: int, global_batch_size: int, model: str = "",
           engine_only: bool = False, document_mask: bool = False) -> SearchResult:
    """Every mesh of c.n_gpus GPUs, its best variant, ranked by predicted tokens/s per GPU. engine_only ranks only
    what `paraseek train` runs (ParallelDims.problem with the engine's rules, the same check the CLI makes before a
    launch); without it the planner also prices the compositions the engine does not run, and ZBVZeroBubble.
    `document_mask`: the data is packed with document masks (Plan.document_mask)."""
    if seq_len <= 0:
        raise UserError(f"--seq-len must be positive, got {seq_len}")
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
                                document_mask=document_mask)
                    best, closest, n, why_not = _best_of_mesh(args, c, base, seq_len, global_batch_size, engine_only)
                    res.evaluated += n
                    if best is not None:
                        res.plans.append(best)
                    elif closest is not None:
                        res.rejected.append(Rejected(closest.plan, _mesh(base), closest.reason, closest.memory,
                                                     closest.overflow))
                    elif why_not:
                        reject(why_not, **_mesh(base))
    res.plans.sort(key=lambda e: -e.tokens_per_s_per_gpu)
    # Closest to fitting first; structural reasons last.
    res.rejected.sort(key=lambda r: r.overflow)
    return res


def best_plan(args: ModelArgs, c: Cluster, seq_len: int, global_batch_size: int,
              document_mask: bool = False) -> Evaluated:
    """The predicted-fastest plan that fits (what `paraseek train --plan auto` runs). Raises UserError with the
    closest miss's reason when nothing fits."""
    res = search(args, c, seq_len, global_batch_size, engine_only=True, document_mask=document_mask)
    if not res.plans:
        why = res.rejected[0].reason if res.rejected else "no mesh is possible"
        raise UserError(f"no parallel plan fits {c.n_gpus} x {c.gpu.name}: closest: {why}")
    return res.plans[0]


@dataclass
class ScalingRow:
    gpus: int
    result: SearchResult | None
    best: Evaluated | None
    efficiency: float = 0.0  # tokens/s/GPU relative to the first count that has a plan
    reason: str = ""


def scaling(args: ModelArgs, c: Cluster, counts: list[int], seq_len: int, global_batch_size: int,
            model: str = "", document_mask: bool = False) -> list[ScalingRow]:
    """The best plan at each GPU count, same model, global batch (strong scaling) and node shape."""
    rows = []
    for n in counts:
        if n <= 0:
            raise UserError(f"--scaling: GPU counts must be positive, got {n}")
        if n > c.gpus_per_node and n % c.gpus_per_node:
            raise UserError(f"--scaling: {n} GPUs is not a whole number of {c.gpus_per_node}-GPU nodes")
        try:
            res = search(args, c.with_gpus(n), seq_len, global_batch_size, model, document_mask=document_mask)
        except UserError as e:  # e.g. the batch cannot be divided at this count: a row, not the end
            rows.append(ScalingRow(n, None, None, reason=str(e)))
            continue
        if res.plans:
            rows.append(ScalingRow(n, res, res.plans[0]))
        else:
            why = res.rejected[0].reason if res.rejected else "no mesh is possible"
            rows.append(ScalingRow(n, res, None, reason=f"nothing fits: {why}"))
    base = next((r for r in rows if r.best is not None), None)
    for r in rows:
        if r.best is not None and base is not None and base.best is not None:
            r.efficiency = r.best.tokens_per_s_per_gpu / base.best.tokens_per_s_per_gpu
    return rows
