"""A DeepSeek MoE block compiles as one graph (fullgraph=True: no graph break, no data-dependent shape) on the path the
GPU runs -- torch._grouped_mm, selective checkpointing, the V2 balance loss -- and computes what eager computes.

A graph break inside a checkpointed block makes torch.compile run that block eagerly under the Python-level
checkpoint policy, which is what made the V2-Lite shape host-bound on H200 (BENCHMARKS.md). The aot_eager backend
traces forward and backward like inductor does, without generating kernels (seconds on CPU)."""

import pytest
import torch

from paraseek.models import build_model
from paraseek.models.args import ModelArgs, preset_config
from paraseek.models.deepseek import MoE
from paraseek.parallel.parallelize import apply_activation_checkpointing
from paraseek.parallel.expert import enable_balance_loss

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")


def _v2_block(ac: str):
    cfg = {**preset_config("tiny-moe"), "model_type": "deepseek_v2", "scoring_func": "softmax",
           "topk_method": "greedy", "n_group": 1, "topk_group": 1, "aux_loss_alpha": 0.01, "seq_aux": True,
           "q_lora_rank": None}
    torch.manual_seed(0)
    model = build_model(ModelArgs.from_hf_config(cfg), "cpu", torch.bfloat16)
    for m in model.modules():
        if isinstance(m, MoE):
            m.use_grouped_mm = True  # the GPU's path (torch 2.13 runs it on CPU too)
    assert enable_balance_loss(model) == 0.01
    apply_activation_checkpointing(model, ac)
    cos, sin = (t.to(torch.bfloat16) for t in model.rope_cos_sin(16, torch.device("cpu")))
    block = model.layers["1"]
    moe = next(m for m in block.modules() if isinstance(m, MoE))
    return block, moe, cos, sin


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_moe_block_compiles_as_one_graph_and_matches_eager(ac):
    block, moe, cos, sin = _v2_block(ac)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)

    def run(fn):
        block.zero_grad(set_to_none=True)
        moe.tokens_per_expert.zero_()
        xx = x.clone().requires_grad_(True)
        y = fn(xx, cos, sin)
        (y.float() ** 2).sum().backward()
        return y.detach(), xx.grad, moe.gate.weight.grad.clone(), moe.tokens_per_expert.clone()

    eager = run(block)
    compiled = run(torch.compile(block, fullgraph=True, backend="aot_eager"))
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert int(eager[3].sum()) == 2 * 16 * moe.top_k  # the counts were written back by the compiled graph
