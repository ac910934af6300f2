"""Speculative decoding (infer/spec.py) on CPU in fp32: greedy speculation gives plain greedy decoding's tokens
exactly, for both drafters, K = 1..4, on every family of the parity tests, under batching, chunked prefill,
preemption and the prefix cache; the MTP drafter's drafts are the training model's MTP module's (V3's formula,
computed there independently); rejection sampling keeps the target's distribution (chi-square over many seeds,
target probabilities computed directly); prompt lookup against a brute-force search."""

import copy
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_hf_parity import VARIANTS  # noqa: E402

from paraseek.infer.engine import Engine, EngineConfig  # noqa: E402
from paraseek.infer.sampling import SampleRow, SamplingParams  # noqa: E402
from paraseek.infer.spec import SpecStats, Verify, ngram_drafts, verify  # noqa: E402
from paraseek.models import ModelArgs, build_model, load_pretrained, save_pretrained  # noqa: E402

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
DENSE, MLA = "llama-gqa-llama3rope", "v3-noaux-yarn"


def _model(variant: str, seed: int = 0, predictable: bool = False):
    """Our model of a parity variant's config with one MTP module, every weight random (norms near 1), as
    test_hf_parity's models. `predictable`: the next token is mostly a function of the current one (every block's
    output projections scaled down, so the residual stream is mostly the token's embedding), and the MTP module is
    a copy of that map one token on (eh_proj passes the embedding half through, its block adds nothing, its final
    norm is the model's): its drafts are mostly right, so verification accepts most of them."""
    args = ModelArgs.from_hf_config({**VARIANTS[variant], "num_nextn_predict_layers": 1})
    torch.manual_seed(seed)
    model = build_model(args, "cpu", torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" not in name else 0.1) + (1.0 if "norm" in name else 0.0))
        if predictable:
            out_proj = ("o_proj.weight", "down_proj.weight", "down_proj")
            for name, p in model.named_parameters():
                if name.endswith(out_proj):
                    p.mul_(0.0 if name.startswith("mtp.") else 0.003)
            m, D = model.mtp[0], args.dim
            m.eh_proj.weight.zero_()
            m.eh_proj.weight[:, :D] = torch.eye(D)
            m.enorm.weight.fill_(1.0)
            m.norm.weight.copy_(model.norm.weight)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Every parity variant with an MTP module (our HF layout: V3's model.layers.{n}.*), and two predictable ones."""
    out = {}
    for name in VARIANTS:
        out[name] = tmp_path_factory.mktemp(name)
        save_pretrained(_model(name), out[name])
    for name in (DENSE, MLA):
        out[f"{name}-predictable"] = tmp_path_factory.mktemp(f"{name}-predictable")
        save_pretrained(_model(name, seed=1, predictable=True), out[f"{name}-predictable"])
    return out


def _engine(folder, **kw):
    cfg = dict(block_size=8, num_kv_blocks=512, max_batched_tokens=64)
    cfg.update(kw)
    return Engine(load_pretrained(folder, dtype=torch.float32, device="cpu").eval(), EngineConfig(**cfg),
                  log=lambda *_: None)


def _prompts(n=8, seed=0, lo=2, hi=40, repeat=False):
    """Prompts of mixed lengths; `repeat`: each is a passage written twice (prompt lookup finds drafts in them)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    out = [torch.randint(0, 320, (k,), generator=g).tolist() for k in lens]
    return [p + p for p in out] if repeat else out


def _outputs(engine, prompts, params=GREEDY):
    return [r.output_ids for r in engine.generate(prompts, params)]


# ---- greedy: exactly plain greedy's tokens --------------------------------------------------------------------------
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_speculation_gives_plain_greedy_tokens(variant, folders):
    """6 prompts of mixed lengths (chunked prefill at 64 tokens a step), K = 2 and 4, both drafters (K = 1..4:
    the next test). Random MTP weights draft badly (most drafts rejected): what is tested is that the tokens are
    plain greedy's."""
    prompts = _prompts(6, repeat=True)
    plain = _outputs(_engine(folders[variant]), prompts)
    for method in ("ngram", "mtp"):
        for k in (2, 4):
            # A random model's tokens rarely continue an earlier n-gram: single tokens are looked up too.
            lookup = dict(ngram_min=1) if method == "ngram" else {}
            engine = _engine(folders[variant], speculative=method, num_speculative_tokens=k, **lookup)
            assert _outputs(engine, prompts) == plain, (method, k)
            assert engine.drafter.stats.num_draft_tokens > 0, (method, k)
            assert engine.pool.num_used == 0  # every block came back


@pytest.mark.parametrize("variant", [DENSE, MLA])
def test_a_model_that_drafts_well_accepts_most_drafts_and_keeps_plain_greedy_tokens(variant, folders):
    folder = folders[f"{variant}-predictable"]
    prompts = _prompts(4, seed=3)
    plain = _outputs(_engine(folder), prompts)
    for method in ("mtp", "ngram"):
        for k in (1, 2, 3, 4):
            engine = _engine(folder, speculative=method, num_speculative_tokens=k)
            assert _outputs(engine, prompts) == plain, (method, k)
            s = engine.drafter.stats.summary()
            assert s["accepted_per_position"][0] > 0.5 and s["mean_accepted_length"] > 1.5, (method, k, s)
            assert s["accept_rate"] < 1 or method == "ngram", (method, k, s)  # rejections happen too


@pytest.mark.parametrize("variant", [DENSE, MLA])
def test_preemption_and_the_prefix_cache_keep_the_tokens(variant, folders):
    """A pool of 24 blocks of 8 tokens for 6 sequences that need up to 99 each (preemption by recompute, drafts
    dropped with it), and prompts sharing a 37-token prefix (prefix-cache hits; with MTP the last hit block is
    recomputed): the tokens stay plain greedy's, and every block comes back."""
    folder = folders[f"{variant}-predictable"]
    g = torch.Generator().manual_seed(2)
    system = torch.randint(0, 320, (37,), generator=g).tolist()
    prompts = [system + torch.randint(0, 320, (k,), generator=g).tolist() for k in (1, 5, 20, 3, 30, 12)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    plain = _outputs(_engine(folder, enable_prefix_caching=False), prompts, params)
    for method in ("mtp", "ngram"):
        small = _engine(folder, num_kv_blocks=25, speculative=method, num_speculative_tokens=3)
        assert _outputs(small, prompts, params) == plain, method
        assert small.scheduler.num_preemptions > 0 and small.pool.num_used == 0
        cached = _engine(folder, speculative=method, num_speculative_tokens=3)
        first = cached.generate(prompts[:1], params)
        rest = cached.generate(prompts[1:], params)
        assert cached.pool.hits >= 3 * len(prompts[1:])
        assert [r.output_ids for r in first + rest] == plain, method
        assert cached.drafter.stats.num_accepted_tokens > 0
        # Every block the prefix cache holds is a block of some request's final (verified) tokens: none holds a
        # draft that was rejected.
        verified = set()
        for r in first + rest:
            parent = None
            for i in range(len(r.token_ids) // 8):
                parent = cached.pool.chain_hash(parent, r.token_ids[i * 8:(i + 1) * 8])
                verified.add(parent)
        assert cached.pool.cached and set(cached.pool.cached) <= verified


def test_penalties_min_tokens_and_logprobs_are_applied_to_every_verified_position(folders):
    """Greedy with a repetition penalty (the drafts before a position count as output), min_tokens (a stop token
    suppressed while the drafts before it leave the output short) and logprobs: plain greedy's tokens and
    log-probabilities."""
    folder = folders[f"{DENSE}-predictable"]
    prompts = _prompts(4, seed=5)
    plain = _engine(folder).generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                             logprobs=2, repetition_penalty=1.3))
    stop = plain[0].output_ids[6]
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=2, repetition_penalty=1.3, min_tokens=10,
                            stop_token_ids=[stop])
    ref = _engine(folder).generate(prompts, params)
    for method in ("mtp", "ngram"):
        got = _engine(folder, speculative=method, num_speculative_tokens=3).generate(prompts, params)
        for r, g in zip(ref, got):
            assert g.output_ids == r.output_ids and g.finish_reason == r.finish_reason
            assert g.logprobs == pytest.approx(r.logprobs, abs=1e-4)
            assert [[t for t, _ in row] for row in g.top_logprobs] == [[t for t, _ in row] for row in r.top_logprobs]


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(folders):
    folder = folders[f"{MLA}-predictable"]
    prompts = _prompts(3, seed=4)
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    for method in ("mtp", "ngram"):
        engine = _engine(folder, speculative=method, num_speculative_tokens=2)
        a = _outputs(engine, prompts, sampled)
        b = _outputs(engine, list(reversed(prompts)), sampled)
        assert a == list(reversed(b)) and all(len(o) == 12 for o in a)  # the seed decides, not the batch
        top1 = _outputs(engine, prompts, SamplingParams(max_tokens=12, temperature=1.3, top_k=1, ignore_eos=True))
        assert top1 == _outputs(_engine(folder), prompts, SamplingParams(max_tokens=12, temperature=0,
                                                                         ignore_eos=True))


# ---- the MTP drafter against the training model's module -------------------------------------------------------------
def _mtp_reference_drafts(model, ids: list[int], k: int) -> list[int]:
    """Greedy drafts after the sequence `ids` by V3's formula on the training model: row i of the module combines
    h_i (the last block's output) with the embedding of token i + 1; the last row's prediction is draft 1; draft
    j + 1 appends a row combining the module's own output at the row before with the embedding of draft j."""
    m = model.mtp[0]
    with torch.no_grad():
        x = torch.tensor([ids])
        h = model._trunk(x, None, None)[0]
        emb = model.embed_tokens(x)
        rows = m.eh_proj(torch.cat([m.enorm(emb[:, 1:]), m.hnorm(h[:, :-1])], dim=-1))  # rows 0 .. L-2
        drafts = []
        for _ in range(k):
            T = rows.shape[1]
            cos, sin = model.rope_cos_sin(T, x.device)  # row i at position i
            out = m.block(rows, cos, sin)
            drafts.append(int(model.head(m.norm(out[:, -1])).argmax()))
            new = m.eh_proj(torch.cat([m.enorm(model.embed_tokens(torch.tensor([[drafts[-1]]]))),
                                       m.hnorm(out[:, -1:])], dim=-1))
            rows = torch.cat([rows, new], dim=1)
    return drafts


@pytest.mark.parametrize("variant", [DENSE, MLA, "v2-group-limited"])
def test_mtp_drafts_are_the_training_modules(variant, folders):
    """The engine's drafts after the prefill step (the module's rows through the chunk path) and after a
    verification step (its rows of the accepted positions, then one-row steps through the decode path) against
    the training model's module run over the whole sequence."""
    reference = load_pretrained(folders[variant], dtype=torch.float32, device="cpu").eval()
    engine = _engine(folders[variant], speculative="mtp", num_speculative_tokens=3, max_batched_tokens=16)
    prompts = _prompts(3, seed=6, lo=20, hi=40)
    reqs = [engine.add_request(f"r{i}", p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    checked = 0
    for _ in range(20):
        engine.step()
        for r in reqs:
            if r.drafts and r.num_computed == len(r.token_ids) - 1:
                assert r.drafts == _mtp_reference_drafts(reference, r.token_ids, len(r.drafts)), r.request_id
                checked += 1
    assert checked >= 12


# ---- rejection sampling keeps the distribution -----------------------------------------------------------------------
def _target_probs(logits_V: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """softmax(logits / T) over the top-k tokens: written out here, not the sampler's code."""
    keep = logits_V.topk(top_k).indices
    p = torch.zeros_like(logits_V)
    p[keep] = torch.softmax(logits_V[keep] / temperature, dim=0)
    return p


def _chi_square_p_value(counts: Counter, p_V: torch.Tensor) -> float:
    """Pearson's chi-square test of observed token counts against the probabilities p_V: tokens expected at least 5
    times are bins of their own, the rest one bin if it is expected 5 times too (else it may hold at most 5
    draws: more of tokens that p_V makes that rare is a p-value of 0)."""
    n = sum(counts.values())
    expected = (p_V.double() * n).tolist()
    big = [t for t, e in enumerate(expected) if e >= 5]
    obs = [counts.get(t, 0) for t in big]
    exp = [expected[t] for t in big]
    rest_e, rest_o = n - sum(exp), n - sum(obs)
    if rest_e >= 5:
        obs.append(rest_o)
        exp.append(rest_e)
    elif rest_o > 5:
        return 0.0
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


ALPHA = 1e-3  # the test's significance: a correct sampler fails it with probability 0.1% (fixed seeds: never here)


@pytest.mark.parametrize("drafter", ["deterministic", "mtp"])
def test_rejection_sampling_keeps_the_target_distribution(drafter, folders):
    """20,000 seeded verifications of one context with K = 2 drafts at temperature 0.8, top-k 40: the first token
    delivered is distributed as the target's p_0 (computed directly from the model's logits), the second, among
    the verifications that accepted draft 1, as p_1 (the bonus or the residual after draft 2). Deterministic
    drafts: the two most likely tokens (q one-hot); MTP: drafts drawn from the MTP module's distribution q under
    the same transforms. The test would see a sampler that delivered the drafts' distribution instead."""
    model = load_pretrained(folders[MLA], dtype=torch.float32, device="cpu").eval()
    ids = _prompts(1, seed=8, lo=12, hi=13)[0]
    T, top_k, B = 0.8, 40, 20_000
    params = SamplingParams(temperature=T, top_k=top_k)
    with torch.no_grad():
        logits0 = model(torch.tensor([ids]))[0, -1]
    p0 = _target_probs(logits0, T, top_k)
    gens = [torch.Generator().manual_seed(1000 + i) for i in range(B)]
    if drafter == "deterministic":
        d1, d2 = p0.topk(2).indices.tolist()
        drafts, q = [[d1, d2]] * B, [None] * B
        logits1 = model(torch.tensor([ids + [d1]]))[0, -1].detach()
        logits2 = model(torch.tensor([ids + [d1, d2]]))[0, -1].detach()
        logits_RV = torch.stack([logits0, logits1, logits2]).repeat(B, 1)
    else:  # q of draft 1 from the training model's module (V3's formula), draft 2 from its row one on
        m = model.mtp[0]
        with torch.no_grad():
            x = torch.tensor([ids])
            h = model._trunk(x, None, None)[0]
            rows = m.eh_proj(torch.cat([m.enorm(model.embed_tokens(x)[:, 1:]), m.hnorm(h[:, :-1])], dim=-1))
            out = m.block(rows, *model.rope_cos_sin(rows.shape[1], x.device))
            q1 = _target_probs(model.head(m.norm(out[0, -1])), T, top_k)
        draw_g = torch.Generator().manual_seed(5)
        d1s = torch.multinomial(q1, B, replacement=True, generator=draw_g).tolist()
        # A second draft that is always the same token (q one-hot at it): the second position then tests the
        # residual of a deterministic draft against p_1 given each first draft.
        logits_by_d1 = {}
        drafts, q = [], []
        for d1 in d1s:
            if d1 not in logits_by_d1:
                with torch.no_grad():
                    l1 = model(torch.tensor([ids + [d1]]))[0, -1]
                    d2 = int(l1.argmax())
                    l2 = model(torch.tensor([ids + [d1, d2]]))[0, -1]
                logits_by_d1[d1] = (l1, d2, l2)
            l1, d2, _ = logits_by_d1[d1]
            drafts.append([d1, d2])
            one_hot = torch.zeros_like(q1)
            one_hot[d2] = 1.0
            q.append(torch.stack([q1, one_hot]))
        logits_RV = torch.cat([torch.stack([logits0, logits_by_d1[d1][0], logits_by_d1[d1][2]]) for d1 in d1s])
    groups = [Verify(drafts[i], q[i], [SampleRow(params, ids, [], gens[i])] * 3) for i in range(B)]
    verdicts = verify(logits_RV, groups)
    first = Counter(v.tokens[0] for v in verdicts)
    assert _chi_square_p_value(first, p0) > ALPHA
    if drafter == "mtp":
        assert _chi_square_p_value(Counter(d[0] for d in drafts), p0) < ALPHA  # q is not p: the test has power
        d1 = max(logits_by_d1, key=lambda t: sum(d[0] == t and v.accepted >= 1 for d, v in zip(drafts, verdicts)))
        logits1 = logits_by_d1[d1][0]
    else:
        assert _chi_square_p_value(Counter([d1] * 50 + [d2] * 50), p0) < ALPHA
    second = Counter(v.tokens[1] for d, v in zip(drafts, verdicts) if v.accepted >= 1 and d[0] == d1)
    assert sum(second.values()) > 300
    assert _chi_square_p_value(second, _target_probs(logits1, T, top_k)) > ALPHA


def test_verification_in_chunks_of_rows_gives_the_same_tokens(monkeypatch):
    """A large step is verified a chunk of whole requests at a time (bounded memory, as plain sampling): seeded
    requests get the same tokens and log-probabilities."""
    from paraseek.infer import sampling

    torch.manual_seed(0)
    V = 50
    logits = torch.randn(18, V) * 3
    best = logits.argmax(-1).tolist()  # drafts that are the argmax at their rows: accepted (greedy) or likely
    spec = [(best[0:3], 0.8), ([], 0.0), (best[5:7], 0.0), ([9], 1.0), ([2, 5, 8], 0.0), ([], 0.7), (best[15:17], 0.0)]
    assert sum(len(d) + 1 for d, _ in spec) == 18

    def groups():
        return [Verify(d, None, [SampleRow(SamplingParams(temperature=t, top_p=0.9, logprobs=1), [], [],
                                           torch.Generator().manual_seed(i))] * (len(d) + 1))
                for i, (d, t) in enumerate(spec)]

    whole = verify(logits, groups())
    monkeypatch.setattr(sampling, "SAMPLE_CHUNK_LOGITS", 3 * V)  # three rows a chunk: a 4-row request alone
    chunked = verify(logits, groups())
    assert [v.tokens for v in chunked] == [v.tokens for v in whole]
    assert [v.logprobs for v in chunked] == [v.logprobs for v in whole]
    assert any(v.accepted for v in whole)


# ---- prompt lookup, counts -------------------------------------------------------------------------------------------
def _brute_force_lookup(ids, n_min, n_max, k):
    for n in range(n_max, n_min - 1, -1):
        if n >= len(ids):
            continue
        suffix = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):  # latest earlier occurrence first
            if ids[start:start + n] == suffix:
                return ids[start + n:start + n + k]
    return []


def test_prompt_lookup_against_a_brute_force_search():
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        ids = torch.randint(0, 4, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        n_min = int(torch.randint(1, 4, (1,), generator=g))
        n_max = n_min + int(torch.randint(0, 3, (1,), generator=g))
        for k in (1, 3, 5):
            assert ngram_drafts(ids, n_min, n_max, k) == _brute_force_lookup(ids, n_min, n_max, k), (ids, n_min, n_max)
    assert ngram_drafts([5, 6, 7, 9, 5, 6, 7], 2, 3, 4) == [9, 5, 6, 7]  # the 3-gram 5 6 7 proposes what followed it
    assert ngram_drafts([1, 2, 3], 1, 3, 2) == []


def test_accepted_counts_per_position():
    s = SpecStats(3)
    for proposed, accepted in [(3, 3), (3, 1), (2, 0), (3, 2), (0, 0)]:
        s.add(proposed, accepted)
    out = s.summary()
    assert (out["drafts"], out["draft_tokens"], out["accepted_tokens"]) == (4, 11, 6)
    assert out["accepted_per_position"] == [3 / 4, 2 / 4, 1 / 3]
    assert out["mean_accepted_length"] == 1 + 6 / 4
    before = s.snapshot()
    s.add(1, 1)
    assert s.since(before).summary()["accepted_per_position"] == [1.0, None, None]


def test_a_model_without_mtp_weights_is_refused_in_one_line(folders):
    from paraseek.errors import UserError

    model = copy.deepcopy(load_pretrained(folders[DENSE], dtype=torch.float32, device="cpu"))
    model.mtp = torch.nn.ModuleList()
    with pytest.raises(UserError, match="has no MTP module"):
        Engine(model, EngineConfig(block_size=8, num_kv_blocks=64, speculative="mtp"), log=lambda *_: None)


# ---- the commands ----------------------------------------------------------------------------------------------------
def _jsonl(path, prompts):
    import json

    path.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    return str(path)


def test_generate_json_reports_each_requests_drafts(folders, tmp_path, capsys):
    import json

    from paraseek.cli import main

    folder, prompts = str(folders[f"{DENSE}-predictable"]), _jsonl(tmp_path / "p.jsonl", _prompts(3, seed=9))
    argv = ["generate", folder, "--prompts", prompts, "--json", "--quiet", "--max-new-tokens", "12", "--ignore-eos"]
    assert main(argv) == 0
    plain = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main(argv + ["--speculative", "mtp", "--num-speculative-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["token_ids"] for r in rows] == [r["token_ids"] for r in plain]
    assert all(0 <= r["accepted_draft_tokens"] <= r["draft_tokens"] for r in rows)
    assert sum(r["accepted_draft_tokens"] for r in rows) > 0 and "draft_tokens" not in plain[0]
    assert "speculative decoding: " in err and "tokens per verification step" in err
    assert "while at most 16 requests run (--speculative-max-batch)" in err
    assert main(argv + ["--speculative", "ngram", "--speculative-max-batch", "1"]) == 0  # 3 requests: plain steps
    out, err = capsys.readouterr()
    assert [json.loads(line)["token_ids"] for line in out.splitlines()] == [r["token_ids"] for r in plain]
    assert "plain steps (more requests ran than --speculative-max-batch)" in err


def test_bench_infer_reports_accepted_per_position(folders, capsys):
    import json

    from paraseek.cli import main

    argv = ["bench-infer", str(folders[f"{MLA}-predictable"]), "--speculative", "ngram",
            "--num-speculative-tokens", "2", "--ngram-min", "1", "--num-requests", "4", "--input-len", "4:20", "--output-len", "20:30",
            "--latency-input", "16", "--latency-output", "30", "--reps", "1", "--concurrency", "1,3",
            "--concurrency-input", "16", "--concurrency-output", "30", "--max-num-seqs", "4"]
    assert main(argv + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["engine"]["speculative"] == "ngram" and r["engine"]["num_speculative_tokens"] == 2
    for part in (r["latency"], r["throughput"], *r["concurrency"]):
        s = part["speculative"]
        assert len(s["accepted_per_position"]) == 2 and s["draft_tokens"] > 0
        assert s["mean_accepted_length"] == 1 + s["accepted_tokens"] / s["drafts"]
        assert s["plain_steps"] == 0  # at most 4 requests run, under the default --speculative-max-batch 16
    assert r["latency"]["tpot_ms"] > 0 and r["throughput"]["output_tokens"] > 0
    assert main(argv + ["--workloads", "latency"]) == 0
    assert "drafts accepted" in capsys.readouterr().out


@pytest.mark.parametrize("flags,says", [
    (["--speculative", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens must be >= 1"),
    (["--num-speculative-tokens", "2"], "--num-speculative-tokens applies to speculative decoding"),
    (["--speculative", "ngram", "--ngram-min", "3", "--ngram-max", "2"], "must satisfy 1 <= min <= max"),
    (["--speculative", "mtp", "--ngram-max", "3"], "--ngram-max sets the prompt lookup of --speculative ngram"),
    (["--speculative", "ngram", "--num-speculative-tokens", "40", "--max-batched-tokens", "32"],
     "more than --max-batched-tokens 32"),
    (["--speculative-max-batch", "4"], "--speculative-max-batch applies to speculative decoding"),
    (["--speculative", "ngram", "--speculative-max-batch", "0"], "--speculative-max-batch must be >= 1"),
    (["--speculative", "mtp"], "has no MTP module"),
    (["--speculative", "ngram", "--json-schema", "schema.json"], "a grammar-constrained output does not draft"),
])
def test_bad_speculative_flags_are_one_line(flags, says, tmp_path, capsys, monkeypatch):
    from paraseek.cli import main
    from paraseek.infer.model import InferenceModel

    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the flags were checked")

    monkeypatch.setattr(InferenceModel, "from_folder", refuse)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    torch.manual_seed(0)
    save_pretrained(build_model(ModelArgs.from_hf_config(VARIANTS[DENSE]), "cpu", torch.float32), tmp_path / "m")
    prompts = _jsonl(tmp_path / "p.jsonl", [[1, 2, 3]])
    assert main(["generate", str(tmp_path / "m"), "--prompts", prompts, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def test_the_server_loop_streams_every_accepted_token_and_the_metrics_count_the_drafts(folders):
    """The server's engine loop delivers a verification step's tokens together (one delta may hold several), all
    of plain greedy's tokens in order; /metrics has vLLM's spec_decode counters with the engine's counts."""
    import dataclasses
    import threading
    import time

    from prometheus_client import generate_latest

    from paraseek.serve.loop import EngineLoop
    from paraseek.serve.metrics import ServerMetrics

    folder = folders[f"{DENSE}-predictable"]
    prompts = _prompts(3, seed=10)
    plain = _outputs(_engine(folder), prompts)
    engine = _engine(folder, speculative="mtp", num_speculative_tokens=3)
    loop = EngineLoop(engine)
    loop.metrics = metrics = ServerMetrics(engine.stats, "tiny", 8, engine.max_model_len)
    deltas: dict[int, list] = {i: [] for i in range(len(prompts))}
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    for i, p in enumerate(prompts):
        loop.submit_to(f"r{i}", p, dataclasses.replace(GREEDY), deltas[i].append)
    deadline = time.time() + 120
    while not all(ds and getattr(ds[-1], "finished", True) for ds in deltas.values()) and time.time() < deadline:
        time.sleep(0.02)
    loop.stop()
    thread.join(10)
    assert [[t for d in deltas[i] for t in d.token_ids] for i in range(len(prompts))] == plain
    assert any(len(d.token_ids) > 1 for ds in deltas.values() for d in ds)
    text = generate_latest(metrics.registry).decode()
    st, label = engine.drafter.stats, 'engine="0",model_name="tiny"'
    assert st.num_accepted_tokens > 0
    for name, n in (("num_drafts", st.num_drafts), ("num_draft_tokens", st.num_draft_tokens),
                    ("num_accepted_tokens", st.num_accepted_tokens)):
        assert f"vllm:spec_decode_{name}_total{{{label}}} {float(n)}" in text, name
    for pos, n in enumerate(st.accepted_per_pos):
        assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{pos}"}} {float(n)}' in text


def test_replicas_sum_their_accepted_per_position():
    from types import SimpleNamespace

    from paraseek.serve.replicas import ReplicaSet

    one = {"spec_num_drafts": 3, "spec_num_draft_tokens": 6, "spec_num_accepted_tokens": 4,
           "spec_accepted_per_pos": [3, 1], "kv_blocks_used": 1, "kv_blocks_total": 10}
    two = {"spec_num_drafts": 2, "spec_num_draft_tokens": 4, "spec_num_accepted_tokens": 3,
           "spec_accepted_per_pos": [2, 1], "kv_blocks_used": 3, "kv_blocks_total": 10}
    local = SimpleNamespace(engine=SimpleNamespace(stats=lambda: dict(one)))
    out = ReplicaSet(local, [SimpleNamespace(stats=dict(two))]).stats()
    assert out["spec_accepted_per_pos"] == [5, 2] and out["spec_num_accepted_tokens"] == 7
