"""The run configuration of `paraseek train`: one flat dataclass and the rule of each of its fields, whatever the
source (train/flags.py fills it from a TOML file and the command line, train/validate.py checks it as a whole), and
the defaults this machine fills in."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paraseek.errors import UserError
from paraseek.parallel.dims import SCHEDULES, ParallelDims, default_virtual_stages


@dataclass
class TrainConfig:
    model: str = "tiny-moe"  # preset name or HF folder
    device: str = ""  # cpu | cuda; "" = cuda when available
    nproc: int = 0  # processes on this node; 0 = one per GPU (4 on CPU)
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""  # HOST:PORT of node 0 for multi-node runs
    rdzv_timeout: float = 600.0  # seconds a node waits for the others to join (torchrun's default join timeout)
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
    seq_len: int = 2048  # unless given: 2048, or the model's positions when fewer (from_namespace)
    global_batch_size: int = 8  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 1  # sequences per forward/backward on one rank
    data: str = "synthetic"  # synthetic | a .txt/.jsonl/.parquet file or a folder of them
    tokenizer: str = ""  # an HF tokenizer.json or a folder; "" = --init-from's if it has one, else the bundled one
    chat_template: str = ""  # a Jinja file for chat data, replacing the tokenizer folder's template
    pack: bool = True  # several documents per window; false: one per row, padded (train/dataset.py)
    doc_mask: str = "auto"  # auto | true | false: attention inside each document; auto = on for chat data only
    loss_on: str = "assistant"  # assistant | all | last-turn (chat data; text trains on every token)
    overlong: str = "truncate"  # truncate | drop: a conversation longer than seq_len + 1 tokens
    eval_data: str = ""  # held-out data (same formats) whose loss is evaluated
    eval_every: int = 0  # evaluate every N steps (and after the last); 0 = after the last step only
    eval_split: float = 0.0  # hold out this fraction of --data's windows as evaluation data instead
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
    # LoRA (models/lora_spec.py): adapters trained on the frozen --init-from model; checkpoints hold the adapters.
    lora_rank: int = 0  # r > 0 turns LoRA on; 0 = off (every parameter is trained)
    lora_alpha: float = 0.0  # the update is scaled by alpha / r; 0 = r (scaling 1)
    lora_targets: str = ""  # comma-separated targets or shorthands (attention, mlp, shared_experts, experts); "" = all
    fp8: str = "off"  # off | tensorwise | rowwise | rowwise-gw-hp: float8 projections (parallel/fp8.py)
    fp8_experts: str = "off"  # off | on: the routed experts' grouped GEMMs in float8 too (parallel/fp8.py)
    # Multi-token prediction (train/mtp.py): DeepSeek-V3's MTP modules trained beside the next-token loss.
    mtp_layers: int = -1  # MTP depths D trained; -1 = the MTP modules the model holds (V3: 1, the others: 0)
    mtp_loss_weight: float = -1.0  # lambda of L_main + lambda / D * sum_k L_MTP^k; -1 = 0.1
    mtp_loss_weight_final: float = -1.0  # lambda after --mtp-loss-weight-switch-step (V3: 0.3, then 0.1); -1 = none
    mtp_loss_weight_switch_step: int = 0  # the last step with --mtp-loss-weight; 0 = no switch

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

        lora = None
        if self.lora_rank:
            from paraseek.models import resolve_model

            lora = self.lora_for(resolve_model(self.init_from or self.model)[0])
        return Plan(**dataclasses.asdict(self.dims), micro_batch_size=self.micro_batch_size,
                    activation_checkpointing=self.activation_checkpointing, cpu_offload=self.cpu_offload,
                    reshard_after_forward=self.reshard_after_forward, compile=self.compile,
                    precision="fp16" if self.precision == "fp16" else "bf16",
                    document_mask=self.doc_mask == "true", fp8=self.fp8,
                    fp8_experts=self.fp8_experts == "on", lora=lora)

    def lora_for(self, args):
        """The run's LoRASpec (models/lora_spec.py) on the model `args`; None without --lora-rank."""
        from paraseek.models.lora_spec import lora_spec

        return lora_spec(self.lora_rank, self.lora_alpha, self.lora_targets, args, self.init_from or self.model)

    def with_plan(self, plan) -> TrainConfig:
        """This run with a planner Plan's degrees, memory settings, compile and precision (its schedule only when it
        pipelines; the precision only when the plan needs fp16, else the config's own, bf16 on GPUs)."""
        dims = {f.name: getattr(plan, f.name) for f in dataclasses.fields(ParallelDims)}
        if plan.pp == 1:
            del dims["pp_schedule"], dims["pp_virtual_stages"]
        return dataclasses.replace(self, **dims, micro_batch_size=plan.micro_batch_size,
                                   activation_checkpointing=plan.activation_checkpointing,
                                   cpu_offload=plan.cpu_offload, reshard_after_forward=plan.reshard_after_forward,
                                   compile=plan.compile,
                                   precision="fp16" if plan.precision == "fp16" else self.precision)


# The rule of every field, whatever its source (a flag, a TOML key, code): its annotated type, its choices, and its
# range. A number must be >= 0 unless listed below, so a field added to TrainConfig is checked without a new line.
CHOICES = {
    "plan": ("", "auto"),
    "device": ("cpu", "cuda"),
    "precision": ("fp32", "bf16", "fp16"),
    "lr_schedule": ("cosine", "linear", "constant"),
    "activation_checkpointing": ("none", "full", "selective"),
    "on_anomaly": ("warn", "skip", "stop"),
    "pp_schedule": SCHEDULES,
    "doc_mask": ("auto", "true", "false"),
    "loss_on": ("assistant", "all", "last-turn"),
    "overlong": ("truncate", "drop"),
    "fp8": ("off", "tensorwise", "rowwise", "rowwise-gw-hp"),
    "fp8_experts": ("off", "on"),
}
_AT_LEAST = {"nnodes": 1, "steps": 1, "seq_len": 1, "global_batch_size": 1, "micro_batch_size": 1, "log_every": 1,
             "rdzv_timeout": 1}
