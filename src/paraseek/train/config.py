"""The run configuration of `paraseek train`: one flat dataclass, filled from a TOML file and the command line
(the command line wins), validated before anything starts or is written."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paraseek.errors import UserError, check_writable
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
_CHOICES = {
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
# "Did you mean" for an unknown name (a TOML key or a flag of any command): first the names other tools use (each
# key's candidates in order, the first one the command has), then the same words in other spellings (`_WORDS`, with
# the filler words dropped: max_sequence_length -> seq_len), then the closest spelling (difflib).
_ALIASES = {"learning_rate": ("lr",),
            "batch_size": ("global_batch_size",), "train_batch_size": ("global_batch_size",),
            "per_device_train_batch_size": ("micro_batch_size",), "micro_batch": ("micro_batch_size",),
            "ckpt_dir": ("checkpoint_dir",), "save_dir": ("checkpoint_dir",), "output_dir": ("checkpoint_dir",),
            "save_every": ("checkpoint_every",), "save_steps": ("checkpoint_every",),
            "save_interval": ("checkpoint_every",), "max_seq_len": ("seq_len", "max_model_len"),
            "max_seq_length": ("seq_len", "max_model_len"), "context_length": ("seq_len", "max_model_len"),
            "warmup": ("warmup_steps",), "lr_warmup": ("warmup_steps",), "lr_warmup_steps": ("warmup_steps",),
            "dtype": ("precision",), "mixed_precision": ("precision",),
            "gradient_checkpointing": ("activation_checkpointing",), "max_grad_norm": ("grad_clip",),
            "clip_grad": ("grad_clip",), "gradient_clipping": ("grad_clip",), "num_gpus": ("nproc",),
            "gpus": ("nproc",), "nproc_per_node": ("nproc",), "num_nodes": ("nnodes",),
            "tensor_parallel": ("tp",), "tensor_parallel_size": ("tp",), "pipeline_parallel": ("pp",),
            "pipeline_parallel_size": ("pp",), "expert_parallel": ("ep",), "resume_from_checkpoint": ("resume",),
            "logging_steps": ("log_every",), "max_tokens": ("max_new_tokens",)}
_WORDS = {"sequence": "seq", "length": "len", "iters": "steps", "iterations": "steps", "ckpt": "checkpoint",
          "interval": "every", "freq": "every", "path": "dir"}
_FILLER = {"max", "num", "total", "n", "train"}
_KINDS = {"int": (int, "an integer"), "float": (float, "a number"), "bool": (bool, "true or false"),
          "str": (str, "a string")}
_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
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
    "data": "'synthetic' or a .txt/.jsonl/.parquet file or folder of them: text (a 'text' field) or chat "
            "('messages', or 'prompt' and 'completion'; rendered with the --tokenizer folder's chat template)",
    "chat_template": "a Jinja chat template file used instead of the --tokenizer folder's",
    "pack": "pack documents into --seq-len windows (chat: whole conversations, next-fit; text: the token stream cut "
            "into windows); false: one document per row, padded",
    "doc_mask": "attention and RoPE positions restricted to each document of a packed window (auto: true for chat "
                "data, false for text)",
    "loss_on": "chat data: train on the assistant turns, on every token, or on the last assistant turn only",
    "overlong": "a conversation longer than --seq-len + 1 tokens: keep its first tokens, or drop it (counted either "
                "way)",
    "eval_data": "held-out data (the --data formats) whose loss and perplexity are reported",
    "eval_every": "evaluate every N steps and after the last (0: after the last step only)",
    "eval_split": "hold out this fraction of --data's windows (chosen by --seed) as the evaluation data",
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
    "lora_rank": "LoRA rank r > 0: train low-rank adapters on the frozen --init-from model (Hu et al. 2021)",
    "lora_alpha": "LoRA alpha: adapters scaled by alpha / r (0: alpha = r)",
    "fp8": "float8 training of the attention and MLP projections (torchao; paraseek[fp8]): tensorwise (fastest, "
           "float8 FSDP2 all-gather when sharded; on one H200 1.27x bf16 for a 7B, +0.1%% loss after 500 steps), "
           "rowwise (a scale per row: 1.09x, +3.1%%), rowwise-gw-hp (rowwise, weight gradients in high precision: "
           "+1.7%%); the head, router, embedding, routed experts (unless --fp8-experts on) and projections too "
           "small for float8 to pay (torchao's thresholds: on V2-Lite nearly all under rowwise) stay in --precision. "
           "Needs an Ada/Hopper GPU",
    "mtp_layers": "multi-token-prediction depths D to train (DeepSeek-V3 report, sec. 2.2): module k predicts the "
                  "token k + 1 positions ahead from depth k - 1's hidden state and the embedding of the token k "
                  "ahead, through the shared head (-1: the MTP modules the model holds: V3's "
                  "num_nextn_predict_layers, 0 for the other families; modules the model lacks are created fresh; "
                  "0: none trained, V3's kept as weights)",
    "mtp_loss_weight": "lambda: the loss is L_main + lambda / D * sum of the D depths' losses (-1: 0.1, the weight "
                       "V3 ended its pre-training with)",
    "mtp_loss_weight_final": "the MTP loss weight after --mtp-loss-weight-switch-step (V3's recipe: "
                             "--mtp-loss-weight 0.3 --mtp-loss-weight-final 0.1 after its first 10T tokens)",
    "mtp_loss_weight_switch_step": "the last step trained with --mtp-loss-weight; later steps use "
                                   "--mtp-loss-weight-final",
    "fp8_experts": "on: with --fp8, the routed experts' grouped GEMMs in float8 too (forward and input gradient, "
                   "per-row scales; Hopper only). Pays on big micro-batches: DeepSeek-V2-Lite (6 layers, one H200) "
                   "with --fp8 tensorwise ran 0.95x bf16 at 8k tokens per micro-batch, 1.01x at 16k, 1.07x at 32k "
                   "and 1.15x at 64k (less memory); 500-step loss vs bf16: tensorwise -0.8%% (means of 2 and 3 runs, "
                   "which themselves vary by 3.7%%), rowwise +7.6%% (one run). `paraseek plan --fp8-experts on` "
                   "predicts it. With --activation-checkpointing full and --compile, torch < 2.13 keeps the experts' "
                   "GEMM outputs (pytorch#177396: +18 GiB on that model at 64k tokens); the planner counts them",
    "lora_targets": "what LoRA adapts, comma-separated: attention projections by name (q_proj, k_proj, v_proj, "
                    "o_proj, q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj), gate_proj/up_proj/down_proj (dense "
                    "MLPs), shared_experts, experts (routed, grouped), or attention, mlp, all (default: all)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per field, all defaulting to None so that only what was typed overrides the TOML file. Choices and
    ranges are not argparse's: `field_problem` checks a flag as it checks the same TOML key."""
    p.add_argument("--config", help="a TOML file with the same keys (dashes or underscores); flags override it")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        help_ = _HELP.get(f.name, "") + (f" (default: {f.default!r})" if f.default not in ("", -1) else "")
        choices = {"metavar": "{" + ",".join(_CHOICES[f.name]) + "}"} if f.name in _CHOICES else {}
        if f.type == "bool":
            p.add_argument(flag, type=_parse_bool, nargs="?", const=True, default=None, metavar="BOOL", help=help_)
        else:
            p.add_argument(flag, type=_KINDS[f.type][0], default=None, help=help_, **choices)


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _words(name: str) -> tuple[str, ...]:
    return tuple(_WORDS.get(w, w) for w in name.lower().split("_") if w not in _FILLER)


