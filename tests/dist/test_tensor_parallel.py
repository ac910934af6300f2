"""Tensor + sequence parallelism (gloo, fp32, real processes) against one process on the same batch.

tiny-dense (GQA attention, dense MLPs), tiny-moe (V3-shaped: MLA with q_lora, shared + routed experts), a
V2-Lite-shaped tiny-moe (MLA without q_lora) and a tied-embedding tiny-dense, each with and without sequence
parallelism on tp = 2; tiny-moe also on a 2 (dp_shard) x 2 (tp) mesh in the engine's order (TP -> selective
activation checkpointing -> FSDP2). Every process builds the model on the meta device, parallelizes it, loads the
same HF folder into its shards (models/hf.py) and runs forward + vocab-parallel loss + backward on the same batch as
a plain model in the same process. Loss and every parameter's full gradient must equal the reference within 1e-4
relative (max |diff| / max |ref| per tensor), and so must the losses of 3 AdamW steps with gradient clipping: the
same math, only the matmul shapes and the reduction order differ. The router weights get std 1 so that no top-k
choice sits on a near-tie (see dist_helpers.seed_checkpoint). And a fresh init_weights of the sharded model is, tensor
by tensor, what one process draws with the same seed.
"""

import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from paraseek.models import load_pretrained, save_pretrained
from paraseek.models.args import ModelArgs, preset_config, read_hf_config
from paraseek.models.deepseek import Transformer
from paraseek.models.hf import load_state_into
from paraseek.parallel.parallelize import apply_activation_checkpointing, apply_compile
from paraseek.parallel.tensor import apply_tensor_parallel, full_value, loss_context, reduce_tp_grads
from paraseek.train.optim import clip_grad_norm, token_loss

from dist_helpers import seeded_model, spawn  # noqa: E402
from numerics import full, rel_error  # noqa: E402

pytestmark = pytest.mark.dist

RTOL = 1e-4
BATCH, SEQ, STEPS, LR, MAX_NORM = 4, 16, 3, 0.01, 1.0


MODELS = {"tiny-dense": ("tiny-dense", {}), "tiny-moe": ("tiny-moe", {}),
          "tiny-moe-no-qlora": ("tiny-moe", {"q_lora_rank": None}),
          "tiny-dense-tied": ("tiny-dense", {"tie_word_embeddings": True})}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """One seeded initialization per model as an HF folder; routers with std 1 (decisive top-k)."""
    root = tmp_path_factory.mktemp("tp-init")
    out = {}
    for name, (preset, overrides) in MODELS.items():
        save_pretrained(seeded_model(ModelArgs.from_hf_config({**preset_config(preset), **overrides})), root / name)
        out[name] = root / name
    return out


def _batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))


