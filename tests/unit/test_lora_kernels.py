"""The many-adapter LoRA delta of one fused projection on CPU: a plain per-token loop (each token its own slot's A and
B, float64) against the masked torch path of LoRALinear and against the plain-torch reference of the Triton kernels'
contract (infer/lora_kernels.py); LoRALinear routes to that contract when the platform's kernels are on. One, two
and three pieces, tokens of every slot and of the base (-1) in one call, adapters of ranks below the slots' rank, a
piece an adapter leaves out, an empty slot. The Triton kernels themselves are held to the reference in
tests/gpu/test_lora_kernels_gpu.py."""

from types import SimpleNamespace

import pytest
import torch

from numerics import rel_error
from paraseek.infer import lora_kernels, ops
from paraseek.infer.lora import LoRALinear, LoRASlots, Piece

I, L, R = 40, 4, 8
ROWS = {1: (24,), 2: (16, 16), 3: (16, 8, 8)}  # the pieces' output rows: o_proj-like, gate|up, q|k|v
IDX = [-1, 0, 1, 2, 3, 0, -1, 3, 1, 1, 0]  # slot 2 stays empty


def _projection(n_pieces: int, dtype: torch.dtype):
    """A LoRALinear of `n_pieces` pieces over L slots of rank R: slot 0 rank 2 on every piece, slot 1 rank 8 on the
    first piece only, slot 3 rank 5 on the first and last; the per-slot weights for the loop."""
    g = torch.Generator().manual_seed(n_pieces)
    rows = ROWS[n_pieces]
    base = torch.nn.Linear(I, sum(rows), bias=True).to(dtype)
    with torch.no_grad():
        base.weight.copy_(torch.randn(sum(rows), I, generator=g))
        base.bias.copy_(torch.randn(sum(rows), generator=g))
    pieces = [Piece(f"p{k}", sum(rows[:k]), rows[k]) for k in range(n_pieces)]
    slots = LoRASlots(L, R, None, "cpu", dtype)
    lin = LoRALinear(base, slots, 0, pieces, I)
    ranks = {0: {k: 2 for k in range(n_pieces)}, 1: {0: 8}, 3: {0: 5, n_pieces - 1: 5}}  # slot -> piece -> rank
    weights = {s: {f"layers.0.p{k}": (torch.randn(r, I, generator=g), torch.randn(rows[k], r, generator=g) * 0.1)
                   for k, r in pk.items()} for s, pk in ranks.items()}
    for s, ws in weights.items():
        lin.load(s, ws)
    return lin, base, pieces, weights


def _per_token_loop(x, base, pieces, weights, idx):
    """y[t] = W x[t] + b + sum over its slot's pieces of B_p (A_p x[t]), token by token, in float64."""
    ref = x.double() @ base.weight.double().T + base.bias.double()
    for t, s in enumerate(idx):
        for name, (a, b) in weights.get(s, {}).items():
            p = pieces[int(name[-1])]
            ref[t, p.start:p.start + p.rows] += b.double() @ (a.double() @ x[t].double())
    return ref


def _reference_contract(lin, x, idx_N):
    y = lin.base(x)
    ws = lora_kernels.shrink_reference(x, lin.a_PXI, idx_N, len(lin.pieces), R)
    return lora_kernels.expand_reference_(y, ws, lin.b_OX, idx_N, [p.start for p in lin.pieces])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_pieces", [1, 2, 3])
def test_reference_contract_and_masked_path_equal_a_per_token_loop(n_pieces, dtype):
    lin, base, pieces, weights = _projection(n_pieces, dtype)
    g = torch.Generator().manual_seed(10 + n_pieces)
    x = torch.randn(len(IDX), I, generator=g).to(dtype)
    idx_N = torch.tensor(IDX)
    lin.slots.begin(SimpleNamespace(lora=idx_N))
    with torch.no_grad():
        masked = lin(x)
        contract = _reference_contract(lin, x, idx_N)
        plain = base(x)
    ref = _per_token_loop(x.float(), base, pieces, weights, IDX)
    untouched = torch.tensor([s in (-1, 2) for s in IDX])  # the base, and an empty slot
    assert torch.equal(contract[untouched], plain[untouched])  # exactly: base rows are not written
    assert torch.equal(masked[untouched], plain[untouched])
    # fp32: both are the loop to fp32 rounding. bf16: the base GEMM and x A^T are rounded to bf16 (as served), so
    # both are the fp64 loop to bf16's resolution, and to each other to a few bf16 ulps (only the order of the fp32
    # sums differs).
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    assert rel_error(masked, ref) < tol
    assert rel_error(contract, ref) < tol
    assert rel_error(contract, masked) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert rel_error(contract[~untouched], plain[~untouched]) > 1e-2  # the adapters matter


def test_shrink_reference_reads_only_the_tokens_own_slot():
    """Another slot's A holding inf reaches no other token (the reference gathers, it does not mask a product)."""
    lin, *_ = _projection(3, torch.float32)
    lin.a_PXI.view(3, L, R, I)[:, 2] = float("inf")
    idx_N = torch.tensor(IDX)
    x = torch.randn(len(IDX), I, generator=torch.Generator().manual_seed(3))
    ws = lora_kernels.shrink_reference(x, lin.a_PXI, idx_N, 3, R)
    assert ws.shape == (len(IDX), 3, 1, R)
    assert torch.isfinite(ws[idx_N != 2]).all() and (ws[idx_N < 0] == 0).all()
    assert not torch.isfinite(ws[idx_N == 2]).any()  # its own token does see it


@pytest.mark.parametrize("n_pieces", [1, 3])
def test_lora_linear_uses_the_kernels_contract_when_kernels_are_on(n_pieces, monkeypatch):
    """With the platform's kernels on, LoRALinear calls lora_kernels.shrink and expand_ (here swapped for their
    reference, which the GPU test holds the Triton kernels to) and gives the masked path's output."""
    lin, *_ = _projection(n_pieces, torch.float32)
    idx_N = torch.tensor(IDX)
    x = torch.randn(len(IDX), I, generator=torch.Generator().manual_seed(4))
    lin.slots.begin(SimpleNamespace(lora=idx_N))
    with torch.no_grad():
        masked = lin(x)
        calls = []
        monkeypatch.setattr(lora_kernels, "shrink", lambda *a: calls.append("shrink") or
                            lora_kernels.shrink_reference(*a))
        monkeypatch.setattr(lora_kernels, "expand_", lambda *a: calls.append("expand_") or
                            lora_kernels.expand_reference_(*a))
        monkeypatch.setattr(ops, "kernels_on", lambda: True)
        routed = lin(x)
    assert calls == ["shrink", "expand_"]
    assert rel_error(routed, masked) < 1e-6
