"""Verification as decode rows (engine._host_batch): a request's last token and K drafts laid out as K + 1 decode
rows, each at its own position with its own context length over the request's block table, give the logits of the
same tokens laid out as one chunk through the prefill path (fp32, on a dense and an MLA/MoE model); the decode
CUDA graph a verification step maps to; the MTP drafter's rows the same way."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_hf_parity import VARIANTS  # noqa: E402

from paraseek.infer.engine import Engine, EngineConfig, max_decode_rows, rows_first  # noqa: E402
from paraseek.infer.runner import HostBatch, ModelRunner  # noqa: E402
from paraseek.infer.sampling import SamplingParams  # noqa: E402
from paraseek.models import ModelArgs, build_model  # noqa: E402

DENSE, MLA = "llama-gqa-llama3rope", "v3-noaux-yarn"
BS = 8


def _engine(variant: str, **kw) -> Engine:
    args = ModelArgs.from_hf_config({**VARIANTS[variant], "num_nextn_predict_layers": 1})
    torch.manual_seed(0)
    model = build_model(args, "cpu", torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" not in name else 0.1) + (1.0 if "norm" in name else 0.0))
    cfg = dict(block_size=BS, num_kv_blocks=64, max_batched_tokens=64, speculative="ngram",
               num_speculative_tokens=3)
    cfg = cfg | kw
    if cfg["speculative"] == "ngram":
        cfg["ngram_min"] = 1
    return Engine(model, EngineConfig(**cfg), log=lambda *_: None)


def _as_chunks(plan, bs: int) -> HostBatch:
    """The reference layout: every item one prefill chunk over its whole context (the prefill attention path)."""
    ids, pos, slots, k_slots, lens, logits_idx, row = [], [], [], [], [], [], 0
    for s in plan.items:
        req = s.request
        blocks = np.asarray(req.blocks, dtype=np.int64)
        p = np.arange(s.start, s.start + s.n)
        ids += req.token_ids[s.start:s.start + s.n - s.num_drafts] + req.drafts[:s.num_drafts]
        pos.append(p)
        slots.append(blocks[p // bs] * bs + p % bs)
        c = np.arange(s.start + s.n)
        k_slots.append(blocks[c // bs] * bs + c % bs)
        lens.append((s.n, s.start + s.n))
        logits_idx += range(row, row + s.n)
        row += s.n
    return HostBatch(np.asarray(ids, np.int64), np.concatenate(pos), np.concatenate(slots), 0,
                     np.zeros((0, 1), np.int32), np.zeros(0, np.int32), lens, np.concatenate(k_slots),
                     np.asarray(logits_idx, np.int64))


@pytest.mark.parametrize("variant", [DENSE, MLA])
def test_verification_rows_give_the_chunk_logits(variant):
    """Three requests (contexts across block boundaries) each verify K = 3 drafts: every row's logits as decode
    rows equal those of the chunk layout."""
    engine = _engine(variant)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 13, 22)]
    reqs = [engine.add_request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    while any(r.num_computed < len(r.prompt_ids) for r in reqs):  # the prefills, then one token each
        engine.step()
    for r in reqs:
        r.drafts = torch.randint(0, 300, (3,), generator=g).tolist()
    plan = engine.scheduler.schedule()
    plan.items = rows_first(plan.items)
    assert [s.num_drafts for s in plan.items] == [3, 3, 3]
    hb, _ = engine._host_batch(plan)
    assert hb.n_decode == len(hb.ids) == 12 and hb.lens == []
    assert hb.context_lens.tolist() == [p + 1 for p in hb.pos.tolist()]
    rows = engine.runner.run(hb).clone()
    chunks = engine.runner.run(_as_chunks(plan, BS))
    torch.testing.assert_close(rows, chunks, rtol=1e-5, atol=1e-5)


def test_rows_first_keeps_the_order_within_each_kind():
    from types import SimpleNamespace as NS

    items = [NS(n=1, num_drafts=0, k="d"), NS(n=9, num_drafts=0, k="p1"), NS(n=4, num_drafts=3, k="v1"),
             NS(n=7, num_drafts=0, k="p2"), NS(n=2, num_drafts=1, k="v2")]
    assert [s.k for s in rows_first(items)] == ["d", "v1", "v2", "p1", "p2"]


def test_a_verification_step_maps_to_the_decode_graph_of_its_rows():
    """Graph selection without a GPU: the captured keys stand in for graphs. A step of two requests verifying
    K = 3 drafts (8 rows) takes the 8-row graph; a step that also holds a prefill chunk runs eagerly."""
    engine = _engine(DENSE, max_num_seqs=4)
    sizes = engine._graph_batch_sizes()
    assert sizes[-1] == max_decode_rows(engine.cfg) == 16  # 4 sequences x (K + 1)
    runner: ModelRunner = engine.runner
    runner.graphs = {(b, w): None for b in sizes for w in (2, 8)}
    runner.graph_batch_sizes, runner._widths = sizes, [2, 8]
    g = torch.Generator().manual_seed(2)
    reqs = [engine.add_request(f"r{i}", torch.randint(0, 300, (n,), generator=g).tolist(),
                               SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
            for i, n in enumerate((6, 12))]
    runner.graphs, saved = {}, runner.graphs  # the prefill runs eagerly (no graph replays on CPU)
    while any(r.num_computed < len(r.prompt_ids) for r in reqs):
        engine.step()
    runner.graphs = saved
    for r in reqs:
        r.drafts = [1, 2, 3]
    plan = engine.scheduler.schedule()
    plan.items = rows_first(plan.items)
    hb, _ = engine._host_batch(plan)
    assert runner.graph_key(hb) == (8, 2)  # 8 rows; block tables of 2 blocks (16 tokens)
    engine.add_request("r2", list(range(20)), SamplingParams(max_tokens=4, temperature=0))
    for r in reqs:
        r.drafts = [1, 2, 3]
    plan = engine.scheduler.schedule()
    plan.items = rows_first(plan.items)
    hb, _ = engine._host_batch(plan)
    assert hb.n_decode < len(hb.ids) and runner.graph_key(hb) is None


def test_mtp_drafter_steps_are_decode_rows_and_map_to_the_drafter_graphs():
    """The drafter's rows of a verified step (here 3 positions of one request, then 1 of another): decode rows at
    their positions, logits at each segment's last row; with MTP graphs captured the step maps to the drafter's
    graph of its row count, without them it runs eagerly. A prefill chunk's longer segment stays a chunk (after the
    rows) and the step runs eagerly."""
    from types import SimpleNamespace as NS

    from paraseek.infer.spec import _drafter_batch, _Segment

    a, b, c = NS(blocks=[3, 4]), NS(blocks=[7]), NS(blocks=[9, 10])
    segs = [_Segment(a, 6, [11, 12, 13], [0, 1, 2]), _Segment(b, 2, [21], [5])]
    hb, order = _drafter_batch(segs, BS, {id(a), id(b)}, max_rows=4)
    assert order == segs and hb.n_decode == len(hb.ids) == 4 and hb.lens == []
    assert hb.pos.tolist() == [6, 7, 8, 2] and hb.context_lens.tolist() == [7, 8, 9, 3]
    assert hb.slots.tolist() == [3 * BS + 6, 3 * BS + 7, 4 * BS + 0, 7 * BS + 2]
    assert hb.block_tables.tolist() == [[3, 4], [3, 4], [3, 4], [7, 0]]
    assert hb.logits_idx.tolist() == [2, 3] and hb.hidden_rows.tolist() == [0, 1, 2, 5]
    runner = _engine(MLA, speculative="mtp", num_speculative_tokens=2).runner
    runner.graphs = runner.mtp_graphs = {(s, 2): None for s in (1, 2, 4, 8)}
    runner.graph_batch_sizes, runner._widths = [1, 2, 4, 8], [2]
    assert runner.graph_key(hb) is None  # no hidden-state buffers: not captured for MTP
    runner._h_out = torch.zeros(8, 1)
    assert runner.graph_key(hb) == (4, 2)
    prefill = _Segment(c, 0, list(range(10)), list(range(6, 16)))
    hb, order = _drafter_batch([prefill] + segs, BS, {id(a), id(c)}, max_rows=4)
    assert order == segs + [prefill] and hb.n_decode == 4 and hb.lens == [(10, 10)]
    assert hb.logits_idx.tolist() == [2, 13] and hb.hidden_rows.tolist() == [0, 1, 2, 5] + list(range(6, 16))
    assert runner.graph_key(hb) is None
