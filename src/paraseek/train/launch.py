"""`paraseek train`: validate in the parent, then re-launch through torch's own launcher (torch.distributed.run)
with N processes per node, each running train/worker.py, which reads the resolved config from the environment (so
every rank runs exactly the same configuration, and no worker parses arguments again).

Signals: torch's agent starts each worker in a session of its own, so a Ctrl-C in the terminal reaches only this
process. It passes SIGINT/SIGTERM on to the workers (they finish the step, save, exit 130/143: train/stop.py) and
exits with their code; a second Ctrl-C kills them at once. torch's agent would pass the first one on too, but kill
the workers 30 s later (TORCH_ELASTIC_SHUTDOWN_TIMEOUT), in the middle of a large save, and leave them running when
a second Ctrl-C interrupts its wait -- so SIGINT and SIGTERM are taken from it here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

from paraseek.errors import UserError
from paraseek.launcher import failed_first, run_ranks, threads_per_rank
from paraseek.train.config import TrainConfig, config_toml, resolve_defaults
from paraseek.train.flags import from_namespace
from paraseek.train.validate import check_profile_window, validate
from paraseek.train.stop import ARGV_ENV
from paraseek.train.worker import CONFIG_ENV


GLIBC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"


def worker_env(cfg: TrainConfig) -> dict[str, str]:
    """What the launcher adds to its workers' environment where the user has not set it."""
    from paraseek.monitor.progress import flight_recorder_env

    # Share the cores between processes instead of oversubscribing them (and silence torchrun's warning).
    env = {"OMP_NUM_THREADS": threads_per_rank(cfg.nproc)}
    env.update(flight_recorder_env(cfg.run_dir))  # Flight Recorder on, dumps into RUN_DIR
    if cfg.device == "cuda":
        # Fewer fragmentation OOMs on long or variable sequences (the fix CUDA_LAUNCH_BLOCKING is not).
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        # FSDP2's reduce-scatter copy-in (aten::_chunk_cat) builds host metadata of one int64 per 2 KiB of gradient,
        # megabytes per block per step. After a fresh torch.compile, glibc served those from new mmaps (page faults
        # on every call): V2-Lite-12 at mbs 1 ran 0.31-0.43 s a step instead of 0.23. Kept on the heap below 32 MiB
        # and not trimmed back, it runs at 0.23 from a fresh compile too (docs/train.md, "Host settings of the GPU
        # workers", and its raw files).
        env["GLIBC_TUNABLES"] = GLIBC_TUNABLES
    return env


def cmd_train(ns: argparse.Namespace) -> int:
    cfg = from_namespace(ns)  # a mistake in a flag or the TOML file costs no torch import (4 s on a small machine)
    if ns.slurm:
        return print_slurm_script(cfg, ns.argv[1:])
    import torch

    os.environ[ARGV_ENV] = json.dumps(ns.argv)  # for the resume command a stopped run prints
    cuda = torch.cuda.is_available() and cfg.device != "cpu"
    gpus = torch.cuda.device_count() if cuda else 0
    if "LOCAL_RANK" in os.environ:  # started by torchrun (or another launcher) directly: one worker of many
        local, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
        cfg.nproc, cfg.nnodes = local, world // local
        first = os.environ.get("RANK", "0") == "0"
        try:
            cfg = resolve_defaults(cfg, cuda, gpus)
            validate(cfg, cuda, gpus)
            check_steps(cfg, _check_checkpoint_dir(cfg, owner=first))
        except UserError as e:
            if first:
                print(f"paraseek: error: {e}", file=sys.stderr, flush=True)
            return 2
        except NothingToTrain as e:
            if first:
                print(f"paraseek: {e}", file=sys.stderr, flush=True)
            return 0
        from paraseek.train.worker import run

        run(cfg)  # does not return: the worker exits with the run's code
    if ns.print_config:
        print(config_toml(prepare(cfg, open_data=False)[0]), end="")
        return 0
    try:
        cfg, _ = prepare(cfg)
    except NothingToTrain as e:
        print(f"paraseek: {e}", file=sys.stderr, flush=True)
        return 0
    return launch(cfg)


def print_slurm_script(cfg: TrainConfig, argv: list[str]) -> int:
    """--slurm: the sbatch script of this run, checked as on one of its nodes (--nproc GPUs there, none needed here:
    the script is usually written on a login node)."""
    from paraseek.train.multinode import slurm_flags, slurm_script

    if not cfg.nproc:
        raise UserError("--slurm needs --nproc (processes, usually GPUs, per node) to check the plan")
    node = resolve_defaults(dataclasses.replace(cfg, device=cfg.device or "cuda"), True, cfg.nproc)
    script = slurm_script(node, slurm_flags(argv))
    validate(node, node.device == "cuda", node.nproc, nodes=False)  # the script sets the node flags per node
    print(script, end="")
    return 0


