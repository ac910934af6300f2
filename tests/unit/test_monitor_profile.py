"""--profile-steps: interval math against a brute-force count, summaries of synthetic traces, one real CPU profile."""

import json
import random

import pytest
import torch
import torch.distributed as dist

from paraseek.errors import UserError
from paraseek.monitor.profile import (
    StepProfiler,
    format_summary,
    intersect,
    length,
    parse_profile_steps,
    subtract,
    summarize_events,
    union,
)


def _points(intervals):
    """Brute force: the integer points t with s <= t < e for some interval."""
    return {t for s, e in intervals for t in range(int(s), int(e))}


def test_interval_math_matches_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        a = [(s, s + rng.randint(0, 15)) for s in (rng.randint(0, 100) for _ in range(rng.randint(0, 6)))]
        b = [(s, s + rng.randint(0, 15)) for s in (rng.randint(0, 100) for _ in range(rng.randint(0, 6)))]
        assert _points(union(a)) == _points(a) and length(a) == len(_points(a))
        assert _points(intersect(a, b)) == _points(a) & _points(b)
        assert _points(subtract(a, b)) == _points(a) - _points(b)
        assert all(s1 < e1 < s2 for (s1, e1), (s2, _) in zip(union(a), union(a)[1:]))


def _x(name, ts, dur, cat, tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "pid": 0, "tid": tid}


def test_gpu_summary():
    # one step [0, 40) us: compute kernels [0,10) and [20,30) on one stream, NCCL [5,25) on another
    events = [_x("ProfilerStep#5", 0, 40, "user_annotation"), _x("ProfilerStep#5", 1, 45, "gpu_user_annotation"),
              _x("sm90_xmma_gemm", 0, 10, "kernel", 7), _x("sm90_xmma_gemm", 20, 10, "kernel", 7),
              _x("ncclDevKernel_AllGather_RING_LL", 5, 20, "kernel", 13), _x("aten::mm", 0, 35, "cpu_op")]
    s = summarize_events(events)
    assert s["device"] == "cuda" and s["steps"] == 1
    assert (s["span_ms"], s["compute_ms"], s["comm_ms"], s["overlap_ms"], s["idle_ms"]) == pytest.approx(
        (0.040, 0.020, 0.020, 0.010, 0.010))
    assert s["top"] == [{"name": "sm90_xmma_gemm", "total_ms": 0.02, "count": 2},
                        {"name": "ncclDevKernel_AllGather_RING_LL", "total_ms": 0.02, "count": 1}]
    assert "compute 0.0 ms (50%) | comm 0.0 ms (50%) | overlap 0.0 ms (25%) | idle 0.0 ms (25%)" in format_summary(0, s)


def test_cpu_summary_nesting_and_threads():
    # main thread: an op [0,10) that waits in a collective [2,6) inside it; backward thread computes [4,8)
    events = [_x("ProfilerStep#1", 0, 20, "user_annotation"),
              _x("aten::linear", 0, 10, "cpu_op"), _x("aten::addmm", 0, 2, "cpu_op"),
              _x("c10d::allreduce_", 2, 4, "cpu_op"), _x("record_param_comms", 2, 3, "cpu_op"),
              _x("aten::mm", 4, 4, "cpu_op", tid=2), _x("aten::broadcast_tensors", 14, 1, "cpu_op"),
              _x("gloo:all_gather", 11, 2, "user_annotation", tid=3), _x("FSDP::pre_forward", 0, 20, "user_annotation")]
    s = summarize_events(events)
    assert s["device"] == "cpu"
    # compute: [0,2) U [6,10) on thread 1, [4,8) on thread 2, [14,15) -> [0,2) U [4,10) U [14,15) = 9 us
    # comm: [2,6) and gloo's worker thread [11,13) = 6 us; overlap with thread 2's compute: [4,6) = 2 us;
    # busy 13 of 20 -> idle 7 (annotations that are not collectives, like FSDP::pre_forward, are not busy time)
    assert (s["compute_ms"], s["comm_ms"], s["overlap_ms"], s["idle_ms"]) == pytest.approx((0.009, 0.006, 0.002, 0.007))
    top = {t["name"]: t["total_ms"] for t in s["top"]}  # self times: linear 10 - 2 - 4 = 4
    assert top == pytest.approx({"aten::linear": 0.004, "aten::mm": 0.004, "aten::addmm": 0.002,
                                 "record_param_comms": 0.003, "c10d::allreduce_": 0.001,
                                 "aten::broadcast_tensors": 0.001})


