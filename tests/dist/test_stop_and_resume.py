"""Stopping and resuming (CPU, gloo, 2 processes, tiny-dense): SIGINT to the launcher and SIGTERM to one rank stop
every rank after the same step with a checkpoint of it, exit 130 / 143 and print the command that resumes; that
command continues the uninterrupted curve past damaged newer checkpoints and keeps the original lr schedule when
--steps changes; a SIGKILLed rank is named, by the run and by `paraseek diagnose`; SIGKILL during saves never leaves
a corrupted newest checkpoint."""

import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_helpers import EXACT, SRC, assert_same_losses, plain_torch_losses, run_train, seed_checkpoint

from paraseek.cli import main

pytestmark = pytest.mark.dist
STEPS, LR, FLOOR = 10, 0.01, 0.001  # EXACT's lr 0.01; the cosine ends at lr * min_lr_ratio (0.1)
COMMON = [*EXACT, "--model", "tiny-dense", "--nproc", "2", "--micro-batch-size", "2", "--lr-schedule", "cosine",
          "--steps", str(STEPS), "--metrics-jsonl", "run/metrics.jsonl"]


def cosine(step: int) -> float:
    """The schedule of a STEPS-step run, written out (no warm-up; flat at the floor past the end)."""
    return FLOOR + (LR - FLOOR) * 0.5 * (1 + math.cos(math.pi * min(step, STEPS) / STEPS))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    init = seed_checkpoint("tiny-dense", tmp_path_factory.mktemp("stop") / "init")
    return init, plain_torch_losses(init, STEPS, cosine)


def _start(*argv: str, cwd: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC, PARASEEK_CACHE=str(cwd / "cache"))
    return subprocess.Popen([sys.executable, "-m", "paraseek", "train", *argv], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _rows(tmp_path: Path) -> list[dict]:
    path = tmp_path / "run" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _when_step_done(tmp_path: Path, step: int, proc: subprocess.Popen) -> None:
    """Wait until rank 0 logged `step`: from then on the ranks are in step + 1 or later."""
    deadline = time.monotonic() + 300
    while not any(r.get("step", 0) >= step and "event" not in r for r in _rows(tmp_path)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)


def _diagnose(tmp_path: Path, capsys) -> tuple[int, dict]:
    """`paraseek diagnose RUN_DIR --json` (in this process: the command is a file reader)."""
    capsys.readouterr()
    code = main(["diagnose", str(tmp_path / "run"), "--json"])
    return code, json.loads(capsys.readouterr().out)


def _stopped_at(tmp_path: Path, proc: subprocess.Popen, code: int, name: str) -> tuple[int, str]:
    """The checks common to SIGINT and SIGTERM; returns the step it stopped after and the resume command."""
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err
    assert "Traceback" not in err
    rows = [r for r in _rows(tmp_path) if "event" not in r]
    k = rows[-1]["step"]
    assert 3 <= k < STEPS and [r["step"] for r in rows] == list(range(1, k + 1))  # the step in progress, no more
    assert (tmp_path / "ck" / "latest").read_text().strip() == f"step-{k:06d}"
    (line,) = [line for line in err.splitlines() if "resume with:" in line]
    assert line.startswith(f"paraseek: stopped by {name} after step {k}, saved ck/step-{k:06d}; resume with: ")
    (stop,) = [r for r in _rows(tmp_path) if r.get("event") == "stop"]
    assert (stop["step"], stop["signal"], stop["checkpoint"]) == (k, getattr(signal, name), f"ck/step-{k:06d}")
    return k, line.split("resume with: ", 1)[1]


def test_sigint_saves_the_step_and_the_printed_command_resumes_past_damage(reference, tmp_path):
    init, ref = reference
    proc = _start(*COMMON, "--init-from", str(init), "--checkpoint-dir", "ck", "--keep-last", "2", cwd=tmp_path)
    _when_step_done(tmp_path, 2, proc)
    proc.send_signal(signal.SIGINT)  # what Ctrl-C does: the launcher gets it (the workers have their own sessions)
    k, command = _stopped_at(tmp_path, proc, 130, "SIGINT")

    # Newer checkpoints that are not whole, which --resume must skip with a warning each: a truncated shard, a
    # missing trainer_state.json, and a `latest` of junk.
    ck = tmp_path / "ck"
    for step in (11, 12):
        shutil.copytree(ck / f"step-{k:06d}", ck / f"step-{step:06d}")
        state = json.loads((ck / f"step-{k:06d}" / "trainer_state.json").read_text())
        (ck / f"step-{step:06d}" / "trainer_state.json").write_text(json.dumps(dict(state, step=step)))
    shard = ck / "step-000012" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (ck / "step-000011" / "trainer_state.json").unlink()
    (ck / "latest").write_text("\x00garbage")

    argv = shlex.split(command)
    assert argv[:2] == ["paraseek", "train"] and argv[-1] == "--resume"
    r = run_train(*argv[2:], "--steps", "12", cwd=tmp_path)  # the printed command, asked to train 2 steps longer
    warnings = [line for line in r.stderr.splitlines() if line.startswith("paraseek: warning: --resume:")]
    assert len(warnings) == 3
    assert "step-000012: shard __1_0.distcp is truncated" in warnings[0]
    assert "step-000011: no trainer_state.json; skipped" in warnings[1] and "holds '\\x00garbage'" in warnings[2]
    assert f"resumed from ck/step-{k:06d} at step {k}" in r.stdout
    assert "lr schedule: the resumed run's (steps 10) is kept" in r.stdout

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (resume,) = [row for row in rows if row.get("event") == "resume"]
    assert resume["step"] == k and resume["checkpoint"] == f"ck/step-{k:06d}"
    resumed = {row["step"]: row for row in rows[rows.index(resume):] if "event" not in row}
    assert sorted(resumed) == list(range(k + 1, 13))
    # The uninterrupted run's losses (plain torch, within the engine's 1e-4), because the lr schedule is still the
    # 10-step one: another --steps did not move it; past step 10 it stays at its end.
    assert_same_losses({s: resumed[s]["loss"] for s in range(k + 1, STEPS + 1)},
                       {s: ref[s] for s in range(k + 1, STEPS + 1)}, rtol=1e-4)
    for s, row in resumed.items():
        assert abs(row["lr"] - cosine(s)) <= 1e-9 * LR, (s, row["lr"], cosine(s))
    # --keep-last 2: the newest complete older step stays, the damaged ones went.
    assert sorted(p.name for p in ck.iterdir()) == ["latest", f"step-{k:06d}", "step-000012"]


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tmp_path, capsys):
    proc = _start(*COMMON, "--checkpoint-dir", "ck", cwd=tmp_path)
    _when_step_done(tmp_path, 2, proc)
    rank1 = json.loads((tmp_path / "run" / "progress" / "rank1.json").read_text())
    os.kill(rank1["pid"], signal.SIGTERM)  # as a job scheduler may: to a worker, not the launcher
    k, _ = _stopped_at(tmp_path, proc, 143, "SIGTERM")
    code, d = _diagnose(tmp_path, capsys)
    assert (code, d["verdict"], d["step"]) == (0, "interrupted", k)
    assert {r["phase"] for r in d["progress"]} == {"stopped"}


