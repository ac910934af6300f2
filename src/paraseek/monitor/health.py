"""Health checks run every step: NaN/Inf, loss spikes, gradient-norm explosions and stragglers.

Events are dicts in the JSONL schema of docs/design.md: {"event", "step", "rank", "detail", ...}.

Spikes use a robust z-score (Iglewicz & Hoaglin 1993, "modified z-score"): z = (x - median) / (1.4826 * MAD) over the
last `window` values. Median and MAD ignore the outliers they are looking for, where mean and standard deviation
would be dragged along by them; 1.4826 makes MAD estimate the standard deviation of normal data.
"""

from __future__ import annotations

import math
import socket
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

ACTIONS = ("warn", "skip", "stop")
_MAD_TO_SIGMA = 1.4826  # 1 / Phi^-1(3/4): MAD -> standard deviation for normal data
_MEAN_AD_TO_SIGMA = 1.2533  # sqrt(pi / 2): mean absolute deviation -> standard deviation (when MAD is 0)
_REL_FLOOR = 1e-3  # never a scale below 0.1 % of the median: a flat history must not flag rounding noise
# Wrappers that prefix parameter names: activation checkpointing, torch.compile, DDP.
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.", "_fsdp_wrapped_module.")


def robust_z(x: float, history: Sequence[float]) -> float:
    """(x - median) / (1.4826 MAD) of `history`. When MAD is 0 (more than half the values equal) the mean absolute
    deviation stands in, and the scale never drops below 0.1 % of |median|, so a constant history doesn't turn
    tiny wiggles into infinite z."""
    med = statistics.median(history)
    deviations = [abs(v - med) for v in history]
    scale = _MAD_TO_SIGMA * statistics.median(deviations)
    if scale == 0:
        scale = _MEAN_AD_TO_SIGMA * statistics.fmean(deviations)
    scale = max(scale, _REL_FLOOR * abs(med), 1e-12)
    return (x - med) / scale


class HealthMonitor:
    """Flags non-finite values, loss spikes and gradient-norm explosions from the per-step scalars (the same on every
    rank: the loss is all-reduced and the grad norm is global). Only upward jumps are anomalies: a loss that drops
    suddenly is not a problem to act on."""

    def __init__(self, window: int = 20, z_threshold: float = 6.0, min_history: int = 5):
        self.window, self.z_threshold, self.min_history = window, z_threshold, min_history
        self.history: dict[str, deque[float]] = {"loss": deque(maxlen=window), "grad_norm": deque(maxlen=window)}

    def observe(self, step: int, loss: float, grad_norm: float | None) -> list[dict[str, Any]]:
        events = []
        values = {"loss": loss, "grad_norm": grad_norm}
        bad = [f"{name} is {value}" for name, value in values.items() if value is not None and not math.isfinite(value)]
        if bad:
            return [{"event": "nan", "step": step, "rank": None, "detail": "; ".join(bad)}]
        for name, kind in (("loss", "loss_spike"), ("grad_norm", "grad_explosion")):
            value, history = values[name], self.history[name]
            if value is None:
                continue
            if len(history) >= self.min_history:
                z = robust_z(value, history)
                if z > self.z_threshold:
                    med = statistics.median(history)
                    events.append({
                        "event": kind, "step": step, "rank": None, "value": value, "median": med, "z": round(z, 1),
                        "detail": f"{name} {value:.4g} is {z:,.1f} robust sigmas above the median {med:.4g} of the "
                                  f"last {len(history)} steps",
                    })
            history.append(value)
        return events


def anomaly_action(events: list[dict[str, Any]], on_anomaly: str) -> str:
    """What the loop does about this step's events: "ok", "warn", "skip" (drop the update) or "stop".

    Only nan, loss_spike and grad_explosion count (a straggler or a hang isn't fixed by skipping a step). Under
    "warn" a NaN still stops: applying a NaN update writes NaN into every weight, so there is nothing left to warn
    about; pick "skip" to drop such steps and go on."""
    kinds = {e["event"] for e in events} & {"nan", "loss_spike", "grad_explosion"}
    if not kinds:
        return "ok"
    if on_anomaly == "warn" and "nan" in kinds:
        return "stop"
    return on_anomaly


