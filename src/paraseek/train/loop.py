"""The training loop, run in every worker process (torch.distributed, launched by torch's launcher).

Loss normalization makes every data-parallel layout compute the same thing: rank r minimizes
sum(token losses on r) / (tokens per rank per step); FSDP/DDP average gradients over the dp ranks, so the update
is that of mean(token losses over the global batch) -- identical to one process with gradient accumulation.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import resource
import statistics
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from paraseek.errors import UserError
from paraseek.hardware.specs import peak_flops
from paraseek.models import flops_per_token, param_counts, resolve_model
from paraseek.models.deepseek import Transformer
from paraseek.models.hf import load_state_into, save_hf_state
from paraseek.monitor.faults import FaultInjector
from paraseek.monitor.health import (HealthMonitor, StragglerDetector, anomaly_action, format_event, gather_hosts,
                                     gather_step_times, log_event, nonfinite_report, step_time_stats)
from paraseek.monitor.metrics import MetricsLogger
from paraseek.monitor.oom import cheapest_fix, write_snapshot
from paraseek.monitor.profile import StepProfiler, report_all_ranks
from paraseek.monitor.progress import REPORTED, ProgressRecorder, report_failure, set_comm_timeout
from paraseek.parallel.apply import DTYPES, apply_activation_checkpointing, apply_compile, apply_ddp, apply_fsdp, build_mesh
from paraseek.parallel.tensor import (
    apply_tensor_parallel, init_weights_tp, local_value, loss_context, reduce_tp_grads, tp_loss,
)
from paraseek.parallel.expert import (
    ExpertLoad, apply_expert_parallel, clip_grad_norm, enable_balance_loss, ep_meshes, load_stats, routed_layers,
    update_routing_bias,
)
from paraseek.parallel.pipeline import Pipeline, build_stage, describe, rank_stages, stage_specs, whole_model_view
from paraseek.train.checkpoint import full_model_state, latest_checkpoint, load_checkpoint, save_checkpoint
from paraseek.train.config import TrainConfig
from paraseek.train.data import DataLoader, open_dataset


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to cfg.lr over warmup_steps, then cosine/linear decay to lr * min_lr_ratio, or constant."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(1, cfg.warmup_steps)
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.lr_schedule == "linear":
        return floor + (cfg.lr - floor) * (1 - progress)
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is not None:
            t = t.to_local() if isinstance(t, DTensor) else t
            total += t.numel() * t.element_size()
    return total


def model_state_bytes_per_rank(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> dict:
    """Bytes of parameters, gradients and AdamW moments (exp_avg, exp_avg_sq; not the scalar step) that each rank
    holds, gathered to every rank: what the planner's model_state_bytes predicts."""
    moments = [st[k] for st in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq") if k in st]
    local = {"params": _local_bytes(params), "grads": _local_bytes(p.grad for p in params),
             "optimizer": _local_bytes(moments)}
    every: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, local)
    return {key: [r[key] for r in every] for key in local}


