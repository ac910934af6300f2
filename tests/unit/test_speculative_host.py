"""The host side of speculative steps (infer/spec.py): the incremental prompt-lookup index against the whole-sequence
search, greedy verification from the argmax against the general verification, and --speculative-max-batch (plain
decode steps while more requests run, speculation again below) keeping plain greedy decoding's tokens."""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_speculative import DENSE, _model  # noqa: E402

from paraseek.infer.engine import Engine, EngineConfig  # noqa: E402
from paraseek.infer.sampling import SampleRow, SamplingParams  # noqa: E402
from paraseek.infer.spec import NgramIndex, Verify, ngram_drafts, verify, verify_greedy  # noqa: E402


def test_ngram_index_gives_the_whole_sequence_lookups_as_the_sequence_grows():
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        n_min = int(torch.randint(1, 4, (1,), generator=g))
        n_max = n_min + int(torch.randint(0, 3, (1,), generator=g))
        index = NgramIndex(n_min, n_max)
        ids = torch.randint(0, 4, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g).tolist()
        for _ in range(15):
            k = int(torch.randint(1, 5, (1,), generator=g))
            assert index.drafts(ids, k) == ngram_drafts(ids, n_min, n_max, k), (ids, n_min, n_max, k)
            ids += torch.randint(0, 4, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
        other = ids[:5]  # another sequence, shorter: indexed anew
        assert index.drafts(other, 3) == ngram_drafts(other, n_min, n_max, 3)


def test_greedy_verification_from_the_argmax_is_the_general_verification():
    torch.manual_seed(0)
    V = 40
    drafts = [[], [1, 2, 3], [5], [7, 7], [], [3, 1, 4]]
    R = sum(len(d) + 1 for d in drafts)
    logits = torch.randn(R, V)
    best = logits.argmax(-1).tolist()
    row = 0
    for i, d in enumerate(drafts):  # some drafts the argmax at their rows (accepted), some not
        for j in range(len(d)):
            if (i + j) % 3:
                d[j] = best[row + j]
        row += len(d) + 1
    greedy = SamplingParams(temperature=0)
    groups = [Verify(d, None, [SampleRow(greedy, [], [])] * (len(d) + 1)) for d in drafts]
    want = verify(logits, groups)
    got = verify_greedy(logits.argmax(-1), drafts)
    assert [(v.tokens, v.accepted) for v in got] == [(v.tokens, v.accepted) for v in want]
    assert any(v.accepted for v in want) and any(v.accepted < len(d) for v, d in zip(want, drafts))


@pytest.fixture(scope="module")
def predictable():
    return _model(DENSE, seed=1, predictable=True)


def _engine(model, **kw):
    cfg = dict(block_size=8, num_kv_blocks=512, max_batched_tokens=64) | kw
    return Engine(copy.deepcopy(model), EngineConfig(**cfg), log=lambda *_: None)  # the engine empties it


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_speculation_pauses_above_the_max_batch_and_keeps_plain_greedy_tokens(method, predictable):
    """Six requests with a max batch of 3: plain steps while more than 3 run, speculation once the short ones
    finish; the tokens are plain greedy decoding's and both kinds of steps happened."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (int(n),), generator=g).tolist() for n in (5, 12, 20, 8, 30, 3)]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 8, 10, 30, 30, 30)]
    plain = [r.output_ids for r in _engine(predictable).generate(prompts, params)]
    engine = _engine(predictable, speculative=method, num_speculative_tokens=2, speculative_max_batch=3,
                     **(dict(ngram_min=1) if method == "ngram" else {}))
    assert [r.output_ids for r in engine.generate(prompts, params)] == plain
    st = engine.drafter.stats.summary()
    assert st["plain_steps"] > 0 and st["drafts"] > 0 and st["accepted_tokens"] > 0, st
    assert engine.pool.num_used == 0  # every block came back
