"""Progress records and hang explanations; the real thing on a 2-process gloo group where rank 1 skips a collective."""

import json
import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paraseek.monitor.progress import (
    ProgressRecorder,
    comm_timeout_message,
    explain_hang,
    hang_event,
    is_comm_timeout,
    missing_ranks,
    read_progress,
)


def test_mark_writes_files_atomically(tmp_path):
    rec = [ProgressRecorder(tmp_path, r, host=f"h{r}") for r in range(3)]
    rec[0].mark(4, "before_step")
    rec[1].mark(3, "after_step")
    rec[1].mark(4, "before_step")
    got = read_progress(tmp_path)
    assert [(r["rank"], r["host"], r["step"], r["phase"]) for r in got] == [(0, "h0", 4, "before_step"),
                                                                            (1, "h1", 4, "before_step")]
    assert sorted(p.name for p in (tmp_path / "progress").iterdir()) == ["rank0.json", "rank1.json"]  # no tmp left
    assert [r["rank"] for r in read_progress(tmp_path, world=3)] == [0, 1]


def test_store_records_and_first_failure():
    store = dist.HashStore()
    r0, r1 = ProgressRecorder(None, 0, "a", store), ProgressRecorder(None, 1, "b", store)
    r0.mark(5, "before_step")
    r1.mark(4, "after_step")
    assert [(r["rank"], r["step"]) for r in read_progress(store, world=3)] == [(0, 5), (1, 4)]
    assert r1.record_failure(RuntimeError("boom")) is True
    assert r0.record_failure(RuntimeError("Connection closed by peer")) is False


def test_record_failure_writes_a_report(tmp_path):
    rec = ProgressRecorder(tmp_path, 1, host="h")
    rec.mark(3, "before_step")
    try:
        raise RuntimeError("injected crash on rank 1 at step 3")
    except RuntimeError as e:
        assert rec.record_failure(e)
    head, tb = (tmp_path / "errors" / "rank1.txt").read_text().split("\n", 1)
    head = json.loads(head)
    assert (head["rank"], head["host"], head["step"]) == (1, "h", 3)
    assert head["exception"] == "RuntimeError: injected crash on rank 1 at step 3"
    assert tb.startswith("Traceback (most recent call last)")


def _records(*rows):
    return [{"rank": r, "host": h, "step": s, "phase": p, "time": t} for r, h, s, p, t in rows]


def test_explain_hang():
    recs = _records((0, "a", 4, "before_step", 100.0), (1, "b", 3, "after_step", 78.7), (2, "a", 4, "after_step", 99.0))
    assert missing_ranks(recs, 4) == [1] and missing_ranks(recs, 4, world=4) == [1, 3]
    assert explain_hang(recs, 4, now=100.0) == (
        "rank 1 (host b) did not reach the collective of step 4 (last seen: step 3 'after_step' 21.3 s ago); "
        "ranks 0, 2 reached it")
    assert "rank 3 did not reach the collective of step 4 (no progress recorded)" in explain_hang(recs, 4, world=4)
    assert explain_hang(recs[:1], 4).startswith("every rank reached step 4")
    e = hang_event(recs, 4, now=100.0)
    assert (e["event"], e["step"], e["rank"], e["missing_ranks"]) == ("hang", 4, 1, [1])


def test_timeout_recognition():
    assert is_comm_timeout(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv"))
    assert is_comm_timeout(dist.DistBackendError("Watchdog caught collective operation timeout: WorkNCCL(...)"))
    assert not is_comm_timeout(RuntimeError("Connection closed by peer")) and not is_comm_timeout(ValueError("timeout"))


def _worker(rank, store_path, run_dir, out):
    from paraseek.monitor.health import gather_hosts, gather_step_times
    from paraseek.monitor.progress import dump_flight_recorder, set_comm_timeout

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    store = dist.distributed_c10d._get_default_store()
    rec = ProgressRecorder(run_dir, rank, host=f"host{rank}", store=store)
    hosts = gather_hosts()
    # own time: rank 1 reached the first collective 0.4 s into a 0.5 s step, rank 0 waited there for it
    times = gather_step_times(0.5, ready_s=[0.01, 0.41][rank])
    x = torch.ones(1)
    for step in (1, 2):  # warm-up steps at the default (long) timeout
        rec.mark(step, "before_step")
        dist.all_reduce(x)
        rec.mark(step, "after_step")
    set_comm_timeout(3)
    if rank == 1:  # "hangs" before step 3: never reaches its collective, then leaves when rank 0 is done
        store.wait(["test/reported"], timedelta(seconds=60))
        os._exit(0)
    rec.mark(3, "before_step")
    try:
        dist.all_reduce(x)
        result = {"error": "the collective did not time out"}
    except RuntimeError as e:
        records = rec.read(2)
        result = {"timeout": is_comm_timeout(e), "message": comm_timeout_message(e, 3, records, 2, timeout_s=3),
                  "event": hang_event(records, 3, 2), "hosts": hosts, "times": times,
                  "fr": str(dump_flight_recorder(run_dir, rank))}
        with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(result["event"]) + "\n")
        rec.record_failure(e, 3)
    with open(out, "w") as f:
        json.dump(result, f)
    store.set("test/reported", "1")
    os._exit(0)  # no destroy_process_group after a timed-out collective


def test_real_gloo_timeout_names_the_missing_rank(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "result.json"
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(run_dir), str(out)), nprocs=2)
    result = json.loads(out.read_text())
    assert result["timeout"], result
    assert result["message"].startswith("a collective timed out at step 3 after 3 s: rank 1 (host host1) did not "
                                        "reach the collective of step 3 (last seen: step 2 'after_step'")
    assert result["message"].endswith("rank 0 reached it")
    assert (result["event"]["event"], result["event"]["step"], result["event"]["rank"]) == ("hang", 3, 1)
    assert result["hosts"] == [socket.gethostname()] * 2
    assert result["times"] == pytest.approx([0.1, 0.5])

    # the dead run read back from its folder says the same, with and without the hang event
    from paraseek.monitor.diagnose import diagnose, format_diagnosis

    d = diagnose(run_dir)
    assert (d["verdict"], d["step"], d["rank"]) == ("hang", 3, 1)
    assert "rank 1 (host host1) did not reach the collective of step 3" in d["message"]
    os.remove(run_dir / "metrics.jsonl")
    d = diagnose(run_dir)
    assert (d["verdict"], d["step"], d["rank"]) == ("hang", 3, 1)
    assert "rank 1 (host host1) did not reach the collective of step 3" in d["message"]
    print(format_diagnosis(d))
    if result["fr"] != "None":  # this PyTorch's Flight Recorder: rank 0's last collective is the timed-out one
        (fr,) = d["flight_recorder"]
        assert fr["rank"] == 0 and any("all_reduce" in last["name"] for last in fr["last"].values())
