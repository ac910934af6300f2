"""`plan --mode infer` prices the layouts the engine runs (tp, ep, tp == ep, ep with dp-attention) with what the
engine holds: each layout's per-rank weight bytes against the tensors InferenceModel.build keeps on that rank
(bf16 and FP8 with its block scales, quantized on load or kept from an FP8 folder), its KV bytes per token against
the engine's cache shape, DeepSeek-V3 on 8 H200s in every layout with dp-attention's cache summed over the ranks,
the engine's pool prediction (planned_kv_tokens) read off an ep or dp-attention engine, and the CLI's layout names
and serve commands. A rank is built in one process: the model asks torch.distributed only for the group's size
and its rank, which these tests answer."""

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fp8_models import TINY_GQA, TINY_V3, write_fp8, write_source
from paraseek.infer.cache import CacheShape
from paraseek.infer.model import InferenceModel
from paraseek.infer.weights import ModelWeights
from paraseek.models import ModelArgs, resolve_model
from paraseek.models.deepseek import build_model
from paraseek.planner import make_cluster
from paraseek.planner.infer import (Layout, kv_bytes_per_token, layouts, plan_inference, planned_kv_tokens,
                                    rank_weight_bytes)
from plan_cli import run_plan_cli

V3 = dict(TINY_V3, num_nextn_predict_layers=0)  # the engine builds the MTP module only to draft with it


def held_bytes(m: InferenceModel) -> int:
    """Bytes of the weights a built rank holds: every tensor reachable from its layers, embedding, head and final
    norm, each storage once (MLA's W_UK / W_UV are views of kv_b, a tied head at tp 1 is the embedding)."""
    seen_objs, seen, total = set(), set(), 0

    def walk(x) -> None:
        nonlocal total
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif hasattr(x, "__dict__") and id(x) not in seen_objs and not isinstance(x, ModelArgs):
            seen_objs.add(id(x))
            for y in vars(x).values():
                walk(y)

    walk([m.layers, m.embed_w, m.head_w, m.final_norm])
    return total


def build_rank(monkeypatch, source, a: ModelArgs, lay: Layout, rank: int, fp8: bool) -> InferenceModel:
    """Rank `rank` of the layout, as InferenceModel.build lays it out (dp-attention holds what ep alone holds)."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: lay.ranks)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    group = object() if lay.ranks > 1 else None
    return InferenceModel.build(source, a, group, torch.bfloat16, "cpu", fp8, ep=lay.ep, tp=lay.tp)


def training_weights(a: ModelArgs) -> ModelWeights:
    torch.manual_seed(0)
    return ModelWeights(build_model(a, "cpu", torch.bfloat16))  # a build empties it: one per rank


@pytest.mark.parametrize("cfg", [V3, TINY_GQA], ids=["v3", "gqa"])
@pytest.mark.parametrize("weight_dtype", ["bf16", "fp8"])
def test_each_layouts_weights_and_kv_bytes_are_what_a_rank_holds(monkeypatch, cfg, weight_dtype):
    a = ModelArgs.from_hf_config(cfg)
    lays = layouts(a, 8)
    names = {lay.name for lay in lays}
    if a.n_routed_experts:  # 4 heads, 8 experts: tp up to 4, ep up to 8
        assert {"tp4", "tp1 ep8", "tp4 ep4", "tp1 ep8 dp-attn"} <= names and "tp8" not in names
    else:
        assert names == {"tp1", "tp2", "tp4", "tp8"}  # a dense model: tp only
    for lay in lays:
        for rank in sorted({0, lay.ranks - 1}):  # the last rank's head rows are padded
            m = build_rank(monkeypatch, training_weights(a), a, lay, rank, weight_dtype == "fp8")
            assert rank_weight_bytes(a, lay, weight_dtype) == held_bytes(m), (lay.name, rank)
            for kv_dtype in ("auto", "fp8"):  # the engine sizes its cache at its model's tp (engine.py)
                engine = CacheShape.of(a, m.tp, fp8=kv_dtype == "fp8").bytes_per_token(m.dtype)
                assert kv_bytes_per_token(a, lay.tp, kv_dtype) == engine, (lay.name, kv_dtype)


def test_fp8_checkpoint_blocks_kept_are_priced_as_held(monkeypatch, tmp_path):
    """An FP8 folder's blocks kept as stored (its scales read, not recomputed): the same bytes."""
    from paraseek.infer.weights import FolderWeights
    from paraseek.models.hf import fp8_block_size

    folder = write_fp8(write_source(tmp_path / "src", V3), tmp_path / "fp8")
    cfg = json.loads((folder / "config.json").read_text())
    a = ModelArgs.from_hf_config(cfg)
    for lay in (Layout(1, 2), Layout(2, 2), Layout(2)):
        src = FolderWeights(folder, a, fp8_block_size(cfg, folder))
        try:
            m = build_rank(monkeypatch, src, a, lay, 1, True)
        finally:
            src.close()
        assert m.weights.startswith("FP8") and "kept" in m.weights and "quantized" not in m.weights
        assert rank_weight_bytes(a, lay, "fp8") == held_bytes(m), lay.name


