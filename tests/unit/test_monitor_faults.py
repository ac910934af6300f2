"""--inject-fault: parsing, one-line errors, and what each hook does on which rank and step."""

import pytest
import torch

from paraseek.errors import UserError
from paraseek.monitor.faults import SPIKE_FACTOR, Fault, FaultInjector, check_faults, parse_faults


def test_parse_every_form():
    assert parse_faults("nan@3, spike@7,hang@1:4,slow@1:400,crash@0:2,kill@1:3") == [
        Fault("nan", step=3), Fault("spike", step=7), Fault("hang", step=4, rank=1), Fault("slow", rank=1, ms=400),
        Fault("crash", step=2, rank=0), Fault("kill", step=3, rank=1),
    ]
    assert parse_faults("") == [] and parse_faults(None) == []
    assert [str(f) for f in parse_faults("hang@1:4,slow@1:400,nan@3")] == ["hang@1:4", "slow@1:400", "nan@3"]


@pytest.mark.parametrize("spec, message", [
    ("nan", "expected nan@STEP, spike@STEP"),
    ("boom@3", "'boom@3': expected nan@STEP"),
    ("nan@x", "expected nan@STEP"),
    ("hang@3", "expected hang@RANK:STEP"),
    ("slow@1", "expected slow@RANK:MS"),
    ("nan@1:2", "nan takes a step only"),
    ("crash@1:0", "steps count from 1"),
    ("nan@3,,spike@-1", "'spike@-1'"),
])
def test_bad_specs_are_one_line_user_errors(spec, message):
    with pytest.raises(UserError, match=message) as e:
        parse_faults(spec)
    assert "\n" not in str(e.value)


def test_check_against_the_run():
    check_faults(parse_faults("hang@1:4"), world=2, steps=10)
    with pytest.raises(UserError, match="rank 2 does not exist"):
        check_faults(parse_faults("crash@2:3"), world=2, steps=10)
    with pytest.raises(UserError, match="after the last step"):
        check_faults(parse_faults("nan@11"), world=2, steps=10)


def _loss(w):
    return (w * torch.arange(3.0)).sum()


def test_loss_hook_nan_and_spike_reach_the_gradients():
    inj = FaultInjector("nan@3,spike@5", rank=1)
    for step in (1, 3, 5):
        w = torch.ones(3, requires_grad=True)
        loss = inj.loss_hook(step, _loss(w))
        loss.backward()
        if step == 1:
            assert loss.item() == 3.0 and w.grad.tolist() == [0.0, 1.0, 2.0]
        elif step == 3:
            assert torch.isnan(loss) and torch.isnan(w.grad).all()
        else:
            assert loss.item() == 3.0 * SPIKE_FACTOR and w.grad.tolist() == [0.0, SPIKE_FACTOR, 2 * SPIKE_FACTOR]


def test_before_step_fires_on_its_rank_and_step_only():
    slept = []

    class Escape(Exception):
        pass

    def fake_sleep(seconds):
        slept.append(seconds)
        if seconds == 1.0:  # the hang's sleep: leave the endless loop
            raise Escape

    faults = parse_faults("slow@1:400,crash@1:3,hang@0:4")
    r0, r1 = FaultInjector(faults, 0, sleep=fake_sleep), FaultInjector(faults, 1, sleep=fake_sleep)
    for step in (1, 2, 3):
        r0.before_step(step)
    assert slept == []
    r1.before_step(1)
    r1.before_step(2)
    assert slept == [0.4, 0.4]
    with pytest.raises(RuntimeError, match="injected crash on rank 1 at step 3"):
        r1.before_step(3)
    with pytest.raises(Escape):
        r0.before_step(4)
    assert slept[-1] == 1.0
    with pytest.raises(RuntimeError, match="injected hang on rank 0 at step 4 ended by a signal"):
        FaultInjector(faults, 0, sleep=fake_sleep, signalled=lambda: 15).before_step(4)
    assert not FaultInjector("", 0) and FaultInjector("nan@1", 0).describe() == "nan@1"