# ---- the worker: reference and TP model side by side ------------------------------------------------------------------
def tp_vs_reference(rank: int, world: int, folders: dict[str, str], sequence_parallel: list[bool], dp: int = 1,
                    ac: str = "none", device: str = "cpu", compile: bool = False) -> dict:
    """Every model folder x sequence_parallel value in one process group (processes start slowly: one spawn for
    all). dp == 1: a 1-D ("tp",) mesh, no FSDP. dp > 1: ("dp_shard", "tp") with tp innermost, activation
    checkpointing, then FSDP2 over dp_shard per block + root; each dp rank on its slice of the batch and every tp
    rank of a dp rank on the same one. A failing comparison's result is its traceback (the same on every rank,
    which run the same code on the same data, so the others still run)."""
    if dp == 1:
        mesh = init_device_mesh(device, (world,), mesh_dim_names=("tp",))
    else:
        mesh = init_device_mesh(device, (dp, world // dp), mesh_dim_names=("dp_shard", "tp"))
    dev = torch.device(device, rank) if device == "cuda" else torch.device(device)
    results: dict[str, dict] = {}
    for name, folder in folders.items():
        for sp in sequence_parallel:
            try:
                results.setdefault(name, {})[sp] = _compare(folder, mesh, sp, dp, ac, dev, compile)
            except Exception:
                results.setdefault(name, {})[sp] = traceback.format_exc()
        try:
            results[name]["init"] = _init_from_scratch(folder, mesh, dp, dev)
        except Exception:
            results[name]["init"] = traceback.format_exc()
    return results


def _init_from_scratch(folder: str, mesh, dp: int, device: torch.device) -> dict:
    """init_weights on the tp (x FSDP2) model gives each rank its part of what one process draws with the same seed
    (models/init.py): no two tp ranks hold the same shard (heads are not duplicated), every tp-replicated parameter
    and buffer is equal on all tp ranks, and every tensor, gathered, is the single process's."""
    tp_mesh = mesh["tp"]
    args = ModelArgs.from_hf_config(read_hf_config(folder))
    with torch.device("meta"):
        model, one = Transformer(args), Transformer(args)
    apply_tensor_parallel(model, tp_mesh)
    if dp > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh["dp_shard"])
    model.to_empty(device=device)
    model.init_weights(device=device, seed=11)
    one.to_empty(device=device)
    one.init_weights(device=device, seed=11)
    one_sd = one.state_dict()
    sharded_equal, replicated_differ = [], []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        local = (t.to_local() if isinstance(t, DTensor) else t).detach().contiguous()
        gathered = [torch.empty_like(local) for _ in range(tp_mesh.size())]
        dist.all_gather(gathered, local, group=tp_mesh.get_group())
        same = all(torch.equal(gathered[0], g) for g in gathered[1:])
        names = t.device_mesh.mesh_dim_names if isinstance(t, DTensor) else ()
        sharded = "tp" in names and not t.placements[names.index("tp")].is_replicate()
        if sharded and same:
            sharded_equal.append(name)
        if not sharded and not same:
            replicated_differ.append(name)
    differ = [name for name, t in model.state_dict().items() if not torch.equal(full(t.detach()), one_sd[name])]
    return {"sharded_equal": sharded_equal, "replicated_differ": replicated_differ, "differs_from_one_process": differ,
            "n_sharded": sum(isinstance(p, DTensor) and "tp" in p.device_mesh.mesh_dim_names for p in model.parameters())}


def _compare(folder: str, mesh, sequence_parallel: bool, dp: int, ac: str, device: torch.device,
             compile: bool = False) -> dict:
    tokens = _batch(2048).to(device)
    ref = load_pretrained(folder, dtype=torch.float32, device=device)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)

    tp_mesh = mesh["tp"]
    with torch.device("meta"):
        model = Transformer(ref.args)
    partial = apply_tensor_parallel(model, tp_mesh, sequence_parallel=sequence_parallel)
    if ac != "none":
        apply_activation_checkpointing(model, ac)
    if compile:
        apply_compile(model)
    if dp > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    model.to_empty(device=device)
    load_state_into(model, folder)
    model.init_buffers(device)
    ref_params = dict(ref.named_parameters())
    params = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in model.named_parameters()}
    assert sorted(params) == sorted(ref_params)
    # The loader put each rank's shard of the full tensors in place.
    load_errors = {n: rel_error(full(p.detach()), ref_params[n].detach()) for n, p in params.items()}
    n_dtensor = sum(isinstance(p, DTensor) for p in params.values())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=dp > 1)

    dp_rank = mesh["dp_shard"].get_local_rank() if dp > 1 else 0
    per = BATCH // dp
    mine = tokens[dp_rank * per:(dp_rank + 1) * per]
    out = {"loss": [], "ref_loss": [], "load_errors": load_errors, "n_dtensor": n_dtensor}
    for step in range(STEPS):
        logits = ref(tokens[:, :-1])
        ref_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
        ref_loss = ref_loss / tokens[:, 1:].numel()
        ref_loss.backward()
        ref_grads = {n: p.grad.clone() for n, p in ref_params.items()}
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)

        with loss_context(True):
            logits = model(mine[:, :-1])
            assert isinstance(logits, DTensor) and logits.placements[0].is_shard(logits.ndim - 1)
            assert logits.to_local().shape[-1] == 2048 // tp_mesh.size()  # vocab-sharded, never gathered
            loss = token_loss(logits, mine[:, 1:]) / mine[:, 1:].numel()
            loss.backward()
        reduce_tp_grads(model, partial, tp_mesh)
        loss_value = full_value(loss).detach().clone()
        if dp > 1:
            dist.all_reduce(loss_value, group=mesh["dp_shard"].get_group())
            loss_value /= dp
        if step == 0:
            out["grad_errors"] = {n: rel_error(full(p.grad), ref_grads[n]) for n, p in params.items()}
        norm = clip_grad_norm(list(params.values()), MAX_NORM)
        if step == 0:
            out["norm"], out["ref_norm"] = norm.item(), ref_norm.item()
            out["clipped_grad_errors"] = {n: rel_error(full(p.grad), ref_params[n].grad) for n, p in params.items()}
        out["loss"].append(loss_value.item())
        out["ref_loss"].append(ref_loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    return out


def _check(outs: list[dict], name: str, rtol: float = RTOL) -> None:
    for rank, by_model in enumerate(outs):
        init = by_model[name].pop("init")
        assert not isinstance(init, str), f"{name}, rank {rank}, init_weights:\n{init}"
        assert init["n_sharded"] > 0 and not init["sharded_equal"] and not init["replicated_differ"], (name, rank, init)
        assert not init["differs_from_one_process"], (name, rank, init)
        for sp, out in by_model[name].items():
            where = (name, f"rank {rank}", "sp" if sp else "no sp")
            assert not isinstance(out, str), f"{where}:\n{out}"
            assert out["n_dtensor"] > 0
            worst = max(out["load_errors"].items(), key=lambda kv: kv[1])
            assert worst[1] == 0.0, (*where, "loaded weights differ", worst)
            for key in ("grad_errors", "clipped_grad_errors"):
                worst = max(out[key].items(), key=lambda kv: kv[1])
                assert worst[1] <= rtol, (*where, key, worst)
            assert abs(out["norm"] - out["ref_norm"]) <= rtol * out["ref_norm"], (*where, out["norm"], out["ref_norm"])
            assert out["ref_norm"] > MAX_NORM  # so that clipping did something
            for step, (got, ref) in enumerate(zip(out["loss"], out["ref_loss"])):
                assert abs(got - ref) <= rtol * abs(ref), (*where, step, got, ref)
            assert out["ref_loss"][-1] < out["ref_loss"][0]


@pytest.fixture(scope="module")
def tp2_results(folders, tmp_path_factory) -> list[dict]:
    return spawn(tp_vs_reference, 2, tmp_path_factory.mktemp("tp2"),
                  folders={name: str(f) for name, f in folders.items()}, sequence_parallel=[True, False])


@pytest.mark.parametrize("model", sorted(MODELS))
def test_tp2_matches_single_process(model, tp2_results):
    _check(tp2_results, model)


def test_fsdp2_by_tp2_matches_single_process(folders, tmp_path):
    """The 2-D mesh and order the engine will use: TP/SP -> selective AC -> FSDP2 over dp_shard (tiny-moe: MLA,
    shared + routed experts, whose plain router/expert weights live on the dp mesh next to the 2-D TP DTensors)."""
    outs = spawn(tp_vs_reference, 4, tmp_path, folders={"tiny-moe": str(folders["tiny-moe"])},
                  sequence_parallel=[True], dp=2, ac="selective")
    _check(outs, "tiny-moe")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp2_nccl_matches_single_gpu(folders, tmp_path):
    """The same comparison with NCCL on 2 GPUs (fp32; CUDA attention kernels differ more than the CPU ones)."""
    names = ["tiny-dense", "tiny-moe"]
    outs = spawn(tp_vs_reference, 2, tmp_path, folders={n: str(folders[n]) for n in names},
                  sequence_parallel=[True, False], device="cuda")
    for name in names:
        _check(outs, name, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp2_compiled_nccl_matches_single_gpu(folders, tmp_path):
    """The engine's full order on GPUs: TP/SP -> selective AC -> torch.compile per block (MLA's custom gradient
    path and the MoE's graph breaks included)."""
    outs = spawn(tp_vs_reference, 2, tmp_path, folders={"tiny-moe": str(folders["tiny-moe"])},
                  sequence_parallel=[True], ac="selective", device="cuda", compile=True)
    _check(outs, "tiny-moe", rtol=1e-3)