def test_v3_on_8_h200_fp8_every_layout_and_dp_attention_caches_per_rank():
    v3 = resolve_model("deepseek-v3")[0]
    rows = {r.layout.name: r for r in plan_inference(v3, make_cluster("H200", 8), 4096, weight_dtype="fp8")}
    assert {"tp8", "tp1 ep8", "tp8 ep8", "tp1 ep8 dp-attn"} <= {n for n, r in rows.items() if not r.reason}
    rep, dpa = rows["tp1 ep8"], rows["tp1 ep8 dp-attn"]
    # The same weights a rank (attention, dense layers and shared experts whole; 32 routed experts)...
    assert rep.weights_gib == dpa.weights_gib > rows["tp8"].weights_gib == rows["tp8 ep8"].weights_gib
    assert rep.kv_bytes_per_token == dpa.kv_bytes_per_token == 61 * 2 * (512 + 64)  # the whole latent a rank
    # ... but replicated attention caches every request on every rank, dp-attention each rank its own: the copy's
    # cache is 8 ranks' (more than 8x: a rank's attention workspace is its 1/8 of the step's tokens).
    assert rep.kv_tokens == rep.max_context and dpa.kv_tokens == 8 * dpa.max_context
    assert dpa.max_batch == 8 * (dpa.max_context // 4096)
    assert 8 <= dpa.kv_tokens / rep.kv_tokens < 12
    assert all(r.replicas == 1 and r.decode_tokens_per_s_per_gpu > 0 for r in (rep, dpa))


def test_each_layouts_step_reads_its_rows_and_pays_its_collectives():
    """Under dp-attention a rank's attention reads its own rows and its MoE every rank's; the MoE collective is
    priced as training's: ep's all-reduce of [N, D] a MoE layer, dp-attention's all-gather and reduce-scatter of
    every rank's rows, tp's two all-reduces a layer."""
    from paraseek.planner import infer_speed as S
    from paraseek.planner.cost import collective

    v3, c = resolve_model("deepseek-v3")[0], make_cluster("H200", 8)
    moe_layers, row = 58, 2 * v3.dim

    def ops(lay, rows):
        return {name: (nbytes, flops) for name, _, _, _, nbytes, flops in
                S.step_ops(v3, lay, 1, S.StepShape(rows, rows * 1024, [], rows))}

    dpa, ep = ops(Layout(1, 8, True), 8), ops(Layout(1, 8), 64)
    assert dpa["moe_gate_up"] == ep["moe_gate_up"] and dpa["router"] == ep["router"]
    assert dpa["decode_attention"] == ops(Layout(1, 8), 8)["decode_attention"]
    assert "shared_gate_up" in ep and "shared_gate_up" not in ops(Layout(8), 64)  # stacked with the routed ones

    def comm(lay, rows):
        bd: dict = {}
        S.decode_step_seconds(v3, c, lay, 1, rows, 1024, 256, bd)
        return bd["collectives"]

    tp = 2 * 61 * collective(c, 64 * row, 1, 8, "all_reduce")
    assert comm(Layout(8), 64) == pytest.approx(tp) and comm(Layout(8, 8), 64) == pytest.approx(tp)
    assert comm(Layout(1, 8), 64) == pytest.approx(moe_layers * collective(c, 64 * row, 1, 8, "all_reduce"))
    full = 8 * 8 * row
    assert comm(Layout(1, 8, True), 8) == pytest.approx(
        moe_layers * (collective(c, full, 1, 8, "all_gather") + collective(c, full, 1, 8, "reduce_scatter")))


def test_planned_kv_tokens_reads_the_engines_layout(monkeypatch):
    """The pool the planner predicts for a running engine is its layout's one rank's, with its weight format."""
    v3 = resolve_model("deepseek-v3")[0]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    cfg = SimpleNamespace(gpu_memory_utilization=0.9, max_batched_tokens=8192, max_num_seqs=256,
                          kv_cache_dtype="auto")
    c = make_cluster("H200", 8)
    rows = {r.layout: r for r in plan_inference(v3, c, 4096, None, "fp8", 0.9, 8192, 256)}
    for lay in (Layout(8), Layout(1, 8), Layout(8, 8), Layout(1, 8, True)):
        model = SimpleNamespace(tp=lay.tp, ep=lay.ep, dp_attention=lay.dp_attention, dtype=torch.bfloat16,
                                weights="FP8 e4m3: 1 projections kept")
        engine = SimpleNamespace(device="cuda:0", tp=lay.ranks, runner=SimpleNamespace(model=model), cfg=cfg,
                                 args=v3, max_model_len=4096, report=SimpleNamespace(total_gib=c.memory_gib))
        assert planned_kv_tokens(engine) == rows[lay].max_context, lay.name


def test_plan_cli_names_each_layout_and_its_serve_command():
    base = ("--model", "deepseek-v3", "--mode", "infer", "--gpus", "8", "--gpu-type", "H200", "--weight-dtype", "fp8",
            "--num-requests", "0", "--kv-cache-dtype", "fp8")
    rc, text = run_plan_cli(*base, "--json")
    assert rc == 0
    plans = {p["layout"]: p for p in json.loads(text)["plans"]}
    flags = (" --quantization fp8 --kv-cache-dtype fp8 --max-model-len 4096 --max-num-seqs 1024"
             " --max-batched-tokens 16384")
    assert plans["tp8"]["command"] == "paraseek serve deepseek-v3 --tp 8" + flags
    assert plans["tp1 ep8"]["command"] == "paraseek serve deepseek-v3 --ep 8" + flags
    assert plans["tp8 ep8"]["command"] == "paraseek serve deepseek-v3 --tp 8 --ep 8" + flags
    assert plans["tp1 ep8 dp-attn"]["command"] == "paraseek serve deepseek-v3 --ep 8 --dp-attention" + flags
    dpa = plans["tp1 ep8 dp-attn"]
    assert (dpa["tp"], dpa["ep"], dpa["dp_attention"], dpa["gpus_per_model_copy"]) == (1, 8, True, 8)
    assert dpa["kv_cache_tokens_per_model_copy"] == 8 * dpa["max_context_at_batch_1"]
    rc, text = run_plan_cli(*base)
    assert rc == 0
    for name, p in plans.items():
        assert f"\n {name} " in text and f"serve: {p['command']}" in " ".join(text.split()), name
    assert "run it (" in text
    # Smaller layouts that do not fit are named with their reason; two model copies a node get --dp 2.
    assert "tp1 ep4 dp-attn: weights" in " ".join(text.split())
    rc, text = run_plan_cli("--model", "deepseek-v2-lite", "--mode", "infer", "--gpus", "8", "--gpu-type", "H100",
                            "--num-requests", "0", "--json")
    plans = {p["layout"]: p for p in json.loads(text)["plans"]}
    assert plans["tp4 ep4"]["command"].startswith("paraseek serve deepseek-v2-lite --tp 4 --ep 4 --dp 2 ")
