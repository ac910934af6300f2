"""SIGINT and SIGTERM in a worker (from the launcher, which passes them on, or straight from a job scheduler) ask
the run to stop: the handler only notes the signal, every rank learns of it in the step's gather (train/loop.py), so
all ranks finish the same step, save it and exit 130 / 143 with the line that says how to resume. A second SIGINT
ends the process at once."""

from __future__ import annotations

import json
import os
import shlex
import signal

ARGV_ENV = "PARASEEK_TRAIN_ARGV"  # the user's `paraseek train ...` arguments (JSON): the resume command's source


class StopRequest:
    """The first SIGINT/SIGTERM this process got (0: none)."""

    def __init__(self) -> None:
        self.signum = 0

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.signum and signum == signal.SIGINT:
            if os.environ.get("RANK", "0") == "0":  # os.write: print() may be in the middle of a line here
                os.write(2, b"paraseek: second Ctrl-C: stopped at once, without saving this step\n")
            os._exit(130)
        self.signum = self.signum or signum


STOP = StopRequest()


def resume_command(argv: list[str] | None, overwrite: bool = False) -> str:
    """The command that continues this run: its own arguments with --resume, without --overwrite, which would remove
    the checkpoint it resumes from (`overwrite`: the run's; turned off explicitly, a --config file may set it)."""
    if argv is None:
        return "the same command with --resume"
    kept, dropped_flag = [], False
    for arg in argv:
        if dropped_flag and arg.lower() in ("1", "0", "true", "false", "yes", "no", "on", "off"):
            dropped_flag = False  # the value of a dropped --resume/--overwrite
            continue
        dropped_flag = arg in ("--resume", "--overwrite")
        if not dropped_flag and arg.split("=", 1)[0] not in ("--resume", "--overwrite"):
            kept.append(arg)
    if overwrite:
        kept += ["--overwrite", "false"]
    return shlex.join(["paraseek", *kept, "--resume"])


def stop_message(signum: int, step: int, checkpoint: str | None, overwrite: bool = False) -> str:
    """The one line a stopped run ends with (rank 0); `overwrite`: the run's --overwrite."""
    name = signal.Signals(signum).name
    if checkpoint is None:
        return (f"paraseek: stopped by {name} after step {step}; nothing was saved (no --checkpoint-dir): add "
                f"--checkpoint-dir DIR to be able to resume a stopped run")
    argv = json.loads(os.environ[ARGV_ENV]) if os.environ.get(ARGV_ENV) else None
    command = resume_command(argv, overwrite)
    return f"paraseek: stopped by {name} after step {step}, saved {checkpoint}; resume with: {command}"
