"""The planner's multi-token prediction (`paraseek plan --mtp-layers D`): the MTP modules' parameters against the
training model's, their model states under each sharding, the activations they keep against what autograd saves,
their FLOPs against a hand count, the pipeline rank that holds them, and the CLI's line and JSON."""

import json
import weakref

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from paraseek.errors import UserError
from paraseek.models import build_model, resolve_model
from paraseek.planner import Plan, evaluate, make_cluster, model_state_bytes
from paraseek.planner.memory import (FP32, mtp_blocks, mtp_module_activation_bytes, mtp_module_params, model_terms,
                                     rank_shares)
from paraseek.planner.search import mtp_cost
from paraseek.models.weights import held_mtp_modules
from paraseek.train.mtp import run_args
from plan_cli import run_plan_cli


def model(name: str, **changes):
    return resolve_model(name)[0].replace(**changes)


def mtp_module_of_training_model(args):
    """The first MTP module of the model `paraseek train --mtp-layers 1` builds (meta device)."""
    return build_model(run_args(args, held_mtp_modules(args), 1), "meta").mtp[0]


def split_by_tp(module) -> tuple[int, int, int]:
    """(whole on every tp rank, divided by tp, routed experts) of a module's parameters, from their names as
    parallel/tensor.py shards them: norms, the router, MLA's latent down-projections and the MTP module's eh_proj
    are replicated (eh_proj and the norms run on this rank's positions)."""
    whole = split = experts = 0
    for name, p in module.named_parameters():
        if ".experts." in name and "shared" not in name:
            experts += p.numel()
        elif "norm" in name or name.endswith("gate.weight") or "q_a_proj" in name or "kv_a_proj" in name \
                or name.startswith("eh_proj"):
            whole += p.numel()
        else:
            split += p.numel()
    return whole, split, experts


def planner_mtp_params(args, seq_len: int = 256) -> int:
    (block,) = mtp_blocks(model_terms(args, seq_len), 1)
    return block.params_split + block.params_whole + block.params_experts + mtp_module_params(args)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe", "deepseek-v3"])
def test_mtp_parameters_match_the_training_model(name):
    a = model(name)
    module = mtp_module_of_training_model(a)
    assert planner_mtp_params(a) == sum(p.numel() for p in module.parameters())
    # the same module on the last (only) rank: its share grows by exactly these parameters, experts apart
    t = model_terms(a, 256)
    with_mtp, without = rank_shares(t, 1, 1, 1, 1, "none", 1)[0], rank_shares(t, 1, 1, 1, 1, "none")[0]
    whole, split, experts = split_by_tp(module)
    assert with_mtp.dense - without.dense == whole + split
    assert with_mtp.experts - without.experts == experts


@pytest.mark.parametrize("name,tp,dp_shard,ep", [("tiny-dense", 1, 2, 1), ("tiny-dense", 2, 1, 1),
                                                  ("tiny-moe", 2, 2, 1), ("tiny-moe", 1, 4, 2)])
def test_model_states_grow_by_the_mtp_modules_as_they_are_sharded(name, tp, dp_shard, ep):
    """16 B per parameter (fp32 params and grads, two AdamW moments) of the MTP module this rank owns: the block
    sharded as the main ones, eh_proj and the norms whole on every tp rank, routed experts over ep, all over
    dp_shard (FSDP2)."""
    a = model(name)
    plan = Plan(tp=tp, dp_shard=dp_shard, ep=ep)
    whole, split, experts = split_by_tp(mtp_module_of_training_model(a))
    grown = (model_state_bytes(a, plan.replace(mtp_layers=1), seq_len=256)["total"]
             - model_state_bytes(a, plan, seq_len=256)["total"])
    assert grown == pytest.approx(16 * (whole + split / tp + experts) / dp_shard)


def test_pipelines_hold_the_mtp_modules_on_the_last_stage():
    a = model("tiny-dense", n_layers=4)
    whole, split, experts = split_by_tp(mtp_module_of_training_model(a))
    for schedule, v, holder in (("1F1B", 1, 1), ("Interleaved1F1B", 2, 1), ("ZBVZeroBubble", 2, 0)):
        plan = Plan(pp=2, pp_schedule=schedule, pp_virtual_stages=v, micro_batch_size=1)
        for rank in (0, 1):
            grown = (model_state_bytes(a, plan.replace(mtp_layers=1), rank, 256)["total"]
                     - model_state_bytes(a, plan, rank, 256)["total"])
            assert grown == (16 * (whole + split + experts) if rank == holder else 0)
        ev = evaluate(a, make_cluster("H100", 2), plan.replace(mtp_layers=1), 256, 4)
        assert mtp_cost(a, make_cluster("H100", 2), ev, 256, 4)["pp_rank"] == holder


