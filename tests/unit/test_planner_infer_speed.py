"""The inference speed model (planner/infer_speed.py): a decode step priced against the same formula worked by hand,
its shape (more sequences -> more tokens a second until compute-bound, longer contexts -> slower), the expected
number of experts a batch touches against sampling, the scheduler replay against the steps and preemptions the
engine logged in measured runs, the fit against the measured rows it was fitted from, and `plan --mode infer`'s
speed report and engine settings."""

import json
import random
import re
from pathlib import Path

import pytest

from paraseek.errors import UserError
from paraseek.models import ModelArgs, preset_config
from paraseek.planner import infer_speed as S
from paraseek.planner import make_cluster
from paraseek.planner.infer import engine_defaults
from plan_cli import run_plan_cli

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
H200 = make_cluster("H200", 1)


def model(name: str) -> ModelArgs:
    return ModelArgs.from_hf_config(preset_config(name))


def measured(path: str, name: str) -> dict:
    """The run called `name` in a measured JSON file (a list of bench-infer results with their names)."""
    return next(d for d in json.loads((BENCH / path).read_text()) if d.get("name") == name)


# ---- one step, by hand ---------------------------------------------------------------------------------------------
def test_decode_step_is_the_hand_computed_sum_of_its_kernels():
    """tiny-dense (D 64, 2 layers, 4 query and 2 kv heads of 16, F 176, vocab 2,048), 4 sequences of 100 tokens in
    a CUDA graph of 4 rows: every kernel's bytes and FLOPs worked out by hand from infer/model.py's decode forward,
    each priced latency + max(bytes / (hbm x HBM), FLOPs / (gemm x GEMM))."""
    a = model("tiny-dense")
    B, T = 4, 100
    per_layer = [  # (kind, launches, bytes, FLOPs)
        ("gemm", 1, 2 * 64 * 128 + 2 * B * (64 + 128), 2 * B * 64 * 128),  # q|k|v: 4 + 2 x 2 heads of 16
        ("small", 1, 2 * B * 128 * 2, 0),  # rope + cache write
        ("decode_gqa", 1, 2 * B * T * 2 * 2 * 16, 4 * B * T * 4 * 16),  # K and V of 2 kv heads
        ("small", 1, 4 * 2 * B * 4 * 16, 0),  # combine of the fp32 partials
        ("gemm", 1, 2 * 64 * 64 + 2 * B * (64 + 64), 2 * B * 64 * 64),  # o
        ("small", 2, 2 * B * 64 * 3 * 2, 0),  # two add + RMSNorm
        ("gemm", 1, 2 * 64 * 352 + 2 * B * (64 + 352), 2 * B * 64 * 352),  # gate|up
        ("small", 1, 2 * B * 3 * 176, 0),  # silu * up
        ("gemm", 1, 2 * 176 * 64 + 2 * B * (176 + 64), 2 * B * 176 * 64),  # down
    ]
    per_step = [
        ("small", 2, 2 * B * 64 * 3, 0),  # embedding, first norm
        ("small", 1, 2 * B * 64 * 2, 0),  # final norm
        ("gemm", 1, 2 * 64 * 2048 + 2 * B * (64 + 2048), 2 * B * 64 * 2048),  # head
        ("small", 5, 0, 0),  # the inputs' copies
        ("small", 1, 2 * B * 2048, 0),  # argmax
    ]

    def seconds(kind, launches, nbytes, flops):
        k = S.KERNELS[kind]
        return launches * (k.latency_s + S.GRAPH_GAP_S) + max(nbytes / (k.hbm * H200.hbm_gbps * 1e9),
                                                              flops / (k.gemm * H200.matmul_tflops * 1e12))

    gpu = 2 * sum(seconds(*k) for k in per_layer) + sum(seconds(*k) for k in per_step)
    bd: dict = {}
    step = S.decode_step_seconds(a, H200, 1, 2, B, T, 256, bd)
    assert bd["gpu_s"] == pytest.approx(gpu, rel=1e-12)
    host = S.HOST.step_s + S.HOST.seq_s * B  # a graph replay: no per-call host time
    assert step == pytest.approx(max(gpu, host), rel=1e-12)


