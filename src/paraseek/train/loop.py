"""The training loop, run in every worker process (train/worker.py, started by torch's launcher): the mesh
(parallel/mesh.py), the model (train/build.py), the data and the optimizer (train/optim.py) set up once, then
`Run.step` per optimizer step, with `ForwardBackward` running the micro-batches (pipelined or not).

SIGINT/SIGTERM (train/stop.py notes them) travel in the step's one gather of step times, so every rank sees the
same request after the same step: all of them save that step and leave with 130/143.

Loss normalization makes every data-parallel layout compute the same thing: rank r minimizes
sum(token losses on r) / (trained tokens of the global batch / dp); FSDP/DDP average gradients over the dp ranks, so
the update is that of mean(token losses over the trained tokens of the global batch) -- identical to one process with
gradient accumulation. Where every label is trained (text, synthetic) that count is the global batch x seq_len; where
some are not (chat roles, padding, documents' first tokens) the ranks sum their counts before the step's forward.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import resource
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from paraseek.errors import UserError
from paraseek.hardware.specs import peak_flops
from paraseek.models import flops_per_token, param_counts, resolve_model
from paraseek.models.hf import save_hf_state
from paraseek.models.lora import is_adapter, merge_state
from paraseek.models.loss import IGNORE_INDEX
from paraseek.monitor.faults import FaultInjector
from paraseek.monitor.health import (HealthMonitor, StragglerDetector, anomaly_action, format_event, gather_floats,
                                     gather_hosts, log_event, nonfinite_report, own_step_times, step_time_stats)
from paraseek.monitor.metrics import GcClock, MetricsLogger
from paraseek.monitor.oom import cheapest_fix, write_snapshot
from paraseek.monitor.profile import StepProfiler, report_all_ranks
from paraseek.monitor.progress import (PEER_LOST, REPORTED, ProgressRecorder, is_peer_lost, report_failure,
                                       set_comm_timeout)
from paraseek.parallel.fp8 import precompute_scales
from paraseek.parallel.mesh import ParallelMesh
from paraseek.parallel.parallelize import DTYPES
from paraseek.parallel.pipeline import Pipeline, describe
from paraseek.parallel.tensor import full_value, loss_context, reduce_tp_grads
from paraseek.train import mtp as mtp_flags
from paraseek.train.build import Model, build, resume
from paraseek.train.checkpoint import full_model_state, save_checkpoint
from paraseek.train.config import TrainConfig, tokenizer_origin
from paraseek.train.dataset import open_training_data
from paraseek.train.loader import DataLoader, EvalLoader
from paraseek.train.moe import ExpertBalance
from paraseek.train.optim import build_optimizer, clip_grad_norm, lr_at, resumed_schedule, schedule_of, token_loss
from paraseek.train.stop import STOP, stop_message


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
        return PEER_LOST if is_peer_lost(e) else REPORTED  # no destroy_process_group: the peers are gone or stuck
    dist.destroy_process_group()
    return rc


def _peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (process RSS peak)


def _memory_metrics(device: torch.device) -> dict:
    """The allocator's view on CUDA: allocated and reserved now, its peak holdings (allocated plus its rounding and
    fragmentation: what an OOM is decided on, less the CUDA context) and cudaMalloc retries (each one a full cache
    flush: a sign of fragmentation or of running at the edge)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"mem_allocated_gib": stats.get("allocated_bytes.all.current", 0) / 2**30,
            "mem_reserved_gib": stats.get("reserved_bytes.all.current", 0) / 2**30,
            "mem_peak_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / 2**30,
            "alloc_retries": stats.get("num_alloc_retries", 0)}


