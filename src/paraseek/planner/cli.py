"""`paraseek plan`: argument parsing and output only; the model lives in memory.py, cost.py and search.py."""

from __future__ import annotations

import argparse
import json

from paraseek.errors import UserError, check_plot


def register(subparsers) -> None:
    """Add the `plan` subcommand to paraseek's subparsers (cli.py calls this)."""
    p = subparsers.add_parser(
        "plan", help="predict memory and speed of every parallel plan and pick the best",
        description="Enumerate dp_replicate x dp_shard x tp x pp (schedule, virtual stages) x ep, micro-batch size, "
        "activation checkpointing and CPU offload; predict memory per GPU (itemized) and step time; rank the plans "
        "that fit by tokens/s and say why the others don't fit. See docs/planner.md for the model.")
    p.add_argument("--model", required=True, help="a preset name (e.g. deepseek-v3) or an HF model folder")
    p.add_argument("--hardware", metavar="PROFILE.json",
                   help="a hardware profile from `paraseek doctor --save` (measured rates override datasheet ones)")
    p.add_argument("--gpus", type=int, help="number of GPUs (overrides the profile's nodes x gpus_per_node)")
    p.add_argument("--gpu-type", help="GPU type without a profile: H100, H100-PCIe, H200, H800, H20, A100-40GB, "
                   "A100-80GB, A800, L40S, RTX4090, V100-32GB, V100-16GB (V100 = V100-32GB), T4")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: 8, or --gpus if fewer)")
    p.add_argument("--inter-node-gbps", type=float,
                   help="inter-node bandwidth per GPU in GB/s (NIC line rate / 8: 400 Gb/s IB per GPU = 50)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--global-batch-size", type=int,
                   help="sequences per optimizer step (training: required); inference: the batch of concurrent "
                   "sequences per model copy to price (one that does not fit is reported, not capped)")
    p.add_argument("--mode", default="train", help="train (default) or infer")
    p.add_argument("--weight-dtype", help="inference weights: bf16 (the default where the GPU has it), fp16 (the "
                   "default on V100 and T4) or fp8")
    g = p.add_argument_group("inference (--mode infer)", "The KV capacity at --seq-len tokens per sequence (the "
                             "engine's --max-model-len) and the engine's speed, priced kernel by kernel "
                             "(docs/planner.md, \"Inference speed\").")
    g.add_argument("--max-num-seqs", type=int, help="the engine's --max-num-seqs (default: what `paraseek generate` "
                   "and `bench-infer` use on this GPU: 1024 on GPUs of 70 GiB or more other than A100, else 256; "
                   "`paraseek serve` runs 256)")
    g.add_argument("--max-batched-tokens", type=int, help="the engine's --max-batched-tokens (default: 16384 where "
                   "--max-num-seqs defaults to 1024, else 8192)")
    g.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], help="the engine's --kv-cache-dtype: auto "
                   "(default; 2 bytes a value) or fp8 (e4m3 with one fp32 scale per token row, as the engine counts)")
    g.add_argument("--context-len", type=int, help="decode speed at this many tokens of context per sequence "
                   "(default: --seq-len)")
    g.add_argument("--batch-sizes", default="1,8,64,256", metavar="N,N,...",
                   help="decode speed at these batches of sequences (default 1,8,64,256; --global-batch-size is "
                   "added)")
    g.add_argument("--prompt-len", type=int, help="prefill speed and time to first token of prompts of this many "
                   "tokens (default 128)")
    g.add_argument("--num-requests", type=int, help="offline throughput as `bench-infer` runs it: requests (default "
                   "1000; 0 = none)")
    g.add_argument("--input-len", help="offline: prompt tokens, N or LO:HI uniform (default 64:1024)")
    g.add_argument("--output-len", help="offline: new tokens, N or LO:HI uniform (default 64:512)")
    p.add_argument("--compile", default="auto", help="train plans: auto (default: compiled wherever `paraseek train "
                   "--compile` runs the plan), true (compiled only) or false (eager only)")
    p.add_argument("--top", type=int, default=10, help="plans to show (0 = all; default 10)")
    p.add_argument("--scaling", metavar="N,N,...", help="predict the first-ranked plan's tokens/s/GPU at each GPU "
                   "count: weak scaling (the first count's per-GPU batch kept, as `paraseek bench --scaling`)")
    p.add_argument("--strong", action="store_true", help="with --scaling: keep the global batch instead (strong "
                   "scaling)")
    p.add_argument("--plot", metavar="FILE.png", help="with --scaling: write a plot (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--fp8", default="off", choices=("off", "tensorwise", "rowwise", "rowwise-gw-hp"),
                   help="train plans with `paraseek train --fp8 RECIPE`: the block projections' GEMMs in float8 and, "
                   "tensorwise, their FSDP2 all-gather (default off; never chosen by the search)")
    p.add_argument("--fp8-experts", default="off", choices=("off", "on"),
                   help="with --fp8: plans with `paraseek train --fp8-experts on`, the routed experts' grouped GEMMs "
                   "in float8 too (Hopper; slower than bf16 below ~1,500 tokens routed to each expert per "
                   "micro-batch, up to 1.75x the experts' GEMM rate with many; default off)")
    p.add_argument("--mtp-layers", type=int, default=0, metavar="D",
                   help="train plans with `paraseek train --mtp-layers D`: D multi-token-prediction depths "
                   "(DeepSeek-V3's MTP modules: one more block, projection and head pass each, on the last pipeline "
                   "stage) priced in memory and time (default 0: none)")
    p.add_argument("--doc-mask", action="store_true",
                   help="price packed rows with document masks (chat fine-tuning: per-token RoPE tables, positions "
                   "and FlexAttention's block mask per micro-batch)")
    p.add_argument("--all-dims", action="store_true",
                   help="also rank what paraseek train does not run, as predictions: tp with DDP, CPU offload with "
                   "tp or pp, pipelines of tied embeddings, and ZBVZeroBubble and DualPipeV (not measured on GPUs "
                   "yet)")
    p.set_defaults(func=run_plan)


