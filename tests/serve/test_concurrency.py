"""64 streaming requests at once through AsyncOpenAI: continuous batching must not lose, duplicate or mix up
anything, and batching must not change a greedy result."""

import asyncio
import re

import httpx

from serve_helpers import NAME, PROMPTS

N = 16  # new tokens per request
WORDS = ["beginning", "light", "waters", "firmament", "seed", "fruit", "stars", "whales"]


def prompts() -> list[str]:
    """64 different prompts of different lengths (so prefills of several sizes share steps with decodes)."""
    return [f"{PROMPTS[i % 8]} {' '.join(WORDS[:1 + i // 8])} {i}" for i in range(64)]


def test_64_concurrent_streams_equal_their_single_results(server):
    client = server.client()
    # The reference: each prompt alone on the server, one after another (batch of one).
    single = {}
    for p in prompts():
        r = client.completions.create(model=NAME, prompt=p, max_tokens=N, temperature=0,
                                      extra_body={"ignore_eos": True})
        single[p] = r.choices[0].text

    async def one(aclient, p):
        ids, text, finish, usage = set(), [], [], None
        stream = await aclient.completions.create(model=NAME, prompt=p, max_tokens=N, temperature=0, stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
        async for chunk in stream:
            ids.add(chunk.id)
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                text.append(c.text)
                finish.append(c.finish_reason)
        return p, ids, "".join(text), finish, usage

    peak = [0.0]

    async def watch_running():  # the largest batch seen, to show they ran together
        async with httpx.AsyncClient() as h:
            while True:
                text = (await h.get(server.url + "/metrics")).text
                peak[0] = max(peak[0], float(re.search(r"^paraseek_requests_running (\S+)$", text, re.M).group(1)))
                await asyncio.sleep(0.02)

    async def all_at_once():
        watcher = asyncio.create_task(watch_running())
        async with server.async_client() as aclient:
            out = await asyncio.gather(*(one(aclient, p) for p in prompts()))
        watcher.cancel()
        return out

    m0 = server.metrics()
    results = asyncio.run(all_at_once())
    m1 = server.metrics()
    assert len(results) == 64
    all_ids = [next(iter(ids)) for _, ids, _, _, _ in results]
    for p, ids, text, finish, usage in results:
        assert len(ids) == 1, f"chunks of one stream carry {len(ids)} ids"
        assert text == single[p], p
        assert [f for f in finish if f is not None] == ["length"], finish  # one end, at the end
        assert finish[-1] == "length"
        assert usage.completion_tokens == N
    assert len(set(all_ids)) == 64  # no stream got another's chunks or a duplicate id
    assert m1["paraseek_generation_tokens_total"] - m0["paraseek_generation_tokens_total"] == 64 * N
    length = 'paraseek_requests_total{finish_reason="length"}'
    assert m1[length] - m0[length] == 64
    assert peak[0] >= 8, f"at most {peak[0]:.0f} requests ran at once"
    assert server.wait_metric("paraseek_kv_blocks_used", 0) == 0
