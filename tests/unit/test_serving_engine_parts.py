"""The engine parts the OpenAI server relies on: the prefix cache's collision-resistant block hash, the waiting
queue ordered by priority, and the sampler's token masks (logit_bias, allowed_token_ids, grammar bitmasks)."""

import hashlib

import numpy as np
import pytest
import torch

from paraseek.infer.cache import BlockPool
from paraseek.infer.sampling import SampleRow, SamplingParams, sample, unpack_bitmask
from paraseek.infer.scheduler import Request, Scheduler

BS = 16


def old_chain_hash(parent, tokens):
    """The previous scheme: Python's 64-bit hash of the tuple."""
    return hash((parent, tuple(tokens)))


def test_a_collision_of_the_old_hash_cannot_serve_wrong_blocks(monkeypatch):
    """Two different first blocks whose old keys collide (CPython hashes an int modulo 2^61 - 1, so token 0 and
    token 2^61 - 1 hash alike): under the old scheme the second prompt is served the first one's cached block;
    under SHA-256 it finds nothing."""
    a = [0] + list(range(1, BS))
    b = [2**61 - 1] + list(range(1, BS))
    assert a != b and old_chain_hash(None, a) == old_chain_hash(None, b)

    def cached_then_lookup(pool):
        [block] = pool.allocate(1)
        pool.register(block, pool.chain_hash(None, a))
        pool.release([block])
        return block, pool.match_prefix(b + [7], 1)[0]

    block, served = cached_then_lookup(BlockPool(4, BS))
    assert served == []  # b's prompt is computed, not served a's K/V
    with monkeypatch.context() as m:
        m.setattr(BlockPool, "chain_hash", staticmethod(old_chain_hash))
        block, served = cached_then_lookup(BlockPool(4, BS))
        assert served == [block]  # what the old key did: another prompt's block


def test_the_block_hash_is_sha256_of_parent_and_tokens():
    tokens = list(range(100, 100 + BS))
    first = BlockPool.chain_hash(None, tokens)
    assert first == hashlib.sha256(bytes(32) + np.asarray(tokens, "<i8").tobytes()).digest()
    second = BlockPool.chain_hash(first, tokens)
    assert second == hashlib.sha256(first + np.asarray(tokens, "<i8").tobytes()).digest() != first
    assert BlockPool.chain_hash(None, tuple(tokens)) == first  # list or tuple alike (the scheduler passes tuples)


def test_equal_prefixes_still_share_blocks():
    pool = BlockPool(8, BS)
    prompt = list(range(3 * BS))
    blocks = pool.allocate(3)
    parent = None
    for i, blk in enumerate(blocks):
        parent = pool.chain_hash(parent, prompt[i * BS:(i + 1) * BS])
        pool.register(blk, parent)
    hit, _ = pool.match_prefix(prompt + [1], 3)
    assert hit == blocks
    other, _ = pool.match_prefix(prompt[:BS] + [5] * BS + [1], 3)
    assert other == blocks[:1]


def make_request(rid, priority=0):
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4), priority=priority)


def test_the_waiting_queue_is_ordered_by_priority_then_arrival():
    s = Scheduler(BlockPool(64, BS), max_num_seqs=1, max_batched_tokens=64, max_model_len=128)
    for rid, p in [("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", 5), ("f", -1)]:
        s.add(make_request(rid, p))
    assert [r.request_id for r in s.waiting] == ["c", "f", "a", "d", "b", "e"]
    plan = s.schedule()  # one slot: the most urgent, earliest
    assert [x.request.request_id for x in plan.items] == ["c"]
    assert s.running[0].first_scheduled_time is not None


def test_a_preempted_request_goes_first_among_its_priority():
    s = Scheduler(BlockPool(64, BS), max_num_seqs=4, max_batched_tokens=64, max_model_len=128)
    for rid, p in [("x", 0), ("y", 3), ("z", -2)]:
        s.add(make_request(rid, p))
    victim = make_request("v", 0)
    victim.status = victim.status.RUNNING
    s.running.append(victim)
    s._preempt(victim)
    assert [r.request_id for r in s.waiting] == ["z", "v", "x", "y"]