def _cluster(ns: argparse.Namespace):
    from paraseek.planner.plan import load_profile, make_cluster

    if ns.hardware:
        if ns.gpu_type:
            raise UserError("give either --hardware PROFILE.json or --gpu-type, not both")
        if ns.gpus is not None and ns.gpus <= 0:
            raise UserError(f"--gpus must be a positive number of GPUs, got {ns.gpus}")
        return load_profile(ns.hardware, ns.gpus)
    if ns.gpus is None or not ns.gpu_type:
        raise UserError("say what to plan for: --hardware PROFILE.json, or --gpus N and --gpu-type T")
    return make_cluster(ns.gpu_type, ns.gpus, ns.gpus_per_node, ns.inter_node_gbps)


def _counts(spec: str) -> list[int]:
    try:
        counts = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--scaling {spec!r}: expected comma-separated GPU counts such as 8,16,64") from None
    if not counts:
        raise UserError("--scaling: give at least one GPU count, e.g. 8,16,64")
    return counts


def run_plan(ns: argparse.Namespace) -> int:
    from paraseek.models.args import resolve_model
    from paraseek.planner import report
    from paraseek.planner.search import scaling, search

    if ns.mode not in ("train", "infer"):
        raise UserError(f"--mode {ns.mode!r}: expected train or infer")
    if ns.seq_len <= 0:
        raise UserError(f"--seq-len must be positive, got {ns.seq_len}")
    if ns.top < 0:
        raise UserError(f"--top must be >= 0, got {ns.top}")
    if ns.plot and not ns.scaling:
        raise UserError("--plot draws the --scaling curve; add --scaling 8,16,...")
    if ns.strong and not ns.scaling:
        raise UserError("--strong goes with --scaling 8,16,...")
    check_plot(ns.plot)
    compile_modes = {"auto": None, "true": True, "false": False}
    if ns.compile not in compile_modes:
        raise UserError(f"--compile {ns.compile!r}: expected auto, true or false")
    compile = compile_modes[ns.compile]
    args, _, _ = resolve_model(ns.model)
    cluster = _cluster(ns)
    if ns.global_batch_size is not None and ns.global_batch_size <= 0:
        raise UserError(f"--global-batch-size must be positive, got {ns.global_batch_size}")

    infer_flags = ("max_num_seqs", "max_batched_tokens", "context_len", "prompt_len", "num_requests", "input_len",
                   "output_len", "kv_cache_dtype")
    if ns.mode == "train":
        given = [f"--{f.replace('_', '-')}" for f in infer_flags if getattr(ns, f) is not None]
        if given or ns.batch_sizes != "1,8,64,256":
            raise UserError(f"{(given or ['--batch-sizes'])[0]} is for --mode infer")
    elif ns.mtp_layers:
        raise UserError("--mtp-layers prices training plans; leave it out with --mode infer")
    if ns.mode == "infer":
        return _run_infer(ns, args, cluster)

    if ns.global_batch_size is None:
        raise UserError("--global-batch-size is required for training plans (sequences per optimizer step)")
    if ns.scaling:
        rows = scaling(args, cluster, _counts(ns.scaling), ns.seq_len, ns.global_batch_size, ns.model,
                       weak=not ns.strong, engine_only=not ns.all_dims, compile=compile, document_mask=ns.doc_mask,
                       fp8=ns.fp8, fp8_experts=ns.fp8_experts == "on", mtp_layers=ns.mtp_layers)
        if ns.plot:
            report.plot_scaling(rows, ns.plot, f"{ns.model} on {cluster.gpu.name}, seq {ns.seq_len}, "
                                f"global batch {ns.global_batch_size} (predicted)")
        if ns.json:
            print(json.dumps(report.scaling_json(ns.model, rows, weak=not ns.strong), indent=2))
        else:
            report.print_scaling(ns.model, rows, cluster, ns.seq_len, ns.global_batch_size, weak=not ns.strong)
            if ns.plot:
                print(f"plot: {ns.plot}")
        return 0

    res = search(args, cluster, ns.seq_len, ns.global_batch_size, ns.model, engine_only=not ns.all_dims,
                 compile=compile, document_mask=ns.doc_mask, fp8=ns.fp8, fp8_experts=ns.fp8_experts == "on",
                 mtp_layers=ns.mtp_layers)
    if ns.json:
        print(json.dumps(report.search_json(res, ns.top), indent=2))
    else:
        report.print_search(res, ns.top)
    return 0