def did_you_mean(word: str, names, prefix: str = "") -> str:
    """' (did you mean X?)' for the name of `names` that `word` most likely means (`_ALIASES` says how), else ''."""
    key, names = word.lstrip("-").replace("-", "_").lower(), list(names)
    close = ([n for n in _ALIASES.get(key, ()) if n in names] or [n for n in names if _words(key) == _words(n) != ()]
             or difflib.get_close_matches(key, names, n=1))
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def field_problem(name: str, value: Any, where: str) -> str:
    """Why `value` cannot be the field `name` ("" if it can): its type, choices and range. `where` names the source
    in the message: "--lr", or "lr in run.toml"."""
    kind, what = _KINDS[_FIELDS[name].type]
    if kind is bool:
        ok = isinstance(value, bool)
    else:  # True is an int to Python, not to a user
        ok = isinstance(value, (int, float) if kind is float else kind) and not isinstance(value, bool)
    if not ok:
        return f"{where} must be {what}, got {value!r}"
    if kind is float and not math.isfinite(value):
        return f"{where} must be a finite number, got {value!r}"
    if name in _CHOICES and value not in _CHOICES[name]:
        choices = [c for c in _CHOICES[name] if c]
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


def from_namespace(ns: argparse.Namespace) -> TrainConfig:
    """The TOML file's keys, then the flags typed, each checked by its field's rule with its source in the message."""
    values: dict[str, Any] = {}
    if ns.config:
        path = Path(ns.config)
        if not path.is_file():
            raise UserError(f"--config {path}: {'a folder; give the TOML file' if path.is_dir() else 'no such file'}")
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise UserError(f"--config {path}: not valid TOML ({e})") from None
        except UnicodeDecodeError:
            raise UserError(f"--config {path}: not valid TOML (not UTF-8 text: a binary file?)") from None
        except OSError as e:
            raise UserError(f"--config {path}: cannot be read ({e.strerror or type(e).__name__})") from None
        for key, value in raw.items():
            name = key.replace("-", "_")
            if name not in _FIELDS and isinstance(value, dict):  # [train] steps = 3
                raise UserError(f"--config {path}: unknown key {key!r}, a [{key}] table: the keys are read at the "
                                f"top level of the file (steps = 10, not under a table)")
            if name not in _FIELDS:
                raise UserError(f"--config {path}: unknown key {key!r}{did_you_mean(name, _FIELDS)}")
            if why := field_problem(name, value, f"{key} in {path}"):
                raise UserError(why)
            values[name] = float(value) if _FIELDS[name].type == "float" else value
    for name in _FIELDS:
        if getattr(ns, name, None) is not None:
            if why := field_problem(name, getattr(ns, name), "--" + name.replace("_", "-")):
                raise UserError(why)
            values[name] = getattr(ns, name)
    if getattr(ns, "lora_rank", None) is not None and ns.lora_rank <= 0:  # a flag given is meant: 0 would train
        raise UserError(f"--lora-rank must be a positive rank, got {ns.lora_rank} (leave it out to train "  # all
                        "every parameter)")
    if values.get("model") and values.get("init_from"):
        _check_same_model(values["model"], values["init_from"])
    if "seq_len" not in values:  # the default 2048, or the model's positions when it has fewer (the tiny presets)
        from paraseek.models.args import resolve_model

        model = values.get("init_from") or values.get("model") or TrainConfig.model
        values["seq_len"] = min(TrainConfig.seq_len, resolve_model(model)[0].max_seq_len)
    return TrainConfig(**values)


