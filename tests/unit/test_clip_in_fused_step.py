"""Gradient clipping handed to a fused AdamW (`grad_scale`, divided inside its kernel) updates the weights as
clipping the gradients first and stepping does: with the clip active and inactive, on the CPU and (gpu) CUDA."""

import pytest
import torch

from paraseek.train.optim import clip_grad_norm


def stepped(fused: bool, grad_size: float, device: str = "cpu") -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused, foreach=not fused)
    params = list(model.parameters())
    for _ in range(3):  # a few steps, so Adam's moments hold clipped gradients too
        (model(torch.randn(4, 16, device=device)).square().sum() * grad_size).backward()
        norm = clip_grad_norm(params, 1.0, fused_optimizer=opt if fused else None)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norm, [p.detach().clone() for p in params]


@pytest.mark.parametrize("grad_size", [100.0, 1e-4])  # clip active (norm >> 1) and inactive (norm << 1)
def test_clip_in_the_fused_step_equals_clip_then_step(grad_size):
    check_clip_in_fused_step(grad_size, "cpu")


def check_clip_in_fused_step(grad_size: float, device: str) -> None:
    norm_ref, ref = stepped(False, grad_size, device)
    norm, got = stepped(True, grad_size, device)
    assert (norm > 1.0) == (grad_size > 1.0)
    torch.testing.assert_close(norm, norm_ref)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("grad_size", [100.0, 1e-4])
def test_clip_in_the_fused_cuda_step_equals_clip_then_step(grad_size):
    check_clip_in_fused_step(grad_size, "cuda")
