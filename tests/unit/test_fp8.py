"""--fp8's rules before launch, the filters that say which linears and routed experts become float8 (parallel/fp8.py),
the routed experts' padded grouped GEMM (models/deepseek.py; its float8 kernel is CUDA-only: tests/gpu) and the
planner's fp8 terms."""

import pytest
import torch

from paraseek.cli import main
from paraseek.models import resolve_model
from paraseek.models import deepseek
from paraseek.models.deepseek import Experts, MoE, Transformer, grouped_mm, pad_groups, padded_grouped_mm
from paraseek.parallel.fp8 import apply_fp8, experts_filter, fp8_experts, fp8_filter, fp8_problem


def test_the_filter_takes_block_projections_with_dims_of_16():
    args, _, _ = resolve_model("tiny-moe")
    with torch.device("meta"):
        model = Transformer(args)
    picked = {n.split(".", 2)[2] for n, m in model.named_modules() if fp8_filter(m, n) and n.startswith("layers.1.")}
    # layer 1 of tiny-moe: MLA without kv_a (40 rows: not a multiple of 16), the router and the grouped experts
    # (experts_filter's) stay out, the shared experts' projections go in; the head and embedding are never block
    # projections
    assert picked == {"self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj", "self_attn.o_proj",
                      "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"}
    assert not fp8_filter(model.lm_head, "lm_head") and not fp8_filter(model.embed_tokens, "embed_tokens")


def test_where_fp8_cannot_run(monkeypatch):
    monkeypatch.delenv("PARASEEK_FP8_EMULATE", raising=False)
    common = dict(tp=1, pp=1, lora=False, ddp=False)
    assert fp8_problem("off", "cpu", None, **common) is None
    assert "needs a GPU with float8 tensor cores" in fp8_problem("rowwise", "cpu", None, **common)
    assert "this GPU has 8.0" in fp8_problem("tensorwise", "cuda", (8, 0), **common)
    assert fp8_problem("tensorwise", "cuda", (9, 0), **common) is None
    assert "--fp8 with --tp is not supported yet" in fp8_problem("tensorwise", "cuda", (9, 0), **{**common, "tp": 2})
    assert "not with DDP" in fp8_problem("tensorwise", "cuda", (9, 0), **{**common, "ddp": True})


