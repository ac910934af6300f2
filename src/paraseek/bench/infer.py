"""`paraseek bench-infer`: the engine's offline throughput (N requests, given or sampled lengths, outputs forced to
their length), batch-1 latency (time to first token, ms per output token) and a concurrency sweep, each beside its
roofline: a decode step cannot beat (weights it reads + the KV cache it reads) / HBM rate, a prefill cannot beat
its FLOPs / the matmul rate. Both rates are measured at the start of the run on this GPU (a device-to-device copy,
an 8192^3 bf16 GEMM), so the ratio is against this machine, not a datasheet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paraseek.errors import UserError, check_plot, parse_range


@dataclass
class StepCost:
    """The work of the steps run so far (from the engine's step inputs) and its roofline time."""

    weight_bytes: float  # read by any step (dense part; experts by the share a batch touches)
    expert_bytes: float
    expert_frac: Any  # batch size -> share of routed-expert bytes a decode step of that size touches
    kv_bytes_per_token: float
    flops_per_token: float  # 2 x active params (matmuls), no attention
    attn_flops_per_pair: float  # one query-key pair over all layers and heads (scores + values)
    hbm: float  # B/s
    matmul: float  # FLOP/s
    floor_s: float = 0.0
    steps: int = 0
    log: list = field(default_factory=list)

    def add(self, hb) -> float:
        nd = hb.n_decode
        ctx = float(hb.context_lens.sum()) if nd else 0.0
        pre = sum(q for q, _ in hb.lens)
        pairs = ctx + sum(q * k - q * (q - 1) / 2 for q, k in hb.lens)
        n = nd + pre
        bytes_ = self.weight_bytes + self.expert_bytes * self.expert_frac(n) + (ctx + sum(k for _, k in hb.lens)) \
            * self.kv_bytes_per_token
        flops = self.flops_per_token * n + self.attn_flops_per_pair * pairs
        floor = max(bytes_ / self.hbm, flops / self.matmul)
        self.floor_s += floor
        self.steps += 1
        return floor


def measure_ceilings(device) -> dict[str, float]:
    import torch

    if device.type != "cuda":
        return {"hbm_gbps": float("nan"), "matmul_tflops": float("nan")}
    x = torch.empty(2**30, dtype=torch.uint8, device=device)  # 1 GiB: far beyond L2
    y = torch.empty_like(x)

    def timed(fn, reps):
        fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)

    hbm = 2 * x.numel() / timed(lambda: y.copy_(x), 10)  # bytes read + written
    del x, y
    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    tflops = 2 * 8192**3 / timed(lambda: m @ m, 10) / 1e12
    del m
    torch.cuda.empty_cache()
    return {"hbm_gbps": hbm / 1e9, "matmul_tflops": tflops}


def step_cost(engine, ceilings: dict[str, float]) -> StepCost:
    a = engine.args
    b = engine.runner.model.decode_bytes()  # this rank's weights by how a decode step reads them (infer/model.py)
    E, K = max(a.n_routed_experts, 1), a.n_activated_experts
    frac = (lambda n: 1 - (1 - K / E) ** n) if a.n_routed_experts else (lambda n: 0.0)
    elt = engine.runner.dtype.itemsize
    active = (b["dense"] + b["routed"] * (K / E if a.n_routed_experts else 0)) / elt  # parameters a token multiplies
    qk = a.kv_lora_rank + a.qk_rope_head_dim if a.is_mla else a.head_dim  # absorbed MLA decode reads the latent
    v = a.kv_lora_rank if a.is_mla else a.head_dim
    heads = a.n_heads // engine.tp
    return StepCost(b["dense"], b["routed"], frac, engine.report.bytes_per_token, 2 * active,
                    2 * a.n_layers * heads * (qk + v), ceilings["hbm_gbps"] * 1e9, ceilings["matmul_tflops"] * 1e12)


