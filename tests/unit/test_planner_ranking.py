"""The planner's ranking: compiled plans, the memory headroom, `plan --scaling` (only what `paraseek train`
accepts, weak scaling, flat FSDP vs HSDP across nodes, 100 columns), GPUs without bf16, inference batches that do not
fit. Fast (CPU, seconds); no number asserted here is an output of the code under test taken as truth: the checks are
directions, bounds, rankings and the engine's own validation."""

import json
import shlex

import pytest

from paraseek.models import build_model, resolve_model
from paraseek.planner import Plan, best_plan, evaluate, make_cluster, search
from paraseek.planner.memory import compiled_layer_activation_bytes, layer_activation_bytes
from paraseek.planner.plan import AC_MODES
from paraseek.planner.search import MEMORY_HEADROOM, explain, scaling
from plan_cli import run_plan_cli


def model(name: str, **changes):
    return resolve_model(name)[0].replace(**changes)


def train_accepts(command: str) -> None:
    """`paraseek train`'s own checks on a printed command, in-process and without a launch: its parser, the config
    translation and validate() (the rule set of parallel/dims.py, the world size, the batch, the pipeline's
    micro-batches), on a machine with the GPUs the command asks for."""
    from paraseek.cli import build_parser
    from paraseek.train.config import resolve_defaults
    from paraseek.train.flags import from_namespace
    from paraseek.train.validate import validate

    argv = shlex.split(command.replace("RANK", "0"))
    assert argv[:2] == ["paraseek", "train"], command
    ns = build_parser().parse_args(argv[1:])
    cfg = resolve_defaults(from_namespace(ns), cuda_available=True, gpu_count=ns.nproc)
    # nodes=False: a multi-node command names node 0 as NODE0_HOST, the user's to fill in (the node flags have
    # their own tests in test_train_inputs.py)
    validate(cfg, cuda_available=True, gpu_count=ns.nproc, nodes=False)


# ---- torch.compile -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["deepseek-llm-7b", "deepseek-v2-lite", "deepseek-v3"])
@pytest.mark.parametrize("ac", ["none", "selective"])
def test_compiled_blocks_keep_no_more_than_eager_ones(name, ac):
    """The partitioner keeps at most what eager autograd keeps (it may recompute, never save more): the search's
    rule that an eager twin never ranks above a compiled plan rests on it."""
    a = model(name)
    for i in range(a.n_layers):
        eager, compiled = layer_activation_bytes(a, i, ac), compiled_layer_activation_bytes(a, i, ac)
        assert compiled[0] <= eager[0] and compiled[1] <= eager[1], (i, eager, compiled)


# What compiled blocks saved, measured with saved_tensors_hooks by scripts/planner/compiled_activations.py (torch
# 2.13, CPU, inductor): bytes per token per layer. The MoE layer is left out: the CPU runs the per-expert loop.
COMPILED_SAVED = [("tiny-dense", {"head_dim": 24}, "none", 0, 2168), ("tiny-dense", {}, "none", 0, 1976),
                  ("tiny-dense", {"head_dim": 24}, "selective", 0, 1552),
                  ("tiny-moe", {"v_head_dim": 24}, "none", 0, 2768),
                  ("tiny-moe", {"v_head_dim": 24}, "selective", 0, 1824)]


@pytest.mark.parametrize("name,changes,ac,layer,measured", COMPILED_SAVED)
def test_compiled_activation_formula_matches_the_measured_blocks(name, changes, ac, layer, measured):
    assert sum(compiled_layer_activation_bytes(model(name, **changes), layer, ac)) == measured


@pytest.mark.parametrize("name,gpus,plan,gbs", [
    ("deepseek-llm-7b", 2, Plan(dp_shard=2, micro_batch_size=2, activation_checkpointing="selective"), 8),
    ("deepseek-llm-7b", 1, Plan(micro_batch_size=2), 2),
    ("deepseek-llm-7b", 2, Plan(tp=2, micro_batch_size=2, activation_checkpointing="full"), 8),
    ("deepseek-llm-7b", 2, Plan(pp=2, pp_schedule="1F1B", micro_batch_size=1, activation_checkpointing="selective"),
     8),
    ("deepseek-v2-lite", 2, Plan(dp_shard=2, ep=2, micro_batch_size=2, activation_checkpointing="full"), 8),
])
def test_compiled_is_never_slower_nor_larger_than_eager(name, gpus, plan, gbs):
    a, c = model(name), make_cluster("H200", gpus)
    eager = evaluate(a, c, plan, 4096, gbs)
    compiled = evaluate(a, c, plan.replace(compile=True), 4096, gbs)
    assert not eager.reason and not compiled.reason
    assert compiled.memory.total <= eager.memory.total
    assert compiled.time.total < eager.time.total


