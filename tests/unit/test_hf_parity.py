"""Our model against transformers' implementations on tiny random configs, both directions, fp32:
HF save -> paraseek load, and paraseek save -> transformers load. Logits within 1e-4 relative."""

import json

import pytest
import torch

from numerics import rel_error
from paraseek.models import ModelArgs, build_model, load_pretrained, preset_config, save_pretrained

_BASE_DENSE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)
_BASE_MLA = dict(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=16, n_shared_experts=2, n_routed_experts=8, num_experts_per_tok=3,
                 first_k_dense_replace=1, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)
_YARN = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
         "mscale": 0.707, "mscale_all_dim": 0.707}

VARIANTS = {
    "llama-mha": dict(_BASE_DENSE, model_type="llama", num_key_value_heads=4),
    "llama-gqa-llama3rope": dict(
        _BASE_DENSE, model_type="llama", num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}),
    "qwen2-bias-tied": dict(_BASE_DENSE, model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=True,
                            use_sliding_window=False),
    "v2-greedy-yarn": dict(_BASE_MLA, model_type="deepseek_v2", q_lora_rank=None, topk_method="greedy",
                           scoring_func="softmax", routed_scaling_factor=1.0, norm_topk_prob=False, rope_scaling=_YARN),
    "v2-group-limited": dict(_BASE_MLA, model_type="deepseek_v2", q_lora_rank=24, topk_method="group_limited_greedy",
                             scoring_func="softmax", n_group=4, topk_group=2, routed_scaling_factor=16.0,
                             norm_topk_prob=False),
    "v3-noaux-yarn": dict(_BASE_MLA, model_type="deepseek_v3", q_lora_rank=24, topk_method="noaux_tc",
                          scoring_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                          norm_topk_prob=True, rope_scaling=dict(_YARN, mscale=1.0, mscale_all_dim=1.0),
                          num_nextn_predict_layers=0),
}


def _hf_model(cfg: dict):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(**cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # random everything, norms and the routing bias included, so each tensor matters
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" not in name else 0.1) + (1.0 if "norm" in name else 0.0))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn_like(b) * 0.1)
    return model


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_hf_to_paraseek(variant, tmp_path):
    hf = _hf_model(VARIANTS[variant])
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, dtype=torch.float32, device="cpu").eval()
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got = ours(ids)
    assert got.shape == ref.shape
    assert rel_error(got, ref) < 1e-4


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_paraseek_to_hf(variant, tmp_path):
    args = ModelArgs.from_hf_config(VARIANTS[variant])
    torch.manual_seed(0)
    ours = build_model(args, "cpu", torch.float32).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for m in ours.modules():
            if getattr(m, "e_score_correction_bias", None) is not None:
                m.e_score_correction_bias.copy_(torch.randn_like(m.e_score_correction_bias) * 0.1)
    save_pretrained(ours, tmp_path)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got = ours(ids)
    assert rel_error(got, ref) < 1e-4


def test_transformers5_rope_parameters_config_reads_the_same():
    transformers = pytest.importorskip("transformers")
    hub = VARIANTS["v3-noaux-yarn"]
    written_by_transformers = transformers.AutoConfig.for_model(**hub).to_dict()
    assert "rope_parameters" in written_by_transformers
    assert ModelArgs.from_hf_config(written_by_transformers).replace(bos_token_id=None, eos_token_id=None) == \
        ModelArgs.from_hf_config(hub).replace(bos_token_id=None, eos_token_id=None)


def test_saved_checkpoint_has_hub_per_expert_names(tmp_path):
    args = ModelArgs.from_hf_config(preset_config("tiny-moe"))
    save_pretrained(build_model(args, "cpu", torch.float32), tmp_path)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in keys
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in keys
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "deepseek_v3"
