"""`paraseek bench-serve URL`: load an OpenAI-compatible server the way `vllm bench serve` does and report what a
client sees.

Requests arrive as a Poisson process at --request-rate (exponential gaps, seeded; `inf` sends them all at once),
optionally capped at --max-concurrency in flight; --sweep runs each rate (or concurrency) in turn, each with its
own random prompts drawn from the seed (the same prompts again would be prefix-cache hits on the server; a
--prompts file is sent again at each point). Against a paraseek server each run also reports the prefix-cache hit
rate its requests got (/metrics). Prompts are random token ids for completions (the server takes `prompt` as a list of ints, so no tokenizer is
needed here) or random words for chat, or rows of --prompts FILE.jsonl; outputs are forced to their length with
ignore_eos + max_tokens. Every request streams, and per request we time:

  TTFT  arrival -> first chunk with output       ITL   gaps between output chunks
  e2e   arrival -> last chunk                    TPOT  (e2e - TTFT) / (output tokens - 1)

With --structured json (response_format json_schema) or tools (chat with tools and tool_choice required) each
request is grammar-constrained instead of forced with ignore_eos: the outputs end where the grammar does (or at
max_tokens), so the output tokens are whatever the model wrote.

Token counts are the server's own (stream_options.include_usage). Throughputs are over the run's wall time;
goodput counts the requests meeting both --slo-ttft-ms and --slo-tpot-ms. Only httpx and the standard library: the
GPU machine that runs the server need not have the openai package.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paraseek.errors import UserError, check_plot, parse_range, read_jsonl_objects

# Random prompt ids come from here: every real vocabulary has these ids, and special tokens sit at its ends.
_ID_RANGE = (16, 1000)
_WORDS = ("the and of to in that he shall unto for his i a lord they be is him not them with all it thou was god "
          "which my me said but ye their have will thee from as are when this out were by upon man king").split()


@dataclass
class Job:
    prompt: Any  # str, list[int] (completions) or a list of messages (chat)
    max_tokens: int


@dataclass
class Result:
    ok: bool = False
    status: str = ""  # HTTP status, "connection" or "stream" when not ok
    detail: str = ""  # the server's error message
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


# ---- input ----------------------------------------------------------------------------------------------------------
def parse_rate(spec: str, what: str = "--request-rate") -> float:
    try:
        r = float(spec)
    except ValueError:
        raise UserError(f"{what} must be a number of requests/s or inf, got {spec!r}") from None
    if not r > 0:
        raise UserError(f"{what} must be > 0 (or inf), got {spec!r}")
    return r


def make_jobs(ns: argparse.Namespace, rng: random.Random) -> list[Job]:
    out_lo, out_hi = parse_range(ns.output_len, "--output-len")
    if ns.prompts:
        return _read_prompts(ns, rng, out_lo, out_hi)
    in_lo, in_hi = parse_range(ns.input_len, "--input-len")
    jobs = []
    for _ in range(ns.num_prompts or 200):
        n = rng.randint(in_lo, in_hi)
        if ns.endpoint == "completions":
            prompt: Any = [rng.randrange(*_ID_RANGE) for _ in range(n)]
        else:  # chat needs text: n random words (the server's usage gives the real token count)
            prompt = [{"role": "user", "content": " ".join(rng.choice(_WORDS) for _ in range(n))}]
        jobs.append(Job(prompt, rng.randint(out_lo, out_hi)))
    return jobs


def _read_prompts(ns, rng, out_lo, out_hi) -> list[Job]:
    path = Path(ns.prompts)
    jobs = []
    for n, row in read_jsonl_objects(path, "prompt, prompt_token_ids or messages"):
        if not ({"prompt", "prompt_token_ids", "messages"} & row.keys()):
            raise UserError(f"{path}:{n}: expected an object with prompt, prompt_token_ids or messages")
        prompt = row.get("messages") or row.get("prompt_token_ids") or row.get("prompt")
        if ns.endpoint == "chat" and "messages" not in row:
            if not isinstance(prompt, str):
                raise UserError(f"{path}:{n}: --endpoint chat needs messages or a text prompt")
            prompt = [{"role": "user", "content": prompt}]
        if ns.endpoint == "completions" and "messages" in row:
            raise UserError(f"{path}:{n}: messages need --endpoint chat")
        out = row.get("max_tokens", row.get("output_len"))
        if out is not None and (not isinstance(out, int) or out < 1):
            raise UserError(f"{path}:{n}: max_tokens must be a positive integer")
        jobs.append(Job(prompt, out or rng.randint(out_lo, out_hi)))
    if not jobs:
        raise UserError(f"--prompts {path}: no prompts in the file")
    return jobs[:ns.num_prompts] if ns.num_prompts else jobs


# --structured: what each request adds (a schema and a tool list of the sizes agents and extraction jobs send)
STRUCTURED_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}, "city": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8}, "verified": {"type": "boolean"}},
    "required": ["name", "age", "city", "tags", "verified"], "additionalProperties": False}
STRUCTURED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1,
                                                                               "maximum": 14},
                                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "days", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web.",
                                      "parameters": {"type": "object", "properties": {
                                          "query": {"type": "string"}, "top_k": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 20}},
                                          "required": ["query"], "additionalProperties": False}}}]


def structured_fields(mode: str | None) -> dict[str, Any]:
    if mode == "json":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "record",
                                                                           "schema": STRUCTURED_SCHEMA}}}
    if mode == "tools":
        return {"tools": STRUCTURED_TOOLS, "tool_choice": "required"}
    return {}


# ---- one run --------------------------------------------------------------------------------------------------------
async def _send(client, url: str, model: str, endpoint: str, job: Job, headers: dict,
                extra: dict | None = None) -> Result:
    import httpx

    body: dict[str, Any] = {"model": model, "max_tokens": job.max_tokens, "ignore_eos": not extra,
                            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                            **(extra or {})}
    body["messages" if endpoint == "chat" else "prompt"] = job.prompt
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    res = Result()
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url + path, json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                res.status = str(r.status_code)
                try:
                    res.detail = r.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    res.detail = r.text[:200]
                return res
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # the server gave up mid-stream (timeout, shutdown)
                    res.status = "stream"
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if any(_has_text(c) for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
            if not done:
                res.status = "stream"
                return res
    except (httpx.ConnectError, httpx.ConnectTimeout):
        res.status = "connection"
        return res
    except (httpx.HTTPError, ValueError, KeyError, TypeError):  # a cut stream or a malformed chunk
        res.status = "stream"
        return res
    res.e2e = (last or time.perf_counter()) - t0
    if last is None:  # no text at all (e.g. only special tokens): the first token time is the end
        res.ttft = res.e2e
    res.ok = True
    return res


def _prefix_counters(url: str, headers: dict) -> tuple[float, float] | None:
    """(prefix-cache hits, queries) from a paraseek server's /metrics; None from another server."""
    import httpx

    try:
        text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    except httpx.HTTPError:
        return None
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("paraseek_prefix_cache_hits_total", "paraseek_prefix_cache_queries_total"):
            values[name] = float(value)
    if len(values) < 2:
        return None
    return values["paraseek_prefix_cache_hits_total"], values["paraseek_prefix_cache_queries_total"]


