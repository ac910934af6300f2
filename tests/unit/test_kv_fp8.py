"""The FP8 KV cache on CPU (the plain-torch paths; the Triton kernels: tests/gpu/test_kv_fp8_gpu.py): the row
format and its error bound, the bytes per token (the engine's and the planner's, on every preset), the reference
writes and paged decodes on an e4m3 cache against the same ops on the dequantized cache, the pool's size and start-up
line, the flag's refusals, and tiny MLA and GQA models generating with an fp8 cache against the fp32 cache."""

import argparse
import json

import numpy as np
import pytest
import torch

from paraseek.cli import build_parser
from paraseek.errors import UserError
from paraseek.infer import kv_fp8, ops
from paraseek.infer.cache import CacheShape, KVCache
from paraseek.infer.config import EngineConfig
from paraseek.infer.engine import Engine
from paraseek.infer.runner import HostBatch
from paraseek.infer.sampling import SamplingParams
from paraseek.models import ModelArgs, resolve_model
from paraseek.models.args import preset_names
from paraseek.models.deepseek import build_model
from paraseek.planner.infer import kv_bytes_per_token
from plan_cli import run_plan_cli

E4M3 = torch.float8_e4m3fn


# ---- the format -----------------------------------------------------------------------------------------------------
def test_row_quantization_is_within_half_an_e4m3_step():
    """Per value |x - x_q s| <= max(|x| / 16, s / 1024): 3 mantissa bits (normal), steps of 2^-9 (subnormal)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 576, generator=g) * torch.logspace(-5, 2, 576)  # 7 decades within a row
    x[3] = 0  # an all-zero row quantizes to zeros
    q, s = kv_fp8.quantize_rows(x)
    assert q.dtype == E4M3 and s.dtype == torch.float32 and s.shape == (64,)
    assert torch.allclose(s[torch.arange(64) != 3], x.abs().amax(-1)[torch.arange(64) != 3] / 448)
    deq = kv_fp8.dequantize_rows(q, s, torch.float32)
    bound = torch.maximum(x.abs() / 16, s[:, None] / 1024) * (1 + 1e-6)
    assert ((deq - x).abs() <= bound).all()
    assert (deq[3] == 0).all()
    assert q.float().abs().max() == 448  # the row's amax maps to e4m3's largest value
    # Relative error of the rows' values: about 2-3% (the mean of a uniform rounding over a 3-bit mantissa).
    big = x.abs() >= s[:, None] * 2**-6  # e4m3's normal range (the subnormals' error is absolute)
    rel = ((deq - x).abs() / x.abs())[big]
    assert rel.max() <= 1 / 16 and 0.01 < rel.mean() < 0.04


def test_bytes_per_token_mla_and_gqa():
    v3 = resolve_model("deepseek-v3")[0]
    mla = CacheShape.of(v3, 8, fp8=True)
    assert mla.bytes_per_token(torch.bfloat16) == 61 * (512 + 64 + 4)  # 580 B a layer
    assert CacheShape.of(v3, 8).bytes_per_token(torch.bfloat16) == 61 * 1152  # 1.99x the fp8 bytes
    gqa = ModelArgs.from_hf_config(dict(model_type="llama", vocab_size=320, hidden_size=512, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=128))
    assert CacheShape.of(gqa, 1, fp8=True).bytes_per_token(torch.bfloat16) == 2 * 2 * 2 * (128 + 4)
    assert CacheShape.of(gqa, 1).bytes_per_token(torch.bfloat16) == 2 * 2 * 2 * 256


@pytest.mark.parametrize("name", preset_names())
def test_planner_counts_the_engines_kv_bytes(name):
    """plan --mode infer prices the engine's pool: the same bytes per token, fp8 or auto, at every tp it plans."""
    a = resolve_model(name)[0]
    for tp in (1, 2, 4, 8):
        if a.n_heads % tp or (not a.is_mla and a.n_kv_heads % tp and tp % a.n_kv_heads):
            continue
        for dtype in ("auto", "fp8"):
            engine = CacheShape.of(a, tp, fp8=dtype == "fp8").bytes_per_token(torch.bfloat16)
            assert kv_bytes_per_token(a, tp, dtype) == engine, (name, tp, dtype)


