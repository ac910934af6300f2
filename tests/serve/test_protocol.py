"""Every field of the protocol either works or gets a 400 that names it: logit_bias and allowed_token_ids change
the output as asked, priority orders the waiting queue, seed is bounded to 64 bits, max_completion_tokens 0 is an
error (not "no limit"), and the known fields the server does not implement are refused by name."""

import threading

import httpx
import openai
import pytest
from serve_helpers import NAME
from test_errors import check_error, post, still_serves

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "In the beginning"}]


def test_logit_bias_plus_100_makes_greedy_output_that_token(server, tokenizer):
    """Greedy output with +100 on one token is that token, every time (completions and chat); without the bias
    it is not."""
    client = server.client()
    target = 65
    plain = client.completions.create(model=NAME, prompt="In the beginning", max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].text != tokenizer.decode([target] * 6)
    r = client.completions.create(model=NAME, prompt="In the beginning", max_tokens=6, temperature=0,
                                  logit_bias={str(target): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == tokenizer.decode([target] * 6)
    chat = client.chat.completions.create(model=NAME, messages=MSG, max_tokens=5, temperature=0,
                                          logit_bias={str(target): 100}, logprobs=True)
    assert [e.token for e in chat.choices[0].logprobs.content] == [tokenizer.decode([target])] * 5


def test_allowed_token_ids_limit_the_output(server, tokenizer):
    allowed = [70, 71, 72]
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": NAME, "prompt": "In the beginning", "max_tokens": 8, "temperature": 1.0, "seed": 3,
        "ignore_eos": True, "allowed_token_ids": allowed, "logprobs": 0}).json()
    tokens = r["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 8 and set(tokens) <= {tokenizer.decode([t], skip_special_tokens=False) for t in allowed}


def test_seed_beyond_64_bits_is_a_400_not_a_500(server):
    """2^64 used to reach torch's manual_seed and come back as a 500 (Overflow when unpacking long long)."""
    for seed in (2**64, 2**63, -2**63 - 1):
        check_error(post(server, {"model": NAME, "prompt": "x", "seed": seed}), 400, "invalid_request_error", "seed")
    for seed in (2**63 - 1, -2**63, 0):  # the bounds themselves work, n > 1 included (seed + i)
        r = post(server, {"model": NAME, "prompt": "x", "seed": seed, "max_tokens": 2, "temperature": 1.0, "n": 2})
        assert r.status_code == 200, r.text
    still_serves(server)


def test_max_completion_tokens_zero_is_an_error(server):
    """0 used to read as "no limit" (the chat ran to the end of the context)."""
    for body in ({"max_completion_tokens": 0}, {"max_completion_tokens": -1}, {"max_tokens": 0}):
        name = next(iter(body))
        err = check_error(post(server, {"model": NAME, "messages": MSG, **body}, CHAT), 400, "invalid_request_error",
                          name)
        assert f"{name} must be >= 1" in err["message"]
    r = post(server, {"model": NAME, "messages": MSG, "max_completion_tokens": 3, "max_tokens": 50}, CHAT)
    assert r.json()["usage"]["completion_tokens"] == 3  # the newer name wins


REFUSED = [  # (route, extra fields, the param named)
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/completions", {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ("/v1/completions", {"bad_words": ["x"]}, "bad_words"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ("/v1/completions", {"logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"allowed_token_ids": [999999]}, "allowed_token_ids"),
    ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    (CHAT, {"echo": True}, "echo"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"reasoning_effort": "high"}, "reasoning_effort"),
    (CHAT, {"store": True}, "store"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"chat_template": "{{ 1 }}"}, "chat_template"),
    (CHAT, {"continue_final_message": True}, "continue_final_message"),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format.type"),
    (CHAT, {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    (CHAT, {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
]


@pytest.mark.parametrize("path,extra,param", REFUSED, ids=[f"{i}-{r[2]}" for i, r in enumerate(REFUSED)])
def test_unsupported_fields_are_refused_by_name(server, path, extra, param):
    body = {"model": NAME, **({"messages": MSG} if path == CHAT else {"prompt": "x"}), "max_tokens": 2, **extra}
    check_error(post(server, body, path), 400, "invalid_request_error", param)
    still_serves(server)


def test_neutral_values_and_unknown_fields_are_accepted(server):
    """The refused fields at their defaults are fine, best_of == n works, and fields nobody knows are ignored (as
    OpenAI ignores them)."""
    body = {"model": NAME, "prompt": "x", "max_tokens": 2, "suffix": None, "best_of": 2, "n": 2,
            "use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True,
            "a_field_from_the_future": {"x": 1}, "user": "u-1"}
    r = post(server, body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    chat = {"model": NAME, "messages": MSG, "max_tokens": 2, "store": False, "modalities": ["text"],
            "service_tier": "auto", "metadata": {"k": "v"}, "response_format": {"type": "text"}, "nonsense": 1}
    assert post(server, chat, CHAT).status_code == 200


def test_truncate_prompt_tokens_keeps_the_prompt_end(server, tokenizer):
    prompt = "In the beginning God created the heaven and the earth"
    ids = tokenizer.encode(prompt)
    r = post(server, {"model": NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                      "truncate_prompt_tokens": 5}).json()
    same = post(server, {"model": NAME, "prompt": ids[-5:], "max_tokens": 4, "temperature": 0}).json()
    assert r["usage"]["prompt_tokens"] == 5
    assert r["choices"][0]["text"] == same["choices"][0]["text"]


def test_priority_orders_the_waiting_queue(narrow):
    """One sequence slot: while a long request runs, a priority-5 request and then a priority -5 one queue up;
    the -5 one is admitted first, so it finishes first (lower is sooner, as vLLM's priority)."""
    client = narrow.client()
    done: list[str] = []
    lock = threading.Lock()

    def send(tag: str, priority: int, n_tokens: int):
        client.completions.create(model=NAME, prompt="In the beginning", max_tokens=n_tokens, temperature=0,
                                  extra_body={"ignore_eos": True, "priority": priority})
        with lock:
            done.append(tag)

    first = threading.Thread(target=send, args=("running", 0, 450))
    first.start()
    assert narrow.wait_metric("paraseek_requests_running", 1) == 1
    late = threading.Thread(target=send, args=("late", 5, 20))
    late.start()
    assert narrow.wait_metric("paraseek_requests_waiting", 1) == 1
    urgent = threading.Thread(target=send, args=("urgent", -5, 20))
    urgent.start()
    assert narrow.wait_metric("paraseek_requests_waiting", 2) == 2
    for t in (first, late, urgent):
        t.join(120)
    assert done == ["running", "urgent", "late"]


def test_the_official_client_sees_the_400s(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=MSG, seed=2**64)
    assert e.value.param == "seed"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", suffix="!")
    assert e.value.param == "suffix"


def test_vllm_chat_extensions(server, tokenizer):
    """include_reasoning false drops reasoning_content (whole and streamed); continuous_usage_stats puts the usage
    so far in every chunk; request_id becomes the response's id; OpenAI's developer role renders as system."""
    client = server.client()
    r = client.chat.completions.create(model=NAME, messages=MSG, max_tokens=6, temperature=0,
                                       extra_body={"include_reasoning": False, "request_id": "req-42"})
    assert r.id == "req-42" and "reasoning_content" not in (r.choices[0].message.model_extra or {})
    chunks = list(client.chat.completions.create(
        model=NAME, messages=MSG, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"include_reasoning": False}))
    assert not any((c.choices[0].delta.model_extra or {}).get("reasoning_content") for c in chunks if c.choices)
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert counts == sorted(counts) and counts[-1] == 6
    dev = [{"role": "developer", "content": "Be brief."}, *MSG]
    sys_ = [{"role": "system", "content": "Be brief."}, *MSG]
    a = httpx.post(server.url + "/tokenize", json={"messages": dev}).json()["tokens"]
    assert a == tokenizer.apply_chat_template(sys_, tokenize=True)
