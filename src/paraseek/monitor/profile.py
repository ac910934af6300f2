"""`--profile-steps A:B`: torch.profiler traces of steps A..B per rank, and where the time went.

The summary splits the profiled span of each rank into compute, communication, their overlap and idle time:

    busy = compute U comm        overlap = compute n comm        idle = span - busy

as interval unions over the trace's events (so nested or concurrent events are not counted twice). On GPUs the events
are the device's kernels and copies (compute and NCCL kernels run on different streams, so they can overlap; idle is
the GPU waiting: launch gaps, host stalls, the pipeline bubble). On CPU runs they are the CPU operators plus the
collectives' record_functions (gloo's worker threads, FSDP's all-gathers); an operator that encloses a collective
counts as communication for that span, since the thread waits there. On GPUs the summary also says what the host
was in while the GPU idled (each CPU event's own time inside the idle intervals): a host-bound step names its cause.

Traces go to RUN_DIR/profile/rank{R}.json (chrome://tracing, Perfetto) with the summary next to it.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from paraseek.errors import UserError

Interval = tuple[float, float]  # (start, end), microseconds as in the trace
# Collectives by name: NCCL kernels (ncclDevKernel_AllGather_...), c10d ops (c10d::allreduce_), gloo and FSDP's
# record_functions. Not bare "broadcast"/"send": aten::broadcast_tensors is compute.
COMM = re.compile(r"nccl|gloo|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|c10d|record_param_comms",
                  re.IGNORECASE)
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
# What the host thread was in: operators, CUDA runtime calls (launches, syncs, mallocs), record_functions.
HOST_CATS = {"cpu_op", "cuda_runtime", "cuda_driver", "user_annotation"}
STEP_MARK = "ProfilerStep#"
TOP = 10


def parse_profile_steps(spec: str) -> tuple[int, int]:
    """'5:7' -> (5, 7); '5' -> (5, 5)."""
    first, _, last = spec.partition(":")
    try:
        a, b = int(first), int(last or first)
    except ValueError:
        a = b = 0
    if not 1 <= a <= b:
        raise UserError(f"--profile-steps {spec!r}: expected A:B, the first and last step to profile (1 <= A <= B)")
    return a, b


# -- interval math ------------------------------------------------------------------------------------------------

def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(intervals: Iterable[Interval]) -> float:
    return sum(e - s for s, e in union(intervals))


def intersect(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Points of a that are not in b."""
    b = union(b)
    out = []
    for s, e in union(a):
        cur = s
        for bs, be in b:
            if be <= cur or bs >= e:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
            if cur >= e:
                break
        if cur < e:
            out.append((cur, e))
    return out


# -- trace summary ------------------------------------------------------------------------------------------------

def _self_intervals(events: list[dict[str, Any]]) -> dict[int, list[Interval]]:
    """Where each CPU event runs itself: its span minus its direct children's, by nesting within a thread."""
    children: dict[int, list[Interval]] = defaultdict(list)
    by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():
        stack: list[dict[str, Any]] = []
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                children[id(stack[-1])].append((e["ts"], e["ts"] + e["dur"]))
            stack.append(e)
    return {id(e): subtract([(e["ts"], e["ts"] + e["dur"])], children[id(e)]) for e in events}


def _host_during_idle(host: list[dict[str, Any]], idle: list[Interval]) -> list[dict[str, Any]]:
    """What the host was doing while the GPU idled: each CPU event's own time inside the idle intervals, summed by
    name (the innermost event gets it, so an op that waits in cudaStreamSynchronize shows as the sync), plus the idle
    time no event covers ("(no op: Python)")."""
    own = _self_intervals(host)
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in host:
        t = length(intersect(own[id(e)], idle))
        if t > 0:
            total[e["name"]] += t
            count[e["name"]] += 1
    uncovered = length(subtract(idle, [(e["ts"], e["ts"] + e["dur"]) for e in host]))
    if uncovered > 0:
        total["(no op: Python)"], count["(no op: Python)"] = uncovered, 0
    names = sorted(total, key=total.__getitem__, reverse=True)[:TOP]
    return [{"name": n, "total_ms": total[n] / 1e3, "count": count[n]} for n in names]


def _top(events: list[dict[str, Any]], weights: dict[int, float] | None = None) -> list[dict[str, Any]]:
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in events:
        total[e["name"]] += weights[id(e)] if weights else e["dur"]
        count[e["name"]] += 1
    names = sorted(total, key=total.__getitem__, reverse=True)[:TOP]
    return [{"name": n, "total_ms": total[n] / 1e3, "count": count[n]} for n in names]


