"""Speculative decoding on CUDA: with the Triton kernels, flash prefill and CUDA graphs (ngram: decode-only steps
replay their graphs between eager verification steps; mtp: every step eager), greedy speculation gives the greedy
tokens of the engine without it, in fp32; in bf16 with MoE it runs within the sized memory and gives every block
back."""

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


@pytest.mark.parametrize("cfg", [GQA, dict(MLA, first_k_dense_replace=3)], ids=["gqa", "mla"])
def test_speculation_gives_the_plain_greedy_tokens_fp32(cfg):
    prompts = [p + p for p in _prompts(8, cfg["vocab_size"])]  # repeated passages: prompt lookup has drafts
    plain = [r.output_ids for r in _engine(cfg, torch.float32).generate(prompts, GREEDY)]
    for kw in (dict(speculative="ngram", num_speculative_tokens=3, ngram_min=1),
               dict(speculative="mtp", num_speculative_tokens=3)):
        engine = _engine(cfg, torch.float32, **kw)
        replays = []
        run = engine.runner.run
        engine.runner.run = lambda hb, src=None: (replays.append(engine.runner.graph_key(hb) is not None),
                                                  run(hb, src))[1]
        assert [r.output_ids for r in engine.generate(prompts, GREEDY)] == plain, kw
        assert engine.drafter.stats.num_draft_tokens > 0 and engine.pool.num_used == 0
        assert any(replays) == (kw["speculative"] == "ngram"), kw  # mtp captures no graphs


def test_mtp_speculation_in_bf16_with_moe_runs_within_its_memory():
    prompts = _prompts(16, MLA["vocab_size"], seed=3)
    engine = _engine(MLA, torch.bfloat16, speculative="mtp", num_speculative_tokens=2)
    reqs = engine.generate(prompts, GREEDY)
    assert all(len(r.output_ids) == GREEDY.max_tokens for r in reqs)
    assert engine.drafter.stats.num_draft_tokens > 0 and engine.pool.num_used == 0
    assert not engine.runner.graphs
