"""The inference engine against transformers' `generate` (greedy, fp32, tiny random models of every family), and
against itself under batching, chunked prefill, preemption, prefix caching; the absorbed MLA decode against the
model's own forward."""

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from test_hf_parity import VARIANTS, _hf_model  # noqa: E402

from paraseek.infer.engine import Engine, EngineConfig  # noqa: E402
from paraseek.infer.runner import HostBatch  # noqa: E402
from paraseek.infer.sampling import SamplingParams  # noqa: E402
from paraseek.models import load_pretrained  # noqa: E402

NEW = 32
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for name, cfg in VARIANTS.items():
        d = tmp_path_factory.mktemp(name)
        _hf_model(cfg).save_pretrained(d)
        out[name] = d
    return out


def _prompts(n=16, seed=0, lo=2, hi=60):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, 320, (k,), generator=g).tolist() for k in lens]


def _engine(folder, **kw):
    model = load_pretrained(folder, dtype=torch.float32, device="cpu").eval()
    cfg = dict(block_size=8, num_kv_blocks=512, max_batched_tokens=96)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg), log=lambda *_: None)


def _outputs(engine, prompts, params=GREEDY):
    return [r.output_ids for r in engine.generate(prompts, params)]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_equals_transformers_generate(variant, folders):
    """16 prompts of 2..59 tokens batched together, 32 new tokens each, chunked prefill (96-token steps)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders[variant], dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    prompts = _prompts()
    ref = []
    for p in prompts:
        ids = torch.tensor([p])  # the mask given: generate() would mask every token equal to pad_token_id
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        ref.append(out[0, len(p):].tolist())
    got = _outputs(_engine(folders[variant]), prompts)
    assert got == ref


@pytest.mark.parametrize("variant", ["llama-gqa-llama3rope", "v3-noaux-yarn"])
def test_batched_equals_alone_and_survives_preemption(variant, folders):
    prompts = _prompts(seed=1)
    alone = [_outputs(_engine(folders[variant]), [p])[0] for p in prompts]
    batched = _outputs(_engine(folders[variant]), prompts)
    assert batched == alone
    # 40 usable blocks of 8 tokens = 320 tokens for 16 sequences that need up to 91 each: preemption must happen.
    small = _engine(folders[variant], num_kv_blocks=41)
    assert _outputs(small, prompts) == alone
    assert small.scheduler.num_preemptions > 0
    assert small.pool.num_used == 0  # every block came back


def test_prefix_caching_on_and_off_give_the_same_outputs(folders):
    g = torch.Generator().manual_seed(2)
    system = torch.randint(0, 320, (37,), generator=g).tolist()  # shared by every prompt: 4 full blocks of 8
    prompts = [system + torch.randint(0, 320, (k,), generator=g).tolist() for k in (1, 5, 9, 20, 3, 8)]
    for variant in ("qwen2-bias-tied", "v2-greedy-yarn"):
        on = _engine(folders[variant])
        off = _engine(folders[variant], enable_prefix_caching=False)
        first = _outputs(on, prompts[:1])
        assert on.pool.hits == 0
        rest = _outputs(on, prompts[1:])
        assert on.pool.hits >= 4 * len(prompts[1:])  # the shared system prompt came from the cache
        assert first + rest == _outputs(off, prompts)
        assert off.pool.hits == 0


def _decode_logits(engine, ids):
    """Prefill ids[:-1] through the engine, then one decode step for ids[-1]: that step's logits."""
    bs = engine.cfg.block_size
    blocks = list(range(1, 2 + len(ids) // bs))
    slots = lambda p: np.array([blocks[i // bs] * bs + i % bs for i in p], dtype=np.int64)  # noqa: E731
    n = len(ids) - 1
    p = np.arange(n)
    engine.runner.run(HostBatch(np.array(ids[:-1]), p, slots(p), 0, np.zeros((0, 1), np.int32), np.zeros(0, np.int32),
                                [(n, n)], slots(p), np.array([n - 1])))
    p = np.array([n])
    return engine.runner.run(HostBatch(np.array(ids[-1:]), p, slots(p), 1, np.array([blocks], dtype=np.int32),
                                       np.array([n + 1], dtype=np.int32), [], np.zeros(0, np.int64), np.array([0])))[0]


@pytest.mark.parametrize("variant", ["v2-greedy-yarn", "v2-group-limited", "v3-noaux-yarn", "llama-mha"])
def test_absorbed_decode_equals_the_model_forward(variant, folders):
    """The decode path (MLA: q through W_UK, MQA over the latent, W_UV after) against the model's expanded forward
    of the whole sequence: the last position's logits within 1e-5 relative."""
    engine = _engine(folders[variant])
    reference = load_pretrained(folders[variant], dtype=torch.float32, device="cpu").eval()
    ids = _prompts(1, seed=3, lo=40, hi=41)[0]
    got = _decode_logits(engine, ids)
    with torch.no_grad():
        ref = reference(torch.tensor([ids]))[0, -1]
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(folders):
    engine = _engine(folders["llama-mha"])
    prompts = _prompts(4, seed=4)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    a = _outputs(engine, prompts, sampled)
    b = _outputs(engine, list(reversed(prompts)), sampled)
    assert a == list(reversed(b))  # the same seed gives the same tokens whatever the batch around it
    assert _outputs(engine, prompts, dataclasses.replace(sampled, seed=8)) != a
    top1 = _outputs(engine, prompts, SamplingParams(max_tokens=12, temperature=1.3, top_k=1, ignore_eos=True))
    assert top1 == _outputs(engine, prompts, dataclasses.replace(GREEDY, max_tokens=12))


def test_sampled_requests_overlap_their_steps_and_sample_as_synchronous_steps_do(folders):
    """Temperature / top-p requests stay on the device between steps (the step overlap is kept), and their seeded
    tokens are those of the same batch run with every step read back before the next."""
    engine = _engine(folders["llama-mha"])
    prompts = _prompts(4, seed=9)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
    reqs = [engine.add_request(f"s{i}", p, dataclasses.replace(sampled)) for i, p in enumerate(prompts)]
    in_flight = 0
    while engine.has_work():
        engine.step()
        in_flight += engine._in_flight is not None
    assert in_flight >= 12  # every decode step was launched before the previous one was read back
    overlapped = [r.output_ids for r in reqs]
    engine._host_sampled = 1  # as when a request with penalties is running: every step synchronous
    synchronous = _outputs(engine, prompts, sampled)
    engine._host_sampled = 0
    assert overlapped == synchronous and all(len(o) == 12 for o in overlapped)


def test_stop_tokens_and_lengths(folders):
    engine = _engine(folders["llama-mha"])
    prompt = _prompts(1, seed=5)[0]
    free = _outputs(engine, [prompt], dataclasses.replace(GREEDY, max_tokens=10))[0]
    stop_at = free[4]
    first = free.index(stop_at)
    r = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at]))[0]
    assert r.output_ids == free[:first + 1] and r.finish_reason == "stop"
    r = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at],
                                                 min_tokens=first + 1))[0]
    assert r.output_ids[:first] == free[:first] and r.output_ids[first] != stop_at  # suppressed before min_tokens
    r = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0))[0]
    assert len(r.output_ids) == 3 and r.finish_reason == "length"


