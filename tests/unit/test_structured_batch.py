"""The batched grammar work of a step (structured.StepMasks: matchers advanced with batch_accept_token, masks filled
by BatchGrammarMatcher into one buffer) against one matcher at a time; apply_masks against a plain unpack of the
bits; the engine's greedy json_schema outputs against the per-row masks."""

import copy
import random

import pytest
import torch

pytest.importorskip("xgrammar")  # the grammar library of [serve]

from paraseek.bench.serve import STRUCTURED_SCHEMA  # noqa: E402
from paraseek.infer import structured  # noqa: E402
from paraseek.infer.engine import Engine, EngineConfig  # noqa: E402
from paraseek.infer.sampling import SampleRow, SamplingParams, apply_masks, unpack_bitmask  # noqa: E402
from paraseek.models import ModelArgs, build_model, preset_config  # noqa: E402
from paraseek.models.tokenizer import BUNDLED_TOKENIZER, load_text_tokenizer  # noqa: E402

from grammar_reference import PerRowMasks  # noqa: E402

SPEC = {"type": "json_schema", "schema": STRUCTURED_SCHEMA}


@pytest.fixture(scope="module")
def tok():
    return load_text_tokenizer(BUNDLED_TOKENIZER)


def _allowed(words_W: torch.Tensor, V: int) -> list[int]:
    return unpack_bitmask(words_W[None], V)[0].nonzero()[:, 0].tolist()


def _walk(backend, rng: random.Random, n: int, bad_at: int | None = None):
    """A random walk of n tokens through SPEC with one matcher: the tokens and the mask before each (all ones once
    the grammar has ended or rejected a token). bad_at: the step whose token is one the mask does not allow."""
    c = backend.matcher(SPEC)
    tokens, masks = [], []
    for k in range(n):
        words_W = c.bitmask_W()
        words_W = torch.full((backend.words,), -1, dtype=torch.int32) if words_W is None else words_W
        masks.append(words_W)
        allowed = _allowed(words_W, backend.vocab_size)
        if k == bad_at:
            t = next(t for t in range(backend.vocab_size) if t not in set(allowed))
        else:
            t = rng.choice(allowed)
        tokens.append(t)
        c.advance(tokens)
    return tokens, masks


def test_batched_fill_equals_one_matcher_at_a_time(tok):
    """Rows of a step: five json_schema requests (one that rejects a token on the way, one that takes two tokens
    between fills, as a request admitted with known tokens does) and an unconstrained one; every step's buffer equals
    each row's own matcher's mask, bit for bit, and all ones in the unconstrained row."""
    V = 4100  # wider than the tokenizer (its 2,048 tokens) and not a multiple of 32
    backend = structured.Backend(tok, V, [2])
    rng = random.Random(0)
    n = 50
    walks = [_walk(backend, rng, 2 * n + 1, bad_at=20 if i == 3 else None) for i in range(5)]
    step_masks = structured.StepMasks(rows=8, words=backend.words, pin=False)
    rows = [backend.matcher(SPEC) for _ in walks] + [None]
    ended = 0
    before = [0] * len(walks)
    for k in range(n):
        lengths = [2 * k if i == 1 else k for i in range(len(walks))]
        new = [w[0][b:m] for w, b, m in zip(walks, before, lengths)]  # the tokens sampled since the last fill
        before = lengths
        got_BW = step_masks.fill(rows, new + [[5]])
        assert got_BW is not None and got_BW.shape == (6, backend.words)
        for i, (w, m) in enumerate(zip(walks, lengths)):
            assert torch.equal(got_BW[i], w[1][m]), (k, i)
        assert (got_BW[5] == -1).all()
        ended += sum(not c.live for c in rows[:5])
    assert rows[3].broken and not rows[0].broken
    assert ended > 0  # some walks reached the end of the grammar (all ones from there)
    assert step_masks.fill([None, None], [[1], [2]]) is None


def test_apply_masks_equals_a_plain_unpack():
    """One buffer for the batch, the rows' own masks (one row without), with a logit_bias in the same step: the
    logits equal masked_fill with the unpacked bits."""
    g = torch.Generator().manual_seed(0)
    B, V = 5, 1000
    W = (V + 31) // 32
    x_BV = torch.randn(B, V, generator=g)
    words_BW = torch.randint(-2**31, 2**31 - 1, (B, W), generator=g, dtype=torch.int32)
    words_BW[2] = -1
    bias = {7: 3.0}
    rows = [SampleRow(SamplingParams(logit_bias=bias if i == 0 else None), [], []) for i in range(B)]
    want_BV = x_BV.clone()
    want_BV[0, 7] += 3.0
    want_BV.masked_fill_(~unpack_bitmask(words_BW, V), float("-inf"))
    assert torch.equal(apply_masks(x_BV.clone(), rows, words_BW), want_BV)
    for i, r in enumerate(rows):
        r.bitmask_W = None if i == 2 else words_BW[i]
    assert torch.equal(apply_masks(x_BV.clone(), rows), want_BV)



def test_engine_json_outputs_equal_the_synchronous_per_row_masks(tok):
    """Overlapped steps with batched masks (the previous step read back while this one's forward runs) give the
    synchronous path's outputs: greedy, seeded sampling, json_object, and a free request in the same batch."""
    torch.manual_seed(0)
    model = build_model(ModelArgs.from_hf_config(preset_config("tiny-dense")), "cpu", torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    prompts = [tok.encode(t) for t in ("The king", "A record of", "In the beginning", "Names:", "And he said")]
    params = [SamplingParams(max_tokens=60, temperature=0, structured=SPEC)] * 2 + [
        SamplingParams(max_tokens=60, temperature=1.0, seed=3, structured=SPEC),
        SamplingParams(max_tokens=60, temperature=0, structured={"type": "json_object"}),
        SamplingParams(max_tokens=30, temperature=0)]
    outs = []
    for cls in (Engine, PerRowMasks):
        engine = cls(copy.deepcopy(model), EngineConfig(num_kv_blocks=256, block_size=8), tokenizer=tok, log=lambda *_: None)
        reqs = engine.generate(prompts, params)
        outs.append([(r.output_ids, r.finish_reason) for r in reqs])
        assert (engine._step_masks is not None) == (cls is Engine)
        assert all(r.device_sampled for r in reqs) == (cls is Engine)  # Engine: the overlapped steps
    assert outs[0] == outs[1]
    backend = structured.backend_for(tok, 2048, engine.stop_token_ids)
    for (ids, _), p in zip(outs[0][:4], params):
        m = backend.matcher(p.structured)
        m.advance(ids)
        assert not m.broken  # every token the grammar's