def test_train_refuses_fp8_on_cpu_in_one_line(capsys, monkeypatch):
    monkeypatch.delenv("PARASEEK_FP8_EMULATE", raising=False)
    assert main(["train", "--model", "tiny-dense", "--device", "cpu", "--nproc", "1", "--steps", "1",
                 "--fp8", "tensorwise"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--fp8 needs a GPU" in err and len(err.splitlines()) == 1, err
    assert main(["train", "--model", "tiny-dense", "--device", "cpu", "--fp8", "fp4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "fp4" in err and "tensorwise" in err and len(err.splitlines()) == 1, err


# ---- the routed experts: float8 grouped GEMM on groups padded to 16 rows (models/deepseek.py) ----------------------
COUNTS = [0, 17, 16, 0, 1, 32, 5, 0]  # empty experts, multiples of 16 already, uneven


def _group_gemm(x_pad, w_EIO, offs_E):
    """A stand-in for torchao's float8 grouped GEMM with its contract: every group a multiple of 16 rows, and the
    rows outside the groups left unwritten (NaN here, so a result that read them would show it)."""
    ends = offs_E.tolist()
    assert offs_E.dtype == torch.int32 and x_pad.shape[0] % 16 == 0 and ends[-1] <= x_pad.shape[0]
    assert all((b - a) % 16 == 0 for a, b in zip([0] + ends, ends))
    y = torch.full((x_pad.shape[0], w_EIO.shape[-1]), float("nan"), dtype=x_pad.dtype)
    for e, (a, b) in enumerate(zip([0] + ends, ends)):
        y[a:b] = x_pad[a:b] @ w_EIO[e]
    return y


def test_pad_groups_places_each_expert_at_a_multiple_of_16():
    counts = torch.tensor(COUNTS)
    dest, offs, n_pad = pad_groups(counts, int(counts.sum()))
    padded = [(c + 15) // 16 * 16 for c in COUNTS]
    assert offs.dtype == torch.int32 and offs.tolist() == torch.tensor(padded).cumsum(0).tolist()
    # static: a bound, not the data's; a multiple of 16 (the float8 weight-gradient GEMM's stride alignment)
    assert n_pad == (sum(COUNTS) + len(COUNTS) * 15) // 16 * 16 >= offs[-1] and n_pad % 16 == 0
    starts = [0] + offs.tolist()[:-1]
    want = [starts[e] + j for e, c in enumerate(COUNTS) for j in range(c)]
    assert dest.tolist() == want
    for counts in ([16] * 8, [1] * 8, [0] * 7 + [71], [15] * 8):  # the bound holds at its extremes
        _, offs, n_pad = pad_groups(torch.tensor(counts), sum(counts))
        assert offs[-1] <= n_pad


def test_padded_grouped_mm_equals_the_unpadded_one_exactly():
    # Small integers: every product and sum is exact in fp32, so any difference is a misplaced row.
    counts = torch.tensor(COUNTS)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (int(counts.sum()), 32), generator=gen).float()
    w = torch.randint(-3, 4, (len(COUNTS), 48, 32), generator=gen).float()
    dy = torch.randint(-3, 4, (int(counts.sum()), 48), generator=gen).float()
    res = []
    for padded in (True, False):
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = padded_grouped_mm(xx, ww, counts, _group_gemm) if padded else grouped_mm(xx, ww, counts, use_grouped=False)
        y.backward(dy)
        res.append((y.detach(), xx.grad, ww.grad))
    for got, want in zip(*res):
        assert torch.equal(got, want)
    assert (res[0][2][counts == 0] == 0).all()  # experts without rows: zero weight gradient


def test_padding_compiles_without_a_graph_break():
    # The padding as the GPU runs it under torch.compile: no host sync, no data-dependent shape, forward and backward
    # (torch._grouped_mm stands in for the float8 GEMM; torch 2.13 runs it on CPU, in bf16).
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    counts = torch.tensor(COUNTS)
    x = torch.randn(int(counts.sum()), 32, dtype=torch.bfloat16)
    w = torch.randn(len(COUNTS), 48, 32, dtype=torch.bfloat16)

    def fn(x, w, counts):
        y = padded_grouped_mm(x, w, counts, lambda a, b, offs: torch._grouped_mm(a, b, offs=offs))
        return y.float().square().sum()

    res = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = f(xx, ww, counts)
        loss.backward()
        res.append((loss.detach(), xx.grad, ww.grad))
    for got, want in zip(*res):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_moe_with_fp8_experts_runs_the_padded_gemm(monkeypatch):
    args, _, _ = resolve_model("tiny-moe")
    torch.manual_seed(0)
    moe = MoE(args)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 24, args.dim)
    calls = []

    def gemm(*a):
        calls.append(1)
        return _group_gemm(*a)

    monkeypatch.setattr(deepseek, "_fp8_grouped_gemm", gemm)  # the float8 kernel's place, CUDA-only
    res = []
    for fp8 in (True, False):
        moe.experts.fp8_grouped = fp8
        moe.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        out = moe(xx)
        out.square().sum().backward()
        res.append((out.detach(), xx.grad, moe.experts.gate_proj.grad, moe.experts.down_proj.grad))
    assert len(calls) == 3  # gate, up, down
    for got, want in zip(*res):  # fp32 GEMMs of other row counts: the last bits may differ
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_apply_fp8_marks_the_routed_experts_only_where_the_grouped_kernel_runs(monkeypatch):
    args, _, _ = resolve_model("tiny-moe")  # dim 64, expert width 32: the grouped GEMM takes them
    with torch.device("meta"):
        model = Transformer(args)
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts and all(experts_filter(m) for m in experts) and not any(m.fp8_grouped for m in experts)
    apply_fp8(model, "tensorwise", fsdp=False, experts=True)
    assert all(m.fp8_grouped for m in experts)
    with torch.device("meta"):
        assert not experts_filter(Experts(4, 64, 40))  # 40 not a multiple of 16
    # CPU emulation (PARASEEK_FP8_EMULATE=1) has no float8 grouped GEMM: the experts keep the ordinary path
    monkeypatch.setenv("PARASEEK_FP8_EMULATE", "1")
    assert not fp8_experts()
    with torch.device("meta"):
        model = Transformer(args)
    apply_fp8(model, "rowwise", fsdp=False)
    assert not any(m.fp8_grouped for m in model.modules() if isinstance(m, Experts))


# ---- the planner's fp8 terms (planner/cost.py) --------------------------------------------------------------------
def _times(model: str, gpus: int, **plan):
    from paraseek.planner import Plan, make_cluster
    from paraseek.planner.cost import step_time
    from paraseek.planner.memory import model_terms

    args, _, _ = resolve_model(model)
    return {f: step_time(model_terms(args, 4096), make_cluster("H200", gpus), Plan(fp8=f, **plan), 16).items
            for f in ("off", "tensorwise", "rowwise", "rowwise-gw-hp")}


def test_fp8_prices_the_block_projections_and_the_float8_all_gather():
    from paraseek.planner.cost import FP8_LINEAR_SPEEDUP
    from paraseek.planner.memory import model_terms, rank_shares

    args, _, _ = resolve_model("deepseek-llm-7b")
    s = rank_shares(model_terms(args, 4096), 1, 1, 1, 1, "none")[0]
    head = 6 * args.vocab_size * args.dim
    t = _times("deepseek-llm-7b", 2, dp_shard=2, micro_batch_size=2)
    for recipe in ("tensorwise", "rowwise", "rowwise-gw-hp"):
        # only the projections speed up; the output head stays in bf16
        want = ((s.linear_flops - head) / FP8_LINEAR_SPEEDUP[recipe] + head) / s.linear_flops
        assert t[recipe]["compute_linear"] / t["off"]["compute_linear"] == pytest.approx(want, rel=1e-9)
        assert t[recipe]["compute_attention"] == t["off"]["compute_attention"]
    # tensorwise all-gathers the projections in float8 (half the bytes); the rowwise recipes gather bf16
    assert t["tensorwise"]["fsdp_comm"] < t["off"]["fsdp_comm"]
    assert t["rowwise"]["fsdp_comm"] == t["off"]["fsdp_comm"]
    assert FP8_LINEAR_SPEEDUP["tensorwise"] > FP8_LINEAR_SPEEDUP["rowwise"] > FP8_LINEAR_SPEEDUP["rowwise-gw-hp"] > 1


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


def test_fp8_prices_the_routed_experts_at_the_rowwise_factor():
    from paraseek.planner import Plan, make_cluster
    from paraseek.planner.cost import FP8_LINEAR_SPEEDUP, step_time
    from paraseek.planner.memory import model_terms

    plan = dict(dp_shard=8, ep=8, micro_batch_size=2, compile=True)  # compiled: not host-bound
    t = _times("deepseek-v2-lite", 8, **plan)
    for recipe in ("tensorwise", "rowwise", "rowwise-gw-hp"):
        # the experts are always rowwise (their fixed per-layer overhead does not speed up) ...
        assert 1 / FP8_LINEAR_SPEEDUP["rowwise"] < t[recipe]["compute_experts"] / t["off"]["compute_experts"] < 1
        # ... so the step gains more than the dense projections' share
        linear_saved = t["off"]["compute_linear"] - t[recipe]["compute_linear"]
        assert sum(t["off"].values()) - sum(t[recipe].values()) > 1.5 * linear_saved, recipe
    # Ada has no float8 grouped GEMM (sm90 only): its experts stay bf16
    args, _, _ = resolve_model("deepseek-v2-lite")
    ada = {f: step_time(model_terms(args, 4096), make_cluster("L40S", 8), Plan(fp8=f, **plan), 16).items
           for f in ("off", "rowwise")}
    assert ada["rowwise"]["compute_experts"] == ada["off"]["compute_experts"]
