"""FP8 block weights in the inference engine, on CPU (the plain-torch forms; the kernels:
tests/gpu/test_fp8_kernels.py): the FP8 projection against a float64 product of its quantized operands and against the unquantized product; the FP8
fused-MoE reference against a float64 loop; a DeepSeek-V3-shaped checkpoint written by scripts/write_fp8_checkpoint.py
(its names, dtypes and config), loaded by slices with its FP8 blocks kept, against the same checkpoint dequantized
(today's load_pretrained); --quantization fp8 of a bf16 folder against that FP8 folder; each tp rank's slices
against the whole; and the one-line refusals of bad checkpoints and flags."""

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fp8_models import ROOT, TINY_V3, prompts, write_fp8, write_source
from paraseek.errors import UserError
from paraseek.infer import moe
from paraseek.infer.engine import Engine, EngineConfig
from paraseek.infer.fp8 import Fp8Linear, quantize_1x128
from paraseek.infer.model import DenseMLP, InferenceModel, LatentAttention, MoELayer
from paraseek.infer.sampling import SamplingParams
from paraseek.infer.weights import FolderWeights, Share
from paraseek.models import ModelArgs, load_pretrained
from paraseek.models.hf import dequantize_fp8, is_fp8_weight, quantize_fp8

E4M3 = torch.float8_e4m3fn
ARGS = ModelArgs.from_hf_config(TINY_V3)


# ---- the format and the projection ----------------------------------------------------------------------------------
def _qdq64(x_NK: torch.Tensor) -> torch.Tensor:
    """Activations as the V3 report quantizes them, written out: per token and group of 128 channels, s = amax / 448
    (fp32), x_q = x / s rounded to e4m3; returned dequantized in float64."""
    out = torch.empty(x_NK.shape, dtype=torch.float64)
    for g0 in range(0, x_NK.shape[1], 128):
        blk = x_NK[:, g0:g0 + 128].float()
        s = blk.abs().amax(dim=1, keepdim=True) / 448
        out[:, g0:g0 + 128] = (blk / s).to(E4M3).double() * s.double()
    return out


def _deq64(q_OI: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    out = q_OI.double()
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= s[i, j].double()
    return out


def test_block_quantization_is_v3s_recipe():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g) * torch.logspace(-3, 0, 300)  # ragged edge blocks, mixed magnitudes
    q, s = quantize_fp8(w)
    assert q.dtype == E4M3 and s.dtype == torch.float32 and s.shape == (2, 3)
    for i in range(2):
        for j in range(3):  # each block's largest magnitude maps to e4m3's largest finite value
            assert s[i, j] == w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max() / 448
    back = _deq64(q, s)
    torch.testing.assert_close(dequantize_fp8(q, s).double(), back, rtol=2**-24, atol=0)  # one fp32 rounding
    # e4m3 keeps 3 significant bits: within 2^-4 relative, or half the subnormal spacing (2^-10 of the scale)
    s_full = s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300].double()
    assert ((back - w.double()).abs() <= w.double().abs() * 2**-4 + s_full * 2**-10).all()


def test_activation_quantization_layout():
    x = torch.randn(5, 200)
    x[2] = 0.0  # an all-zero token quantizes to zeros, not NaN
    q, s = quantize_1x128(x)
    assert q.shape == (5, 200) and s.shape == (5, 2) and s.stride() == (1, 5)  # outer-dim-major, as _scaled_mm reads
    assert not q.float().isnan().any() and (q[2].float() == 0).all()
    deq = q.float() * s.repeat_interleave(128, 1)[:, :200]
    rows = [0, 1, 3, 4]  # (the written-out form divides 0 by 0 for the zero token)
    torch.testing.assert_close(deq[rows].double(), _qdq64(x[rows]), rtol=2**-24, atol=0)  # one fp32 rounding


