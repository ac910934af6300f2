"""The `paraseek` command. Thin: parse, call one function, print. User mistakes exit 2 with one line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from paraseek.errors import UserError


def _model_summary(spec: str, seq_len: int) -> dict[str, Any]:
    from paraseek.models import flops_per_token, param_counts, resolve_model
    from paraseek.models.stats import attention_flops_per_token

    args, _, folder = resolve_model(spec)
    if seq_len > args.max_seq_len:  # the FLOPs of a sequence the model cannot run would describe nothing
        raise UserError(f"--seq-len {seq_len} is longer than {spec}'s {args.max_seq_len:,} positions "
                        f"(max_position_embeddings); use --seq-len {args.max_seq_len} or less")
    c = param_counts(args)
    n_moe = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    if args.is_mla:
        attention = f"MLA (q_lora {args.q_lora_rank or 'none'}, kv_lora {args.kv_lora_rank}, qk {args.qk_head_dim}, v {args.v_head_dim})"
    elif args.n_kv_heads < args.n_heads:
        attention = f"GQA ({args.n_heads} heads, {args.n_kv_heads} kv heads, head dim {args.head_dim})"
    else:
        attention = f"MHA ({args.n_heads} heads, head dim {args.head_dim})"
    summary: dict[str, Any] = {
        "model": spec,
        "source": str(folder) if folder else "preset",
        "model_type": args.model_type,
        "total_params": c.total,
        "active_params": c.active,
        "embedding_params": c.embedding,
        "mtp_params": c.mtp,
        "n_layers": args.n_layers,
        "dense_layers": args.n_layers - n_moe,
        "moe_layers": n_moe,
        "hidden_size": args.dim,
        "vocab_size": args.vocab_size,
        "attention": attention,
        "rope": args.rope_type if args.rope_type == "default" else f"{args.rope_type} x{args.rope_factor:g}",
        "max_seq_len": args.max_seq_len,
        "seq_len": seq_len,
        "flops_per_token": flops_per_token(args, seq_len),
        "attention_flops_per_token": attention_flops_per_token(args, seq_len),
    }
    if args.n_routed_experts:
        summary["experts"] = (
            f"{args.n_shared_experts} shared + {args.n_activated_experts} of {args.n_routed_experts} routed "
            f"(width {args.moe_inter_dim}, {args.score_func}, {args.topk_method}"
            + (f", {args.topk_group} of {args.n_group} groups" if args.n_group > 1 else "") + ")"
        )
    return summary


def cmd_info(ns: argparse.Namespace) -> int:
    summary = _model_summary(ns.model, ns.seq_len)
    if ns.json:
        print(json.dumps(summary, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{ns.model}", show_header=False)
    for key, value in summary.items():
        if isinstance(value, int) and key.endswith(("params", "per_token")):
            value = f"{value:,} ({value / 1e9:.2f} B)" if value >= 1e8 else f"{value:,}"
        table.add_row(key, str(value))
    Console().print(table)
    return 0


def cmd_demo(ns: argparse.Namespace) -> int:
    """The quick-start job: train on the bundled public-domain corpus with a hybrid data-parallel plan.
    CPU: tiny-moe (DeepSeek-V3-shaped) over 4 gloo processes as HSDP 2 x 2. CUDA: a real preset on all GPUs."""
    import torch

    from paraseek.train.corpus import BUNDLED_CORPUS

    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        argv = ["train", "--model", "deepseek-r1-distill-qwen-1.5b", "--device", "cuda", "--nproc", str(gpus),
                "--seq-len", "2048", "--global-batch-size", str(8 * gpus), "--micro-batch-size", "4",
                "--steps", str(ns.steps or 100), "--lr", "1e-3", "--warmup-steps", "10", "--log-every", "10"]
    else:
        argv = ["train", "--model", "tiny-moe", "--device", "cpu", "--nproc", "4", "--dp-replicate", "2",
                "--dp-shard", "2", "--seq-len", "128", "--global-batch-size", "16", "--micro-batch-size", "4",
                "--steps", str(ns.steps or 300), "--lr", "3e-3", "--warmup-steps", "20", "--log-every", "20"]
    # --overwrite: each `make demo` starts the demo again in its own folder (a checkpoint folder that holds
    # checkpoints is otherwise refused without --resume).
    argv += ["--data", str(BUNDLED_CORPUS), "--metrics-jsonl", "runs/demo/metrics.jsonl",
             "--tensorboard", "runs/demo/tb", "--checkpoint-dir", "runs/demo/checkpoints", "--overwrite"]
    print("paraseek demo: " + " ".join(["paraseek", *argv]), flush=True)
    rc = main(argv)
    if rc != 0:
        return rc
    # train -> generate: a few lines from the checkpoint just written, through the inference engine.
    gen = ["generate", "runs/demo/checkpoints", "--max-new-tokens", "24", "--temperature", "0.8", "--top-p", "0.95",
           "--sampling-seed", "0", "--quiet",
           "--prompt", "In the beginning", "--prompt", "And the LORD said unto", "--prompt", "CYNIC, n."]
    print("paraseek demo: " + " ".join(["paraseek", *gen]), flush=True)
    return main(gen)


class OneLineParser(argparse.ArgumentParser):
    """A command-line mistake costs one line, as every other user mistake does: what is wrong and, for a misspelt
    flag, the closest one; not the usage block (`--help` prints that). Subcommands' parsers are of this class too."""

    def error(self, message: str):
        if message.endswith("expected one argument"):  # argparse reads "-1e-3" as a flag
            message += " (a value that starts with '-' is written --flag=VALUE)"
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):
        given = sys.argv[1:] if args is None else list(args)
        if self._subparsers is not None and given and given[0].startswith("-") and given[0] not in ("-h", "--help"):
            # `paraseek --model X train`: argparse would call X an unknown command
            flag = given[0].split("=", 1)[0]
            command = next((a for a in given if a in self._subparsers._group_actions[0].choices), "COMMAND")
            self.error(f"{flag} before the command: flags follow it, as in `{self.prog} {command} {flag} ...`")
        ns, extra = super().parse_known_args(args, namespace)
        if extra and self._subparsers is None:  # a subcommand's own: its flags are the ones to suggest
            from paraseek.train.flags import did_you_mean

            flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
            word = extra[0]
            if word.startswith("-"):
                names = [f[2:].replace("-", "_") for f in flags]
                hint = did_you_mean(word.split("=", 1)[0], names, prefix="--").replace("_", "-")
                self.error(f"unknown flag {word.split('=', 1)[0]}{hint}")
            self.error(f"unexpected argument {word!r} (only flags follow `{self.prog}`; see --help)")
        return ns, extra


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="paraseek",
        description="DeepSeek-family models on many GPUs, PyTorch-native: plan a parallel layout, train it "
        "(FSDP2/HSDP/DDP, TP, PP, EP), diagnose the machine and dead runs, benchmark, generate and serve.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = sub.add_parser("info", help="architecture summary, exact parameter counts and FLOPs per token",
                          description="Summarize a preset or an HF model folder: total/active/embedding parameters "
                          "(exact), layer counts, and training FLOPs per token at --seq-len "
                          "(6 x active non-embedding params + attention).")
    info.add_argument("model", help="a preset name (e.g. deepseek-v3, tiny-moe) or an HF model folder with config.json")
    info.add_argument("--seq-len", type=int, default=4096, help="sequence length for the attention FLOPs (default 4096)")
    info.add_argument("--json", action="store_true", help="print one JSON document")
    info.set_defaults(func=cmd_info)

    from paraseek.hardware.doctor import register as register_doctor
    from paraseek.train.launch import register as register_train

    from paraseek.planner.cli import register as register_plan

    from paraseek.bench.run import register as register_bench

    register_train(sub)
    register_plan(sub)
    register_bench(sub)
    register_doctor(sub)
    from paraseek.monitor.diagnose import register as register_diagnose

    register_diagnose(sub)
    from paraseek.infer.cli import register as register_generate

    register_generate(sub)
    from paraseek.bench.infer import register as register_bench_infer

    register_bench_infer(sub)
    from paraseek.serve.cli import register as register_serve

    register_serve(sub)
    from paraseek.train.export import register as register_export

    register_export(sub)
    from paraseek.bench.serve import register as register_bench_serve

    register_bench_serve(sub)
    for command in ("generate", "serve", "bench-infer"):  # their startup log's planner line; infer/ imports no planner
        sub.choices[command].set_defaults(plan_kv_tokens=_planned_kv_tokens)

    demo = sub.add_parser("demo", help="the quick-start job (`make demo`): a short training run on the bundled corpus, "
                          "then text generated from its checkpoint",
                          description="CPU: trains tiny-moe (DeepSeek-V3-shaped) over 4 gloo processes with HSDP 2x2 "
                          "on the bundled corpus. GPU: trains deepseek-r1-distill-qwen-1.5b on all GPUs with FSDP2. "
                          "Metrics, TensorBoard and checkpoints go to runs/demo/. Then `paraseek generate` writes a "
                          "few lines from the checkpoint through the inference engine.")
    demo.add_argument("--steps", type=int, default=0, help="optimizer steps (default 300 on CPU, 100 on GPU)")
    demo.set_defaults(func=cmd_demo)
    return p


def _planned_kv_tokens(engine) -> int | None:
    from paraseek.planner.infer import planned_kv_tokens  # on use: the planner loads only for a GPU engine

    return planned_kv_tokens(engine)


def main(argv: list[str] | None = None) -> int:
    from paraseek.bench.run import serve_alias

    argv = serve_alias(list(argv) if argv is not None else sys.argv[1:])
    parser = build_parser()
    ns = parser.parse_args(argv)
    ns.argv = argv  # commands that re-launch themselves need it
    if getattr(ns, "seq_len", 1) is not None and getattr(ns, "seq_len", 1) <= 0:
        parser.exit(2, f"paraseek: error: --seq-len must be positive, got {ns.seq_len}\n")
    try:
        return ns.func(ns)
    except UserError as e:
        print(f"paraseek: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("paraseek: interrupted", file=sys.stderr)
        return 130
