"""SIGTERM: the server stops admitting at once (503 or a refused connection), lets the running request finish within
--drain-timeout or cuts it off there, and exits 0."""

import json
import signal
import threading
import time

import httpx
from serve_helpers import NAME, Server

LONG = 400  # forced output tokens: about a second or more of decoding on the CPU


def start_stream(server: Server, max_tokens: int) -> tuple[threading.Thread, dict, threading.Event]:
    """A streamed forced-length completion on its own thread; `first` is set once its first token arrived."""
    out: dict = {"chunks": [], "done": False, "error": None}
    first = threading.Event()

    def run():
        body = {"model": NAME, "prompt": "In the beginning", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        out["done"] = True
                    elif line.startswith("data: "):
                        out["chunks"].append(line)
                        first.set()
        except httpx.HTTPError as e:
            out["error"] = e
        first.set()

    t = threading.Thread(target=run)
    t.start()
    return t, out, first


def refused_or_503(server: Server) -> None:
    """A new request during the drain: the listening socket is closed (refused) or the server says 503."""
    try:
        r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 1},
                       timeout=10)
    except httpx.ConnectError:
        return
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text


def test_sigterm_drains_the_running_request_and_exits_0(folder):
    s = Server(folder, "--drain-timeout", "60")
    try:
        t, out, first = start_stream(s, LONG)
        assert first.wait(60) and out["error"] is None
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        refused_or_503(s)
        t.join(90)
        rc = s.proc.wait(90)
        took = time.monotonic() - t0
        assert rc == 0, s.stderr()
        assert out["error"] is None and out["done"], "the running request was cut off during the drain"
        usage = out["chunks"][-1]
        assert f'"completion_tokens": {LONG}' in usage, usage
        assert took < 90
        assert "stopped (SIGTERM)" in s.stderr()
    finally:
        s.stop()


def test_sigterm_cuts_off_what_outlasts_the_drain_timeout(folder):
    """--drain-timeout 0.3 s is shorter than a 500-token request: at the deadline a streamed request ends with an
    error event (503) and no [DONE], a non-streamed one gets a 503 error object, nothing is cancelled mid-write
    (no traceback in the log), and the process exits 0 soon after."""
    s = Server(folder, "--drain-timeout", "0.3")
    try:
        t, out, first = start_stream(s, 500)
        plain: dict = {}

        def non_streamed():
            body = {"model": NAME, "prompt": "The word was", "max_tokens": 500, "ignore_eos": True}
            plain["r"] = httpx.post(s.url + "/v1/completions", json=body, timeout=60)

        t2 = threading.Thread(target=non_streamed)
        t2.start()
        assert first.wait(60) and out["error"] is None
        assert s.wait_metric("paraseek_requests_running", 2, timeout=30) == 2  # both in flight before the signal
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        rc = s.proc.wait(60)
        took = time.monotonic() - t0
        t.join(30)
        t2.join(30)
        assert rc == 0, s.stderr()
        assert out["error"] is None and not out["done"], out["error"]  # a clean end of the stream, without [DONE]
        last = json.loads(out["chunks"][-1].removeprefix("data: "))
        assert last["error"]["code"] == 503 and "--drain-timeout" in last["error"]["message"], last
        assert len(out["chunks"]) < 500
        r = plain["r"]
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
        assert "Traceback" not in s.stderr(), s.stderr()
        assert took < 30, f"exit took {took:.1f} s after a 0.3 s drain"
    finally:
        s.stop()