# ---- the sampler's masks ---------------------------------------------------------------------------------------------
def rows(*params, bitmasks=None):
    return [SampleRow(p, [], [], None, [], None if bitmasks is None else bitmasks[i]) for i, p in enumerate(params)]


def test_logit_bias_and_allowed_tokens_against_a_direct_computation():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    bias = {7: 100.0, 3: -100.0}
    out = sample(logits, rows(SamplingParams(temperature=0, logit_bias=bias),
                              SamplingParams(temperature=0, allowed_token_ids=[4, 9, 30]),
                              SamplingParams(temperature=0)))
    want0 = logits[0].clone()
    want0[7] += 100
    want0[3] -= 100
    restricted = torch.full((50,), float("-inf"))
    restricted[[4, 9, 30]] = logits[1, [4, 9, 30]]
    assert out.token_ids == [int(want0.argmax()), int(restricted.argmax()), int(logits[2].argmax())]
    assert logits.shape == (3, 50) and torch.isfinite(logits).all()  # the caller's logits are untouched


def test_grammar_bitmasks_unpack_as_xgrammar_packs_them():
    V = 70
    allowed = [0, 5, 31, 32, 33, 63, 64, 69]
    words = np.zeros((V + 31) // 32, dtype=np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1) << np.uint32(t % 32)
    words_W = torch.from_numpy(words.view(np.int32).copy())
    keep = unpack_bitmask(words_W[None], V)[0]
    assert torch.nonzero(keep).flatten().tolist() == allowed
    logits = torch.randn(2, V)
    logits[0, 10] = 50.0  # the best token is not allowed: the best allowed one is picked
    out = sample(logits, rows(SamplingParams(temperature=0), SamplingParams(temperature=0),
                              bitmasks=[words_W, None]))
    best_allowed = max(allowed, key=lambda t: float(logits[0, t]))
    assert out.token_ids == [best_allowed, int(logits[1].argmax())]
    for seed in range(5):  # sampled too: never outside the mask
        g = torch.Generator().manual_seed(seed)
        tok = sample(logits[:1], [SampleRow(SamplingParams(temperature=1.0), [], [], g, [], words_W)]).token_ids[0]
        assert tok in allowed


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1])
def test_seeds_outside_64_bits_are_refused(seed):
    from paraseek.errors import UserError

    with pytest.raises(UserError, match="seed"):
        SamplingParams(seed=seed).validate()
    SamplingParams(seed=2**64 - 1).validate()
    torch.Generator().manual_seed(2**64 - 1)  # what the engine does with it


def test_sampling_in_chunks_of_rows_gives_the_unchunked_tokens_and_logprobs(monkeypatch):
    """A large batch is sampled a chunk of rows at a time (bounded memory): seeded rows draw the same tokens, and
    log-probabilities and greedy rows come out as from one pass over all rows."""
    import torch

    from paraseek.infer import sampling

    torch.manual_seed(0)
    logits = torch.randn(7, 50) * 3

    def rows():
        kinds = [dict(temperature=0.8, top_p=0.9), dict(temperature=0.0), dict(temperature=1.0, top_k=5),
                 dict(temperature=0.7, min_p=0.1, logprobs=2)]
        return [SampleRow(SamplingParams(**kinds[i % 4], seed=i), [], [], torch.Generator().manual_seed(100 + i))
                for i in range(7)]

    whole = sample(logits, rows())
    monkeypatch.setattr(sampling, "SAMPLE_CHUNK_LOGITS", 2 * 50)  # two rows a chunk
    chunked = sample(logits, rows())
    assert chunked.token_ids == whole.token_ids
    assert chunked.logprobs == whole.logprobs and chunked.top_logprobs == whole.top_logprobs
    on_device = sample(logits, rows(), to_host=False).token_ids
    assert on_device.tolist() == whole.token_ids