def test_a_compiled_plan_with_headroom_wins_the_7b_on_one_h200():
    """The 7B on one H200 at global batch 2: mbs 2 without checkpointing, eager (predicted 134 GiB; measured 130 GiB
    of 140 and 7,415 tokens/s, the allocator thrashing) must lose to mbs 2 selective --compile (measured 12,455
    tokens/s at 106 GiB; docs/planner.md, "Memory headroom")."""
    a, c = model("deepseek-llm-7b"), make_cluster("H200", 1)
    best = best_plan(a, c, 4096, 2)
    assert best.plan.compile and not best.tight
    eager_twin = evaluate(a, c, best.plan.replace(compile=False), 4096, 2)
    assert best.tokens_per_s_per_gpu > eager_twin.tokens_per_s_per_gpu
    # The thrashing plan fits, is predicted faster than every eager plan with room, and still loses to them: it is
    # above the headroom.
    thrashing = evaluate(a, c, Plan(micro_batch_size=2, activation_checkpointing="none"), 4096, 2)
    assert not thrashing.reason and thrashing.tight
    assert thrashing.memory.total > MEMORY_HEADROOM * c.memory_gib * 2**30
    eager_first = best_plan(a, c, 4096, 2, compile=False)
    assert not eager_first.tight and eager_first.plan != thrashing.plan
    assert thrashing.tokens_per_s_per_gpu > eager_first.tokens_per_s_per_gpu
    why = explain(a, c, best, 4096, 2)
    assert why.startswith("compile: +") and "memory" in why and "\n" not in why


def test_a_tight_plan_ranks_only_when_nothing_has_room():
    a, c = model("deepseek-llm-7b"), make_cluster("H200", 1)
    res = search(a, c, 4096, 2, engine_only=True)
    assert res.plans and not res.plans[0].tight
    keys = [(not e.tight, e.tokens_per_s_per_gpu) for e in res.plans]
    assert keys == sorted(keys, reverse=True)


