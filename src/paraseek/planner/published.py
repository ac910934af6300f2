"""The planner against published large runs.

`published_runs.json` holds runs other trainers published (TorchTitan, the Llama 3 paper, Megatron-LM's paper,
DeepSeek-V3's report): the model (a hub-style config.json), the GPUs, the layout and precision as the source states
them, and the source's speed (tokens/s/GPU, MFU, teraFLOP/s per GPU or GPU hours per trillion tokens, each turned
into tokens/s/GPU with the source's own FLOP count). `check()` prices every row as the planner prices a plan of that
layout: what the source states is fixed, what it does not (a micro-batch size, virtual stages) is the planner's
fastest choice among the values listed in the row's `free`. Rows check the planner, they are not fitted to it; a
cluster whose compute rate no datasheet gives (TorchTitan's 500 W H100s) is calibrated on one named row, which is
then left out of the checked set. `python -m paraseek.planner.published` prints the table of docs/planner.md, and
`--docs docs/planner.md` writes it there.
"""

from __future__ import annotations

import functools
import itertools
import json
import statistics
from dataclasses import dataclass, fields, replace
from pathlib import Path

from paraseek.models.args import ModelArgs, resolve_model
from paraseek.planner.cost import step_time
from paraseek.planner.memory import model_terms
from paraseek.planner.plan import ATTENTION, EP_DISPATCH, Cluster, Plan, make_cluster
from paraseek.planner.search import Evaluated, _rank_key, evaluate

TABLE = Path(__file__).with_name("published_runs.json")


@functools.cache
def table() -> dict:
    return json.loads(TABLE.read_text())


@functools.cache
def model_args(name: str) -> ModelArgs:
    """A row's model: a config of the table, or a preset."""
    cfg = table()["models"].get(name)
    return ModelArgs.from_hf_config(cfg) if cfg is not None else resolve_model(name)[0]


def measured_tokens_per_s(row: dict) -> float:
    """The source's speed in tokens/s/GPU, with the source's own FLOP count where it gives FLOPs:
    - tokens_per_s_per_gpu: as given (TorchTitan's TPS/GPU);
    - mfu: PaLM's model FLOPs (6 x non-embedding params + 12 L H Q T, Chowdhery et al. 2023, appendix B), which is
      the planner's MFU numerator (stats.flops_per_token), against the GPU's datasheet bf16 peak;
    - megatron_tflops_per_gpu: Narayanan et al. 2021's eq. 3, F = 96 B s l h^2 (1 + s/6h + V/16lh) per iteration of
      B sequences, recomputation included;
    - gpu_hours_per_trillion_tokens: 1e12 tokens over that many GPU hours."""
    a, kind, value = model_args(row["model"]), row["metric"], float(row["value"])
    if kind == "tokens_per_s_per_gpu":
        return value
    if kind == "mfu":
        spec = make_cluster(table()["hardware"][row["hardware"]]["gpu_type"], 1).peak_tflops
        return value * spec * 1e12 / model_terms(a, row["seq_len"]).flops_per_token
    if kind == "megatron_tflops_per_gpu":
        s, l, h, V = row["seq_len"], a.n_layers, a.dim, a.vocab_size
        return value * 1e12 / (96 * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)))
    if kind == "gpu_hours_per_trillion_tokens":
        return 1e12 / (value * 3600)
    raise ValueError(f"{row['id']}: unknown metric {kind!r}")


def _cluster(name: str, n_gpus: int, matmul_scale: float = 1.0) -> Cluster:
    hw = table()["hardware"][name]
    c = make_cluster(hw["gpu_type"], n_gpus, hw.get("gpus_per_node"), hw.get("inter_node_gbps"))
    if "memory_gib" in hw:
        c = replace(c, memory_gib=hw["memory_gib"])
    if "hbm_gbps" in hw:
        c = replace(c, hbm_gbps=hw["hbm_gbps"] * c.eff.hbm)
    return replace(c, matmul_tflops=c.matmul_tflops * matmul_scale)


_PLAN_FIELDS = {f.name for f in fields(Plan)}


def candidates(row: dict) -> list[Plan]:
    """The row's plan: its stated fields, and every combination of its `free` ones."""
    free = row.get("free", {})
    bad = (set(row["plan"]) | set(free)) - _PLAN_FIELDS
    if bad:
        raise ValueError(f"{row['id']}: not Plan fields: {sorted(bad)}")
    base = Plan(**row["plan"])
    if base.ep_dispatch not in EP_DISPATCH or base.attention not in ATTENTION:
        raise ValueError(f"{row['id']}: ep_dispatch one of {EP_DISPATCH}, attention one of {ATTENTION}")
    keys = list(free)
    return [base.replace(**dict(zip(keys, values, strict=True))) for values in itertools.product(*free.values())]


