"""The ranks of one command on this node, started one of two ways:
- `run_ranks`: torch's launcher (torch.distributed.run) in this process rather than as a subprocess, so that a failed
  rank comes back as an exit code and one line instead of the launcher's traceback and error dump (`paraseek train`,
  `paraseek generate`);
- `spawn`: plain subprocesses without torch's agent, so that SIGTERM/SIGINT reach rank 0 alone, which drains and then
  tells the others to stop (`paraseek serve`).
It imports neither training, inference nor the planner: both sides start their ranks through it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def threads_per_rank(nproc: int) -> str:
    """OMP_NUM_THREADS for `nproc` ranks sharing this node's cores, instead of each taking all of them."""
    return str(max(1, (os.cpu_count() or 1) // nproc))


def run_ranks(args: list[str]):
    """torch.distributed.run with these arguments (its flags, then what each rank runs); None when every rank exited
    0, else torch's ChildFailedError (its .failures: rank -> exit code, time)."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # The elastic agent's own warnings and error dumps: the ranks report for themselves, and the caller does.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name == "torch.distributed.run":
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(get_args_parser().parse_args(args))
    except ChildFailedError as e:
        return e
    return None


def failed_first(rank: int, code: int) -> str:
    """The line for the rank that failed first with exit code `code` (negative: the signal that killed it)."""
    how = f"signal {-code}" if code < 0 else f"exit code {code}"
    return f"rank {rank} failed first ({how}); all ranks were stopped"


def spawn(nproc: int, argv: list[str], env: dict[str, str]) -> int:
    """`python -m paraseek ARGV` as `nproc` local ranks (rank i on GPU i) with `env` added to their environment.
    SIGTERM/SIGINT go to rank 0 alone. Returns rank 0's exit code; a rank that dies first stops all of them with one
    line (2 when it was a user error)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), **env)
    base.setdefault("OMP_NUM_THREADS", threads_per_rank(nproc))
    procs = [subprocess.Popen([sys.executable, "-m", "paraseek", *argv],
                              env=dict(base, RANK=str(i), LOCAL_RANK=str(i))) for i in range(nproc)]

    def forward(sig, frame) -> None:
        if procs[0].poll() is None:
            procs[0].send_signal(sig)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
            if codes[0] is not None or failed is not None:
                break
            time.sleep(0.2)
        deadline = time.time() + 30
        for p in procs:  # the others end by themselves once rank 0 has told them; the stragglers are stopped
            while p.poll() is None and time.time() < deadline and failed is None:
                time.sleep(0.1)
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        if failed is not None and failed != 0:
            code = procs[failed].returncode
            print(f"paraseek: {failed_first(failed, code)}", file=sys.stderr)
            return 2 if code == 2 else 1
        return procs[0].returncode
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
