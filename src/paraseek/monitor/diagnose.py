"""`paraseek diagnose RUN_DIR`: read a dead (or finished) run's records and say what went wrong.

It reads, when present:
  RUN_DIR/progress/rank*.json      where every rank was last (monitor/progress.py)
  RUN_DIR/**/*.jsonl               event rows {"event": ...} among the metrics (hang, nan, loss_spike, straggler, ...)
  RUN_DIR/errors/rank*.txt         crash reports: a JSON line (rank, host, step, exception), then the traceback
  RUN_DIR/flight_recorder/rank*    PyTorch Flight Recorder dumps (pickles): each rank's last collectives
and prints one verdict -- the hang (which rank did not reach which step), the crash (rank, step, exception), the
rank killed by a signal, the NaN (step), the stop on SIGINT/SIGTERM -- or "no failure found", followed by the
evidence. It exits 0 for a run that finished or was stopped on request and saved, 1 for a failed one.
"""

from __future__ import annotations

import argparse
import json
import pickle
from pathlib import Path
from typing import Any

from paraseek.errors import UserError
from paraseek.monitor.progress import (FR_DIR, PHASES, explain_hang, is_comm_timeout, is_peer_lost, killed_message,
                                       missing_ranks, read_progress)


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """Every {"event": ...} row of every JSONL file under run_dir, in file order."""
    events = []
    for path in sorted(run_dir.rglob("*.jsonl")):
        try:
            with open(path, errors="replace") as f:  # damaged bytes: a line that is not JSON, skipped below
                for line in f:
                    if '"event"' not in line:
                        continue
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue  # a line cut short by the crash
                    if isinstance(row, dict) and "event" in row:
                        events.append({**row, "file": str(path.relative_to(run_dir))})
        except OSError:
            continue
    return events


def read_errors(run_dir: Path) -> list[dict[str, Any]]:
    """Crash reports, earliest first (the first failure is the cause; later ones are ranks losing their peer)."""
    reports = []
    for path in sorted((run_dir / "errors").glob("rank*.txt")):
        text = path.read_text(errors="replace")
        head, _, tb = text.partition("\n")
        try:
            report = json.loads(head)
        except ValueError:  # not our format: the traceback's last line is the exception
            lines = [line for line in text.splitlines() if line.strip()]
            rank = path.stem[len("rank"):]
            report = {"rank": int(rank) if rank.isdigit() else None, "step": None, "time": path.stat().st_mtime,
                      "exception": lines[-1] if lines else "", "host": None}
            tb = text
        report["file"] = str(path.relative_to(run_dir))
        report["traceback"] = tb
        reports.append(report)
    return sorted(reports, key=lambda r: (r.get("time") is None, r.get("time") or 0, r.get("rank") or 0))


def read_flight_recorder(run_dir: Path) -> list[dict[str, Any]]:
    """One summary per dump file: rank, entries, and the last collective per process group (seq id, name, state)."""
    folder = run_dir / FR_DIR
    dumps = []
    paths = sorted(p for p in folder.glob("*") if p.is_file() and not p.name.startswith(".")) if folder.is_dir() else []
    for path in paths:
        digits = "".join(ch for ch in path.name if ch.isdigit())
        summary: dict[str, Any] = {"file": str(path.relative_to(run_dir)), "rank": int(digits) if digits else None}
        try:
            with open(path, "rb") as f:
                data = pickle.load(f)
            entries = data.get("entries", []) if isinstance(data, dict) else []
        except Exception as e:  # not a pickle we can read (another PyTorch's format, a JSON dump): list it
            summary["error"] = f"unreadable ({type(e).__name__})"
            dumps.append(summary)
            continue
        last: dict[str, dict[str, Any]] = {}
        for e in entries:
            if e.get("is_p2p"):
                continue
            pg = e.get("process_group", ("?", ""))
            pg_name = f"{pg[0]}:{pg[1]}" if isinstance(pg, (tuple, list)) else str(pg)
            seq = e.get("collective_seq_id", 0)
            if pg_name not in last or seq >= last[pg_name]["seq"]:
                last[pg_name] = {"seq": seq, "name": e.get("profiling_name", "?"), "state": e.get("state", "?")}
        summary["entries"] = len(entries)
        summary["last"] = last
        dumps.append(summary)
    return dumps