def _timed_engine(engine, cost: StepCost):
    """Wrap the runner so each forward's inputs are priced; returns the list of (wall_s, floor_s, n_decode,
    n_tokens, drafter): a speculative drafter's forward (infer/spec.py) is logged but not priced (the rooflines
    count the target's work)."""
    run = engine.runner.run
    log: list = []

    def priced(hb, patch=None):
        t0 = time.perf_counter()
        out = run(hb, patch)
        drafter = hb.hidden_rows is not None
        log.append([t0, 0.0 if drafter else cost.add(hb), hb.n_decode, len(hb.ids), drafter])
        return out

    engine.runner.run = priced
    return log


def _lengths(spec: str, n: int, rng, what: str) -> list[int]:
    lo, hi = parse_range(spec, f"--{what}")
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def sample_requests(n: int, input_len: str, output_len: str, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """The throughput workload: n (random prompt, output length) pairs, lengths uniform in the given ranges. A
    function of its arguments alone, so the baselines (scripts/gpu/hf_requests_baseline.py) replay the same set."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ins, outs = _lengths(input_len, n, rng, "input-len"), _lengths(output_len, n, rng, "output-len")
    return [(rng.integers(0, vocab, size=k).tolist(), o) for k, o in zip(ins, outs)]


WORKLOADS = ("latency", "throughput", "concurrency")


def check_workloads(ns: argparse.Namespace, max_len: int) -> tuple[list[str], list[int]]:
    """(the workloads, the concurrency levels), every length flag checked and fitted to the context `max_len`:
    before the engine is built, not in the middle of the runs."""
    workloads = [w.strip() for w in ns.workloads.split(",") if w.strip()]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or not workloads:
        raise UserError(f"--workloads: {f'unknown {bad[0]!r}' if bad else 'none given'}; expected "
                        f"{', '.join(WORKLOADS)}")

    def fits(what: str, tokens: int) -> None:
        if tokens > max_len:
            raise UserError(f"{what} need up to {tokens:,} tokens per sequence, more than the context of {max_len:,} "
                            f"(the model's, or --max-model-len); give shorter lengths")

    def lengths(*names: str) -> int:
        for name in names:
            if getattr(ns, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
        return sum(getattr(ns, name) for name in names)

    if "latency" in workloads:
        fits(f"--latency-input {ns.latency_input} + --latency-output {ns.latency_output}",
             lengths("latency_input", "latency_output"))
    if "throughput" in workloads:
        (_, in_hi), (_, out_hi) = parse_range(ns.input_len, "--input-len"), parse_range(ns.output_len, "--output-len")
        fits(f"--input-len {ns.input_len} with --output-len {ns.output_len}", in_hi + out_hi)
    levels: list[int] = []
    if "concurrency" in workloads:
        try:
            levels = [int(x) for x in ns.concurrency.split(",") if x.strip()]
        except ValueError:
            raise UserError(f"--concurrency {ns.concurrency!r}: expected comma-separated request counts such as "
                            "1,8,32") from None
        if not levels or min(levels) < 1:
            raise UserError(f"--concurrency {ns.concurrency!r}: counts must be >= 1")
        if max(levels) > ns.max_num_seqs:  # the engine runs no more at once: that level could not be measured
            raise UserError(f"--concurrency {max(levels)} is more than --max-num-seqs {ns.max_num_seqs} sequences "
                            f"run at once; raise --max-num-seqs or leave that level out")
        fits(f"--concurrency-input {ns.concurrency_input} + --concurrency-output {ns.concurrency_output}",
             lengths("concurrency_input", "concurrency_output"))
    return workloads, levels


def text_prompts(ns: argparse.Namespace, tokenizer):
    """--prompt-text: prompt(n, rng) -> n tokens cut from the file (the model's tokenizer) at a random offset, the
    passage of n / --prompt-repeat tokens repeated; None without --prompt-text (random token ids)."""
    if not ns.prompt_text:
        return None
    if tokenizer is None:
        raise UserError("--prompt-text needs the model's tokenizer; this model has none (give --tokenizer)")
    try:
        ids = tokenizer.encode(Path(ns.prompt_text).read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"--prompt-text {ns.prompt_text}: {e.strerror or e}") from None

    def prompt(n: int, rng) -> list[int]:
        w = -(-n // ns.prompt_repeat)
        if w >= len(ids):
            raise UserError(f"--prompt-text {ns.prompt_text} has {len(ids):,} tokens, too few for passages of {w:,}")
        start = int(rng.integers(0, len(ids) - w))
        return (ids[start:start + w] * ns.prompt_repeat)[:n]

    return prompt


def run_workloads(engine, ns: argparse.Namespace, ceilings: dict[str, float]) -> dict[str, Any]:
    import numpy as np
    import torch

    from paraseek.infer.sampling import SamplingParams

    cost = step_cost(engine, ceilings)
    plain_run = engine.runner.run
    log = _timed_engine(engine, cost)
    rng = np.random.default_rng(ns.seed)
    V = engine.args.vocab_size
    from_text = text_prompts(ns, engine.tokenizer)
    prompt = from_text or (lambda n, rng: rng.integers(0, V, size=n).tolist())  # noqa: E731
    spec = engine.drafter
    sync = (lambda: torch.cuda.synchronize()) if engine.device.type == "cuda" else (lambda: None)
    out: dict[str, Any] = {}

    def run(prompts, outs):
        log.clear()
        params = [SamplingParams(max_tokens=o, temperature=ns.temperature, top_p=ns.top_p, ignore_eos=True,
                                 seed=ns.seed + i if ns.temperature > 0 else None) for i, o in enumerate(outs)]
        before = spec.stats.snapshot() if spec is not None else None
        sync()
        t0 = time.perf_counter()
        reqs = engine.generate(prompts, params, progress=not ns.json and len(prompts) > 50)
        sync()
        wall = time.perf_counter() - t0
        ends = [e[0] for e in log[1:]] + [t0 + wall]
        for e, end in zip(log, ends):
            e.append(e[0])  # its start, then
            e[0] = end - e[0]  # its wall time
        run.spec = spec.stats.since(before).summary() if spec is not None else None
        return reqs, wall

    def decode_phase(reqs) -> tuple[float, float, list]:
        """Speculative runs: (decode tokens, seconds from the first request's first token to the last finish,
        the steps -- a target forward and its drafter's forwards, (wall, floor) -- that started once every request
        had its first token)."""
        first = [r.first_token_time for r in reqs]
        steps = []
        for e in log:
            if not e[4]:
                steps.append([e[0], e[1], e[5]])
            elif steps:
                steps[-1][0] += e[0]
        return (sum(r.num_output - 1 for r in reqs), max(r.finish_time for r in reqs) - min(first),
                [(w, f) for w, f, t in steps if t >= max(first)])

    workloads, levels = check_workloads(ns, engine.max_model_len)
    if "latency" in workloads:
        rows = []
        for _ in range(ns.reps + 1):  # the first repetition warms up
            reqs, wall = run([prompt(ns.latency_input, rng)], [ns.latency_output])
            r = reqs[0]
            tpot = (r.finish_time - r.first_token_time) / max(r.num_output - 1, 1)
            if spec is None:
                decode = [e for e in log if e[2] == 1 and e[3] == 1]
                step, floor = statistics.median(e[0] for e in decode), statistics.median(e[1] for e in decode)
            else:  # a step delivers several tokens: the time per token, and the target's floor per token
                _, _, steps = decode_phase(reqs)
                step, floor = tpot, sum(f for _, f in steps) / max(r.num_output - 1, 1)
            rows.append({"ttft_ms": (r.first_token_time - r.arrival) * 1e3, "ms_per_token": step * 1e3,
                         "tpot_ms": tpot * 1e3, "roofline_ms_per_token": floor * 1e3, "wall_s": wall})
        rows = rows[1:]
        lat = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        lat.update(input_len=ns.latency_input, output_len=ns.latency_output, reps=ns.reps,
                   roofline_fraction=lat["roofline_ms_per_token"] / lat["ms_per_token"])
        if spec is not None:
            lat["speculative"] = run.spec
        out["latency"] = lat
    if "throughput" in workloads:
        n = ns.num_requests
        pairs = sample_requests(n, ns.input_len, ns.output_len, V, ns.seed)
        if from_text is not None:  # the same lengths, the text's tokens
            pairs = [(from_text(len(p), rng), o) for p, o in pairs]
        # Untimed warm-up on the first 16 prompts (8 tokens each): first-use costs (kernel builds, cuBLAS
        # heuristics for new shapes) are not the engine's throughput.
        run([p for p, _ in pairs[:16]], [min(o, 8) for _, o in pairs[:16]])
        engine.pool.reset_prefix_cache()  # so that the timed run finds none of those prompts cached
        pre0 = engine.scheduler.num_preemptions
        reqs, wall = run([p for p, _ in pairs], [o for _, o in pairs])
        n_out, n_in = sum(r.num_output for r in reqs), sum(r.num_prompt for r in reqs)
        floor = sum(e[1] for e in log)
        ttft = sorted(r.first_token_time - r.arrival for r in reqs)
        out["throughput"] = {
            "requests": n, "input_len": ns.input_len, "output_len": ns.output_len, "input_tokens": n_in,
            "temperature": ns.temperature, "top_p": ns.top_p,
            "output_tokens": n_out, "wall_s": wall, "output_tokens_per_s": n_out / wall,
            "total_tokens_per_s": (n_in + n_out) / wall, "requests_per_s": n / wall, "steps": len(log),
            "roofline_wall_s": floor, "roofline_fraction": floor / wall,
            "preemptions": engine.scheduler.num_preemptions - pre0, "median_ttft_s": ttft[len(ttft) // 2],
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if engine.device.type == "cuda" else None,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if engine.device.type == "cuda" else None,
            "memory_limit_gib": engine.cfg.gpu_memory_utilization * engine.report.total_gib,
        }
        if spec is not None:
            out["throughput"]["speculative"] = run.spec
    if "concurrency" in workloads:
        rows = []
        for c in levels:
            prompts = [prompt(ns.concurrency_input, rng) for _ in range(c)]
            reqs, wall = run(prompts, [ns.concurrency_output] * c)
            if spec is None:
                decode = [(e[0], e[1]) for e in log if e[2] == c and e[3] == c]
                rate = lambda step: c / step  # noqa: E731
            else:  # the steps once every request decodes; tokens over the time from first token to last finish
                tokens, span, decode = decode_phase(reqs)
                rate = lambda step: tokens / span  # noqa: E731
            step = statistics.median(w for w, _ in decode) if decode else float("nan")
            floor = statistics.median(f for _, f in decode) if decode else float("nan")
            rows.append({"concurrency": c, "decode_ms_per_step": step * 1e3, "roofline_ms_per_step": floor * 1e3,
                         "decode_tokens_per_s": rate(step),
                         "output_tokens_per_s": sum(r.num_output for r in reqs) / wall,
                         "roofline_fraction": floor / step, "wall_s": wall})
            if spec is not None:
                rows[-1]["speculative"] = run.spec
        out["concurrency"] = rows
    engine.runner.run = plain_run
    return out


def cmd_bench_infer(ns: argparse.Namespace) -> int:
    import torch

    from paraseek.infer.build import build_engine, check_speculative
    from paraseek.infer.flags import engine_config, resolve_offline_defaults
    from paraseek.infer.ranks import check_parallel, device_for, place
    from paraseek.infer.load import resolve_source

    src = resolve_source(ns.model, random_weights=ns.random_weights, tokenizer=ns.tokenizer)
    if ns.layers is not None:
        if not ns.random_weights:
            raise UserError("--layers cuts the architecture's layer count: it needs --random-weights")
        if not 1 <= ns.layers <= src.args.n_layers:
            raise UserError(f"--layers must be in 1..{src.args.n_layers} (the model's layers), got {ns.layers}")
        # An MTP module stays for --speculative mtp (the layer after the cut is its, with random weights too).
        src.args = src.args.replace(n_layers=ns.layers,
                                    n_mtp_layers=src.args.n_mtp_layers if ns.speculative == "mtp" else 0)
    device = device_for(ns)
    check_parallel(ns, src.args, device)
    batch_line = resolve_offline_defaults(ns, device)
    check_workloads(ns, engine_config(ns).context_length(src.args))
    check_speculative(ns, src)
    if ns.prompt_repeat < 1:
        raise UserError(f"--prompt-repeat must be >= 1, got {ns.prompt_repeat}")
    if ns.prompt_repeat > 1 and not ns.prompt_text:
        raise UserError("--prompt-repeat repeats passages of --prompt-text: give --prompt-text FILE")
    if ns.prompt_text and not Path(ns.prompt_text).is_file():
        raise UserError(f"--prompt-text {ns.prompt_text}: no such file")
    check_plot(ns.plot)
    if ns.tp * ns.dp * ns.ep > 1 or ns.dp_attention:
        raise UserError("bench-infer measures one replica on one process for now; --tp/--ep/--dp/--dp-attention are "
                        "measured with `paraseek generate --tp N` (or --ep N) timings")
    if ns.reps < 1 or ns.num_requests < 1:
        raise UserError("--reps and --num-requests must be >= 1")
    if ns.temperature < 0 or not 0 < ns.top_p <= 1:
        raise UserError(f"--temperature must be >= 0 and --top-p in (0, 1], got {ns.temperature} and {ns.top_p}")
    pl = place(ns, device)
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k))
    log(batch_line)
    t0 = time.perf_counter()
    # Before the engine: the measurement's 2 GiB of buffers must not compete with the KV pool, which takes what is left.
    ceilings = measure_ceilings(torch.device(pl.device))
    engine = build_engine(ns, src, pl, log=log)
    log(engine.report.line() + f" | load {engine.report.extra.get('load_s', 0):.1f} s, "
        f"graphs {engine.report.extra.get('graphs', 0)} in {engine.report.extra.get('graphs_s', 0):.1f} s", flush=True)
    result = {"model": ns.model, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(engine.runner.dtype).removeprefix("torch."),
              "engine": {"max_num_seqs": engine.cfg.max_num_seqs, "max_batched_tokens": engine.cfg.max_batched_tokens,
                         "block_size": engine.cfg.block_size, "cuda_graphs": bool(engine.runner.graphs),
                         "max_model_len": engine.max_model_len, "speculative": engine.cfg.speculative,
                         "num_speculative_tokens": engine.cfg.spec_tokens,
                         "prompts": (f"{ns.prompt_text} x{ns.prompt_repeat}" if ns.prompt_text else "random ids")},
              "kv_cache": {"blocks": engine.report.num_blocks - 1, "tokens": engine.report.tokens,
                           "bytes_per_token": engine.report.bytes_per_token, "weights_gib": engine.report.weights_gib,
                           "profile_peak_gib": engine.report.peak_gib, **engine.report.extra},
              "ceilings": ceilings, "startup_s": time.perf_counter() - t0}
    result.update(run_workloads(engine, ns, ceilings))
    if ns.plot and result.get("concurrency"):
        _plot(result["concurrency"], ns.plot, f"{ns.model} on {result['device']}")
    if ns.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)
    return 0


def _print(r: dict[str, Any]) -> None:
    c = r["ceilings"]
    print(f"bench-infer {r['model']} on {r['device']} ({r['dtype']}), HBM {c['hbm_gbps']:,.0f} GB/s, "
          f"GEMM {c['matmul_tflops']:,.0f} TFLOP/s measured; KV cache {r['kv_cache']['tokens']:,} tokens")
    from paraseek.infer.cli import spec_line

    spec = lambda d: f"\n    {spec_line(d['speculative'])}" if d.get("speculative") else ""  # noqa: E731
    if "latency" in r:
        lat = r["latency"]
        print(f"  latency (batch 1, {lat['input_len']} prompt + {lat['output_len']} new): TTFT {lat['ttft_ms']:.1f} ms, "
              f"{lat['ms_per_token']:.2f} ms/token (roofline {lat['roofline_ms_per_token']:.2f} ms, "
              f"{lat['roofline_fraction']:.0%}){spec(lat)}")
    if "throughput" in r:
        t = r["throughput"]
        print(f"  throughput ({t['requests']} requests, input {t['input_len']}, output {t['output_len']}): "
              f"{t['output_tokens_per_s']:,.0f} output tokens/s, {t['total_tokens_per_s']:,.0f} total tokens/s, "
              f"{t['wall_s']:.1f} s (roofline {t['roofline_wall_s']:.1f} s, {t['roofline_fraction']:.0%}), "
              f"preemptions {t['preemptions']}{spec(t)}")
    for row in r.get("concurrency", []):
        print(f"  concurrency {row['concurrency']:>4}: {row['decode_ms_per_step']:.2f} ms/step, "
              f"{row['decode_tokens_per_s']:,.0f} decode tokens/s (roofline {row['roofline_ms_per_step']:.2f} ms, "
              f"{row['roofline_fraction']:.0%}){spec(row)}")


def _plot(rows: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    cs = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(cs, [r["decode_tokens_per_s"] for r in rows], "o-", label="measured")
    ax.plot(cs, [r["concurrency"] / r["roofline_ms_per_step"] * 1e3 for r in rows], "--", label="roofline")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent sequences")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def register(subparsers) -> None:
    from paraseek.infer.flags import add_engine_arguments

    p = subparsers.add_parser(
        "bench-infer", help="inference throughput, latency and a concurrency sweep, each beside its roofline",
        description="Measure the inference engine on random token prompts (outputs forced to their length): "
        "batch-1 latency (TTFT, ms per output token), offline throughput of --num-requests requests with uniform "
        "random lengths, and decode throughput per concurrency; each with the roofline from this GPU's measured "
        "HBM and GEMM rates. With --speculative, each workload also reports the share of drafts accepted per position "
        "and the mean accepted length.")
    add_engine_arguments(p, offline=True)
    p.add_argument("--workloads", default="latency,throughput,concurrency",
                   help="comma list of latency, throughput, concurrency (default: all)")
    p.add_argument("--num-requests", type=int, default=1000, help="throughput: requests (default 1000)")
    p.add_argument("--input-len", default="64:1024", help="throughput: prompt tokens, N or LO:HI uniform (default 64:1024)")
    p.add_argument("--output-len", default="64:512", help="throughput: new tokens, N or LO:HI uniform (default 64:512)")
    p.add_argument("--latency-input", type=int, default=128, help="latency: prompt tokens (default 128)")
    p.add_argument("--latency-output", type=int, default=256, help="latency: new tokens (default 256)")
    p.add_argument("--reps", type=int, default=3, help="latency: measured repetitions after one warm-up (default 3)")
    p.add_argument("--concurrency", default="1,8,32,64,128,256", help="concurrency sweep (default 1,8,32,64,128,256)")
    p.add_argument("--concurrency-input", type=int, default=128, help="concurrency: prompt tokens (default 128)")
    p.add_argument("--concurrency-output", type=int, default=128, help="concurrency: new tokens (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request (default 0: "
                   "greedy); request i is seeded with --seed + i")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's p with --temperature (default 1.0)")
    p.add_argument("--layers", type=int, help="with --random-weights: only the first N layers of the architecture "
                   "(the dense ones it starts with included), a model cut to fit one GPU with its layers' shapes intact")
    p.add_argument("--prompt-text", metavar="FILE.txt", help="prompts cut from this text (the model's tokenizer) at "
                   "random offsets instead of random token ids: drafters need text a model can predict")
    p.add_argument("--prompt-repeat", type=int, default=1, metavar="N",
                   help="with --prompt-text: each prompt is a passage repeated N times (prompt lookup finds its "
                   "drafts in the earlier copies; default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--plot", metavar="FILE.png", help="decode throughput vs concurrency with its roofline")
    p.set_defaults(func=cmd_bench_infer)