def _train(cfg: TrainConfig, device: torch.device, recorder: ProgressRecorder) -> int:
    mesh = ParallelMesh(cfg.dims, device.type)
    m = build(cfg, mesh, device)  # meta -> stages -> parallelize -> materialize -> init or load
    dataset, held_out = open_training_data(cfg, m.args.vocab_size)
    loader = DataLoader(dataset, global_batch_size=cfg.global_batch_size, micro_batch_size=cfg.micro_batch_size,
                        dp_rank=mesh.dp_rank, dp_size=mesh.dims.dp)
    optimizer = build_optimizer(m.params, cfg, device)
    run = Run(cfg, mesh, m, loader, optimizer, device, recorder)
    if held_out is not None:  # pipelined, each call of the schedule takes grad_accum_steps micro-batches
        run.eval_loader = EvalLoader(held_out, micro_batch_size=cfg.micro_batch_size, dp_rank=mesh.dp_rank,
                                     dp_size=mesh.dims.dp, multiple=cfg.grad_accum_steps if mesh.pp else 1)
    state = resume(cfg, m.inner, optimizer, loader, run.scaler, run.is_main)
    if state is not None:
        run.start_step, run.schedule = state["step"], resumed_schedule(cfg, state)
        run.mark_resume(state)
    run.print_header()
    run.profiler = StepProfiler(cfg.profile_steps, cfg.run_dir, run.rank, first_step=run.start_step + 1) \
        if cfg.profile_steps else None
    recorder.mark(run.start_step, "start")
    t_run = time.perf_counter()
    for step in range(run.start_step + 1, cfg.steps + 1):
        run.step(step)
        if run.stop_signal and step < cfg.steps:  # at the last step the run is complete: it ends as usual
            return run.stop(step)
    if cfg.export_hf:
        state = full_model_state(m.inner, mesh.stage_leaders)
        if run.is_main:
            # An HF folder holds plain weights: LoRA's adapters are merged into them (paraseek export
            # --export-adapter writes them apart, from a checkpoint).
            save_hf_state(merge_state(state, m.lora) if m.lora else state, m.args, cfg.export_hf)
            if cfg.data != "synthetic":  # the tokenizer it trained with travels with it, as `paraseek export` does
                from paraseek.train.export import model_tokenizer, write_tokenizer

                tok = model_tokenizer(cfg.tokenizer, m.args, cfg.chat_template)
                write_tokenizer(Path(cfg.tokenizer), tok, Path(cfg.export_hf), m.args.max_seq_len,
                                bool(cfg.chat_template))
            print(f"exported an HF folder{' (LoRA merged)' if m.lora else ''} to {Path(cfg.export_hf).resolve()}",
                  flush=True)
        dist.barrier()
    run.logger.close()
    run.gc_clock.close()
    recorder.mark(cfg.steps, "done")
    run.print_summary(time.perf_counter() - t_run)
    return 0