def _flight_recorder_lines(dumps: list[dict[str, Any]]) -> list[str]:
    lines = []
    behind: dict[str, dict[int, int]] = {}
    for d in dumps:
        if "error" in d:
            lines.append(f"flight recorder {d['file']}: {d['error']}")
            continue
        for pg, last in d.get("last", {}).items():
            lines.append(f"flight recorder rank {d['rank']}: process group {pg}: last collective #{last['seq']} "
                         f"{last['name']} ({last['state']})")
            behind.setdefault(pg, {})[d["rank"]] = last["seq"]
    for pg, seqs in behind.items():
        if len(set(seqs.values())) > 1:
            top = max(seqs.values())
            late = sorted(r for r, s in seqs.items() if s < top)
            lines.append(f"flight recorder: in process group {pg}, rank(s) {', '.join(map(str, late))} issued fewer "
                         f"collectives than the others (#{min(seqs.values())} vs #{top})")
    return lines


class _AsError(RuntimeError):
    """An exception line read back from a report, to reuse is_comm_timeout on it."""


# Events that are findings (others, like "model_state", are information and only listed).
_ANOMALIES = {"nan", "loss_spike", "grad_explosion", "straggler", "hang", "crash", "oom", "killed"}
FINE = ("ok", "interrupted")  # verdicts of a run that did not fail: `paraseek diagnose` exits 0 for them, else 1


def _is_victim(exception: str) -> bool:
    """The report of a rank that failed because another one died or hung."""
    return is_comm_timeout(_AsError(exception)) or is_peer_lost(exception)


def diagnose(run_dir: str | Path) -> dict[str, Any]:
    """The verdict and the evidence, as a JSON-able dict: {"verdict", "message", "step", "rank", ...}.

    Verdicts: hang, crash, killed (by a signal: SIGKILL is what the out-of-memory killer sends), oom, nan, error (a
    user error stopped the run), interrupted (SIGINT/SIGTERM: every rank stopped after the same step), stopped (no
    failure recorded but the run did not finish), ok."""
    run_dir = Path(run_dir)
    where = "pass the run folder: --run-dir, by default the metrics file's folder, holding progress/ and errors/"
    if not run_dir.is_dir():
        raise UserError(f"paraseek diagnose {run_dir}: no such folder ({where})")
    if not any((run_dir / name).is_dir() for name in ("progress", "errors", FR_DIR)) and \
            not any(run_dir.rglob("*.jsonl")):
        raise UserError(f"paraseek diagnose {run_dir}: not a run folder (no progress/, errors/ or metrics JSONL; "
                        f"{where})")
    progress = read_progress(run_dir)
    events = read_events(run_dir)
    errors = read_errors(run_dir)
    # A resumed run writes into the same folder (and appends to the same JSONL): keep the latest attempt's records
    # (ranks of an older, larger world may have left theirs) and the reports written since it started.
    if progress and progress[0].get("attempt") is not None:
        latest = max(progress, key=lambda r: r["time"])["attempt"]
        progress = [r for r in progress if r.get("attempt") == latest]
    started = min((r["started"] for r in progress if r.get("started")), default=None)
    if started is not None:
        events = [e for e in events if not e.get("time") or e["time"] >= started]
        errors = [e for e in errors if not e.get("time") or e["time"] >= started]
    result: dict[str, Any] = {"run_dir": str(run_dir), "verdict": "ok", "message": "no failure found", "step": None,
                              "rank": None, "progress": progress, "events": events,
                              "errors": [{k: v for k, v in e.items() if k != "traceback"} for e in errors],
                              "flight_recorder": read_flight_recorder(run_dir)}

    def verdict(kind: str, message: str, step: Any = None, rank: Any = None) -> dict[str, Any]:
        result.update(verdict=kind, message=message, step=step, rank=rank)
        return result

    by_kind: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        by_kind.setdefault(e["event"], []).append(e)
    if "hang" in by_kind:
        e = by_kind["hang"][0]
        return verdict("hang", e.get("detail") or f"a collective hung at step {e.get('step')}", e.get("step"),
                       e.get("rank"))
    # The first report that is neither a rank losing its peers (a timeout waiting for the culprit, a connection the
    # culprit's exit closed) nor a user error is the cause.
    cause = next((r for r in errors if not _is_victim(r["exception"]) and not r["exception"].startswith("UserError")),
                 None)
    if cause is not None:
        where = f" at step {cause['step']}" if cause.get("step") is not None else ""
        host = f" (host {cause['host']})" if cause.get("host") else ""
        if cause.get("signal"):  # written by the launcher: a rank killed by a signal leaves no traceback
            return verdict("killed", killed_message(cause), cause.get("step"), cause.get("rank"))
        kind = "oom" if "out of memory" in cause["exception"].lower() else "crash"
        return verdict(kind, f"rank {cause['rank']}{host} failed{where}: {cause['exception']} "
                             f"(traceback in {cause['file']})", cause.get("step"), cause.get("rank"))
    finished = bool(progress) and all(r["phase"] == "done" for r in progress)
    if finished:
        step = max(r["step"] for r in progress)
        noted = sorted({e["event"] for e in events} & _ANOMALIES)
        return verdict("ok", f"no failure found: the run finished at step {step}"
                             + (f" (events: {', '.join(noted)})" if noted else ""), step)
    if progress and all(r["phase"] == "stopped" for r in progress):
        step = max(r["step"] for r in progress)
        stop = (by_kind.get("stop") or [{}])[-1]
        return verdict("interrupted", stop.get("detail") or f"every rank stopped after step {step} on SIGINT/SIGTERM",
                       step)
    for kind in ("oom", "nan"):
        if kind in by_kind:
            e = by_kind[kind][0]
            what = "the loss or the gradients became NaN/Inf" if kind == "nan" else "out of memory"
            detail = f": {e['detail']}" if e.get("detail") else ""
            return verdict(kind, f"{what} at step {e.get('step')}{detail}", e.get("step"), e.get("rank"))
    user = next((r for r in errors if r["exception"].startswith("UserError")), None)
    if user is not None:
        return verdict("error", f"stopped at step {user.get('step')}: {user['exception']}", user.get("step"),
                       user.get("rank"))
    if progress:
        front = max(progress, key=lambda r: (r["step"], PHASES.get(r["phase"], 1)))
        step = front["step"]
        late = missing_ranks(progress, step)
        timed_out = bool(errors) or any("last" in d for d in result["flight_recorder"])
        if late and timed_out:  # a rank timed out (or the NCCL watchdog dumped) waiting for the late ones
            return verdict("hang", explain_hang(progress, step, ages=False), step, late[0])
        if timed_out:
            return verdict("hang", f"ranks timed out in a collective at step {step}; "
                                   + explain_hang(progress, step, ages=False), step)
        if late:  # ranks apart but nobody timed out: killed from outside while they were, or a hang nobody timed
            return verdict("stopped", f"the run stopped at step {step} with no failure recorded (killed from outside?); "
                                      f"at that time {explain_hang(progress, step, ages=False)}", step, late[0])
        return verdict("stopped", f"every rank stopped at step {step} ({front['phase']!r}) with no failure recorded: "
                                  f"killed from outside, or a hang inside the step (see the Flight Recorder dumps)",
                       step)
    return result


