"""Where every rank is: a progress record per rank, independent of the communication backend, to name the rank a
hung collective waits for.

Each rank writes {rank, host, step, phase, time} at a few points of every step into the c10d store (the launcher's
TCPStore, which still answers while a collective hangs) and atomically into RUN_DIR/progress/rank{R}.json (which
survives the job for `paraseek diagnose`). When a collective times out, a waiting rank reads every record: the ranks
that have not reached the step are the ones it waited for.

Crash reports go to RUN_DIR/errors/rank{R}.txt: one JSON line (rank, host, step, exception) and the traceback; for a
rank killed by a signal (SIGKILL: the out-of-memory killer), which cannot write one, its launcher writes it.
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any


KEY = "paraseek/progress/{rank}"
FAILED_KEY = "paraseek/failures"
# Order of the phases within a step; a rank at (step, phase) has passed every earlier (step, phase).
PHASES = {"start": 0, "before_step": 1, "after_step": 2, "done": 3, "stopped": 3}  # stopped: by SIGINT/SIGTERM
FR_DIR = "flight_recorder"  # Flight Recorder dumps: RUN_DIR/flight_recorder/rank{R}


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # readers see the old record or the new one, never half of one


class ProgressRecorder:
    def __init__(self, run_dir: str | Path | None, rank: int, host: str | None = None, store: Any = None):
        self.run_dir = Path(run_dir) if run_dir else None
        self.rank, self.host, self.store = rank, host or socket.gethostname(), store
        self.last: dict[str, Any] | None = None
        self.started = time.time()  # this attempt's start: diagnose ignores reports older than it (a resumed run)
        # The launcher's job id (+ restart), the same on every rank of one attempt: tells attempts apart in a folder.
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        self.attempt = f"{run_id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}" if run_id else None
        if self.run_dir:
            (self.run_dir / "progress").mkdir(parents=True, exist_ok=True)
            for stale in (self.run_dir / "errors" / f"rank{rank}.txt", self.run_dir / FR_DIR / f"rank{rank}"):
                stale.unlink(missing_ok=True)  # a previous attempt's, in the same folder

    @classmethod
    def from_env(cls, run_dir: str | Path | None) -> ProgressRecorder:
        """The recorder of this process in an initialized process group, on the launcher's store."""
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        return cls(run_dir, dist.get_rank(), store=_get_default_store())

    def mark(self, step: int, phase: str) -> None:
        """Record that this rank reached `phase` of `step` (a store round trip and a small file write)."""
        self.last = {"rank": self.rank, "host": self.host, "pid": os.getpid(), "step": step, "phase": phase,
                     "time": time.time(), "started": self.started, "attempt": self.attempt}
        text = json.dumps(self.last)
        if self.store is not None:
            self.store.set(KEY.format(rank=self.rank), text)
        if self.run_dir:
            _atomic_write(self.run_dir / "progress" / f"rank{self.rank}.json", text)

    def read(self, world: int) -> list[dict[str, Any]]:
        """Every rank's record: from the store when there is one (live), else from the files."""
        return read_progress(self.store if self.store is not None else self.run_dir, world)

    def current_step(self) -> int | None:
        """The step this rank is in: the last marked one, or the next after an 'after_step' or 'start' mark (a
        failure between two marks, e.g. in FaultInjector.before_step, belongs to the step about to start)."""
        if self.last is None:
            return None
        return self.last["step"] + (self.last["phase"] in ("after_step", "start"))

    def record_failure(self, exc: BaseException, step: int | None = None, *, count: bool = True) -> bool:
        """Write RUN_DIR/errors/rank{R}.txt and return True when this is the first failure of the job (the rank
        that should print the one-line cause; the others fail because it did). count=False: a rank that lost its
        peers, never the cause, does not take the first place from the rank that is."""
        step = step if step is not None else self.current_step()
        if self.run_dir:
            folder = self.run_dir / "errors"
            folder.mkdir(parents=True, exist_ok=True)
            head = {"rank": self.rank, "host": self.host, "step": step, "time": time.time(),
                    "exception": f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__}
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            _atomic_write(folder / f"rank{self.rank}.txt", json.dumps(head) + "\n" + tb)
        if not count:
            return False
        if self.store is None:
            return True
        try:
            return self.store.add(FAILED_KEY, 1) == 1
        except Exception:  # the store went away with the job: say it rather than say nothing
            return True


