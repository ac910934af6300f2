"""The sampler's keyed exponential race (infer/sampling.py) on CPU: its hash against a pure-Python splitmix64 and
splitmix64's published first output; the tokens it draws are distributed as p (chi-square over many seeds); a row's
token does not depend on the rows around it; seeded tokens repeat; and top-k + top-p from one sort equal a
plain-torch form that sorts for each separately (the sampler's earlier code)."""

from collections import Counter

import pytest
import torch

from paraseek.infer import sampling
from paraseek.infer.sampling import SampleRow, SamplingParams, distributions, sample

MASK64 = (1 << 64) - 1


def _mix64_py(z: int) -> int:
    """splitmix64's output function on Python ints (Vigna's splitmix64.c), written out independently."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def _uniform_py(seed: int, position: int, v: int) -> float:
    key = _mix64_py((_mix64_py(seed & MASK64) + position) & MASK64)
    z = _mix64_py((key + v * 0x9E3779B97F4A7C15) & MASK64)
    return ((z >> 40) + 0.5) / 2**24


def test_mix64_gives_splitmix64s_published_first_outputs():
    # splitmix64 seeded with 0: its first outputs are mix64(k * 0x9E3779B97F4A7C15), k = 1, 2, ...
    # (0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F; Vigna's splitmix64.c).
    states = torch.tensor([sampling._signed64(k * sampling.GOLDEN_GAMMA) for k in (1, 2, 3)])
    got = [x & MASK64 for x in sampling._mix64(states).tolist()]
    assert got == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert got == [_mix64_py(k * 0x9E3779B97F4A7C15 & MASK64) for k in (1, 2, 3)]


def test_uniform_noise_equals_a_pure_python_hash():
    seeds = [0, 1, -1, 2**63 + 5, 2**64 - 1, 123456789]
    positions = [0, 3, 7, 1000, 2**40, 5]
    V = 40
    seed_B = torch.tensor([sampling._signed64(s) for s in seeds])
    got = sampling.uniform_noise(seed_B, torch.tensor(positions), V)
    want = torch.tensor([[_uniform_py(s, p, v) for v in range(V)] for s, p in zip(seeds, positions)])
    assert torch.equal(got, want)
    assert 0 < got.min() and got.max() < 1


def _chi_square_p_value(counts: Counter, p_V: torch.Tensor) -> float:
    """Pearson's chi-square test of token counts against p_V (every bin expected >= 5 times here)."""
    n = sum(counts.values())
    expected = (p_V.double() * n).tolist()
    assert min(e for e in expected if e > 0) >= 5
    stat = sum((counts.get(t, 0) - e) ** 2 / e for t, e in enumerate(expected) if e > 0)
    dof = sum(e > 0 for e in expected) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


ALPHA = 1e-3  # a correct sampler fails with probability 0.1% (fixed seeds: never here)


def test_the_race_draws_tokens_distributed_as_p():
    """20,000 seeds (and as many positions of one seed) draw from unnormalized p with a zero: counts match p."""
    p_V = torch.tensor([0.05, 0.3, 0.0, 0.15, 0.4, 0.1]) * 3
    n = 20_000
    probs_BV = p_V.repeat(n, 1)
    by_seed = sampling.race_reference(probs_BV, torch.arange(n), torch.zeros(n, dtype=torch.int64))
    by_position = sampling.race_reference(probs_BV, torch.full((n,), 42), torch.arange(n))
    for tokens in (by_seed, by_position):
        counts = Counter(tokens.tolist())
        assert 2 not in counts
        assert _chi_square_p_value(counts, p_V / p_V.sum()) > ALPHA
    # the test has power: the same draws against a slightly different p fail it
    assert _chi_square_p_value(Counter(by_seed.tolist()), torch.tensor([0.1, 0.25, 0.0, 0.15, 0.4, 0.1])) < ALPHA


def _rows(kinds, seed0=11):
    return [SampleRow(SamplingParams(**k), [], [], seed=seed0 + i, position=3 * i) for i, k in enumerate(kinds)]


