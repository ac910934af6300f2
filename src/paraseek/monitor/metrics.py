"""Per-step metrics from rank 0: a console line with ETA, JSONL (schema in docs/design.md) and TensorBoard scalars."""

from __future__ import annotations

import gc
import json
import math
import time
from pathlib import Path
from typing import Any

# Metrics that go to TensorBoard as scalars (the JSONL gets everything).
_TB_KEYS = ("loss", "grad_norm", "lr", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "mem_peak_gib", "step_time_s",
            "expert_load_max_over_mean", "loss_scale")


class GcClock:
    """Seconds Python's cyclic garbage collector ran since the last `take` (gc.callbacks). A collection stops the
    host; in a host-bound step the GPU waits it out, so each step's metrics carry it (`gc_s`)."""

    def __init__(self):
        self.seconds, self._start = 0.0, 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def close(self) -> None:
        gc.callbacks.remove(self._on)


class MetricsLogger:
    def __init__(self, *, enabled: bool, total_steps: int, jsonl: str = "", tensorboard: str = "", log_every: int = 1,
                 unit: str = "gpu"):
        self.enabled, self.total_steps, self.log_every, self.unit = enabled, total_steps, max(1, log_every), unit
        self.jsonl = None
        self.tb = None
        self.t_start = time.perf_counter()
        self.first_step: int | None = None
        if not enabled:
            return
        if jsonl:
            Path(jsonl).parent.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(jsonl, "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(tensorboard)

    def event(self, kind: str, step: int, rank: int | None = None, detail: str = "", **extra: Any) -> None:
        if self.enabled and self.jsonl:
            self.jsonl.write(json.dumps({"event": kind, "step": step, "rank": rank, "detail": detail, **extra}) + "\n")

    def step(self, m: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = m["step"]
        if self.first_step is None:
            self.first_step, self.t_first = step, time.perf_counter() - m["step_time_s"]
        if self.jsonl:
            self.jsonl.write(json.dumps(m) + "\n")
        if self.tb:
            for key in [*_TB_KEYS, *(k for k in m if k.startswith("mtp_loss_"))]:
                if m.get(key) is not None:
                    self.tb.add_scalar(f"train/{key}", m[key], step)
        if step % self.log_every == 0 or step == self.total_steps:
            done = step - self.first_step + 1
            elapsed = time.perf_counter() - self.t_first
            eta = elapsed / done * (self.total_steps - step)
            mfu = f" | MFU {m['mfu'] * 100:5.1f}%" if m.get("mfu") is not None else ""
            # the multi-token-prediction depths' losses, mtp_loss_1, mtp_loss_2, ...: "mtp 2.3104/2.8731"
            mtp = "/".join(f"{m[k]:.4f}" for k in sorted((k for k in m if k.startswith("mtp_loss_")),
                                                           key=lambda k: int(k.rsplit("_", 1)[1])))
            mtp = f" | mtp {mtp}" if mtp else ""
            print(
                f"step {step:>5}/{self.total_steps} | loss {m['loss']:.4f}{mtp} | grad_norm {m['grad_norm']:.3f} | "
                f"lr {m['lr']:.2e} | {m['tokens_per_s_per_gpu']:,.0f} tok/s/{self.unit}{mfu} | mem {m['mem_peak_gib']:.2f} GiB | "
                f"{m['step_time_s'] * 1e3:,.0f} ms | ETA {_fmt(eta)}",
                flush=True,
            )

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()


def _fmt(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