def read_progress(source: str | Path | Any, world: int | None = None) -> list[dict[str, Any]]:
    """Records sorted by rank, from a run folder (RUN_DIR/progress/rank*.json) or a c10d store (needs `world`).
    Ranks without a record are left out."""
    records = []
    if isinstance(source, (str, Path)):
        folder = Path(source) / "progress"
        ranks = range(world) if world is not None else None
        paths = [folder / f"rank{r}.json" for r in ranks] if ranks is not None else sorted(folder.glob("rank*.json"))
        for path in paths:
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
    else:
        if world is None:
            raise ValueError("reading progress from a store needs the world size")
        for r in range(world):
            key = KEY.format(rank=r)
            if source.check([key]):  # get() would block until the key exists
                records.append(json.loads(source.get(key)))
    return sorted(records, key=lambda rec: rec["rank"])


def reached(record: dict[str, Any], step: int, phase: str = "before_step") -> bool:
    position = (record["step"], PHASES.get(record["phase"], PHASES["before_step"]))
    return position >= (step, PHASES[phase])


def missing_ranks(records: list[dict[str, Any]], step: int, world: int | None = None) -> list[int]:
    """Ranks that have not reached the first collective of `step` (including ranks with no record at all)."""
    ranks = range(world) if world is not None else [r["rank"] for r in records]
    by_rank = {r["rank"]: r for r in records}
    return [r for r in ranks if r not in by_rank or not reached(by_rank[r], step)]


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def explain_hang(records: list[dict[str, Any]], waiting_step: int, world: int | None = None,
                 now: float | None = None, ages: bool = True) -> str:
    """"rank 1 (host h) did not reach the collective of step 4 (last seen: step 3 'after_step' 21.3 s ago); rank 0
    reached it" -- or, when every rank reached the step, that the hang is inside it. ages=False leaves out the
    "s ago" (for a dead run read later)."""
    now = time.time() if now is None else now
    by_rank = {r["rank"]: r for r in records}
    missing = missing_ranks(records, waiting_step, world)
    present = [r for r in (range(world) if world is not None else sorted(by_rank)) if r not in missing]
    if not missing:
        return (f"every rank reached step {waiting_step}; the collective that hangs is inside the step (a rank stuck "
                f"in a kernel, or ranks calling different collectives): see the Flight Recorder dumps")
    parts = []
    for r in missing:
        rec = by_rank.get(r)
        if rec is None:
            parts.append(f"rank {r} did not reach the collective of step {waiting_step} (no progress recorded)")
        else:
            age = f" {now - rec['time']:.1f} s ago" if ages else ""
            parts.append(f"rank {r} (host {rec['host']}) did not reach the collective of step {waiting_step} "
                         f"(last seen: step {rec['step']} {rec['phase']!r}{age})")
    tail = f"; {_ranks(present)} reached it" if present else ""
    return "; ".join(parts) + tail


def hang_event(records: list[dict[str, Any]], step: int, world: int | None = None,
               now: float | None = None) -> dict[str, Any]:
    """The JSONL event: {"event": "hang", "step", "rank": the (first) missing rank, "detail", "missing_ranks"}."""
    missing = missing_ranks(records, step, world)
    return {"event": "hang", "step": step, "rank": missing[0] if missing else None, "missing_ranks": missing,
            "detail": explain_hang(records, step, world, now)}


# What a rank raises when another rank died: gloo's and NCCL's words for a lost peer.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "communicator was aborted",
              "distnetworkerror", "remote process exited", "socket closed")


def is_peer_lost(exc: BaseException | str) -> bool:
    """The failure of a rank whose peer died (not a cause: the rank that died is)."""
    return any(p in str(exc).lower() for p in _PEER_LOST)