def _valid(a: ModelArgs, p: Plan, seq_len: int, gbs: int) -> bool:
    if gbs % p.dp or (gbs // p.dp) % p.micro_batch_size:
        return False
    if p.pp > 1 and (p.pp_schedule in ("GPipe", "1F1B")) != (p.pp_virtual_stages == 1):
        return False
    return not p.problem(a, seq_len, p.n_microbatches(gbs), engine=False)


def price(row: dict, matmul_scale: float = 1.0) -> Evaluated:
    """The planner's best candidate of the row (memory headroom first, then speed, as the search ranks). A row with
    "memory_checked": false is priced for time even where the planner's memory says it does not fit (its trainer
    keeps memory the planner does not model, e.g. DeepSeek-V3's BF16 optimizer moments and ZeRO-1)."""
    a, c = model_args(row["model"]), _cluster(row["hardware"], row["gpus"], matmul_scale)
    seq, gbs = row["seq_len"], row["global_batch_size"]
    best = None
    for p in candidates(row):
        if not _valid(a, p, seq, gbs):
            continue
        ev = evaluate(a, c, p, seq, gbs)
        if ev.reason and row.get("memory_checked", True) is False:
            ev.time = step_time(model_terms(a, seq), c, p, gbs)
            ev.tokens_per_s_per_gpu = gbs * seq / ev.time.total / p.world
            ev.mfu = model_terms(a, seq).flops_per_token * ev.tokens_per_s_per_gpu / (c.peak_tflops * 1e12)
            ev.reason = ""
        if ev.reason:
            continue
        if best is None or _rank_key(ev) > _rank_key(best):
            best = ev
    if best is None:
        raise ValueError(f"{row['id']}: no candidate plan fits")
    return best


@functools.cache
def calibration(hardware: str) -> float:
    """The matmul scale of a hardware entry with `calibrate_on`: the factor on the planner's GEMM ceiling at which the
    named row's prediction equals its measurement (bisection), 1 for the others."""
    on = table()["hardware"][hardware].get("calibrate_on")
    if not on:
        return 1.0
    row = next(r for r in table()["rows"] if r["id"] == on)
    target = measured_tokens_per_s(row)
    lo, hi = 0.2, 2.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if price(row, mid).tokens_per_s_per_gpu < target else (lo, mid)
    return (lo + hi) / 2


@dataclass
class Result:
    row: dict
    evaluated: Evaluated
    measured: float  # tokens/s/GPU, from the source
    predicted: float  # tokens/s/GPU, the planner
    checked: bool  # False for a row that calibrates its hardware

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1


def check() -> list[Result]:
    """Every row, priced; calibration rows come back with checked=False."""
    out = []
    for row in table()["rows"]:
        scale = calibration(row["hardware"])
        ev = price(row, scale)
        calibrates = table()["hardware"][row["hardware"]].get("calibrate_on") == row["id"]
        out.append(Result(row, ev, measured_tokens_per_s(row), ev.tokens_per_s_per_gpu, not calibrates))
    return out


def summary(results: list[Result]) -> dict:
    errs = [abs(r.error) for r in results if r.checked]
    return {"rows": len(errs), "median_abs_error": statistics.median(errs), "max_abs_error": max(errs)}


def plan_words(p: Plan) -> str:
    """The priced plan in a few words (report.plan_short, with the peers' features)."""
    from paraseek.planner.report import plan_short

    extra = [w for w, on in (("fp8 " + p.fp8, p.fp8 != "off"), ("fp8 experts", p.fp8_experts),
                             ("async TP", p.async_tp), ("DeepEP", p.ep_dispatch == "deepep"),
                             ("shared-expert overlap", p.shared_expert_overlap),
                             ("F&B overlap", p.overlap_fb), ("materialized attention", p.attention != "flash")) if on]
    return ", ".join([plan_short(p), *extra])


UNITS = {"tokens_per_s_per_gpu": "{:,.0f} tokens/s/GPU", "mfu": "{:.0%} MFU",
         "megatron_tflops_per_gpu": "{:.0f} TFLOP/s/GPU",
         "gpu_hours_per_trillion_tokens": "{:,.0f} GPU h per 1T tokens"}


def markdown(results: list[Result]) -> str:
    """The table docs/planner.md carries (between its 'published runs' markers), then its sources and summary."""
    lines = ["| row | source | GPUs | model | layout (as published) | precision | published | tokens/s/GPU | "
             "planner's plan | predicted | error |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        row = r.row
        err = f"{r.error:+.1%}" if r.checked else f"calibrates {row['hardware']}: x{calibration(row['hardware']):.3f}"
        lines.append(f"| {row['id']} | {row['source']}, {row['where']} | {row['gpus']:,} | {row['model']} | "
                     f"{row['layout']} | {row['precision']} | {UNITS[row['metric']].format(row['value'])} | "
                     f"{r.measured:,.1f} | {plan_words(r.evaluated.plan)} | {r.predicted:,.1f} | {err} |")
    s = summary(results)
    bands = table()["bands"]
    lines += ["", f"Checked rows: {s['rows']} of {len(results)}; median absolute error {s['median_abs_error']:.1%}, "
              f"max {s['max_abs_error']:.1%} (bands: {bands['median']:.0%} and {bands['row']:.0%})."]
    lines += ["", "Sources:"] + [f"- {key}: {text}" for key, text in table()["sources"].items()]
    return "\n".join(lines)


BEGIN = "<!-- published runs: begin (generated by python -m paraseek.planner.published) -->"
END = "<!-- published runs: end -->"


def write_docs(path: str | Path) -> None:
    """Replace the table between docs/planner.md's published-runs markers with the current one."""
    p = Path(path)
    text = p.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    p.write_text(f"{head}{BEGIN}\n{markdown(check())}\n{END}{tail}")


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--docs"]:  # python -m paraseek.planner.published --docs docs/planner.md
        write_docs(sys.argv[2])
    else:
        print(markdown(check()))