def _check_same_model(model: str, init_from: str) -> None:
    """--init-from names the model by its config.json; a --model beside it must be the same architecture, or which
    one trains would be a silent choice. (An export of a run of --model is: its special-token ids are those of the
    tokenizer it trained with, which the weights do not depend on.)"""
    from paraseek.models.args import architecture_difference, resolve_model

    if (Path(init_from) / "config.json").is_file() and (
            why := architecture_difference(resolve_model(model)[0], resolve_model(init_from)[0])):
        raise UserError(f"--model {model} and --init-from {init_from} are different models ({why}); --init-from's "
                        "config.json is the model, so leave out --model")


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


def validate(cfg: TrainConfig, cuda_available: bool, gpu_count: int, nodes: bool = True) -> None:
    """Every check that can fail on user input, before a process is launched or a file written. `nodes=False`
    leaves out the node flags (--node-rank, --rdzv-endpoint), which --slurm's script sets on each node."""
    check_fields(cfg)
    _check_flags_act(cfg)
    if cfg.device == "cuda" and not cuda_available:
        raise UserError("--device cuda: no CUDA device is visible (use --device cpu, or check the driver)")
    if cfg.device == "cuda" and cfg.nproc > gpu_count:
        raise UserError(f"--nproc {cfg.nproc} but this node has {gpu_count} GPU(s)")
    if cfg.nproc <= 0:
        raise UserError(f"--nproc must be positive, got {cfg.nproc}")
    if nodes:
        _check_nodes(cfg)
    if cfg.init_from and not (Path(cfg.init_from) / "config.json").is_file():
        raise UserError(f"--init-from {cfg.init_from}: not an HF folder (no config.json)")
    if cfg.init_from:
        from paraseek.models.weights import weight_files

        weight_files(cfg.init_from, hint=", which --init-from starts from (--model with the folder starts from "
                     "random weights of its architecture)")
    from paraseek.models.args import resolve_model

    model = cfg.init_from or cfg.model
    args, _, _ = resolve_model(model)
    if cfg.seq_len > args.max_seq_len:
        raise UserError(f"--seq-len {cfg.seq_len} is longer than {model}'s {args.max_seq_len:,} positions "
                        f"(max_position_embeddings); use --seq-len {args.max_seq_len} or less")
    if cfg.dp_shard == -1 and min(cfg.dp_replicate, cfg.tp, cfg.pp) > 0:  # resolve_defaults could not fill it
        raise UserError(f"--dp-shard fills the world by default, but {cfg.world_size} processes are not divisible by "
                        f"--dp-replicate {cfg.dp_replicate} x --tp {cfg.tp} x --pp {cfg.pp}; give --dp-shard")
    dims = cfg.dims
    options = dict(cpu_offload=cfg.cpu_offload, compile=cfg.compile, precision=cfg.precision)
    dims.check(args, cfg.seq_len, **options)  # the plan's one rule set (parallel/dims.py), the planner's too
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
    if cfg.loss_chunks and (cfg.tp > 1 or cfg.pp > 1):
        raise UserError("--loss-chunks works without --tp and --pp (TP's loss is vocab-parallel already; under "
                        "pipelining the last stage's schedule computes the loss)")
    if cfg.pp > 1 and cfg.grad_compression != "none":
        raise UserError("--pp with --grad-compression is not supported yet")
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
    if cfg.overwrite and not cfg.checkpoint_dir:
        raise UserError("--overwrite replaces the checkpoints of --checkpoint-dir, and none is given")
    if cfg.keep_last and not cfg.checkpoint_dir:
        raise UserError(f"--keep-last {cfg.keep_last} needs --checkpoint-dir (the folder whose checkpoints it keeps)")
    if cfg.lr_schedule_reset and not cfg.resume:
        raise UserError("--lr-schedule-reset goes with --resume (a run from step 0 follows this command's schedule)")
    # (the default interval applies only when a folder is given: a run without one saves nothing, and says so)
    if cfg.checkpoint_every not in (0, TrainConfig.checkpoint_every) and not cfg.checkpoint_dir:
        raise UserError(f"--checkpoint-every {cfg.checkpoint_every} needs --checkpoint-dir (where to write them)")
    if not args.n_routed_experts and (cfg.moe_bias_gamma > 0 or cfg.moe_aux_loss_alpha > 0):
        flag = "--moe-bias-gamma" if cfg.moe_bias_gamma > 0 else "--moe-aux-loss-alpha"
        raise UserError(f"{flag} balances routed experts, and {model} has none (a dense model); leave it out")
    if cfg.hardware and not Path(cfg.hardware).is_file():
        raise UserError(f"--hardware {cfg.hardware}: no such file (write one with paraseek doctor --save FILE)")
    from paraseek.monitor.faults import check_faults, parse_faults

    check_faults(parse_faults(cfg.inject_fault), cfg.world_size, cfg.steps)
    check_profile_window(cfg, 0)  # and again with the step a --resume continues from (launch.check_steps)
    _check_data_and_tokenizer(cfg, args.vocab_size)
    _check_outputs(cfg)
    check_lora(cfg, args)
    from paraseek.train.mtp import check_mtp

    check_mtp(cfg, args, model)
    _validate_data_flags(cfg)
    if cfg.fp8 != "off" or cfg.fp8_experts == "on":
        from paraseek.parallel.fp8 import fp8_problem
        from paraseek.parallel.dims import fp8_experts_problem

        capability = None
        if cfg.device == "cuda" and cuda_available:
            import torch

            capability = torch.cuda.get_device_capability(0)
        problem = fp8_problem(cfg.fp8, cfg.device, capability, dims, lora=cfg.lora_rank > 0)
        if cfg.fp8_experts == "on" and not problem:
            problem = fp8_experts_problem(cfg.fp8, cfg.device, capability) or (
                None if args.n_routed_experts else f"--fp8-experts on: {model} has no routed experts; leave it out")
        if problem:
            raise UserError(problem)


def _check_flags_act(cfg: TrainConfig) -> None:
    """The flags of one kind of parallelism act only with it: given without it they would silently change nothing."""
    if not cfg.sequence_parallel and cfg.tp == 1:
        raise UserError("--sequence-parallel false acts only with --tp N (sequence parallelism shards a tensor-"
                        "parallel group's norms and residuals); without --tp there is none to turn off: leave it out")
    if cfg.pp == 1 and (cfg.pp_schedule != TrainConfig.pp_schedule or cfg.pp_virtual_stages > 1):
        flag = (f"--pp-schedule {cfg.pp_schedule}" if cfg.pp_schedule != TrainConfig.pp_schedule
                else f"--pp-virtual-stages {cfg.pp_virtual_stages}")
        raise UserError(f"{flag} acts only with --pp N (pipeline stages); add --pp, or leave it out")


def check_profile_window(cfg: TrainConfig, start: int) -> None:
    """--profile-steps A:B inside the steps this run trains, start + 1 .. --steps (`start`: the step a --resume
    continues from): a window outside them would never be profiled, and nothing would say so."""
    if not cfg.profile_steps:
        return
    from paraseek.monitor.profile import parse_profile_steps

    def steps(a: int, b: int) -> str:
        return f"step {a}" if a == b else f"steps {a}-{b}"

    first, last = parse_profile_steps(cfg.profile_steps)
    if first <= start or last > cfg.steps:
        trained = f" ({steps(1, start)} before this --resume)" if start else ""
        raise UserError(f"--profile-steps {cfg.profile_steps}: this run trains {steps(start + 1, cfg.steps)}"
                        f"{trained}, so that window would never be profiled; give A:B with {start + 1} <= A <= B <= "
                        f"{cfg.steps}")


