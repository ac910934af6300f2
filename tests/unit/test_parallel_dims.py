"""The plan's one rule set (parallel/dims.py: ParallelDims.problem): what the CLI refuses before a launch is what the
planner never ranks; and the translations between TrainConfig and the planner's Plan."""

import pytest

from paraseek.errors import UserError
from paraseek.models import resolve_model
from paraseek.models.args import ModelArgs, preset_config
from paraseek.parallel.dims import ParallelDims
from paraseek.planner import Plan, make_cluster, search
from paraseek.train.config import TrainConfig


def check_pipeline(args, pp, v, schedule, micro_batches, **options):
    ParallelDims(pp=pp, pp_virtual_stages=v, pp_schedule=schedule).check(args, 64, micro_batches, **options)


@pytest.mark.parametrize("pp,v,schedule,mb,words", [
    (2, 1, "Nope", 4, "expected one of"),
    (2, 2, "GPipe", 4, "one stage per rank"),
    (2, 1, "Interleaved1F1B", 4, "needs --pp-virtual-stages 2"),
    (2, 3, "ZBVZeroBubble", 6, "exactly 2 stages"),
    (4, 1, "1F1B", 4, "4 stages, but the model has 3 layers"),
    (2, 1, "1F1B", 1, "at least 2 micro-batches"),
    (2, 2, "Interleaved1F1B", 3, "multiple of --pp 2"),
])
def test_impossible_pipelines_are_refused(pp, v, schedule, mb, words):
    args = ModelArgs.from_hf_config({**preset_config("tiny-moe"), "num_hidden_layers": 3 if pp == 4 else 4})
    with pytest.raises(UserError, match=words):
        check_pipeline(args, pp, v, schedule, mb)


def test_fp16_and_compiled_zero_bubble_are_refused():
    args = ModelArgs.from_hf_config({**preset_config("tiny-moe"), "num_hidden_layers": 4})
    with pytest.raises(UserError, match="fp16"):
        check_pipeline(args, 2, 1, "1F1B", 4, precision="fp16")
    with pytest.raises(UserError, match="torch.compile"):
        check_pipeline(args, 2, 2, "ZBVZeroBubble", 4, compile=True)
    check_pipeline(args, 2, 2, "Interleaved1F1B", 4, compile=True)  # fine


def test_tied_embeddings_are_refused():
    args = ModelArgs.from_hf_config({**preset_config("tiny-dense"), "tie_word_embeddings": True})
    with pytest.raises(UserError, match="tied"):
        check_pipeline(args, 2, 1, "1F1B", 4)


def check_tensor_parallel(args, tp):
    ParallelDims(tp=tp).check(args, 64)


def test_tp_must_divide_the_heads():
    dense = ModelArgs.from_hf_config(preset_config("tiny-dense"))  # 4 heads, 2 kv heads
    check_tensor_parallel(dense, 2)
    with pytest.raises(UserError, match=r"--tp 4 does not divide .*key/value heads.* = 2; --tp 2 would"):
        check_tensor_parallel(dense, 4)
    with pytest.raises(UserError, match=r"--tp 3 does not divide .*attention heads"):
        check_tensor_parallel(dense, 3)
    moe = ModelArgs.from_hf_config(preset_config("tiny-moe"))  # MLA: 4 heads, no kv-head constraint
    check_tensor_parallel(moe, 4)
    with pytest.raises(UserError, match="attention heads"):
        check_tensor_parallel(moe, 8)


def test_sequence_parallel_needs_the_sequence_divisible():
    args = ModelArgs.from_hf_config(preset_config("tiny-dense"))
    with pytest.raises(UserError, match="--seq-len 31 is not divisible by --tp 2"):
        ParallelDims(tp=2).check(args, 31)
    ParallelDims(tp=2, sequence_parallel=False).check(args, 31)  # without SP every tp rank holds the whole sequence


