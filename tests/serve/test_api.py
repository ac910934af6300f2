"""The OpenAI routes through the official client against a live server: greedy output equals `paraseek generate`'s
(text and token for token), the chat prompt is the template's rendering, R1's reasoning split, prefix-cache hits,
a disconnect frees the KV blocks, and /metrics has every documented family."""

import json
import socket
import time
import uuid

import httpx
import pytest
from serve_helpers import NAME, PROMPTS, Server, generate, token_strings

from paraseek.models.tokenizer import split_reasoning

N = 12  # new tokens per request: enough to cross several decode steps, cheap on two cores


@pytest.fixture(scope="module")
def reference(folder):
    """`paraseek generate` on PROMPTS[:4], greedy, the model's end tokens on (as the server's defaults)."""
    return generate(folder, PROMPTS[:4], N)


def test_models_lists_the_served_name(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == [NAME]
    assert models[0].model_extra["max_model_len"] == 512  # tiny-dense's max_position_embeddings


def test_completion_equals_generate(server, reference, tokenizer):
    client = server.client()
    for ref in reference:
        r = client.completions.create(model=NAME, prompt=ref["prompt"], max_tokens=N, temperature=0, logprobs=0)
        choice = r.choices[0]
        assert choice.text == ref["text"]
        assert choice.logprobs.tokens == token_strings(tokenizer, ref["token_ids"])  # token for token
        assert choice.finish_reason == ref["finish_reason"]
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref["prompt_tokens"], ref["completion_tokens"])
        assert r.id.startswith("cmpl-") and r.model == NAME


def test_streamed_completion_equals_generate(server, reference):
    client = server.client()
    for ref in reference:
        chunks = list(client.completions.create(model=NAME, prompt=ref["prompt"], max_tokens=N, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        *deltas, usage = chunks
        assert "".join(c.choices[0].text for c in deltas) == ref["text"]
        assert [c.choices[0].finish_reason for c in deltas] == [None] * (len(deltas) - 1) + [ref["finish_reason"]]
        assert len({c.id for c in chunks}) == 1
        assert usage.choices == [] and usage.usage.completion_tokens == ref["completion_tokens"]


def test_token_id_prompt_equals_text_prompt(server, reference, tokenizer):
    ref = reference[0]
    ids = tokenizer.encode(ref["prompt"])
    r = server.client().completions.create(model=NAME, prompt=ids, max_tokens=N, temperature=0)
    assert r.usage.prompt_tokens == len(ids) == ref["prompt_tokens"]
    assert r.choices[0].text == ref["text"]


# ---- chat ----------------------------------------------------------------------------------------------------------
def test_chat_prompt_is_the_template_rendering(server, tokenizer):
    """usage.prompt_tokens against tokenizer.apply_chat_template(tokenize=True), for a multi-turn chat with a
    system prompt (the R1 template moves it first and drops the assistant's earlier <think> part)."""
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Who begat Enos?"},
                {"role": "assistant", "content": "<think>\nGenesis 4.\n</think>\n\nSeth."},
                {"role": "user", "content": "And Enos?"}]
    r = server.client().chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert r.usage.prompt_tokens == len(ids)
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("<｜Assistant｜><think>\n")


def test_chat_equals_generate_and_splits_reasoning(server, folder, tokenizer):
    """The R1 template ends the prompt with <think>, so the whole output is reasoning until </think>: the server's
    (reasoning_content, content) equal split_reasoning of `paraseek generate --chat`'s whole text."""
    client = server.client()
    for text, ref in zip(PROMPTS[4:6], generate(folder, PROMPTS[4:6], N, "--chat")):
        messages = [{"role": "user", "content": text}]
        want_reasoning, want_content = split_reasoning(ref["text"], starts_in_reasoning=True)
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=N, temperature=0)
        msg = r.choices[0].message
        assert r.usage.prompt_tokens == ref["prompt_tokens"] == len(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        assert r.usage.completion_tokens == ref["completion_tokens"]
        assert msg.role == "assistant"
        assert msg.model_extra["reasoning_content"] == want_reasoning
        assert msg.content == want_content

        stream = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=N, temperature=0,
                                                     stream=True))
        assert stream[0].choices[0].delta.role == "assistant"
        deltas = [c.choices[0].delta for c in stream]
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == want_reasoning
        assert "".join(d.content or "" for d in deltas) == want_content
        assert stream[-1].choices[0].finish_reason == ref["finish_reason"]


