"""--fp8's rules before launch, and the filter that says which linears become float8 (parallel/fp8.py)."""

import pytest
import torch

from paraseek.cli import main
from paraseek.models import resolve_model
from paraseek.models.deepseek import Transformer
from paraseek.parallel.fp8 import fp8_filter, fp8_problem


def test_the_filter_takes_block_projections_with_dims_of_16():
    args, _, _ = resolve_model("tiny-moe")
    with torch.device("meta"):
        model = Transformer(args)
    picked = {n.split(".", 2)[2] for n, m in model.named_modules() if fp8_filter(m, n) and n.startswith("layers.1.")}
    # layer 1 of tiny-moe: MLA without kv_a (40 rows: not a multiple of 16), the router and the grouped experts
    # stay out, the shared experts' projections go in; the head and embedding are never block projections
    assert picked == {"self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj", "self_attn.o_proj",
                      "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"}
    assert not fp8_filter(model.lm_head, "lm_head") and not fp8_filter(model.embed_tokens, "embed_tokens")


def test_where_fp8_cannot_run(monkeypatch):
    from paraseek.planner.dims import ParallelDims

    monkeypatch.delenv("PARASEEK_FP8_EMULATE", raising=False)
    one = ParallelDims()
    assert fp8_problem("off", "cpu", None, one, lora=False) is None
    assert "needs a GPU with float8 tensor cores" in fp8_problem("rowwise", "cpu", None, one, lora=False)
    assert "this GPU has 8.0" in fp8_problem("tensorwise", "cuda", (8, 0), one, lora=False)
    assert fp8_problem("tensorwise", "cuda", (9, 0), one, lora=False) is None
    assert fp8_problem("tensorwise", "cuda", (9, 0), ParallelDims(dp_replicate=2, dp_shard=2), lora=False) is None
    assert "--fp8 with --tp is not supported yet" in fp8_problem("tensorwise", "cuda", (9, 0),
                                                                 ParallelDims(tp=2), lora=False)
    assert fp8_problem("rowwise", "cuda", (9, 0), ParallelDims(pp=2, pp_schedule="1F1B"), lora=False) is None
    assert "--lora-rank" in fp8_problem("rowwise", "cuda", (9, 0), one, lora=True)
    assert "not with DDP" in fp8_problem("tensorwise", "cuda", (9, 0), ParallelDims(dp_replicate=2), lora=False)


def test_train_refuses_fp8_on_cpu_in_one_line(capsys, monkeypatch):
    monkeypatch.delenv("PARASEEK_FP8_EMULATE", raising=False)
    assert main(["train", "--model", "tiny-dense", "--device", "cpu", "--nproc", "1", "--steps", "1",
                 "--fp8", "tensorwise"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--fp8 needs a GPU" in err and len(err.splitlines()) == 1, err
    assert main(["train", "--model", "tiny-dense", "--device", "cpu", "--fp8", "fp4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "fp4" in err and "tensorwise" in err and len(err.splitlines()) == 1, err


# ---- the planner's fp8 terms (planner/cost.py) --------------------------------------------------------------------
def _times(model: str, gpus: int, **plan):
    from paraseek.planner import Plan, make_cluster
    from paraseek.planner.cost import step_time
    from paraseek.planner.memory import model_terms

    args, _, _ = resolve_model(model)
    return {f: step_time(model_terms(args, 4096), make_cluster("H200", gpus), Plan(fp8=f, **plan), 16).items
            for f in ("off", "tensorwise", "rowwise", "rowwise-gw-hp")}


def test_fp8_prices_the_block_projections_and_the_float8_all_gather():
    from paraseek.planner.cost import FP8_LINEAR_SPEEDUP
    from paraseek.planner.memory import model_terms, rank_shares

    args, _, _ = resolve_model("deepseek-llm-7b")
    s = rank_shares(model_terms(args, 4096), 1, 1, 1, 1, "none")[0]
    head = 6 * args.vocab_size * args.dim
    t = _times("deepseek-llm-7b", 2, dp_shard=2, micro_batch_size=2)
    for recipe in ("tensorwise", "rowwise", "rowwise-gw-hp"):
        # only the projections speed up; the output head stays in bf16
        want = ((s.linear_flops - head) / FP8_LINEAR_SPEEDUP[recipe] + head) / s.linear_flops
        assert t[recipe]["compute_linear"] / t["off"]["compute_linear"] == pytest.approx(want, rel=1e-9)
        assert t[recipe]["compute_attention"] == t["off"]["compute_attention"]
    # tensorwise all-gathers the projections in float8 (half the bytes); the rowwise recipes gather bf16
    assert t["tensorwise"]["fsdp_comm"] < t["off"]["fsdp_comm"]
    assert t["rowwise"]["fsdp_comm"] == t["off"]["fsdp_comm"]
    assert FP8_LINEAR_SPEEDUP["tensorwise"] > FP8_LINEAR_SPEEDUP["rowwise"] > FP8_LINEAR_SPEEDUP["rowwise-gw-hp"] > 1


def test_the_float8_all_gather_and_its_eager_casts_only_where_there_is_a_gather():
    from paraseek.planner import make_cluster
    from paraseek.planner.cost import FP8_GATHER_CAST_BYTES
    from paraseek.planner.memory import model_terms, rank_shares

    args, _, _ = resolve_model("deepseek-llm-7b")
    one = _times("deepseek-llm-7b", 1, dp_shard=1, micro_batch_size=2)
    two = _times("deepseek-llm-7b", 2, dp_shard=2, micro_batch_size=2)
    # one shard: the weights are cast inside the compiled linears (the factor holds that), FSDP2 copies bf16
    assert one["tensorwise"]["fp8_gather_casts"] == 0 and one["tensorwise"]["fsdp_copies"] == one["off"]["fsdp_copies"]
    assert all(t["fp8_gather_casts"] == 0 for f, t in two.items() if f != "tensorwise")
    # two shards: each rank casts its half of the projections, 16 B a parameter, in each of the 2 gathers of each of
    # the 4 micro-batches of each rank (16 sequences over 2 ranks at 2 each), at the H200's memory rate
    s = rank_shares(model_terms(args, 4096), 1, 1, 1, 1, "none")[0]
    want = 4 * 2 * FP8_GATHER_CAST_BYTES * (s.dense - s.root) / 2 / (make_cluster("H200", 2).hbm_gbps * 1e9)
    assert two["tensorwise"]["fp8_gather_casts"] == pytest.approx(want, rel=1e-9)


def test_the_search_keeps_fp8_and_refuses_it_without_float8_cores():
    from paraseek.errors import UserError
    from paraseek.planner import make_cluster, search
    from paraseek.train.config import TrainConfig

    args, _, _ = resolve_model("deepseek-llm-7b")
    res = search(args, make_cluster("H200", 2), 4096, 16, engine_only=True, fp8="rowwise")
    assert res.plans and all(e.plan.fp8 == "rowwise" for e in res.plans)
    assert "--fp8 rowwise" in res.plans[0].plan.flags()
    assert TrainConfig(model="deepseek-llm-7b", fp8="tensorwise").to_plan().fp8 == "tensorwise"
    with pytest.raises(UserError, match="A100-80GB has no float8 tensor cores"):
        search(args, make_cluster("A100-80GB", 8), 4096, 64, fp8="tensorwise")
