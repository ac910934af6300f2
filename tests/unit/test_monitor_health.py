"""Health checks: robust z-score spikes, the action table, non-finite gradients (plain and DTensor), stragglers."""

import random
import statistics

import pytest
import torch
import torch.distributed as dist

from paraseek.monitor.health import (
    HealthMonitor,
    StragglerDetector,
    anomaly_action,
    nonfinite_report,
    own_step_times,
    param_group,
    robust_z,
    step_time_stats,
)


def test_robust_z_against_the_textbook_formula():
    history = [2.0, 2.1, 1.9, 2.2, 2.05, 1.95, 50.0]  # one outlier barely moves median and MAD
    med = sorted(history)[3]
    mad = sorted(abs(v - med) for v in history)[3]
    assert robust_z(3.0, history) == pytest.approx((3.0 - med) / (1.4826 * mad))
    # MAD 0 (a flat history): no division by zero, wiggles stay small, a jump is still huge
    assert abs(robust_z(1.0001, [1.0] * 10)) < 1 and robust_z(1000.0, [1.0] * 10) > 1e5


def test_spike_flagged_noise_not():
    rng = random.Random(0)
    mon = HealthMonitor(window=20, z_threshold=6.0, min_history=5)
    events = []
    for step in range(1, 101):
        loss = 2.5 - step * 0.005 + rng.gauss(0, 0.03)  # a slowly falling, noisy curve
        grad = 1.0 + rng.gauss(0, 0.1)
        if step == 60:
            loss, grad = loss * 1e3, grad * 1e3
        events += mon.observe(step, loss, grad)
    assert [(e["event"], e["step"]) for e in events] == [("loss_spike", 60), ("grad_explosion", 60)]
    assert "robust sigmas above the median" in events[0]["detail"]


def test_no_verdict_before_min_history_and_nan_is_its_own_event():
    mon = HealthMonitor(min_history=5)
    assert mon.observe(1, 2.0, 1.0) == [] and mon.observe(2, 2000.0, 1.0) == []  # too little history to judge
    (e,) = mon.observe(3, float("nan"), float("inf"))
    assert e["event"] == "nan" and e["step"] == 3 and "loss is nan" in e["detail"] and "grad_norm is inf" in e["detail"]


def test_actions():
    spike, nan, slow = {"event": "loss_spike"}, {"event": "nan"}, {"event": "straggler"}
    assert anomaly_action([], "stop") == "ok" and anomaly_action([slow], "stop") == "ok"
    assert [anomaly_action([spike], a) for a in ("warn", "skip", "stop")] == ["warn", "skip", "stop"]
    assert [anomaly_action([nan], a) for a in ("warn", "skip", "stop")] == ["stop", "skip", "stop"]


def test_param_group_names():
    assert param_group("layers.3.mlp.experts.gate_proj") == "layers.3.mlp"
    assert param_group("layers.0._checkpoint_wrapped_module.self_attn.q_proj.weight") == "layers.0.self_attn"
    assert param_group("_orig_mod.norm.weight") == "norm"
    assert param_group("mtp.0.eh_proj.weight") == "mtp.0.eh_proj"


def _tiny_model():
    from paraseek.models import build_model, resolve_model

    args, _, _ = resolve_model("tiny-dense")
    torch.manual_seed(0)
    return build_model(args, "cpu", torch.float32)


def _backward(model):
    tokens = torch.randint(0, model.args.vocab_size, (1, 8))
    model(tokens).float().logsumexp(-1).mean().backward()


def test_nonfinite_report_names_the_first_bad_parameter():
    model = _tiny_model()
    _backward(model)
    assert nonfinite_report(model) is None
    names = [n for n, _ in model.named_parameters()]
    target = next(n for n in names if n.startswith("layers.1.mlp."))
    model.get_parameter(target).grad[0, 0] = float("nan")
    later = next(n for n in names if n.startswith("norm"))
    model.get_parameter(later).grad.fill_(float("inf"))
    report = nonfinite_report(model)
    assert report.startswith("first non-finite gradient in layers.1.mlp (" + target) and "2 of" in report


def test_nonfinite_report_on_fsdp2_dtensor_grads(tmp_path):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = _tiny_model()
        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
        _backward(model)
        grads = {n: p.grad for n, p in model.named_parameters()}
        target = next(n for n in grads if n.startswith("layers.0.self_attn."))
        assert isinstance(grads[target], DTensor)
        assert nonfinite_report(model, all_ranks=True) is None
        grads[target].to_local().view(-1)[3] = float("inf")
        assert nonfinite_report(model, all_ranks=True) == f"first non-finite gradient in layers.0.self_attn ({target})"
    finally:
        dist.destroy_process_group()


def test_straggler_flagged_once():
    rng = random.Random(1)
    det = StragglerDetector(world=4, window=5, slow_ratio=1.3, min_hits=3)
    hosts = ["a", "a", "b", "b"]
    events = []
    for step in range(1, 41):
        times = [0.1 + rng.uniform(0, 0.01) for _ in range(4)]
        if step >= 10:
            times[2] += 0.4
        e = det.observe(step, times, hosts)
        if e:
            events.append(e)
    assert len(events) == 1
    e = events[0]
    assert (e["event"], e["step"], e["rank"], e["host"]) == ("straggler", 12, 2, "b")
    assert "rank 2 (host b) was the slowest in 3 of the last 5 steps" in e["detail"]


def test_noise_and_rotating_slowness_are_not_stragglers():
    rng = random.Random(2)
    det = StragglerDetector(world=4)
    for step in range(1, 101):
        times = [0.1 + rng.uniform(0, 0.02) for _ in range(4)]
        times[step % 4] *= 2  # each rank slow once in a while (GC, a checkpoint write): nobody persistently
        assert det.observe(step, times) is None


def test_own_step_times_remove_the_wait_for_the_last_rank():
    # rank 1 slept 0.4 s before the first collective; rank 0 waited for it there, so both steps took 0.5 s.
    assert own_step_times([0.5, 0.5], [0.01, 0.41]) == pytest.approx([0.1, 0.5])
    stats = step_time_stats([0.1, 0.5, 0.2])
    assert stats == {"step_time_min_s": 0.1, "step_time_median_s": statistics.median([0.1, 0.5, 0.2]),
                     "step_time_max_s": 0.5, "slowest_rank": 1}
