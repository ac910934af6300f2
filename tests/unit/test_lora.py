"""LoRA (models/lora.py, models/lora_spec.py) on the tiny models in fp32, in one process: adapters with B = 0 leave
the model exactly as it was and are the only trained parameters, as many as the planner's formula counts; merging
them gives the unmerged forward; PEFT loads our adapter folder onto transformers' model with our logits; the LoRA
memory term against the parameters of a real LoRA model; bad flags cost one line and exit code 2."""

import copy

import pytest
import torch
import torch.nn.functional as F

from numerics import rel_error
from paraseek.cli import main
from paraseek.models import build_model, resolve_model, save_pretrained
from paraseek.models.deepseek import Transformer
from paraseek.models.lora import apply_lora, init_adapters, is_adapter, merge_state, save_peft_adapter
from paraseek.models.lora_spec import LoRASpec, adapter_params, lora_spec, model_targets

MODELS = ["tiny-dense", "tiny-moe"]


def _lora_model(name: str, rank: int = 4, alpha: float = 8.0, targets: str = ""):
    args, _, _ = resolve_model(name)
    torch.manual_seed(0)
    base = build_model(args, "cpu", torch.float32)
    spec = lora_spec(rank, alpha, targets, args, name)
    model = copy.deepcopy(base)
    apply_lora(model, spec)
    init_adapters(model, seed=1)
    return base, model, spec


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(3))


def _randomize_b(model) -> None:
    # A trained adapter: B != 0 (it starts at zero), of a size that moves the logits visibly.
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.mark.parametrize("name", MODELS)
def test_b_zero_is_the_base_model_and_only_adapters_train(name):
    base, model, spec = _lora_model(name)
    assert spec.targets == model_targets(base.args)  # "" = all the model has
    ids = _ids(base.args.vocab_size)
    with torch.no_grad():
        assert torch.equal(model(ids), base(ids))  # B = 0 adds exact zeros
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter(n) for n in trainable)
    assert sum(p.numel() for p in trainable.values()) == adapter_params(base.args, spec)  # the planner's count
    loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)
    assert all(p.grad is not None for p in trainable.values())
    # With B = 0, only B gets a gradient at step 0 (dL/dA = B^T ...): as Hu et al.'s init intends.
    assert all(p.grad.abs().sum() == 0 for n, p in trainable.items() if ".lora_A." in n)
    assert any(p.grad.abs().sum() > 0 for n, p in trainable.items() if ".lora_B." in n)


@pytest.mark.parametrize("name", MODELS)
def test_merged_weights_give_the_unmerged_forward(name):
    base, model, spec = _lora_model(name)
    _randomize_b(model)
    ids = _ids(base.args.vocab_size)
    merged = copy.deepcopy(base)
    merged.load_state_dict(merge_state(model.state_dict(), spec))
    with torch.no_grad():
        ref, got = model(ids), merged(ids)
    assert rel_error(ref, base(ids)) > 1e-2  # the adapters matter
    assert rel_error(got, ref) < 1e-5


