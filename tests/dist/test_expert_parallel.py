"""Expert parallelism on tiny-moe (gloo, fp32, real processes) against one process on the whole batch.

Every rank takes its own slice of the batch (EP ranks are data-parallel ranks); loss and every gradient must equal
the single-process ones within 1e-4 relative (max |diff| / max |ref| per tensor): the same math, only the batch
shapes of the dense matmuls and the order of the gradient reductions differ. The router weights get std 1 (see
dist_helpers.seed_checkpoint) so no top-k choice sits on a tie. Also: V3's balancing bias fixes a skewed router,
and the balance losses equal their formulas written out token by token.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from paraseek.models import load_pretrained, save_pretrained
from paraseek.models.args import ModelArgs, preset_config
from paraseek.models.deepseek import Gate, MoE, Transformer
from paraseek.models.hf import load_state_into
from paraseek.parallel.parallelize import apply_activation_checkpointing
from paraseek.parallel.expert import (
    ExpertLoad,
    apply_expert_parallel,
    balance_loss_value,
    enable_balance_loss,
    expert_balance_loss,
    load_stats,
    moe_layers,
    update_routing_bias,
)

from dist_helpers import seeded_model, spawn  # noqa: E402
from numerics import normal_init, rel_error  # noqa: E402

pytestmark = pytest.mark.dist

RTOL = 1e-4
BATCH, SEQ = 8, 16


@pytest.fixture(scope="module")
def seed_folder(tmp_path_factory) -> Path:
    """tiny-moe with a decisive router (std 1) as an HF folder, which every process loads, plus the single-process
    reference on the whole batch (reference.pt), computed once here."""
    folder = tmp_path_factory.mktemp("tiny-moe") / "init"
    model = seeded_model(ModelArgs.from_hf_config(preset_config("tiny-moe")))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Gate):
                m.e_score_correction_bias.normal_(0.0, 0.1)  # a non-zero bias: it must reach every rank's router
    save_pretrained(model, folder)
    torch.save(_reference(folder), folder / "reference.pt")
    return folder


def _batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))


def _reference(folder: Path) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, the whole batch, loss = mean over the global tokens: (loss, gradients, weights), the model
    loaded back from the HF folder as the ranks load it."""
    model = load_pretrained(folder, dtype=torch.float32, device="cpu")
    tokens = _batch(model.args.vocab_size)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return (loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()},
            {n: p.detach().clone() for n, p in model.named_parameters()})


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, torch.distributed.tensor.DTensor) else t


