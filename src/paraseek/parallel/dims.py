"""The parallel plan's degrees (`ParallelDims`) and the one rule set that says whether `paraseek train` runs them.

The planner describes plans, parallel/ and train/ realize them: `TrainConfig.dims` translates the flags into a
ParallelDims, parallel/mesh.py builds its DeviceMesh, parallel/parallelize.py applies it, and the planner, which
imports it from here, prices it (`planner.Plan` adds how each rank holds memory). Beside it the pure rules both sides
share: which chunks a pipeline rank holds (`rank_chunks`), and where float8 pays and gathers (`fp8_pays`,
`float8_all_gather`). `problem()` is the rule set: the CLI calls `check` before a process
is launched, the planner turns the same message into a rejection reason. Pure Python: neither imports torch for it.

Mesh order, outermost (slowest-varying rank) first: pp, dp_replicate, dp_shard, tp; with expert parallelism dp_shard is
(dp_shard / ep, ep), so an EP group is ep consecutive dp_shard ranks. tp is innermost, so a tensor-parallel group is tp
consecutive ranks (one NVLink island); pp is outermost, since stages exchange only activations, point to point, and so
the cheapest traffic crosses the slowest links; dp_replicate outside dp_shard, so HSDP reduce-scatters inside a node and
all-reduces across nodes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from paraseek.errors import UserError
from paraseek.models.args import ModelArgs

# torch.distributed.pipelining's schedules. The single-stage ones hold one stage per rank, the others v >= 2.
SINGLE_SCHEDULES = ("GPipe", "1F1B")
MULTI_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# Two stages per rank in the V shape (rank r holds stages r and 2pp - 1 - r): torch's ZBVZeroBubble and DualPipeV
# (DeepSeek's DualPipe cut in half, deepseek-ai/DualPipe; torch.distributed.pipelining.ScheduleDualPipeV).
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE_SCHEDULES + MULTI_SCHEDULES


def default_virtual_stages(schedule: str) -> int:
    """Stages per pp rank when not given: 1 for GPipe/1F1B, 2 for the interleaved schedules."""
    return 1 if schedule in SINGLE_SCHEDULES else 2


@dataclass(frozen=True)
class ParallelDims:
    """How the world is cut. world = pp * dp_replicate * dp_shard * tp; ep borrows ranks from dp_shard."""

    dp_replicate: int = 1  # replicas: DDP alone, HSDP's all-reduce dimension with dp_shard > 1
    dp_shard: int = 1  # FSDP2 (ZeRO-3) sharding degree of params, grads and optimizer states
    tp: int = 1  # tensor parallel (Megatron-style, with sequence parallelism by default)
    pp: int = 1  # pipeline stages' ranks; stages cut by the planner's per-layer cost
    pp_schedule: str = "none"  # "none" when pp == 1, else one of SCHEDULES
    pp_virtual_stages: int = 1  # model chunks per pp rank (interleaved schedules: 2+, ZBVZeroBubble, DualPipeV: 2)
    ep: int = 1  # expert parallel: routed experts split over ep ranks of dp_shard (all-to-all dispatch)
    sequence_parallel: bool = True  # with tp: norms and residuals sharded over the sequence

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each has its own share of the batch (the tp ranks of one dp rank share it)."""
        return self.dp_replicate * self.dp_shard

    @property
    def n_stages(self) -> int:
        return self.pp * self.pp_virtual_stages

    @property
    def ddp(self) -> bool:
        """The engine's rule: DDP when replicas are not sharded and not pipelined (a pipelined stage runs FSDP2 over
        (dp_replicate, dp_shard), HSDP with a shard of one); a single process still runs FSDP2 on a 1-rank mesh."""
        return self.dp_replicate > 1 and self.dp_shard == 1 and self.pp == 1

    def mesh_shape(self) -> tuple[tuple[str, int], ...]:
        """The DeviceMesh's (name, size) dims, outermost first; pp and tp only when > 1, the dp dims always (FSDP2
        needs a mesh even on one rank). With ep > 1, dp_shard is split into (dp_shard_mod_ep, ep)."""
        dp_shard = (("dp_shard_mod_ep", self.dp_shard // self.ep), ("ep", self.ep)) if self.ep > 1 \
            else (("dp_shard", self.dp_shard),)
        return ((("pp", self.pp),) if self.pp > 1 else ()) + (("dp_replicate", self.dp_replicate),) + dp_shard \
            + ((("tp", self.tp),) if self.tp > 1 else ())

    def stride(self, group: str) -> int:
        """Rank distance between neighbours of a `group` under the mesh order above: the planner prices each
        collective at the link its group spans (planner.plan.Cluster.busbw). expert_dp is the dp_shard ranks outside
        an EP group (those holding the same experts)."""
        return {"tp": 1, "ep": self.tp, "dp_shard": self.tp, "expert_dp": self.tp * self.ep,
                "dp_replicate": self.tp * self.dp_shard, "pp": self.tp * self.dp_shard * self.dp_replicate}[group]

    def check(self, args: ModelArgs, seq_len: int, micro_batches: int | None = None, **options) -> None:
        """Raise UserError with `problem`'s one line if there is one."""
        if why := self.problem(args, seq_len, micro_batches, **options):
            raise UserError(why)

    def problem(self, args: ModelArgs, seq_len: int, micro_batches: int | None = None, *, cpu_offload: bool = False,
                compile: bool = False, precision: str = "bf16", engine: bool = True) -> str:
        """Why `paraseek train` cannot run these degrees for this model ("" if it can). micro_batches: per optimizer
        step and dp rank (None skips the pipeline's batch rules, which the planner asks per micro-batch size).
        engine=False keeps only what the model's shapes allow (the planner's --all-dims), dropping what the engine
        does not compose (tp with DDP, CPU offload with tp or pp, pipelines of tied embeddings, fp16 or zero-bubble
        with compile under pp)."""
        return (_degrees_problem(self, cpu_offload) or _tp_problem(self.tp, self.sequence_parallel, args, seq_len)
                or _ep_problem(self, args) or (engine and _engine_problem(self, cpu_offload))
                or _pp_problem(self, args, engine, compile, precision)
                or (micro_batches is not None and self.batch_problem(micro_batches)) or "")

    def batch_problem(self, micro_batches: int) -> str:
        """The pipeline schedules' rule on the micro-batches per step and dp rank ("" when fine)."""
        pp, schedule = self.pp, self.pp_schedule
        if pp == 1:
            return ""
        if micro_batches < pp:
            return (f"--pp {pp} needs at least {pp} micro-batches per step to fill the pipeline, but global batch / "
                    f"(micro-batch x data-parallel size) = {micro_batches}; raise --global-batch-size or lower "
                    "--micro-batch-size")
        if schedule in MULTI_SCHEDULES and schedule != "DualPipeV" and micro_batches % pp:
            return f"--pp-schedule {schedule} needs a multiple of --pp {pp} micro-batches per step, got {micro_batches}"
        if schedule == "DualPipeV" and micro_batches < 2 * pp:  # its only rule on them (ScheduleDualPipeV)
            return (f"--pp-schedule DualPipeV needs at least as many micro-batches per step as stages (2 x --pp {pp} "
                    f"= {2 * pp}), got {micro_batches}")
        return ""


def _degrees_problem(d: ParallelDims, cpu_offload: bool) -> str:
    # dp_shard last: the CLI derives it from the others, so a bad --tp reads as itself, not as a bad dp_shard
    for name in ("dp_replicate", "tp", "pp", "ep", "pp_virtual_stages", "dp_shard"):
        if getattr(d, name) <= 0:
            return f"--{name.replace('_', '-')} must be positive, got {getattr(d, name)}"
    if d.dp_shard % d.ep:
        return f"--ep {d.ep} must divide --dp-shard {d.dp_shard} (expert parallelism borrows data-parallel ranks)"
    if cpu_offload and d.ddp:  # CPUOffloadPolicy is FSDP2's
        return "--cpu-offload needs FSDP2 (--dp-shard > 1 or a single process), not DDP"
    return ""


@functools.lru_cache(maxsize=1024)
def _tp_problem(tp: int, sequence_parallel: bool, args: ModelArgs, seq_len: int) -> str:
    """Tensor parallelism shards heads, the MLP widths and the vocabulary (parallel/tensor.py): tp must divide each.
    Sequence parallelism also shards the sequence."""
    if tp == 1:
        return ""
    dims = {"attention heads (num_attention_heads)": args.n_heads, "vocab_size": args.vocab_size}
    if not args.is_mla:
        dims["key/value heads (num_key_value_heads)"] = args.n_kv_heads
    if any(not args.is_moe_layer(i) for i in range(args.n_layers)):
        dims["intermediate_size"] = args.inter_dim
    if args.n_routed_experts and args.n_shared_experts:
        dims["shared-expert width (moe_intermediate_size x n_shared_experts)"] = args.moe_inter_dim * args.n_shared_experts
    bad = {name: n for name, n in dims.items() if n % tp}
    if bad:
        fits = [t for t in range(2, 65) if all(n % t == 0 for n in dims.values())]
        what = ", ".join(f"{name} = {n}" for name, n in bad.items())
        hint = f"--tp {' or '.join(map(str, fits))} would" if fits else "only --tp 1 does"
        return f"--tp {tp} does not divide the model's {what}; {hint}"
    if sequence_parallel and seq_len % tp:
        return (f"--seq-len {seq_len} is not divisible by --tp {tp}, as sequence parallelism needs; choose a multiple "
                f"of {tp} (or --sequence-parallel false)")
    return ""


def _ep_problem(d: ParallelDims, args: ModelArgs) -> str:
    if d.ep > 1 and (not args.n_routed_experts or args.n_routed_experts % d.ep):
        return f"--ep {d.ep}: the model has {args.n_routed_experts} routed experts; ep must divide them"
    return ""


def _pp_problem(d: ParallelDims, args: ModelArgs, engine: bool, compile: bool, precision: str) -> str:
    pp, v, schedule = d.pp, d.pp_virtual_stages, d.pp_schedule
    if pp == 1:
        return ""
    if schedule not in SCHEDULES:
        return f"--pp-schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}"
    if schedule in SINGLE_SCHEDULES and v != 1:
        return (f"--pp-schedule {schedule} runs one stage per rank; use --pp-virtual-stages 1 or an interleaved "
                f"schedule ({', '.join(MULTI_SCHEDULES)})")
    if schedule in MULTI_SCHEDULES and v < 2:
        return f"--pp-schedule {schedule} needs --pp-virtual-stages 2 or more"
    if schedule in V_SCHEDULES and v != 2:
        return f"--pp-schedule {schedule} holds exactly 2 stages per rank (--pp-virtual-stages 2)"
    if engine and precision == "fp16":
        return ("--pp with --precision fp16 is not supported (the loss scaler would have to scale the loss inside the "
                "schedule and agree across stages); use bf16")
    if engine and compile and ("ZeroBubble" in schedule or schedule == "DualPipeV"):
        return (f"--pp-schedule {schedule} splits the backward into input and weight parts, which torch.compile'd "
                "blocks do not support; use 1F1B or Interleaved1F1B with --compile")
    if pp * v > args.n_layers:
        return (f"--pp {pp} x --pp-virtual-stages {v} = {pp * v} stages, but the model has {args.n_layers} layers "
                "(each stage needs at least one)")
    if engine and args.tie_embeddings:
        return ("--pp with tied input/output embeddings is not supported (the first and last stages would share one "
                "weight); use --tp or FSDP for this model")
    return ""


def fp8_engine_problem(d: ParallelDims, lora: bool) -> str:
    """What `--fp8` does not compose with in the engine (yet): the CLI (parallel/fp8.py: fp8_problem) and the
    planner's ranking (Plan.problem) ask this one rule."""
    if lora:
        return "--fp8 with --lora-rank is not supported yet; leave one of them out"
    if d.ddp:
        return "--fp8 runs with FSDP2 (--dp-shard > 1 or one process), not with DDP (--dp-shard 1 over replicas)"
    return ""


def fp8_experts_problem(recipe: str, device: str, capability: tuple[int, int] | None) -> str | None:
    """Why `--fp8-experts on` cannot run here, or None: it adds the routed experts to a --fp8 recipe, and
    torch._scaled_grouped_mm's float8 kernels are Hopper's (sm90) only. CPU: the emulation of the tests."""
    if recipe == "off":
        return ("--fp8-experts on adds the routed experts to --fp8 RECIPE; give --fp8 tensorwise, rowwise or "
                "rowwise-gw-hp")
    if device == "cuda" and capability is not None and tuple(capability)[0] != 9:
        return (f"--fp8-experts needs a Hopper GPU (compute capability 9.x: the float8 grouped GEMM's kernels); this "
                f"GPU has {capability[0]}.{capability[1]}; leave it out (the experts then train in bf16)")
    return None


def float8_all_gather(d: ParallelDims, fp8: str) -> bool:
    """Whether FSDP2 all-gathers the block projections in float8 (parallel/parallelize.py does, planner/cost.py
    prices it): tensorwise where the parameters are sharded. With one shard the "all-gather" is a local copy, and
    the weights' casts run fused inside the compiled linears instead (9% faster on one H200: BENCHMARKS.md, FP8).
    Not under TP: the tp-sharded projections and MLA's replicated latent ones live on different meshes, and
    torchao's one-pass scale precompute (fp8.precompute_scales) stacks every float8 weight's abs-max together."""
    return fp8 == "tensorwise" and not d.ddp and d.dp_shard > 1 and d.tp == 1


def rank_chunks(pp: int, v: int, schedule: str) -> list[list[int]]:
    """Which model chunks each pp rank holds: looped (r, r+pp, ...) or the V shape of ZBVZeroBubble and DualPipeV
    (r, 2pp-1-r)."""
    if schedule in V_SCHEDULES:
        return [[r, 2 * pp - 1 - r] for r in range(pp)]
    return [[r + k * pp for k in range(v)] for r in range(pp)]


def fp8_pays(recipe: str, k: int, n: int) -> bool:
    """Whether a float8 GEMM of in_features k and out_features n beats bf16 under `recipe`, casts included: torchao's
    thresholds from its H100 tables (torchao/float8 README, "Performance"; float8_linear_utils._auto_filter_for_*).
    Below them the casts and scale reductions cost more than the faster GEMM saves: DeepSeek-V2-Lite's projections
    (2048 wide) all in float8 rowwise ran 0.80x bf16 on one H200 (BENCHMARKS.md, FP8). parallel/fp8.py converts
    only these; fp8_terms prices them."""
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))  # rowwise, and rowwise-gw-hp's same casts


def _engine_problem(d: ParallelDims, cpu_offload: bool) -> str:
    """What the engine does not compose (yet)."""
    if d.tp > 1 and d.dp_shard == 1 and d.dp_replicate > 1:
        return "--tp composes with FSDP2 (--dp-shard), not with DDP; use --dp-shard instead of --dp-replicate"
    for flag, degree in (("--tp", d.tp), ("--pp", d.pp)):
        if cpu_offload and degree > 1:
            return f"{flag} with --cpu-offload is not supported yet"
    return ""
