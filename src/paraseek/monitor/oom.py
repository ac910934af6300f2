"""CUDA out-of-memory: keep the evidence (an allocator snapshot) and say the cheapest change that fits, from the
planner's memory model of this run's plan."""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path

import torch

from paraseek.models import ModelArgs


def write_snapshot(run_dir: str | Path, rank: int) -> Path | None:
    """The allocator's segments and blocks at the moment of the OOM (torch.cuda.memory._snapshot; viewable at
    pytorch.org/memory_viz). None when there is no CUDA."""
    if not torch.cuda.is_available():
        return None
    path = Path(run_dir) / f"oom_snapshot_rank{rank}.pickle"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(torch.cuda.memory._snapshot()))
    return path


def cheapest_fix(args: ModelArgs, cfg, gpu_name: str) -> str:
    """The planner's breakdown of the plan that ran out of memory (`cfg.to_plan()`: every degree, pp included) and,
    among the changes the engine can make on the same GPUs (more checkpointing, a smaller micro-batch, more sharding,
    CPU offload), the predicted-fastest that fits and that the engine runs (ParallelDims' rules)."""
    from paraseek.hardware.specs import spec_for_device_name
    from paraseek.planner import evaluate, make_cluster

    spec = spec_for_device_name(gpu_name)
    if spec is None:
        return f"no datasheet for {gpu_name!r}: run `paraseek plan` with a --hardware profile for advice"
    cluster = make_cluster(spec.name, cfg.world_size, gpus_per_node=cfg.nproc)
    plan = cfg.to_plan()
    now = evaluate(args, cluster, plan, cfg.seq_len, cfg.global_batch_size)
    top = sorted(now.memory.items.items(), key=lambda kv: -kv[1])[:4]
    lines = [f"predicted {now.memory.total / 2**30:.1f} GiB/GPU for this plan: "
             + ", ".join(f"{k.replace('_', ' ')} {v / 2**30:.1f}" for k, v in top)]
    # Every combination of the changes the engine can make on the same GPUs; the fastest that fits wins, reported
    # as the flags that differ from this run.
    mbs_options = sorted({cfg.micro_batch_size} | {m for m in (1, 2, 4, 8) if m < cfg.micro_batch_size})
    dp_options = [(cfg.dp_replicate, cfg.dp_shard)] + ([(1, cfg.dp_shard * cfg.dp_replicate)] if cfg.dp_replicate > 1 else [])
    best = None
    for ac in ("none", "selective", "full"):
        for mbs in mbs_options:
            for offload in (cfg.cpu_offload, True):
                for reshard in (cfg.reshard_after_forward, True):
                    for rep, shard in dp_options:
                        alt = replace(plan, activation_checkpointing=ac, micro_batch_size=mbs, cpu_offload=offload,
                                      reshard_after_forward=reshard, dp_replicate=rep, dp_shard=shard)
                        if alt == plan or cfg.global_batch_size % (mbs * rep * shard) or alt.problem(
                                args, cfg.seq_len, alt.n_microbatches(cfg.global_batch_size), cpu_offload=offload,
                                compile=cfg.compile, precision=cfg.precision):
                            continue
                        ev = evaluate(args, cluster, alt, cfg.seq_len, cfg.global_batch_size)
                        if not ev.reason and (best is None or ev.tokens_per_s_per_gpu > best.tokens_per_s_per_gpu):
                            best = ev
    if best is not None:
        now_flags, best_flags = plan.flags(), best.plan.flags()
        flags = [f for f in best_flags if f not in now_flags]
        if "--reshard-after-forward false" in now_flags and "--reshard-after-forward false" not in best_flags:
            flags.append("--reshard-after-forward true")
        lines.append(f"cheapest fix: {' '.join(flags)} (predicted {best.memory.total / 2**30:.1f} GiB/GPU, "
                     f"{best.tokens_per_s_per_gpu:,.0f} tokens/s/GPU); `paraseek plan` lists every option")
    else:
        lines.append("nothing fits these GPUs with this model and batch: `paraseek plan` shows plans with more GPUs")
    return "\n".join(lines)