def _check_nodes(cfg: TrainConfig) -> None:
    if cfg.node_rank >= cfg.nnodes:
        raise UserError(f"--node-rank {cfg.node_rank} with --nnodes {cfg.nnodes}: node ranks are 0 to {cfg.nnodes - 1}")
    if cfg.nnodes > 1 and not cfg.rdzv_endpoint:
        raise UserError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address)")
    if cfg.rdzv_endpoint:
        if cfg.nnodes == 1:
            raise UserError(f"--rdzv-endpoint {cfg.rdzv_endpoint} is for multi-node runs; add --nnodes N (or leave "
                            "it out: one node needs no rendezvous address)")
        from paraseek.train.multinode import check_endpoint

        check_endpoint(cfg.rdzv_endpoint)


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


def _check_data_and_tokenizer(cfg: TrainConfig, vocab_size: int) -> None:
    if cfg.data == "synthetic":
        if cfg.tokenizer:
            raise UserError(f"--tokenizer {cfg.tokenizer} with --data synthetic: synthetic data is random token ids "
                            "and is not tokenized; give text --data, or leave out --tokenizer")
        return
    from paraseek.models.tokenizer import load_text_tokenizer
    from paraseek.train.corpus import list_files

    list_files(cfg.data)
    try:
        n_vocab = load_text_tokenizer(cfg.tokenizer).vocab_size
    except UserError as e:
        raise UserError(f"--tokenizer {e}") from None
    if n_vocab > vocab_size:  # ids past the embedding: the model cannot read this tokenizer's text
        raise UserError(f"{tokenizer_origin(cfg)} has {n_vocab:,} tokens but the model's vocab_size is "
                        f"{vocab_size:,}: it is not this model's tokenizer (give --tokenizer with the model's own)")


