"""Tiny models for the FP8 and sharded-loading tests: a DeepSeek-V3-shaped config whose tp 2 cuts fall on 128-row
FP8 blocks, random weights chosen so that the model is well-conditioned, and its FP8 folder written by
scripts/write_fp8_checkpoint.py (V3's names, dtypes and quantization_config).

Well-conditioned: FP8 rounds weights and activations to 3 significant bits (about 3% relative), and a random model
with unit-gain projections, near-tied routing and sharp attention amplifies any such perturbation (1% weight noise
moved its logits by 10-20%), so no comparison of FP8 with bf16 could be made on it. Here the projections have gain
0.5 (std 0.5 / sqrt(fan-in)), the router 4 (its sigmoid scores are clear, so a small perturbation rarely swaps an
expert), the head 3 (peaked next-token distributions): 1% weight noise moves the logits by 0.5%, while the layers
still move them by 24% relative L2 (and change 35% of the argmaxes) against a model whose layers add nothing -- a
wrong layer cannot hide in the tolerance."""

import importlib.util
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# V3's architecture in miniature: MLA with q_lora, a dense first layer, sigmoid noaux_tc routing with groups and a
# bias, a shared expert, YaRN, one MTP layer. Every dim tp 2 cuts is a multiple of 128 per rank: q_b 4 x 128 rows,
# kv_b 4 x 128, o_proj 4 x 64 columns, the MLP 512, the experts 256.
TINY_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 300, "hidden_size": 256, "intermediate_size": 512,
    "moe_intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": 128, "kv_lora_rank": 128,
    "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
# A dense GQA model (Qwen2-style biases) of the same width: 8 query heads of 64, 2 kv heads, MLP 512.
TINY_GQA = {
    "model_type": "qwen2", "vocab_size": 300, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "use_sliding_window": False,
}


def write_source(folder: Path, cfg: dict, seed: int = 0) -> Path:
    """An fp32 HF folder of `cfg` with the well-conditioned random weights above."""
    from paraseek.models import ModelArgs, build_model, save_pretrained

    torch.manual_seed(seed)
    model = build_model(ModelArgs.from_hf_config(cfg), "cpu", torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in n:
                p.copy_(torch.randn_like(p))
            elif n == "lm_head.weight":
                p.copy_(torch.randn_like(p) * 3 / p.shape[-1] ** 0.5)
            elif n.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p) * 4 / p.shape[-1] ** 0.5)
            elif p.dim() >= 2:
                p.copy_(torch.randn_like(p) * 0.5 / p.shape[-1] ** 0.5)
            else:  # biases
                p.copy_(torch.randn_like(p) * 0.1)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    save_pretrained(model, folder)
    return folder


def write_fp8(src: Path, out: Path, *extra: str) -> Path:
    """scripts/write_fp8_checkpoint.py SRC OUT, in this process."""
    spec = importlib.util.spec_from_file_location("write_fp8_checkpoint", ROOT / "scripts" / "write_fp8_checkpoint.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([str(src), str(out), "--device", "cpu", *extra]) == 0
    return out


def prompts(n: int = 6, seed: int = 1, vocab: int = 300) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [3, 17, 40, 9, 25, 2, 31, 12][:n]
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]


def config_of(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())