def test_fp8_linear_equals_a_float64_product_of_its_quantized_operands():
    """Tight: the projection is exactly dequantize(W) @ quantize-dequantize(x), up to fp32 accumulation."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 320, generator=g) * torch.logspace(-2, 1, 320)  # channel groups of different scales
    w = torch.randn(200, 320, generator=g) * 0.05
    b = torch.randn(200, generator=g)
    q, s = quantize_fp8(w)
    got = Fp8Linear(q, s, b)(x)
    want = _qdq64(x) @ _deq64(q, s).t() + b.double()
    assert got.dtype == torch.float32 and got.shape == (7, 200)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5


def test_fp8_linear_is_near_the_unquantized_product():
    """Loose: e4m3 rounds x and W each to 3 significant bits (up to 2^-4 relative, about 2.5% RMS): the product
    moves by about 3.6% relative L2 on random data (measured), bound here at 6%."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 512, generator=g)
    w = torch.randn(384, 512, generator=g) * 512**-0.5
    y = F.linear(x, w)
    z = Fp8Linear(*quantize_fp8(w))(x)
    err = ((z - y).norm() / y.norm()).item()
    assert 0.01 < err < 0.06  # it does quantize, and no more than e4m3 must


def test_fused_moe_fp8_reference_against_a_float64_loop():
    """moe.fused_moe_fp8 (the CPU path) against the same MoE written token by token in float64 from the dequantized
    operands. Both round h to fp32 and quantize it, so an h element within an fp32 ulp of an e4m3 rounding boundary
    may land on either neighbour (one element off by <= 12%): the bound is relative L2 5e-3 (such a flip costs about
    1e-3 here), while a wrong scale or group costs >= 3e-2; against bf16 experts the error is e4m3's, ~5%."""
    g = torch.Generator().manual_seed(3)
    N, E, ns, K, D, F_ = 40, 9, 1, 2, 200, 160
    x = torch.randn(N, D, generator=g)
    # per-block magnitudes that differ, so that a scale read from the wrong block shows
    w13 = torch.randn(E, 2 * F_, D, generator=g) * D**-0.5 * torch.rand(E, 2 * F_, 1, generator=g).add(0.25)
    w2 = torch.randn(E, D, F_, generator=g) * F_**-0.5 * torch.rand(E, 1, F_, generator=g).add(0.25)
    q13, s13 = quantize_fp8(w13)
    q2, s2 = quantize_fp8(w2)
    idx = torch.rand(N, E - ns, generator=g).topk(K, dim=1).indices.int()
    wt = torch.rand(N, K, generator=g)
    got = moe.fused_moe_fp8(x, q13, s13, q2, s2, wt, idx, ns)
    want = torch.zeros(N, D, dtype=torch.float64)
    xq = _qdq64(x)
    for t in range(N):
        for j, e in enumerate(idx[t].tolist() + list(range(E - ns, E))):
            w13e = dequantize_fp8(q13[e], s13[e]).double()
            h = (F.silu(xq[t] @ w13e[:F_].t()) * (xq[t] @ w13e[F_:].t())).float()
            y = _qdq64(h[None])[0] @ dequantize_fp8(q2[e], s2[e]).double().t()
            want[t] += y * (wt[t, j].double() if j < K else 1.0)
    assert ((got.double() - want).norm() / want.norm()).item() < 5e-3
    bf = moe.fused_moe(x, dequantize_fp8(q13, s13), dequantize_fp8(q2, s2), wt, idx, ns)
    assert ((got - bf).norm() / bf.norm()).item() < 0.1


# ---- a V3-shaped FP8 checkpoint --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp8")
    src = write_source(tmp / "source", TINY_V3)
    return {"source": src, "fp8": write_fp8(src, tmp / "fp8")}