def _run_infer(ns: argparse.Namespace, args, cluster) -> int:
    from paraseek.errors import parse_range
    from paraseek.planner import infer_speed, report
    from paraseek.planner.infer import WEIGHT_BYTES, engine_defaults, plan_inference

    weight_dtype = ns.weight_dtype or ("bf16" if cluster.gpu.has_bf16 else "fp16")
    if weight_dtype not in WEIGHT_BYTES:
        raise UserError(f"--weight-dtype {weight_dtype!r}: expected {', '.join(WEIGHT_BYTES)}")
    if weight_dtype == "bf16" and not cluster.gpu.has_bf16:
        raise UserError(f"--weight-dtype bf16: {cluster.gpu.name} has no bf16; use --weight-dtype fp16")
    if weight_dtype == "fp8" and not cluster.gpu.has_fp8:
        raise UserError(f"--weight-dtype fp8: {cluster.gpu.name} has no float8 tensor cores (Ada and Hopper "
                        f"GPUs do); use --weight-dtype {'bf16' if cluster.gpu.has_bf16 else 'fp16'}")
    if ns.seq_len > args.max_seq_len:
        raise UserError(f"--seq-len {ns.seq_len} exceeds the model's max_position_embeddings {args.max_seq_len}")
    seqs, step_tokens = engine_defaults(cluster)
    seqs = ns.max_num_seqs if ns.max_num_seqs is not None else seqs
    step_tokens = ns.max_batched_tokens if ns.max_batched_tokens is not None else step_tokens
    context = ns.context_len if ns.context_len is not None else ns.seq_len
    prompt_len = ns.prompt_len if ns.prompt_len is not None else 128
    requests = ns.num_requests if ns.num_requests is not None else 1000
    for flag, value in (("--max-num-seqs", seqs), ("--max-batched-tokens", step_tokens), ("--context-len", context),
                        ("--prompt-len", prompt_len)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    if requests < 0:
        raise UserError(f"--num-requests must be >= 0, got {requests}")
    if context > ns.seq_len:
        raise UserError(f"--context-len {context} is more than --seq-len {ns.seq_len} (the engine's --max-model-len)")
    try:
        batches = sorted({int(x) for x in ns.batch_sizes.split(",") if x.strip()} | (
            {ns.global_batch_size} if ns.global_batch_size else set()))
    except ValueError:
        raise UserError(f"--batch-sizes {ns.batch_sizes!r}: expected comma-separated batch sizes such as 1,8,64") \
            from None
    if not batches or batches[0] < 1:
        raise UserError(f"--batch-sizes {ns.batch_sizes!r}: give batch sizes >= 1")
    workload = None
    if requests:
        (a_in, b_in), (a_out, b_out) = (parse_range(ns.input_len or "64:1024", "--input-len"),
                                        parse_range(ns.output_len or "64:512", "--output-len"))
        if b_in + b_out > ns.seq_len:
            raise UserError(f"--input-len {ns.input_len or '64:1024'} with --output-len {ns.output_len or '64:512'} "
                            f"needs up to {b_in + b_out:,} tokens per sequence, more than --seq-len {ns.seq_len:,}")
        workload = infer_speed.Workload(requests, (a_in, b_in), (a_out, b_out))
    rows = plan_inference(args, cluster, ns.seq_len, ns.global_batch_size, weight_dtype,
                          max_batched_tokens=step_tokens, max_num_seqs=seqs,
                          kv_cache_dtype=ns.kv_cache_dtype or "auto")
    wb = WEIGHT_BYTES[weight_dtype]
    for r in rows:
        r.command = report.serve_command(ns.model, cluster, r, ns.seq_len, weight_dtype, ns.kv_cache_dtype or "auto",
                                         seqs, step_tokens)
        if r.max_batch >= 1:  # weights and one sequence fit (an asked batch that does not is reported)
            r.speed = infer_speed.predict(args, cluster, r.layout, wb, r.max_context, context_len=context,
                                          batch_sizes=batches, prompt_len=prompt_len, workload=workload,
                                          max_num_seqs=seqs, max_batched_tokens=step_tokens, replicas=r.replicas)
    if ns.json:
        print(json.dumps(report.infer_json(ns.model, cluster, ns.seq_len, rows, weight_dtype), indent=2))
    else:
        report.print_infer(ns.model, cluster, ns.seq_len, rows, args.max_seq_len, weight_dtype)
    return 0