def _has_text(choice: dict) -> bool:
    """A chunk that carries output: text, or the token ids of a server without a tokenizer."""
    if choice.get("token_ids"):
        return True
    if "text" in choice:
        return bool(choice["text"])
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


async def run_once(url: str, model: str, endpoint: str, jobs: list[Job], rate: float, concurrency: int | None,
                   headers: dict, seed: int, timeout: float, extra: dict | None = None) -> tuple[list[Result], float]:
    import httpx

    gaps = random.Random(seed)
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    limits = httpx.Limits(max_connections=concurrency or None, max_keepalive_connections=concurrency or 100)

    async def one(client, job: Job) -> Result:
        if limit is None:
            return await _send(client, url, model, endpoint, job, headers, extra)
        async with limit:
            return await _send(client, url, model, endpoint, job, headers, extra)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30), limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        due = t0
        for job in jobs:
            tasks.append(asyncio.create_task(one(client, job)))
            if math.isfinite(rate):
                due += gaps.expovariate(rate)  # Poisson arrivals: exponential gaps of mean 1/rate
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return list(results), wall


# ---- the report -----------------------------------------------------------------------------------------------------
def percentiles(xs: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 in ms (linear interpolation, as numpy's default)."""
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(xs)

    def q(p: float) -> float:
        i = (len(s) - 1) * p
        lo, hi = math.floor(i), math.ceil(i)
        return (s[lo] + (s[hi] - s[lo]) * (i - lo)) * 1e3

    return {"mean": sum(s) / len(s) * 1e3, "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def summarize(results: list[Result], wall: float, rate: float, concurrency: int | None, slo_ttft_ms: float | None,
              slo_tpot_ms: float | None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    n_in, n_out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    good = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        meets = [r for r in ok if (slo_ttft_ms is None or r.ttft * 1e3 <= slo_ttft_ms)
                 and (slo_tpot_ms is None or r.tpot * 1e3 <= slo_tpot_ms)]
        good = len(meets) / wall
    return {
        "request_rate": rate if math.isfinite(rate) else "inf", "max_concurrency": concurrency,
        "requests": len(results), "completed": len(ok),
        "failed": dict(sorted(Counter(r.status for r in results if not r.ok).items())),
        "duration_s": wall, "input_tokens": n_in, "output_tokens": n_out,
        "request_throughput": len(ok) / wall, "output_throughput": n_out / wall,
        "total_token_throughput": (n_in + n_out) / wall, "goodput": good,
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "tpot_ms": percentiles([r.tpot for r in ok if r.output_tokens > 1]),
        "itl_ms": percentiles([x for r in ok for x in r.itl]), "e2e_ms": percentiles([r.e2e for r in ok]),
    }


def _print(doc: dict[str, Any]) -> None:
    print(f"bench-serve {doc['url']} model {doc['model']!r}, {doc['endpoint']}, {doc['num_prompts']} prompts "
          f"(input {doc['input_len']}, output {doc['output_len']})")
    for run in doc["runs"]:
        where = f"rate {run['request_rate']}/s" + (f", concurrency {run['max_concurrency']}"
                                                   if run["max_concurrency"] else "")
        failed = ", ".join(f"{k}: {v}" for k, v in run["failed"].items()) or "none"
        print(f"  {where}: {run['completed']}/{run['requests']} completed in {run['duration_s']:.2f} s "
              f"(failed: {failed})")
        print(f"    {run['request_throughput']:.2f} requests/s, {run['output_throughput']:,.1f} output tokens/s, "
              f"{run['total_token_throughput']:,.1f} total tokens/s"
              + (f", goodput {run['goodput']:.2f} requests/s" if run["goodput"] is not None else "")
              + (f", prefix-cache hits {run['prefix_cache_hit_rate']:.0%} of prompt blocks"
                 if "prefix_cache_hit_rate" in run else ""))
        for name in ("ttft", "tpot", "itl", "e2e"):
            p = run[f"{name}_ms"]
            if p["mean"] is not None:
                print(f"    {name.upper():>4} ms: mean {p['mean']:.1f}, p50 {p['p50']:.1f}, p90 {p['p90']:.1f}, "
                      f"p99 {p['p99']:.1f}")


def _plot(doc: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    runs = [r for r in doc["runs"] if r["completed"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (x, xlabel), (y, ylabel) in ((axes[0], ("request_throughput", "requests/s"), ("ttft_ms", "TTFT ms")),
                                         (axes[1], ("output_throughput", "output tokens/s"), ("tpot_ms", "TPOT ms"))):
        xs = [r[x] for r in runs]
        for stat, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(xs, [r[y][stat] for r in runs], style, label=stat)
        for r, xv in zip(runs, xs):  # each point says which rate or concurrency it was
            label = f"c={r['max_concurrency']}" if doc["sweep"] == "concurrency" else f"r={r['request_rate']}"
            ax.annotate(label, (xv, r[y]["p50"]), fontsize=7, textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.legend()
    fig.suptitle(f"{doc['model']} at {doc['url']} ({doc['endpoint']})", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", file=sys.stderr)


# ---- the command ----------------------------------------------------------------------------------------------------
def _served_model(url: str, headers: dict, timeout: float) -> str:
    """The first model of GET /v1/models; one line (exit 2) when the server does not answer as an OpenAI server."""
    import httpx

    try:
        r = httpx.get(url + "/v1/models", headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise UserError(f"{url} does not answer ({type(e).__name__}: {str(e) or 'no response'}); is the server "
                        f"running?") from None
    if r.status_code == 401:
        raise UserError(f"{url} wants an API key: give --api-key")
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise UserError(f"{url}/v1/models answered {r.status_code} without a model list; is it an OpenAI-compatible "
                        f"server?") from None


def cmd_bench_serve(ns: argparse.Namespace) -> int:
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise UserError("bench-serve needs httpx: pip install httpx") from None
    url = ns.url.rstrip("/").removesuffix("/v1")
    if not url.startswith(("http://", "https://")):
        raise UserError(f"URL must start with http:// or https://, got {ns.url!r}")
    if ns.num_prompts is not None and ns.num_prompts < 1:
        raise UserError(f"--num-prompts must be >= 1, got {ns.num_prompts}")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise UserError(f"--max-concurrency must be >= 1, got {ns.max_concurrency}")
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        if getattr(ns, name) is not None and not getattr(ns, name) > 0:
            raise UserError(f"--{name.replace('_', '-')} must be > 0, got {getattr(ns, name)}")
    if ns.timeout <= 0:
        raise UserError(f"--timeout must be > 0, got {ns.timeout}")
    if ns.structured == "tools" and ns.endpoint != "chat":
        raise UserError("--structured tools needs --endpoint chat (tools are a chat field)")
    extra = structured_fields(ns.structured)
    rate = parse_rate(ns.request_rate)
    # --sweep: the request rate, or the concurrency when --max-concurrency is given
    sweep = "concurrency" if ns.max_concurrency is not None else "rate"
    points: list[tuple[float, int | None]] = [(rate, ns.max_concurrency)]
    if ns.sweep:
        items = [x.strip() for x in ns.sweep.split(",") if x.strip()]
        if not items:
            raise UserError("--sweep must be a comma list of rates (or of concurrencies with --max-concurrency)")
        if sweep == "rate":
            points = [(parse_rate(x, "--sweep"), None) for x in items]
        else:
            try:
                cs = [int(x) for x in items]
            except ValueError:
                raise UserError(f"--sweep with --max-concurrency takes integers, got {ns.sweep!r}") from None
            if min(cs) < 1:
                raise UserError(f"--sweep concurrencies must be >= 1, got {ns.sweep!r}")
            points = [(rate, c) for c in cs]
    rng = random.Random(ns.seed)
    # Each point its own random prompts (the same ones again would be prefix-cache hits on the server); a
    # --prompts file is the user's data, sent again at each point. All drawn before any request: bad input costs
    # nothing.
    point_jobs = [make_jobs(ns, rng) for _ in (points if not ns.prompts else points[:1])]
    probe_job = make_jobs(ns, rng)[0]
    jobs = point_jobs[0]
    check_plot(ns.plot)
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    served = _served_model(url, headers, min(ns.timeout, 30))  # also the one-line check that the server answers
    model = ns.model or served
    doc: dict[str, Any] = {"url": url, "model": model, "endpoint": ns.endpoint, "num_prompts": len(jobs),
                           "input_len": "file" if ns.prompts else ns.input_len, "output_len": ns.output_len,
                           "seed": ns.seed, "sweep": sweep if ns.sweep else None, "structured": ns.structured,
                           "slo_ttft_ms": ns.slo_ttft_ms, "slo_tpot_ms": ns.slo_tpot_ms, "runs": []}
    # One untimed request first, as vLLM's bench does: it warms the server up, and a request the server refuses
    # (a wrong --model, a prompt too long for it) is one line here instead of N failures.
    probe = asyncio.run(run_once(url, model, ns.endpoint, [Job(probe_job.prompt, min(probe_job.max_tokens, 4))],
                                 math.inf, None, headers, ns.seed, ns.timeout, extra))[0][0]
    if not probe.ok:
        raise UserError(f"the first request failed ({probe.status}{': ' + probe.detail if probe.detail else ''})")
    for i, (r, c) in enumerate(points):
        jobs = point_jobs[min(i, len(point_jobs) - 1)]
        before = _prefix_counters(url, headers)
        results, wall = asyncio.run(run_once(url, model, ns.endpoint, jobs, r, c, headers, ns.seed, ns.timeout,
                                             extra))
        doc["runs"].append(summarize(results, wall, r, c, ns.slo_ttft_ms, ns.slo_tpot_ms))
        after = _prefix_counters(url, headers)
        if before and after and after[1] > before[1]:  # a paraseek server: how much of the prefill it skipped
            doc["runs"][-1]["prefix_cache_hit_rate"] = (after[0] - before[0]) / (after[1] - before[1])
        if not ns.json:
            print(f"bench-serve: {doc['runs'][-1]['completed']}/{len(jobs)} at rate {r}"
                  + (f", concurrency {c}" if c else ""), file=sys.stderr, flush=True)
    if ns.plot:
        _plot(doc, ns.plot)
    if ns.json:
        print(json.dumps(doc, indent=2))
    else:
        _print(doc)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench-serve", help="load an OpenAI-compatible server (Poisson arrivals or fixed concurrency) and report "
        "TTFT, TPOT, ITL, e2e percentiles, throughput and goodput",
        description="Send --num-prompts streamed requests to URL (a `paraseek serve` or any OpenAI-compatible server) "
        "at --request-rate (Poisson) or at most --max-concurrency at a time, outputs forced to --output-len with "
        "ignore_eos, and report per-request latencies (TTFT, TPOT, ITL, e2e: mean, p50, p90, p99), throughputs, "
        "goodput under --slo-ttft-ms/--slo-tpot-ms and failures by status. --sweep repeats the run per rate (or "
        "per concurrency with --max-concurrency).")
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="the model name to send (default: the first of GET /v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="completions (random token-id prompts) or chat (random-word messages); default completions")
    p.add_argument("--num-prompts", type=int, help="requests per run (default 200, or every row of --prompts)")
    p.add_argument("--request-rate", default="inf", help="requests/s, Poisson arrivals; inf sends all at once "
                   "(default inf)")
    p.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: no cap)")
    p.add_argument("--sweep", help="comma list of request rates run one after another; with --max-concurrency, of "
                   "concurrencies")
    p.add_argument("--input-len", default="128", help="prompt tokens (words for chat), N or LO:HI uniform "
                   "(default 128)")
    p.add_argument("--output-len", default="128", help="output tokens, N or LO:HI uniform, forced with ignore_eos "
                   "(default 128)")
    p.add_argument("--prompts", metavar="FILE.jsonl", help="one object a line: prompt (text), prompt_token_ids or "
                   "messages, optional max_tokens; replaces the random prompts (--num-prompts caps the count)")
    p.add_argument("--structured", choices=["json", "tools"],
                   help="grammar-constrained requests: json sends response_format json_schema (a five-field record), "
                   "tools sends two tools with tool_choice required (chat); outputs then end where the grammar "
                   "ends instead of being forced with ignore_eos")
    p.add_argument("--seed", type=int, default=0, help="prompts, lengths and arrival gaps (default 0)")
    p.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT at most this")
    p.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT at most this")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--plot", metavar="FILE.png", help="TTFT and TPOT (p50, p99) against throughput over the sweep")
    p.set_defaults(func=cmd_bench_serve)
