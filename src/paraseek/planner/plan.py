"""The planner's two inputs besides the model: a parallel `Plan` and the `Cluster` it runs on (GPU type, node
shape, achievable rates, and which link each process group crosses under paraseek's rank order, parallel/dims.py)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from paraseek.errors import UserError
from paraseek.hardware.specs import GPU_SPECS, GPUSpec, resolve_gpu_type, spec_for_device_name
from paraseek.models.lora_spec import LoRASpec
from paraseek.parallel.dims import ParallelDims, fp8_engine_problem

AC_MODES = ("none", "selective", "full")  # activation checkpointing, least recompute first
# The pipeline schedules the planner prices (of dims.SCHEDULES: LoopedBFS and InterleavedZeroBubble run, unpriced).
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
# What the peers run and `paraseek train` does not: priced so that the planner can be checked against their published
# runs (planner/published.py), never chosen by the search, refused as a training plan (Plan.problem).
EP_DISPATCH = ("all_to_all", "deepep")
ATTENTION = ("flash", "materialized")


@dataclass(frozen=True)
class Plan(ParallelDims):
    """One way to run training: the degrees (ParallelDims: mesh order, strides and the engine's rules are defined
    there) and how each rank holds its memory."""

    micro_batch_size: int = 1  # sequences per micro-batch per dp rank
    activation_checkpointing: str = "none"  # none | selective | full
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy: sharded params, grads and AdamW states in host memory
    reshard_after_forward: bool = True  # False = ZeRO-2-like (params stay gathered between forward and backward)
    compile: bool = False  # torch.compile per block (and the loss without tp/pp): --compile
    precision: str = "bf16"  # compute dtype: bf16, or fp16 with loss scaling on GPUs without bf16
    # Packed rows with per-document attention (chat data, --doc-mask): positions, per-token RoPE tables and a
    # FlexAttention block mask live with each micro-batch. A property of the data, not a choice the search makes.
    document_mask: bool = False
    # --fp8 (parallel/fp8.py): the block projections' GEMMs in float8, and under tensorwise their FSDP2 all-gather.
    # The user's choice, as the data's document masks: numerics change, so the search never picks it.
    fp8: str = "off"
    fp8_experts: bool = False  # --fp8-experts on: the routed experts' grouped GEMMs in float8 too (with fp8)
    # --lora-rank (models/lora.py): the base frozen in the compute dtype, only the adapters trained. The user's
    # choice of what to train, so the search never picks it; it prices the run's model states, not a new plan.
    lora: LoRASpec | None = None
    # --mtp-layers D (train/mtp.py): DeepSeek-V3's multi-token-prediction modules trained beside the next-token loss,
    # on the last pipeline stage. The user's choice of objective, as lora: priced, never chosen by the search.
    mtp_layers: int = 0
    # The peers' overlap and kernels (peer_features; cost.py prices each, docs/planner.md, "Overlap"):
    # async_tp: TP's all-gathers and reduce-scatters split into tp pieces, each overlapped with a GEMM on the previous
    # piece (TorchTitan's async TP under torch.compile, Megatron-Core's --tp-comm-overlap).
    async_tp: bool = False
    # ep_dispatch "deepep": DeepSeek-V3's node-limited routing with DeepEP's dispatch: each token crosses the network
    # once per target node (at most topk_group nodes), then NVLink forwards it to its experts; fp8 out, bf16 back.
    ep_dispatch: str = "all_to_all"
    # shared_expert_overlap: the shared experts computed while dispatch and combine move the routed tokens
    # (Megatron-Core's --moe-shared-expert-overlap).
    shared_expert_overlap: bool = False
    # overlap_fb: DualPipe's overlapped forward and backward chunk pairs (DualPipeV here): a chunk's all-to-all and
    # pipeline sends run behind the other chunk's compute, on the SMs left after communication's share.
    overlap_fb: bool = False
    # attention "materialized": the score matrix written to and read from HBM (Megatron-LM 2021's fused softmax
    # kernels, before flash attention), over the whole square rather than the causal half.
    attention: str = "flash"

    @property
    def peer_features(self) -> list[str]:
        """The features of this plan that only the peers run (flags-like names), [] for a plan paraseek trains."""
        return [name for name, on in (("async TP", self.async_tp),
                                      ("DeepEP dispatch", self.ep_dispatch != "all_to_all"),
                                      ("shared-expert overlap", self.shared_expert_overlap),
                                      ("DualPipe's overlapped forward-backward", self.overlap_fb),
                                      ("materialized attention", self.attention != "flash")) if on]

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(**{f.name: getattr(self, f.name) for f in fields(ParallelDims)})

    @property
    def keeps_params_gathered(self) -> bool:
        """The engine's rule (parallel/parallelize.py): FSDP2 keeps the gathered params from forward to backward
        under pipelining, or with reshard_after_forward=False when there is more than one data-parallel rank (with
        one there is nothing to all-gather and the flag is ignored)."""
        return self.pp > 1 or (not self.reshard_after_forward and self.dp > 1)

    def n_microbatches(self, global_batch_size: int) -> int:
        return global_batch_size // (self.dp * self.micro_batch_size)

    def to_dict(self) -> dict:
        return asdict(self)

    def problem(self, args, seq_len: int, micro_batches: int | None = None, **options) -> str:
        """ParallelDims.problem with this plan's own offload, compile and precision unless given, and (engine
        rules on) what its --fp8 does not compose with."""
        options = {"cpu_offload": self.cpu_offload, "compile": self.compile, "precision": self.precision, **options}
        engine = options.get("engine", True)
        fp8 = self.fp8 != "off" and engine
        peer = (f"{', '.join(self.peer_features)}: priced for published runs of other trainers; paraseek train does "
                "not run it") if engine and self.peer_features else ""
        return (super().problem(args, seq_len, micro_batches, **options)
                or (fp8 and fp8_engine_problem(self, self.lora is not None)) or peer)

    def replace(self, **changes) -> Plan:
        return replace(self, **changes)

    def flags(self) -> list[str]:
        """This plan as `paraseek train` flags (what differs from their defaults, plus the dp degrees, the
        micro-batch and the checkpointing mode), one "--flag value" string each."""
        out = [f"--micro-batch-size {self.micro_batch_size}", f"--dp-replicate {self.dp_replicate}",
               f"--dp-shard {self.dp_shard}"]
        out += [f"--tp {self.tp}"] if self.tp > 1 else []
        out += ["--sequence-parallel false"] if self.tp > 1 and not self.sequence_parallel else []
        if self.pp > 1:
            out += [f"--pp {self.pp}", f"--pp-schedule {self.pp_schedule}"]
            out += [f"--pp-virtual-stages {self.pp_virtual_stages}"] if self.pp_virtual_stages > 1 else []
        out += [f"--ep {self.ep}"] if self.ep > 1 else []
        out += [f"--activation-checkpointing {self.activation_checkpointing}"]
        out += ["--cpu-offload"] if self.cpu_offload else []
        out += ["--compile"] if self.compile else []
        out += ["--precision fp16"] if self.precision == "fp16" else []
        out += [f"--fp8 {self.fp8}"] if self.fp8 != "off" else []
        out += ["--fp8-experts on"] if self.fp8_experts else []
        out += [f"--mtp-layers {self.mtp_layers}"] if self.mtp_layers else []
        # Pipelining keeps parameters gathered anyway, and DDP has nothing to reshard.
        if self.pp == 1 and self.dp_shard > 1 and not self.reshard_after_forward:
            out.append("--reshard-after-forward false")
        return out


# Achievable fractions, per GPU generation. `matmul` is the large-GEMM ceiling as a fraction of the datasheet peak
# (H200 measured here: 790-803 of 989 TFLOP/s); the op-kind factors are fractions of that ceiling, calibrated on
# paraseek's eager layers and `paraseek train` on one H200 (docs/planner.md, "Calibration"). `linear`:
# transformer-shaped GEMMs with their backward; `grouped`: MoE expert GEMMs at many rows per expert (cost.py scales
# it down for few); `attention`: SDPA forward+backward on the causal half; `hbm`: memory-bound kernels vs datasheet
# bandwidth (4.26 of 4.8 TB/s copy measured); `busbw`: NCCL ring busbw vs link bandwidth (348 of 450 GB/s on NV18).
# A profile with a `paraseek bench --calibrate` section replaces matmul (as a rate), linear, grouped and attention
# with the ones measured on that machine (`calibrated` below).
@dataclass(frozen=True)
class Efficiency:
    matmul: float
    linear: float = 0.73
    grouped: float = 0.60
    attention: float = 0.50
    hbm: float = 0.85
    busbw: float = 0.77


EFFICIENCY = {
    "hopper": Efficiency(matmul=0.80),
    "ampere": Efficiency(matmul=0.85, attention=0.55),
    "ada": Efficiency(matmul=0.75, attention=0.45),
    "volta": Efficiency(matmul=0.75, attention=0.30, grouped=0.40),  # no flash attention: mem-efficient kernel only
    # T4: a 70 W card whose clocks drop under sustained tensor-core load; an estimate, not measured here.
    "turing": Efficiency(matmul=0.60, attention=0.30, grouped=0.40),
}
ARCH = {"H100": "hopper", "H100-PCIe": "hopper", "H200": "hopper", "H800": "hopper", "H20": "hopper",
        "A100-40GB": "ampere", "A100-80GB": "ampere", "A800": "ampere", "L40S": "ada", "RTX4090": "ada",
        "V100-32GB": "volta", "V100-16GB": "volta", "T4": "turing"}
# Inter-node bandwidth per GPU (GB/s, NIC line rate / 8) of a typical node of these GPUs: one 400 Gb/s NIC per
# GPU on Hopper (DeepSeek's H800 nodes too), 200 Gb/s HDR on Ampere, 100 Gb/s Ethernet per GPU on PCIe cards.
NIC_GBPS = {"hopper": 50.0, "ampere": 25.0, "ada": 12.5, "volta": 12.5, "turing": 12.5}


@dataclass(frozen=True)
class Cluster:
    """GPUs of one type, `gpus_per_node` per node, rates the planner prices work at."""

    gpu: GPUSpec
    n_gpus: int
    gpus_per_node: int
    matmul_tflops: float  # achievable large-GEMM rate (bf16, or fp16 on V100)
    intra_busbw_gbps: float  # NCCL busbw inside a node (NVLink, or PCIe without it)
    inter_busbw_gbps: float  # NCCL busbw per GPU across nodes
    hbm_gbps: float  # achievable device-memory bandwidth (memory-bound kernels)
    eff: Efficiency
    memory_gib: float  # usable device memory
    host_memory_gib: float  # per node
    notes: tuple[str, ...] = ()  # what was assumed about these GPUs (an alias taken as a type, fp16 for no bf16)

    @property
    def nodes(self) -> int:
        return math.ceil(self.n_gpus / self.gpus_per_node)

    @property
    def precision(self) -> str:
        """The compute dtype plans on these GPUs train in: bf16, or fp16 where there is none."""
        return "bf16" if self.gpu.has_bf16 else "fp16"

    @property
    def peak_tflops(self) -> float:  # MFU denominator: the datasheet peak, as the peers quote it
        return self.gpu.bf16_tflops if self.gpu.has_bf16 else self.gpu.fp16_tflops

    def with_gpus(self, n_gpus: int) -> Cluster:
        """The same node type, n_gpus of them (a partial node when fewer than gpus_per_node)."""
        return replace(self, n_gpus=n_gpus, gpus_per_node=min(self.gpus_per_node, n_gpus))

    def busbw(self, stride: int, size: int, ring: bool = True) -> tuple[float, bool]:
        """(busbw in B/s, crosses nodes) of a process group of `size` ranks `stride` apart. With tp innermost and
        gpus_per_node a multiple of the inner dims, a group stays in one node iff stride * size <= gpus_per_node.
        Across nodes the traffic goes over the NICs, inter_busbw_gbps per GPU (one NIC per GPU, or a share of one):
        a ring collective (all-reduce, all-gather, reduce-scatter) over p of a node's GPUs crosses each node
        boundary once per channel, and NCCL spreads its channels over the NICs of those p GPUs, so its ring runs at
        min(intra-node busbw, p x the per-GPU NIC rate); all-to-all and point-to-point traffic (ring=False) leaves
        each GPU through its own NIC share. A group with one rank per node (HSDP's replicas, pp) has p = 1."""
        if stride * size <= self.gpus_per_node:
            return self.intra_busbw_gbps * 1e9, False
        per_node = max(1, min(size, self.gpus_per_node // stride))  # the group's ranks in one node
        if not ring or per_node == 1:
            return self.inter_busbw_gbps * 1e9, True
        return min(self.intra_busbw_gbps, per_node * self.inter_busbw_gbps) * 1e9, True

    def describe(self) -> str:
        link = f"{'NVLink' if self.gpu.nvlink_gbps else 'PCIe'} busbw {self.intra_busbw_gbps:.0f} GB/s"
        return (f"{self.n_gpus} x {self.gpu.name} ({self.memory_gib:.0f} GiB), {self.gpus_per_node}/node, {link}, "
                f"inter-node {self.inter_busbw_gbps:.0f} GB/s/GPU, matmul {self.matmul_tflops:.0f} TFLOP/s")


def _intra_busbw(spec: GPUSpec, eff: Efficiency) -> float:
    # Without NVLink, collectives go through PCIe and often the CPU's root complex (P2P through the host, or NCCL's
    # shared-memory transport): half the link rate is an estimate, which a doctor profile's measured
    # intra_node_busbw_gbps replaces.
    return spec.nvlink_gbps * eff.busbw if spec.nvlink_gbps else spec.pcie_gbps * 0.5


def make_cluster(gpu_type: str, n_gpus: int, gpus_per_node: int | None = None,
                 inter_node_gbps: float | None = None) -> Cluster:
    """A cluster from datasheet defaults. `inter_node_gbps`: inter-node bandwidth per GPU in GB/s (line rate)."""
    spec, alias_note = resolve_gpu_type(gpu_type)
    if n_gpus <= 0:
        raise UserError(f"--gpus must be a positive number of GPUs, got {n_gpus}")
    gpn = gpus_per_node if gpus_per_node is not None else min(n_gpus, 8)
    if gpn <= 0:
        raise UserError(f"--gpus-per-node must be positive, got {gpus_per_node}")
    if n_gpus > gpn and n_gpus % gpn:
        raise UserError(f"--gpus {n_gpus} is not a multiple of --gpus-per-node {gpn}; use whole nodes")
    if inter_node_gbps is not None and inter_node_gbps <= 0:
        raise UserError(f"--inter-node-gbps must be positive, got {inter_node_gbps}")
    arch = ARCH.get(spec.name, "hopper")
    eff = EFFICIENCY[arch]
    nic = inter_node_gbps if inter_node_gbps is not None else NIC_GBPS[arch]
    return Cluster(
        gpu=spec, n_gpus=n_gpus, gpus_per_node=min(gpn, n_gpus),
        matmul_tflops=(spec.bf16_tflops if spec.has_bf16 else spec.fp16_tflops) * eff.matmul,
        # Across nodes NCCL's ring busbw is taken as 80% of the NIC line rate (protocol, PCIe and proxy overheads):
        # an estimate, which a doctor profile's measured inter_node_busbw_gbps replaces.
        intra_busbw_gbps=_intra_busbw(spec, eff), inter_busbw_gbps=nic * 0.8, hbm_gbps=spec.hbm_gbps * eff.hbm,
        eff=eff,
        memory_gib=spec.memory_gib, host_memory_gib=spec.host_memory_gib,
        notes=tuple(n for n in (alias_note, precision_note(spec)) if n),
    )


def precision_note(spec: GPUSpec) -> str:
    """What the planner assumes about a GPU without bf16 ("" when it has bf16)."""
    if spec.has_bf16:
        return ""
    return (f"{spec.name} has no bf16: plans train in fp16 with dynamic loss scaling (--precision fp16; no --pp), "
            "priced at the fp16 rate")


def _positive(where: str, key: str, value: object, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise UserError(f"{where}: {key!r} must be a positive number, got {value!r}")
    return float(value)


# What `paraseek bench --calibrate` measured for isolated kernels on the machine the Hopper efficiencies above were
# fitted on (2x H200, 2026-11-30: benchmarks/2026-11-30/h200-calibrated-profile.json). Those efficiencies are
# in-training rates: they also absorb what the planner does not price apart (launch gaps, collectives sharing the
# SMs, the layouts of real activations). Priced at the isolated rates, five held-out H200 runs came out 16-22%
# optimistic; scaled by this machine's kernels relative to these, they price the reference machine as the defaults do.
REFERENCE_KERNEL_EFFICIENCY = {"linear": 0.9582, "attention": 0.5208, "grouped": 1.0}


def calibrated(c: Cluster, cal: dict, where: str) -> Cluster:
    """`c` at the rates `paraseek bench --calibrate` measured (the profile's "calibration" section,
    bench/calibrate.py): matmul_tflops and hbm_gbps replace the doctor's 8192^3 figure and the datasheet; each
    linear/attention/grouped efficiency becomes the fitted Hopper one times the measured kernel efficiency over
    the reference machine's (REFERENCE_KERNEL_EFFICIENCY), at most 1 (missing ones keep the per-generation
    defaults). Link rates are not calibrated here: they stay the doctor's."""
    if not isinstance(cal, dict):
        raise UserError(f"{where}: 'calibration' must be an object; run `paraseek bench --calibrate` again")
    effs = cal.get("efficiency") or {}
    if not isinstance(effs, dict):
        raise UserError(f"{where}: 'calibration.efficiency' must be an object")
    eff = {}
    for key in ("linear", "attention", "grouped"):
        value = _positive(where, f"calibration.efficiency.{key}", effs.get(key), getattr(c.eff, key))
        if value > 1:  # fractions of the measured GEMM ceiling
            raise UserError(f"{where}: 'calibration.efficiency.{key}' must be at most 1, got {value!r}")
        if effs.get(key) is not None:
            value = min(1.0, getattr(EFFICIENCY["hopper"], key) * value / REFERENCE_KERNEL_EFFICIENCY[key])
        eff[key] = value
    return replace(
        c,
        matmul_tflops=_positive(where, "calibration.matmul_tflops", cal.get("matmul_tflops"), c.matmul_tflops),
        hbm_gbps=_positive(where, "calibration.hbm_gbps", cal.get("hbm_gbps"), c.hbm_gbps),
        eff=replace(c.eff, **eff),
    )


def load_profile(path: str | Path, n_gpus: int | None = None) -> Cluster:
    """A cluster from a `paraseek doctor --save` profile: keys gpu_name, memory_gib, gpus_per_node, nodes,
    matmul_tflops, hbm_gbps, intra_node_busbw_gbps, inter_node_busbw_gbps (measured; each one present and not
    null overrides the datasheet default), then a `calibration` section (`paraseek bench --calibrate`) if any."""
    from paraseek.hardware.profile import load_profile as read_profile

    p = Path(path)
    prof = read_profile(p, required=("gpu_name",))
    name = str(prof["gpu_name"])
    spec = GPU_SPECS.get(name) or next((s for k, s in GPU_SPECS.items() if k.lower() == name.lower()), None)
    spec = spec or spec_for_device_name(name)
    if spec is None:
        raise UserError(f"{p}: GPU {name!r} is not one the planner knows ({', '.join(GPU_SPECS)})")
    gpn = int(prof.get("gpus_per_node") or 8)
    total = n_gpus if n_gpus is not None else gpn * int(prof.get("nodes") or 1)
    c = make_cluster(spec.name, total, gpn)

    def num(key: str, default: float) -> float:
        return _positive(str(p), key, prof.get(key), default)

    c = replace(
        c,
        memory_gib=num("memory_gib", c.memory_gib),
        matmul_tflops=num("matmul_tflops", c.matmul_tflops),
        intra_busbw_gbps=num("intra_node_busbw_gbps", c.intra_busbw_gbps),
        # The doctor's inter-node all-reduce runs over every GPU of every node: a flat ring whose gpus_per_node GPUs
        # in a node share that node's NICs (Cluster.busbw). Its busbw / gpus_per_node is the per-GPU NIC share the
        # planner prices (a lower bound when NVLink, not the NICs, bounded that ring).
        inter_busbw_gbps=num("inter_node_busbw_gbps", c.inter_busbw_gbps * gpn) / gpn,
        hbm_gbps=num("hbm_gbps", c.hbm_gbps),
    )
    return calibrated(c, prof["calibration"], str(p)) if prof.get("calibration") is not None else c