def test_serial_kernels_add_their_memory_and_compute_time():
    k = S.KERNELS["moe"]
    nbytes, flops = 1e9, 1e12
    expect = 3 * (k.latency_s + S.GRAPH_GAP_S) + nbytes / (k.hbm * H200.hbm_gbps * 1e9) \
        + flops / (k.gemm * H200.matmul_tflops * 1e12)
    assert S.op_seconds(H200, "moe", nbytes, flops, 3) == pytest.approx(expect, rel=1e-12)


def test_the_copied_engine_constants_are_the_engines():
    """The speed model copies the engine's fused-MoE threshold and its CUDA-graph batch sizes (those modules import
    torch, which `paraseek plan` does not)."""
    from types import SimpleNamespace

    from paraseek.infer import model as infer_model
    from paraseek.infer.engine import Engine

    assert S.FUSED_MAX_SLOTS == infer_model.FUSED_MAX_SLOTS
    from paraseek.infer import sampling
    from paraseek.planner import infer as planner_infer

    assert planner_infer.SAMPLE_CHUNK_LOGITS == sampling.SAMPLE_CHUNK_LOGITS
    from paraseek.infer import config
    from paraseek.planner import memory

    assert memory.ALLOCATOR_FRACTION == config.ALLOCATOR_FRACTION
    for seqs in (1, 8, 256, 300, 1024, 2048):
        sizes = Engine._graph_batch_sizes(SimpleNamespace(cfg=SimpleNamespace(max_num_seqs=seqs)))
        assert [S.graph_batch(n, seqs) for n in range(1, seqs + 1)] == [min(s for s in sizes if s >= n)
                                                                         for n in range(1, seqs + 1)]