def test_no_reasoning_content_when_the_prompt_does_not_open_think(server):
    """Without the generation prompt the rendering ends in the user's turn, not in <think>: no reasoning split."""
    r = server.client().chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Vanity"}], max_tokens=N, temperature=0, extra_body={
            "add_generation_prompt": False})
    msg = r.choices[0].message
    assert (msg.model_extra or {}).get("reasoning_content") is None
    assert msg.content  # everything is content


# ---- the engine through the metrics -----------------------------------------------------------------------------
def test_shared_prefix_hits_the_prefix_cache(server, tokenizer):
    """Two prompts with a common prefix of several 16-token blocks: the second finds the first's full blocks."""
    prefix = f"{uuid.uuid4().hex} In the beginning God created the heaven and the earth. And the earth was without " \
             f"form, and void; and darkness was upon the face of the deep."
    a, b = prefix + " And God said", prefix + " And the Spirit"
    ia, ib = tokenizer.encode(a), tokenizer.encode(b)
    common = next(i for i, (x, y) in enumerate(zip(ia, ib)) if x != y)
    shared_blocks = common // 16
    assert shared_blocks >= 2
    client = server.client()
    before = server.metrics()["paraseek_prefix_cache_hits_total"]
    client.completions.create(model=NAME, prompt=a, max_tokens=2)
    first = server.metrics()["paraseek_prefix_cache_hits_total"]
    client.completions.create(model=NAME, prompt=b, max_tokens=2)
    second = server.metrics()["paraseek_prefix_cache_hits_total"]
    assert first == before  # a unique first block: nothing to find
    assert second - first == shared_blocks


