"""The MoE ops' shared rules, used by both the plain-torch reference (moe.py) and the Triton kernels (moe_kernels.py):
the routing and expert arguments each op accepts, the bound on an expert-major layout's tiles, and the kernels'
tile configs read from moe_configs.json (its format: moe.py's docstring). Shape legend: moe.py's."""

from __future__ import annotations

import functools
import json
from pathlib import Path

CONFIG_FILE = Path(__file__).with_name("moe_configs.json")
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
SCORE_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def _check_route_args(E: int, score_func: str, topk_method: str, n_group: int, topk_group: int, top_k: int) -> bool:
    """Validate; True when the experts are chosen within groups (as Gate: any method but greedy, n_group > 1)."""
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"route: score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    if topk_method not in TOPK_METHODS:
        raise ValueError(f"route: topk_method must be one of {TOPK_METHODS}, got {topk_method!r}")
    if not 1 <= top_k <= E:
        raise ValueError(f"route: top_k={top_k} must be in [1, {E}]")
    grouped = topk_method != "greedy" and n_group > 1
    if grouped:
        if E % n_group:
            raise ValueError(f"route: {E} experts do not split into {n_group} groups")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"route: topk_group={topk_group} must be in [1, n_group={n_group}]")
        if topk_method == "noaux_tc" and E // n_group < 2:
            raise ValueError("route: noaux_tc ranks groups by their top-2 scores: groups need >= 2 experts")
        if topk_group * (E // n_group) < top_k:
            raise ValueError(f"route: topk_group={topk_group} groups of {E // n_group} experts hold fewer than "
                             f"top_k={top_k}")
    return grouped


def max_tiles(n_slots: int, n_experts: int, block_m: int) -> int:
    """Tiles the expert-major layout can need, from shapes only: sum_e cdiv(c_e, BLOCK_M) over the m <= min(E, S)
    experts with c_e > 0 slots is m + sum_e floor((c_e - 1) / BLOCK_M) <= m + (S - m) // BLOCK_M, which grows
    with m. Tighter than the S + E (BLOCK_M - 1) padded rows of a bound per expert: at batch 1 of DeepSeek-V3
    (9 slots, 257 experts) 9 tiles rather than 242, so the GEMM grids hold no programs that only return."""
    m = min(n_experts, n_slots)
    return m + (n_slots - m) // block_m


def _check_moe_args(x_ND, w13_EXD, w2_EDF, weights_NK, idx_NK, n_shared) -> None:
    E, X, D = w13_EXD.shape
    if x_ND.dim() != 2 or x_ND.shape[1] != D:
        raise ValueError(f"fused_moe: x is {tuple(x_ND.shape)}, expected [N, {D}]")
    if X % 2 or w2_EDF.shape != (E, D, X // 2):
        raise ValueError(f"fused_moe: w13 {tuple(w13_EXD.shape)} and w2 {tuple(w2_EDF.shape)} are not [E, 2F, D] "
                         "and [E, D, F]")
    if weights_NK.shape != idx_NK.shape or idx_NK.shape[0] != x_ND.shape[0]:
        raise ValueError(f"fused_moe: weights {tuple(weights_NK.shape)} and idx {tuple(idx_NK.shape)} must both be "
                         f"[{x_ND.shape[0]}, K]")
    if not 0 <= n_shared < E:
        raise ValueError(f"fused_moe: n_shared={n_shared} must be in [0, {E})")


# ---- tile configs -------------------------------------------------------------------------------------------------
def config_key(n_experts: int, F_: int, D: int) -> str:
    return f"E={n_experts},F={F_},D={D}"


@functools.lru_cache(maxsize=1)
def _config_file() -> dict:
    if not CONFIG_FILE.is_file():
        return {}
    return json.loads(CONFIG_FILE.read_text())


def default_config(n_tokens: int, n_slots_per_token: int, n_experts: int) -> dict:
    """The fallback tile config: BLOCK_M the smallest of 16, 32, 64 holding the mean slots per expert (decode
    spreads its few slots over many experts, so most tiles hold 1-2 real rows and BLOCK_M = 16 wastes the least);
    64 output columns and 128-wide reduction steps, 4 stages to keep weight loads in flight (a decode step is bound
    by reading the expert weights)."""
    mean = n_tokens * n_slots_per_token / max(n_experts, 1)
    block_m = 16 if mean <= 16 else (32 if mean <= 48 else 64)
    return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)


def moe_config(n_tokens: int, n_slots_per_token: int, n_experts: int, F_: int, D: int) -> dict:
    """The tile config for N tokens over stacked weights [E_total, 2F, D]: the file's entry for the smallest
    listed token count >= N (the largest beyond them all), else `default_config`."""
    table = _config_table(config_key(n_experts, F_, D))
    if not table:
        return default_config(n_tokens, n_slots_per_token, n_experts)
    for count, cfg in table:
        if n_tokens <= count:
            return dict(cfg)
    return dict(table[-1][1])


@functools.lru_cache(maxsize=None)
def _config_table(key: str) -> tuple:
    """A shape's (token count, config) pairs in ascending order (parsed once: the lookup runs every step)."""
    entry = _config_file().get(key) or {}
    return tuple(sorted((int(k), v) for k, v in entry.get("configs", {}).items()))


def format_config_file(data: dict) -> str:
    """moe_configs.json's text: one line per token count, so a diff after tuning shows what changed."""
    lines = ["{"]
    for i, (key, entry) in enumerate(data.items()):
        lines.append(f"  {json.dumps(key)}: {{")
        lines.append(f"    \"source\": {json.dumps(entry.get('source', ''))},")
        lines.append("    \"configs\": {")
        table = sorted(entry["configs"].items(), key=lambda kv: int(kv[0]))
        for j, (count, cfg) in enumerate(table):
            body = ", ".join(f"{json.dumps(k)}: {int(cfg[k])}" for k in CONFIG_KEYS)
            lines.append(f"      {json.dumps(str(count))}: {{{body}}}" + ("," if j < len(table) - 1 else ""))
        lines.append("    }")
        lines.append("  }" + ("," if i < len(data) - 1 else ""))
    lines.append("}")
    return "\n".join(lines) + "\n"
