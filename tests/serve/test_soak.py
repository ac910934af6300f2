"""A bounded soak: an open-loop sender at a fixed rate above the server's capacity for PARASEEK_SOAK_S seconds
(default 30; set it higher for a real soak). Throughout: the waiting queue stays within --max-queue, /health
answers, every request gets a whole result or a 429; at the end nothing is left running or holding KV blocks, and
the server's RSS is flat."""

import asyncio
import os
import re
import time

import httpx
import pytest
from serve_helpers import NAME, Server

SOAK_S = float(os.environ.get("PARASEEK_SOAK_S", "30"))
MAX_QUEUE = 8
RATE = 80.0  # requests/s offered; two sequences of 32 forced tokens serve ~30/s on a shared 2-core CPU
OUT = 32
WARMUP_S = min(5.0, SOAK_S / 4)


@pytest.fixture(scope="module")
def soak_server(folder):
    s = Server(folder, "--max-queue", str(MAX_QUEUE), "--max-num-seqs", "2")
    yield s
    s.stop()


def gauge(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_soak_above_capacity(soak_server):
    s = soak_server
    statuses: list[int] = []
    bad: list[str] = []
    waiting_seen: list[float] = []
    health: list[int] = []
    rss: dict[str, int] = {}

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": NAME, "prompt": f"Vanity of vanities {i}", "max_tokens": OUT, "ignore_eos": True,
                "stream": i % 2 == 0}
        try:
            r = await client.post("/v1/completions", json=body)
        except httpx.HTTPError as e:
            bad.append(f"request {i}: {type(e).__name__}: {e}")
            return
        statuses.append(r.status_code)
        if r.status_code == 200 and not body["stream"]:
            if r.json()["usage"]["completion_tokens"] != OUT:
                bad.append(f"request {i}: {r.text[:200]}")
        elif r.status_code == 200:  # streamed: every token's chunk, then [DONE]
            events = [x for x in r.text.split("\n\n") if x.startswith("data: ")]
            if events[-1] != "data: [DONE]" or '"finish_reason": "length"' not in events[-2]:
                bad.append(f"request {i}: stream ended with {events[-2:]}")
        elif r.status_code not in (429, 503):
            bad.append(f"request {i}: {r.status_code} {r.text[:200]}")

    async def watch(client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                h = await client.get("/health", timeout=5)
                health.append(h.status_code)
                m = await client.get("/metrics", timeout=5)
                waiting_seen.append(gauge(m.text, "paraseek_requests_waiting"))
            except httpx.HTTPError as e:
                health.append(-1)
                bad.append(f"/health or /metrics: {type(e).__name__}")
            await asyncio.sleep(0.25)

    async def soak() -> int:
        limits = httpx.Limits(max_connections=500, max_keepalive_connections=100)
        async with httpx.AsyncClient(base_url=s.url, timeout=120, limits=limits) as client:
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(client, stop))
            tasks = []
            t0 = time.monotonic()
            i = 0
            while (now := time.monotonic() - t0) < SOAK_S:
                if "warm" not in rss and now >= WARMUP_S:
                    rss["warm"] = s.rss_kib()
                # open loop: the i-th request leaves at i / RATE whatever the earlier ones are doing
                due = t0 + i / RATE
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                tasks.append(asyncio.create_task(one(client, i)))
                i += 1
            await asyncio.gather(*tasks)
            stop.set()
            await watcher
            return i

    sent = asyncio.run(soak())
    rss["end"] = s.rss_kib()

    print(f"soak: {sent} requests in {SOAK_S:.0f} s: {statuses.count(200)} served, {statuses.count(429)} refused "
          f"(429); "
          f"waiting at most {max(waiting_seen):.0f}; RSS {rss['warm'] / 1024:.0f} -> {rss['end'] / 1024:.0f} MiB")
    assert not bad, bad[:10]
    assert len(statuses) == sent  # none lost: each got an answer
    assert statuses.count(200) >= 10 and statuses.count(429) >= 10, "not above capacity, or nothing served"
    assert max(waiting_seen) <= MAX_QUEUE
    # /health answered every poll, and polls ran through the whole period (how many fit depends on the machine's
    # load, so only a floor that any machine reaches is asserted, not a rate)
    assert len(health) >= 10 and set(health) == {200}
    # Flat memory: after the warm-up the RSS may still move a little as pymalloc arenas and torch's CPU allocator
    # settle, so the bound is 25% of the ~400 MiB process, ~100 MiB. At 80 requests/s for 30 s (2,400 requests) that
    # catches a leak of ~45 KiB or more a request (its tensors, the deltas it streamed); smaller leaks need a longer
    # PARASEEK_SOAK_S, which grows the request count and not the bound. (Measured: flat to the MiB.)
    assert rss["end"] <= 1.25 * rss["warm"], rss
    assert s.wait_metric("paraseek_requests_running", 0) == 0
    assert s.wait_metric("paraseek_requests_waiting", 0) == 0
    assert s.wait_metric("paraseek_kv_blocks_used", 0) == 0
