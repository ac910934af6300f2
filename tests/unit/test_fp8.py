"""--fp8's rules before launch, and the filter that says which linears become float8 (parallel/fp8.py)."""

import dataclasses

import pytest
import torch

from paraseek.cli import main
from paraseek.models import resolve_model
from paraseek.models.deepseek import Transformer
from paraseek.parallel.fp8 import fp8_filter, fp8_problem


def test_the_filter_takes_block_projections_with_dims_of_16(monkeypatch):
    monkeypatch.setenv("PARASEEK_FP8_EMULATE", "1")  # no speed to weigh: every projection the GEMM takes
    args, _, _ = resolve_model("tiny-moe")
    with torch.device("meta"):
        model = Transformer(args)
    picked = {n.split(".", 2)[2] for n, m in model.named_modules()
              if fp8_filter(m, n, "rowwise") and n.startswith("layers.1.")}
    # layer 1 of tiny-moe: MLA without kv_a (40 rows: not a multiple of 16), the router and the grouped experts
    # stay out, the shared experts' projections go in; the head and embedding are never block projections
    assert picked == {"self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj", "self_attn.o_proj",
                      "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"}
    assert not fp8_filter(model.lm_head, "lm_head", "rowwise")
    assert not fp8_filter(model.embed_tokens, "embed_tokens", "rowwise")


def _named(model_name: str) -> list:
    args, _, _ = resolve_model(model_name)
    with torch.device("meta"):
        return list(Transformer(args).named_modules())


def _converted(model_name: str, recipe: str) -> set[str]:
    return {n.split(".")[-1] for n, m in _named(model_name) if fp8_filter(m, n, recipe)}


