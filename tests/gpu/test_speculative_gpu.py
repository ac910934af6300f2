"""Speculative decoding on CUDA: with the Triton kernels, flash prefill and CUDA graphs, verification steps (K + 1
decode rows a request) replay the decode graphs with both drafters, and with `mtp` the drafter's steps replay graphs
of their own; greedy speculation gives the greedy tokens of the engine without it, in fp32; in bf16 with MoE it runs
within the sized memory and gives every block back."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from paraseek.infer.engine import Engine, EngineConfig  # noqa: E402
from paraseek.infer.sampling import SamplingParams  # noqa: E402
from paraseek.models import ModelArgs, build_model  # noqa: E402
from test_infer_gpu import GQA, MLA, _prompts  # noqa: E402

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def _engine(cfg, dtype, **kw):
    torch.manual_seed(0)
    model = build_model(ModelArgs.from_hf_config({**cfg, "num_nextn_predict_layers": 1}), "cuda", dtype).eval()
    return Engine(model, EngineConfig(num_kv_blocks=400, max_batched_tokens=256, **kw), log=lambda *_: None)


def _count_replays(engine) -> dict:
    """Counts of the runner's steps by kind: target or drafter, replayed or eager, and verifications replayed."""
    runner, run, counts = engine.runner, engine.runner.run, {}

    def counted(hb, src=None):
        key = runner.graph_key(hb)
        kind = ("drafter" if hb.hidden_rows is not None else "target") + ("_graph" if key is not None else "_eager")
        counts[kind] = counts.get(kind, 0) + 1
        if key is not None and hb.hidden_rows is None and len(hb.ids) > len(set(hb.block_tables[:, 0].tolist())):
            counts["verify_graph"] = counts.get("verify_graph", 0) + 1  # more rows than requests: drafts verified
        return run(hb, src)

    runner.run = counted
    return counts


@pytest.mark.parametrize("cfg", [GQA, dict(MLA, first_k_dense_replace=3)], ids=["gqa", "mla"])
@pytest.mark.parametrize("batch", [1, 8])
def test_graphed_speculation_gives_the_plain_greedy_tokens_fp32(cfg, batch):
    prompts = [p + p for p in _prompts(8, cfg["vocab_size"])][:batch]  # repeated passages: prompt lookup has drafts
    plain = [r.output_ids for r in _engine(cfg, torch.float32).generate(prompts, GREEDY)]
    for kw in (dict(speculative="ngram", num_speculative_tokens=3, ngram_min=1),
               dict(speculative="mtp", num_speculative_tokens=3)):
        engine = _engine(cfg, torch.float32, **kw)
        assert engine.runner.graphs and bool(engine.runner.mtp_graphs) == (kw["speculative"] == "mtp"), kw
        counts = _count_replays(engine)
        assert [r.output_ids for r in engine.generate(prompts, GREEDY)] == plain, kw
        assert engine.drafter.stats.num_draft_tokens > 0 and engine.pool.num_used == 0
        assert counts.get("verify_graph", 0) > 0, (kw, counts)
        if kw["speculative"] == "mtp":
            assert counts.get("drafter_graph", 0) > 0, counts


def test_graphed_mtp_speculation_gives_the_eager_tokens_fp32():
    """The same engine's steps with and without the graphs: the same tokens (the graphs hold the same kernels)."""
    prompts = [p + p for p in _prompts(4, MLA["vocab_size"], seed=5)]
    kw = dict(speculative="mtp", num_speculative_tokens=2)
    eager = [r.output_ids for r in _engine(MLA, torch.float32, enforce_eager=True, **kw).generate(prompts, GREEDY)]
    graphed = [r.output_ids for r in _engine(MLA, torch.float32, **kw).generate(prompts, GREEDY)]
    assert graphed == eager


def test_mtp_speculation_in_bf16_with_moe_runs_within_its_memory():
    prompts = _prompts(16, MLA["vocab_size"], seed=3)
    engine = _engine(MLA, torch.bfloat16, speculative="mtp", num_speculative_tokens=2)
    counts = _count_replays(engine)
    reqs = engine.generate(prompts, GREEDY)
    assert all(len(r.output_ids) == GREEDY.max_tokens for r in reqs)
    assert engine.drafter.stats.num_draft_tokens > 0 and engine.pool.num_used == 0
    assert engine.runner.mtp_graphs and counts.get("drafter_graph", 0) > 0, counts


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_speculation_paused_above_the_max_batch_gives_the_plain_greedy_tokens_fp32(method):
    """8 requests, --speculative-max-batch 3: graphed plain steps (with ngram the overlapped ones) while more than 3
    run, graphed verification steps once the short ones finish; plain greedy's tokens, both kinds of steps."""
    prompts = [p + p for p in _prompts(8, MLA["vocab_size"], seed=7)]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (4, 6, 8, 10, 12, 40, 40, 40)]
    plain = [r.output_ids for r in _engine(MLA, torch.float32).generate(prompts, params)]
    engine = _engine(MLA, torch.float32, speculative=method, num_speculative_tokens=2, speculative_max_batch=3,
                     **(dict(ngram_min=1) if method == "ngram" else {}))
    counts = _count_replays(engine)
    assert [r.output_ids for r in engine.generate(prompts, params)] == plain
    st = engine.drafter.stats.summary()
    assert st["plain_steps"] > 0 and st["draft_tokens"] > 0 and engine.pool.num_used == 0, st
    assert counts.get("verify_graph", 0) > 0, counts