def param_group(name: str) -> str:
    """'layers.3.mlp.experts.gate_proj' -> 'layers.3.mlp'; 'norm.weight' -> 'norm' (wrapper prefixes removed)."""
    for prefix in _WRAPPERS:
        name = name.replace(prefix, "")
    parts = name.split(".")
    if len(parts) >= 3 and parts[0] in ("layers", "mtp") and parts[1].isdigit():
        return ".".join(parts[:3])
    return ".".join(parts[:-1]) or name


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def nonfinite_report(model: torch.nn.Module, *, all_ranks: bool = False) -> str | None:
    """Name the first parameter (in model order) whose gradient holds NaN or Inf, with its group, or None.

    Looks at this rank's shard of each gradient (DTensor grads via to_local). With all_ranks=True (a collective: every
    rank must call it) the ranks agree on the first affected parameter over all shards, so a NaN in a shard held
    by another rank is still found."""
    names, first, affected = [], None, 0
    for i, (name, p) in enumerate(model.named_parameters()):
        names.append(name)
        if p.grad is None:
            continue
        g = _local(p.grad)
        if g.numel() and not bool(torch.isfinite(g).all()):
            affected += 1
            if first is None:
                first = i
    if all_ranks and dist.is_available() and dist.is_initialized():
        device = _collective_device()
        t = torch.tensor([len(names) if first is None else first], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        first = None if int(t) == len(names) else int(t)
    if first is None:
        return None
    name = names[first]
    for prefix in _WRAPPERS:
        name = name.replace(prefix, "")
    where = "" if all_ranks else f"; {affected} of {len(names)} parameters on this rank"
    return f"first non-finite gradient in {param_group(name)} ({name}{where})"


class StragglerDetector:
    """A rank that is the slowest in at least `min_hits` of the last `window` steps, each time by more than
    `slow_ratio` x the median of the other ranks, is a straggler. Reported once per rank."""

    def __init__(self, world: int, window: int = 5, slow_ratio: float = 1.3, min_hits: int = 3):
        self.world, self.window, self.slow_ratio, self.min_hits = world, window, slow_ratio, min_hits
        self.hits: deque[int | None] = deque(maxlen=window)  # per step: the rank that was slow, or None
        self.reported: set[int] = set()

    def observe(self, step: int, step_times: Sequence[float], hosts: Sequence[str] | None = None) -> dict | None:
        if len(step_times) < 2:
            return None
        slowest = max(range(len(step_times)), key=step_times.__getitem__)
        others = statistics.median(t for r, t in enumerate(step_times) if r != slowest)
        slow = step_times[slowest] > self.slow_ratio * others
        self.hits.append(slowest if slow else None)
        count = sum(1 for r in self.hits if r == slowest)
        if not slow or count < self.min_hits or slowest in self.reported:
            return None
        self.reported.add(slowest)
        host = hosts[slowest] if hosts else "?"
        ratio = step_times[slowest] / others if others > 0 else math.inf
        return {
            "event": "straggler", "step": step, "rank": slowest, "host": host,
            "detail": f"rank {slowest} (host {host}) was the slowest in {count} of the last {len(self.hits)} steps: "
                      f"{step_times[slowest] * 1e3:,.0f} ms vs a median of {others * 1e3:,.0f} ms on the other ranks "
                      f"({ratio:.1f}x)",
        }


def step_time_stats(times: Sequence[float]) -> dict[str, Any]:
    return {
        "step_time_min_s": min(times), "step_time_median_s": statistics.median(times),
        "step_time_max_s": max(times), "slowest_rank": max(range(len(times)), key=times.__getitem__),
    }


def own_step_times(step_times: Sequence[float], ready_times: Sequence[float]) -> list[float]:
    """Per-rank step time without the wait for the other ranks at the step's first collective.

    In synchronous training every rank's wall step time is the same: ranks that reach the first collective early
    wait there for the last one. ready_times[r] is when rank r reached it (seconds since its own step start), so it
    waited max(ready) - ready[r]; what is left is the step as it would have run on r alone. This sees host-side
    stragglers (data loading, GC, a busy CPU, `slow@RANK:MS`); a GPU that is slow in its kernels makes others wait
    inside later collectives instead, which the profiler (--profile-steps) shows."""
    last = max(ready_times)
    return [max(0.0, t - (last - ready)) for t, ready in zip(step_times, ready_times, strict=True)]


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_floats(values: Sequence[float]) -> list[list[float]]:
    """All-gather a few floats from every rank (one small collective): result[rank] = that rank's values."""
    local = torch.tensor(list(values), dtype=torch.float64, device=_collective_device())
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return [t.tolist() for t in out]


def gather_step_times(local_time: float, ready_s: float | None = None) -> list[float]:
    """Every rank's step time (a collective). With ready_s (seconds from this rank's step start to its first
    collective) the result is own_step_times: the wait for slower ranks taken out, so the straggler stands out."""
    if ready_s is None:
        return [row[0] for row in gather_floats([local_time])]
    rows = gather_floats([local_time, ready_s])
    return own_step_times([r[0] for r in rows], [r[1] for r in rows])


def gather_hosts() -> list[str]:
    """Every rank's host name (a collective; call once at start-up)."""
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts


def log_event(logger: Any, event: dict[str, Any]) -> None:
    """Write an event dict through MetricsLogger.event."""
    extra = {k: v for k, v in event.items() if k not in ("event", "step", "rank", "detail")}
    logger.event(event["event"], event["step"], event.get("rank"), event.get("detail", ""), **extra)


def format_event(event: dict[str, Any], action: str = "warn") -> str:
    """One console line for an event, e.g. "paraseek: warning: step 12: loss_spike: loss 812 is ... (skipped)"."""
    what = {"skip": " (update skipped)", "stop": " (stopping)"}.get(action, "")
    return f"paraseek: warning: step {event['step']}: {event['event']}: {event.get('detail', '')}{what}"