def prepare(cfg: TrainConfig, with_prediction: bool = False, open_data: bool = True) -> tuple[TrainConfig, dict | None]:
    """Everything before the launch, in the parent: machine defaults, --plan auto, validation, model and data
    checks (`open_data`: tokenize the corpus into its cache, then the checkpoint folder and the steps left: a
    --resume of a run that is done raises NothingToTrain). With `with_prediction`, also the planner's prediction
    for the plan (None off CUDA or on an unknown GPU)."""
    import torch

    cuda = torch.cuda.is_available() and cfg.device != "cpu"
    gpus = torch.cuda.device_count() if cuda else 0
    cfg = resolve_defaults(cfg, cuda, gpus)
    if cfg.plan == "auto":
        cfg = apply_auto_plan(cfg)
    validate(cfg, cuda, gpus)
    if open_data:
        _check_data(cfg)
        check_steps(cfg, _check_checkpoint_dir(cfg))
    return cfg, (_predict(cfg) if with_prediction and cuda else None)


class NothingToTrain(Exception):
    """A --resume of a run whose checkpoint is at --steps already: the command ends with exit code 0 and this line."""


def check_steps(cfg: TrainConfig, start: int) -> None:
    """The steps a run resumed at `start` trains, start + 1 .. --steps, against what needs them: none left is
    NothingToTrain (unless --export-hf is still to be written), and --profile-steps must lie inside them."""
    if start >= cfg.steps and not cfg.export_hf:
        raise NothingToTrain(f"--resume: {cfg.checkpoint_dir} holds step {start} and --steps is {cfg.steps}: nothing "
                             f"left to train (raise --steps to train on; `paraseek export {cfg.checkpoint_dir} OUT` "
                             f"writes the model)")
    check_profile_window(cfg, start)


def _check_checkpoint_dir(cfg: TrainConfig, owner: bool = True) -> int:
    """checkpoint.prepare_checkpoint_dir with this model's parameter names and shapes from a meta-device build (no
    memory), printing from one process only; the step the run continues from (0: a fresh start)."""
    if not cfg.checkpoint_dir and not cfg.overwrite:
        return 0  # nothing to check (and torch's DCP stays unimported: a second of the launcher's start)
    from paraseek.train.checkpoint import prepare_checkpoint_dir

    def shapes() -> dict[str, tuple[int, ...]]:
        import torch

        from paraseek.models import resolve_model
        from paraseek.models.deepseek import Transformer

        args, _, _ = resolve_model(cfg.init_from or cfg.model)
        with torch.device("meta"):
            model = Transformer(args)
        if not cfg.lora_rank:
            return {name: tuple(t.shape) for name, t in model.state_dict().items()}
        from paraseek.models.lora import apply_lora, is_adapter

        # A LoRA checkpoint holds the adapters only (the base is the --init-from folder).
        apply_lora(model, cfg.lora_for(args))
        return {name: tuple(t.shape) for name, t in model.state_dict().items() if is_adapter(name)}

    say = (lambda line: print(line, flush=True)) if owner else (lambda line: None)
    warn = (lambda line: print(f"paraseek: warning: --resume: {line}", file=sys.stderr, flush=True)) if owner \
        else None
    return prepare_checkpoint_dir(cfg, shapes, owner=owner, log=say, warn=warn)


def _predict(cfg: TrainConfig) -> dict | None:
    import torch

    from paraseek.hardware.specs import spec_for_device_name
    from paraseek.models import resolve_model
    from paraseek.planner import evaluate, make_cluster
    from paraseek.planner.plan import PP_SCHEDULES

    spec = spec_for_device_name(torch.cuda.get_device_name(0))
    if spec is None:
        return None
    args, _, _ = resolve_model(cfg.init_from or cfg.model)
    if cfg.pp > 1 and cfg.pp_schedule not in PP_SCHEDULES:
        return None  # a schedule the planner does not price
    return prediction(evaluate(args, make_cluster(spec.name, cfg.world_size, gpus_per_node=cfg.nproc), cfg.to_plan(),
                               cfg.seq_len, cfg.global_batch_size))


def prediction(ev) -> dict:
    """A planner evaluation (planner.search.Evaluated) as `paraseek bench` reports it beside the measurement."""
    return {"memory_gib": ev.memory.total / 2**30, "tokens_per_s_per_gpu": ev.tokens_per_s_per_gpu,
            "step_time_s": ev.time.total if ev.time else None, "fits": not ev.reason,
            "memory_breakdown_gib": {k: v / 2**30 for k, v in ev.memory.items.items()},
            "step_time_breakdown_s": dict(ev.time.items) if ev.time else {}}


