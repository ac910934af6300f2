"""Serving tensor parallelism's rules (Megatron-LM, Shoeybi et al. 2019): plain column/row-parallel weights, not
training's DTensor plans -- decode is bound by host latency, and this way a step is ordinary tensors in a CUDA
graph. The weights are cut while the inference model is built (infer/model.py): q/k/v (MLA: q or q_b, and kv_b)
by heads, o_proj by its input, gate/up and down and every expert (shared ones too) by their hidden width, the head
by vocabulary. This file checks, before any weight loads, that the model's dimensions divide. With --ep N as well
(infer/ep.py) the routed experts go whole by expert index instead, so their width need not divide.
"""

from __future__ import annotations

from paraseek.errors import UserError
from paraseek.models.args import ModelArgs


def check_tp(a: ModelArgs, tp: int, ep: int = 1) -> None:
    """The engine's tp rules, before any weight loads: one line naming what does not divide (`ep` > 1: the
    routed experts are not cut by width)."""
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
        if ep == 1:
            widths["moe_intermediate_size"] = a.moe_inter_dim
        if a.n_shared_experts:
            widths["shared experts' width"] = a.moe_inter_dim * a.n_shared_experts
    for what, w in widths.items():
        if w % tp:
            raise UserError(f"--tp {tp} does not divide the model's {what} {w}")
