"""Where a decode step's time goes, on the GPU machine: engine step vs graph replay vs the kernels inside it, and
for an offline run the wall time of eager (mixed prefill) steps against graph (decode-only) steps.

    python scripts/gpu/decode_profile.py MODEL [--batch 1] [--offline N] [engine flags as for bench-infer]

Prints lines starting with PROFILE (one JSON object each) and the profiler's top kernels of one replay.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
import torch

from paraseek.cli import build_parser
from paraseek.infer.build import build_engine
from paraseek.infer.ranks import place
from paraseek.infer.load import resolve_source
from paraseek.infer.sampling import SamplingParams


def main() -> None:
    argv = sys.argv[1:]
    opts = {"--batch": "1", "--offline": "0", "--short": "", "--input": "128"}
    for flag in list(opts):
        if flag in argv:
            i = argv.index(flag)
            opts[flag] = argv[i + 1]
            del argv[i:i + 2]
    batch, offline, prompt_len = int(opts["--batch"]), int(opts["--offline"]), int(opts["--input"])
    if opts["--short"]:  # the GQA decode kernel's short-context partitions: P,C (0,0 turns them off)
        from paraseek.infer import kernels

        kernels.SHORT_PARTITION, kernels.SHORT_CONTEXT = (int(x) for x in opts["--short"].split(","))
    ns = build_parser().parse_args(["bench-infer", *argv, "--random-weights"])
    src = resolve_source(ns.model, random_weights=True, tokenizer=None)
    if getattr(ns, "layers", None):  # bench-infer's --layers: the architecture cut to its first N layers
        src.args = src.args.replace(n_layers=ns.layers, n_mtp_layers=0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    engine = build_engine(ns, src, place(ns, dev), log=lambda *a, **k: None)
    runner = engine.runner
    seen = []
    run = runner.run

    def spy(hb, *rest):  # the runner's other argument (the decode rows' input sources) passed through as given
        seen.append(hb)
        return run(hb, *rest)

    runner.run = spy
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    # The engine's decode steps at `batch` sequences of `--input` + 256 tokens (at most --max-num-seqs of them).
    params = SamplingParams(max_tokens=256 if prompt_len + 256 <= engine.max_model_len else 16, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [(7 * i + j) % 1000 + 1 for j in range(prompt_len)], params)
    step_s = []
    while engine.has_work():
        t0 = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t0)
    decode = step_s[2:]
    hb = next(h for h in reversed(seen) if h.n_decode == len(h.ids) == batch)
    # Tokens the overlapped step patched in on the device: random ids, not one id for every row (rows with one token
    # route alike, so a replay of a MoE model would read a few experts instead of the engine's spread).
    ids_rng = np.random.default_rng(1)
    hb.ids = np.where(hb.ids < 0, ids_rng.integers(1, engine.args.vocab_size, size=len(hb.ids)), hb.ids)
    runner.run = run
    key = runner.graph_key(hb)
    out = {"model": ns.model, "batch": batch, "input": prompt_len, "short": opts["--short"],
           "engine_step_ms": 1e3 * statistics.median(decode), "graph": key}
    reps = 200
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        runner.run(hb)
        sync()
    out["run_sync_ms"] = 1e3 * (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        runner.run(hb)
    sync()
    out["run_nosync_ms"] = 1e3 * (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        logits = runner.run(hb)
        logits.argmax(-1).tolist()
    out["run_argmax_tolist_ms"] = 1e3 * (time.perf_counter() - t0) / reps
    if key is not None:
        g = runner.graphs[key][0]
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            g.replay()
        sync()
        out["replay_only_ms"] = 1e3 * (time.perf_counter() - t0) / reps
    print("PROFILE " + json.dumps(out), flush=True)
    if dev == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                runner.run(hb)
            sync()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70))

    if offline:
        import random

        rng = random.Random(0)
        kinds = {"graph": [0, 0.0, 0], "eager": [0, 0.0, 0]}

        def timed(hb, *rest):
            t0 = time.perf_counter()
            r = run(hb, *rest)
            sync()
            k = kinds["graph" if runner.graph_key(hb) is not None else "eager"]
            k[0] += 1
            k[1] += time.perf_counter() - t0
            k[2] += len(hb.ids)
            return r

        runner.run = timed
        for i in range(offline):
            n, m = rng.randint(64, 1024), rng.randint(64, 512)
            if n + m > engine.max_model_len:  # a CPU dry run on a tiny model
                n, m = n * engine.max_model_len // 2048, m * engine.max_model_len // 2048
            engine.add_request(f"o{i}", [rng.randrange(1, 1000) for _ in range(n)], SamplingParams(max_tokens=m, ignore_eos=True))
        t0, before = time.perf_counter(), engine.num_generated
        while engine.has_work():
            engine.step()
        wall = time.perf_counter() - t0
        out_tokens = engine.num_generated - before
        print("PROFILE " + json.dumps({"offline": offline, "wall_s": wall, "output_tokens_per_s": out_tokens / wall,
                                       **{f"{k}_steps": v[0] for k, v in kinds.items()},
                                       **{f"{k}_s": v[1] for k, v in kinds.items()},
                                       **{f"{k}_tokens": v[2] for k, v in kinds.items()}}), flush=True)


if __name__ == "__main__":
    main()
