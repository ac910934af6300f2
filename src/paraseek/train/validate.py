"""The checks of a whole `paraseek train` configuration against the machine, the model, the data and the plan:
every mistake is one line before a process is launched or a file written."""

from __future__ import annotations

from pathlib import Path

from paraseek.errors import UserError, check_writable
from paraseek.train.config import TrainConfig, check_fields, tokenizer_origin


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