def apply_auto_plan(cfg: TrainConfig) -> TrainConfig:
    """--plan auto: the planner's first-ranked plan for this machine (or --hardware's profile) that the engine runs
    (with memory headroom if any, then the fastest; compiled where the engine compiles); its flags, prediction and
    the one-line reason for it are printed so the run can be compared with them."""
    import torch

    from paraseek.hardware.specs import spec_for_device_name
    from paraseek.models import resolve_model
    from paraseek.planner import best_plan, load_profile, make_cluster
    from paraseek.planner.search import explain

    args, _, _ = resolve_model(cfg.init_from or cfg.model)
    if cfg.hardware:
        cluster = load_profile(cfg.hardware, n_gpus=cfg.world_size)
    else:
        if cfg.device != "cuda":
            raise UserError("--plan auto plans for GPUs; on CPU give --dp-replicate/--dp-shard yourself")
        spec = spec_for_device_name(torch.cuda.get_device_name(0))
        if spec is None:
            raise UserError(f"--plan auto: no datasheet for {torch.cuda.get_device_name(0)!r}; "
                            "give a profile with --hardware (paraseek doctor --save PROFILE.json)")
        cluster = make_cluster(spec.name, cfg.world_size, gpus_per_node=cfg.nproc)
    best = best_plan(args, cluster, cfg.seq_len, cfg.global_batch_size, document_mask=cfg.doc_mask == "true",
                     fp8=cfg.fp8, fp8_experts=cfg.fp8_experts == "on", lora=cfg.lora_for(args))
    p = best.plan
    cfg = cfg.with_plan(p)
    print(f"plan auto: {' '.join(p.flags())} | predicted {best.memory.total / 2**30:.1f} GiB/GPU, "
          f"{best.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {best.mfu * 100:.1f}%", flush=True)
    print(f"plan auto: why: {explain(args, cluster, best, cfg.seq_len, cfg.global_batch_size)}", flush=True)
    return cfg


def _check_data(cfg: TrainConfig) -> None:
    """Open the data in the parent: a mistake costs one line and no processes, and a corpus is tokenized once here
    (with a progress bar) into the cache the workers then read. (validate has checked the model and the plan.)"""
    from paraseek.models import resolve_model
    from paraseek.train.dataset import open_training_data

    if cfg.data != "synthetic" or cfg.eval_data or cfg.eval_split:  # (an --eval-split of synthetic data is refused)
        args, _, _ = resolve_model(cfg.init_from or cfg.model)
        train, held_out = open_training_data(cfg, args.vocab_size)
        for what, ds in (("data", getattr(train, "dataset", train)), ("eval data", held_out)):
            if getattr(ds, "summary", ""):  # synthetic data and an --eval-split carve-out have none of their own
                print(f"{what}: {ds.summary}", flush=True)
        if held_out is not None:
            held = f" held out of --data (--eval-split {cfg.eval_split})" if cfg.eval_split else ""
            when = f"every {cfg.eval_every} steps and after the last" if cfg.eval_every else "after the last step"
            print(f"evaluation: {held_out.num_sequences:,} windows{held}, {when}", flush=True)


def launch(cfg: TrainConfig) -> int:
    """The workers of every rank of this node, through torch's launcher (launcher.run_ranks); the run's exit code."""
    argv = [f"--nproc-per-node={cfg.nproc}"]
    if cfg.nnodes == 1:
        argv.append("--standalone")
    else:
        from paraseek.train.multinode import join_nodes

        # Every node's launcher is here, or one line names the node that did not come. Node 0's store must stay
        # alive through run(): torch's rendezvous below shares it.
        nodes_store = join_nodes(cfg)  # noqa: F841
        argv += [f"--nnodes={cfg.nnodes}", f"--node-rank={cfg.node_rank}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={cfg.rdzv_endpoint}", f"--rdzv-conf=join_timeout={math.ceil(cfg.rdzv_timeout)}"]
    argv += ["--signals-to-handle=SIGHUP,SIGQUIT", "-m", "paraseek.train.worker"]  # SIGINT, SIGTERM: _PassOn
    os.environ[CONFIG_ENV] = json.dumps(dataclasses.asdict(cfg))
    for key, value in worker_env(cfg).items():
        os.environ.setdefault(key, value)  # the user's own settings win
    passer = _PassOn(bool(cfg.checkpoint_dir))
    previous = {signum: signal.signal(signum, passer) for signum in (signal.SIGINT, signal.SIGTERM)}
    started = time.time()
    try:
        failure = run_ranks(argv)
        return 0 if failure is None else _failed(cfg, failure, passer.signum, started)
    except KeyboardInterrupt:  # a second Ctrl-C (the workers are killed), or a signal before any worker started
        print("paraseek: stopped at once; the step in progress was not saved", file=sys.stderr)
        return 128 + (passer.signum or signal.SIGINT)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _worker_pids() -> list[int]:
    """The worker processes this launcher started (torch's agent runs them as its children)."""
    me, pids = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after "pid (comm)": state, ppid, ...
            if ppid == me and b"paraseek.train.worker" in (stat.parent / "cmdline").read_bytes():
                pids.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # a process that ended while we looked
    return pids


