"""Every error is its HTTP status with OpenAI's error object ({"error": {"message", "type", "param", "code"}}), the
official client maps it to the matching exception, and the server answers a correct request right after."""

import threading

import httpx
import openai
import pytest
from serve_helpers import KEY, LIMIT, NAME

def check_error(r: httpx.Response, status: int, type_: str, param=None, says: str = "") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert err["type"] == type_ and err["param"] == param and err["code"] == status, err
    assert isinstance(err["message"], str) and says in err["message"], err
    return err


def still_serves(server, **headers) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "In the beginning", "max_tokens": 2},
                   headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def post(server, body, path="/v1/completions", **kw) -> httpx.Response:
    kw.setdefault("timeout", 60)
    if isinstance(body, (bytes, str)):
        return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, **kw)
    return httpx.post(server.url + path, json=body, **kw)


BAD = [  # (body, status, type, param, a piece of the message)
    (b'{"model": "tiny", "prompt": ', 400, "invalid_request_error", None, "not valid JSON"),
    (b'[1, 2]', 400, "invalid_request_error", None, "valid dictionary"),
    ({"model": NAME, "prompt": "x", "max_tokens": "5"}, 400, "invalid_request_error", "max_tokens", "valid integer"),
    ({"model": NAME, "prompt": "x", "temperature": "hot"}, 400, "invalid_request_error", "temperature", "number"),
    ({"model": NAME, "prompt": 7}, 400, "invalid_request_error", "prompt", ""),
    ({"model": NAME}, 400, "invalid_request_error", "prompt", "required"),
    ({"model": NAME, "prompt": "x", "max_tokens": 0}, 400, "invalid_request_error", "max_tokens",
     "max_tokens must be >= 1"),
    ({"model": NAME, "prompt": "x", "max_tokens": -3}, 400, "invalid_request_error", "max_tokens",
     "max_tokens must be >= 1"),
    ({"model": NAME, "prompt": "x", "top_p": 2.0}, 400, "invalid_request_error", "top_p", "top_p"),
    ({"model": NAME, "prompt": "a b " * 300, "max_tokens": 4}, 400, "invalid_request_error", "prompt",
     "maximum context length is 512"),
    ({"model": NAME, "prompt": "a b " * 300}, 400, "invalid_request_error", "prompt", "maximum context length is 512"),
    ({"model": NAME, "prompt": "x", "max_tokens": 600}, 400, "invalid_request_error", "prompt",
     "maximum context length is 512"),
    ({"model": NAME, "prompt": [5, 99999]}, 400, "invalid_request_error", "prompt", "token ids must be in"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "not_found_error", "model", "does not exist"),
]


@pytest.mark.parametrize("body,status,type_,param,says", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_completion_requests(server, body, status, type_, param, says):
    check_error(post(server, body), status, type_, param, says)
    still_serves(server)


def test_bad_chat_requests(server):
    chat = "/v1/chat/completions"
    check_error(post(server, {"model": NAME, "messages": []}, chat), 400, "invalid_request_error", "messages")
    check_error(post(server, {"model": NAME, "messages": [{"content": "hi"}]}, chat), 400, "invalid_request_error",
                "messages.0.role", "required")
    check_error(post(server, {"model": NAME, "messages": [{"role": "user", "content": "a b " * 300}]}, chat), 400,
                "invalid_request_error", "messages", "maximum context length is 512")
    check_error(post(server, {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, chat), 404,
                "not_found_error", "model")
    still_serves(server)


def test_unknown_routes_are_openai_errors_too(server):
    check_error(httpx.get(server.url + "/v1/nothing"), 404, "not_found_error")
    check_error(httpx.get(server.url + "/v1/completions"), 405, "invalid_request_error")
    still_serves(server)


def test_the_official_client_raises_the_matching_exceptions(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x")
    assert e.value.status_code == 404 and e.value.param == "model" and e.value.type == "not_found_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", max_tokens=0)
    assert e.value.status_code == 400 and "max_tokens" in e.value.message
    assert client.completions.create(model=NAME, prompt="x", max_tokens=1).usage.completion_tokens == 1


def test_errors_are_counted_by_status(server):
    before = server.metrics()
    post(server, {"model": "nope", "prompt": "x"})
    post(server, {"model": NAME, "prompt": "x", "max_tokens": 0})
    after = server.metrics()
    for status in ("404", "400"):
        key = f'paraseek_request_errors_total{{status="{status}"}}'
        assert after[key] - before.get(key, 0) == 1


# ---- the strict server: API key and body limit -------------------------------------------------------------------
def test_api_key(strict):
    ok = {"model": NAME, "prompt": "x", "max_tokens": 1}
    check_error(post(strict, ok), 401, "authentication_error", says="API key")
    check_error(post(strict, ok, headers={"Authorization": "Bearer wrong"}), 401, "authentication_error")
    check_error(post(strict, ok, headers={"Authorization": KEY}), 401, "authentication_error")  # no "Bearer "
    check_error(httpx.get(strict.url + "/v1/models"), 401, "authentication_error")
    assert httpx.get(strict.url + "/health").status_code == 200  # probes and scrapers need no key
    assert httpx.get(strict.url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        strict.client(api_key="wrong").completions.create(model=NAME, prompt="x", max_tokens=1)
    r = strict.client(api_key=KEY).completions.create(model=NAME, prompt="x", max_tokens=1)
    assert r.usage.completion_tokens == 1
    still_serves(strict, Authorization=f"Bearer {KEY}")


def test_body_too_large(strict):
    auth = {"Authorization": f"Bearer {KEY}"}
    big = {"model": NAME, "prompt": "x" * (2 * LIMIT), "max_tokens": 1}
    check_error(post(strict, big, headers=auth), 413, "invalid_request_error", says=f"{LIMIT:,}")

    def chunked():  # no Content-Length: the limit must be counted as the body arrives
        yield b'{"model": "tiny", "max_tokens": 1, "prompt": "'
        for _ in range(4):
            yield b"x" * LIMIT
        yield b'"}'

    r = httpx.post(strict.url + "/v1/completions", content=chunked(),
                   headers={**auth, "content-type": "application/json"})
    assert "content-length" not in {k.lower() for k in r.request.headers}
    check_error(r, 413, "invalid_request_error", says=f"{LIMIT:,}")
    still_serves(strict, **auth)


# ---- the narrow server: a full queue -------------------------------------------------------------------------------
def test_queue_full_is_429_with_retry_after(narrow):
    """Ten long requests at once on one sequence slot and two queue places: two wait (a third runs if the engine
    took the first off the queue before the rest arrived), the others are refused at once with 429 and
    Retry-After; every request gets one of those answers."""
    answers: list[httpx.Response] = []
    lock = threading.Lock()
    go = threading.Barrier(10)

    def send():
        go.wait()
        r = post(narrow, {"model": NAME, "prompt": "In the beginning", "max_tokens": 150, "ignore_eos": True},
                 timeout=120)
        with lock:
            answers.append(r)

    threads = [threading.Thread(target=send) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert len(answers) == 10
    ok = [r for r in answers if r.status_code == 200]
    full = [r for r in answers if r.status_code == 429]
    assert len(ok) + len(full) == 10, [r.status_code for r in answers]
    assert len(ok) >= 2 and full, [r.status_code for r in answers]
    for r in full:
        check_error(r, 429, "rate_limit_error", says="queue is full")
        assert int(r.headers["retry-after"]) >= 1
    assert all(r.json()["usage"]["completion_tokens"] == 150 for r in ok)
    still_serves(narrow)