# PEFT checks rank_pattern keys against module names only, so the fused experts' key (a parameter's) is reported
# as unused although it is applied: the adapter counts below prove its rank.
@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match")
@pytest.mark.parametrize("name", MODELS)
def test_peft_loads_the_adapter_folder_with_our_logits(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    base, model, spec = _lora_model(name)
    _randomize_b(model)
    save_pretrained(base, tmp_path / "base")
    adapters = {n: t for n, t in model.state_dict().items() if is_adapter(n)}
    save_peft_adapter(adapters, base.args, spec, tmp_path / "adapter", base_model=str(tmp_path / "base"),
                      dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    hf = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    n_lora = sum(p.numel() for n, p in hf.named_parameters() if "lora_" in n)
    # Every adapter landed, none twice: ours plus, per MoE layer, the zero off-diagonal blocks of the fused
    # gate|up adapter's block-diagonal B (E x 2F x r).
    a = base.args
    zeros = sum(a.n_routed_experts * 2 * a.moe_inter_dim * spec.rank for i in range(a.n_layers) if a.is_moe_layer(i))
    assert n_lora == adapter_params(a, spec) + zeros
    ids = _ids(base.args.vocab_size)
    with torch.no_grad():
        ref, got = model(ids), hf(input_ids=ids).logits
    assert rel_error(got, ref) < 1e-4  # the transformers parity tolerance (tests/unit/test_hf_parity.py)


def test_lora_memory_term_counts_a_real_lora_model():
    from paraseek.planner.memory import lora_state_bytes
    from paraseek.planner.plan import Plan

    args, _, _ = resolve_model("tiny-moe")
    spec = LoRASpec(4, 8.0, model_targets(args))
    with torch.device("meta"):
        model = Transformer(args)
    apply_lora(model, spec)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    one = lora_state_bytes(args, Plan(dp_shard=1), spec)
    assert one["base_params"] == 2 * frozen  # bf16, no gradients, no optimizer states for the base
    assert (one["params"], one["grads"], one["optimizer"]) == (4 * adapters, 4 * adapters, 8 * adapters)
    # FSDP2 over 4 (and EP 2 inside it): every state a quarter on each rank.
    four = lora_state_bytes(args, Plan(dp_shard=4, ep=2), spec, base_bytes=4)
    assert four["base_params"] == pytest.approx(4 * frozen / 4)
    assert four["total"] == pytest.approx((4 * frozen + 16 * adapters) / 4)


def test_planner_prices_a_lora_run_with_the_lora_states():
    """`paraseek train --lora-rank` as the planner's Plan (TrainConfig.to_plan): its peak holds the LoRA states
    (bf16 base, 16 B/param adapters) in place of 16 B/param for the whole model, and nothing else changes."""
    from paraseek.planner import evaluate, make_cluster
    from paraseek.planner.memory import lora_state_bytes
    from paraseek.train.config import TrainConfig

    args, _, _ = resolve_model("deepseek-r1-distill-qwen-1.5b")
    cluster = make_cluster("H200", 1, gpus_per_node=1)
    full_cfg = TrainConfig(model="deepseek-r1-distill-qwen-1.5b", micro_batch_size=2, global_batch_size=4,
                           activation_checkpointing="selective", nproc=1)
    plan = full_cfg.to_plan()
    lora = plan.replace(lora=LoRASpec(16, 32.0, model_targets(args)))
    full, adapted = (evaluate(args, cluster, p, 4096, 4).memory for p in (plan, lora))
    states = lora_state_bytes(args, lora, lora.lora, seq_len=4096)
    assert adapted.items["parameters"] == pytest.approx(states["base_params"] + states["params"])
    assert adapted.items["optimizer_states"] == pytest.approx(states["optimizer"])
    assert adapted.items["activations"] == full.items["activations"]  # the same tokens through the same layers
    saved = full.items["parameters"] + full.items["optimizer_states"] - states["total"] + states["grads"]
    assert full.total - adapted.total == pytest.approx(saved, rel=0.1)  # grads: 4 B/param x 2 micro-batches


def test_plan_auto_for_a_lora_run_ranks_lora_plans():
    """--plan auto with --lora-rank (train/launch.py: apply_auto_plan) searches LoRA plans: priced with the LoRA
    states, and never tp or pp, which the engine refuses for LoRA."""
    from paraseek.planner import best_plan, make_cluster
    from paraseek.planner.search import search

    args, _, _ = resolve_model("deepseek-r1-distill-qwen-1.5b")
    spec = LoRASpec(16, 32.0, model_targets(args))
    one = make_cluster("H200", 1, gpus_per_node=1)
    full, lora = best_plan(args, one, 4096, 8), best_plan(args, one, 4096, 8, lora=spec)
    assert lora.plan.lora == spec and full.plan.lora is None
    assert lora.memory.items["optimizer_states"] < full.memory.items["optimizer_states"] / 50
    res = search(args, make_cluster("H200", 4, gpus_per_node=4), 4096, 8, engine_only=True, lora=spec)
    assert res.plans and all(e.plan.tp == 1 and e.plan.pp == 1 and e.plan.lora == spec for e in res.plans)
    assert any("not --tp or --pp" in r.reason for r in res.rejected)


def test_selective_checkpointing_recomputes_lora_b_and_keeps_the_projections():
    """LoRA's B ([T, r] @ [r, O]) is recomputed in backward (cheap), so selective checkpointing does not keep a
    second [T, O] output per adapted projection; the projections' own matmuls stay saved."""
    from torch.utils.checkpoint import CheckpointPolicy

    from paraseek.parallel.parallelize import _selective_policy

    x_TI, h_TR = torch.zeros(8, 256), torch.zeros(8, 16)
    assert _selective_policy(None, torch.ops.aten.mm.default, x_TI, torch.zeros(256, 512)) == CheckpointPolicy.MUST_SAVE
    assert _selective_policy(None, torch.ops.aten.mm.default, x_TI, torch.zeros(256, 16)) == CheckpointPolicy.MUST_SAVE
    assert _selective_policy(None, torch.ops.aten.mm.default, h_TR, torch.zeros(16, 512)) == \
        CheckpointPolicy.PREFER_RECOMPUTE
    x_T64 = torch.zeros(8, 64)  # a tiny test model's 64-wide projection: saved like a real one
    assert _selective_policy(None, torch.ops.aten.mm.default, x_T64, torch.zeros(64, 64)) == CheckpointPolicy.MUST_SAVE


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dense") / "init"
    args, _, _ = resolve_model("tiny-dense")
    save_pretrained(build_model(args, "cpu", torch.float32), folder)
    return folder


def test_bad_lora_flags_cost_one_line(dense_folder, capsys):
    common = ["train", "--device", "cpu", "--nproc", "1", "--steps", "1", "--seq-len", "16", "--global-batch-size", "1"]
    init = ["--init-from", str(dense_folder)]
    cases = [
        (["--model", "tiny-dense", "--lora-rank", "0"], "--lora-rank must be a positive rank, got 0"),
        (["--model", "tiny-dense", "--lora-rank", "-2"], "--lora-rank must be >= 0, got -2"),
        (["--model", "tiny-dense", "--lora-targets", "q_proj"], "need --lora-rank"),
        ([*init, "--lora-rank", "8", "--lora-targets", "atention"], "unknown target 'atention'; did you mean 'attention'?"),
        ([*init, "--lora-rank", "8", "--lora-targets", "q_proj,experts"], "has no routed experts"),
        (["--model", "tiny-moe", "--lora-rank", "8", "--lora-targets", "k_proj"], "tiny-moe has no k_proj"),
        (["--model", "tiny-dense", "--lora-rank", "8"], "give it with --init-from"),
        ([*init, "--lora-rank", "8", "--nproc", "2", "--tp", "2", "--dp-shard", "1"], "not supported yet"),
    ]
    for argv, message in cases:
        assert main([*common, *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, (argv, err)
