"""Host time per decode step of grammar-constrained requests, on the CPU: 32 json_schema requests (bench/serve.py's
five-field record) against 32 free-text ones on tiny-dense with a vocabulary of 128,256 (DeepSeek-R1-Distill-Llama's
width; the bundled tokenizer's 2,048 tokens, the other ids never allowed), greedy, 128 tokens at most.

Each full decode step (all 32 requests in it) is split into: the grammar work (structured.py: advancing the matchers
and filling the masks), apply_masks (sampling.py: the masks applied to the logits) and the rest (scheduling, the
tiny forward, sampling, delivery). The tiny model's forward is a small part of the rest, so the grammar's share here
is the host time it adds to every step of a real model.

    PYTHONPATH=src python scripts/bench_structured_host.py [--requests 32] [--max-tokens 128] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch

from paraseek.bench.serve import STRUCTURED_SCHEMA
from paraseek.infer import sampling, structured
from paraseek.infer.config import EngineConfig
from paraseek.infer.engine import Engine
from paraseek.infer.sampling import SamplingParams
from paraseek.models import ModelArgs, build_model, preset_config
from paraseek.models.tokenizer import BUNDLED_TOKENIZER, load_text_tokenizer

VOCAB = 128256
TIMED = {"grammar": [], "apply_masks": []}


@contextmanager
def timed(owner, names: list[str], bucket: str):
    """Wrap owner.NAME for each name that exists, adding its wall time to TIMED[bucket]."""
    saved = {}
    for name in names:
        fn = getattr(owner, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def wrapper(*a, _fn=fn, **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                TIMED[bucket].append(time.perf_counter() - t0)
        setattr(owner, name, wrapper)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(owner, name, fn)


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    steps = []
    while engine.has_work():
        for v in TIMED.values():
            v.clear()
        t0 = time.perf_counter()
        done = engine.step()
        dt = time.perf_counter() - t0
        if len(done) == len(prompts):  # a decode step of every request
            steps.append((dt, sum(TIMED["grammar"]), sum(TIMED["apply_masks"])))
    engine.flush()
    total = statistics.median(s[0] for s in steps)
    grammar = statistics.median(s[1] for s in steps)
    masks = statistics.median(s[2] for s in steps)
    return {"steps": len(steps), "step_ms": total * 1e3, "grammar_ms": grammar * 1e3, "apply_masks_ms": masks * 1e3,
            "rest_ms": (total - grammar - masks) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating; the fastest is shown "
                    "(other processes on the machine slow some runs)")
    args = ap.parse_args()
    tok = load_text_tokenizer(BUNDLED_TOKENIZER)
    cfg = preset_config("tiny-dense")
    cfg["vocab_size"] = VOCAB
    torch.manual_seed(0)
    model = build_model(ModelArgs.from_hf_config(cfg), "cpu", torch.float32).eval()
    engine = Engine(model, EngineConfig(num_kv_blocks=2048, max_num_seqs=args.requests), tokenizer=tok,
                    log=lambda *_: None)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2000, (16,), generator=g).tolist() for _ in range(args.requests)]
    spec = {"type": "json_schema", "schema": STRUCTURED_SCHEMA}
    # compiled once before timing (the server compiles off the engine thread)
    structured.backend_for(tok, VOCAB, engine.stop_token_ids).compile(spec)
    with torch.no_grad(), \
            timed(structured.Constraint, ["advance", "bitmask_W"], "grammar"), \
            timed(getattr(structured, "StepMasks", None), ["fill"], "grammar"), \
            timed(sampling, ["apply_masks"], "apply_masks"):
        modes = {"free": SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True),
                 "json": SamplingParams(max_tokens=args.max_tokens, temperature=0, structured=spec)}
        results = {name: [] for name in modes}
        for _ in range(args.repeats):
            for name, params in modes.items():
                results[name].append(run(engine, prompts, params))
    print(f"{args.requests} requests, vocabulary {VOCAB:,}, torch threads {torch.get_num_threads()}; "
          "medians over full decode steps (ms)")
    print(f"{'':6} {'steps':>6} {'step':>8} {'grammar':>8} {'masks':>8} {'rest':>8}")
    for name, runs in results.items():
        r = min(runs, key=lambda x: x["step_ms"])
        print(f"{name:6} {r['steps']:>6} {r['step_ms']:>8.2f} {r['grammar_ms']:>8.2f} {r['apply_masks_ms']:>8.2f} "
              f"{r['rest_ms']:>8.2f}")


if __name__ == "__main__":
    main()