def test_on_a_gpu_only_projections_large_enough_for_float8_to_pay(monkeypatch):
    monkeypatch.delenv("PARASEEK_FP8_EMULATE", raising=False)
    # DeepSeek-LLM-7B: 4096 x 4096 attention and 4096 <-> 11008 MLP projections pay under every recipe
    seven = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert _converted("deepseek-llm-7b", "tensorwise") == _converted("deepseek-llm-7b", "rowwise") == seven
    # DeepSeek-V2-Lite, 2048 wide: under rowwise only its first (dense) layer's 2048 -> 10944 gate and up (the rest
    # have out <= 2048, or <= 4096 with in <= 2048, or in <= 1024); under tensorwise all but the 2048 -> 576 latent
    # projection (in <= 4096 and out <= 1024)
    rowwise = {n for n, m in _named("deepseek-v2-lite") if fp8_filter(m, n, "rowwise")}
    assert rowwise == {f"layers.0.mlp.{n}" for n in ("gate_proj", "up_proj")}
    assert _converted("deepseek-v2-lite", "rowwise-gw-hp") == {"gate_proj", "up_proj"}
    assert _converted("deepseek-v2-lite", "tensorwise") == {"q_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                                                            "down_proj"}
    # Llama-3.1-8B's 4096 -> 1024 k/v projections (grouped-query attention) stay bf16 under both
    assert "k_proj" not in _converted("deepseek-r1-distill-llama-8b", "tensorwise")
    assert "q_proj" in _converted("deepseek-r1-distill-llama-8b", "rowwise")


def test_where_fp8_cannot_run(monkeypatch):
    from paraseek.parallel.dims import ParallelDims

    monkeypatch.delenv("PARASEEK_FP8_EMULATE", raising=False)
    one = ParallelDims()
    assert fp8_problem("off", "cpu", None, one, lora=False) is None
    assert "needs a GPU with float8 tensor cores" in fp8_problem("rowwise", "cpu", None, one, lora=False)
    assert "this GPU has 8.0" in fp8_problem("tensorwise", "cuda", (8, 0), one, lora=False)
    assert fp8_problem("tensorwise", "cuda", (9, 0), one, lora=False) is None
    assert fp8_problem("tensorwise", "cuda", (9, 0), ParallelDims(dp_replicate=2, dp_shard=2), lora=False) is None
    assert fp8_problem("tensorwise", "cuda", (9, 0), ParallelDims(tp=2), lora=False) is None
    assert fp8_problem("rowwise", "cuda", (9, 0), ParallelDims(pp=2, pp_schedule="1F1B"), lora=False) is None
    assert "--lora-rank" in fp8_problem("rowwise", "cuda", (9, 0), one, lora=True)
    assert "not with DDP" in fp8_problem("tensorwise", "cuda", (9, 0), ParallelDims(dp_replicate=2), lora=False)


def test_train_refuses_fp8_on_cpu_in_one_line(capsys, monkeypatch):
    monkeypatch.delenv("PARASEEK_FP8_EMULATE", raising=False)
    assert main(["train", "--model", "tiny-dense", "--device", "cpu", "--nproc", "1", "--steps", "1",
                 "--fp8", "tensorwise"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--fp8 needs a GPU" in err and len(err.splitlines()) == 1, err
    assert main(["train", "--model", "tiny-dense", "--device", "cpu", "--fp8", "fp4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "fp4" in err and "tensorwise" in err and len(err.splitlines()) == 1, err


def test_fp8_experts_flag_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.setenv("PARASEEK_FP8_EMULATE", "1")
    for argv, want in ((["--model", "tiny-moe", "--fp8-experts", "on"], "adds the routed experts to --fp8"),
                       (["--model", "tiny-dense", "--fp8", "rowwise", "--fp8-experts", "on"], "has no routed experts")):
        assert main(["train", "--device", "cpu", "--nproc", "1", "--steps", "1", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert want in err and len(err.splitlines()) == 1, err
    from paraseek.parallel.dims import fp8_experts_problem

    assert "needs a Hopper GPU" in fp8_experts_problem("tensorwise", "cuda", (8, 9))
    assert "this GPU has 10.0" in fp8_experts_problem("tensorwise", "cuda", (10, 0))
    assert fp8_experts_problem("rowwise", "cuda", (9, 0)) is None


# ---- the routed experts' float8 grouped GEMM (models/fp8_grouped.py), emulated -----------------------------------
def test_rowwise_fp8_scales_are_powers_of_two_and_round_within_e4m3():
    from paraseek.models.fp8_grouped import E4M3_MAX, rowwise_fp8

    t = torch.randn(64, 48, dtype=torch.float64) * torch.logspace(-3, 3, 64, dtype=torch.float64)[:, None]
    t8, inv = rowwise_fp8(t, dim=-1)
    assert t8.dtype == torch.float8_e4m3fn and inv.shape == (64,) and inv.is_contiguous()
    assert torch.equal(torch.exp2(torch.round(torch.log2(inv))), inv)  # powers of two
    scaled_amax = t8.float().abs().amax(dim=-1)
    assert (scaled_amax <= E4M3_MAX).all() and (scaled_amax >= E4M3_MAX / 2).all()  # the largest exponent that fits
    back = t8.double() * inv.double()[:, None]
    normal = t8.float().abs() >= 2 ** -6  # e4m3's smallest normal: 3 mantissa bits, relative error <= 2^-4 there
    assert ((back - t).abs() <= t.abs() * 2 ** -4)[normal].all()


def test_pad_groups_puts_each_expert_on_a_multiple_of_16_rows():
    from paraseek.models.fp8_grouped import pad_groups

    counts = torch.tensor([5, 0, 17, 10, 16])
    dest, padded, n_pad = pad_groups(counts, 48)
    starts = torch.cumsum(padded, 0) - padded
    assert n_pad == 128 and n_pad % 16 == 0 and int(padded.sum()) == n_pad  # the static bound 48 + 15 * 5, to 16
    assert (padded % 16 == 0).all() and (padded >= counts).all()
    # expert e's rows keep their order and start at its padded group's start
    want = torch.cat([starts[e] + torch.arange(int(c)) for e, c in enumerate(counts)])
    assert torch.equal(dest, want)


def test_fp8_grouped_mm_against_plain_float32(monkeypatch):
    """The emulated float8 experts against an fp32 computation written out here: the forward and dx are the float8
    casts' rounding away (e4m3: 3 mantissa bits), and dw (a bf16 GEMM on the GPU) is dy_e^T x_e exactly."""
    monkeypatch.setenv("PARASEEK_FP8_EMULATE", "1")
    from paraseek.models.fp8_grouped import fp8_grouped_mm

    torch.manual_seed(0)
    counts = torch.tensor([7, 0, 33, 24])
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(4, 48, 32, requires_grad=True)
    dy = torch.randn(64, 48)
    fp8_grouped_mm(x, w, counts).backward(dy)
    rows = [slice(int(a), int(b)) for a, b in zip(torch.cumsum(counts, 0) - counts, torch.cumsum(counts, 0))]
    y_ref = torch.cat([x[r] @ w[e].t() for e, r in enumerate(rows)])
    dx_ref = torch.cat([dy[r] @ w[e] for e, r in enumerate(rows)])
    dw_ref = torch.stack([dy[r].t() @ x[r] for r in rows])
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    y = fp8_grouped_mm(x, w, counts)
    assert 1e-3 < rel(y, y_ref.detach()) < 0.06 and 1e-3 < rel(x.grad, dx_ref) < 0.06  # quantized, not exact
    assert torch.allclose(w.grad, dw_ref, rtol=1e-5, atol=1e-5) and w.grad[1].abs().max() == 0


def test_float8_experts_pad_without_changing_what_they_compute(monkeypatch):
    """Experts under --fp8-experts pad each expert's rows to 16 with zeros for the GPU kernel: the rows out, their
    input gradient and the weight gradients are those of the same float8 GEMMs on the unpadded rows (the emulation
    takes any group size), since every scale is per row."""
    monkeypatch.setenv("PARASEEK_FP8_EMULATE", "1")
    import torch.nn.functional as F

    from paraseek.models.deepseek import Experts
    from paraseek.models.fp8_grouped import fp8_grouped_mm

    torch.manual_seed(0)
    experts = Experts(4, 32, 16)
    for p in experts.parameters():
        torch.nn.init.normal_(p, 0, 0.1)
    counts = torch.tensor([9, 0, 30, 1])
    x = torch.randn(40, 32, requires_grad=True)
    experts.fp8 = True
    padded = torch.autograd.grad(experts(x, counts).square().sum(), [x, *experts.parameters()])
    h = F.silu(fp8_grouped_mm(x, experts.gate_proj, counts)) * fp8_grouped_mm(x, experts.up_proj, counts)
    y = fp8_grouped_mm(h, experts.down_proj, counts)
    unpadded = torch.autograd.grad(y.square().sum(), [x, *experts.parameters()])
    for a, b in zip(padded, unpadded):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


# ---- the planner's fp8 terms (planner/cost.py) --------------------------------------------------------------------
def _times(model: str, gpus: int, **plan):
    from paraseek.planner import Plan, make_cluster
    from paraseek.planner.cost import step_time
    from paraseek.planner.memory import model_terms

    args, _, _ = resolve_model(model)
    return {f: step_time(model_terms(args, 4096), make_cluster("H200", gpus), Plan(fp8=f, **plan), 16).items
            for f in ("off", "tensorwise", "rowwise", "rowwise-gw-hp")}


def test_fp8_prices_the_block_projections_and_the_float8_all_gather():
    from paraseek.planner import make_cluster
    from paraseek.planner.cost import FP8_CAST_BYTES, FP8_LINEAR_SPEEDUP, fp8_terms
    from paraseek.planner.memory import model_terms, rank_shares

    args, _, _ = resolve_model("deepseek-llm-7b")
    s = rank_shares(model_terms(args, 4096), 1, 1, 1, 1, "none")[0]
    head = 6 * args.vocab_size * args.dim
    t = _times("deepseek-llm-7b", 2, dp_shard=2, micro_batch_size=2)
    hbm = make_cluster("H200", 2).hbm_gbps * 1e9
    for recipe in ("tensorwise", "rowwise", "rowwise-gw-hp"):
        # only the projections speed up (the output head stays in bf16), and their casts move FP8_CAST_BYTES an
        # element of each one's input and output gradient: q, k, v, o 4096 x 4096, gate, up, down 4096 x 11008
        k_plus_n, k_times_n = 4 * (4096 + 4096) + 3 * (4096 + 11008), 4 * 4096 * 4096 + 3 * 4096 * 11008
        assert fp8_terms(args, recipe)[1] == pytest.approx(k_plus_n / (6 * k_times_n), rel=1e-12)
        tokens = 4 * 2 * 4096  # 4 micro-batches of 2 x 4096 a rank
        casts = tokens * (s.linear_flops - head) * fp8_terms(args, recipe)[1] * FP8_CAST_BYTES / hbm
        gemm = t["off"]["compute_linear"] * ((s.linear_flops - head) / FP8_LINEAR_SPEEDUP[recipe] + head) / (
            s.linear_flops)
        assert t[recipe]["compute_linear"] == pytest.approx(gemm + casts, rel=1e-9)
        assert t[recipe]["compute_attention"] == t["off"]["compute_attention"]
    # tensorwise all-gathers the projections in float8 (half the bytes); the rowwise recipes gather bf16
    assert t["tensorwise"]["fsdp_comm"] < t["off"]["fsdp_comm"]
    assert t["rowwise"]["fsdp_comm"] == t["off"]["fsdp_comm"]
    assert FP8_LINEAR_SPEEDUP["tensorwise"] > FP8_LINEAR_SPEEDUP["rowwise"] > FP8_LINEAR_SPEEDUP["rowwise-gw-hp"] > 1


def test_no_float8_all_gather_under_tensor_parallelism():
    """With --tp the weights are cast inside each linear and FSDP2 gathers bf16 (parallelize.py): the tp-sharded
    projections and MLA's replicated latent ones sit on different meshes, which torchao's one-pass scale precompute
    cannot stack."""
    from paraseek.parallel.dims import ParallelDims, float8_all_gather

    assert float8_all_gather(ParallelDims(dp_shard=2), "tensorwise")
    assert not float8_all_gather(ParallelDims(dp_shard=2, tp=2), "tensorwise")
    assert not float8_all_gather(ParallelDims(dp_shard=2), "rowwise")


def test_the_float8_all_gather_and_its_eager_casts_only_where_there_is_a_gather():
    from paraseek.planner import make_cluster
    from paraseek.planner.cost import FP8_GATHER_CAST_BYTES
    from paraseek.planner.memory import model_terms, rank_shares

    args, _, _ = resolve_model("deepseek-llm-7b")
    one = _times("deepseek-llm-7b", 1, dp_shard=1, micro_batch_size=2)
    two = _times("deepseek-llm-7b", 2, dp_shard=2, micro_batch_size=2)
    # one shard: the weights are cast inside the compiled linears (the factor holds that), FSDP2 copies bf16
    assert one["tensorwise"]["fp8_gather_casts"] == 0 and one["tensorwise"]["fsdp_copies"] == one["off"]["fsdp_copies"]
    assert all(t["fp8_gather_casts"] == 0 for f, t in two.items() if f != "tensorwise")
    # two shards: each rank casts its half of the projections, 16 B a parameter, in each of the 2 gathers of each of
    # the 4 micro-batches of each rank (16 sequences over 2 ranks at 2 each), at the H200's memory rate
    s = rank_shares(model_terms(args, 4096), 1, 1, 1, 1, "none")[0]
    want = 4 * 2 * FP8_GATHER_CAST_BYTES * (s.dense - s.root) / 2 / (make_cluster("H200", 2).hbm_gbps * 1e9)
    assert two["tensorwise"]["fp8_gather_casts"] == pytest.approx(want, rel=1e-9)


def test_the_search_keeps_fp8_and_refuses_it_without_float8_cores():
    from paraseek.errors import UserError
    from paraseek.planner import make_cluster, search
    from paraseek.train.config import TrainConfig

    args, _, _ = resolve_model("deepseek-llm-7b")
    res = search(args, make_cluster("H200", 2), 4096, 16, engine_only=True, fp8="rowwise")
    assert res.plans and all(e.plan.fp8 == "rowwise" for e in res.plans)
    assert "--fp8 rowwise" in res.plans[0].plan.flags()
    assert TrainConfig(model="deepseek-llm-7b", fp8="tensorwise").to_plan().fp8 == "tensorwise"
    with pytest.raises(UserError, match="A100-80GB has no float8 tensor cores"):
        search(args, make_cluster("A100-80GB", 8), 4096, 64, fp8="tensorwise")


def test_the_float8_experts_term_against_its_formula_and_the_measured_break_even():
    """--fp8-experts: the routed experts' forward and input gradient (two of their three GEMM passes) at the float8
    grouped GEMM's rate relative to bf16's, FP8_GROUPED_SPEEDUP x (rows + 450) / (rows + FP8_GROUPED_HALF_ROWS),
    computed here by hand from the bf16 term; nothing else in the step moves. It is slower than bf16 at 768 rows
    per expert (V2-Lite at micro-batch 2: measured 0.96x the tensorwise step) and faster from 3,072 (1.05x)."""
    from paraseek.planner import Plan, make_cluster
    from paraseek.planner.cost import (FP8_GROUPED_HALF_ROWS, FP8_GROUPED_SPEEDUP, GROUPED_HALF_ROWS,
                                       MOE_LAYER_OVERHEAD_S, step_time)
    from paraseek.planner.memory import model_terms

    args = dataclasses.replace(resolve_model("deepseek-v2-lite")[0], n_layers=6)
    n_moe = args.n_layers - args.first_k_dense_replace
    for mbs, faster in ((2, False), (8, True), (16, True)):
        rows = mbs * 4096 * args.n_activated_experts / args.n_routed_experts  # 768, 3,072, 6,144
        bf16, fp8 = (step_time(model_terms(args, 4096), make_cluster("H200", 1),
                               Plan(micro_batch_size=mbs, compile=True, fp8="tensorwise", fp8_experts=on), mbs).items
                     for on in (False, True))
        gemm = bf16["compute_experts"] - n_moe * MOE_LAYER_OVERHEAD_S  # the routing kernels stay
        rate = FP8_GROUPED_SPEEDUP * (rows + GROUPED_HALF_ROWS) / (rows + FP8_GROUPED_HALF_ROWS)
        assert fp8["compute_experts"] - bf16["compute_experts"] == pytest.approx(gemm * 2 / 3 * (1 / rate - 1),
                                                                                rel=1e-9)
        assert (fp8["compute_experts"] < bf16["compute_experts"]) == faster, mbs
        assert {k: v for k, v in fp8.items() if k != "compute_experts"} == {
            k: v for k, v in bf16.items() if k != "compute_experts"}


@pytest.mark.parametrize("torch_version, kept", [("2.11.0+cu130", True), ("2.13.0+cpu", False)])
def test_full_checkpointing_keeps_the_float8_experts_outputs_before_torch_2_13(torch_version, kept, monkeypatch):
    """Under full checkpointing of compiled blocks, torch before 2.13 saves the float8 experts' GEMM outputs (gate,
    up: Fe wide; down: D wide; bf16, each routed row, every MoE layer) instead of recomputing them (measured on one
    H200: +17.9 GiB on V2-Lite cut to 6 layers at mbs 16, +35.7 at mbs 32, BENCHMARKS.md "Float8 routed experts";
    pytorch#177396). Only there, and only with the flag."""
    import importlib.metadata

    from paraseek.planner import Plan, make_cluster
    from paraseek.planner.cost import (FP8_GROUPED_HALF_ROWS, FP8_GROUPED_SPEEDUP, FULL_AC_RECOMPUTE,
                                       GROUPED_HALF_ROWS, MOE_LAYER_OVERHEAD_S, step_time)
    from paraseek.planner.memory import compiled_ac_saves_fp8_expert_outputs, memory, model_terms

    monkeypatch.setattr(importlib.metadata, "version", lambda name: torch_version)
    compiled_ac_saves_fp8_expert_outputs.cache_clear()
    args = dataclasses.replace(resolve_model("deepseek-v2-lite")[0], n_layers=6)
    terms, c = model_terms(args, 4096), make_cluster("H200", 1)
    plan = Plan(micro_batch_size=16, compile=True, activation_checkpointing="full", fp8="tensorwise")
    try:
        off, on = (memory(terms, c, plan.replace(fp8_experts=e), 16).items["activations"] for e in (False, True))
        want = 5 * 16 * 4096 * 6 * 2 * (2 * 1408 + 2048)  # 5 MoE layers x rows x bf16 x (gate + up + down)
        assert on - off == (pytest.approx(want, rel=1e-12) if kept else 0)
        if kept:
            assert want / 2**30 == pytest.approx(17.8, abs=0.05)  # measured: +17.9 GiB
        for ac in ("none", "selective"):  # nothing extra where nothing is recomputed the plain way
            assert len({memory(terms, c, plan.replace(activation_checkpointing=ac, fp8_experts=e), 16).total
                        for e in (False, True)}) == 1
        # and the time: kept outputs are not recomputed, so the experts' float8 passes lose their recompute share
        rows = 16 * 4096 * 6 / 64
        rate = FP8_GROUPED_SPEEDUP * (rows + GROUPED_HALF_ROWS) / (rows + FP8_GROUPED_HALF_ROWS)
        gemm = [step_time(terms, c, plan.replace(fp8_experts=e), 16).items["compute_experts"] - 5 * MOE_LAYER_OVERHEAD_S
                for e in (False, True)]
        passes = 1 / 3 + ((1.0 if kept else FULL_AC_RECOMPUTE) - 1 / 3) / rate
        assert gemm[1] / gemm[0] == pytest.approx(passes / FULL_AC_RECOMPUTE, rel=1e-9)
    finally:
        compiled_ac_saves_fp8_expert_outputs.cache_clear()


_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not _HOPPER, reason="float8 grouped GEMMs need a Hopper GPU")])])
def test_what_full_checkpointing_of_compiled_float8_experts_saves(device, monkeypatch):
    """The planner's rule (memory.compiled_ac_saves_fp8_expert_outputs: on torch < 2.13 a compiled, fully
    checkpointed block keeps the float8 experts' GEMM outputs, pytorch#177396) against what the installed torch does:
    a compiled toy expert MLP on fp8_grouped_mm (emulated on CPU), the bytes its forward saves for backward as
    saved-tensor hooks see them. Without checkpointing they include the GEMM outputs; under full checkpointing only
    the input where the rule says so."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from paraseek.models.fp8_grouped import fp8_grouped_mm
    from paraseek.planner.memory import compiled_ac_saves_fp8_expert_outputs

    if device == "cpu":
        monkeypatch.setenv("PARASEEK_FP8_EMULATE", "1")
    E, D, F, rows = 4, 64, 128, 32  # experts, dim, expert width, rows per expert (multiples of 16)

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w_in = torch.nn.Parameter(torch.randn(E, F, D, device=device, dtype=torch.bfloat16) / D**0.5)
            self.w_out = torch.nn.Parameter(torch.randn(E, D, F, device=device, dtype=torch.bfloat16) / F**0.5)

        def forward(self, x_MD):
            counts_E = torch.full((E,), rows, device=device, dtype=torch.int64)
            h_MF = torch.nn.functional.silu(fp8_grouped_mm(x_MD * 1.5, self.w_in, counts_E))
            return fp8_grouped_mm(h_MF, self.w_out, counts_E) + x_MD

    def saved_bytes(module) -> int:
        torch.compiler.reset()
        module.compile()
        x = torch.randn(E * rows, D, device=device, dtype=torch.bfloat16, requires_grad=True)
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            y = module(x)
        y.float().square().mean().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
        return sum(sizes)

    input_bytes = E * rows * D * 2
    torch.manual_seed(0)
    assert saved_bytes(Experts()) > 2 * input_bytes  # the hooks see the compiled graph's saved GEMM outputs
    full = saved_bytes(checkpoint_wrapper(Experts(), preserve_rng_state=False))
    assert (full > input_bytes) == compiled_ac_saves_fp8_expert_outputs(), (torch.__version__, full, input_bytes)


def test_the_planner_prices_the_projections_the_filter_converts(monkeypatch):
    """planner/cost.py's fp8_terms (from the shapes models/lora_spec lists) against the model's own nn.Linear run
    through parallel/fp8.py's filter: the share of block-projection GEMM FLOPs in float8, and the elements their casts
    touch (each converted one's input and output gradient) per block-projection GEMM FLOP."""
    from paraseek.planner.cost import fp8_terms

    monkeypatch.delenv("PARASEEK_FP8_EMULATE", raising=False)
    for name in ("deepseek-llm-7b", "deepseek-v2-lite", "deepseek-r1-distill-llama-8b",
                 "deepseek-r1-distill-qwen-1.5b"):
        args, _, _ = resolve_model(name)
        linears = [(n, m) for n, m in _named(name) if isinstance(m, torch.nn.Linear)
                   and n.split(".")[-2:-1] in (["self_attn"], ["mlp"], ["shared_experts"])]
        total = sum(m.in_features * m.out_features for _, m in linears)
        for recipe in ("tensorwise", "rowwise"):
            fp8 = sum(m.in_features * m.out_features for n, m in linears if fp8_filter(m, n, recipe))
            assert fp8_terms(args, recipe)[0] == pytest.approx(fp8 / total, rel=1e-12), (name, recipe)
            cast = sum(m.in_features + m.out_features for n, m in linears if fp8_filter(m, n, recipe))
            assert fp8_terms(args, recipe)[1] == pytest.approx(cast / (6 * total), rel=1e-12), (name, recipe)
    assert fp8_terms(resolve_model("deepseek-llm-7b")[0], "rowwise")[0] == 1.0
    # V2-Lite's 2048-wide projections cast about 2.3x the elements per FLOP of the 7B's 4096-wide ones
    ratio = fp8_terms(resolve_model("deepseek-v2-lite")[0], "tensorwise")[1] / fp8_terms(
        resolve_model("deepseek-llm-7b")[0], "tensorwise")[1]
    assert 2.2 < ratio < 2.4
