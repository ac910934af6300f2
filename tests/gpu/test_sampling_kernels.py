"""The sampler's race kernel (infer/sampling_kernels.py) against its plain-torch reference (sampling.uniform_noise,
sampling.race_reference) on the same tensors: the uniforms equal bit for bit (the hash's integers), the tokens
equal, for batches of 1..1024 rows over the 8B and V3 vocabularies; a row's token is the same alone and in a batch.

On the GPU machine: `PYTHONPATH=src python3 -m pytest -q -m gpu tests/gpu/test_sampling_kernels.py`. Without a GPU:
`PARASEEK_TRITON_INTERPRET=1 PYTHONPATH=src python -m pytest -q -m gpu tests/gpu/test_sampling_kernels.py`
(small shapes only)."""

import pytest
import torch

# First: it chooses CUDA or Triton's interpreter before triton is imported.
from triton_device import CUDA, DEVICE, gen  # noqa: F401

from paraseek.infer import sampling, sampling_kernels  # noqa: E402
from paraseek.infer.sampling import SampleRow, SamplingParams, sample  # noqa: E402

pytestmark = pytest.mark.gpu
SHAPES = [(1, 128_256), (64, 129_280), (256, 128_256), (1024, 129_280)] if CUDA else [(1, 5000), (3, 9000)]


def _keys(B: int, seed: int):
    g = gen("keys", B, seed)
    seed_B = torch.randint(-2**63, 2**63 - 1, (B,), generator=g, dtype=torch.int64)
    position_B = torch.randint(0, 1 << 20, (B,), generator=g, dtype=torch.int64)
    return seed_B.to(DEVICE), position_B.to(DEVICE)


@pytest.mark.parametrize("B,V", SHAPES)
def test_uniforms_equal_the_reference_bit_for_bit(B, V):
    seed_B, position_B = _keys(B, 0)
    assert torch.equal(sampling_kernels.uniform(seed_B, position_B, V), sampling.uniform_noise(seed_B, position_B, V))


@pytest.mark.parametrize("B,V", SHAPES)
def test_race_tokens_equal_the_reference(B, V):
    """Peaked and flat rows, some tokens at probability 0 (top-p)."""
    seed_B, position_B = _keys(B, 1)
    g = gen("probs", B, V)
    logits_BV = torch.randn(B, V, generator=g) * torch.linspace(0.5, 6.0, B)[:, None]
    probs_BV = logits_BV.softmax(-1)
    probs_BV[:, ::3] = 0
    probs_BV = probs_BV.to(DEVICE)
    got = sampling_kernels.race(probs_BV, seed_B, position_B)
    assert torch.equal(got, sampling.race_reference(probs_BV, seed_B, position_B))


def test_a_rows_token_is_the_same_alone_and_in_a_batch():
    B, V = (8, 129_280) if CUDA else (8, 3000)
    torch.manual_seed(0)
    logits_BV = (torch.randn(B, V) * 3).to(DEVICE)
    kinds = [dict(temperature=0.8, top_p=0.95), dict(temperature=1.0), dict(temperature=0.7, top_k=50, top_p=0.8),
             dict(temperature=0.0)]
    rows = [SampleRow(SamplingParams(**kinds[i % 4]), [], [], seed=100 + i, position=i) for i in range(B)]
    batch = sample(logits_BV, rows).token_ids
    assert [sample(logits_BV[i:i + 1], [rows[i]]).token_ids[0] for i in range(B)] == batch
    # and the draws are the reference's on the same device
    probs_BV = sampling.distributions(logits_BV, rows).probs_BV
    seed_B = torch.tensor([r.seed for r in rows], device=DEVICE)
    position_B = torch.tensor([r.position for r in rows], device=DEVICE)
    want = sampling.race_reference(probs_BV, seed_B, position_B)
    greedy = [r.params.greedy for r in rows]
    assert [t for t, g in zip(batch, greedy) if not g] == [t for t, g in zip(want.tolist(), greedy) if not g]