def test_client_disconnect_frees_its_blocks(server):
    """Read a few chunks of a long forced-length stream, close the connection: the request is aborted (far fewer
    tokens than asked), its KV blocks return to the pool and nothing is left running."""
    assert server.wait_metric("paraseek_kv_blocks_used", 0) == 0
    m0 = server.metrics()
    body = {"model": NAME, "prompt": "In the beginning", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        chunks = 0
        while chunks < 3:
            chunks += next(lines).startswith("data: {")
        during = server.metrics()
        assert during["paraseek_kv_blocks_used"] > 0 and during["paraseek_requests_running"] == 1
    t0 = time.monotonic()
    assert server.wait_metric("paraseek_kv_blocks_used", 0, timeout=10) == 0
    assert server.wait_metric("paraseek_requests_running", 0, timeout=10) == 0
    freed_s = time.monotonic() - t0
    m1 = server.metrics()
    generated = m1["paraseek_generation_tokens_total"] - m0["paraseek_generation_tokens_total"]
    assert generated < 480, "the request ran to the end instead of being aborted"
    assert m1['paraseek_requests_total{finish_reason="abort"}'] - m0.get(
        'paraseek_requests_total{finish_reason="abort"}', 0) == 1
    assert freed_s < 10


def test_non_streamed_client_disconnect_aborts(folder):
    """A non-streamed request whose client leaves mid-generation is aborted (its handler polls the connection every
    api._POLL_S), not run to the end. The margin does not rest on the machine's speed: one sequence at a time and n=8
    choices of 480 forced tokens are 3,840 decode steps one after another, and the client leaves as soon as /metrics
    shows the request running. (A client that gave up after a fixed read timeout raced a fast CPU to 480 tokens.)"""
    s = Server(folder, "--max-num-seqs", "1")
    try:
        m0 = s.metrics()
        body = json.dumps({"model": NAME, "prompt": "The word was", "max_tokens": 480, "ignore_eos": True,
                           "n": 8}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
            sock.sendall(head + body)
            assert s.wait_metric("paraseek_requests_running", 1) == 1
        # the connection is closed: the handler notices at its next poll and aborts every choice
        assert s.wait_metric("paraseek_requests_running", 0) == 0
        assert s.wait_metric("paraseek_requests_waiting", 0) == 0
        assert s.wait_metric("paraseek_kv_blocks_used", 0) == 0
        m1 = s.metrics()
        generated = m1["paraseek_generation_tokens_total"] - m0["paraseek_generation_tokens_total"]
        assert generated < 8 * 480, "the request ran to the end after its client left"
        abort = 'paraseek_requests_total{finish_reason="abort"}'
        assert m1.get(abort, 0) - m0.get(abort, 0) >= 1
    finally:
        s.stop()


FAMILIES = {  # name -> type, as text_string_to_metric_families reports them
    "paraseek_requests_running": "gauge", "paraseek_requests_waiting": "gauge", "paraseek_kv_blocks_used": "gauge",
    "paraseek_kv_blocks_free": "gauge", "paraseek_kv_cache_usage_ratio": "gauge",
    "paraseek_prefix_cache_queries": "counter", "paraseek_prefix_cache_hits": "counter",
    "paraseek_prefix_cache_hit_rate": "gauge", "paraseek_preemptions": "counter",
    "paraseek_prompt_tokens": "counter", "paraseek_generation_tokens": "counter",
    "paraseek_requests": "counter", "paraseek_request_errors": "counter",
    "paraseek_time_to_first_token_seconds": "histogram", "paraseek_time_per_output_token_seconds": "histogram",
    "paraseek_e2e_request_latency_seconds": "histogram",
}


def test_metrics_parse_and_count_a_request(server, tokenizer):
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert {k: families.get(k) for k in FAMILIES} == FAMILIES
    m0 = server.metrics()
    prompt = "A soft answer turneth away wrath"
    server.client().completions.create(model=NAME, prompt=prompt, max_tokens=7, extra_body={"ignore_eos": True})
    m1 = server.metrics()
    delta = {k: m1[k] - m0.get(k, 0) for k in m1}
    assert delta["paraseek_prompt_tokens_total"] == len(tokenizer.encode(prompt))
    assert delta["paraseek_generation_tokens_total"] == 7
    for h in ("time_to_first_token", "e2e_request_latency", "time_per_output_token"):
        assert delta[f"paraseek_{h}_seconds_count"] == 1
        assert delta[f"paraseek_{h}_seconds_sum"] > 0
    assert delta['paraseek_requests_total{finish_reason="length"}'] == 1
    # the pool: 256 sequences (--max-num-seqs) x 32 blocks of 16 tokens (512-token context), cached blocks are free
    assert m1["paraseek_kv_blocks_used"] + m1["paraseek_kv_blocks_free"] == 256 * 32


def test_stops_equal_generate(server, folder, reference):
    """A stop token id and a stop string taken from the reference output end the server's output where they end
    `paraseek generate`'s (finish_reason stop, the stop string excluded)."""
    ref = reference[1]
    stop_id = ref["token_ids"][5]
    stop_text = ref["text"][len(ref["text"]) // 2:][:3]
    client = server.client()
    for flags, extra in [(["--stop-token-ids", str(stop_id)], {"extra_body": {"stop_token_ids": [stop_id]}}),
                         (["--stop", stop_text], {"stop": [stop_text]})]:
        want = generate(folder, [ref["prompt"]], N, *flags)[0]
        r = client.completions.create(model=NAME, prompt=ref["prompt"], max_tokens=N, temperature=0, **extra)
        assert want["finish_reason"] == r.choices[0].finish_reason == "stop"
        assert r.choices[0].text == want["text"] and len(want["text"]) < len(ref["text"])
        assert r.usage.completion_tokens == want["completion_tokens"]