# ---- shape -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["deepseek-r1-distill-llama-8b", "deepseek-r1-distill-qwen-1.5b", "deepseek-v2-lite"])
def test_more_sequences_more_tokens_per_second_until_compute_bound(name):
    a = model(name)
    rates = [b / S.decode_step_seconds(a, H200, 1, 2, b, 512, 1024) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    assert all(x < y for x, y in zip(rates, rates[1:]))
    # once the GEMMs are compute-bound and the K/V reads grow with the batch, more sequences hardly help
    big = [b / S.decode_step_seconds(a, H200, 1, 2, b, 512, b) for b in (1024, 2048, 4096)]
    assert big[1] / big[0] < 1.2 and big[2] / big[1] < 1.1


@pytest.mark.parametrize("name", ["deepseek-r1-distill-llama-8b", "deepseek-v2-lite"])
def test_longer_context_is_slower(name):
    a = model(name)
    for b in (1, 64):
        steps = [S.decode_step_seconds(a, H200, 1, 2, b, ctx, 1024) for ctx in (128, 1024, 4096, 16384)]
        assert all(x < y for x, y in zip(steps, steps[1:]))


def test_a_longer_prompt_takes_longer_to_its_first_token():
    a = model("deepseek-r1-distill-llama-8b")
    ttft = [S.prefill_seconds(a, H200, 1, 2, n, 8192) for n in (128, 2048, 8192, 20000)]
    assert all(x < y for x, y in zip(ttft, ttft[1:]))


def test_touched_experts_match_sampling():
    """E (1 - (1 - K/E)^n) against the mean number of distinct experts when n tokens each draw K of E at random."""
    rng = random.Random(0)
    for E, K in ((64, 6), (256, 8)):
        assert S.touched_experts(1, K, E) == pytest.approx(K)
        for n in (2, 8, 64):
            trials = [len({e for _ in range(n) for e in rng.sample(range(E), K)}) for _ in range(2000)]
            assert S.touched_experts(n, K, E) == pytest.approx(sum(trials) / len(trials), rel=0.02)
        assert S.touched_experts(10_000, K, E) == pytest.approx(E)


# ---- the scheduler replay --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlapped", [True, False])
def test_replay_computes_every_prompt_once_and_every_output_token(overlapped):
    """Without preemption: the prefill chunks cover each prompt exactly once, each request gets its first token
    from its prefill and the rest from one decode row each, and no step exceeds the token or sequence budget."""
    prompts, outputs = S.Workload(300, (64, 1024), (64, 512), seed=3).lengths()
    rp = S.replay(prompts, outputs, 64, 2048, 10**7, overlapped=overlapped)
    chunk_tokens = sum(q for st, _ in rp.steps for q, _ in st.chunks)
    decode_rows = sum(st.n_decode for st, _ in rp.steps)
    assert rp.preemptions == 0
    assert chunk_tokens == sum(prompts)
    assert decode_rows == sum(outputs) - len(outputs)
    assert all(i >= 0 for i in rp.first_token_step)
    assert all(st.n_decode + sum(q for q, _ in st.chunks) <= 2048 and running <= 64 for st, running in rp.steps)
    assert all(st.graph_rows == 0 for st, _ in rp.steps if st.chunks)


def test_replay_with_too_little_cache_preempts_and_recomputes():
    rp = S.replay([300] * 50, [200] * 50, 64, 2048, 8000)
    assert rp.preemptions > 0 and all(i >= 0 for i in rp.first_token_step)
    assert sum(q for st, _ in rp.steps for q, _ in st.chunks) > 50 * 300  # recomputed prompts
    with pytest.raises(UserError, match="cannot be run with a KV cache of 4,000 tokens"):
        S.replay([5000], [10], 4, 2048, 4000)


@pytest.mark.parametrize("path,name", [
    ("2026-12-01/bench-infer-8b-vs-hf-generate.json", "llama8b"),  # 1,000 requests, 256 sequences, 8,192 tokens a step
    ("2026-12-04/bench-infer-fused-moe-all-shapes.json", "qwen"),
    ("2026-12-04/bench-infer-fused-moe-all-shapes.json", "v2lite"),  # 500 requests
    # 1,024 sequences, 16,384 tokens a step
    ("2026-12-01/bench-infer-1.5b-vs-hf-generate-and-stress.json", "qwen-wide"),
    ("2026-12-01/bench-infer-1.5b-vs-hf-generate-and-stress.json", "offline-c32"),  # 128 x (512 + 128), 32 sequences
    ("2026-12-04/bench-infer-fused-moe-all-shapes.json", "stress"),  # 512 x (2,048 + 128) in 25% of the GPU
    ("2026-12-01/bench-infer-1.5b-vs-hf-generate-and-stress.json", "stress"),
    ("2026-12-01/bench-infer-8b-1.5b-stress.json", "stress"),
])
def test_replay_makes_the_steps_and_preemptions_the_engine_logged(path, name):
    """The engine's own step count and preemptions for measured offline runs, replayed at their settings and their
    measured KV pool (an independent record: the runner's step log and the scheduler's counter)."""
    run = measured(path, name)
    t, e = run["throughput"], run["engine"]
    if ":" in t["input_len"]:
        (a, b), (c, d) = [tuple(map(int, x.split(":"))) for x in (t["input_len"], t["output_len"])]
        prompts, outputs = S.Workload(t["requests"], (a, b), (c, d)).lengths()
    else:
        prompts, outputs = [int(t["input_len"])] * t["requests"], [int(t["output_len"])] * t["requests"]
    assert (sum(prompts), sum(outputs)) == (t["input_tokens"], t["output_tokens"])
    rp = S.replay(prompts, outputs, e["max_num_seqs"], e["max_batched_tokens"], run["kv_cache"]["tokens"])
    assert abs(len(rp.steps) - t["steps"]) <= 2
    assert rp.preemptions == t["preemptions"]


# ---- the fit ---------------------------------------------------------------------------------------------------------
def test_predictions_at_batch_1_and_64_are_within_15_percent_of_the_rows_fitted_from():
    """Guards the fit, not an out-of-sample check: these measured rows (bench-infer on one H200, 256 sequences and
    8,192 tokens a step) are among those KERNELS and HOST were fitted from. Batch 1: the latency workload (128 +
    256 tokens) of the 8B, the 1.5B and V2-Lite; batch 64: the 8B at 512 + 128 tokens and V2-Lite at 2,048 + 128
    (the 1.5B has no measured batch-64 row)."""
    rows = [
        ("2026-12-04/bench-infer-fused-moe-all-shapes.json", "llama8b-latency", "deepseek-r1-distill-llama-8b", 1,
         (128, 256)),
        ("2026-12-04/bench-infer-fused-moe-all-shapes.json", "qwen", "deepseek-r1-distill-qwen-1.5b", 1, (128, 256)),
        ("2026-12-04/bench-infer-fused-moe-all-shapes.json", "v2lite", "deepseek-v2-lite", 1, (128, 256)),
        ("2026-12-01/bench-infer-8b-vs-hf-generate.json", "llama8b", "deepseek-r1-distill-llama-8b", 64, (512, 128)),
        ("2026-12-04/bench-infer-fused-moe-all-shapes.json", "v2lite", "deepseek-v2-lite", 64, (2048, 128)),
    ]
    for path, name, preset, n, (p, o) in rows:
        run = measured(path, name)
        e = run["engine"]
        r = S.run_requests(model(preset), H200, 1, 2, [p] * n, [o] * n, e["max_num_seqs"], e["max_batched_tokens"],
                           run["kv_cache"]["tokens"])
        want = run["latency"]["ms_per_token"] if n == 1 else \
            next(c for c in run["concurrency"] if c["concurrency"] == n)["decode_ms_per_step"]
        assert r["decode_ms_per_step"] == pytest.approx(want, rel=0.15), (name, n)


def test_fused_moe_pricing_is_within_10_percent_of_its_tuning_timings():
    """benchmarks/2026-12-04/fused-moe-tuning-v2lite-h200.txt: the router, route, align, both fused kernels and the
    combine at 1 to 512 tokens on V2-Lite's layer (one of the files the moe terms were fitted from)."""
    text = (BENCH / "2026-12-04/fused-moe-tuning-v2lite-h200.txt").read_text()
    table = {int(m[1]): float(m[2]) for m in re.finditer(r"^\| (\d+) \| [^|]+\| ([\d.]+) \|", text, re.M)}
    assert len(table) == 10
    a = model("deepseek-v2-lite")
    moe_ops = ("router_cast", "router", "route", "moe_align", "moe_gate_up", "moe_down", "moe_combine")
    for n, us in table.items():
        bd: dict = {}
        S.step_seconds(a, H200, 1, 2, S.StepShape(n, n, [], n), n, bd)
        assert sum(bd[k] for k in moe_ops) / 26 * 1e6 == pytest.approx(us, rel=0.10), n


# ---- plan --mode infer -----------------------------------------------------------------------------------------------
def test_engine_defaults_follow_the_gpu_memory():
    assert engine_defaults(make_cluster("H200", 1)) == (1024, 16384)
    assert engine_defaults(make_cluster("H100", 1)) == (1024, 16384)
    assert engine_defaults(make_cluster("A100-80GB", 1)) == (256, 8192)
    assert engine_defaults(make_cluster("L40S", 1)) == (256, 8192)
    # The planner's copy of the engine's rule (infer/config.offline_defaults; the planner imports no infer code).
    from paraseek.infer.config import offline_defaults

    for gpu in ("H200", "H100", "A100-80GB", "A100-40GB", "L40S", "V100", "T4"):
        c = make_cluster(gpu, 1)
        assert engine_defaults(c) == offline_defaults(c.memory_gib, f"NVIDIA {c.gpu.name}")[:2], gpu


def test_plan_infer_json_carries_the_speed_report():
    rc, out = run_plan_cli("--model", "deepseek-r1-distill-qwen-1.5b", "--gpus", "2", "--gpu-type", "H200", "--mode",
                       "infer", "--seq-len", "8192", "--context-len", "1024", "--global-batch-size", "32",
                       "--num-requests", "200", "--json")
    doc = json.loads(out)
    assert rc == 0 and {"kernels", "host"} <= set(doc["speed_terms"])
    assert [p["tp"] for p in doc["plans"]] and all("speed" in p for p in doc["plans"])
    for p in doc["plans"]:
        s = p["speed"]
        assert s["engine"] == {"max_num_seqs": 1024, "max_batched_tokens": 16384,
                               "kv_tokens": p["max_context_at_batch_1"]}
        assert [d["batch"] for d in s["decode"]] == [1, 8, 32, 64, 256]
        assert all(d["context"] == 1024 for d in s["decode"])
        assert s["batch1_ms_per_token"] == pytest.approx(s["decode"][0]["ms_per_step"])
        assert s["prefill"]["prompt_len"] == 128 and s["prefill"]["ttft_ms"] > 0
        off = s["offline"]
        assert off["requests"] == 200 and off["per_model_copy"]["requests"] == 200 // p["replicas"]
        assert off["output_tokens_per_s"] == pytest.approx(off["per_model_copy"]["output_tokens_per_s"] * p["replicas"],
                                                           rel=1e-3)
        b32 = next(d for d in s["decode"] if d["batch"] == 32)
        assert p["decode_tokens_per_s_per_gpu"] == pytest.approx(
            32 / S.decode_step_seconds(model("deepseek-r1-distill-qwen-1.5b"), make_cluster("H200", 2), p["tp"], 2,
                                       32, 8192, 1024) / p["tp"], rel=1e-3)
        assert b32["tokens_per_s"] > 0


def test_plan_infer_engine_flags_and_their_checks():
    rc, out = run_plan_cli("--model", "deepseek-v2-lite", "--gpus", "1", "--gpu-type", "A100-80GB", "--mode", "infer",
                       "--num-requests", "0", "--json")
    s = json.loads(out)["plans"][0]["speed"]
    assert s["engine"]["max_num_seqs"] == 256 and s["engine"]["max_batched_tokens"] == 8192 and "offline" not in s
    rc, out = run_plan_cli("--model", "deepseek-v2-lite", "--gpus", "1", "--gpu-type", "H200", "--mode", "infer",
                       "--max-num-seqs", "128", "--max-batched-tokens", "4096", "--num-requests", "50", "--json")
    s = json.loads(out)["plans"][0]["speed"]
    assert (s["engine"]["max_num_seqs"], s["engine"]["max_batched_tokens"]) == (128, 4096)
    rc, text = run_plan_cli("--model", "deepseek-v2-lite", "--gpus", "1", "--gpu-type", "H200", "--mode", "infer",
                        "--num-requests", "50")
    assert rc == 0 and "ms/token" in text and "TTFT" in text and "output tok/s" in text
    for argv, msg in [
        (["--global-batch-size", "8", "--prompt-len", "64"], "--prompt-len is for --mode infer"),
        (["--mode", "infer", "--batch-sizes", "1,x"], "--batch-sizes"),
        (["--mode", "infer", "--context-len", "8192", "--seq-len", "4096"], "more than --seq-len"),
        (["--mode", "infer", "--input-len", "9:3"], "--input-len"),
        (["--mode", "infer", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    ]:
        with pytest.raises(UserError, match=msg):
            run_plan_cli("--model", "deepseek-v2-lite", "--gpus", "1", "--gpu-type", "H200", *argv)
