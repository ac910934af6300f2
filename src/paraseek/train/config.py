"""The run configuration of `paraseek train`: one flat dataclass, filled from a TOML file and the command line
(the command line wins), validated before anything starts or is written."""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paraseek.errors import UserError
from paraseek.planner.dims import ParallelDims, default_virtual_stages


@dataclass
class TrainConfig:
    model: str = "tiny-moe"  # preset name or HF folder
    device: str = ""  # cpu | cuda; "" = cuda when available
    nproc: int = 0  # processes on this node; 0 = one per GPU (4 on CPU)
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""  # HOST:PORT of node 0 for multi-node runs
    plan: str = ""  # "auto": the planner picks the degrees, micro-batch, checkpointing and offload
    hardware: str = ""  # a `paraseek doctor --save` profile for --plan auto (default: this machine's datasheet)
    dp_replicate: int = 1  # replicas (DDP alone; with dp_shard > 1: HSDP's all-reduce dimension, across nodes)
    dp_shard: int = -1  # FSDP2 sharding degree; -1 = whatever the world size leaves
    tp: int = 1  # tensor parallel (innermost mesh dim: keep it inside a node's NVLink island)
    sequence_parallel: bool = True  # with tp: norms and residuals sharded over the sequence
    pp: int = 1  # pipeline parallel: stages cut by the planner's cost model (outermost mesh dim)
    pp_schedule: str = "1F1B"  # GPipe | 1F1B | Interleaved1F1B | LoopedBFS | InterleavedZeroBubble | ZBVZeroBubble
    pp_virtual_stages: int = 0  # stages per pp rank; 0 = 1 for GPipe/1F1B, 2 for the interleaved schedules
    ep: int = 1  # expert parallel: routed experts sharded over ep consecutive ranks of dp_shard (all-to-all dispatch)
    moe_bias_gamma: float = -1.0  # V3's aux-loss-free balancing rate; -1 = 0.001 for noaux_tc models, else off
    moe_aux_loss_alpha: float = -1.0  # balance loss weight; -1 = the model's (V2: aux_loss_alpha; V3: off), 0 = off
    reshard_after_forward: bool = True  # False keeps gathered params between forward and backward (ZeRO-2-like)
    steps: int = 100
    seq_len: int = 2048
    global_batch_size: int = 8  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 1  # sequences per forward/backward on one rank
    data: str = "synthetic"  # synthetic | a .txt/.jsonl/.parquet file or a folder of them
    tokenizer: str = ""  # an HF tokenizer.json; "" = the bundled one
    precision: str = ""  # fp32 | bf16 | fp16; "" = bf16 on CUDA, fp32 on CPU
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine/linear decay ends at lr * min_lr_ratio
    warmup_steps: int = 0
    lr_schedule: str = "cosine"  # cosine | linear | constant (after warm-up)
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    seed: int = 0
    activation_checkpointing: str = "none"  # none | full | selective
    cpu_offload: bool = False
    compile: bool = False
    loss_chunks: int = 0  # > 0: the head + cross-entropy in this many row chunks, no whole logits (not with tp/pp)
    grad_compression: str = "none"  # none | bf16 | powersgd:RANK (DDP only)
    metrics_jsonl: str = ""
    tensorboard: str = ""
    checkpoint_dir: str = ""
    # Checkpoints and stopping (train/checkpoint.py; the rules of the folder in prepare_checkpoint_dir). 500 steps:
    # what torchtitan and HF's Trainer default to; a crash then costs at most that many steps, 0 = only at the end.
    checkpoint_every: int = 500
    resume: bool = False
    keep_last: int = 0  # keep only the newest N step folders (0: every one)
    overwrite: bool = False  # start from step 0 in a --checkpoint-dir that holds checkpoints (they are removed)
    lr_schedule_reset: bool = False  # with --resume: this command's lr flags and --steps, not the original run's
    init_from: str = ""  # an HF folder to start from
    export_hf: str = ""  # write an HF folder at the end
    log_every: int = 1
    run_dir: str = ""  # progress records, crash reports, profiles, Flight Recorder dumps ("" = --metrics-jsonl's folder)
    on_anomaly: str = "warn"  # warn | skip | stop: what a NaN, loss spike or grad-norm explosion does
    comm_timeout: float = 0.0  # seconds a collective may take after the first step; 0 = the backend's default
    inject_fault: str = ""  # nan@STEP | spike@STEP | hang@RANK:STEP | slow@RANK:MS | crash@RANK:STEP, comma-separated
    profile_steps: str = ""  # A:B = torch.profiler traces of steps A..B per rank

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def dims(self) -> ParallelDims:
        """The flags' degrees as the one ParallelDims (the schedule and virtual stages mean something with pp > 1)."""
        pipelined = self.pp > 1
        return ParallelDims(dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, tp=self.tp, pp=self.pp, ep=self.ep,
                            pp_schedule=self.pp_schedule if pipelined else "none",
                            pp_virtual_stages=self.pp_virtual_stages if pipelined else 1,
                            sequence_parallel=self.sequence_parallel)

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank."""
        return self.global_batch_size // (self.micro_batch_size * self.dims.dp)

    def to_plan(self):
        """This run as the planner's Plan (what --plan auto, `paraseek bench`'s prediction and the OOM advice price)."""
        from paraseek.planner.plan import Plan

        return Plan(**dataclasses.asdict(self.dims), micro_batch_size=self.micro_batch_size,
                    activation_checkpointing=self.activation_checkpointing, cpu_offload=self.cpu_offload,
                    reshard_after_forward=self.reshard_after_forward)

    def with_plan(self, plan) -> TrainConfig:
        """This run with a planner Plan's degrees and memory settings (its schedule only when it pipelines)."""
        dims = {f.name: getattr(plan, f.name) for f in dataclasses.fields(ParallelDims)}
        if plan.pp == 1:
            del dims["pp_schedule"], dims["pp_virtual_stages"]
        return dataclasses.replace(self, **dims, micro_batch_size=plan.micro_batch_size,
                                   activation_checkpointing=plan.activation_checkpointing,
                                   cpu_offload=plan.cpu_offload, reshard_after_forward=plan.reshard_after_forward)