def test_logprobs_are_the_models(folders):
    engine = _engine(folders["qwen2-bias-tied"])
    reference = load_pretrained(folders["qwen2-bias-tied"], dtype=torch.float32, device="cpu").eval()
    prompt = _prompts(1, seed=6)[0]
    r = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))[0]
    with torch.no_grad():
        lp = torch.log_softmax(reference(torch.tensor([r.token_ids[:-1]]))[0], -1)[len(prompt) - 1:]
    for i, tok in enumerate(r.output_ids):
        assert abs(r.logprobs[i] - lp[i, tok].item()) < 1e-4
        top = lp[i].topk(3)
        assert [t for t, _ in r.top_logprobs[i]] == top.indices.tolist()


def test_requests_that_cannot_fit_are_refused(folders):
    from paraseek.errors import UserError

    engine = _engine(folders["llama-mha"], num_kv_blocks=5)
    with pytest.raises(UserError, match="maximum context length is 256"):
        engine.check_request(list(range(250)), SamplingParams(max_tokens=10))
    with pytest.raises(UserError, match="needs 6 KV blocks but the whole cache holds 4"):
        engine.check_request(list(range(40)), SamplingParams(max_tokens=8))
    with pytest.raises(UserError, match="top_p"):
        engine.check_request([1, 2], SamplingParams(top_p=0))


def test_stop_strings_cut_the_text_before_the_stop():
    from paraseek.models import ModelArgs, build_model, preset_config
    from paraseek.models.tokenizer import load_text_tokenizer
    from paraseek.models.tokenizer import BUNDLED_TOKENIZER

    tok = load_text_tokenizer(BUNDLED_TOKENIZER)
    torch.manual_seed(0)
    model = build_model(ModelArgs.from_hf_config(preset_config("tiny-dense")), "cpu", torch.float32).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in n else 0.0))
    engine = Engine(model, EngineConfig(num_kv_blocks=64), tokenizer=tok, log=lambda *_: None)
    ids = tok.encode("In the beginning God created")
    free = engine.generate([ids], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    text = tok.decode(free.output_ids)
    stop = text[10:14]
    r = engine.generate([ids], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop, "\x00"]))[0]
    assert r.finish_reason == "stop" and r.stream.text == text[:text.index(stop)]
    assert len(r.output_ids) < len(free.output_ids)
    r = engine.add_request("s", ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), stream_text=True)
    deltas = []
    while engine.has_work():
        engine.step()
        deltas.append(r.stream.delta)
    assert "".join(deltas) == tok.decode(r.output_ids) == r.stream.text
