"""The LoRA shrink/expand Triton kernels (infer/lora_kernels.py) against their plain-torch reference: fused
projections of 1 to 3 pieces, tokens of every slot and of the base (-1), adapters of ranks below the slots' rank,
tiny shapes and the 8B's (q|k|v, gate|up, down at 64 tokens, 8 slots of rank 16); another slot's non-finite values
never reach a token; a captured CUDA graph reads the slots and the tokens' slots as they are at replay. Then the
engine on CUDA with the kernels on (eager and graphs, fp32): each request's greedy tokens under its adapter are the
tokens of the model with that adapter merged into its weights (W + B A), base requests the base model's. MLA's
kv_b adapter read absorbed (query and attended value): the two latent kernels against LatentLoRA's torch path.

Tolerances (max|kernel - reference| / max|reference|): the shrink's fp32 partial sums 1e-5 in both dtypes (fp32
products of the same inputs, summed in another order); the expanded output 1e-5 in fp32 and 1e-2 in bf16 (one
rounding of y, and x A^T rounded to bf16 as in the torch path: a sum that differs in its last fp32 bits can round
to the neighbouring bf16 value). Base rows are compared exactly.

On the GPU machine: `PYTHONPATH=src python -m pytest -q -m gpu tests/gpu/test_lora_kernels_gpu.py`. Without a GPU,
PARASEEK_TRITON_INTERPRET=1 runs the fp32 kernel cases of the tiny shapes through Triton's interpreter."""

import pytest
import torch

# First: it chooses CUDA or Triton's interpreter before triton is imported. reference_ops is an autouse fixture.
from triton_device import CUDA, DEVICE, DTYPES, rel  # noqa: F401
from triton_device import reference_ops  # noqa: F401

from paraseek.infer import lora_kernels  # noqa: E402

pytestmark = pytest.mark.gpu

# (tokens N, input I, the pieces' rows, slots L, rank R)
TINY = [(11, 40, (16, 8, 8), 4, 8), (5, 100, (24,), 3, 16), (7, 1500, (40, 40), 2, 5)]
LLAMA_8B = [(64, 4096, (4096, 1024, 1024), 8, 16), (64, 4096, (14336, 14336), 8, 16), (64, 14336, (4096,), 8, 16),
            (1, 4096, (4096, 1024, 1024), 8, 16)]
SHAPES = TINY + (LLAMA_8B if CUDA else [])