@pytest.mark.parametrize("engine_only", [True, False])
def test_the_planner_never_ranks_a_tp_the_engine_refuses(engine_only):
    """V2-Lite with an odd vocabulary: its 16 heads divide by 2, 4 and 8, but the vocab-parallel embedding and head
    do not, so the engine refuses every tp > 1 -- and the planner, which once checked only the heads, ranks none."""
    args = resolve_model("deepseek-v2-lite")[0].replace(vocab_size=102401)
    res = search(args, make_cluster("H200", 8), 4096, 64, engine_only=engine_only)
    assert res.plans and all(e.plan.tp == 1 for e in res.plans)
    assert any("vocab_size = 102401" in r.reason for r in res.rejected if r.mesh.get("tp", 1) > 1)
    for e in res.plans:  # and every ranked plan passes the check `paraseek train` makes before it launches
        assert e.plan.problem(args, 4096, e.plan.n_microbatches(64), engine=engine_only) == ""


def test_every_ranked_plan_is_one_the_engine_runs():
    args = resolve_model("deepseek-v2-lite")[0]
    res = search(args, make_cluster("H200", 16, gpus_per_node=8), 4096, 64, engine_only=True)
    assert any(e.plan.tp > 1 for e in res.plans) and any(e.plan.pp > 1 for e in res.plans)
    for e in res.plans:
        p = e.plan
        assert p.problem(args, 4096, p.n_microbatches(64), cpu_offload=p.cpu_offload) == "", p


def test_config_and_plan_translate_both_ways():
    cfg = TrainConfig(nproc=8, dp_replicate=2, dp_shard=2, tp=2, pp=1, pp_schedule="1F1B", micro_batch_size=2,
                      activation_checkpointing="full")
    plan = cfg.to_plan()
    assert plan.dims == cfg.dims and (plan.tp, plan.pp_schedule, plan.micro_batch_size) == (2, "none", 2)
    piped = plan.replace(pp=2, pp_schedule="Interleaved1F1B", pp_virtual_stages=2, tp=1, cpu_offload=True)
    back = cfg.with_plan(piped)
    got = (back.pp, back.pp_schedule, back.pp_virtual_stages, back.tp, back.cpu_offload)
    assert got == (2, "Interleaved1F1B", 2, 1, True)
    assert back.to_plan() == piped
    assert cfg.with_plan(plan) == cfg  # pp = 1: the config's own schedule flag stays


@pytest.mark.parametrize("changes,tp,words", [
    ({"intermediate_size": 178}, 4, "intermediate_size = 178"),  # tiny-moe's first layer is dense: F / tp columns
    ({"moe_intermediate_size": 30}, 4, "shared-expert width"),  # shared experts are column-parallel like the MLP
    ({"vocab_size": 2050}, 4, "vocab_size = 2050"),  # vocab-parallel embedding and head
])
def test_tp_must_divide_every_sharded_width(changes, tp, words):
    """parallel/tensor.py shards heads, the dense FFN width, the shared experts and the vocabulary: tp must divide
    each; the routed experts are replicated over tp (so their width is free)."""
    args = ModelArgs.from_hf_config({**preset_config("tiny-moe"), **changes})
    with pytest.raises(UserError, match=words):
        check_tensor_parallel(args, tp)
    check_tensor_parallel(args, 2)  # 2 divides all of them


def test_expert_parallel_rules():
    args = ModelArgs.from_hf_config(preset_config("tiny-moe"))  # 8 routed experts
    with pytest.raises(UserError, match="routed experts; ep must divide them"):
        ParallelDims(dp_shard=6, ep=3).check(args, 64)
    with pytest.raises(UserError, match="must divide --dp-shard"):
        ParallelDims(dp_shard=2, ep=4).check(args, 64)
    dense = ModelArgs.from_hf_config(preset_config("tiny-dense"))
    with pytest.raises(UserError, match="0 routed experts"):
        ParallelDims(dp_shard=2, ep=2).check(dense, 64)
    ParallelDims(dp_shard=4, ep=4).check(args, 64)


def test_plan_carries_compile_and_precision_to_train_and_back():
    cfg = TrainConfig(nproc=2, dp_shard=2, micro_batch_size=2, activation_checkpointing="selective", compile=True,
                      precision="fp16")
    plan = cfg.to_plan()
    assert (plan.compile, plan.precision) == (True, "fp16")
    assert "--compile" in plan.flags() and "--precision fp16" in plan.flags()
    assert cfg.with_plan(plan) == cfg
    bf16 = TrainConfig(nproc=2, dp_shard=2)  # precision "" (bf16 on GPUs): a bf16 plan leaves it as it is
    assert bf16.with_plan(bf16.to_plan()).precision == ""