def _local_loss(model: torch.nn.Module, rank: int, world: int) -> torch.Tensor:
    """This rank's slice of the batch; loss normalized by the rank's tokens (the engine's convention), so that
    averaging gradients over the data-parallel ranks gives the global mean's gradient."""
    tokens = _batch(model.args.vocab_size)
    per = BATCH // world
    mine = tokens[rank * per:(rank + 1) * per]
    logits = model(mine[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten(), reduction="sum") / mine[:, 1:].numel()


def _meta_model() -> Transformer:
    args = ModelArgs.from_hf_config(preset_config("tiny-moe"))
    with torch.device("meta"):
        return Transformer(args)


# ---- EP alone: ep = world, data parallelism by hand ------------------------------------------------------------------
def ep_only(rank: int, world: int, root: Path, folder: str) -> dict:
    ref_loss, ref_grads, ref_weights = torch.load(Path(folder) / "reference.pt")
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    # The engine's order: meta -> parallelize -> materialize -> load the HF folder into the local shards.
    model = _meta_model()
    apply_expert_parallel(model, mesh)
    model.to_empty(device="cpu")
    load_state_into(model, folder)
    model.init_buffers(torch.device("cpu"))
    loss = _local_loss(model, rank, world)
    loss.backward()
    # Full activation checkpointing (the engine's wrapper) recomputes each block, all-to-alls included, in backward:
    # the same gradients, bit for bit.
    plain = [_local(p.grad).clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    apply_activation_checkpointing(model, "full")
    assert _local_loss(model, rank, world).item() == loss.item()
    _local_loss(model, rank, world).backward()
    ac_equal = all(torch.equal(a, _local(p.grad)) for a, p in zip(plain, model.parameters()))
    # Data parallelism by hand: average the loss and the replicated gradients over the ranks. An expert's gradient on
    # its owner already sums every rank's contribution (the all-to-all's backward); the average over the dp ranks
    # divides it by dp (FSDP2 does this with set_gradient_divide_factor(dp)).
    total = torch.tensor([loss.item()])
    dist.all_reduce(total)
    errors: dict[str, float] = {}
    n_experts_local = 0
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        g = p.grad
        if ".mlp.experts." in name:
            assert isinstance(p, torch.distributed.tensor.DTensor) and tuple(p.shape) == tuple(ref_grads[name].shape)
            n_experts_local = n = p.to_local().shape[0]
            # The loader filled the local shard with this rank's block of the full weights.
            assert torch.equal(p.to_local(), ref_weights[name][rank * n:(rank + 1) * n]), name
            got = g.to_local() / world
            ref = ref_grads[name][rank * n:(rank + 1) * n]
        else:
            dist.all_reduce(g)
            got = g / world
            ref = ref_grads[name]
        errors[name] = rel_error(got, ref)
    return {"loss": total.item() / world, "ref_loss": ref_loss, "errors": errors, "n_local": n_experts_local,
            "ac_equal": ac_equal, "tokens_per_expert": [m.tokens_per_expert.clone() for m in moe_layers(model)]}


# ---- one process group per world size: processes start slowly, so each spawn runs every check of its size ---------
def _each(rank: int, world: int, root: Path, folder: str, checks: dict) -> dict:
    """Run checks {name: (fn, kwargs)} one after the other in this process group, each in a folder of its own; a
    failing check's result is its traceback (every rank runs the same code on the same data), so the others still
    run and each test reports only its own."""
    import traceback

    out = {}
    for name, (fn, kwargs) in checks.items():
        sub = root / name
        sub.mkdir(exist_ok=True)
        try:
            out[name] = fn(rank, world, root=sub, folder=folder, **kwargs)
        except Exception:
            out[name] = traceback.format_exc()
        dist.barrier()
    return out


BALANCING = dict(steps=20, gamma=0.01, skewed=0, push=30.0)


@pytest.fixture(scope="module")
def on_2_ranks(seed_folder, tmp_path_factory) -> list[dict]:
    """EP alone over 2 ranks and the balancing run, in one spawn of 2 processes."""
    root = tmp_path_factory.mktemp("ep2")
    return spawn(_each, 2, root, root=root, folder=str(seed_folder),
                 checks={"ep_only": (ep_only, {}), "balancing": (balancing, BALANCING)})


@pytest.fixture(scope="module")
def on_4_ranks(seed_folder, tmp_path_factory) -> list[dict]:
    """EP alone over 4 ranks and EP x FSDP2 in the engine's layouts, in one spawn of 4 processes."""
    root = tmp_path_factory.mktemp("ep4")
    return spawn(_each, 4, root, root=root, folder=str(seed_folder),
                 checks={"ep_only": (ep_only, {}), "ep_fsdp": (ep_fsdp, {})})


def _results(outs: list[dict], name: str) -> list:
    for rank, out in enumerate(outs):
        assert not isinstance(out[name], str), f"{name}, rank {rank}:\n{out[name]}"
    return [out[name] for out in outs]


@pytest.mark.parametrize("ep", [2, 4])
def test_ep_gradients_equal_single_process(ep, request):
    outs = _results(request.getfixturevalue(f"on_{ep}_ranks"), "ep_only")
    for rank, out in enumerate(outs):
        assert abs(out["loss"] - out["ref_loss"]) <= RTOL * abs(out["ref_loss"]), (rank, out["loss"], out["ref_loss"])
        assert out["n_local"] == 8 // ep
        assert out["ac_equal"], rank
        worst = max(out["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] <= RTOL, (rank, worst)
        assert any(".mlp.experts." in n for n in out["errors"])
    # Each rank counts its own tokens; together they are the whole batch's slots.
    for layer in range(len(outs[0]["tokens_per_expert"])):
        assert sum(int(o["tokens_per_expert"][layer].sum()) for o in outs) == BATCH * SEQ * 2


# ---- EP composed with FSDP2, as the engine will run it -------------------------------------------------------------
FSDP_LAYOUTS = [(1, 4, 2), (1, 4, 4), (2, 2, 2)]  # (dp_replicate, dp_shard, ep) on 4 ranks


def ep_fsdp(rank: int, world: int, root: Path, folder: str) -> dict:
    """The engine's mesh and order (mesh.ParallelMesh, parallelize.parallelize: the experts EP-sharded first, then
    FSDP-sharded over the dp ranks outside the EP group, FSDP2 for the rest); the HF loader; the global gradient
    norm; an AdamW step (as the engine builds it); a DCP checkpoint written by each layout and read back by the next."""
    from paraseek.parallel.mesh import ParallelMesh
    from paraseek.parallel.parallelize import parallelize
    from paraseek.parallel.dims import ParallelDims
    from paraseek.models.checkpoint_read import latest_checkpoint
    from paraseek.train.checkpoint import load_checkpoint, save_checkpoint
    from paraseek.train.optim import clip_grad_norm

    ref_loss, ref_grads, _ = torch.load(Path(folder) / "reference.pt")
    ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref_grads.values()])).item()
    results = {}
    saved: dict[str, torch.Tensor] | None = None
    for i, (dp_replicate, dp_shard, ep) in enumerate(FSDP_LAYOUTS):
        mesh = ParallelMesh(ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, ep=ep), "cpu")
        model = _meta_model()
        parallelize(model, mesh, precision="fp32")
        model.to_empty(device="cpu")
        model.init_weights(device=torch.device("cpu"))  # works on the sharded experts (then overwritten)
        load_state_into(model, folder)
        model.init_buffers(torch.device("cpu"))
        loss = _local_loss(model, rank, world)
        loss.backward()
        total = torch.tensor([loss.item()])
        dist.all_reduce(total)
        errors = {name: rel_error(p.grad.full_tensor(), ref_grads[name]) for name, p in model.named_parameters()}
        params = list(model.parameters())
        norm = clip_grad_norm(params, 0.0).item()
        clipped = clip_grad_norm(params, 0.5 * norm).item()  # clips to half: the norm afterwards is half
        after = clip_grad_norm(params, 0.0).item()
        placements = {name: str(p.placements) for name, p in model.named_parameters() if ".mlp.experts." in name}
        # Resume the previous layout's checkpoint (model + optimizer) into this one, then step and save.
        optimizer = torch.optim.AdamW(params, lr=0.01, foreach=True)
        restored = None
        if saved is not None:
            load_checkpoint(latest_checkpoint(root / "ckpt"), model, optimizer)
            restored = max(rel_error(p.full_tensor(), saved[n]) for n, p in model.named_parameters())
        optimizer.step()
        saved = {n: p.full_tensor() for n, p in model.named_parameters()}
        save_checkpoint(root / "ckpt", i + 1, model, optimizer, {})
        results[(dp_replicate, dp_shard, ep)] = {"loss": total.item() / world, "errors": errors, "norm": norm,
                                                 "clipped": (clipped, after), "placements": placements,
                                                 "restored": restored}
    return {"ref_loss": ref_loss, "ref_norm": ref_norm, "layouts": results}


