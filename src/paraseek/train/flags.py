"""`paraseek train`'s flags and --config TOML file: one flag per TrainConfig field, each value checked by its
field's rule (train/config.py) with its source in the message, and the "did you mean" of an unknown name."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from pathlib import Path
from typing import Any

from paraseek.errors import UserError, read_parsed
from paraseek.train.config import CHOICES, FIELDS, KINDS, TrainConfig, field_problem


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
        choices = {"metavar": "{" + ",".join(CHOICES[f.name]) + "}"} if f.name in CHOICES else {}
        if f.type == "bool":
            p.add_argument(flag, type=_parse_bool, nargs="?", const=True, default=None, metavar="BOOL", help=help_)
        else:
            p.add_argument(flag, type=KINDS[f.type][0], default=None, help=help_, **choices)


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


def from_namespace(ns: argparse.Namespace) -> TrainConfig:
    """The TOML file's keys, then the flags typed, each checked by its field's rule with its source in the message."""
    values: dict[str, Any] = {}
    if ns.config:
        path = Path(ns.config)
        if not path.is_file():
            raise UserError(f"--config {path}: {'a folder; give the TOML file' if path.is_dir() else 'no such file'}")
        raw = read_parsed(path, f"--config {path}", "valid TOML")
        for key, value in raw.items():
            name = key.replace("-", "_")
            if name not in FIELDS and isinstance(value, dict):  # [train] steps = 3
                raise UserError(f"--config {path}: unknown key {key!r}, a [{key}] table: the keys are read at the "
                                f"top level of the file (steps = 10, not under a table)")
            if name not in FIELDS:
                raise UserError(f"--config {path}: unknown key {key!r}{did_you_mean(name, FIELDS)}")
            if why := field_problem(name, value, f"{key} in {path}"):
                raise UserError(why)
            values[name] = float(value) if FIELDS[name].type == "float" else value
    for name in FIELDS:
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
