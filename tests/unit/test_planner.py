"""The planner: closed forms for model states, activation bytes against what autograd really saves, known facts
about real models and clusters, the JSON contract and bad input. Fast (CPU, a few seconds)."""

import json
import weakref

import pytest
import torch

from paraseek.errors import UserError
from paraseek.models import build_model, param_counts, resolve_model
from paraseek.planner import Plan, best_plan, evaluate, make_cluster, model_state_bytes, search
from paraseek.planner.infer import kv_bytes_per_token, plan_inference
from paraseek.planner.memory import GiB, in_flight, layer_activation_bytes, model_terms, partition, rank_shares
from paraseek.planner.plan import load_profile
from paraseek.planner.search import scaling
from plan_cli import run_plan_cli


def model(name: str, **changes):
    return resolve_model(name)[0].replace(**changes)


def split_of_module(args):
    """Parameters of the real module, split the way TP/EP shard them (a reference built from named_parameters)."""
    m = build_model(args, "meta")
    whole = split = experts = 0
    for name, p in m.named_parameters():
        if name.startswith("mtp."):
            continue
        if ".experts." in name and "shared" not in name:
            experts += p.numel()
        elif "norm" in name or name.endswith("gate.weight") or "q_a_proj" in name or "kv_a_proj" in name:
            whole += p.numel()
        else:
            split += p.numel()
    return whole, split, experts


# ---- model states: closed forms for every sharding mode ----------------------------------------------------------
MODES = [
    Plan(dp_replicate=4),  # DDP
    Plan(dp_shard=8),  # FSDP (ZeRO-3)
    Plan(dp_shard=8, reshard_after_forward=False),  # ZeRO-2-like: same states
    Plan(dp_replicate=2, dp_shard=4),  # HSDP
    Plan(dp_shard=4, cpu_offload=True),  # FSDP + CPU offload
    Plan(dp_shard=4, tp=2),
    Plan(dp_shard=8, ep=4),
    Plan(dp_replicate=2, dp_shard=4, tp=2, ep=2),
]


def _plan_id(p: Plan) -> str:
    return (f"r{p.dp_replicate}s{p.dp_shard}t{p.tp}e{p.ep}" + ("-offload" if p.cpu_offload else "")
            + ("" if p.reshard_after_forward else "-z2"))


# EP plans only for the models that have routed experts.
CASES = [(name, plan) for name in ["tiny-dense", "tiny-moe", "deepseek-llm-7b", "deepseek-v2-lite", "deepseek-v3"]
         for plan in MODES if plan.ep == 1 or name not in ("tiny-dense", "deepseek-llm-7b")]


@pytest.mark.parametrize("name,plan", CASES, ids=[f"{n}-{_plan_id(p)}" for n, p in CASES])
def test_model_state_bytes_equal_closed_forms(name, plan):
    a = model(name)
    whole, split, experts = split_of_module(a)
    assert whole + split + experts == param_counts(a).total
    # fp32 params 4 B, fp32 grads 4 B, AdamW exp_avg + exp_avg_sq 8 B per parameter this rank owns. TP splits
    # `split` only: the engine replicates the routed experts on every tp rank (each routes its own tokens under SP);
    # FSDP splits everything over dp_shard; EP splits experts over ep ranks and FSDP them over dp_shard / ep, so
    # ep * (dp_shard / ep) = dp_shard either way. DDP: dp_shard = 1, all replicated.
    owned = (split / plan.tp + whole + experts) / plan.dp_shard
    got = model_state_bytes(a, plan)
    assert got["params"] == pytest.approx(4 * owned, rel=1e-12)
    assert got["grads"] == pytest.approx(4 * owned, rel=1e-12)
    assert got["optimizer"] == pytest.approx(8 * owned, rel=1e-12)
    assert got["total"] == pytest.approx(16 * owned, rel=1e-12)
    assert got["device"] == ("cpu" if plan.cpu_offload else "cuda")