# ---- GPUs without bf16 ---------------------------------------------------------------------------------------------
def test_a_v100_plan_trains_in_fp16_and_train_accepts_it():
    a, c = model("deepseek-r1-distill-qwen-1.5b"), make_cluster("V100", 8)
    assert c.gpu.name == "V100-32GB" and any("V100-32GB" in n for n in c.notes)  # the alias is said, not silent
    res = search(a, c, 2048, 64, "deepseek-r1-distill-qwen-1.5b", engine_only=True)
    assert res.plans and all(e.plan.precision == "fp16" and e.plan.pp == 1 for e in res.plans)  # no fp16 under pp
    assert any("--pp with --precision fp16" in r.reason for r in res.rejected)
    rc, out = run_plan_cli("--model", "deepseek-r1-distill-qwen-1.5b", "--gpus", "8", "--gpu-type", "V100",
                           "--seq-len", "2048", "--global-batch-size", "64", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["hardware"]["precision"] == "fp16" and doc["hardware"]["notes"]
    for p in doc["plans"]:
        assert "--precision fp16" in p["command"]
        train_accepts(p["command"])
    t4 = make_cluster("T4", 4)
    assert t4.precision == "fp16" and t4.peak_tflops == t4.gpu.fp16_tflops


def test_infer_fp16_weights_and_a_batch_that_does_not_fit_is_reported_not_capped():
    """A reported case: an inference service on 4x V100 that ran out of memory above a batch size. A batch that
    does not fit is a reason with the largest one that does, not a row priced at a smaller batch."""
    base = ["--model", "deepseek-r1-distill-qwen-1.5b", "--mode", "infer", "--gpus", "4", "--gpu-type",
            "V100-16GB", "--seq-len", "4096", "--json"]
    rc, out = run_plan_cli(*base)
    doc = json.loads(out)
    assert rc == 0 and doc["weight_dtype"] == "fp16" and doc["plans"]  # the default where there is no bf16
    fits = {p["tp"]: p["max_batch_at_seq_len"] for p in doc["plans"]}
    too_many = max(fits.values()) + 1
    rc, out = run_plan_cli(*base, "--global-batch-size", str(too_many))
    doc = json.loads(out)
    assert rc == 0 and doc["plans"] == []
    for r in doc["rejected"]:
        assert r["batch"] == too_many and r["max_batch_at_seq_len"] < too_many
        assert f"batch {too_many} per model copy does not fit" in r["reason"]
    one_fits = min(fits.values())
    rc, out = run_plan_cli(*base, "--global-batch-size", str(one_fits))
    assert all(p["batch"] == one_fits for p in json.loads(out)["plans"])
    with pytest.raises(Exception, match="has no bf16; use --weight-dtype fp16"):
        run_plan_cli(*base, "--weight-dtype", "bf16")


# ---- plan --scaling ------------------------------------------------------------------------------------------------
SCALING_CASES = [
    ("deepseek-llm-67b", "A100-80GB", "4,8,16,32", "64", []),
    ("deepseek-v2-lite", "H200", "8,16", "64", []),
    ("deepseek-llm-7b", "H100", "8,16,64", "128", ["--strong"]),
]


@pytest.mark.parametrize("name,gpu,counts,gbs,extra", SCALING_CASES)
def test_scaling_prints_only_plans_that_train_accepts(name, gpu, counts, gbs, extra):
    rc, out = run_plan_cli("--model", name, "--gpus", "8", "--gpu-type", gpu, "--gpus-per-node", "8",
                           "--global-batch-size", gbs, "--scaling", counts, "--json", *extra)
    doc = json.loads(out)
    assert rc == 0
    commands = [r["plan"]["command"] for r in doc["scaling"] if "plan" in r]
    commands += [r[k]["command"] for r in doc["scaling"] for k in ("flat", "hsdp") if k in r]
    assert commands
    for command in commands:
        train_accepts(command)
    for r in doc["scaling"]:  # above 100% only with a printed reason
        if r.get("scaling_efficiency", 0) > 1.0005:
            assert r["efficiency_note"].startswith("above 100%")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_plans_are_only_ones_train_accepts(recipe, monkeypatch):
    """--fp8 does not compose with DDP in the engine (yet): the ranking holds no DDP plan; it keeps tensor-parallel
    ones (the best 8-GPU plans for the 7B include tp=2 with and without fp8), and train validates every printed
    command (pipelined and tensor-parallel ones included)."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))  # an H200's; a CPU has none
    rc, out = run_plan_cli("--model", "deepseek-llm-7b", "--gpus", "8", "--gpu-type", "H200", "--global-batch-size",
                           "64", "--fp8", recipe, "--json")
    plans = json.loads(out)["plans"]
    assert rc == 0 and plans
    for p in plans:
        assert not (p["dp_replicate"] > 1 and p["dp_shard"] == 1 and p["pp"] == 1)  # DDP (ParallelDims.ddp)
        assert f"--fp8 {recipe}" in p["command"]
        train_accepts(p["command"])
    assert any(p["tp"] > 1 for p in plans)


def test_fp8_expert_plans_are_priced_ranked_and_accepted_by_train(monkeypatch):
    """`plan --fp8 tensorwise --fp8-experts on` on a MoE model: every plan carries the flag and is faster than the
    same plan with the experts in bf16 at these rows per expert; train accepts each printed command. Refused in one
    line without --fp8, on a GPU type that is not Hopper, and on a model without routed experts."""
    import torch

    from paraseek.errors import UserError

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))  # an H200's; a CPU has none
    common = ("--model", "deepseek-v2-lite", "--gpus", "4", "--gpu-type", "H200", "--global-batch-size", "32",
              "--fp8", "tensorwise", "--json")
    rc, out = run_plan_cli(*common, "--fp8-experts", "on")
    plans = json.loads(out)["plans"]
    assert rc == 0 and plans
    for p in plans:
        assert "--fp8-experts on" in p["command"]
        train_accepts(p["command"])
    args, c = model("deepseek-v2-lite"), make_cluster("H200", 4)
    ranked = search(args, c, 4096, 32, engine_only=True, fp8="tensorwise", fp8_experts=True).plans
    for p, e in zip(plans, ranked):
        assert all(flag in p["command"] for flag in e.plan.flags())
    for e in ranked:
        # rows per expert = 4096 x mbs x ep x 6 / 64 (/ tp); from 1,536 (mbs x ep = 4) on, past the fitted
        # break-even near 1,470, the float8 grouped GEMM is faster than bf16's; at 768 (mbs 2, no ep) slower
        bf16 = evaluate(args, c, e.plan.replace(fp8_experts=False), 4096, 32)
        assert (e.tokens_per_s_per_gpu > bf16.tokens_per_s_per_gpu) == (e.plan.micro_batch_size * e.plan.ep >= 4)
    with pytest.raises(UserError, match="--fp8-experts needs a Hopper GPU"):
        search(args, make_cluster("L40S", 4), 4096, 16, fp8="tensorwise", fp8_experts=True)
    with pytest.raises(UserError, match="give --fp8 tensorwise"):
        search(args, make_cluster("H200", 4), 4096, 16, fp8_experts=True)
    with pytest.raises(UserError, match="has no routed experts"):
        search(model("deepseek-llm-7b"), make_cluster("H200", 4), 4096, 16, fp8="tensorwise", fp8_experts=True)


def test_the_67b_case_falls_with_flat_sharding_across_nodes_and_recovers_with_hsdp():
    """A reported case (DeepSeek-LLM-67B on 4, 8, 16 A100-80GB, 8 per node: efficiency 82% -> 53% at 16 GPUs, 78%
    with hierarchical all-reduce). On a network with a small NIC share per GPU (1.5 GB/s: one 100 Gb/s NIC for 8
    GPUs), sharding flat over two nodes falls below one node's efficiency and HSDP (shard inside the node, replicate
    across) recovers; with one 200 Gb/s NIC per GPU the flat ring's NICs carry it and the fall is gone."""
    a = model("deepseek-llm-67b")
    slow = scaling(a, make_cluster("A100-80GB", 16, 8, inter_node_gbps=1.5), [4, 8, 16], 4096, 64)
    one_node, two = slow[1], slow[2]
    assert one_node.best is not None and two.flat is not None and two.hsdp is not None
    assert two.flat_efficiency < one_node.efficiency  # the fall
    assert two.hsdp_efficiency > two.flat_efficiency  # the recovery
    fast = scaling(a, make_cluster("A100-80GB", 16, 8), [4, 8, 16], 4096, 64)
    assert fast[2].flat_efficiency > two.flat_efficiency  # the flat ring's cost is the NICs'
    # HSDP moves only the once-per-step gradient all-reduce across nodes: the network moves it less than flat FSDP
    assert (fast[2].flat_efficiency - two.flat_efficiency) > (fast[2].hsdp_efficiency - two.hsdp_efficiency)


