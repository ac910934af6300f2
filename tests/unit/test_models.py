"""Presets, exact counts, checkpoint I/O (sharded, MTP, FP8), bad input, MoE math and meta-device init."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from paraseek.errors import UserError
from paraseek.models import (
    ModelArgs, build_model, load_pretrained, param_counts, preset_config, preset_names, resolve_model, save_pretrained,
)
from paraseek.models.deepseek import MoE, grouped_mm
from paraseek.models.hf import dequantize_fp8

from numerics import normal_init

PUBLISHED = ["deepseek-llm-7b", "deepseek-llm-67b", "deepseek-v2-lite", "deepseek-v2", "deepseek-v3",
             "deepseek-r1-distill-qwen-1.5b", "deepseek-r1-distill-qwen-7b", "deepseek-r1-distill-qwen-14b",
             "deepseek-r1-distill-qwen-32b", "deepseek-r1-distill-llama-8b", "deepseek-r1-distill-llama-70b"]


def test_all_presets_exist():
    assert set(PUBLISHED + ["tiny-dense", "tiny-moe"]) <= set(preset_names())


@pytest.mark.parametrize("name", PUBLISHED + ["tiny-dense", "tiny-moe"])
def test_total_params_equal_transformers_meta_model(name):
    transformers = pytest.importorskip("transformers")
    cfg = preset_config(name)
    hf_cfg = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "auto_map"})
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    hf_total = sum(p.numel() for p in hf_model.parameters())
    args = ModelArgs.from_hf_config(cfg)
    counts = param_counts(args)
    assert counts.total == hf_total
    # our own module tree agrees with the closed form (MTP modules are counted apart)
    assert sum(p.numel() for p in build_model(args).parameters()) == counts.total + counts.mtp


@pytest.mark.parametrize("name,published_active", [("deepseek-v3", 37e9), ("deepseek-v2", 21e9), ("deepseek-v2-lite", 2.4e9)])
def test_active_params_match_published(name, published_active):
    # The papers quote activated parameters without the input embedding (a lookup, not compute).
    c = param_counts(ModelArgs.from_hf_config(preset_config(name)))
    assert abs(c.active - c.embedding - published_active) / published_active < 0.05


def test_v3_preset_values_are_the_hub_ones():
    a = ModelArgs.from_hf_config(preset_config("deepseek-v3"))
    assert (a.dim, a.n_layers, a.n_routed_experts, a.n_activated_experts, a.n_group, a.topk_group) == (7168, 61, 256, 8, 8, 4)
    assert (a.q_lora_rank, a.kv_lora_rank, a.score_func, a.topk_method, a.routed_scaling_factor) == (1536, 512, "sigmoid", "noaux_tc", 2.5)
    assert (a.rope_type, a.rope_factor, a.rope_mscale_all_dim, a.n_mtp_layers, a.first_k_dense_replace) == ("yarn", 40, 1.0, 1, 3)


def test_hf_config_round_trip():
    for name in preset_names():
        a = ModelArgs.from_hf_config(preset_config(name))
        assert ModelArgs.from_hf_config(a.to_hf_config()) == a


# ---- checkpoint I/O ----------------------------------------------------------------------------------------------------
def _tiny(name="tiny-moe", **changes):
    args = ModelArgs.from_hf_config(preset_config(name)).replace(**changes)
    torch.manual_seed(0)
    return build_model(args, "cpu", torch.float32)


def test_sharded_save_and_load_give_the_same_logits(tmp_path):
    model = _tiny()
    save_pretrained(model, tmp_path, max_shard_bytes=200_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = load_pretrained(tmp_path, dtype=torch.float32, device="cpu")
    ids = torch.randint(0, 2048, (2, 16))
    torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)


def test_mtp_layer_is_kept_through_save_and_load(tmp_path):
    model = _tiny(n_mtp_layers=1)
    save_pretrained(model, tmp_path)
    keys = set(load_file(tmp_path / "model.safetensors"))
    n = model.args.n_layers
    for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
              "embed_tokens.weight", "self_attn.kv_b_proj.weight", "mlp.experts.3.up_proj.weight"):
        assert f"model.layers.{n}.{k}" in keys
    loaded = load_pretrained(tmp_path, dtype=torch.float32, device="cpu")
    assert loaded.args.n_mtp_layers == 1
    for (name, a), (_, b) in zip(model.mtp.state_dict().items(), loaded.mtp.state_dict().items()):
        assert torch.equal(a, b), name


def test_fp8_block_quantized_weights_are_dequantized(tmp_path):
    model = _tiny("tiny-dense")
    save_pretrained(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.mlp.gate_proj.weight"  # [176, 64]: blocks of 128 cover it with a ragged edge
    w = tensors[name]
    # one scale per 128x128 block, chosen as DeepSeek does: the block's max maps to e4m3's max (448)
    scale_inv = torch.stack([w[:128].abs().max(), w[128:].abs().max()]).view(2, 1) / 448
    expanded = scale_inv.repeat_interleave(128, 0)[: w.shape[0]]
    tensors[name] = (w / expanded).to(torch.float8_e4m3fn)
    tensors[name + "_scale_inv"] = scale_inv
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_pretrained(tmp_path, dtype=torch.float32, device="cpu")
    expect = tensors[name].float() * expanded
    torch.testing.assert_close(loaded.layers["0"].mlp.gate_proj.weight, expect, rtol=0, atol=0)
    # e4m3 keeps ~3 significant bits: the dequantized weight is the original within that precision
    torch.testing.assert_close(expect, w, rtol=0.07, atol=w.abs().max().item() * 2**-9)
    assert dequantize_fp8(tensors[name], scale_inv).shape == w.shape


def test_missing_and_misshaped_tensors_are_named(tmp_path):
    save_pretrained(_tiny("tiny-dense"), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="lacks layers.1.self_attn.k_proj.weight"):
        load_pretrained(tmp_path, dtype=torch.float32)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"k_proj.weight' has shape \(3, 3\)"):
        load_pretrained(tmp_path, dtype=torch.float32)


def test_bad_model_sources(tmp_path):
    with pytest.raises(UserError, match="unknown model 'deepseek-v9'"):
        resolve_model("deepseek-v9")
    with pytest.raises(UserError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(UserError, match="unsupported model_type 'gpt2'"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(preset_config("tiny-dense")))
    with pytest.raises(UserError, match="no \\*.safetensors"):
        load_pretrained(tmp_path)


# ---- MoE math ---------------------------------------------------------------------------------------------------------
def test_grouped_mm_fallback_equals_torch_grouped_mm():
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(int(counts.sum()), 16)
    w = torch.randn(4, 8, 16)
    ref = torch.cat([x[:3] @ w[0].T, x[3:8] @ w[2].T, x[8:] @ w[3].T])
    torch.testing.assert_close(grouped_mm(x, w, counts, use_grouped=False), ref)
    if hasattr(torch, "_grouped_mm"):
        torch.testing.assert_close(grouped_mm(x, w, counts, use_grouped=True), ref, rtol=1e-5, atol=1e-5)


def test_moe_equals_a_per_token_reference():
    """The sorted grouped computation against the definition: y_t = sum_k w_tk * expert_k(x_t) + shared(x_t)."""
    args = ModelArgs.from_hf_config(preset_config("tiny-moe"))
    torch.manual_seed(0)
    moe = normal_init(MoE(args), 0.2)
    x = torch.randn(2, 5, args.dim)
    weights, idx, _ = moe.gate(x.view(-1, args.dim))
    e = moe.experts
    ref = []
    for t, x_t in enumerate(x.view(-1, args.dim)):
        y = moe.shared_experts(x_t)
        for k in range(args.n_activated_experts):
            j = idx[t, k]
            y = y + weights[t, k] * (torch.nn.functional.silu(e.gate_proj[j] @ x_t) * (e.up_proj[j] @ x_t)) @ e.down_proj[j].T
        ref.append(y)
    torch.testing.assert_close(moe(x).view(-1, args.dim), torch.stack(ref), rtol=1e-4, atol=1e-5)  # fp32, summation order differs
    assert moe.tokens_per_expert.sum() == 10 * args.n_activated_experts


def test_meta_build_allocates_nothing_and_init_fills_everything():
    args = ModelArgs.from_hf_config(preset_config("deepseek-v3"))
    model = build_model(args)  # 671B parameters: only possible because nothing is allocated
    assert all(p.is_meta for p in model.parameters())
    # NaN everywhere first, so that a tensor init_weights misses stays NaN (to_empty memory may happen to be zeros)
    tiny = build_model(ModelArgs.from_hf_config({**preset_config("tiny-moe"), "num_nextn_predict_layers": 1}))
    tiny.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*tiny.parameters(), *tiny.buffers()]:
            t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)
    tiny.init_weights(device=torch.device("cpu"), seed=0)
    for name, t in [*tiny.named_parameters(), *tiny.named_buffers()]:
        assert torch.isfinite(t).all() and (t.is_floating_point() or (t >= 0).all()), name
    assert any(n.startswith("mtp.") for n, _ in tiny.named_parameters())


def test_init_is_per_tensor_and_reproducible():
    """Each tensor from its own (seed, name) generator: the same seed gives the same model, another seed another
    one, and a tensor's values do not depend on which other tensors exist (a pipeline stage draws what one process
    draws for its layers)."""
    args = ModelArgs.from_hf_config(preset_config("tiny-moe"))
    a, b, c = (build_model(args) for _ in range(3))
    for model, seed in ((a, 5), (b, 5), (c, 6)):
        model.to_empty(device="cpu")
        model.init_weights(device=torch.device("cpu"), seed=seed)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.layers["0"].self_attn.kv_b_proj.weight, c.layers["0"].self_attn.kv_b_proj.weight)
    stage = build_model(args)
    del stage.layers["0"]
    stage.to_empty(device="cpu")
    stage.init_weights(device=torch.device("cpu"), seed=5)
    assert torch.equal(stage.layers["2"].mlp.experts.up_proj, a.layers["2"].mlp.experts.up_proj)
    # the residual scaling: output projections start smaller than the others
    assert a.layers["1"].mlp.experts.down_proj.std() < 0.5 * a.layers["1"].mlp.experts.up_proj.std()