_CHOICES = {
    "plan": ("", "auto"),
    "device": ("cpu", "cuda"),
    "precision": ("fp32", "bf16", "fp16"),
    "lr_schedule": ("cosine", "linear", "constant"),
    "activation_checkpointing": ("none", "full", "selective"),
    "on_anomaly": ("warn", "skip", "stop"),
}
_HELP = {
    "tp": "tensor-parallel degree (attention heads, MLP width, vocabulary); innermost, inside a node",
    "sequence_parallel": "with --tp: shard norms/residual activations over the sequence (default true)",
    "pp": "pipeline-parallel degree: stages cut by the planner's per-layer cost, outermost (across nodes)",
    "pp_schedule": "torch.distributed.pipelining schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, "
                   "InterleavedZeroBubble or ZBVZeroBubble",
    "pp_virtual_stages": "stages per pp rank (0: 1 for GPipe/1F1B, 2 for the interleaved schedules)",
    "ep": "expert-parallel degree: routed experts sharded over ep ranks borrowed from --dp-shard",
    "moe_bias_gamma": "DeepSeek-V3 balancing: bias += gamma * sign(mean load - load) after each step "
                      "(-1: 0.001 for noaux_tc models)",
    "moe_aux_loss_alpha": "weight of the MoE balance loss (-1: the model's default; 0: off)",
    "plan": "'auto': run the plan `paraseek plan` predicts fastest (sets the dp degrees, micro-batch, "
            "checkpointing and offload)",
    "hardware": "a `paraseek doctor --save` (or `bench --calibrate`) profile: what --plan auto plans for, and "
                "`paraseek bench`'s MFU against its measured GEMM ceiling",
    "model": "preset name (paraseek info lists them) or an HF model folder",
    "nproc": "processes on this node (default: one per GPU; 4 on CPU)",
    "dp_shard": "FSDP2 sharding degree (-1: the world size divided by the other degrees)",
    "dp_replicate": "data-parallel replicas: DDP when dp-shard is 1, else HSDP (all-reduce across replicas)",
    "data": "'synthetic' or a .txt/.jsonl/.parquet file or folder of them",
    "loss_chunks": "compute the output head and its cross-entropy in this many row chunks (gradients on the fly): "
                   "the [tokens, vocab] logits never exist whole; 0 = off. Not with --tp (its loss is "
                   "vocab-parallel already) or --pp",
    "grad_compression": "DDP gradient compression: none, bf16, or powersgd:RANK",
    "checkpoint_every": "write a checkpoint every K steps into --checkpoint-dir, and at the end and when "
                        "SIGINT/SIGTERM stops the run (0: only then)",
    "resume": "continue from the newest complete checkpoint in --checkpoint-dir (a new or empty folder: step 0)",
    "keep_last": "keep only the newest N checkpoints, removing older ones after each save (0: keep every one)",
    "overwrite": "start again from step 0 in a --checkpoint-dir that holds checkpoints, removing them",
    "lr_schedule_reset": "with --resume: follow this command's --lr, --warmup-steps, --lr-schedule, --min-lr-ratio and "
                         "--steps instead of the schedule of the run being resumed",
    "init_from": "start from the weights of this HF folder (loaded shard by shard)",
    "export_hf": "write the trained model as an HF folder transformers loads",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per field, all defaulting to None so that only what was typed overrides the TOML file."""
    p.add_argument("--config", help="a TOML file with the same keys (dashes or underscores); flags override it")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        help_ = _HELP.get(f.name, "") + (f" (default: {f.default!r})" if f.default not in ("", -1) else "")
        if f.type == "bool":
            p.add_argument(flag, type=_parse_bool, nargs="?", const=True, default=None, metavar="BOOL", help=help_)
        else:
            kind = {"int": int, "float": float}.get(f.type, str)
            p.add_argument(flag, type=kind, default=None, choices=_CHOICES.get(f.name), help=help_)


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def from_namespace(ns: argparse.Namespace) -> TrainConfig:
    values: dict[str, Any] = {}
    if ns.config:
        path = Path(ns.config)
        if not path.is_file():
            raise UserError(f"--config {path}: no such file")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise UserError(f"--config {path}: not valid TOML ({e})") from None
        names = {f.name for f in dataclasses.fields(TrainConfig)}
        for key, value in raw.items():
            name = key.replace("-", "_")
            if name not in names:
                raise UserError(f"--config {path}: unknown key {key!r}")
            values[name] = value
    for f in dataclasses.fields(TrainConfig):
        if getattr(ns, f.name, None) is not None:
            values[f.name] = getattr(ns, f.name)
    return TrainConfig(**values)


def resolve_defaults(cfg: TrainConfig, cuda_available: bool, gpu_count: int) -> TrainConfig:
    """Fill the "auto" fields from the machine."""
    cfg = dataclasses.replace(cfg)
    if not cfg.device:
        cfg.device = "cuda" if cuda_available else "cpu"
    if not cfg.precision:
        cfg.precision = "bf16" if cfg.device == "cuda" else "fp32"
    if cfg.nproc <= 0:
        cfg.nproc = gpu_count if cfg.device == "cuda" else 4
    if not cfg.run_dir:
        cfg.run_dir = str(Path(cfg.metrics_jsonl).parent) if cfg.metrics_jsonl else "runs/last"
    other = cfg.dp_replicate * cfg.tp * cfg.pp
    if cfg.dp_shard == -1 and other > 0 and cfg.world_size % other == 0:
        cfg.dp_shard = cfg.world_size // other
    if cfg.pp_virtual_stages == 0:
        cfg.pp_virtual_stages = default_virtual_stages(cfg.pp_schedule)
    return cfg


def validate(cfg: TrainConfig, cuda_available: bool, gpu_count: int) -> None:
    """Every check that can fail on user input, before a process is launched or a file written."""
    if cfg.device == "cuda" and not cuda_available:
        raise UserError("--device cuda: no CUDA device is visible (use --device cpu, or check the driver)")
    if cfg.device == "cuda" and cfg.nproc > gpu_count:
        raise UserError(f"--nproc {cfg.nproc} but this node has {gpu_count} GPU(s)")
    for name in ("nproc", "nnodes", "steps", "seq_len", "global_batch_size", "micro_batch_size"):
        if getattr(cfg, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    if cfg.init_from and not (Path(cfg.init_from) / "config.json").is_file():
        raise UserError(f"--init-from {cfg.init_from}: not an HF folder (no config.json)")
    from paraseek.models.args import resolve_model

    args, _, _ = resolve_model(cfg.init_from or cfg.model)
    dims = cfg.dims
    options = dict(cpu_offload=cfg.cpu_offload, compile=cfg.compile, precision=cfg.precision)
    dims.check(args, cfg.seq_len, **options)  # the plan's one rule set (planner/dims.py), the planner's too
    if dims.world != cfg.world_size:
        raise UserError(
            f"{f'--pp {cfg.pp} x ' if cfg.pp > 1 else ''}--dp-replicate {cfg.dp_replicate} x --dp-shard "
            f"{cfg.dp_shard} x --tp {cfg.tp} = {dims.world}, but the world size is {cfg.world_size} "
            f"({cfg.nnodes} node(s) x {cfg.nproc} processes)"
        )
    per_step = cfg.micro_batch_size * dims.dp
    if cfg.global_batch_size % per_step:
        raise UserError(
            f"--global-batch-size {cfg.global_batch_size} is not divisible by micro-batch {cfg.micro_batch_size} x "
            f"data-parallel size {dims.dp} = {per_step}"
        )
    dims.check(args, cfg.seq_len, cfg.grad_accum_steps, **options)  # and the pipeline's micro-batch rule
    if cfg.loss_chunks < 0:
        raise UserError(f"--loss-chunks must be >= 0, got {cfg.loss_chunks}")
    if cfg.loss_chunks and (cfg.tp > 1 or cfg.pp > 1):
        raise UserError("--loss-chunks works without --tp and --pp (TP's loss is vocab-parallel already; under "
                        "pipelining the last stage's schedule computes the loss)")
    if cfg.pp > 1 and cfg.grad_compression != "none":
        raise UserError("--pp with --grad-compression is not supported yet")
    if cfg.nnodes > 1 and not cfg.rdzv_endpoint:
        raise UserError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address)")
    if cfg.grad_compression != "none":
        if not (cfg.grad_compression == "bf16" or _powersgd_rank(cfg.grad_compression)):
            raise UserError(f"--grad-compression {cfg.grad_compression!r}: expected none, bf16 or powersgd:RANK")
        if cfg.dp_shard != 1:
            raise UserError("--grad-compression needs DDP (--dp-shard 1); FSDP2 reduce-scatters uncompressed")
    if cfg.cpu_offload and cfg.device != "cuda":
        raise UserError("--cpu-offload moves GPU state to host memory; on --device cpu there is nothing to offload")
    if cfg.precision == "fp16" and cfg.device == "cpu":
        raise UserError("--precision fp16 is for GPUs without bf16; on CPU use fp32 or bf16")
    if cfg.resume and not cfg.checkpoint_dir:
        raise UserError("--resume needs --checkpoint-dir")
    if cfg.data != "synthetic" and not Path(cfg.data).exists():
        raise UserError(f"--data {cfg.data}: no such file or folder")
    from paraseek.monitor.faults import check_faults, parse_faults
    from paraseek.monitor.profile import parse_profile_steps

    check_faults(parse_faults(cfg.inject_fault), cfg.world_size, cfg.steps)
    if cfg.profile_steps:
        parse_profile_steps(cfg.profile_steps)
    if cfg.tokenizer and not Path(cfg.tokenizer).exists():
        raise UserError(f"--tokenizer {cfg.tokenizer}: no such file")


def _powersgd_rank(text: str) -> int:
    if text.startswith("powersgd:") and text[len("powersgd:"):].isdigit() and int(text[len("powersgd:"):]) > 0:
        return int(text[len("powersgd:"):])
    return 0
