"""Comparisons the numerical tests share (tests/conftest.py puts this folder on the import path)."""

import torch


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| over the tensor (in fp32): one scale for the whole tensor, so elements near zero
    do not blow the ratio up."""
    got, ref = got.float(), ref.float()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor (gathered), a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def normal_init(module: torch.nn.Module, std: float) -> torch.nn.Module:
    """Every parameter of a module built on its own (a MoE layer, say) drawn from N(0, std^2) from torch's global
    generator; its buffers (routing bias, counts) start at zero when it is built on a real device."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, std)
    return module
