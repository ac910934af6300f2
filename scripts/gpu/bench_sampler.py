"""Milliseconds per sample step of infer/sampling.py's `sample` (on the device, tokens left there: to_host=False, as
the engine's overlapped steps call it) for 1/64/256/1024 rows of bf16 logits over the V3 (129,280) and Llama-3
(128,256) vocabularies: greedy, temperature 0.8, top-p 0.95, top-k 50 + top-p 0.95, and seeded rows (temperature
0.8 / top-p 0.95, a seed each). Rows are built as the engine builds them: a noise key (seed, output position) on
every row where the sampler takes one, a torch.Generator on the seeded rows.

  PYTHONPATH=src python3 scripts/gpu/bench_sampler.py [--before-src /path/to/other/checkout/src] [--iters 50]

--before-src times that checkout's sampling.py in the same process (loaded from its file; its imports resolve to
this checkout's package) in a column beside this one's.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top-p": dict(temperature=0.8, top_p=0.95),
    "top-k+top-p": dict(temperature=0.8, top_k=50, top_p=0.95),
    "seeded": dict(temperature=0.8, top_p=0.95, seed=0),
}
ROWS = [1, 64, 256, 1024]
VOCABS = [129_280, 128_256]
DEVICE = "cuda"


def load_sampling(src: str):
    path = Path(src) / "paraseek" / "infer" / "sampling.py"
    if not path.is_file():
        sys.exit(f"bench_sampler: no sampling.py at {path}")
    spec = importlib.util.spec_from_file_location("before_sampling", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["before_sampling"] = mod
    spec.loader.exec_module(mod)
    return mod


def make_rows(mod, case: dict, B: int) -> list:
    keyed = "seed" in mod.SampleRow.__dataclass_fields__
    rows = []
    for i in range(B):
        params = mod.SamplingParams(**{**case, **({"seed": 1000 + i} if "seed" in case else {})}).validate()
        gen = torch.Generator(device=DEVICE).manual_seed(params.seed) if params.seed is not None else None
        extra = dict(seed=1000 + i, position=17) if keyed else {}
        rows.append(mod.SampleRow(params, [], [], gen, **extra))
    return rows


def time_ms(mod, logits_BV: torch.Tensor, rows: list, iters: int) -> float:
    for _ in range(3):
        mod.sample(logits_BV, rows, to_host=False)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        mod.sample(logits_BV, rows, to_host=False)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before-src", help="another checkout's src/ whose sampler is timed beside this one")
    ap.add_argument("--iters", type=int, default=50)
    ns = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_sampler: needs a GPU")
    from paraseek.infer import sampling

    mods = {"after": sampling}
    if ns.before_src:
        mods = {"before": load_sampling(ns.before_src), **mods}
    print(f"{'vocab':>7} {'rows':>5} {'case':<12} " + " ".join(f"{n + ' ms':>10}" for n in mods)
          + ("   after/before" if len(mods) == 2 else ""))
    for V in VOCABS:
        for B in ROWS:
            logits_BV = torch.randn(B, V, device="cuda", dtype=torch.bfloat16) * 3
            for name, case in CASES.items():
                ms = [time_ms(m, logits_BV, make_rows(m, case, B), ns.iters) for m in mods.values()]
                ratio = f"   {ms[1] / ms[0]:.2f}" if len(ms) == 2 else ""
                print(f"{V:>7} {B:>5} {name:<12} " + " ".join(f"{x:>10.3f}" for x in ms) + ratio, flush=True)


if __name__ == "__main__":
    main()