class Run:
    """One training run's parts, set up once; `step` is one optimizer step."""

    def __init__(self, cfg: TrainConfig, mesh: ParallelMesh, m: Model, loader: DataLoader,
                 optimizer: torch.optim.Optimizer, device: torch.device, recorder: ProgressRecorder):
        self.cfg, self.mesh, self.m, self.loader, self.optimizer, self.device = cfg, mesh, m, loader, optimizer, device
        self.recorder = recorder
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        self.scaler = torch.amp.GradScaler("cuda") if cfg.precision == "fp16" else None
        # A fused AdamW takes the gradient clip into its own kernel (optim.clip_grad_norm); not with a GradScaler.
        self.fused = optimizer if optimizer.defaults.get("fused") and self.scaler is None else None
        self.experts = ExpertBalance(cfg, m.inner, m.parts, m.stage_ids, mesh, device) if m.args.n_routed_experts \
            else None
        self.faults = FaultInjector(cfg.inject_fault, self.rank, signalled=lambda: STOP.signum)
        self.forward_backward = ForwardBackward(cfg, m, mesh, device, self.faults, self.experts, self.scaler,
                                                loader.dataset.every_label_counts)
        self.eval_loader: EvalLoader | None = None
        self.health, self.stragglers, self.hosts = HealthMonitor(), StragglerDetector(self.world), gather_hosts()
        self.logger = MetricsLogger(enabled=self.is_main, total_steps=cfg.steps, jsonl=cfg.metrics_jsonl,
                                    tensorboard=cfg.tensorboard, log_every=cfg.log_every,
                                    unit="gpu" if device.type == "cuda" else "rank")
        self.gc_clock = GcClock()
        self.flops_per_token = flops_per_token(m.args, cfg.seq_len)
        self.peak = peak_flops(torch.cuda.get_device_name(device), cfg.precision) if device.type == "cuda" else None
        self.start_step, self.profiler = 0, None
        self.schedule = cfg  # what lr_at follows: after --resume, the original run's schedule (resumed_schedule)
        self.stop_signal = 0  # SIGINT/SIGTERM on any rank, known to every rank after the step's gather
        self.checkpoint: Path | None = None  # the newest checkpoint this run wrote
        self.step_times: list[float] = []
        self.losses: list[float] = []
        self.metrics: dict = {}

    def step(self, step: int) -> None:
        """Data -> forward/backward (the pipeline schedule or plain micro-batches) -> tp gradient sums -> clip ->
        the step's loss and health -> update -> MoE balancing -> telemetry and checkpoint."""
        cfg, mesh, optimizer = self.cfg, self.mesh, self.optimizer
        t0 = time.perf_counter()
        lr = lr_at(self.schedule, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro_batches = self.loader.next_step()
        self.faults.before_step(step)  # before the mark: a rank that hangs here still reads as "finished step - 1"
        self.recorder.mark(step, "before_step")
        ready_s = time.perf_counter() - t0
        loss_sum = self.forward_backward(micro_batches, step)
        if mesh.tp is not None:  # the tp-replicated weights (router, experts, MLA's latent path) got partial grads
            reduce_tp_grads(self.m.model, self.m.tp_partial, mesh.tp)
        if self.scaler:
            self.scaler.unscale_(optimizer)
        grad_norm = clip_grad_norm(self.m.params, cfg.grad_clip, mesh.pp_group, self.fused).item()
        loss = mesh.mean_loss(loss_sum)  # before the update: --on-anomaly skip must know the loss first
        mtp_metrics = self.forward_backward.mtp_metrics(mesh)
        action = self._health(step, loss, grad_norm)
        if action != "skip":
            if self.scaler:
                self.scaler.step(optimizer)
                self.scaler.update()
            else:
                optimizer.step()
            if self.m.fp8_precompute:
                precompute_scales(self.m.inner)
        moe_metrics = self.experts.after_step(skipped=action == "skip") if self.experts else {}
        if step == self.start_step + 1:  # where each rank's model state lives, once (the planner's prediction target)
            layout = model_state_bytes_per_rank(self.m.params, optimizer)
            if self.is_main:
                self.logger.event("model_state", step, detail="bytes per rank", **layout)
        optimizer.zero_grad(set_to_none=True)
        self._report(step, time.perf_counter() - t0, ready_s, loss, grad_norm, lr, {**mtp_metrics, **moe_metrics})
        if step == self.start_step + 1:
            # The garbage that building and compiling left is collected once, between steps, and what survives
            # (FX graphs, guards, inductor's caches) is frozen out of later collections. Measured on one H200 from a
            # fresh compile (benchmarks/2026-12-03/train-host-gc-freeze.json): V2-Lite-8 0.174 s a step vs 0.196
            # without, V2-Lite-12 0.359 vs 0.416; the collector itself ran under 1.5 ms a step either way (gc_s), so
            # the gain is not its walk.
            gc.collect()
            gc.freeze()
            self.gc_clock.take()  # that collection ran between steps, not in one
        if self.eval_loader is not None and not self.stop_signal and (
                (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps):
            self.evaluate(step)
        every = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
        if cfg.checkpoint_dir and (every or step == cfg.steps or self.stop_signal):
            config = dataclasses.asdict(cfg)
            # What the checkpoint's readers open wherever they run (export, generate, serve): a LoRA run's base (its
            # --init-from), the tokenizer and chat template it trained with.
            for key in ("model", "init_from", "tokenizer", "chat_template"):
                if config[key] and Path(config[key]).exists():
                    config[key] = str(Path(config[key]).resolve())
            self.checkpoint = save_checkpoint(
                cfg.checkpoint_dir, step, self.m.inner, optimizer,
                {"data": self.loader.state_dict(), "config": config, "lr_schedule": schedule_of(self.schedule),
                 "mtp_depth": self.m.mtp_depth, "mtp_modules": self.m.args.n_mtp_layers},
                model_keys=is_adapter if self.m.lora else None, keep_last=cfg.keep_last, scaler=self.scaler)
            if self.is_main:
                print(f"checkpoint: {self.checkpoint}", flush=True)

    def mark_resume(self, state: dict) -> None:
        """Say on the console and in the metrics file where this run continues from, and which lr schedule it
        follows when this command's differs from it."""
        if not self.is_main:
            return
        kept, asked = schedule_of(self.schedule), schedule_of(self.cfg)
        detail = f"resumed from {state['path']} at step {state['step']}"
        if kept != asked:
            ours = ", ".join(f"{k} {v}" for k, v in kept.items() if v != asked[k])
            theirs = ", ".join(f"{k} {v}" for k, v in asked.items() if v != kept[k])
            print(f"lr schedule: the resumed run's ({ours}) is kept, not this command's ({theirs}); "
                  f"--lr-schedule-reset follows this command's", flush=True)
            detail += f"; the resumed run's lr schedule is kept ({ours})"
        self.logger.event("resume", state["step"], detail=detail, checkpoint=state["path"], lr_schedule=kept)

    def stop(self, step: int) -> int:
        """After the step in which SIGINT/SIGTERM reached some rank (saved by step() when a folder is set): one line
        with the command that resumes, a "stop" event, and 128 + the signal as exit code."""
        checkpoint = str(self.checkpoint) if self.cfg.checkpoint_dir else None  # step() saved this step
        message = stop_message(self.stop_signal, step, checkpoint, self.cfg.overwrite)
        self.recorder.mark(step, "stopped")
        if self.is_main:
            self.logger.event("stop", step, detail=message.removeprefix("paraseek: "), signal=self.stop_signal,
                              checkpoint=checkpoint)
            print(message, file=sys.stderr, flush=True)
        self.logger.close()
        self.gc_clock.close()
        return 128 + self.stop_signal

    def evaluate(self, step: int) -> None:
        """The loss over every trained token of the evaluation data (and its perplexity), the same for any layout:
        each rank sums its share's token losses and counts, then one all-reduce (EvalLoader says why the shares
        add up to the whole set). Console, JSONL ({"event": "eval", ...}) and TensorBoard (eval/loss,
        eval/perplexity)."""
        t0 = time.perf_counter()
        loss_sum, tokens = self.forward_backward.evaluate(self.eval_loader.batches())
        dims = self.mesh.dims
        # The loss lives on the last pipeline stage, alike on its tp ranks; the counts on every rank of a dp rank.
        totals = torch.tensor([loss_sum, tokens], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        loss_sum, tokens = totals[0].item() / dims.tp, int(totals[1].item()) // (dims.tp * dims.pp)
        loss = loss_sum / max(tokens, 1)
        ppl = math.exp(loss) if loss < 700 else math.inf
        if self.is_main:
            seconds = time.perf_counter() - t0
            self.logger.event("eval", step, detail=f"{tokens:,} tokens", eval_loss=loss, eval_ppl=ppl,
                              eval_tokens=tokens, eval_time_s=seconds)
            if self.logger.tb:
                self.logger.tb.add_scalar("eval/loss", loss, step)
                self.logger.tb.add_scalar("eval/perplexity", ppl, step)
            print(f"eval  {step:>5}/{self.cfg.steps} | loss {loss:.4f} | ppl {ppl:,.2f} | {tokens:,} tokens | "
                  f"{seconds * 1e3:,.0f} ms", flush=True)

    def _health(self, step: int, loss: float, grad_norm: float) -> str:
        """NaN, loss spike and grad-norm explosion: logged, and what --on-anomaly does about them (stop raises)."""
        # fp16: an inf grad norm is the scaler's business (it skips the step and lowers the scale), not an anomaly
        events = self.health.observe(step, loss, None if self.scaler and not math.isfinite(grad_norm) else grad_norm)
        action = anomaly_action(events, self.cfg.on_anomaly)
        for e in events:
            if e["event"] == "nan":
                e["detail"] += f"; {nonfinite_report(self.m.model, all_ranks=True) or 'gradients finite'}"
            if self.is_main:
                log_event(self.logger, e)
                if action != "stop":  # a stop prints its one line below
                    print(format_event(e, action), file=sys.stderr, flush=True)
        if action == "stop":
            raise UserError(f"{events[0]['event']} at step {step}: {events[0]['detail']} "
                            f"(--on-anomaly {self.cfg.on_anomaly})")
        return action

    def _report(self, step: int, dt: float, ready_s: float, loss: float, grad_norm: float, lr: float,
                moe_metrics: dict) -> None:
        """Every rank's step time (stragglers), the progress mark, the step's metrics and the profiler."""
        # One small collective per step: every rank's step time and time to its first collective (straggler
        # detection takes the wait for the slowest out) and the signal, if any, that asked it to stop.
        rows = gather_floats([dt, ready_s, STOP.signum])
        rank_times = own_step_times([r[0] for r in rows], [r[1] for r in rows])
        self.stop_signal = int(max(r[2] for r in rows))  # ranks that got different ones: SIGTERM's 15 wins
        self.recorder.mark(step, "after_step")  # after the step's last collective
        if step == self.start_step + 1 and self.cfg.comm_timeout:
            set_comm_timeout(self.cfg.comm_timeout)  # after warm-up: the first step may compile and allocate
        straggler = self.stragglers.observe(step, rank_times, self.hosts)
        if straggler and self.is_main:
            log_event(self.logger, straggler)
            print(format_event(straggler), file=sys.stderr, flush=True)
        self.step_times.append(dt)
        self.losses.append(loss)
        tps = self.cfg.global_batch_size * self.cfg.seq_len / dt
        self.metrics = {
            "step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
            "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / self.world,
            "mfu": self.flops_per_token * tps / self.world / self.peak if self.peak else None,
            "mem_peak_gib": _peak_memory_gib(self.device), "step_time_s": dt, **step_time_stats(rank_times),
            "gc_s": self.gc_clock.take(),
            **_memory_metrics(self.device),
        }
        if self.scaler:
            self.metrics["loss_scale"] = self.scaler.get_scale()
        self.metrics.update(moe_metrics)
        self.logger.step(self.metrics)
        if self.profiler and (summary := self.profiler.step(step)) is not None:
            text = report_all_ranks(summary)  # a collective: every rank stops the profiler at the same step
            if text:
                print(text, flush=True)

    def print_header(self) -> None:
        if not self.is_main:
            return
        cfg, dims, m = self.cfg, self.mesh.dims, self.m
        print(data_line(cfg, self.loader.dataset), flush=True)
        counts = param_counts(m.args)
        plan = "DDP" if dims.ddp else ("HSDP" if dims.dp_replicate > 1 else "FSDP2")
        pp_text = (f" | pp={dims.pp} {dims.pp_schedule}"
                   f"{f' x {dims.pp_virtual_stages} stages/rank' if dims.pp_virtual_stages > 1 else ''}"
                   if dims.pp > 1 else "")
        print(f"paraseek train: {cfg.init_from or cfg.model} ({counts.total / 1e6:,.1f} M params, "
              f"{counts.active / 1e6:,.1f} M active) | {self.world} x {self.device.type} | {plan} "
              f"dp_replicate={dims.dp_replicate} dp_shard={dims.dp_shard} | {cfg.precision} | global batch "
              f"{cfg.global_batch_size} x {cfg.seq_len} tokens (micro {cfg.micro_batch_size}, accumulation "
              f"{cfg.grad_accum_steps}) | AC {cfg.activation_checkpointing}"
              f"{f' | ep={dims.ep}' if dims.ep > 1 else ''}"
              f"{f' | tp={dims.tp}' + (' +SP' if dims.sequence_parallel else '') if dims.tp > 1 else ''}"
              f"{pp_text}{' | compile' if cfg.compile else ''}", flush=True)
        if dims.pp > 1:
            print(describe(m.specs, dims.pp, dims.pp_virtual_stages, dims.pp_schedule, m.mtp_depth), flush=True)
        if m.mtp_depth:
            print(mtp_flags.describe(cfg, m.mtp_depth, m.mtp_held), flush=True)
        if m.lora:
            from paraseek.models.lora_spec import adapter_params

            n = adapter_params(m.args, m.lora)
            print(f"LoRA: r={m.lora.rank} alpha={m.lora.alpha:g} (scaling {m.lora.scaling:g}) on "
                  f"{','.join(m.lora.targets)}: {n:,} trainable parameters ({100 * n / counts.total:.2f}% of the "
                  f"model), the base frozen in {cfg.precision}", flush=True)

    def print_summary(self, seconds: float) -> None:
        if not (self.is_main and self.losses):
            return
        median = statistics.median(self.step_times[1:] or self.step_times)
        tps_gpu = self.cfg.global_batch_size * self.cfg.seq_len / median / self.world
        mfu = f", MFU {self.flops_per_token * tps_gpu / self.peak * 100:.1f}%" if self.peak else ""
        unit = "gpu" if self.device.type == "cuda" else "rank"
        print(f"done: {len(self.losses)} steps in {seconds:.1f} s | loss {self.losses[0]:.4f} -> "
              f"{self.losses[-1]:.4f} | median step {median * 1e3:,.0f} ms, {tps_gpu:,.0f} tokens/s/{unit}{mfu} | "
              f"peak memory {self.metrics['mem_peak_gib']:.2f} GiB", flush=True)


def data_line(cfg: TrainConfig, dataset) -> str:
    """The header's first line: which data, which tokenizer (never chosen silently), how many tokens and
    sequences, and how many epochs the run's steps make of them."""
    used = cfg.steps * cfg.global_batch_size  # sequences the whole run reads
    whole = getattr(dataset, "dataset", dataset)  # an --eval-split Subset: the corpus it was carved from
    if dataset.num_sequences is None:
        return (f"data: synthetic (random token ids below vocab_size {dataset.vocab_size:,}; no tokenizer) | "
                f"{cfg.steps} steps x {cfg.global_batch_size} sequences of {cfg.seq_len} tokens = {used:,} sequences")
    return (f"data: {whole.source} | tokenizer: {tokenizer_origin(cfg)} ({whole.tokenizer_vocab:,} tokens) | "
            f"{whole.num_tokens:,} tokens = {dataset.num_sequences:,} sequences of {cfg.seq_len} + 1 | "
            f"{cfg.steps} steps x {cfg.global_batch_size} sequences = {used / dataset.num_sequences:.2f} epochs")


class ForwardBackward:
    """The step's forward and backward of every micro-batch, one call whichever way they run:
    (micro_batches, step) -> this rank's sum of their losses, each normalized by the trained tokens per dp rank (the
    module docstring says why). Pipelined, torch's schedule runs them; otherwise one after the other, the gradients
    accumulating (under DDP synchronized in the last one only). `evaluate(micro_batches)`: forward only, (this
    rank's summed token loss, its trained tokens).

    With MTP (train/mtp.py) each micro-batch minimizes (L_main + lambda / D * sum_k L_MTP^k) / norm; the sum returned
    is L_main's alone (the logged "loss", comparable with a run without MTP), each depth's own in `mtp_metrics`."""

    def __init__(self, cfg: TrainConfig, m: Model, mesh: ParallelMesh, device: torch.device, faults: FaultInjector,
                 experts: ExpertBalance | None, scaler, every_label_counts: bool = True):
        self.cfg, self.m, self.mesh, self.device = cfg, m, mesh, device
        self.faults, self.experts, self.scaler = faults, experts, scaler
        self.every_label_counts = every_label_counts
        self.tp = mesh.tp is not None
        self.pipe = None
        self.current = {"step": 0, "norm": 1.0, "eval": False}  # what the schedule's loss function needs
        self.depth = m.mtp_depth  # MTP depths trained (0: none)
        self.mtp_sums = torch.zeros(self.depth, device=device)  # this step's L_MTP^k, normalized, on this rank
        self.mtp_seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (L_main, L_MTP) of each schedule loss call
        if mesh.pp is not None:
            self.pipe = Pipeline(m.parts, m.stage_ids, len(m.specs), cfg.pp_schedule, cfg.grad_accum_steps,
                                 self._pipeline_loss, device, mesh.pp_group, m.seq_shards)
        # Compiled, the fp32 cast, log-softmax and gather of the [tokens, vocab] logits fuse (no fp32 copies of them).
        self.loss_fn = torch.compile(token_loss) if cfg.compile and not self.tp else token_loss
        # DDP has no mixed-precision policy of its own: autocast keeps fp32 master weights and bf16/fp16 compute.
        ddp = mesh.dims.ddp
        self.autocast = (lambda: torch.autocast(device.type, dtype=DTYPES[cfg.precision])) \
            if ddp and cfg.precision != "fp32" else nullcontext

    def _pipeline_loss(self, output, labels: torch.Tensor) -> torch.Tensor:
        if self.current["eval"]:  # evaluation runs no MTP: the last stage returns logits
            return token_loss(output, labels)
        logits, mtp_D = output if self.depth else (output, None)
        loss = self.faults.loss_hook(self.current["step"], token_loss(logits, labels) / self.current["norm"])
        if mtp_D is None:
            return loss
        # torch's schedules also call this once to infer the backward's shapes (first step): `_pipelined` keeps
        # the last grad_accum_steps entries, the micro-batches'.
        self.mtp_seen.append((loss.detach(), mtp_D.detach() / self.current["norm"]))
        return loss + self._mtp_weight(self.current["step"]) * mtp_D.sum() / self.current["norm"]

    def _mtp_weight(self, step: int) -> float:
        return mtp_flags.loss_weight(self.cfg, step) / self.depth

    def mtp_metrics(self, mesh: ParallelMesh) -> dict:
        """{"mtp_loss_1": L_MTP^1, ...} of the step just run, the same on every rank (one all-reduce; summed as
        mesh.mean_loss sums the loss); {} without MTP."""
        if not self.depth:
            return {}
        totals = self.mtp_sums.clone()
        dist.all_reduce(totals)
        values = (totals / (mesh.dims.dp * mesh.dims.tp)).tolist()
        return {f"mtp_loss_{k}": v for k, v in enumerate(values, start=1)}

    def tokens_per_rank(self, micro_batches: list) -> float:
        """The step's loss normalizer: trained labels of the global batch / dp (at least one: a step without any
        trained token then has loss 0 and no gradient instead of NaN)."""
        cfg, dp = self.cfg, self.mesh.dims.dp
        if self.every_label_counts:
            return cfg.global_batch_size * cfg.seq_len // dp
        local = sum(int((mb[1] != IGNORE_INDEX).sum()) for mb in micro_batches)
        return max(self.mesh.dp_sum(local), 1) / dp

    def __call__(self, micro_batches: list, step: int) -> torch.Tensor:
        norm = self.tokens_per_rank(micro_batches)
        self.mtp_sums.zero_()
        return self._pipelined(micro_batches, step, norm) if self.pipe else self._one_by_one(micro_batches, step, norm)

    def _batch(self, mb: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        inputs, labels, *positions = (x.to(self.device, non_blocking=True) for x in mb)
        return inputs, labels, positions[0] if positions else None

    def _pipelined(self, micro_batches: list, step: int, norm: float) -> torch.Tensor:
        self.current.update(step=step, norm=norm, eval=False)
        inputs_BT, labels_BT, positions_BT = self._batch(tuple(torch.cat(x) for x in zip(*micro_batches)))
        loss_sum = torch.zeros((), device=self.device)
        with loss_context(self.tp):
            for loss in self.pipe.step(inputs_BT, labels_BT, positions_BT, mtp=self.depth > 0):
                loss_sum += full_value(loss).detach()
        if self.depth:  # the losses above hold the MTP terms: L_main and each L_MTP^k apart instead
            seen = self.mtp_seen[-self.cfg.grad_accum_steps:] if self.pipe.has_last else []
            loss_sum = sum((full_value(main) for main, _ in seen), torch.zeros((), device=self.device))
            self.mtp_sums += sum((full_value(mtp) for _, mtp in seen), torch.zeros(self.depth, device=self.device))
            self.mtp_seen.clear()
        if self.experts is not None:
            self.experts.after_schedule()
        return loss_sum

    def _one_by_one(self, micro_batches: list, step: int, norm: float) -> torch.Tensor:
        cfg, model, scaler, ddp = self.cfg, self.m.model, self.scaler, self.mesh.dims.ddp
        loss_sum = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro_batches):
            inputs, labels, positions = self._batch(mb)
            last = i == len(micro_batches) - 1
            # Under TP the logits stay vocab-sharded: loss_parallel computes the cross-entropy without gathering them.
            with (model.no_sync() if ddp and not last else nullcontext()), self.autocast(), loss_context(self.tp):
                mtp_D = None
                if self.depth:
                    out, mtp_D = model(inputs, labels, cfg.loss_chunks, positions_BT=positions, mtp_labels_BT=labels)
                    token_losses = out if cfg.loss_chunks else self.loss_fn(out, labels)
                elif cfg.loss_chunks:
                    token_losses = model(inputs, labels, cfg.loss_chunks, positions_BT=positions)
                else:
                    token_losses = self.loss_fn(model(inputs, positions_BT=positions), labels)
                loss = self.faults.loss_hook(step, token_losses / norm)
                objective = loss
                if mtp_D is not None:
                    self.mtp_sums += full_value(mtp_D).detach() / norm
                    objective = loss + self._mtp_weight(step) * mtp_D.sum() / norm
                (scaler.scale(objective) if scaler else objective).backward()
            loss_sum += full_value(loss).detach()
            if self.experts is not None:
                self.experts.after_micro_batch()
            del token_losses, loss, objective, mtp_D
        return loss_sum

    @torch.no_grad()
    def evaluate(self, micro_batches: list) -> tuple[float, int]:
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = sum(int((mb[1] != IGNORE_INDEX).sum()) for mb in micro_batches)
        if self.pipe is not None:
            self.current["eval"] = True
            n = self.cfg.grad_accum_steps  # micro-batches per call of the schedule
            try:
                for k in range(0, len(micro_batches), n):
                    batch = self._batch(tuple(torch.cat(x) for x in zip(*micro_batches[k:k + n])))
                    with loss_context(self.tp):
                        for loss in self.pipe.eval(*batch):
                            loss_sum += full_value(loss).double()
            finally:
                self.current["eval"] = False
            return loss_sum.item(), tokens
        for mb in micro_batches:
            inputs, labels, positions = self._batch(mb)
            with self.autocast(), loss_context(self.tp):
                if self.cfg.loss_chunks:
                    loss = self.m.model(inputs, labels, self.cfg.loss_chunks, positions_BT=positions)
                else:
                    loss = self.loss_fn(self.m.model(inputs, positions_BT=positions), labels)
            loss_sum += full_value(loss).double()
        return loss_sum.item(), tokens