def test_a_sigkilled_rank_is_named_by_the_run_and_by_diagnose(tmp_path, capsys):
    r = run_train(*COMMON, "--steps", "6", "--inject-fault", "kill@1:3", cwd=tmp_path, check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("paraseek:")]
    assert len(lines) == 1 and lines[0].startswith("paraseek: rank 1 was killed (signal 9: SIGKILL) at step 3")
    code, d = _diagnose(tmp_path, capsys)
    assert (code, d["verdict"], d["step"], d["rank"]) == (1, "killed", 3, 1)
    assert d["message"].startswith("rank 1 was killed (signal 9: SIGKILL) at step 3")


def test_sigkill_during_saves_never_corrupts_the_newest_checkpoint(tmp_path):
    """tests/dist/checkpoint_drill.py: 20 rounds of two ranks saving without pause, SIGKILLed at random moments,
    each resuming from what the last round left."""
    rounds = 20
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("checkpoint_drill.py")), str(tmp_path),
                        str(rounds), "0"], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=SRC))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    results, resumed = summary["rounds"], []
    assert len(results) == rounds + 1  # and one more resume of what the last kill left
    for n, result in enumerate(results):
        first = result["first"]
        assert all("resumed" in f for f in first), first  # no crash, no unreadable checkpoint
        assert first[0]["resumed"] == first[1]["resumed"] and all(f["exact"] for f in first), first
        resumed.append(first[0]["resumed"])
        if n and results[n - 1]["saved"] is not None:  # nothing that was saved is lost
            assert resumed[n] >= results[n - 1]["saved"]
    assert resumed == sorted(resumed) and resumed[-1] > 0
    assert sum(result["killed_mid_save"] for result in results) >= 1  # most rounds, in fact
    # A shard overwritten with junk of its own length passes every size check; loading it is one line per rank.
    for row in summary["damaged"]:
        assert "the checkpoint could not be read (UnpicklingError" in row["error"] and "\n" not in row["error"]
