"""The planner's price of packed rows with document masks (planner/memory.py: document_mask_bytes) against the
tensors the model really builds for them, and where it enters a plan's memory."""

import torch

from paraseek.models import build_model, resolve_model
from paraseek.models.args import ModelArgs, preset_config
from paraseek.planner.memory import document_mask_bytes
from paraseek.planner.plan import Plan, make_cluster
from paraseek.planner.search import evaluate


def test_document_mask_bytes_are_the_tensors_the_model_builds():
    """Positions and document ids (int64), the per-token cos/sin in bf16 (models/deepseek.py rope_cos_sin), and a
    FlexAttention BlockMask for the same rows -- built on the CPU here; CUDA builds the same tables."""
    from torch.nn.attention.flex_attention import create_block_mask

    args = ModelArgs.from_hf_config({**preset_config("tiny-dense"), "max_position_embeddings": 4096})
    B, T = 2, 384
    positions = torch.cat([torch.arange(100), torch.arange(T - 100)]).repeat(B, 1)
    doc = (positions == 0).cumsum(1)
    model = build_model(args)  # meta: only the RoPE buffer is used
    model.rope_inv_freq = torch.ones(args.rope_dim // 2)
    cos, sin = (c.to(torch.bfloat16) for c in model.rope_cos_sin(T, torch.device("cpu"), positions))
    mask = create_block_mask(lambda b, h, q, kv: (doc[b, q] == doc[b, kv]) & (q >= kv), B, None, T, T, device="cpu")
    tables = [t for t in (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
                          mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices)]
    measured = sum(t.numel() * t.element_size() for t in [positions, doc, cos, sin, *tables])
    assert document_mask_bytes(args, T) * B * T == measured


def test_document_masks_add_their_bytes_to_the_activations_and_padding_adds_none():
    args, _, _ = resolve_model("deepseek-r1-distill-qwen-1.5b")
    c = make_cluster("H200", 8)
    acts = {mask: evaluate(args, c, Plan(dp_shard=8, micro_batch_size=2, document_mask=mask), 4096, 64,
                           with_time=False).memory.items["activations"] for mask in (False, True)}
    assert acts[True] - acts[False] == 2 * 4096 * document_mask_bytes(args, 4096)
    assert acts[True] - acts[False] < 0.01 * acts[False]  # a few hundred bytes per token against ~100 KB
