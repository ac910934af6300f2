"""Fault injection for tests and drills (`--inject-fault`): make the failures the health checks must catch.

    nan@STEP          the loss (and so every gradient) becomes NaN on every rank at STEP
    spike@STEP        the loss (and every gradient) is multiplied by 1e3 on every rank at STEP
    hang@RANK:STEP    RANK stops before the first collective of STEP and comes back only to a signal (the
                      launcher's SIGTERM once another rank gave up on it)
    slow@RANK:MS      RANK sleeps MS milliseconds before every step (a straggler)
    crash@RANK:STEP   RANK raises RuntimeError("injected crash ...") before STEP
    oom@RANK:STEP     RANK raises torch.OutOfMemoryError before STEP (the OOM report and advice, on any device)
    kill@RANK:STEP    RANK is killed by SIGKILL before STEP (what the kernel's out-of-memory killer does)

Several faults are separated by commas: `--inject-fault slow@1:400,nan@20`.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from paraseek.errors import UserError

SPIKE_FACTOR = 1e3  # large enough that a robust z-score over any sane loss history flags it
FORMS = "nan@STEP, spike@STEP, hang@RANK:STEP, slow@RANK:MS, crash@RANK:STEP, oom@RANK:STEP or kill@RANK:STEP"
_STEP_ONLY = ("nan", "spike")
_RANK_AND = ("hang", "slow", "crash", "oom", "kill")
_SPEC = re.compile(r"^([a-z]+)@(\d+)(?::(\d+))?$")


@dataclass(frozen=True)
class Fault:
    kind: str  # nan | spike | hang | slow | crash | oom | kill
    step: int | None = None  # the step it fires at (nan, spike, hang, crash)
    rank: int | None = None  # the rank it fires on (hang, slow, crash); None = every rank
    ms: int = 0  # slow: the delay per step

    def __str__(self) -> str:
        if self.kind in _STEP_ONLY:
            return f"{self.kind}@{self.step}"
        return f"{self.kind}@{self.rank}:{self.ms if self.kind == 'slow' else self.step}"


def parse_faults(spec: str) -> list[Fault]:
    """'slow@1:400,nan@3' -> [Fault('slow', rank=1, ms=400), Fault('nan', step=3)]. An empty spec is no faults."""
    faults = []
    for part in (p.strip() for p in (spec or "").split(",")):
        if not part:
            continue
        m = _SPEC.match(part)
        kind = m.group(1) if m else ""
        if not m or kind not in _STEP_ONLY + _RANK_AND:
            raise UserError(f"--inject-fault {part!r}: expected {FORMS}")
        first, second = int(m.group(2)), m.group(3)
        if kind in _STEP_ONLY:
            if second is not None:
                raise UserError(f"--inject-fault {part!r}: {kind} takes a step only ({kind}@STEP), on every rank")
            fault = Fault(kind, step=first)
        else:
            if second is None:
                what = "MS" if kind == "slow" else "STEP"
                raise UserError(f"--inject-fault {part!r}: expected {kind}@RANK:{what}")
            if kind == "slow":
                fault = Fault(kind, rank=first, ms=int(second))
            else:
                fault = Fault(kind, step=int(second), rank=first)
        if fault.step is not None and fault.step < 1:
            raise UserError(f"--inject-fault {part!r}: steps count from 1")
        faults.append(fault)
    return faults


def check_faults(faults: list[Fault], world: int, steps: int) -> None:
    """The checks that need the run's shape: call where the config is validated (before launching)."""
    for f in faults:
        if f.rank is not None and f.rank >= world:
            raise UserError(f"--inject-fault {f}: rank {f.rank} does not exist (world size {world})")
        if f.step is not None and f.step > steps:
            raise UserError(f"--inject-fault {f}: step {f.step} is after the last step ({steps})")


class FaultInjector:
    """The loop's hooks. With no faults every hook is a no-op that costs one attribute test."""

    def __init__(self, faults: list[Fault] | str, rank: int, sleep: Callable[[float], None] = time.sleep,
                 signalled: Callable[[], int] = lambda: 0):
        self.faults = parse_faults(faults) if isinstance(faults, str) else list(faults)
        self.rank = rank
        self._sleep = sleep  # tests pass a recorder instead of really sleeping
        self._signalled = signalled  # the signal this process got (train/stop.py's STOP), 0 for none

    def __bool__(self) -> bool:
        return bool(self.faults)

    def describe(self) -> str:
        return ", ".join(str(f) for f in self.faults)

    def loss_hook(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """Call on each micro-batch's loss before backward. Multiplying (rather than replacing) keeps the autograd
        graph, so a NaN loss makes NaN gradients and a spiked loss makes 1e3x gradients, as real ones do."""
        for f in self.faults:
            if f.step == step and f.kind == "nan":
                loss = loss * float("nan")
            elif f.step == step and f.kind == "spike":
                loss = loss * SPIKE_FACTOR
        return loss

    def before_step(self, step: int) -> None:
        """Call at the top of the step, before its first collective (and before ProgressRecorder.mark(step,
        'before_step'), so that a hung rank's progress record still says it finished the previous step)."""
        for f in self.faults:
            if f.rank != self.rank:
                continue
            if f.kind == "slow":
                self._sleep(f.ms / 1e3)
            elif f.kind == "crash" and f.step == step:
                raise RuntimeError(f"injected crash on rank {self.rank} at step {step} (--inject-fault {f})")
            elif f.kind == "oom" and f.step == step:
                raise torch.OutOfMemoryError(f"CUDA out of memory (injected on rank {self.rank} at step {step}, "
                                             f"--inject-fault {f})")
            elif f.kind == "kill" and f.step == step:
                os.kill(os.getpid(), signal.SIGKILL)
            elif f.kind == "hang" and f.step == step:
                # Until the job's comm timeout ends it: a peer gives up and the launcher SIGTERMs this rank, which
                # the worker's handler only notes (a hung process that is not stuck in a kernel would see it too).
                while not self._signalled():
                    self._sleep(1.0)
                raise RuntimeError(f"injected hang on rank {self.rank} at step {step} ended by a signal")