def test_tp_replicates_routed_experts_and_all_reduces_their_grads():
    """The engine's TP layout for MoE (parallel/tensor.py): router and routed experts whole on every tp rank, so
    tp only shrinks the rest; their partial grads, with MLA's replicated down-projections', are summed over tp."""
    a, c = model("deepseek-v2-lite"), make_cluster("H200", 8)
    whole, split, experts = split_of_module(a)
    for tp in (1, 2, 4):
        got = model_state_bytes(a, Plan(dp_shard=8 // tp, tp=tp))["params"]
        assert got == pytest.approx(4 * (split / tp + whole + experts) / (8 // tp), rel=1e-12)
    # The all-reduce moves the fp32 (dp-shard of the) partial grads once per step: router + MLA latent + experts.
    m = build_model(a, "meta")
    partial = sum(p.numel() for n, p in m.named_parameters()
                  if ".experts." in n and "shared" not in n or n.endswith("gate.weight")
                  or any(k in n for k in ("q_a_proj", "q_a_layernorm", "kv_a_proj", "kv_a_layernorm")))
    plan = Plan(dp_shard=4, tp=2, micro_batch_size=1, activation_checkpointing="full")
    ev = evaluate(a, c, plan, 4096, 32)
    assert ev.time.items["tp_grad_allreduce"] > 0
    tp1 = evaluate(a, c, Plan(dp_shard=8, micro_batch_size=1, activation_checkpointing="full"), 4096, 32)
    assert tp1.time.items["tp_grad_allreduce"] == 0
    # fp32 grads, dp shard of 4: a ring all-reduce over the 2 tp ranks (busbw factor 2(n-1)/n = 1) + 10 us per call,
    # plus the flat buffer's copy in and out (4 bytes of HBM traffic per byte).
    nbytes = 4 * partial / 4
    expected = nbytes / c.busbw(1, 2)[0] + 10e-6 + 4 * nbytes / (c.hbm_gbps * 1e9)
    assert ev.time.items["tp_grad_allreduce"] == pytest.approx(expected, rel=1e-9)
    # A dense GQA model has no tp-replicated params that get partial grads: no such all-reduce.
    d = model("deepseek-llm-7b")
    dense = evaluate(d, c, Plan(dp_shard=4, tp=2, activation_checkpointing="full"), 4096, 32)
    assert dense.time.items["tp_grad_allreduce"] == 0


def test_tp_divides_expert_work_and_routing_activations_per_rank():
    """Under SP each tp rank routes T / tp tokens: expert FLOPs and routing/dispatch activations per rank are 1/tp
    of one rank's at tp = 1 (the whole experts run on a quarter of the tokens at tp = 4)."""
    a = model("deepseek-v2-lite")
    t = model_terms(a, 4096)
    one, four = rank_shares(t, 1, 1, 1, 1, "none")[0], rank_shares(t, 4, 1, 1, 1, "none")[0]
    assert four.expert_flops == pytest.approx(one.expert_flops / 4)
    assert four.experts == one.experts  # replicated
    assert four.dispatch_max == pytest.approx(one.dispatch_max / 4)
    moe_layer = next(i for i in range(a.n_layers) if a.is_moe_layer(i))
    whole, _ = layer_activation_bytes(a, moe_layer, "none")
    dense_layer_whole, _ = layer_activation_bytes(a.replace(n_routed_experts=0, first_k_dense_replace=a.n_layers),
                                                  moe_layer, "none")
    assert whole == dense_layer_whole  # routing keeps nothing whole on every tp rank: only the gathered inputs


def test_engine_only_allows_tp_for_moe_and_tp_x_ep():
    a, c = model("deepseek-v2-lite"), make_cluster("H200", 8)
    res = search(a, c, 4096, 64, engine_only=True)
    assert any(e.plan.tp > 1 for e in res.plans), [r.reason for r in res.rejected if r.mesh.get("tp", 1) > 1]
    assert any(e.plan.tp > 1 and e.plan.ep > 1 for e in res.plans)
    assert not any("tp x ep" in r.reason for r in res.rejected)
    # the engine runs tp with FSDP2 only, and without CPU offload
    assert all(not (e.plan.tp > 1 and (e.plan.dp_shard == 1 and e.plan.dp_replicate > 1 or e.plan.cpu_offload))
               for e in res.plans)


def test_pipeline_stages_hold_every_layer_once():
    a = model("deepseek-v3")
    t = model_terms(a, 4096)
    for n in (2, 7, 16, 61):
        chunks = partition(t, n)
        assert len(chunks) == n and chunks[0][0] == 0 and chunks[-1][1] == a.n_layers
        assert all(lo < hi for lo, hi in chunks) and all(chunks[i][1] == chunks[i + 1][0] for i in range(n - 1))
    # Per-stage model states add up to the whole model (tp = 1, FSDP over 8).
    plan = Plan(dp_shard=8, pp=4, pp_schedule="1F1B")
    total = sum(model_state_bytes(a, plan, stage=r)["params"] for r in range(4))
    assert total == pytest.approx(4 * param_counts(a).total / 8, rel=1e-12)


def test_micro_batches_in_flight_per_schedule():
    assert in_flight(Plan(pp=4, pp_schedule="GPipe"), 0, 16) == 16
    assert [in_flight(Plan(pp=4, pp_schedule="1F1B"), r, 16) for r in range(4)] == [4, 3, 2, 1]
    # Interleaved, rank 0: Korthikanti et al. 2022 sec. 4.2.3: pp * (1 + (pp-1)/(pp*v)) micro-batches of L/pp layers
    interleaved = Plan(pp=4, pp_schedule="Interleaved1F1B", pp_virtual_stages=2)
    assert in_flight(interleaved, 0, 16) == pytest.approx(4 * (1 + 3 / 8))
    assert in_flight(Plan(pp=4, pp_schedule="ZBVZeroBubble", pp_virtual_stages=2), 0, 16) == 4


# ---- activations: the formula against what autograd saves in the real blocks -------------------------------------
def saved_bytes_per_token(args, checkpoint: bool) -> list[float]:
    """Bytes per token that each block keeps for backward, measured with saved_tensors_hooks: live saved tensors
    only (autograd frees what dead branches saved), parameters and the shared cos/sin excluded, and the slope
    between two token counts (so per-step constants like the router's fp32 weight copy drop out)."""
    torch.manual_seed(0)
    m = build_model(args, "cpu", torch.bfloat16)
    out = []
    for block in m.layers.values():
        sizes = []
        for T in (64, 128):
            x = torch.randn(2, T, args.dim, dtype=torch.bfloat16, requires_grad=True)
            cos, sin = (c.to(torch.bfloat16) for c in m.rope_cos_sin(T, x.device))
            skip = {p.untyped_storage().data_ptr() for p in block.parameters()}
            skip |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
            refs = []

            def pack(t, refs=refs):
                refs.append(weakref.ref(t))
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                if checkpoint:
                    y = torch.utils.checkpoint.checkpoint(block, x, cos, sin, use_reentrant=False)
                else:
                    y = block(x, cos, sin)
            live = {}
            for r in refs:
                t = r()
                if t is not None and t.untyped_storage().data_ptr() not in skip:
                    live[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            sizes.append(sum(live.values()))
            del y
        out.append((sizes[1] - sizes[0]) / (2 * 64))
    return out


@pytest.mark.parametrize("name,changes", [
    ("tiny-dense", {}),  # GQA attention + SwiGLU
    # MLA + MoE. v_head_dim = qk head dim so that CPU SDPA takes its flash kernel (as CUDA does); with unequal
    # dims the CPU falls back to the math kernel, which keeps the score matrix.
    ("tiny-moe", {"v_head_dim": 24}),
    ("tiny-moe", {"v_head_dim": 24, "q_lora_rank": 0}),  # V2-Lite's plain q_proj
    ("tiny-moe", {"v_head_dim": 24, "topk_method": "group_limited_greedy", "score_func": "softmax"}),  # V2 routing
])
@pytest.mark.parametrize("ac", ["none", "full"])
def test_activation_bytes_match_autograd(name, changes, ac):
    a = model(name, **changes)
    measured = saved_bytes_per_token(a, checkpoint=ac == "full")
    predicted = [sum(layer_activation_bytes(a, i, ac)) for i in range(a.n_layers)]  # tp = 1: whole + split
    assert predicted == measured


def test_checkpointing_orders_memory():
    a, c = model("deepseek-llm-7b"), make_cluster("H100", 8)
    mem = {ac: evaluate(a, c, Plan(dp_shard=8, micro_batch_size=2, activation_checkpointing=ac), 4096, 64,
                        with_time=False).memory.items["activations"] for ac in ("none", "selective", "full")}
    assert mem["full"] < mem["selective"] < mem["none"]
    # Korthikanti et al. 2022 sec. 4.2.2: sequence parallelism divides everything but the gathered inputs by tp.
    tp1 = evaluate(a, c, Plan(dp_shard=8, micro_batch_size=2), 4096, 64, with_time=False).memory.items["activations"]
    tp8 = evaluate(a, c, Plan(tp=8, micro_batch_size=2), 4096, 64, with_time=False).memory.items["activations"]
    assert tp1 / 8 < tp8 < tp1 / 4


# ---- known facts -------------------------------------------------------------------------------------------------
def test_deepseek_v3_full_training_does_not_fit_one_h200_node():
    res = search(model("deepseek-v3"), make_cluster("H200", 8), 4096, 64, "deepseek-v3")
    assert res.plans == []
    assert res.rejected and "GiB/GPU" in res.rejected[0].reason and "host memory" in res.rejected[0].reason
    assert "model states alone" in res.why_none
    with pytest.raises(UserError, match="no parallel plan fits 8 x H200"):
        best_plan(model("deepseek-v3"), make_cluster("H200", 8), 4096, 64)


def test_deepseek_v3_fits_2048_h800_and_the_search_is_complete():
    # Also the 2,048-GPU search that must stay fast (its timing is not asserted here).
    a, c = model("deepseek-v3"), make_cluster("H800", 2048, gpus_per_node=8)
    res = search(a, c, 4096, 15360, "deepseek-v3")
    assert res.plans, res.why_none
    best = res.plans[0]
    assert best.plan.world == 2048 and best.memory.total <= c.memory_gib * GiB
    assert 0 < best.mfu < 1
    # ranked: plans with memory headroom first, each group fastest first
    keys = [(not e.tight, e.tokens_per_s_per_gpu) for e in res.plans]
    assert keys == sorted(keys, reverse=True)


def test_deepseek_llm_7b_on_one_a100_needs_cpu_offload():
    a, c = model("deepseek-llm-7b"), make_cluster("A100-80GB", 1)
    best = best_plan(a, c, 4096, 64)
    assert best.plan.cpu_offload
    without = evaluate(a, c, best.plan.replace(cpu_offload=False, activation_checkpointing="full",
                                               micro_batch_size=1), 4096, 64)
    assert "GiB/GPU" in without.reason  # the 16 B/param states alone are ~103 GiB


def test_deepseek_llm_7b_on_8_h100_is_in_a_plausible_mfu_range():
    c = make_cluster("H100", 8)
    eager = best_plan(model("deepseek-llm-7b"), c, 4096, 256, compile=False)
    assert 0.35 <= eager.mfu <= 0.60
    # compiled: faster than eager, and never above the GEMM ceiling (0.80 of the datasheet peak on Hopper)
    compiled = best_plan(model("deepseek-llm-7b"), c, 4096, 256)
    assert compiled.plan.compile and eager.mfu < compiled.mfu < c.matmul_tflops / c.peak_tflops


# ---- inference ---------------------------------------------------------------------------------------------------
def test_mla_kv_cache_is_the_compressed_latent():
    v3 = model("deepseek-v3")
    assert kv_bytes_per_token(v3, 8) == 61 * 2 * (512 + 64)  # held whole on every tp rank
    d7 = model("deepseek-llm-7b")
    assert kv_bytes_per_token(d7, 1) == 30 * 2 * 2 * 32 * 128
    assert kv_bytes_per_token(d7, 8) == kv_bytes_per_token(d7, 1) / 8


def test_inference_v3_on_one_h200_node_fits_in_fp8_not_bf16():
    v3, c = model("deepseek-v3"), make_cluster("H200", 8)
    bf16 = {r.layout.name: r for r in plan_inference(v3, c, 4096, weight_dtype="bf16")}
    fp8 = {r.layout.name: r for r in plan_inference(v3, c, 4096, weight_dtype="fp8")}
    assert bf16["tp8"].max_batch == 0 and bf16["tp8"].reason
    assert fp8["tp8"].max_batch > 0 and fp8["tp8"].decode_tokens_per_s_per_gpu > 0
    assert fp8["tp8"].max_context >= 4096


# ---- scaling, profile ----------------------------------------------------------------------------------------------
def test_scaling_rows_and_efficiency():
    rows = scaling(model("deepseek-llm-7b"), make_cluster("H100", 8), [8, 16, 64, 512], 4096, 512, weak=False)
    assert [r.gpus for r in rows] == [8, 16, 64, 512]
    assert rows[0].efficiency == 1.0
    assert all(r.best is not None for r in rows)
    assert rows[-1].efficiency < 1.0  # strong scaling: a fixed batch over 64x the GPUs is not free


def test_scaling_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "scaling.png"
    rc, text = run_plan_cli("--model", "deepseek-llm-7b", "--gpus", "8", "--gpu-type", "H100",
                            "--global-batch-size", "256", "--scaling", "8,16,32", "--plot", str(out))
    assert rc == 0 and "predicted" in text and f"plot: {out}" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_overrides_datasheet_rates(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"gpu_name": "NVIDIA H200", "memory_gib": 139.8, "gpus_per_node": 8, "nodes": 2,
                                "matmul_tflops": 700.0, "intra_node_busbw_gbps": 300.0,
                                "inter_node_busbw_gbps": 20.0}))
    c = load_profile(path)
    assert (c.gpu.name, c.n_gpus, c.gpus_per_node, c.memory_gib) == ("H200", 16, 8, 139.8)
    assert (c.matmul_tflops, c.intra_busbw_gbps) == (700.0, 300.0)
    # The doctor's inter-node number is an all-reduce over all 16 GPUs: a flat ring over 8 GPUs per node, priced back
    # at what was measured, while a group with one GPU per node (HSDP's replicas) gets one GPU's share of the NICs.
    assert c.busbw(stride=1, size=16)[0] == pytest.approx(20.0e9)
    assert c.busbw(stride=8, size=2)[0] == pytest.approx(20.0e9 / 8)
    slower = evaluate(model("deepseek-llm-7b"), c, Plan(dp_shard=16), 4096, 64)
    faster = evaluate(model("deepseek-llm-7b"), make_cluster("H200", 16), Plan(dp_shard=16), 4096, 64)
    assert slower.time.total > faster.time.total


# ---- the CLI contract ----------------------------------------------------------------------------------------------
def test_json_has_the_promised_fields_best_first():
    rc, out = run_plan_cli("--model", "deepseek-v2-lite", "--gpus", "16", "--gpu-type", "H100", "--seq-len", "4096",
                           "--global-batch-size", "256", "--top", "5", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert set(doc) >= {"plans", "rejected"}
    assert 1 <= len(doc["plans"]) <= 5
    for p in doc["plans"]:
        assert set(p) >= {"dp_replicate", "dp_shard", "tp", "pp", "pp_schedule", "ep", "micro_batch_size",
                          "activation_checkpointing", "cpu_offload", "memory_gib_per_gpu", "step_time_s",
                          "tokens_per_s_per_gpu", "mfu", "command", "memory_breakdown"}
        assert p["dp_replicate"] * p["dp_shard"] * p["tp"] * p["pp"] == 16
        assert p["command"].startswith("paraseek train --model deepseek-v2-lite --nnodes 2")
        assert sum(p["memory_breakdown"].values()) == pytest.approx(p["memory_gib_per_gpu"], abs=0.01)
    keys = [(not p["above_memory_headroom"], p["tokens_per_s_per_gpu"]) for p in doc["plans"]]
    assert keys == sorted(keys, reverse=True)


def test_text_report_and_infer_mode_run():
    rc, out = run_plan_cli("--model", "deepseek-llm-7b", "--gpus", "8", "--gpu-type", "A100-80GB",
                           "--global-batch-size", "64")
    assert rc == 0 and "best variant of each mesh" in out and "why #1:" in out and "paraseek train" in out
    rc, out = run_plan_cli("--model", "deepseek-v2-lite", "--gpus", "8", "--gpu-type", "H200", "--mode", "infer",
                           "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["plans"] and all(p["max_batch_at_seq_len"] > 0 for p in doc["plans"])


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "8", "--gpu-type", "B300"], "unknown GPU type 'B300'"),
    (["--gpus", "0", "--gpu-type", "H100"], "--gpus must be a positive number of GPUs, got 0"),
    # 30 layers and tp <= 8 leave at least 2048 / (8 * 16) = 16 data-parallel ranks
    (["--gpus", "2048", "--gpu-type", "H800", "--global-batch-size", "100"],
     "--global-batch-size 100 cannot be divided over any data-parallel size of 2048 GPUs; use a multiple of 16"),
    (["--gpus", "8", "--gpu-type", "H100"], "--global-batch-size is required"),
    (["--gpus", "12", "--gpu-type", "H100", "--global-batch-size", "48"], "not a multiple of --gpus-per-node 8"),
    (["--gpu-type", "H100", "--global-batch-size", "8"], "--gpus N and --gpu-type T"),
    (["--hardware", "/nonexistent.json", "--global-batch-size", "8"], "hardware profile /nonexistent.json: no such file"),
    (["--gpus", "8", "--gpu-type", "H100", "--global-batch-size", "8", "--scaling", "8,x"], "comma-separated"),
])
def test_bad_input_is_one_clear_line(argv, message):
    with pytest.raises(UserError) as e:
        run_plan_cli("--model", "deepseek-llm-7b", *argv)
    text = str(e.value)
    assert message in text and "\n" not in text