class _PassOn:
    """The launcher's SIGINT/SIGTERM handler: the first signal goes on to the workers; a second SIGINT kills them
    (KeyboardInterrupt then ends torch's agent, which finds them gone)."""

    def __init__(self, saves: bool):
        self.signum, self.saves = 0, saves

    def __call__(self, signum: int, frame) -> None:
        pids = _worker_pids()
        if (self.signum and signum == signal.SIGINT) or not pids:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            self.signum = self.signum or signum
            raise KeyboardInterrupt
        if self.signum:
            return  # a second SIGTERM: the workers are stopping already
        self.signum = signum
        for pid in pids:
            os.kill(pid, signum)
        then = "saves it and stops" if self.saves else "stops (no --checkpoint-dir: nothing will be saved)"
        # os.write: print() may be in the middle of a line when the signal comes
        os.write(2, f"paraseek: {signal.Signals(signum).name}: every rank finishes the step it is in, {then}; "
                    f"Ctrl-C again to stop at once\n".encode())


def _failed(cfg: TrainConfig, e, signum: int, started: float) -> int:
    """The launcher's exit code for failed workers, and the one line when no worker printed it: a user error (2,
    printed by rank 0), a stop on SIGINT/SIGTERM (130/143, rank 0 printed the resume command), a rank killed by a
    signal (the crash report it could not write goes to RUN_DIR/errors/), a crash (printed by the rank), ranks that
    lost a peer on another node, else the first failure's exit code and what `paraseek diagnose` makes of it."""
    from paraseek.monitor.progress import PEER_LOST, REPORTED, killed_message, record_killed

    codes = {rank: f.exitcode for rank, f in e.failures.items()}
    if 2 in codes.values():
        return 2
    if set(codes.values()) <= {130, 143}:
        return 128 + signum if signum else max(codes.values())
    # SIGKILL is what the out-of-memory killer sends (other signals, e.g. NCCL's watchdog's SIGABRT, are left to the
    # diagnosis below: that one is a hang).
    killed = sorted((f.timestamp, rank) for rank, f in e.failures.items() if f.exitcode == -signal.SIGKILL)
    if killed:
        report = record_killed(cfg.run_dir, killed[0][1], signal.SIGKILL, since=started)
        print(f"paraseek: {killed_message(report)}; the job was stopped on all ranks", file=sys.stderr)
        return 1
    if REPORTED in codes.values():
        return 1  # the first failing worker printed the cause in one line
    if set(codes.values()) == {PEER_LOST}:
        print(f"paraseek: rank {min(codes)} lost its connection to the other ranks: a rank of another node died "
              f"(that node's output, or `paraseek diagnose` of the run folder, names it)", file=sys.stderr)
        return 1
    rank, failure = e.get_first_failure()
    print(f"paraseek: {failed_first(rank, failure.exitcode)}", file=sys.stderr)
    # A worker killed before it could report (NCCL's watchdog aborts on a timeout): the progress records and
    # Flight Recorder dumps in the run folder still say who did not reach which step.
    from paraseek.monitor.diagnose import diagnose

    try:
        verdict = diagnose(cfg.run_dir)
    except UserError:  # no run folder was written
        return 1
    if verdict.get("verdict") not in (None, "ok", "interrupted", "stopped"):
        print(f"paraseek: {verdict['message']}", file=sys.stderr)
    return 1


def register(subparsers: argparse._SubParsersAction) -> None:
    from paraseek.train.flags import add_arguments

    p = subparsers.add_parser(
        "train", help="train a model on torch.distributed (FSDP2 / HSDP / DDP, TP, PP, EP), one node or many",
        description="Train a preset or HF model with data parallelism (FSDP2 per block, HSDP, or DDP with gradient "
        "compression), tensor + sequence parallelism (--tp), pipeline stages cut by cost (--pp, torch's schedules), "
        "expert parallelism (--ep), or the planner's fastest plan (--plan auto); checkpoints (torch DCP, resumable "
        "under another layout), HF import/export and per-step metrics. The plan is checked before anything starts, "
        "then the command re-launches itself through torch.distributed.run with --nproc processes.",
    )
    add_arguments(p)
    p.add_argument("--print-config", action="store_true",
                   help="print the configuration this run would use (the TOML file, the flags and this machine's "
                   "defaults merged, as TOML that --config reads back) and exit")
    p.add_argument("--slurm", action="store_true",
                   help="print an sbatch script that runs this training on --nnodes nodes (one launcher per node, "
                   "requeued on preemption and continued with --resume) and exit")
    p.set_defaults(func=cmd_train)