def test_ep_with_fsdp_equals_single_process(on_4_ranks):
    """4 ranks: FSDP2 over 4 with ep 2 and ep 4, HSDP 2x2 with ep 2 (the experts then replicated over dp_replicate,
    one EP group per replica); loss, every gradient and the global gradient norm as one process computes them;
    a checkpoint of one layout resumes in the next."""
    out = _results(on_4_ranks, "ep_fsdp")[0]
    for layout, got in out["layouts"].items():
        assert abs(got["loss"] - out["ref_loss"]) <= RTOL * abs(out["ref_loss"]), (layout, got["loss"], out["ref_loss"])
        worst = max(got["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] <= RTOL, (layout, worst)
        assert abs(got["norm"] - out["ref_norm"]) <= RTOL * out["ref_norm"], (layout, got["norm"], out["ref_norm"])
        assert got["clipped"][0] == got["norm"] and abs(got["clipped"][1] - 0.5 * got["norm"]) <= 1e-4 * got["norm"]
        assert all(p.endswith("Shard(dim=0))") for p in got["placements"].values()), (layout, got["placements"])
        assert got["restored"] is None or got["restored"] == 0.0, layout  # the previous layout's weights, exactly


# ---- V3's auxiliary-loss-free balancing ------------------------------------------------------------------------------
def balancing(rank: int, world: int, root: Path, folder: str, steps: int, gamma: float, skewed: int,
              push: float) -> dict:
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    model = load_pretrained(Path(folder), dtype=torch.float32)
    # Skew the router: in every MoE layer expert `skewed` gets a large score for most tokens (its gate row pushed
    # along the mean of the layer's inputs), and the routing bias starts at zero.
    inputs: dict[int, torch.Tensor] = {}
    hooks = [m.gate.register_forward_hook(lambda mod, args, out, i=i: inputs.__setitem__(i, args[0].detach()))
             for i, m in enumerate(moe_layers(model))]
    tokens = _batch(model.args.vocab_size)
    per = BATCH // world
    mine = tokens[rank * per:(rank + 1) * per, :-1]
    with torch.no_grad():
        model(tokens[:, :-1])
        for h in hooks:
            h.remove()
        for i, m in enumerate(moe_layers(model)):
            mean_D = inputs[i].mean(0)
            m.gate.weight[skewed] += push * mean_D / mean_D.pow(2).sum()
            m.gate.e_score_correction_bias.zero_()
    apply_expert_parallel(model, mesh)  # also works on a materialized model
    load = ExpertLoad(model)
    history = []
    with torch.no_grad():
        for _ in range(steps):
            for half in mine.split(per // 2 or 1):  # two micro-batches per step
                model(half)
                load.observe()
            load_YE = load.reduce()
            history.append(load_stats(load_YE))
            update_routing_bias(model, gamma, load_YE=load_YE)
    biases = torch.stack([m.gate.e_score_correction_bias for m in moe_layers(model)])
    all_biases = [torch.empty_like(biases) for _ in range(world)]
    dist.all_gather(all_biases, biases)

    # The rule itself, with a known load: counts (rank+1) * [0, 1, ..., E-1] summed over the ranks.
    before = biases.clone()
    E = biases.shape[1]
    for m in moe_layers(model):
        m.tokens_per_expert.copy_(torch.arange(E) * (rank + 1))
    used = update_routing_bias(model, 0.5)  # all-reduces the last forward's counts over the world
    after = torch.stack([m.gate.e_score_correction_bias for m in moe_layers(model)])
    return {"history": history, "biases": all_biases, "dtype": str(biases.dtype), "rule_load": used,
            "rule_delta": after - before}


def test_balancing_bias_brings_load_down(on_2_ranks):
    """EP over 2 ranks, 20 steps of two micro-batches, V3's rule with gamma 0.01 on a router skewed towards expert 0."""
    outs = _results(on_2_ranks, "balancing")
    history = [h["expert_load_max_over_mean"] for h in outs[0]["history"]]
    assert history[0] > 2.4, history  # the skew worked: expert 0 takes most tokens (4.0 = every token, 1.0 = even)
    assert max(history[-5:]) < 0.6 * history[0], history
    assert history[-1] < 1.4, history
    first, last = outs[0]["history"][0], outs[0]["history"][-1]
    per_layer = "expert_load_max_over_mean_per_layer"
    assert all(b < a for a, b in zip(first[per_layer], last[per_layer])), (first[per_layer], last[per_layer])
    assert outs[0]["history"][0]["tokens_dropped"] == 0
    # Same telemetry on every rank (it is global), identical fp32 biases on every rank.
    assert [h["expert_load_max_over_mean"] for h in outs[1]["history"]] == history
    assert outs[0]["dtype"] == "torch.float32"
    for b in outs[0]["biases"][1:]:
        assert torch.equal(b, outs[0]["biases"][0])
    # bias += gamma * sign(mean - load) with the load summed over the ranks: 3 * [0..7], mean 10.5.
    E = 8
    expected_load = torch.arange(E) * 3
    for out in outs:
        assert torch.equal(out["rule_load"], expected_load.expand_as(out["rule_load"]))
        want = 0.5 * torch.sign(expected_load.float().mean() - expected_load.float())
        torch.testing.assert_close(out["rule_delta"], want.expand_as(out["rule_delta"]), rtol=0, atol=1e-6)


# ---- auxiliary balance losses (one process) ------------------------------------------------------------------------
def _written_out(scores_NE, idx_NK, B, alpha, per_sequence, normalize):
    """The papers' sums, token by token: alpha * mean_b sum_i f_i P_i."""
    N, E = scores_NE.shape
    K = idx_NK.shape[1]
    seqs = [(b * (N // B), (b + 1) * (N // B)) for b in range(B)] if per_sequence else [(0, N)]
    total = 0.0
    for lo, hi in seqs:
        T = hi - lo
        for i in range(E):
            f = E / (K * T) * sum(int(idx_NK[t, k] == i) for t in range(lo, hi) for k in range(K))
            P = 0.0
            for t in range(lo, hi):
                s = scores_NE[t] / scores_NE[t].sum() if normalize else scores_NE[t]
                P += s[i].item() / T
            total += f * P
    return alpha * total / len(seqs)


@pytest.mark.parametrize("per_sequence,normalize", [(False, False), (True, False), (True, True)])
def test_balance_loss_formula(per_sequence, normalize):
    gen = torch.Generator().manual_seed(3)
    B, T, E, K = 2, 5, 8, 2
    scores = torch.rand(B * T, E, generator=gen)
    if not normalize:
        scores = scores.softmax(-1)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(B * T)])
    got = expert_balance_loss(scores, idx, B, 0.01, per_sequence=per_sequence, normalize_scores=normalize)
    assert abs(got.item() - _written_out(scores, idx, B, 0.01, per_sequence, normalize)) < 1e-7


@pytest.mark.parametrize("model", ["tiny-moe", "tiny-moe-v2"])
def test_balance_loss_hook_adds_its_gradient(model):
    """The hook leaves the forward unchanged and adds exactly scale * d(balance loss)/d(params): with a zero output
    gradient, the gradients are those of the balance loss alone, computed here from the gate by hand."""
    cfg = preset_config("tiny-moe")
    if model == "tiny-moe-v2":
        cfg.update(model_type="deepseek_v2", scoring_func="softmax", topk_method="group_limited_greedy",
                   aux_loss_alpha=0.01, seq_aux=False, norm_topk_prob=False, routed_scaling_factor=1.0)
    args = ModelArgs.from_hf_config(cfg)
    torch.manual_seed(0)
    moe = normal_init(MoE(args), 0.5)
    x = torch.randn(2, 6, args.dim)
    out_plain = moe(x)
    alpha = enable_balance_loss(moe, 0.1 if model == "tiny-moe" else None, scale=0.5)
    assert alpha == (0.1 if model == "tiny-moe" else 0.01)
    out = moe(x)
    assert torch.equal(out, out_plain)
    (out * 0).sum().backward()
    hooked = moe.gate.weight.grad.clone()
    assert hooked.abs().max() > 0
    assert all(p.grad is None or not p.grad.any() for n, p in moe.named_parameters() if n != "gate.weight")
    # The reference: the balance loss from the gate's outputs, by hand.
    moe.zero_grad()
    _, idx, scores = moe.gate(x.view(-1, args.dim))
    v3 = args.topk_method == "noaux_tc"
    aux = expert_balance_loss(scores, idx, 2, alpha, per_sequence=v3 or args.seq_aux, normalize_scores=v3)
    (0.5 * aux).backward()
    torch.testing.assert_close(hooked, moe.gate.weight.grad, rtol=1e-5, atol=1e-9)
    assert balance_loss_value(moe) == pytest.approx(aux.item(), rel=1e-6)
    with torch.no_grad():  # no gradient, no loss: inference is untouched
        assert torch.equal(moe(x), out_plain)
    enable_balance_loss(moe, 0.0)
    assert moe.balance_loss is None