def format_diagnosis(d: dict[str, Any]) -> str:
    lines = [f"paraseek diagnose {d['run_dir']}: {d['verdict']}", f"  {d['message']}"]
    for r in d["progress"]:
        lines.append(f"  progress rank {r['rank']} (host {r['host']}): step {r['step']} {r['phase']!r}")
    for e in d["errors"]:
        lines.append(f"  error rank {e['rank']} step {e.get('step')}: {e['exception']} ({e['file']})")
    for e in d["events"]:
        if e["event"] != d["verdict"]:
            rank = f" rank {e['rank']}" if e.get("rank") is not None else ""
            lines.append(f"  event {e['event']} step {e.get('step')}{rank}: {e.get('detail', '')}")
    lines += [f"  {line}" for line in _flight_recorder_lines(d["flight_recorder"])]
    return "\n".join(lines)


def run_diagnose(ns: argparse.Namespace) -> int:
    d = diagnose(ns.run_dir)
    if ns.json:
        print(json.dumps(d, indent=2, default=str))
    else:
        print(format_diagnosis(d))
    return 0 if d["verdict"] in FINE else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "diagnose", help="say why a run died: the hung rank and step, the crash, the killed rank, the NaN",
        description="Read a run folder's progress records, metrics events, crash reports and Flight Recorder dumps "
        "and print the verdict: which rank did not reach which collective, which rank crashed at which step and "
        "why, which rank a signal killed (the out-of-memory killer's SIGKILL), where the loss became NaN, that "
        "SIGINT/SIGTERM stopped it -- or that no failure was found. Exits 0 for a run that finished or was stopped "
        "on request, 1 for a failed one.",
    )
    p.add_argument("run_dir", help="the run folder (with progress/, errors/, flight_recorder/ or a metrics JSONL)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=run_diagnose)