def test_the_written_checkpoint_has_v3s_names_dtypes_and_config(folders):
    cfg = json.loads((folders["fp8"] / "config.json").read_text())
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "weight_block_size": [128, 128]}
    source = load_file(folders["source"] / "model.safetensors")
    with safe_open(folders["fp8"] / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert keys - {k for k in keys if k.endswith("_scale_inv")} == set(source)  # the MTP layer (3) included
        assert "model.layers.3.eh_proj.weight" in keys
        n_fp8 = 0
        for k in sorted(source):
            t = f.get_tensor(k)
            if is_fp8_weight(k):
                n_fp8 += 1
                s = f.get_tensor(k + "_scale_inv")
                assert t.dtype == E4M3 and s.dtype == torch.float32
                assert s.shape == (-(-t.shape[0] // 128), -(-t.shape[1] // 128))
                torch.testing.assert_close(dequantize_fp8(t, s), source[k], rtol=2**-4, atol=s.max().item() * 2**-10)
            else:
                assert k + "_scale_inv" not in keys and torch.equal(t, source[k])
    # 4 layers (3 + MTP) x attention's q_a, q_b, kv_a, kv_b, o; the dense MLP's 3; 3 MoE layers x 9 experts x 3
    assert n_fp8 == 4 * 5 + 3 + 3 * 9 * 3


GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=5)
# Measured on this model (120 teacher-forced steps): FP8 moves the top-5 log-probabilities by 0.04 (median) and
# 0.21 (max); the two choices it changed had reference margins of 0.012 and 0.021; 96 steps have margins above 0.2.
CLEAR = 0.2  # a reference choice clearer than this (top-1 minus top-2 log-probability) must survive FP8
LOGPROB_TOL = 0.35  # FP8's log-probabilities of the reference's top tokens


def _engine(model) -> Engine:
    return Engine(model, EngineConfig(block_size=8, num_kv_blocks=512, max_batched_tokens=96), log=lambda *_: None)


def _fp8_engine(folder: Path, fp8: bool = True, block=(128, 128)) -> Engine:
    return _engine(InferenceModel.from_folder(folder, ModelArgs.from_hf_config(json.loads((folder / "config.json")
                                                                                           .read_text())),
                                              dtype=torch.float32, device="cpu", block=block, fp8=fp8))


def test_fp8_engine_against_the_dequantized_checkpoint(folders):
    """The FP8 folder served with its blocks kept (activations quantized per token, the plain-torch GEMMs) against the
    same folder dequantized on load (load_pretrained -> the bf16 path's math in fp32). FP8 quantizes activations
    too, so a next token the reference chooses by a hair may go either way: teacher-forced on the reference's
    continuations, every choice clearer than CLEAR is the same and the top-5 log-probabilities agree within
    LOGPROB_TOL; free-running, the greedy tokens are the same up to the first choice that is not clear."""
    ref = _engine(load_pretrained(folders["fp8"], dtype=torch.float32, device="cpu").eval())
    fp8 = _fp8_engine(folders["fp8"])
    layer = fp8.runner.model.layers[1]
    assert isinstance(layer.attn.q_b, Fp8Linear) and layer.mlp.w13_scale is not None
    ps = prompts()
    want = ref.generate(ps, GREEDY)
    prefixes = [p + r.output_ids[:t] for p, r in zip(ps, want) for t in range(GREEDY.max_tokens)]
    a, b = ref.generate(prefixes, ONE), fp8.generate(prefixes, ONE)
    clear = [ra.top_logprobs[0][0][1] - ra.top_logprobs[0][1][1] > CLEAR for ra in a]
    assert sum(clear) >= 0.7 * len(clear)  # the comparison covers most steps
    for ra, rb, c in zip(a, b, clear):
        if c:
            assert ra.output_ids == rb.output_ids
        mine = dict(rb.top_logprobs[0])
        diffs = [abs(lp - mine[t]) for t, lp in ra.top_logprobs[0] if t in mine]
        assert len(diffs) >= 3 and max(diffs) < LOGPROB_TOL
    got = fp8.generate(ps, GREEDY)
    for r, f in zip(want, got):
        gaps = [top[0][1] - top[1][1] for top in r.top_logprobs]
        n = next((t for t, gap in enumerate(gaps) if gap <= CLEAR), len(gaps))
        assert f.output_ids[:n + 1] == r.output_ids[:n + 1]  # the first unclear step's token may differ


def test_quantizing_a_bf16_folder_on_load_equals_the_written_fp8_folder(folders):
    """--quantization fp8 of the source folder (projections and experts quantized on load) holds the very e4m3 values
    and scales of the script's FP8 folder (the fused projections' parts are whole blocks here); MLA's kv_b differs
    (kept at the source's precision, where the FP8 folder's is its dequantized FP8), so the engines agree closely."""
    on_load = _fp8_engine(folders["source"], block=None)
    kept = _fp8_engine(folders["fp8"])
    assert "quantized to FP8 128x128 blocks on load" in on_load.runner.model.weights
    assert "kept in the checkpoint's FP8 blocks" in kept.runner.model.weights
    source = load_file(folders["source"] / "model.safetensors")
    for i, (x, y) in enumerate(zip(on_load.runner.model.layers, kept.runner.model.layers)):
        projections = [(x.attn.in_proj, y.attn.in_proj), (x.attn.q_b, y.attn.q_b), (x.attn.o, y.attn.o)]
        if i == 0:
            projections += [(x.mlp.gate_up, y.mlp.gate_up), (x.mlp.down, y.mlp.down)]
        else:
            for a, b in [(x.mlp.w13_EXD, y.mlp.w13_EXD), (x.mlp.w13_scale, y.mlp.w13_scale),
                         (x.mlp.w2_EDF, y.mlp.w2_EDF), (x.mlp.w2_scale, y.mlp.w2_scale)]:
                assert torch.equal(a.float(), b.float())
        for a, b in projections:
            assert torch.equal(a.w.float(), b.w.float()) and torch.equal(a.scale, b.scale)
        assert torch.equal(x.attn.kv_b_w, source[f"model.layers.{i}.self_attn.kv_b_proj.weight"])
    ps = prompts(4)
    for x, y in zip(on_load.generate(ps, ONE), kept.generate(ps, ONE)):
        mine = dict(y.top_logprobs[0])
        assert max(abs(lp - mine[t]) for t, lp in x.top_logprobs[0] if t in mine) < LOGPROB_TOL


def test_an_fp8_folder_loaded_dequantized_equals_load_pretrained(folders):
    """--quantization none (and auto on CPU): the sharded loader dequantizes exactly as load_pretrained does."""
    ref = _engine(load_pretrained(folders["fp8"], dtype=torch.float32, device="cpu").eval())
    deq = _fp8_engine(folders["fp8"], fp8=False)
    assert "float32" in deq.runner.model.weights
    ps = prompts(4)
    for x, y in zip(ref.generate(ps, GREEDY), deq.generate(ps, GREEDY)):
        assert x.output_ids == y.output_ids and x.logprobs == y.logprobs


@pytest.mark.parametrize("tp", [2, 4])
def test_each_ranks_share_is_its_slice_of_the_whole(folders, tp):
    """Layers built from rank r's slices (no process group needed: a Share is rank and tp) against the slices of the
    whole dequantized model. At tp 2 every cut falls on 128-row blocks, which are kept; at tp 4 the experts' 64-row
    shares and o_proj's 64 columns cut blocks and are dequantized instead -- still exactly the checkpoint's values."""
    whole = load_pretrained(folders["fp8"], dtype=torch.float32, device="cpu").state_dict()
    src = FolderWeights(folders["fp8"], ARGS, (128, 128))
    deq = lambda lin: lin.dequantized(torch.float32) if isinstance(lin, Fp8Linear) else lin.w  # noqa: E731
    for rank in range(tp):
        s = Share(src, rank, tp, torch.float32, torch.device("cpu"), fp8=True)
        cut = lambda t, per, dim=0: t.narrow(dim, rank * per, per)  # noqa: E731
        attn = LatentAttention(s, "layers.1", ARGS)
        p = "layers.1.self_attn."
        qk, v = 128, 64
        assert torch.equal(deq(attn.q_b), cut(whole[p + "q_b_proj.weight"], 4 // tp * qk))
        assert torch.equal(deq(attn.o), cut(whole[p + "o_proj.weight"], 4 // tp * v, 1))
        assert torch.equal(attn.kv_b_w, cut(whole[p + "kv_b_proj.weight"], 4 // tp * (64 + v)))
        assert torch.equal(deq(attn.in_proj), torch.cat([whole[p + "q_a_proj.weight"],
                                                         whole[p + "kv_a_proj_with_mqa.weight"]]))
        mlp = DenseMLP(s, "layers.0")
        per = 512 // tp
        assert torch.equal(deq(mlp.gate_up), torch.cat([cut(whole["layers.0.mlp.gate_proj.weight"], per),
                                                        cut(whole["layers.0.mlp.up_proj.weight"], per)]))
        assert torch.equal(deq(mlp.down), cut(whole["layers.0.mlp.down_proj.weight"], per, 1))
        m = MoELayer(s, "layers.1", ARGS)
        per = 256 // tp
        ex, sh = "layers.1.mlp.experts.", "layers.1.mlp.shared_experts."
        shared = torch.cat([cut(whole[sh + "gate_proj.weight"], per), cut(whole[sh + "up_proj.weight"], per)])
        w13 = torch.cat([torch.cat([cut(whole[ex + "gate_proj"], per, 1), cut(whole[ex + "up_proj"], per, 1)], 1),
                         shared[None]])
        w2 = torch.cat([cut(whole[ex + "down_proj"], per, 2), cut(whole[sh + "down_proj.weight"], per, 1)[None]])
        fp8_experts = m.w13_scale is not None
        assert fp8_experts == (tp == 2)
        assert torch.equal(dequantize_fp8(m.w13_EXD, m.w13_scale) if fp8_experts else m.w13_EXD, w13)
        assert torch.equal(dequantize_fp8(m.w2_EDF, m.w2_scale) if fp8_experts else m.w2_EDF, w2)
        assert isinstance(attn.o, Fp8Linear) == (tp == 2) and isinstance(attn.q_b, Fp8Linear)
        if tp == 4:
            assert "dequantized" in s.summary()


# ---- bad checkpoints and flags: one line each -------------------------------------------------------------------
def _edited(folders, tmp_path, edit_tensors=None, edit_config=None) -> Path:
    out = tmp_path / "edited"
    shutil.copytree(folders["fp8"], out)
    if edit_tensors:
        tensors = load_file(out / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    if edit_config:
        cfg = json.loads((out / "config.json").read_text())
        edit_config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def _both_refuse(folder: Path, match: str) -> None:
    with pytest.raises(UserError, match=match):
        load_pretrained(folder, dtype=torch.float32)
    with pytest.raises(UserError, match=match):
        InferenceModel.from_folder(folder, ARGS, dtype=torch.float32, device="cpu", block=(128, 128), fp8=True)


def test_a_missing_or_misshaped_scale_is_named(folders, tmp_path):
    key = "model.layers.1.self_attn.q_b_proj.weight"
    folder = _edited(folders, tmp_path, lambda t: t.pop(key + "_scale_inv"))
    _both_refuse(folder, f"'{key}' is float8_e4m3fn but its scale '{key}_scale_inv' is missing")
    shutil.rmtree(folder)
    folder = _edited(folders, tmp_path, lambda t: t.__setitem__(key + "_scale_inv", torch.ones(3, 1)))
    _both_refuse(folder, r"has shape \(3, 1\); \(512, 128\) in blocks of \[128, 128\] needs \(4, 1\)")


@pytest.mark.parametrize("quant,match", [
    ({"quant_method": "awq"}, "quant_method 'awq'"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "activation_scheme"),
    ({"quant_method": "fp8", "weight_block_size": 128}, "weight_block_size 128: expected two positive integers"),
])
def test_quantization_configs_not_read_are_refused(folders, tmp_path, quant, match):
    folder = _edited(folders, tmp_path, edit_config=lambda c: c.__setitem__("quantization_config", quant))
    with pytest.raises(UserError, match=match):
        load_pretrained(folder, dtype=torch.float32)


def test_other_block_sizes_load_dequantized_and_refuse_fp8(folders, tmp_path):
    """A checkpoint of 64 x 64 blocks: served dequantized (as load_pretrained reads it); --quantization fp8 is one
    line (the FP8 GEMMs take 128 x 128)."""
    from paraseek.infer.build import weight_format
    from paraseek.infer.load import resolve_source

    source = load_file(folders["source"] / "model.safetensors")
    out = tmp_path / "b64"
    shutil.copytree(folders["fp8"], out)
    tensors = {}
    for k, t in source.items():
        if is_fp8_weight(k):
            tensors[k], tensors[k + "_scale_inv"] = quantize_fp8(t, (64, 64))
        else:
            tensors[k] = t
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    (out / "config.json").write_text(json.dumps(cfg))
    src = resolve_source(str(out))
    with pytest.raises(UserError, match=r"\[64, 64\] blocks and the FP8 GEMMs take \[128, 128\]"):
        weight_format("fp8", src, "cpu")
    fp8, block, why = weight_format("auto", src, "cpu")
    assert not fp8 and block == (64, 64) and "dequantized" in why
    ref = _engine(load_pretrained(out, dtype=torch.float32, device="cpu").eval())
    deq = _fp8_engine(out, fp8=False, block=block)
    ps = prompts(3)
    for x, y in zip(ref.generate(ps, GREEDY), deq.generate(ps, GREEDY)):
        assert x.output_ids == y.output_ids and x.logprobs == y.logprobs


def test_fp8_on_a_gpu_without_fp8_is_refused(monkeypatch):
    from paraseek.infer import fp8, ranks

    monkeypatch.setattr(fp8, "has_fp8", lambda device: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    ns = argparse.Namespace(quantization="fp8", dp=1, tp=1)
    with pytest.raises(UserError, match=r"A100-SXM4-80GB \(sm80\) has no FP8 tensor cores"):
        ranks.check_parallel(ns, ARGS, "cuda")


def _paraseek(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, "-m", "paraseek", *argv], capture_output=True, text=True, env=env,
                          timeout=300)


def test_cli_refusals_are_one_line(folders, tmp_path):
    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    key = "model.layers.2.mlp.experts.5.down_proj.weight"
    folder = _edited(folders, tmp_path, lambda t: t.pop(key + "_scale_inv"))
    r = _paraseek("generate", str(folder), "--device", "cpu", "--prompts", str(prompts_file), "--max-new-tokens", "2")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert [line for line in r.stderr.splitlines() if "error" in line] == [
        f"paraseek: error: model.safetensors: '{key}' is float8_e4m3fn but its scale '{key}_scale_inv' is missing; "
        "the download may be incomplete"]
    script = [sys.executable, str(ROOT / "scripts" / "write_fp8_checkpoint.py")]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    for argv, match in [(["tiny-moe", str(tmp_path / "a")], "a preset has no weights to quantize"),
                        ([str(folders["fp8"]), str(tmp_path / "b")], "is already quantized"),
                        ([str(folders["source"]), str(tmp_path / "c"), "--layers", "9"], "--layers must be in 1..3")]:
        r = subprocess.run(script + argv, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 2 and "Traceback" not in r.stderr and match in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