def test_plan_cli_kv_cache_dtype():
    rows = {}
    for dtype in ("auto", "fp8"):
        rc, text = run_plan_cli("--model", "deepseek-v3", "--mode", "infer", "--gpus", "8", "--gpu-type", "H200",
                                "--weight-dtype", "fp8", "--num-requests", "0", "--kv-cache-dtype", dtype, "--json")
        assert rc == 0
        rows[dtype] = {r["layout"]: r for r in json.loads(text)["plans"]}["tp8"]
    assert rows["fp8"]["kv_cache_bytes_per_token"] == 61 * 580
    assert rows["auto"]["kv_cache_bytes_per_token"] == 61 * 1152
    # The same memory holds 1.99x the tokens.
    assert rows["fp8"]["max_context_at_batch_1"] / rows["auto"]["max_context_at_batch_1"] == pytest.approx(
        1152 / 580, rel=1e-3)
    with pytest.raises(UserError, match="--kv-cache-dtype is for --mode infer"):
        run_plan_cli("--model", "deepseek-v3", "--gpus", "8", "--gpu-type", "H200", "--global-batch-size", "8",
                     "--kv-cache-dtype", "fp8")


# ---- the reference ops ----------------------------------------------------------------------------------------------
def _paged(g, B, M, block_size):
    ctx = torch.randint(1, M * block_size + 1, (B,), generator=g).int()
    tables = torch.randperm(B * M + 3, generator=g)[:B * M].view(B, M).int()
    return ctx, tables, (B * M + 3) * block_size