def _check_outputs(cfg: TrainConfig) -> None:
    """Every path the run writes, refused now if it cannot be written there (errors.check_writable tries it), so a
    mistake costs no run. Nothing is left here: a refused run leaves nothing behind."""
    if cfg.metrics_jsonl:  # first: the default --run-dir is its folder
        check_writable("--metrics-jsonl", cfg.metrics_jsonl, folder=False)
    folders = {"--checkpoint-dir": cfg.checkpoint_dir, "--tensorboard": cfg.tensorboard, "--run-dir": cfg.run_dir}
    if cfg.data != "synthetic":
        from paraseek.train.token_cache import cache_dir

        folders["the token cache ($PARASEEK_CACHE)"] = str(cache_dir())
    for what, path in folders.items():
        if path:
            check_writable(what, path, folder=True)
    if cfg.export_hf:  # written at the end of the run, replacing its files (or an --init-from folder's) if it held any
        from paraseek.train.export import check_out_folder

        check_out_folder(cfg.export_hf, label="--export-hf ", fix="give a new or empty folder (the export would "
                         "replace its files)")


def _validate_data_flags(cfg: TrainConfig) -> None:
    """The packing and evaluation flags against each other and the plan (the data itself is opened by launch)."""
    if cfg.chat_template and not Path(cfg.chat_template).is_file():
        raise UserError(f"--chat-template {cfg.chat_template}: no such file")
    if not cfg.pack and cfg.doc_mask == "true":
        raise UserError("--doc-mask true with --pack false: each row holds one document already; drop one of them")
    if cfg.eval_data and cfg.eval_split:
        raise UserError("give --eval-data PATH or --eval-split FRACTION, not both")
    if not 0 <= cfg.eval_split < 1:
        raise UserError(f"--eval-split must be a fraction in [0, 1), got {cfg.eval_split}")
    if cfg.eval_every < 0:
        raise UserError(f"--eval-every must be >= 0, got {cfg.eval_every}")
    if cfg.eval_every and not (cfg.eval_data or cfg.eval_split):
        raise UserError("--eval-every needs evaluation data: --eval-data PATH or --eval-split FRACTION")
    if cfg.eval_data == "synthetic":
        raise UserError("--eval-data synthetic has no end to evaluate over: give held-out files, or --eval-split")
    if cfg.eval_data and not Path(cfg.eval_data).exists():
        raise UserError(f"--eval-data {cfg.eval_data}: no such file or folder")


def _powersgd_rank(text: str) -> int:
    if text.startswith("powersgd:") and text[len("powersgd:"):].isdigit() and int(text[len("powersgd:"):]) > 0:
        return int(text[len("powersgd:"):])
    return 0


def check_lora(cfg: TrainConfig, args) -> None:
    """The LoRA flags against the model and the plan (one line each)."""
    if not cfg.lora_rank:
        if cfg.lora_alpha or cfg.lora_targets:
            raise UserError("--lora-alpha and --lora-targets need --lora-rank R (a positive rank) to turn LoRA on")
        return
    if cfg.lora_rank < 0 or cfg.lora_alpha < 0:
        raise UserError(f"--lora-rank must be positive and --lora-alpha >= 0, got {cfg.lora_rank} and {cfg.lora_alpha}")
    cfg.lora_for(args)  # the targets
    if not cfg.init_from:
        raise UserError("--lora-rank trains adapters on a pretrained model: give it with --init-from HF_DIR (the "
                        "frozen base, which checkpoints name instead of copying)")
    if cfg.tp > 1 or cfg.pp > 1:
        raise UserError("--lora-rank with --tp or --pp is not supported yet (LoRA runs with FSDP2/HSDP, DDP and --ep)")
    if cfg.moe_bias_gamma > 0:
        raise UserError("--moe-bias-gamma with --lora-rank: the routing-bias update changes the frozen base, which "
                        "the adapters cannot carry (LoRA runs keep the bias fixed)")