def is_comm_timeout(exc: BaseException) -> bool:
    """Gloo raises RuntimeError('... Timed out waiting 20000ms for recv ...'); NCCL raises DistBackendError
    ('Watchdog caught collective operation timeout ...') when the process survives its watchdog."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("timed out" in text or "timeout" in text)


def comm_timeout_message(exc: BaseException, step: int, records: list[dict[str, Any]], world: int | None = None,
                         timeout_s: float | None = None, now: float | None = None) -> str:
    """The one message for a collective timeout: what timed out, and who did not come."""
    after = f" after {timeout_s:g} s" if timeout_s else ""
    return f"a collective timed out at step {step}{after}: {explain_hang(records, step, world, now)}"


def set_comm_timeout(seconds: float) -> None:
    """Shorten the default group's collective timeout (call after warm-up: the first steps, with compilation and
    the first all-gathers, may legitimately take long). Gloo and NCCL both honour it."""
    import torch.distributed as dist

    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


def flight_recorder_env(run_dir: str | Path) -> dict[str, str]:
    """Environment for the workers: Flight Recorder on (NCCL always; gloo too on recent PyTorch), dumped on timeout
    into RUN_DIR/flight_recorder/rank{R}. Creates that folder (NCCL's writer does not: it logs "Error opening file"
    and dumps nothing). The launcher applies the result with os.environ.setdefault."""
    folder = Path(run_dir).resolve() / FR_DIR
    folder.mkdir(parents=True, exist_ok=True)
    # The TORCH_FR_* names (PyTorch >= 2.7); the older TORCH_NCCL_TRACE_* aliases now print deprecation warnings.
    # After a timeout NCCL's watchdog waits for the dumps before it takes the process down: 60 s by default, which
    # would make a --comm-timeout 20 job end after 80 s; 10 s is plenty for a 2000-entry buffer.
    return {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": str(folder / "rank"), "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "10000"}


def dump_flight_recorder(run_dir: str | Path, rank: int) -> Path | None:
    """Write this process's Flight Recorder buffer (the collectives it issued, with state and stack) to
    RUN_DIR/flight_recorder/rank{R}, as the NCCL watchdog would. None when this PyTorch has no recorder."""
    import pickle

    import torch._C._distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    if dump is None:
        return None
    try:
        data = dump()
    except Exception:
        return None
    path = Path(run_dir) / FR_DIR / f"rank{rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else pickle.dumps(data))
    return path


REPORTED = 3  # a worker's exit code when it has printed the job's one-line cause itself (the launcher stays quiet)
PEER_LOST = 4  # a worker's exit code when it lost its peers and stayed quiet (the launcher names the rank that died)


def record_killed(run_dir: str | Path, rank: int, signum: int, since: float) -> dict[str, Any]:
    """The crash report of a rank that a signal killed (SIGKILL cannot be caught: the rank writes nothing), written
    by its launcher: the step from the rank's progress record (when written after `since`, this launch)."""
    import signal

    run_dir = Path(run_dir)
    record = next((r for r in read_progress(run_dir) if r["rank"] == rank and r["time"] >= since), None)
    step = record["step"] + (record["phase"] in ("after_step", "start")) if record else None
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = "unknown"
    head = {"rank": rank, "host": record["host"] if record else socket.gethostname(), "step": step,
            "time": time.time(), "exception": f"killed (signal {signum}: {name})", "signal": signum}
    (run_dir / "errors").mkdir(parents=True, exist_ok=True)
    _atomic_write(run_dir / "errors" / f"rank{rank}.txt", json.dumps(head) + "\n")
    return head


def killed_message(report: dict[str, Any]) -> str:
    """"rank 1 was killed (signal 9: SIGKILL) at step 3 on host h; ..." for a record_killed report."""
    where = f" at step {report['step']}" if report.get("step") is not None else ""
    hint = ("; SIGKILL is what the kernel's out-of-memory killer sends (`dmesg` says whether it did), or kill -9"
            if report["signal"] == 9 else "")
    return f"rank {report['rank']} was {report['exception']}{where} on host {report['host']}{hint}"


def report_failure(recorder: ProgressRecorder, exc: BaseException, world: int, *, timeout_s: float | None = None,
                   jsonl: str | Path | None = None) -> str | None:
    """What a worker does with the exception that ends it: write its crash report (and Flight Recorder dump on a
    timeout), and on the first failing rank of the job only, append the event to the metrics JSONL and return the one
    line to print. The other ranks (those that lose their peer) return None and stay quiet.

    A collective timeout becomes {"event": "hang", "rank": the rank that did not come}; anything else
    {"event": "crash" | "oom", "rank": this rank}."""
    step = recorder.current_step()
    if is_peer_lost(exc) and not is_comm_timeout(exc):  # the rank that died is the news: its launcher reports it
        recorder.record_failure(exc, step, count=False)
        return None
    if is_comm_timeout(exc):
        records = recorder.read(world)
        step = step or max([0] + [r["step"] for r in records])
        event = hang_event(records, step, world)
        message = comm_timeout_message(exc, step, records, world, timeout_s)
        if recorder.run_dir:
            dump_flight_recorder(recorder.run_dir, recorder.rank)
    else:
        first_line = (str(exc).strip().splitlines() or [""])[0]
        kind = "oom" if "out of memory" in first_line.lower() else "crash"
        where = f" at step {step}" if step is not None else ""
        report = f" (traceback: {recorder.run_dir / 'errors' / f'rank{recorder.rank}.txt'})" if recorder.run_dir else ""
        message = (f"rank {recorder.rank} (host {recorder.host}) failed{where}: {type(exc).__name__}: "
                   f"{first_line}{report}")
        event = {"event": kind, "step": step, "rank": recorder.rank, "host": recorder.host,
                 "detail": f"{type(exc).__name__}: {first_line}"}
    event["time"] = time.time()
    if not recorder.record_failure(exc, step):
        return None
    if jsonl:
        with open(jsonl, "a") as f:
            f.write(json.dumps(event) + "\n")
    return message