def train(cfg: TrainConfig) -> int:
    # DTensor warns that its RNG tracker doesn't cover CPU meshes; we seed shards ourselves (see _train).
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
    # With EP the grad norm spans two mesh dims; DTensor logs that it all-reduces them one after the other (correct,
    # a few scalars per step).
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        # CPU offload keeps sharded state in host memory: its collectives (e.g. the grad-norm reduction) need gloo.
        dist.init_process_group("cuda:nccl,cpu:gloo" if cfg.cpu_offload else "nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    recorder = ProgressRecorder.from_env(cfg.run_dir)
    try:
        rc = _train(cfg, device, recorder)
        dist.barrier()  # no rank tears its process group down while another still talks to it
    except UserError:
        dist.destroy_process_group()
        raise
    except Exception as e:  # one line from the first failing rank; the traceback goes to RUN_DIR/errors/
        oom = isinstance(e, torch.OutOfMemoryError)
        snapshot = write_snapshot(cfg.run_dir, dist.get_rank()) if oom else None  # while the allocator holds it
        message = report_failure(recorder, e, dist.get_world_size(), timeout_s=cfg.comm_timeout or None,
                                 jsonl=cfg.metrics_jsonl or None)
        if message:
            print(f"paraseek: {message}", file=sys.stderr, flush=True)
            if oom:
                args, _, _ = resolve_model(cfg.init_from or cfg.model)
                gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "H200"
                head = f"allocator snapshot: {snapshot}\n" if snapshot else "(a CPU run: the advice is for H200s)\n"
                print(head + cheapest_fix(args, cfg, gpu), file=sys.stderr, flush=True)
        return REPORTED  # no destroy_process_group: the peers are gone or stuck
    dist.destroy_process_group()
    return rc


def _peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (process RSS peak)


def _memory_metrics(device: torch.device) -> dict:
    """The allocator's view on CUDA: allocated and reserved now, and cudaMalloc retries (each one a full cache
    flush: a sign of fragmentation or of running at the edge)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"mem_allocated_gib": stats.get("allocated_bytes.all.current", 0) / 2**30,
            "mem_reserved_gib": stats.get("reserved_bytes.all.current", 0) / 2**30,
            "alloc_retries": stats.get("num_alloc_retries", 0)}


def _train(cfg: TrainConfig, device: torch.device, recorder: ProgressRecorder) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0
    mesh = build_mesh(device.type, cfg.dp_replicate, cfg.dp_shard, cfg.ep, cfg.tp, cfg.pp)
    shard_rank = mesh["dp_shard"].get_local_rank()
    dp_rank = mesh["dp_replicate"].get_local_rank() * cfg.dp_shard + shard_rank
    args, _, _ = resolve_model(cfg.init_from or cfg.model)
    use_ddp = cfg.dp_replicate > 1 and cfg.dp_shard == 1 and cfg.pp == 1

    dataset = open_dataset(cfg.data, seq_len=cfg.seq_len, vocab_size=args.vocab_size, tokenizer=cfg.tokenizer or None,
                           seed=cfg.seed)
    loader = DataLoader(dataset, global_batch_size=cfg.global_batch_size, micro_batch_size=cfg.micro_batch_size,
                        dp_rank=dp_rank, dp_size=cfg.dims.dp)

    # meta -> (pipeline stages) -> parallelize -> materialize -> init or load (no rank ever holds the whole model)
    if cfg.pp > 1:
        specs = stage_specs(args, cfg.seq_len, cfg.dims.n_stages)
        stage_ids = rank_stages(mesh["pp"].get_local_rank(), cfg.pp, cfg.pp_virtual_stages, cfg.pp_schedule)
        parts = [build_stage(args, specs[sid]) for sid in stage_ids]
    else:
        stage_ids = [0]
        with torch.device("meta"):
            parts = [Transformer(args)]
    meshes = ep_meshes(mesh, cfg.ep) if cfg.ep > 1 else {}
    for sid, part in zip(stage_ids, parts):
        # V3's MTP modules are kept (checkpoints, export) but not trained yet: frozen, so the optimizer holds no
        # state for them and a checkpoint resumes under any plan.
        part.mtp.requires_grad_(False)
        # EP first: it replaces each MoE's experts module, which TP then marks as getting partial grads over tp.
        if meshes:
            apply_expert_parallel(part, meshes["ep"])
        if cfg.tp > 1:
            apply_tensor_parallel(part, mesh["tp"], cfg.sequence_parallel)
        apply_activation_checkpointing(part, cfg.activation_checkpointing)
        if cfg.compile:
            apply_compile(part)
        if not use_ddp:
            # Pipelining runs several micro-batches through a stage before their backward: resharding after each
            # forward would all-gather the stage's parameters once per micro-batch (TorchTitan keeps them too).
            # Without pipelining, keeping them gathered saves all-gathers; with one data-parallel rank there are
            # none to save, only the memory of a second (bf16) copy, so the flag is ignored there.
            keep_gathered = cfg.pp > 1 or (not cfg.reshard_after_forward and cfg.dims.dp > 1)
            apply_fsdp(part, mesh, cfg.precision, not keep_gathered, cfg.cpu_offload, meshes.get("expert_dp"))
        part.to_empty(device="cpu" if cfg.cpu_offload else device)
        if cfg.init_from:
            load_state_into(part, cfg.init_from, stage=cfg.pp > 1)
            part.init_buffers(device)
        else:
            # Shards differ, replicas agree: seed by the shard coordinate (and the stage).
            seed = cfg.seed + shard_rank + 1000 * sid
            if cfg.tp > 1:  # tp shards drawn apart, tp-replicated weights equal (see init_weights_tp)
                init_weights_tp(part, mesh["tp"], seed, device)
            else:
                torch.manual_seed(seed)
                part.init_weights(device=device)
    torch.manual_seed(cfg.seed)
    # `inner`: the model as named parameters (checkpoints, telemetry); `model`: what runs forward without pp.
    inner = model = parts[0] if cfg.pp == 1 else whole_model_view(args, parts)
    if use_ddp:
        model = apply_ddp(model, mesh, device, cfg.grad_compression)
    # Ranks holding the same stages (pp == 1: everyone): the expert-load sums run over them.
    # Each pp coordinate's ranks, read from the mesh (pp is its first dim).
    stage_ranks = [mesh.mesh[s].flatten().tolist() for s in range(cfg.pp)] if cfg.pp > 1 else None
    stage_group = _stage_group(stage_ranks) if stage_ranks else None

    # Compiled, the fp32 cast, log-softmax and gather of the [tokens, vocab] logits fuse (no fp32 copies of them).
    loss_fn = torch.compile(tp_loss) if cfg.compile and cfg.tp == 1 else tp_loss
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay,
                                  fused=device.type == "cuda" and not cfg.cpu_offload,
                                  foreach=None if device.type == "cuda" and not cfg.cpu_offload else True)
    scaler = torch.amp.GradScaler("cuda") if cfg.precision == "fp16" else None
    # DDP has no mixed-precision policy of its own: autocast keeps fp32 master weights and bf16/fp16 compute.
    autocast = (torch.autocast(device.type, dtype=DTYPES[cfg.precision])
                if use_ddp and cfg.precision != "fp32" else nullcontext())

    # MoE: load telemetry every step, V3's bias balancing, the optional balance loss.
    expert_load = ExpertLoad(inner, device) if args.n_routed_experts else None  # also on a stage without MoE layers
    stage_counts: dict[int, list] = {}  # pp: stage -> (rows, counts) of each forward in this step
    if expert_load is not None and cfg.pp > 1:
        # A stage's forward runs inside the schedule: snapshot each stage's routing right after its forward (the
        # root module's forward is never recomputed by activation checkpointing). On the first step torch's
        # PipelineStage runs an extra forward to infer the shapes it exchanges (a no-grad forward of zeros in older
        # releases, a real forward + backward in torch 2.13); each stage keeps its last n_microbatches snapshots of
        # the step, which are the real ones.
        for sid, part in zip(stage_ids, parts):
            rows = [i for i, m in enumerate(expert_load.layers) if any(m is x for x in routed_layers(part))]
            if rows:
                part.register_forward_hook(lambda *_, sid=sid, rows=slice(rows[0], rows[-1] + 1): stage_counts
                                           .setdefault(sid, []).append((rows, expert_load.snapshot(rows))))
    gamma = cfg.moe_bias_gamma if cfg.moe_bias_gamma >= 0 else (0.001 if args.topk_method == "noaux_tc" else 0.0)
    if expert_load is not None:
        alpha = None if cfg.moe_aux_loss_alpha < 0 else cfg.moe_aux_loss_alpha
        if alpha is None and args.topk_method == "noaux_tc":
            alpha = 0.0  # V3 trains without the auxiliary loss by default (its bias does the balancing)
        enable_balance_loss(inner, alpha, scale=1.0 / cfg.grad_accum_steps)

    start_step = 0
    if cfg.resume:
        path = latest_checkpoint(cfg.checkpoint_dir)
        if path is None:
            if is_main:
                print(f"no checkpoint in {cfg.checkpoint_dir} yet: starting from step 0", flush=True)
        else:
            state = load_checkpoint(path, inner, optimizer)
            start_step = state["step"]
            loader.load_state_dict(state["data"])
            if is_main:
                print(f"resumed from {path} at step {start_step}", flush=True)
    if start_step == 0:
        loader.load_state_dict({"position": 0})

    counts = param_counts(args)
    flops_tok = flops_per_token(args, cfg.seq_len)
    peak = peak_flops(torch.cuda.get_device_name(device), cfg.precision) if device.type == "cuda" else None
    tokens_per_step = cfg.global_batch_size * cfg.seq_len
    tokens_per_rank_step = tokens_per_step // cfg.dims.dp
    logger = MetricsLogger(enabled=is_main, total_steps=cfg.steps, jsonl=cfg.metrics_jsonl,
                           tensorboard=cfg.tensorboard, log_every=cfg.log_every,
                           unit="gpu" if device.type == "cuda" else "rank")
    if is_main:
        plan = "DDP" if use_ddp else ("HSDP" if cfg.dp_replicate > 1 else "FSDP2")
        pp_text = (f" | pp={cfg.pp} {cfg.pp_schedule}"
                   f"{f' x {cfg.pp_virtual_stages} stages/rank' if cfg.pp_virtual_stages > 1 else ''}" if cfg.pp > 1 else "")
        print(f"paraseek train: {cfg.init_from or cfg.model} ({counts.total / 1e6:,.1f} M params, {counts.active / 1e6:,.1f} M active) | "
              f"{world} x {device.type} | {plan} dp_replicate={cfg.dp_replicate} dp_shard={cfg.dp_shard} | "
              f"{cfg.precision} | global batch {cfg.global_batch_size} x {cfg.seq_len} tokens "
              f"(micro {cfg.micro_batch_size}, accumulation {cfg.grad_accum_steps}) | AC {cfg.activation_checkpointing}"
              f"{f' | ep={cfg.ep}' if cfg.ep > 1 else ''}"
              f"{f' | tp={cfg.tp}' + (' +SP' if cfg.sequence_parallel else '') if cfg.tp > 1 else ''}"
              f"{pp_text}{' | compile' if cfg.compile else ''}", flush=True)
        if cfg.pp > 1:
            print(describe(specs, cfg.pp, cfg.pp_virtual_stages, cfg.pp_schedule), flush=True)
    faults = FaultInjector(cfg.inject_fault, rank)
    pipe = None
    if cfg.pp > 1:
        current = {"step": 0}  # the schedule calls the loss; the fault drills need the step

        def pipeline_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return faults.loss_hook(current["step"], tp_loss(logits, labels) / tokens_per_rank_step)

        pipe = Pipeline(parts, stage_ids, len(specs), cfg.pp_schedule, cfg.grad_accum_steps, pipeline_loss, device,
                        mesh["pp"].get_group())
    health, stragglers, hosts = HealthMonitor(), StragglerDetector(world), gather_hosts()
    profiler = StepProfiler(cfg.profile_steps, cfg.run_dir, rank, first_step=start_step + 1) if cfg.profile_steps else None
    recorder.mark(start_step, "start")
    step_times: list[float] = []
    losses: list[float] = []
    metrics: dict = {}
    t_run = time.perf_counter()
    for step in range(start_step + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        lr = lr_at(cfg, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro_batches = loader.next_step()
        faults.before_step(step)  # before the mark: a rank that hangs here still reads as "finished step - 1"
        recorder.mark(step, "before_step")
        ready_s = time.perf_counter() - t0
        loss_sum = torch.zeros((), device=device)
        if pipe is not None:  # the schedule runs every micro-batch's forward and backward
            current["step"] = step
            inputs_BT = torch.cat([x for x, _ in micro_batches]).to(device, non_blocking=True)
            labels_BT = torch.cat([y for _, y in micro_batches]).to(device, non_blocking=True)
            with loss_context(cfg.tp > 1):
                for loss in pipe.step(inputs_BT, labels_BT):
                    loss_sum += local_value(loss).detach()
            for seen in stage_counts.values():
                for rows, counts in seen[-cfg.grad_accum_steps:]:
                    expert_load.observe(rows, counts)
            stage_counts.clear()
            micro_batches = []
        for i, (inputs, labels) in enumerate(micro_batches):
            inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            last = i == len(micro_batches) - 1
            # Under TP the logits stay vocab-sharded: loss_parallel computes the cross-entropy without gathering them.
            with (model.no_sync() if use_ddp and not last else nullcontext()), autocast, loss_context(cfg.tp > 1):
                if cfg.loss_chunks:
                    token_losses = model(inputs, labels, cfg.loss_chunks)
                else:
                    token_losses = loss_fn(model(inputs), labels)
                loss = faults.loss_hook(step, token_losses / tokens_per_rank_step)
                (scaler.scale(loss) if scaler else loss).backward()
            loss_sum += local_value(loss).detach()
            if expert_load is not None:
                expert_load.observe()
            del token_losses, loss
        if cfg.tp > 1:
            reduce_tp_grads(model)  # the tp-replicated weights (router, experts, MLA's latent path) got partial grads
        if scaler:
            scaler.unscale_(optimizer)
        grad_norm = clip_grad_norm(params, cfg.grad_clip, mesh["pp"].get_group() if cfg.pp > 1 else None,
                                   optimizer if optimizer.defaults.get("fused") and scaler is None else None)
        dist.all_reduce(loss_sum)  # before the update now: --on-anomaly skip must know the loss first
        # Every tp rank of a dp rank holds the same loss; only the last pipeline stage holds it.
        loss_value = loss_sum.item() / (world // cfg.pp)
        norm = grad_norm.item()
        # fp16: an inf grad norm is the scaler's business (it skips the step and lowers the scale), not an anomaly
        events = health.observe(step, loss_value, None if scaler and not math.isfinite(norm) else norm)
        action = anomaly_action(events, cfg.on_anomaly)
        for e in events:
            if e["event"] == "nan":
                e["detail"] += f"; {nonfinite_report(model, all_ranks=True) or 'gradients finite'}"
            if is_main:
                log_event(logger, e)
                if action != "stop":  # a stop prints its one line below
                    print(format_event(e, action), file=sys.stderr, flush=True)
        if action == "stop":
            raise UserError(f"{events[0]['event']} at step {step}: {events[0]['detail']} (--on-anomaly {cfg.on_anomaly})")
        if action != "skip":
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
        moe_metrics = {}
        if expert_load is not None:
            load_YE = expert_load.reduce(stage_group)
            moe_metrics = load_stats(_all_stages(load_YE, inner, mesh["pp"].get_group()) if cfg.pp > 1 else load_YE)
            if gamma > 0 and action != "skip":
                update_routing_bias(inner, gamma, load_YE=load_YE)
        if step == start_step + 1:  # where each rank's model state lives, once (the planner's prediction target)
            layout = model_state_bytes_per_rank(params, optimizer)
            if is_main:
                logger.event("model_state", step, detail="bytes per rank", **layout)
        optimizer.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        rank_times = gather_step_times(dt, ready_s)  # every rank's time, the wait for the slowest taken out
        recorder.mark(step, "after_step")  # after the step's last collective
        if step == start_step + 1 and cfg.comm_timeout:
            set_comm_timeout(cfg.comm_timeout)  # after warm-up: the first step may compile and allocate
        straggler = stragglers.observe(step, rank_times, hosts)
        if straggler and is_main:
            log_event(logger, straggler)
            print(format_event(straggler), file=sys.stderr, flush=True)
        step_times.append(dt)
        losses.append(loss_value)
        tps = tokens_per_step / dt
        metrics = {
            "step": step, "loss": loss_value, "grad_norm": grad_norm.item(), "lr": lr,
            "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / world,
            "mfu": flops_tok * tps / world / peak if peak else None,
            "mem_peak_gib": _peak_memory_gib(device), "step_time_s": dt, **step_time_stats(rank_times),
            **_memory_metrics(device),
        }
        if scaler:
            metrics["loss_scale"] = scaler.get_scale()
        metrics.update(moe_metrics)
        logger.step(metrics)
        if profiler and (summary := profiler.step(step)) is not None:
            text = report_all_ranks(summary)  # a collective: every rank stops the profiler at the same step
            if text:
                print(text, flush=True)
        if cfg.checkpoint_dir and ((cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps):
            path = save_checkpoint(cfg.checkpoint_dir, step, inner, optimizer,
                                   {"data": loader.state_dict(), "config": dataclasses.asdict(cfg)})
            if is_main:
                print(f"checkpoint: {path}", flush=True)

    if cfg.export_hf:
        state = full_model_state(inner, [ranks[0] for ranks in stage_ranks] if stage_ranks else None)
        if is_main:
            save_hf_state(state, args, cfg.export_hf)
            print(f"exported an HF folder to {Path(cfg.export_hf).resolve()}", flush=True)
        dist.barrier()
    logger.close()
    recorder.mark(cfg.steps, "done")
    if is_main and losses:
        steady = step_times[1:] or step_times
        median = statistics.median(steady)
        tps_gpu = tokens_per_step / median / world
        mfu = f", MFU {flops_tok * tps_gpu / peak * 100:.1f}%" if peak else ""
        print(f"done: {len(losses)} steps in {time.perf_counter() - t_run:.1f} s | loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f} | median step {median * 1e3:,.0f} ms, {tps_gpu:,.0f} tokens/s/{'gpu' if device.type == 'cuda' else 'rank'}{mfu} | "
              f"peak memory {metrics['mem_peak_gib']:.2f} GiB", flush=True)
    return 0


def _stage_group(stage_ranks: list[list[int]]) -> dist.ProcessGroup:
    """This rank's pipeline-stage group (the ranks of its pp coordinate). Every rank creates every group, in the
    same order, as new_group requires."""
    groups = [dist.new_group(ranks) for ranks in stage_ranks]
    return next(g for g, ranks in zip(groups, stage_ranks) if dist.get_rank() in ranks)


def _all_stages(load_YE: torch.Tensor, model: Transformer, pp_group: dist.ProcessGroup) -> torch.Tensor:
    """The whole model's [Y, E] expert loads from each pp rank's rows (its stages' MoE layers): every rank fills
    its layers' rows of a zero [Y, E] tensor and the pp group sums them."""
    a = model.args
    moe_ids = [i for i in range(a.n_layers) if a.is_moe_layer(i)]
    mine = [moe_ids.index(int(k)) for k, block in model.layers.items() if int(k) in moe_ids]
    every_YE = torch.zeros((len(moe_ids), a.n_routed_experts), dtype=load_YE.dtype, device=load_YE.device)
    every_YE[mine] = load_YE
    dist.all_reduce(every_YE, group=pp_group)
    return every_YE
