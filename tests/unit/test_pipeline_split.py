"""The pipeline split: stages cut by the planner's cost per token, not by layer count."""

import pytest
import torch

from paraseek.models import resolve_model
from paraseek.models.args import ModelArgs, preset_config
from paraseek.parallel.pipeline import build_stage, describe, rank_stages, stage_specs, whole_model_view
from paraseek.planner.memory import layer_cost, model_terms, partition


def _specs(args: ModelArgs, seq_len: int, n_stages: int):
    """The stages train/build.py cuts: the planner's partition and per-layer costs."""
    t = model_terms(args, seq_len)
    return stage_specs(partition(t, n_stages), [layer_cost(t, i) for i in range(args.n_layers)])


def test_deepseek_v3_16_stages_within_10_percent_of_the_mean_and_better_than_uniform():
    args, _, _ = resolve_model("deepseek-v3")
    specs = _specs(args, 4096, 16)
    costs = [s.cost for s in specs]
    mean = sum(costs) / len(costs)
    assert max(costs) <= 1.10 * mean, max(costs) / mean
    # Every layer in exactly one stage, in order; embedding first, head last.
    assert [i for s in specs for i in s.layers] == list(range(args.n_layers))
    assert specs[0].first and specs[-1].last and not any(s.first or s.last for s in specs[1:-1])
    # A uniform split by layer count (61 layers: 3 or 4 per stage, the head on the last) is far worse: the stage
    # with 4 MoE layers and the 129k-vocab head costs about 1.3x the mean.
    t = model_terms(args, 4096)
    bounds = [round(k * args.n_layers / 16) for k in range(17)]
    uniform = [sum(layer_cost(t, i) for i in range(bounds[k], bounds[k + 1])) for k in range(16)]
    assert sum(uniform) == pytest.approx(sum(costs))
    print(f"V3 16 stages: cost-balanced max/mean {max(costs) / mean:.3f}, uniform {max(uniform) / mean:.3f}")
    assert max(uniform) / mean > 1.25
    assert max(costs) < max(uniform)


def test_the_head_moves_layers_off_the_last_stage():
    args, _, _ = resolve_model("deepseek-llm-7b")  # 30 layers, 102k vocabulary
    specs = _specs(args, 4096, 4)
    sizes = [len(s.layers) for s in specs]
    assert sum(sizes) == 30 and sizes[-1] < max(sizes)


def test_rank_stages_looped_and_v_shape():
    assert [rank_stages(r, 2, 2, "Interleaved1F1B") for r in range(2)] == [[0, 2], [1, 3]]
    assert [rank_stages(r, 2, 2, "ZBVZeroBubble") for r in range(2)] == [[0, 3], [1, 2]]
    assert [rank_stages(r, 4, 1, "1F1B") for r in range(4)] == [[0], [1], [2], [3]]


def test_stages_keep_the_whole_models_names():
    args = ModelArgs.from_hf_config({**preset_config("tiny-moe"), "num_hidden_layers": 4})
    specs = _specs(args, 64, 4)
    parts = [build_stage(args, specs[s]) for s in (0, 2)]  # pp rank 0 of an interleaved 2 x 2 pipeline
    assert parts[0].embed_tokens is not None and parts[0].norm is None and parts[0].lm_head is None
    assert parts[1].embed_tokens is None and parts[1].norm is None
    view = whole_model_view(args, parts)
    names = {n for n, _ in view.named_parameters()}
    assert {n.split(".")[1] for n in names if n.startswith("layers.")} == {"0", "2"}
    assert all(any(p is q for q in view.parameters()) for part in parts for p in part.parameters())
    text = describe(specs, 2, 2, "Interleaved1F1B")
    assert "stage 3 (pp rank 1)" in text and "norm + head + loss" in text


def test_a_middle_stage_forwards_hidden_states():
    args = ModelArgs.from_hf_config({**preset_config("tiny-dense"), "num_hidden_layers": 3})
    torch.manual_seed(0)
    whole = build_stage(args, _specs(args, 16, 1)[0]).to_empty(device="cpu")
    whole.init_weights(device=torch.device("cpu"))
    specs = _specs(args, 16, 3)
    parts = [build_stage(args, s).to_empty(device="cpu") for s in specs]
    sd = whole.state_dict()
    for part in parts:
        part.load_state_dict({k: sd[k] for k in part.state_dict()})
        part.init_buffers(torch.device("cpu"))
    ids = torch.randint(0, args.vocab_size, (2, 16))
    h = ids
    for part in parts:
        h = part(h)
    torch.testing.assert_close(h, whole(ids))