def test_reference_gqa_write_and_decode_on_fp8_equal_the_dequantized_cache():
    g = torch.Generator().manual_seed(1)
    N, H, G, D, S = 6, 8, 2, 32, 64
    qkv = torch.randn(N, (H + 2 * G) * D, generator=g)
    angles = torch.rand(50, D // 2, generator=g)
    cos, sin, pos, slots = angles.cos(), angles.sin(), torch.arange(N), torch.randperm(S, generator=g)[:N]
    plain = torch.zeros(S, 2, G, D)
    ops.rope_write_kv_(qkv.clone(), H, G, cos, sin, pos, slots, plain)
    kv, sc = torch.zeros(S, 2, G, D, dtype=E4M3), torch.zeros(S, 2, G)
    ops.rope_write_kv_(qkv.clone(), H, G, cos, sin, pos, slots, kv, sc)
    q_want, s_want = kv_fp8.quantize_rows(plain[slots])  # each kv head's K and V a row of its own
    assert torch.equal(kv[slots].view(torch.uint8), q_want.view(torch.uint8)) and torch.equal(sc[slots], s_want)

    B, M, bs = 5, 6, 8
    ctx, tables, S = _paged(g, B, M, bs)
    q, s = kv_fp8.quantize_rows(torch.randn(S, 2, G, D, generator=g) * 3)
    qry = torch.randn(B, H, D, generator=g)
    got = ops.paged_decode_gqa(qry, q[:, 0], q[:, 1], tables, ctx, bs, 0.2, s[:, 0], s[:, 1])
    deq = kv_fp8.dequantize_rows(q, s, torch.float32)
    assert torch.equal(got, ops.paged_decode_gqa(qry, deq[:, 0], deq[:, 1], tables, ctx, bs, 0.2))


def test_reference_mla_write_and_decode_on_fp8_equal_the_dequantized_cache():
    g = torch.Generator().manual_seed(2)
    N, H, C, R, S = 5, 4, 32, 8, 64
    kv_a = torch.randn(N, C + R, generator=g) * 4
    w = 1 + 0.1 * torch.randn(C, generator=g)
    angles = torch.rand(50, R // 2, generator=g)
    cos, sin, pos, slots = angles.cos(), angles.sin(), torch.arange(N), torch.randperm(S, generator=g)[:N]
    q_pe = torch.randn(N, H, R, generator=g)
    plain = torch.zeros(S, C + R)
    ops.mla_prepare_(q_pe.clone(), kv_a.clone(), w, 1e-6, cos, sin, pos, slots, plain, True)
    c, sc = torch.zeros(S, C + R, dtype=E4M3), torch.zeros(S)
    ops.mla_prepare_(q_pe.clone(), kv_a.clone(), w, 1e-6, cos, sin, pos, slots, c, True, sc)
    q_want, s_want = kv_fp8.quantize_rows(plain[slots])  # latent and rope key: one row, one scale
    assert torch.equal(c[slots].view(torch.uint8), q_want.view(torch.uint8)) and torch.equal(sc[slots], s_want)

    B, M, bs = 4, 5, 16
    ctx, tables, S = _paged(g, B, M, bs)
    q, s = kv_fp8.quantize_rows(torch.randn(S, C + R, generator=g))
    ql, qp = torch.randn(B, H, C, generator=g), torch.randn(B, H, R, generator=g)
    got = ops.paged_decode_mla(ql, qp, q, tables, ctx, bs, 0.1, s)
    assert torch.equal(got, ops.paged_decode_mla(ql, qp, kv_fp8.dequantize_rows(q, s, torch.float32), tables, ctx,
                                                 bs, 0.1))


def test_kv_cache_tensors_and_prefill_context():
    a = resolve_model("deepseek-v2-lite")[0]
    cache = KVCache(CacheShape.of(a, 1, fp8=True), 4, 16, torch.bfloat16, "cpu")
    assert cache.k[0].dtype == E4M3 and cache.k[0].shape == (64, 576) and cache.k_scale[0].shape == (64,)
    q, s = kv_fp8.quantize_rows(torch.randn(3, 576))
    cache.k[0][torch.tensor([5, 9, 2])] = q
    cache.k_scale[0][torch.tensor([5, 9, 2])] = s
    ctx = cache.context_latent(0, torch.tensor([9, 2]))
    assert ctx.dtype == torch.bfloat16 and torch.equal(ctx, kv_fp8.dequantize_rows(q[1:], s[1:], torch.bfloat16))
    gqa = KVCache(CacheShape(2, False, 2, 16, 16, True), 2, 8, torch.float32, "cpu")
    assert gqa.kv[1].shape == (16, 2, 2, 16) and gqa.kv_scale[1].shape == (16, 2, 2)
    assert gqa.k_scale[1].data_ptr() == gqa.kv_scale[1].data_ptr()  # views: one write fills K's and V's scales
    plain = KVCache(CacheShape.of(a, 1), 2, 8, torch.float32, "cpu")
    assert plain.k_scale[0] is None and plain.k[0].dtype == torch.float32


# ---- the flag -------------------------------------------------------------------------------------------------------
def test_flag_values_and_refusals(monkeypatch):
    ns = build_parser().parse_args(["generate", "m", "--kv-cache-dtype", "fp8"])
    assert ns.kv_cache_dtype == "fp8"
    assert build_parser().parse_args(["serve", "m"]).kv_cache_dtype == "auto"
    with pytest.raises(UserError, match="--kv-cache-dtype must be auto or fp8"):
        EngineConfig(kv_cache_dtype="fp16").validate()
    assert kv_fp8.refusal("fp8", "cpu") is None and kv_fp8.refusal("auto", "cuda") is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    msg = kv_fp8.refusal("fp8", "cuda")
    assert msg == ("--kv-cache-dtype fp8: NVIDIA A100-SXM4-80GB (compute capability 8.0) has no e4m3 support (8.9+: "
                   "Ada, Hopper); leave out --kv-cache-dtype")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert kv_fp8.refusal("fp8", "cuda") is None


# ---- the engine -----------------------------------------------------------------------------------------------------
MLA = dict(model_type="deepseek_v3", vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=24, n_shared_experts=1, n_routed_experts=4,
           num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=256, n_group=1, topk_group=1,
           topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, num_nextn_predict_layers=0)
GQA = dict(model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _engine(cfg: dict, **kw) -> Engine:
    torch.manual_seed(0)
    model = build_model(ModelArgs.from_hf_config(cfg), "cpu", torch.float32)
    model.init_weights(seed=0)
    return Engine(model, EngineConfig(**dict(dict(block_size=8, num_kv_blocks=128, max_batched_tokens=64), **kw)),
                  log=lambda *_: None)


def _decode_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Prefill ids[:-1] (in one chunk: its attention reads the chunk's own K/V back from the cache), then one decode
    step for ids[-1]: that step's logits."""
    bs = engine.cfg.block_size
    blocks = list(range(1, 2 + len(ids) // bs))
    slots = lambda p: np.array([blocks[i // bs] * bs + i % bs for i in p], dtype=np.int64)  # noqa: E731
    n = len(ids) - 1
    p = np.arange(n)
    engine.runner.run(HostBatch(np.array(ids[:-1]), p, slots(p), 0, np.zeros((0, 1), np.int32), np.zeros(0, np.int32),
                                [(n, n)], slots(p), np.array([n - 1])))
    p = np.array([n])
    return engine.runner.run(HostBatch(np.array(ids[-1:]), p, slots(p), 1, np.array([blocks], dtype=np.int32),
                                       np.array([n + 1], dtype=np.int32), [], np.zeros(0, np.int64), np.array([0])))[0]


@pytest.mark.parametrize("cfg", [MLA, GQA], ids=["mla", "gqa"])
def test_fp8_cache_logits_and_greedy_tokens_against_the_fp32_cache(cfg):
    """Measured on these tiny random models (fp32 weights, logits of std ~1 over 320 tokens: near ties are common):
    the decode logits after a 40-token prefill differ by 0.2% (MLA) and 0.5% (GQA) of their largest magnitude;
    greedy outputs of 6 prompts x 24 tokens: 4 of 6 identical for both models, the other two part at a near tie
    (MLA at tokens 9 and 13, GQA at tokens 3 and 17) and differ from there on (118 and 116 of 144 tokens equal)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 320, (41,), generator=g).tolist()
    ref, fp8 = _engine(cfg), _engine(cfg, kv_cache_dtype="fp8")
    assert fp8.runner.cache.k[0].dtype == E4M3
    want, got = _decode_logits(ref, ids), _decode_logits(fp8, ids)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert 0 < err < 0.01
    prompts = [torch.randint(0, 320, (k,), generator=g).tolist() for k in (5, 17, 33, 60, 2, 41)]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    a = [r.output_ids for r in _engine(cfg).generate(prompts, greedy)]
    b = [r.output_ids for r in _engine(cfg, kv_cache_dtype="fp8").generate(prompts, greedy)]
    assert sum(x == y for x, y in zip(a, b)) >= 4


def test_pool_holds_twice_the_tokens_and_says_so():
    """--kv-cache-gib on CPU: the same memory holds the fp8 rows' tokens, and the start-up line puts the model's
    dtype's count beside them (here fp32: 320 B against 88 B a token)."""
    auto = _engine(MLA, num_kv_blocks=None, kv_cache_gib=2**-14, max_num_seqs=64)
    fp8 = _engine(MLA, num_kv_blocks=None, kv_cache_gib=2**-14, max_num_seqs=64, kv_cache_dtype="fp8")
    per_auto, per_fp8 = auto.report.bytes_per_token, fp8.report.bytes_per_token
    assert per_auto == 2 * 40 * 4 and per_fp8 == 2 * (40 + 4)  # fp32 model: 4 B a value
    assert fp8.report.extra["model_dtype_tokens"] == auto.report.tokens
    assert fp8.report.num_blocks - 1 == int(2**30 * 2**-14 // (per_fp8 * 8))
    line = fp8.report.line()
    assert f"{per_auto / per_fp8:.2f}x the tokens of float32 ({per_auto:,} B/token: {auto.report.tokens:,} tokens" \
        in line, line
    assert "fp8" not in auto.report.line()
