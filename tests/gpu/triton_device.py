"""Where the Triton kernel tests run: on CUDA, or through Triton's interpreter on CPU when
PARASEEK_TRITON_INTERPRET=1 (fp32 only), else skipped. Imported first by those test modules: the interpreter is
chosen when the kernels are decorated, so the variable must be set before triton is imported."""

import os
import zlib

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERPRET = not CUDA and os.environ.get("PARASEEK_TRITON_INTERPRET") == "1"
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"
if not (CUDA or INTERPRET):
    pytest.skip("needs CUDA (or PARASEEK_TRITON_INTERPRET=1 for Triton's interpreter on CPU)", allow_module_level=True)
pytest.importorskip("triton")

from paraseek.infer import ops  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]  # the interpreter cannot run bf16


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max|got - want| / max|want|."""
    got, want = got.float(), want.float()
    assert got.shape == want.shape
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.fixture(autouse=True)
def reference_ops():
    """The ops modules' functions are the plain-torch references inside these tests; the kernel modules' are
    called directly."""
    before = ops.kernels_on()
    ops.use_kernels(False)
    yield
    ops.use_kernels(before)


def gen(*key) -> torch.Generator:
    """A CPU generator seeded from the test's parameters (stable across runs, unlike hash())."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