def test_parse_profile_steps():
    assert parse_profile_steps("5:7") == (5, 7) and parse_profile_steps("3") == (3, 3)
    for bad in ("7:5", "0:2", "a:b", ""):
        with pytest.raises(UserError, match="expected A:B"):
            parse_profile_steps(bad)


def test_real_cpu_profile(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        prof = StepProfiler("2:3", tmp_path, rank=0, first_step=1)
        summaries = []
        for step in range(1, 6):
            model(torch.randn(32, 64)).square().mean().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
            opt.zero_grad()
            summaries.append(prof.step(step))
    finally:
        dist.destroy_process_group()
    assert [s is not None for s in summaries] == [False, False, True, False, False]
    s = summaries[2]
    trace = json.loads((tmp_path / "profile" / "rank0.json").read_text())
    marks = sorted(e["name"] for e in trace["traceEvents"]
                   if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep"))
    assert marks == ["ProfilerStep#2", "ProfilerStep#3"] and s["steps"] == 2
    assert json.loads((tmp_path / "profile" / "rank0.summary.json").read_text())["steps"] == 2
    assert s["compute_ms"] > 0 and s["comm_ms"] > 0
    busy = s["compute_ms"] + s["comm_ms"] - s["overlap_ms"]
    assert busy + s["idle_ms"] == pytest.approx(s["span_ms"], rel=1e-6)
    names = {t["name"] for t in s["top"]}
    assert names & {"aten::addmm", "aten::mm", "aten::gelu", "aten::gelu_backward", "c10d::allreduce_"}
    assert format_summary(0, s).startswith("profile rank 0 (cpu, ")


def _cuda_worker(rank, store_path, run_dir):
    import os

    from paraseek.monitor.health import gather_step_times

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(64 * 2**20, device="cuda")
    prof = StepProfiler("2:3", run_dir, rank, first_step=1)
    for step in range(1, 4):
        work = dist.all_reduce(g, async_op=True)  # communication overlapping the matmuls
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        work.wait()
        torch.cuda.synchronize()
        prof.step(step)
    times = gather_step_times(0.5, 0.1 * rank)
    assert times == pytest.approx([0.4, 0.5])
    dist.destroy_process_group()
    os._exit(0)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_real_cuda_profile(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_cuda_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        s = json.loads((tmp_path / "profile" / f"rank{rank}.summary.json").read_text())
        print(format_summary(rank, s))
        assert s["device"] == "cuda" and s["steps"] == 2
        assert s["compute_ms"] > 0 and s["comm_ms"] > 0 and s["overlap_ms"] > 0
        assert any("nccl" in t["name"].lower() for t in s["top"])


def test_gpu_idle_names_what_the_host_was_in():
    # kernels [0,10) and [30,40); the GPU idles [10,30). On the host: an op [5,25) that waits in
    # cudaStreamSynchronize [8,20) inside it, then nothing [25,30): Python between ops.
    events = [_x("ProfilerStep#2", 0, 40, "user_annotation"),
              _x("triton_poi_fused", 0, 10, "kernel", 7), _x("triton_poi_fused", 30, 10, "kernel", 7),
              _x("aten::item", 5, 20, "cpu_op"), _x("cudaStreamSynchronize", 8, 12, "cuda_runtime"),
              _x("cudaLaunchKernel", 26, 2, "cuda_runtime")]
    s = summarize_events(events)
    assert s["idle_ms"] == pytest.approx(0.020)
    idle = {t["name"]: t["total_ms"] for t in s["idle_host"]}
    # sync [10,20) (its part after the kernel ended), item's own [20,25), launch [26,28), no op [25,26) U [28,30)
    assert idle == pytest.approx({"cudaStreamSynchronize": 0.010, "aten::item": 0.005, "cudaLaunchKernel": 0.002,
                                  "(no op: Python)": 0.003})
    assert sum(idle.values()) == pytest.approx(s["idle_ms"])
    assert "while the GPU idled the host was in: cudaStreamSynchronize 0.01 ms" in format_summary(0, s)
