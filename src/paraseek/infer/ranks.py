"""One process per GPU for the engine commands (tp x dp, or ep x dp): where each process sits, the checks of the
layout against the model and the GPUs, the relaunch of a command as its ranks, and the process groups they join."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any

from paraseek.errors import UserError
from paraseek.infer.flags import lora_enabled
from paraseek.launcher import failed_first, run_ranks, threads_per_rank

WORKER_ENV = "PARASEEK_INFER_WORKER"  # set in the ranks a command starts (relaunch, launcher.spawn): "1"


@dataclass
class Placement:
    """Where this process sits: its replica and tp rank, the device, the groups (None when alone)."""

    rank: int = 0
    world: int = 1
    replica: int = 0
    tp_rank: int = 0
    device: str = "cpu"
    tp_group: Any = None
    meta_group: Any = None  # gloo, for the driver's step broadcast and small host-side collectives
    world_gloo: Any = None

    @property
    def driver(self) -> bool:
        return self.tp_rank == 0


def device_for(ns: argparse.Namespace) -> str:
    import torch

    if ns.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible")
    return "cuda" if ns.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"


def replica_gpus(ns: argparse.Namespace) -> int:
    """GPUs (processes) of one model replica: --tp's or --ep's, the same ones when both are given."""
    from paraseek.infer.ep import model_ranks

    return model_ranks(ns.tp, getattr(ns, "ep", 1))


def check_parallel(ns: argparse.Namespace, args, device: str) -> None:
    from paraseek.infer.ep import check_ep
    from paraseek.infer.tp import check_tp

    if getattr(ns, "quantization", "auto") == "fp8" and device == "cuda":
        import torch

        from paraseek.infer.fp8 import has_fp8

        if not has_fp8(device):
            major, minor = torch.cuda.get_device_capability()
            raise UserError(f"--quantization fp8: {torch.cuda.get_device_name()} (sm{major}{minor}) has no FP8 "
                            "tensor cores (they start at compute capability 8.9: L40S, H100, H200); leave out "
                            "--quantization to serve in --dtype")
    if ns.dp < 1:
        raise UserError(f"--dp must be >= 1, got {ns.dp}")
    ep = getattr(ns, "ep", 1)
    check_ep(args, ns.tp, ep)
    check_tp(args, ns.tp, ep)
    if getattr(ns, "dp_attention", False):
        if ep < 2:
            raise UserError("--dp-attention needs --ep N with N > 1: it spreads the requests over the expert-parallel "
                            "GPUs, each running attention for its own")
        if ns.tp > 1:
            raise UserError(f"--dp-attention with --tp {ns.tp}: attention runs at tp 1 under --dp-attention (each GPU "
                            "its own requests); leave out --tp")
        if getattr(ns, "speculative", None):
            raise UserError("--dp-attention with --speculative is not supported: leave one of them out")
    if ep > 1 and lora_enabled(ns):
        raise UserError(f"--ep {ep} with LoRA adapters: adapters are served with --tp only; leave out --ep")
    if device == "cuda":
        import torch

        n = torch.cuda.device_count()
        if replica_gpus(ns) * ns.dp > n:
            what = f"--ep {ep}" if ep > ns.tp else f"--tp {ns.tp}"
            raise UserError(f"{what} x --dp {ns.dp} = {replica_gpus(ns) * ns.dp} GPUs, but {n} "
                            f"{'is' if n == 1 else 'are'} visible")


def relaunch(nproc: int, argv: list[str]) -> int:
    """Run this very command again as `nproc` ranks (one per GPU) through torch's launcher (launcher.run_ranks)."""
    os.environ[WORKER_ENV] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", threads_per_rank(nproc))
    failure = run_ranks([f"--nproc-per-node={nproc}", "--standalone", "-m", "paraseek", *argv])
    if failure is None:
        return 0
    if 2 in {f.exitcode for f in failure.failures.values()}:
        return 2
    rank, first = failure.get_first_failure()
    print(f"paraseek: {failed_first(rank, first.exitcode)}", file=sys.stderr)
    return 1


def place(ns: argparse.Namespace, device: str) -> Placement:
    """Join the process group when launched as one of several processes; a replica's tp/ep ranks are consecutive."""
    if os.environ.get(WORKER_ENV) != "1" or "RANK" not in os.environ:
        return Placement(device=device)
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if device == "cuda":
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        device = f"cuda:{local}"
    else:
        dist.init_process_group("gloo")
    tp = replica_gpus(ns)  # the replica's ranks: its group carries tp's and ep's collectives alike
    pl = Placement(rank, world, rank // tp, rank % tp, device)
    pl.world_gloo = dist.new_group(backend="gloo") if device != "cpu" else dist.group.WORLD
    for r in range(world // tp):  # every rank creates every group, in the same order
        ranks = list(range(r * tp, (r + 1) * tp))
        g = dist.new_group(ranks)
        mg = dist.new_group(ranks, backend="gloo") if device != "cpu" else g
        if r == pl.replica:
            pl.tp_group, pl.meta_group = (g, mg) if tp > 1 else (None, None)
    return pl


def finish(rc: int, pl: Placement) -> int:
    """`rc`, after every rank has reached the end and left its process groups. A rank of several exits here, as
    train/worker.py does: gloo's threads occasionally abort the interpreter's teardown ("terminate called without an
    active exception", signal 6) after all work and output is done."""
    if pl.world > 1:
        import torch.distributed as dist

        dist.barrier(group=pl.world_gloo)
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc
