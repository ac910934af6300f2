"""`paraseek serve --dp 2`: two model replicas behind one server (two gloo processes on CPU). Requests are spread
over both, each result equals the one-replica server's, and the counters are the sum of both engines'."""

import concurrent.futures

import pytest
from serve_helpers import NAME, PROMPTS, Server


@pytest.fixture(scope="module")
def two(folder):
    s = Server(folder, "--dp", "2", ready_timeout=180)
    yield s
    s.stop()


def test_two_replicas_share_the_work_and_give_the_same_tokens(two, server):
    def ask(s, prompt):
        r = s.client().completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
        return r.choices[0].text

    m0 = two.metrics()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: ask(two, p), PROMPTS))
    want = [ask(server, p) for p in PROMPTS]
    assert got == want
    m1 = two.metrics()
    routed = [m1.get(f'paraseek_replica_requests_total{{replica="{i}"}}', 0) for i in (0, 1)]
    assert sum(routed) == len(PROMPTS) and min(routed) > 0
    # the counters sum both engines: 8 requests x 12 tokens, whichever replica made them
    import time

    deadline = time.monotonic() + 5  # a remote replica sends its counters every 0.2 s
    while m1["paraseek_generation_tokens_total"] - m0["paraseek_generation_tokens_total"] < 12 * len(PROMPTS):
        assert time.monotonic() < deadline
        time.sleep(0.1)
        m1 = two.metrics()
    assert m1["paraseek_generation_tokens_total"] - m0["paraseek_generation_tokens_total"] == 12 * len(PROMPTS)
    assert two.wait_metric("paraseek_kv_blocks_used", 0) == 0


def test_sigterm_stops_every_replica(folder):
    s = Server(folder, "--dp", "2", ready_timeout=180)
    s.terminate()
    assert s.proc.wait(60) == 0
    s.stop()