def summarize_events(trace_events: list[dict[str, Any]]) -> dict[str, Any]:
    """Compute/comm/overlap/idle (ms) and the top kernels (GPU) or operators by self time (CPU) of one rank's trace
    events (the chrome-trace dicts torch.profiler exports: name, cat, ph, ts, dur in microseconds)."""
    spans = [e for e in trace_events if e.get("ph") == "X" and "dur" in e]
    for e in spans:
        e["ts"], e["dur"] = float(e["ts"]), float(e["dur"])
    device = [e for e in spans if e.get("cat") in DEVICE_CATS]
    marks = [(e["ts"], e["ts"] + e["dur"]) for e in spans
             if e.get("cat") == "user_annotation" and e["name"].startswith(STEP_MARK)]
    if device:
        comm = union((e["ts"], e["ts"] + e["dur"]) for e in device if COMM.search(e["name"]))
        compute = union((e["ts"], e["ts"] + e["dur"]) for e in device if not COMM.search(e["name"]))
        top = _top(device)
        busy_events = device
    else:
        ops = [e for e in spans if e.get("cat") == "cpu_op"]
        # gloo's worker threads and FSDP mark their collectives with record_functions ("gloo:all_gather",
        # "FSDP::all_gather"): that is where a rank waits for the others, so it counts as communication.
        waits = [e for e in spans if e.get("cat") == "user_annotation" and COMM.search(e["name"])]
        by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
        for e in ops + waits:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
        comm, compute = [], []
        for evs in by_thread.values():
            c = union((e["ts"], e["ts"] + e["dur"]) for e in evs if COMM.search(e["name"]))
            comm += c
            compute += subtract(((e["ts"], e["ts"] + e["dur"]) for e in evs if not COMM.search(e["name"])), c)
        comm, compute = union(comm), union(compute)
        top = _top(ops, {k: length(v) for k, v in _self_intervals(ops).items()})
        busy_events = ops + waits
    window = [(min(s for s, _ in marks), max(e for _, e in marks))] if marks else (
        [(min(e["ts"] for e in busy_events), max(e["ts"] + e["dur"] for e in busy_events))] if busy_events else [])
    compute, comm = intersect(compute, window), intersect(comm, window)
    span = length(window)
    busy = length(compute + comm)
    out = {
        "device": "cuda" if device else "cpu", "steps": len(marks), "span_ms": span / 1e3,
        "compute_ms": length(compute) / 1e3, "comm_ms": length(comm) / 1e3,
        "overlap_ms": length(intersect(compute, comm)) / 1e3, "idle_ms": max(0.0, span - busy) / 1e3, "top": top,
    }
    if device:  # a GPU that waits is waiting for the host: say on what
        host = [e for e in spans if e.get("cat") in HOST_CATS and not e["name"].startswith(STEP_MARK)]
        out["idle_host"] = _host_during_idle(host, subtract(window, compute + comm))
    return out


def summarize_trace(path: str | Path) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    return summarize_events(data["traceEvents"] if isinstance(data, dict) else data)


def format_summary(rank: int, s: dict[str, Any]) -> str:
    span = s["span_ms"] or 1.0
    per_step = f" over {s['steps']} step(s)" if s.get("steps") else ""

    def part(name: str, key: str) -> str:
        return f"{name} {s[key]:,.1f} ms ({s[key] / span * 100:.0f}%)"

    parts = [part("compute", "compute_ms"), part("comm", "comm_ms"), part("overlap", "overlap_ms"),
             part("idle", "idle_ms")]
    lines = [f"profile rank {rank} ({s['device']}, {s['span_ms']:,.1f} ms{per_step}): " + " | ".join(parts)]
    what = "kernels" if s["device"] == "cuda" else "ops (self time)"
    top = "; ".join(f"{t['name']} {t['total_ms']:,.2f} ms x{t['count']}" for t in s["top"][:5])
    lines.append(f"  top {what}: {top}")
    if s.get("idle_host"):
        host = "; ".join(f"{t['name']} {t['total_ms']:,.2f} ms" for t in s["idle_host"][:5])
        lines.append(f"  while the GPU idled the host was in: {host}")
    return "\n".join(lines)


# -- the loop's profiler ------------------------------------------------------------------------------------------

class StepProfiler:
    """Profiles steps A..B: construct before the loop with first_step = the first step that will run, call step(step)
    after each optimizer step. On step B it stops, writes RUN_DIR/profile/rank{R}.json (+ .summary.json) and returns
    the summary (every other call returns None)."""

    def __init__(self, spec: str, run_dir: str | Path, rank: int, first_step: int = 1):
        self.first, self.last = parse_profile_steps(spec)
        self.folder, self.rank = Path(run_dir) / "profile", rank
        self.prof: torch.profiler.profile | None = None
        self._mark: Any = None
        self.summary: dict[str, Any] | None = None
        if self.first <= first_step <= self.last:  # resumed inside the window: profile what is left
            self._start(first_step)

    def _start(self, step: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities)
        self.prof.start()
        self._open_mark(step)

    def _open_mark(self, step: int) -> None:
        self._mark = torch.profiler.record_function(f"{STEP_MARK}{step}")
        self._mark.__enter__()

    def step(self, step: int) -> dict[str, Any] | None:
        if self.prof is None:
            if step + 1 == self.first:
                self._start(step + 1)
            return None
        self._mark.__exit__(None, None, None)
        if step < self.last:
            self._open_mark(step + 1)
            return None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.prof.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank{self.rank}.json"
        self.prof.export_chrome_trace(str(path))
        self.prof = None
        self.summary = {**summarize_trace(path), "trace": str(path)}
        (self.folder / f"rank{self.rank}.summary.json").write_text(json.dumps(self.summary, indent=1))
        return self.summary


def report_all_ranks(summary: dict[str, Any]) -> str | None:
    """Gather every rank's summary (a collective: call on every rank, on the step the profiler stopped) and return
    the text for rank 0 to print (None on the others)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return format_summary(0, summary)
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, summary)
    if dist.get_rank() != 0:
        return None
    return "\n".join(format_summary(r, s) for r, s in enumerate(rows))