def test_weak_scaling_keeps_the_per_gpu_batch():
    rows = scaling(model("deepseek-llm-7b"), make_cluster("H100", 8), [8, 16, 32], 4096, 64)
    assert [r.global_batch_size for r in rows] == [64, 128, 256]
    assert rows[0].efficiency == 1.0
    for r in rows:
        assert r.efficiency <= 1.0005 or r.note.startswith("above 100%")


@pytest.mark.parametrize("argv,columns", [
    (["--model", "deepseek-llm-67b", "--gpus", "16", "--gpu-type", "A100-80GB", "--global-batch-size", "64",
      "--scaling", "4,8,16,32"], ("GPUs", "plan", "tok/s/GPU", "MFU", "GiB/GPU", "eff")),
    (["--model", "deepseek-v2-lite", "--gpus", "16", "--gpu-type", "H200", "--global-batch-size", "64"],
     ("#", "dp", "tp", "pp", "ep", "mbs", "AC", "comp", "offl", "GiB", "step s", "tok/s/GPU", "MFU")),
])
def test_the_tables_keep_every_column_at_100_columns(argv, columns):
    rc, out = run_plan_cli(*argv)
    assert rc == 0
    header = next(line for line in out.splitlines() if line.split()[:2] == list(columns[:2]))
    assert header.split() == [w for col in columns for w in col.split()]
    lines = out[out.index(header):].splitlines()
    table = "\n".join(lines[:next(i for i, line in enumerate(lines) if not line.strip())])
    assert "…" not in table and max(len(line) for line in table.splitlines()) <= 100