def _inputs(N, I, rows, L, R, dtype, seed=0):
    """x, the base output y, the slots' A [P*L*R, I] and B [O, L*R] with slot l's adapter of rank R - l (zero rows
    and columns past it, as lora.py loads them), and each token's slot in -1 .. L-1 (every one present when N
    allows)."""
    g = torch.Generator().manual_seed(seed)
    P, O = len(rows), sum(rows)
    a_PLRI = torch.randn(P, L, R, I, generator=g) / I ** 0.5
    b_OLR = torch.randn(O, L, R, generator=g)
    for slot in range(L):
        rank = max(R - slot, 1)
        a_PLRI[:, slot, rank:] = 0
        b_OLR[:, slot, rank:] = 0
    idx_N = (torch.arange(N) + 1) % (L + 1) - 1  # slot 0 first: one token is always on an adapter, the base from N > L
    idx_N = idx_N[torch.randperm(N, generator=g)]
    x = torch.randn(N, I, generator=g)
    y = torch.randn(N, O, generator=g)
    on = dict(device=DEVICE, dtype=dtype)
    return (x.to(**on), y.to(**on), a_PLRI.reshape(P * L * R, I).to(**on), b_OLR.reshape(O, L * R).to(**on),
            idx_N.to(DEVICE), [sum(rows[:k]) for k in range(P)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,I,rows,L,R", SHAPES)
def test_shrink_and_expand_equal_the_reference(N, I, rows, L, R, dtype):
    x, y, a, b, idx, starts = _inputs(N, I, rows, L, R, dtype)
    P = len(rows)
    ws = lora_kernels.shrink(x, a, idx, P, R)
    ws_ref = lora_kernels.shrink_reference(x, a, idx, P, R)
    assert ws.dtype == torch.float32 and ws.shape[:2] == (N, P) and ws.shape[3] == R
    mine = idx >= 0  # a base token's partials are not written (expand_ does not read them)
    assert rel(ws.sum(2)[mine], ws_ref.sum(2)[mine]) < 1e-5
    got = lora_kernels.expand_(y.clone(), ws, b, idx, starts)
    want = lora_kernels.expand_reference_(y.clone(), ws_ref, b, idx, starts)
    assert got.dtype == y.dtype
    assert torch.equal(got[idx < 0], y[idx < 0])  # base rows untouched
    assert rel(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel(got, y) > 1e-3  # the adapters matter


def test_other_slots_non_finite_values_reach_no_token():
    """Slot 1's A and B set to inf/NaN: every token of another slot (and of the base) gets the reference's finite
    output; the kernels read only each token's own slot."""
    N, I, rows, L, R = 11, 40, (16, 8, 8), 4, 8
    x, y, a, b, idx, starts = _inputs(N, I, rows, L, R, torch.float32, seed=1)
    want = lora_kernels.expand_reference_(y.clone(), lora_kernels.shrink_reference(x, a, idx, 3, R), b, idx, starts)
    a.view(3, L, R, I)[:, 1] = float("inf")
    b.view(-1, L, R)[:, 1] = float("nan")
    got = lora_kernels.expand_(y.clone(), lora_kernels.shrink(x, a, idx, 3, R), b, idx, starts)
    others = idx != 1
    assert torch.isfinite(got[others]).all()
    assert rel(got[others], want[others]) < 1e-5


@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_captured_graph_reads_slots_and_token_slots_at_replay():
    N, I, rows, L, R = 64, 4096, (4096, 1024, 1024), 8, 16
    x, y, a, b, idx, starts = _inputs(N, I, rows, L, R, torch.bfloat16)
    y_out = y.clone()
    lora_kernels.expand_(y_out, lora_kernels.shrink(x, a, idx, 3, R), b, idx, starts)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_out.copy_(y)
        lora_kernels.expand_(y_out, lora_kernels.shrink(x, a, idx, 3, R), b, idx, starts)
    x2, y2, a2, b2, idx2, _ = _inputs(N, I, rows, L, R, torch.bfloat16, seed=5)
    for t, t2 in ((x, x2), (y, y2), (a, a2), (b, b2), (idx, idx2)):
        t.copy_(t2)
    graph.replay()
    want = lora_kernels.expand_reference_(y2.clone(), lora_kernels.shrink_reference(x2, a2, idx2, 3, R), b2, idx2,
                                          starts)
    assert rel(y_out, want) < 1e-2


# ---- MLA's kv_b read absorbed -------------------------------------------------------------------------------------
# (decode tokens n, all tokens N, heads H, nope, V, latent C, slots L, rank R)
LATENT = [(7, 9, 4, 16, 16, 64, 3, 8)] + ([(64, 64, 16, 128, 128, 512, 8, 16), (1, 1, 128, 128, 128, 512, 4, 16)]
                                          if CUDA else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,N,H,nope,V,C,L,R", LATENT)
def test_latent_kernels_equal_the_torch_path(n, N, H, nope, V, C, L, R, dtype):
    """LatentLoRA's absorbed query and attended-value deltas: the kernels against its masked torch path, q_nope a
    strided view as the model passes it; rows of base tokens untouched."""
    from types import SimpleNamespace

    from paraseek.infer.lora import LatentLoRA, LoRASlots

    g = torch.Generator().manual_seed(n + H)
    on = dict(device=DEVICE, dtype=dtype)
    slots = LoRASlots(L, R, None, DEVICE, dtype)
    lat = LatentLoRA(slots, 0, H, nope, V, C, lambda t: t)
    lat.a_XC.copy_((torch.randn(L * R, C, generator=g) / C ** 0.5).to(**on))
    lat.b_OX.copy_(torch.randn(H * (nope + V), L * R, generator=g).to(**on))
    idx_N = ((torch.arange(N) + 1) % (L + 1) - 1)[torch.randperm(N, generator=g)].to(DEVICE)  # N = 1: on slot 0
    slots.begin(SimpleNamespace(lora=idx_N))
    q_NHX = torch.randn(N, H, nope + 32, generator=g).to(**on)
    q_lat = torch.randn(H, n, C, generator=g).to(**on)
    o_lat = torch.randn(n, H, C, generator=g).to(**on)
    o = torch.randn(N, H, V, generator=g).to(**on)
    base = idx_N[:n] < 0
    tol = 1e-5 if dtype == torch.float32 else 1e-2

    want = q_lat.clone()
    lat.absorb_q_(want, q_NHX[:n, :, :nope])
    got = q_lat.clone()
    lora_kernels.latent_absorb_q_(got, q_NHX[:n, :, :nope], lat.b_OX, lat.a_XC, idx_N, V, R)
    assert torch.equal(got[:, base], q_lat[:, base])
    assert rel(got, want) < tol and rel(got, q_lat) > 1e-3

    want = o.clone()
    lat.value_(want, o_lat)
    got = o.clone()
    lora_kernels.latent_value_(got, o_lat, lat.a_XC, lat.b_OX, idx_N, nope, R)
    assert torch.equal(got[:n][base], o[:n][base]) and torch.equal(got[n:], o[n:])
    assert rel(got, want) < tol and rel(got, o) > 1e-3


# ---- the engine against merged models -----------------------------------------------------------------------------
def _adapter(args, rank: int, seed: int):
    """A random adapter (A [r, I], B [O, r] already scaled) of every projection the slots serve."""
    from paraseek.infer.lora import Adapter
    from paraseek.models.lora_spec import LoRASpec, adapted, model_targets

    g = torch.Generator().manual_seed(seed)
    targets = tuple(t for t in model_targets(args) if t not in ("experts", "shared_experts"))
    out = Adapter(f"random-{seed}", rank)
    for w in adapted(args, LoRASpec(rank, rank, targets)):
        out.weights[w.name] = (torch.randn(rank, w.in_features, generator=g) / w.in_features ** 0.5,
                               torch.randn(w.out_features, rank, generator=g) * 0.2)
    return out


def _merged_tokens(cfg, adapters: dict, names: list, prompts, eager: bool):
    """Each prompt's greedy tokens from its own engine built on the model with its adapter merged (None: the base)."""
    from test_infer_gpu import _model

    from paraseek.infer import ops
    from paraseek.infer.engine import Engine, EngineConfig
    from paraseek.infer.sampling import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    out = {}
    ops.use_kernels(True)
    for name in set(names):
        model = _model(cfg, torch.float32)
        if name is not None:
            state = model.state_dict()
            with torch.no_grad():
                for module, (a, b) in adapters[name].weights.items():
                    state[f"{module}.weight"] += (b @ a).to(state[f"{module}.weight"])
        engine = Engine(model, EngineConfig(num_kv_blocks=400, max_batched_tokens=256, enforce_eager=eager),
                        log=lambda *_: None)
        out[name] = [r.output_ids for r in engine.generate(prompts, params)]
    return out


@pytest.mark.skipif(not CUDA, reason="the engine on CUDA")
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("cfg_name", ["gqa", "mla"])
def test_engine_tokens_with_adapters_equal_the_merged_models(cfg_name, eager):
    """fp32, kernels on: two adapters (ranks 16 and 8 in slots of rank 16) and the base in one batch. MLA's dense
    layers only (q_a|kv_a, q_b, o and kv_b's absorbed decode forms through the kernels, kv_b's prefill keys through
    the torch path)."""
    from test_infer_gpu import GQA, MLA, _model, _prompts

    from paraseek.infer import ops
    from paraseek.infer.engine import Engine, EngineConfig
    from paraseek.infer.sampling import SamplingParams

    cfg = GQA if cfg_name == "gqa" else dict(MLA, first_k_dense_replace=3)
    ops.use_kernels(True)
    engine = Engine(_model(cfg, torch.float32), EngineConfig(num_kv_blocks=400, max_batched_tokens=256,
                                                             enforce_eager=eager, max_loras=2, max_lora_rank=16),
                    log=lambda *_: None)
    assert eager or engine.runner.graphs
    adapters = {"a": _adapter(engine.args, 16, 1), "b": _adapter(engine.args, 8, 2)}
    for name, ad in adapters.items():
        engine.load_lora(name, name, ad)
    prompts = _prompts(12, cfg["vocab_size"])
    names = ["a", None, "b"] * 4
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    got = [r.output_ids for r in engine.generate(prompts, params, loras=names)]
    ref = _merged_tokens(cfg, adapters, names, prompts, eager)
    assert ref["a"] != ref[None] and ref["b"] != ref[None]  # the adapters matter
    for i, name in enumerate(names):
        assert got[i] == ref[name][i], (i, name)
