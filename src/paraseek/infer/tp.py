"""Serving tensor parallelism (Megatron-LM, Shoeybi et al. 2019): plain column/row-parallel weights, not training's
DTensor plans -- decode is bound by host latency, and this way a step is ordinary tensors in a CUDA graph.

Per block: q/k/v (MLA: q or q_b, and kv_b) split by heads (column), o_proj split by its input (row), one
all-reduce after attention; gate/up column, down row, one all-reduce after the MLP. Routed experts are split the
same way along their hidden width, so each rank computes every token's experts for its slice and the MLP's
all-reduce sums them -- no token dispatch. MLA's latent projection, the norms and the router stay whole: the latent
cache is held whole on every rank. The head is split by vocabulary (its logits all-gathered); the embedding stays
whole. GQA with fewer kv heads than ranks replicates each kv head over tp / n_kv_heads ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from paraseek.errors import UserError
from paraseek.models.args import ModelArgs
from paraseek.models.deepseek import MLA, MLP, MoE, Transformer


def check_tp(a: ModelArgs, tp: int) -> None:
    """The engine's tp rules, before any weight loads: one line naming what does not divide."""
    if tp < 1:
        raise UserError(f"--tp must be >= 1, got {tp}")
    if tp == 1:
        return
    if a.n_heads % tp:
        raise UserError(f"--tp {tp} does not divide the model's {a.n_heads} attention heads")
    if not a.is_mla and a.n_kv_heads % tp and tp % a.n_kv_heads:
        raise UserError(f"--tp {tp}: the model's {a.n_kv_heads} kv heads neither divide by it nor divide it")
    widths = {"intermediate_size": a.inter_dim}
    if a.n_routed_experts:
        widths["moe_intermediate_size"] = a.moe_inter_dim
        if a.n_shared_experts:
            widths["shared experts' width"] = a.moe_inter_dim * a.n_shared_experts
    for what, w in widths.items():
        if w % tp:
            raise UserError(f"--tp {tp} does not divide the model's {what} {w}")


def _rows(w: torch.Tensor, rank: int, tp: int, dim: int = 0, unit: int = 1) -> torch.Tensor:
    """This rank's contiguous share of dim (in whole units of `unit` rows, e.g. one head), as a new tensor."""
    n = w.shape[dim] // unit
    per = n // tp
    return w.narrow(dim, rank * per * unit, per * unit).contiguous()


def _set(lin: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    lin.weight = nn.Parameter(weight, requires_grad=False)
    if lin.bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None


@torch.no_grad()
def shard_model(model: Transformer, rank: int, tp: int) -> None:
    """Cut a whole model's weights down to tp rank `rank`'s share, in place (the whole tensors are freed)."""
    a = model.args
    for layer in model.layers.values():
        attn = layer.self_attn
        if isinstance(attn, MLA):
            qk = attn.nope_dim + attn.rope_dim
            q = attn.q_b_proj if attn.q_lora_rank else attn.q_proj
            _set(q, _rows(q.weight, rank, tp, 0, qk))
            _set(attn.kv_b_proj, _rows(attn.kv_b_proj.weight, rank, tp, 0, attn.nope_dim + attn.v_dim))
            _set(attn.o_proj, _rows(attn.o_proj.weight, rank, tp, 1, attn.v_dim))
        else:
            D = a.head_dim
            _set(attn.q_proj, _rows(attn.q_proj.weight, rank, tp, 0, D),
                 _rows(attn.q_proj.bias, rank, tp, 0, D) if attn.q_proj.bias is not None else None)
            if a.n_kv_heads % tp == 0:
                kv = [(_rows(lin.weight, rank, tp, 0, D), _rows(lin.bias, rank, tp, 0, D) if lin.bias is not None else None)
                      for lin in (attn.k_proj, attn.v_proj)]
            else:  # fewer kv heads than ranks: rank r keeps kv head r * n_kv // tp
                h = rank * a.n_kv_heads // tp
                kv = [(lin.weight[h * D:(h + 1) * D].clone(), lin.bias[h * D:(h + 1) * D].clone() if lin.bias is not None else None)
                      for lin in (attn.k_proj, attn.v_proj)]
            _set(attn.k_proj, *kv[0])
            _set(attn.v_proj, *kv[1])
            bias = attn.o_proj.bias
            _set(attn.o_proj, _rows(attn.o_proj.weight, rank, tp, 1, D),
                 (bias if rank == 0 else torch.zeros_like(bias)) if bias is not None else None)  # added once
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            ex = mlp.experts
            ex.gate_proj = nn.Parameter(_rows(ex.gate_proj, rank, tp, 1), requires_grad=False)
            ex.up_proj = nn.Parameter(_rows(ex.up_proj, rank, tp, 1), requires_grad=False)
            ex.down_proj = nn.Parameter(_rows(ex.down_proj, rank, tp, 2), requires_grad=False)
            if mlp.shared_experts is not None:
                _shard_mlp(mlp.shared_experts, rank, tp)
        else:
            _shard_mlp(mlp, rank, tp)
    head = model.lm_head.weight if model.lm_head is not None else model.embed_tokens.weight
    V = head.shape[0]
    pad = -V % tp  # vocabularies that tp does not divide: zero rows, their logits cut after the gather
    if pad:
        head = torch.cat([head, head.new_zeros((pad, head.shape[1]))])
    model.tp_head_w = _rows(head, rank, tp)
    model.lm_head = None  # the split copy replaces it (a tied head keeps the whole embedding for the input side)


def _shard_mlp(mlp: MLP, rank: int, tp: int) -> None:
    _set(mlp.gate_proj, _rows(mlp.gate_proj.weight, rank, tp, 0))
    _set(mlp.up_proj, _rows(mlp.up_proj.weight, rank, tp, 0))
    _set(mlp.down_proj, _rows(mlp.down_proj.weight, rank, tp, 1))
