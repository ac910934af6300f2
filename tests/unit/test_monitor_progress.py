"""Progress records and hang explanations; the real thing on a 2-process gloo group where rank 1 skips a collective."""

import json
import os
import socket
import time
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
    # a NaN in a gradient shard that only rank 1 holds: with all_ranks both ranks name it
    from paraseek.monitor.health import nonfinite_report

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model(torch.ones(1, 4)).sum().backward()
    if rank == 1:
        model[1].weight.grad[0, 0] = float("nan")
    nonfinite = nonfinite_report(model, all_ranks=True)
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
                  "event": hang_event(records, 3, 2), "hosts": hosts, "times": times, "nonfinite": nonfinite,
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
    assert result["nonfinite"] == "first non-finite gradient in 1 (1.weight)"

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


def test_report_failure_prints_once_and_writes_the_event(tmp_path):
    from paraseek.monitor.progress import report_failure

    store, jsonl = dist.HashStore(), tmp_path / "metrics.jsonl"
    crashed, victim = ProgressRecorder(tmp_path, 1, "h1", store), ProgressRecorder(tmp_path, 0, "h0", store)
    crashed.mark(2, "after_step")  # the crash comes before step 3's first mark: it belongs to step 3
    victim.mark(3, "before_step")
    message = report_failure(crashed, RuntimeError("injected crash on rank 1 at step 3\nmore"), 2, jsonl=jsonl)
    assert message == (f"rank 1 (host h1) failed at step 3: RuntimeError: injected crash on rank 1 at step 3 "
                       f"(traceback: {tmp_path / 'errors' / 'rank1.txt'})")
    assert report_failure(victim, RuntimeError("Connection reset by peer"), 2, jsonl=jsonl) is None
    (event,) = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert (event["event"], event["step"], event["rank"]) == ("crash", 3, 1)

    # a resumed attempt in the same folder: its own stale report is gone, the old event no longer counts
    from paraseek.monitor.diagnose import diagnose

    assert diagnose(tmp_path)["verdict"] == "crash"
    for rank in (0, 1):
        ProgressRecorder(tmp_path, rank, f"h{rank}").mark(5, "done")
    assert not (tmp_path / "errors" / "rank1.txt").exists()
    d = diagnose(tmp_path)
    assert d["verdict"] == "ok" and d["events"] == []


def test_report_failure_on_a_timeout_names_the_missing_rank(tmp_path):
    from paraseek.monitor.progress import report_failure

    store = dist.HashStore()
    waiting, hung = ProgressRecorder(tmp_path, 0, "h0", store), ProgressRecorder(tmp_path, 1, "h1", store)
    hung.mark(3, "after_step")
    waiting.mark(4, "before_step")
    message = report_failure(waiting, RuntimeError("Timed out waiting 20000ms for recv operation"), 2, timeout_s=20,
                             jsonl=tmp_path / "m.jsonl")
    assert message.startswith("a collective timed out at step 4 after 20 s: rank 1 (host h1) did not reach the "
                              "collective of step 4")
    event = json.loads((tmp_path / "m.jsonl").read_text())
    assert (event["event"], event["step"], event["rank"]) == ("hang", 4, 1)


def _nccl_worker(rank, store_path, run_dir):
    from paraseek.monitor.progress import flight_recorder_env, set_comm_timeout

    os.environ.update(flight_recorder_env(run_dir))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    store = dist.distributed_c10d._get_default_store()
    rec = ProgressRecorder(run_dir, rank, host=f"gpu{rank}", store=store)
    x = torch.ones(1024, device="cuda")
    for step in (1, 2):
        rec.mark(step, "before_step")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        rec.mark(step, "after_step")
    set_comm_timeout(5)
    if rank == 1:  # skips step 3's collective; stays alive so that its peer's timeout is the only failure
        time.sleep(40)
        os._exit(0)
    rec.mark(3, "before_step")
    try:
        dist.all_reduce(x)
        torch.cuda.synchronize()  # the NCCL watchdog times out, dumps and (by default) aborts this process
    except Exception as e:  # when the watchdog lets the error surface instead
        from paraseek.monitor.progress import report_failure

        report_failure(rec, e, 2, timeout_s=5, jsonl=os.path.join(run_dir, "metrics.jsonl"))
    os._exit(1)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_timeout_leaves_records_diagnose_reads(tmp_path):
    from paraseek.monitor.diagnose import diagnose, format_diagnosis

    run_dir = tmp_path / "run"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_nccl_worker, args=(r, str(tmp_path / "store"), str(run_dir))) for r in range(2)]
    t = time.monotonic()
    for p in procs:
        p.start()
    procs[0].join(120)
    print(f"rank 0 ended after {time.monotonic() - t:.0f} s with exit code {procs[0].exitcode}")
    procs[1].join(60)
    d = diagnose(run_dir)
    print(format_diagnosis(d))
    assert procs[0].exitcode != 0
    assert (d["verdict"], d["step"], d["rank"]) == ("hang", 3, 1)
    assert "rank 1 (host gpu1) did not reach the collective of step 3" in d["message"]
    dumps = {x["rank"]: x for x in d["flight_recorder"]}
    assert 0 in dumps and "last" in dumps[0], d["flight_recorder"]  # the watchdog's dump on timeout