# ---- activations: the MTP module's formula against what autograd saves -----------------------------------------
def mtp_saved_bytes_per_token(args, checkpoint: bool) -> float:
    """Bytes per token that one MTP module and its pass through the head keep for backward, measured with
    saved_tensors_hooks as test_planner's blocks are (live saved tensors, parameters and cos/sin excluded, the slope
    between two token counts). `checkpoint`: the block fully checkpointed, as parallel/parallelize.py wraps it."""
    torch.manual_seed(0)
    m = build_model(args.replace(n_mtp_layers=1), "cpu", torch.bfloat16)
    module = m.mtp[0]
    if checkpoint:
        module.block = checkpoint_wrapper(module.block, preserve_rng_state=False)
    sizes = []
    for T in (64, 128):
        h, emb = (torch.randn(2, T, args.dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        cos, sin = (c.to(torch.bfloat16) for c in m.rope_cos_sin(T, h.device))
        skip = {p.untyped_storage().data_ptr() for p in m.parameters()}
        skip |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
        refs = []

        def pack(t, refs=refs):
            refs.append(weakref.ref(t))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, hn = module(h, emb, cos, sin)
            logits = m.head(hn)
        live = {}
        for r in refs:
            t = r()
            if t is not None and t.untyped_storage().data_ptr() not in skip:
                live[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        sizes.append(sum(live.values()))
        del logits, hn
    return (sizes[1] - sizes[0]) / (2 * 64)


@pytest.mark.parametrize("name,changes", [("tiny-dense", {}), ("tiny-moe", {"v_head_dim": 24})])
@pytest.mark.parametrize("ac", ["none", "full"])
def test_mtp_activation_bytes_match_autograd(name, changes, ac):
    a = model(name, **changes)
    (block,) = mtp_blocks(model_terms(a, 128), 1)
    predicted = sum(block.act[ac]) + sum(mtp_module_activation_bytes(a))  # tp = 1: whole + split
    assert predicted == mtp_saved_bytes_per_token(a, checkpoint=ac == "full")


def test_memory_grows_by_the_mtp_activations_and_its_saved_log_softmax():
    a, c = model("tiny-dense"), make_cluster("H100", 1)
    plan, seq, mbs = Plan(micro_batch_size=2), 256, 2
    tokens = mbs * seq
    base = evaluate(a, c, plan, seq, mbs, with_time=False).memory
    mem = evaluate(a, c, plan.replace(mtp_layers=1), seq, mbs, with_time=False).memory
    assert base.phase == mem.phase == "loss"
    (block,) = mtp_blocks(model_terms(a, seq), 1)
    assert mem.items["activations"] - base.items["activations"] == \
        pytest.approx(tokens * (sum(block.act["none"]) + sum(mtp_module_activation_bytes(a))))
    # at the main loss, each depth's fp32 log-softmax is still held for its backward
    assert mem.items["logits_loss"] - base.items["logits_loss"] == pytest.approx(FP32 * tokens * a.vocab_size)


# ---- FLOPs: a hand count ---------------------------------------------------------------------------------------
def test_mtp_flops_match_a_hand_count():
    """tiny-dense (hidden 64, 4 heads of 16, 2 kv heads, SwiGLU 176 wide, vocabulary 2048): 6 FLOPs per parameter per
    token (forward + backward) of the MTP block, eh_proj (128 -> 64) and its three norms, the head once more
    (2 x 3 x tokens x hidden x vocab), and the block's attention, 6 x seq x heads x (16 + 16) per token."""
    a, seq = model("tiny-dense"), 512
    attention_proj = 64 * 64 + 2 * 64 * 2 * 16 + 64 * 64  # q, k, v, o
    block = attention_proj + 2 * 64 + 3 * 64 * 176  # + two norms + gate/up/down
    module = 2 * 64 * 64 + 3 * 64
    head = 64 * 2048
    by_hand = 6 * (block + module + head) + 6 * seq * 4 * (16 + 16)

    def flops(mtp: int) -> float:
        s = rank_shares(model_terms(a, seq), 1, 1, 1, 1, "none", mtp)[0]
        return s.linear_flops + s.expert_flops + 2 * s.attn_flops  # attn_flops: the causal half

    assert flops(1) - flops(0) == by_hand
    assert flops(2) - flops(0) == 2 * by_hand
    t = evaluate(a, make_cluster("H100", 1), Plan(micro_batch_size=2, mtp_layers=1), seq, 2).time
    t0 = evaluate(a, make_cluster("H100", 1), Plan(micro_batch_size=2), seq, 2).time
    assert t.total > t0.total and t.items["compute_linear"] > t0.items["compute_linear"]


# ---- the CLI -----------------------------------------------------------------------------------------------------
def test_plan_prints_the_mtp_depth_and_its_share():
    argv = ("--model", "deepseek-llm-7b", "--gpus", "8", "--gpu-type", "H100", "--global-batch-size", "16")
    rc, out = run_plan_cli(*argv, "--mtp-layers", "1", "--top", "1")
    assert rc == 0
    line = next(ln for ln in out.splitlines() if ln.startswith("MTP: "))
    assert "1 depth" in line and "% of the step" in line and "GiB/GPU" in line
    assert "--mtp-layers 1" in out
    rc, out = run_plan_cli(*argv, "--mtp-layers", "1", "--top", "1", "--json")
    doc = json.loads(out)["plans"][0]
    assert doc["mtp_layers"] == 1 and doc["mtp"]["depth"] == 1 and 0 < doc["mtp"]["step_share"] < 0.2
    assert doc["command"].endswith("--mtp-layers 1") or "--mtp-layers 1 " in doc["command"]
    rc, out = run_plan_cli(*argv, "--top", "1")
    assert rc == 0 and "MTP" not in out and "--mtp-layers" not in out


@pytest.mark.parametrize("extra,match", [(("--mtp-layers", "-1"), "--mtp-layers must be 0 or more"),
                                         (("--mtp-layers", "4096"), "no target that far"),
                                         (("--mtp-layers", "1", "--mode", "infer"), "prices training plans")])
def test_plan_refuses_bad_mtp_depths(extra, match):
    with pytest.raises(UserError, match=match):
        run_plan_cli("--model", "tiny-dense", "--gpus", "1", "--gpu-type", "H100", "--global-batch-size", "2",
                     "--seq-len", "4096" if "4096" in extra else "256", *extra)