KINDS = [dict(temperature=0.8, top_p=0.95), dict(temperature=0.0), dict(temperature=1.0, top_k=20),
         dict(temperature=0.7, top_k=50, top_p=0.8), dict(temperature=1.2), dict(temperature=0.9, min_p=0.05),
         dict(temperature=1.0, top_k=5, top_p=0.5), dict(temperature=0.6, logit_bias={3: 5.0})]


def test_a_rows_token_is_the_same_alone_and_in_a_batch_of_8():
    torch.manual_seed(0)
    logits_BV = torch.randn(8, 300) * 3
    rows = _rows(KINDS)
    batch = sample(logits_BV, rows).token_ids
    alone = [sample(logits_BV[i:i + 1], [rows[i]]).token_ids[0] for i in range(8)]
    assert batch == alone
    assert sample(logits_BV.flip(0), rows[::-1]).token_ids == batch[::-1]
    # the same seed and position repeat the tokens; another position draws others
    assert sample(logits_BV, _rows(KINDS)).token_ids == batch
    moved = [SampleRow(r.params, [], [], seed=r.seed, position=r.position + 1) for r in rows]
    assert sample(logits_BV, moved).token_ids != batch


def test_unseeded_rows_still_draw_from_torchs_generator():
    """Rows without a noise key (speculative verification builds such rows) take `draw`'s path."""
    logits_BV = torch.randn(4, 100)
    rows = [SampleRow(SamplingParams(temperature=1.0), [], [], torch.Generator().manual_seed(i)) for i in range(4)]
    want = sampling.draw(logits_BV.softmax(-1), [torch.Generator().manual_seed(i) for i in range(4)])
    assert sample(logits_BV, rows).token_ids == want.tolist()


def _separate_sorts(t_BV: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """top-k by the k-th value of one sort, softmax, then top-p from a second sort of the probabilities."""
    V = t_BV.shape[1]
    k_B = torch.tensor([k or V for k in ks])
    kth_B = t_BV.sort(dim=-1, descending=True).values.gather(1, (k_B - 1)[:, None])
    probs_BV = t_BV.masked_fill(t_BV < kth_B, float("-inf")).softmax(dim=-1)
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
    drop_sorted = (sorted_BV.cumsum(dim=-1) - sorted_BV) >= torch.tensor(ps)[:, None]
    drop_sorted[torch.tensor(ps) >= 1] = False  # top_p = 1: off
    return probs_BV.masked_fill(torch.zeros_like(drop_sorted).scatter_(1, order_BV, drop_sorted), 0.0)


@pytest.mark.parametrize("ks", [[0, 20, 50, 0], [10, 20, 50, 7], [0, 0, 0, 0]])
def test_top_k_and_top_p_from_one_sort_equal_separate_sorts(ks):
    torch.manual_seed(len(ks) + sum(ks))
    logits_BV = torch.randn(4, 1000) * 4
    ps = [0.9, 1.0, 0.8, 0.5]
    temps = [0.8, 1.0, 1.3, 0.6]
    rows = [SampleRow(SamplingParams(temperature=t, top_k=k, top_p=p), [], [], seed=i)
            for i, (t, k, p) in enumerate(zip(temps, ks, ps))]
    got = distributions(logits_BV, rows).probs_BV
    want = _separate_sorts(logits_BV / torch.tensor(temps)[:, None], ks, ps)
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)


def test_masked_rows_keep_their_masks_under_top_k_and_top_p():
    """allowed_token_ids and logit_bias act before the sort: only allowed tokens are ever kept."""
    logits_BV = torch.randn(2, 200)
    allowed = [5, 17, 99, 150]
    rows = [SampleRow(SamplingParams(temperature=1.0, top_k=3, top_p=0.9, allowed_token_ids=allowed), [], [], seed=1),
            SampleRow(SamplingParams(temperature=1.0, top_p=0.9, logit_bias={7: 100.0}), [], [], seed=2)]
    probs_BV = distributions(logits_BV, rows).probs_BV
    assert set(probs_BV[0].nonzero()[:, 0].tolist()) <= set(allowed)
    assert probs_BV[0].count_nonzero() <= 3
    assert probs_BV[1].nonzero()[:, 0].tolist() == [7]
