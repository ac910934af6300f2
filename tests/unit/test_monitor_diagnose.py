"""`paraseek diagnose` on synthetic run folders: hang, crash, NaN, a finished run, Flight Recorder dumps."""

import argparse
import json
import pickle

import pytest

from paraseek.errors import UserError
from paraseek.monitor.diagnose import diagnose, register
from paraseek.monitor.progress import ProgressRecorder, record_killed


def _progress(run_dir, *rows):
    folder = run_dir / "progress"
    folder.mkdir(parents=True, exist_ok=True)
    for rank, step, phase in rows:
        (folder / f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "host": f"node{rank // 2}", "step": step, "phase": phase, "time": 1000.0 + step}))


def _events(run_dir, *events, name="metrics.jsonl"):
    rows = [{"step": 1, "loss": 2.0}] + list(events)
    (run_dir / name).write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"event": "cut sh')  # last line torn


def _cli(*argv):
    p = argparse.ArgumentParser(prog="paraseek")
    register(p.add_subparsers())
    ns = p.parse_args(["diagnose", *argv])
    return ns.func(ns)


def test_hang_from_progress_and_a_timeout_report(tmp_path, capsys):
    _progress(tmp_path, (0, 4, "before_step"), (1, 3, "after_step"), (2, 4, "before_step"), (3, 4, "before_step"))
    d = diagnose(tmp_path)  # ranks apart, but nobody timed out: the job was stopped from outside
    assert (d["verdict"], d["step"], d["rank"]) == ("stopped", 4, 1)
    assert "at that time rank 1 (host node0) did not reach the collective of step 4" in d["message"]
    ProgressRecorder(tmp_path, 0, "node0").record_failure(  # rank 0 timed out waiting
        RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation"), 4)
    d = diagnose(tmp_path)
    assert (d["verdict"], d["step"], d["rank"]) == ("hang", 4, 1)
    assert d["message"] == ("rank 1 (host node0) did not reach the collective of step 4 (last seen: step 3 "
                            "'after_step'); ranks 0, 2, 3 reached it")
    assert _cli(str(tmp_path)) == 1  # a failed run
    out = capsys.readouterr().out
    assert out.splitlines()[1].strip().startswith("rank 1 (host node0) did not reach the collective of step 4")


def test_hang_event_wins_and_json_output(tmp_path, capsys):
    _progress(tmp_path, (0, 4, "before_step"), (1, 3, "after_step"))
    _events(tmp_path, {"event": "straggler", "step": 2, "rank": 1, "detail": "rank 1 slow"},
            {"event": "hang", "step": 4, "rank": 1, "detail": "rank 1 (host x) did not reach the collective of step 4"})
    assert _cli(str(tmp_path), "--json") == 1
    d = json.loads(capsys.readouterr().out)
    assert (d["verdict"], d["step"], d["rank"], d["message"]) == (
        "hang", 4, 1, "rank 1 (host x) did not reach the collective of step 4")
    assert [e["event"] for e in d["events"]] == ["straggler", "hang"]


def test_crash_names_the_first_failure_not_its_victims(tmp_path):
    _progress(tmp_path, (0, 3, "before_step"), (1, 3, "before_step"))
    crashed, victim = ProgressRecorder(tmp_path, 1, "node0"), ProgressRecorder(tmp_path, 0, "node0")
    crashed.record_failure(RuntimeError("injected crash on rank 1 at step 3 (--inject-fault crash@1:3)"), 3)
    victim.record_failure(RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234"), 3)
    d = diagnose(tmp_path)
    assert (d["verdict"], d["step"], d["rank"]) == ("crash", 3, 1)
    assert d["message"] == ("rank 1 (host node0) failed at step 3: RuntimeError: injected crash on rank 1 at step 3 "
                            "(--inject-fault crash@1:3) (traceback in errors/rank1.txt)")
    (tmp_path / "errors" / "rank1.txt").write_text("Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory.\n")
    d = diagnose(tmp_path)
    assert (d["verdict"], d["rank"]) == ("oom", 1)


def test_nan_stop(tmp_path):
    _progress(tmp_path, (0, 3, "before_step"), (1, 3, "before_step"))
    _events(tmp_path, {"event": "nan", "step": 3, "rank": None, "detail": "loss is nan"})
    ProgressRecorder(tmp_path, 0, "node0").record_failure(
        type("UserError", (Exception,), {})("the loss became nan at step 3"), 3)
    d = diagnose(tmp_path)
    assert (d["verdict"], d["step"]) == ("nan", 3)
    assert d["message"] == "the loss or the gradients became NaN/Inf at step 3: loss is nan"


def test_finished_run_and_unfinished_without_failure(tmp_path):
    _progress(tmp_path, (0, 10, "done"), (1, 10, "done"))
    _events(tmp_path, {"event": "model_state", "step": 1, "rank": None, "detail": "bytes per rank"},
            {"event": "nan", "step": 3, "rank": None, "detail": "loss is nan (update skipped)"})
    d = diagnose(tmp_path)
    assert d["verdict"] == "ok" and d["message"] == "no failure found: the run finished at step 10 (events: nan)"
    _progress(tmp_path, (0, 7, "after_step"), (1, 7, "after_step"))
    (tmp_path / "metrics.jsonl").unlink()
    d = diagnose(tmp_path)
    assert (d["verdict"], d["step"]) == ("stopped", 7)
    empty = tmp_path / "empty"
    (empty / "progress").mkdir(parents=True)  # a run that died before its first record
    assert diagnose(empty)["message"] == "no failure found"


def test_missing_folder_and_other_folders_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no such folder"):
        diagnose(tmp_path / "nope")
    (tmp_path / "checkpoints" / "step-000002").mkdir(parents=True)
    with pytest.raises(UserError, match="checkpoints: not a run folder"):
        diagnose(tmp_path / "checkpoints")


def test_a_killed_rank_and_a_run_stopped_on_request(tmp_path, capsys):
    _progress(tmp_path, (0, 3, "before_step"), (1, 2, "after_step"))
    victim = ProgressRecorder(tmp_path, 0, "node0")
    victim.record_failure(RuntimeError("[gloo] Read error [127.0.0.1]:1234: Connection reset by peer"), 3, count=False)
    record_killed(tmp_path, 1, 9, since=0.0)  # what the launcher writes for a SIGKILLed worker
    d = diagnose(tmp_path)
    assert (d["verdict"], d["step"], d["rank"]) == ("killed", 3, 1)
    assert d["message"].startswith("rank 1 was killed (signal 9: SIGKILL) at step 3 on host node0; SIGKILL is what "
                                   "the kernel's out-of-memory killer sends")
    assert _cli(str(tmp_path)) == 1
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    _progress(stopped, (0, 5, "stopped"), (1, 5, "stopped"))
    _events(stopped, {"event": "stop", "step": 5, "rank": None, "signal": 15,
                      "detail": "stopped by SIGTERM after step 5, saved ck/step-000005; resume with: paraseek train"})
    d = diagnose(stopped)
    assert (d["verdict"], d["step"]) == ("interrupted", 5) and d["message"].startswith("stopped by SIGTERM after step 5")
    assert _cli(str(stopped)) == 0  # not a failure: the run saved and can resume


def _entry(seq, name, state):
    return {"collective_seq_id": seq, "profiling_name": name, "state": state, "process_group": ("0", "default_pg"),
            "is_p2p": False, "record_id": seq}


def test_flight_recorder_dumps(tmp_path, capsys):
    fr = tmp_path / "flight_recorder"
    fr.mkdir()
    (fr / "rank0").write_bytes(pickle.dumps({"version": "2.10", "entries": [
        _entry(1, "nccl:all_gather", "completed"), _entry(2, "nccl:reduce_scatter", "started")]}))
    (fr / "rank1").write_bytes(pickle.dumps({"version": "2.10",
                                             "entries": [_entry(1, "nccl:all_gather", "completed")]}))
    (fr / "rank2").write_text("{not a pickle")
    d = diagnose(tmp_path)
    by_rank = {x["rank"]: x for x in d["flight_recorder"]}
    assert by_rank[0]["last"]["0:default_pg"] == {"seq": 2, "name": "nccl:reduce_scatter", "state": "started"}
    assert by_rank[2]["error"].startswith("unreadable")
    _cli(str(tmp_path))
    out = capsys.readouterr().out
    assert "in process group 0:default_pg, rank(s) 1 issued fewer collectives than the others (#1 vs #2)" in out


def test_only_the_latest_attempt_counts(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "old")
    for rank in range(4):  # a 4-rank attempt that crashed at step 3 ...
        ProgressRecorder(tmp_path, rank, "h").mark(3, "before_step")
    ProgressRecorder(tmp_path, 3, "h").record_failure(RuntimeError("boom"), 3)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "new")
    for rank in range(2):  # ... resumed on 2 ranks, which finished
        ProgressRecorder(tmp_path, rank, "h").mark(6, "done")
    d = diagnose(tmp_path)
    assert d["verdict"] == "ok" and [r["rank"] for r in d["progress"]] == [0, 1] and d["errors"] == []
