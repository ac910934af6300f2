"""The engine on CUDA: the Triton kernels, varlen flash prefill and CUDA-graph replay give the outputs of the
plain-torch reference path (the one the CPU suite checks against transformers), on tiny random models."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from paraseek.infer import ops  # noqa: E402
from paraseek.infer.engine import Engine, EngineConfig  # noqa: E402
from paraseek.infer.sampling import SamplingParams  # noqa: E402
from paraseek.models import ModelArgs, build_model, preset_config  # noqa: E402

GQA = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
       "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 2048,
       "rope_theta": 10000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}}
MLA = dict(preset_config("tiny-moe"), num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64,
           qk_nope_head_dim=128, v_head_dim=128, hidden_size=512, max_position_embeddings=2048)


def _model(cfg, dtype):
    torch.manual_seed(0)
    return build_model(ModelArgs.from_hf_config(cfg), "cuda", dtype).eval()


def _run(cfg, dtype, kernels: bool, eager: bool, prompts, new=24, **kw):
    model = _model(cfg, dtype)
    engine = Engine(model, EngineConfig(num_kv_blocks=400, max_batched_tokens=256, enforce_eager=eager, **kw),
                    log=lambda *_: None)
    ops.use_kernels(kernels)
    reqs = engine.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    ops.use_kernels(True)
    return [r.output_ids for r in reqs], engine


def _prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in torch.randint(3, 300, (n,), generator=g)]


@pytest.mark.parametrize("cfg", [GQA, dict(MLA, first_k_dense_replace=3)], ids=["gqa", "mla"])
def test_kernels_and_graphs_equal_the_reference_path_fp32(cfg):
    """fp32: the kernel path (eager and graph replay) gives the reference path's greedy tokens. (Dense layers: in
    fp32 the routed experts run the exact per-expert loop, which syncs with the host and is not captured; bf16 MoE
    graphs are the next test's.)"""
    prompts = _prompts(12, cfg["vocab_size"])
    ref, _ = _run(cfg, torch.float32, kernels=False, eager=True, prompts=prompts)
    eager, _ = _run(cfg, torch.float32, kernels=True, eager=True, prompts=prompts)
    graphs, engine = _run(cfg, torch.float32, kernels=True, eager=False, prompts=prompts)
    assert engine.runner.graphs
    assert eager == ref
    assert graphs == ref


@pytest.mark.parametrize("cfg", [GQA, MLA], ids=["gqa", "mla"])
def test_bf16_graph_decode_logits_close_to_reference(cfg):
    """bf16: one decode step's logits through the captured graph against the reference ops, relative 2e-2."""
    prompts = _prompts(5, cfg["vocab_size"], seed=1)
    model = _model(cfg, torch.bfloat16)
    engine = Engine(model, EngineConfig(num_kv_blocks=400, max_batched_tokens=2048), log=lambda *_: None)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()  # all prefills
    engine.flush()  # their first tokens read back: the decode inputs below are on the host
    plan = engine.scheduler.schedule()
    hb, _ = engine._host_batch(plan)
    assert engine.runner.graph_key(hb) is not None
    got = engine.runner.run(hb).float().clone()
    ops.use_kernels(False)
    ref = engine.runner.forward(hb.to_device(engine.device)).float()
    ops.use_kernels(True)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 2e-2


def test_decode_gemv_in_the_graph_gives_the_cublas_logits_on_a_measured_shape(monkeypatch):
    """The 8B shape cut to one layer, bf16, batch 1 (every projection and the head have a GEMV config for the H200):
    a captured decode step with the GEMV kernel against the same step through F.linear / torch.mm (no configs),
    relative 1e-2, and the same greedy tokens over 16 steps."""
    from paraseek.infer import gemv

    if not gemv.gemv_config(gemv.device_name(torch.device("cuda")), 6144, 4096, 1):
        pytest.skip("no decode GEMV config for this GPU")
    cfg = dict(preset_config("deepseek-r1-distill-llama-8b"), num_hidden_layers=1)
    prompt = _prompts(1, 1000, seed=3)

    def run(with_gemv: bool):
        if not with_gemv:
            monkeypatch.setattr(gemv, "gemv_config", lambda *a, **k: None)
        model = _model(cfg, torch.bfloat16)
        engine = Engine(model, EngineConfig(num_kv_blocks=64, max_num_seqs=4, max_model_len=512), log=lambda *_: None)
        engine.add_request("a", prompt[0], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        engine.step()
        engine.flush()
        hb, _ = engine._host_batch(engine.scheduler.schedule())
        assert engine.runner.graph_key(hb) is not None
        logits = engine.runner.run(hb).float().clone()
        engine.abort("a")
        tokens = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].output_ids
        monkeypatch.undo()
        return logits, tokens

    got, got_tokens = run(True)
    ref, ref_tokens = run(False)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-2
    assert got_tokens == ref_tokens