_AT_MOST = {"min_lr_ratio": 1}
_AUTO = {"dp_shard": -1, "moe_bias_gamma": -1, "moe_aux_loss_alpha": -1,  # the value that means "the default"
         "mtp_layers": -1, "mtp_loss_weight": -1, "mtp_loss_weight_final": -1}
_DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "ep")  # ranges: ParallelDims' rule set (parallel/dims.py)
KINDS = {"int": (int, "an integer"), "float": (float, "a number"), "bool": (bool, "true or false"),
         "str": (str, "a string")}
FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def field_problem(name: str, value: Any, where: str) -> str:
    """Why `value` cannot be the field `name` ("" if it can): its type, choices and range. `where` names the source
    in the message: "--lr", or "lr in run.toml"."""
    kind, what = KINDS[FIELDS[name].type]
    if kind is bool:
        ok = isinstance(value, bool)
    else:  # True is an int to Python, not to a user
        ok = isinstance(value, (int, float) if kind is float else kind) and not isinstance(value, bool)
    if not ok:
        return f"{where} must be {what}, got {value!r}"
    if kind is float and not math.isfinite(value):
        return f"{where} must be a finite number, got {value!r}"
    if name in CHOICES and value not in CHOICES[name]:
        choices = [c for c in CHOICES[name] if c]
        hint = [c for c in choices if c.lower() == value.lower()] or difflib.get_close_matches(value, choices, n=1)
        return (f"{where} must be one of {', '.join(choices)}, got {value!r}"
                + (f" (did you mean {hint[0]}?)" if hint else ""))
    if kind in (int, float) and name not in _DEGREES and value != _AUTO.get(name):
        low, high = _AT_LEAST.get(name, 0), _AT_MOST.get(name)
        if value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f">= {low}"
            auto = f" (or {_AUTO[name]}: the default)" if name in _AUTO else ""
            return f"{where} must be {bound}{auto}, got {value!r}"
    return ""


def check_fields(cfg: TrainConfig) -> None:
    """Every field's own rule (`field_problem`), for a configuration however it was made."""
    for f in dataclasses.fields(cfg):
        if why := field_problem(f.name, getattr(cfg, f.name), "--" + f.name.replace("_", "-")):
            raise UserError(why)


def resolve_defaults(cfg: TrainConfig, cuda_available: bool, gpu_count: int) -> TrainConfig:
    """Fill the "auto" fields from the machine (and the tokenizer from --init-from), so that what runs, what the
    checkpoint records and what --print-config shows are the same values."""
    cfg = dataclasses.replace(cfg)
    if not cfg.device:
        cfg.device = "cuda" if cuda_available else "cpu"
    if not cfg.precision:
        cfg.precision = "bf16" if cfg.device == "cuda" else "fp32"
    if cfg.nproc == 0:
        cfg.nproc = gpu_count if cfg.device == "cuda" else 4
    if not cfg.run_dir:
        cfg.run_dir = str(Path(cfg.metrics_jsonl).parent) if cfg.metrics_jsonl else "runs/last"
    other = cfg.dp_replicate * cfg.tp * cfg.pp
    if cfg.dp_shard == -1 and other > 0 and cfg.world_size % other == 0:
        cfg.dp_shard = cfg.world_size // other
    if cfg.pp_virtual_stages == 0:
        cfg.pp_virtual_stages = default_virtual_stages(cfg.pp_schedule)
    if cfg.init_from:
        cfg.model = cfg.init_from  # its config.json is the model
    if cfg.data != "synthetic" and not cfg.tokenizer:
        # The model's own tokenizer when --init-from has one; the header's first line names whichever it is.
        from paraseek.models.tokenizer import BUNDLED_TOKENIZER

        has_own = cfg.init_from and (Path(cfg.init_from) / "tokenizer.json").is_file()
        cfg.tokenizer = cfg.init_from if has_own else str(BUNDLED_TOKENIZER)
    if cfg.doc_mask == "auto":  # on for packed chat data (train/dataset.py says why), what the planner then prices
        cfg.doc_mask = "true" if cfg.pack and _is_chat(cfg.data) else "false"
    return cfg


def _is_chat(data: str) -> bool:
    if data == "synthetic" or not Path(data).exists():
        return False  # validate says what is wrong with a missing path
    from paraseek.train.corpus import data_kind, list_files

    return data_kind(list_files(data)) == "chat"


def config_toml(cfg: TrainConfig) -> str:
    """The configuration as a TOML file that --config reads back: every field, in declaration order."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        return json.dumps(v) if isinstance(v, str) else repr(v)  # JSON's string escapes are TOML's

    lines = [f"{f.name} = {value(getattr(cfg, f.name))}" for f in dataclasses.fields(cfg)]
    return "# paraseek train --print-config: the TOML file, the flags and this machine's defaults, merged\n" + \
        "\n".join(lines) + "\n"


def tokenizer_origin(cfg: TrainConfig) -> str:
    """Where the run's tokenizer came from, for the header line and error messages."""
    from paraseek.models.tokenizer import BUNDLED_TOKENIZER

    if cfg.init_from and cfg.tokenizer == cfg.init_from:
        return f"--init-from's {Path(cfg.init_from) / 'tokenizer.json'}"
    if cfg.tokenizer == str(BUNDLED_TOKENIZER):
        return f"the bundled {BUNDLED_TOKENIZER.name}"
    return f"--tokenizer {cfg.tokenizer}"
