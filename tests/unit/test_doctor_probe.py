"""probe.py: a measurement that hangs or crashes is reported and the others go on; gloo collectives on CPU give
bus bandwidths with nccl-tests' factors."""

import os
import time

import pytest

from paraseek.hardware import probe


def _worker(rank, world, port, tasks, q, cfg, backend):
    """Stand-in for the device worker: task ("t", what) -> done / hang / crash / error."""
    q.put(("ready", None, None))
    for k, (_, what) in tasks:
        if what == "hang":
            time.sleep(3600)
        elif what == "crash":
            os._exit(3)
        elif what == "raise":
            q.put(("error", k, "ValueError: bad"))
        else:
            q.put(("done", k, {"what": what, "pid": os.getpid()}))


def _never_ready(rank, world, port, tasks, q, cfg, backend):
    time.sleep(3600)


def cfg(**kw):
    return probe.ProbeConfig(timeout_s=1.5, startup_timeout_s=30.0, **kw)


def test_hang_and_crash_are_reported_and_the_rest_still_runs():
    tasks = [("t", "a"), ("t", "hang"), ("t", "b"), ("t", "crash"), ("t", "raise"), ("t", "c")]
    t0 = time.monotonic()
    res, err = probe.run_tasks(_worker, 1, tasks, cfg(), "gloo")
    assert time.monotonic() - t0 < 60
    assert {k: r["what"] for k, r in res.items()} == {0: "a", 2: "b", 5: "c"}
    assert err[1] == "did not finish within 1.5 s"
    assert err[3].startswith("a worker process died (exit codes [3])")
    assert err[4] == "ValueError: bad"
    assert len({res[0]["pid"], res[2]["pid"], res[5]["pid"]}) == 3  # fresh workers after each failure


def test_larger_sizes_of_a_hung_collective_are_skipped():
    tasks = [("c", "hang"), ("c", "x"), ("d", "y")]
    res, err = probe.run_tasks(_worker, 1, tasks, cfg(), "gloo", same_fate=lambda a, b: a[0] == b[0])
    assert set(res) == {2} and err[0] == "did not finish within 1.5 s" and err[1].startswith("skipped")


def test_workers_that_never_start():
    c = probe.ProbeConfig(timeout_s=1.0, startup_timeout_s=1.5)
    res, err = probe.run_tasks(_never_ready, 2, [("t", "a"), ("t", "b")], c, "gloo")
    assert res == {} and err == {0: "workers did not start within 1.5 s", 1: "workers did not start within 1.5 s"}


def test_busbw_factors_are_nccl_tests():
    assert probe.busbw_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    for c in ("all_gather", "reduce_scatter", "all_to_all"):
        assert probe.busbw_factor(c, 8) == pytest.approx(7 / 8)
    assert probe.busbw_factor("all_reduce", 2) == 1.0


def test_gloo_collectives_on_cpu():
    import torch  # not at module level: the spawned stand-in workers import this module

    if torch.cuda.is_available():
        pytest.skip("the CPU path")
    node = {"node": 0, "gpus": []}
    meas = probe.measure_local(node, probe.ProbeConfig(sizes=(2**16, 2**20), iters=3, warmup=1))
    assert meas["backend"] == "gloo" and meas["gpus"] == [] and meas["errors"] == []
    res = meas["collectives"]["intra_node"]["results"]
    assert set(res) == set(probe.COLLECTIVES)
    for name, rows in res.items():
        assert [r["bytes"] for r in rows] == [2**16, 2**20]
        for r in rows:
            assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * probe.busbw_factor(name, 2), abs=0.02)
            assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9, rel=0.05, abs=0.01)