def test_preemption_and_prefix_cache_on_gpu_give_the_same_tokens():
    prompts = _prompts(16, GQA["vocab_size"], seed=2)
    prompts = [prompts[0][:64] + p for p in prompts]  # a shared 64-token prefix
    full, _ = _run(GQA, torch.float32, kernels=True, eager=False, prompts=prompts)
    small, engine = _run(GQA, torch.float32, kernels=True, eager=False, prompts=prompts, block_size=16)
    assert small == full
    tight_model = _model(GQA, torch.float32)
    tight = Engine(tight_model, EngineConfig(num_kv_blocks=60, max_batched_tokens=256), log=lambda *_: None)
    out = [r.output_ids for r in tight.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))]
    assert out == full
    assert tight.scheduler.num_preemptions > 0 and tight.pool.hits > 0


def test_memory_sizing_leaves_the_configured_headroom():
    """The pool is sized from measured free memory: after warm-up, graphs and a full batch, the process holds no
    more than the configured share of the GPU."""
    model = _model(GQA, torch.bfloat16)
    engine = Engine(model, EngineConfig(gpu_memory_utilization=0.3, max_num_seqs=64), log=lambda *_: None)
    prompts = _prompts(64, GQA["vocab_size"], seed=3)
    engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, ignore_eos=True))
    free, total = torch.cuda.mem_get_info()
    assert engine.report.num_blocks > 1000
    assert total - free <= 0.3 * total  # everything this process holds, the CUDA context included


@pytest.mark.parametrize("cfg", [GQA, MLA], ids=["gqa", "mla"])
def test_chunked_flash_prefill_equals_the_model_forward_bf16(cfg):
    """A 300-token prompt prefilled in two chunks (the second attends to 200 cached tokens: bottom-right causal
    alignment) through the varlen flash kernel: its last logits against the reference loop and against the model's
    own forward of the whole sequence (bf16, relative 2e-2)."""
    import numpy as np

    from paraseek.infer import attention
    from paraseek.infer.runner import HostBatch

    model = _model(cfg, torch.bfloat16)
    ids = torch.randint(0, cfg["vocab_size"], (300,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids], device="cuda"))[0, -1].float()
    engine = Engine(model, EngineConfig(num_kv_blocks=64, enforce_eager=True), log=lambda *_: None)
    bs = engine.cfg.block_size
    slots = np.arange(bs, bs + 300, dtype=np.int64)  # blocks 1.. in order

    def chunk(a, b):
        p = np.arange(a, b)
        return HostBatch(np.array(ids[a:b]), p, slots[a:b], 0, np.zeros((0, 1), np.int32), np.zeros(0, np.int32),
                         [(b - a, b)], slots[:b], np.array([b - a - 1]))

    outs = []
    for flash in (True, False):
        attention.USE_FLASH = flash
        engine.runner.run(chunk(0, 200))
        outs.append(engine.runner.run(chunk(200, 300))[0].float())
    attention.USE_FLASH = True
    for got in outs:
        assert ((got - ref).abs().max() / ref.abs().max()).item() < 2e-2
    assert ((outs[0] - outs[1]).abs().max() / outs[1].abs().max()).item() < 2e-2


def test_fused_moe_decode_equals_the_grouped_path_for_256_greedy_tokens():
    """DeepSeek-V2-Lite's layer shapes (64 routed experts top-6 of width 1408, 2 shared, MLA 16 x (128 + 64), D=2048)
    cut to 3 layers, fp32: the fused MoE kernels (no sort; graphs on) and the sorted grouped path (eager) give the
    same 256 greedy tokens for each of 4 prompts."""
    from paraseek.infer import model as infer_model

    cfg = dict(preset_config("deepseek-v2-lite"), num_hidden_layers=3, vocab_size=4096)
    prompts = _prompts(4, cfg["vocab_size"], seed=5)
    outs = {}
    try:
        for path, eager in (("fused", False), ("grouped", True)):
            infer_model.MOE_PATH = path
            model = _model(cfg, torch.float32)
            engine = Engine(model, EngineConfig(num_kv_blocks=200, max_batched_tokens=512, max_num_seqs=8,
                                                max_model_len=1024, enforce_eager=eager), log=lambda *_: None)
            reqs = engine.generate(prompts, SamplingParams(max_tokens=256, temperature=0, ignore_eos=True))
            outs[path] = [r.output_ids for r in reqs]
    finally:
        infer_model.MOE_PATH = None
    assert all(len(o) == 256 for o in outs["fused"])
    assert outs["fused"] == outs["grouped"]
