"""Readiness and capacity: until the engine is warm no route looks ready (a client that waits for /v1/models as it
waits for vLLM can then send its requests), and `serve` refuses a KV cache that cannot hold one sequence of
--max-model-len, in one line that says what would fit."""

import asyncio
import os
import subprocess
import sys
import time

import httpx
from serve_helpers import NAME, ROOT, free_port

from paraseek.serve.api import ServerState, build_app


def test_a_loading_server_answers_503_everywhere_but_metrics():
    """The app before its engine exists (in process): /v1/models was a 200 here while every completion got 503."""
    async def probe():
        app = build_app(ServerState(NAME, None, 512))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as c:
            return {path: await (c.get(path) if method == "GET" else c.post(path, json=body))
                    for path, method, body in [
                        ("/health", "GET", None), ("/v1/models", "GET", None),
                        ("/v1/completions", "POST", {"model": NAME, "prompt": "x"}),
                        ("/v1/chat/completions", "POST", {"model": NAME, "messages": [{"role": "user", "content": "x"}]}),
                        ("/tokenize", "POST", {"prompt": "x"}), ("/detokenize", "POST", {"tokens": [1]}),
                        ("/metrics", "GET", None)]}

    answers = asyncio.run(probe())
    for path, r in answers.items():
        if path == "/metrics":
            assert r.status_code == 200
        else:
            assert r.status_code == 503, (path, r.text)
            assert int(r.headers.get("retry-after", 5)) >= 1
    assert answers["/v1/models"].json()["error"]["type"] == "service_unavailable"


def test_waiting_for_v1_models_then_requesting_succeeds(folder):
    """A live server from its first second: poll /v1/models as vLLM users' scripts do; every answer before the
    first 200 is a 503 (or no listener yet), and the completion sent right after that 200 is served."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "paraseek", "serve", str(folder), "--port", str(port),
                             "--served-model-name", NAME], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                r = httpx.get(url + "/v1/models", timeout=5)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            seen.append(r.status_code)
            if r.status_code == 200:
                break
            time.sleep(0.05)
        assert seen and seen[-1] == 200, (seen, proc.poll())
        assert set(seen[:-1]) <= {503}, seen
        r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "In the beginning", "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stderr.close()


def test_a_cache_smaller_than_one_sequence_refuses_to_start(folder):
    """--num-kv-blocks 8 used to start and report healthy with room for 0.2 sequences, then refuse every request
    of default length. Now: exit 2 before listening, one line with what would fit."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "paraseek", "serve", str(folder), "--port", str(port),
                        "--num-kv-blocks", "8"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    # 7 usable blocks of 16 tokens = 112; one sequence of 512 needs 32 blocks plus the padding block
    assert "112 tokens" in lines[0] and "--num-kv-blocks 33" in lines[0] and "--max-model-len 112" in lines[0]
