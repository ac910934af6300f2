"""vLLM-compatible operations: the Prometheus scrape (parsed with prometheus_client's own parser) has vLLM's metric
names with the model_name label and counts a request in each histogram; /tokenize and /detokenize; CORS for the
allowed origins only; the OpenAI batch file format through `serve --batch-file`."""

import json
import os
import subprocess
import sys

import httpx
import pytest
from serve_helpers import NAME, ROOT, Server

VLLM_FAMILIES = {  # name -> type, as text_string_to_metric_families reports them
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter", "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram", "vllm:time_per_output_token_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram", "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram", "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:request_params_max_tokens": "histogram",
}
LABEL = 'engine="0",model_name="tiny"'


def test_the_scrape_has_vllms_names_and_counts_a_request(server, tokenizer):
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    assert {k: families[k].type if k in families else None for k in VLLM_FAMILIES} == VLLM_FAMILIES
    for name in VLLM_FAMILIES:
        for sample in families[name].samples:
            assert sample.labels["model_name"] == NAME and sample.labels["engine"] == "0", sample
    m0 = server.metrics()
    prompt = "Blessed are the meek: for they shall inherit the earth"
    server.client().completions.create(model=NAME, prompt=prompt, max_tokens=9, extra_body={"ignore_eos": True})
    m1 = server.metrics()
    delta = {k: v - m0.get(k, 0) for k, v in m1.items()}
    assert delta[f"vllm:prompt_tokens_total{{{LABEL}}}"] == len(tokenizer.encode(prompt))
    assert delta[f"vllm:generation_tokens_total{{{LABEL}}}"] == 9
    assert delta['vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"}'] == 1
    for h in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time",
              "request_decode_time", "request_inference_time", "request_time_per_output_token"):
        assert delta[f"vllm:{h}_seconds_count{{{LABEL}}}"] == 1, h
        assert delta[f"vllm:{h}_seconds_sum{{{LABEL}}}"] >= 0, h
    assert delta[f"vllm:inter_token_latency_seconds_count{{{LABEL}}}"] == 8  # the gaps between 9 tokens
    assert delta[f"vllm:request_generation_tokens_sum{{{LABEL}}}"] == 9
    assert delta[f"vllm:request_params_max_tokens_sum{{{LABEL}}}"] == 9
    # the phases add up: prefill + decode is the inference time, queue + inference the whole (up to the arrival)
    inference = delta[f"vllm:request_inference_time_seconds_sum{{{LABEL}}}"]
    assert inference == pytest.approx(delta[f"vllm:request_prefill_time_seconds_sum{{{LABEL}}}"]
                                      + delta[f"vllm:request_decode_time_seconds_sum{{{LABEL}}}"])
    assert delta[f"vllm:e2e_request_latency_seconds_sum{{{LABEL}}}"] == pytest.approx(
        inference + delta[f"vllm:request_queue_time_seconds_sum{{{LABEL}}}"])
    # vLLM counts the prefix cache in tokens: blocks x 16
    assert m1[f"vllm:prefix_cache_queries_total{{{LABEL}}}"] == 16 * m1["paraseek_prefix_cache_queries_total"]


def test_tokenize_and_detokenize(server, tokenizer):
    text = "In the beginning God created"
    r = httpx.post(server.url + "/tokenize", json={"model": NAME, "prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == tokenizer.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    assert r["token_strs"] == [tokenizer.decode([t], skip_special_tokens=False) for t in r["tokens"]]
    plain = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": text}]}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
    back = httpx.post(server.url + "/detokenize", json={"model": NAME, "tokens": r["tokens"]}).json()
    assert back["prompt"] == tokenizer.decode(r["tokens"], skip_special_tokens=False)
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(server.url + "/tokenize", json={"model": "gpt-4", "prompt": "x"}).status_code == 404


@pytest.fixture(scope="module")
def cors(folder):
    s = Server(folder, "--allowed-origins", '["https://app.example"]', "--api-key", "sk-cors")
    yield s
    s.stop()


PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


def test_cors_preflight_from_an_allowed_origin_gets_the_headers(cors):
    r = httpx.options(cors.url + "/v1/chat/completions", headers={"Origin": "https://app.example", **PREFLIGHT})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    # the real request from that page: answered (with the key) and marked for the browser
    r = httpx.post(cors.url + "/v1/completions", headers={"Origin": "https://app.example",
                                                          "Authorization": "Bearer sk-cors"},
                   json={"model": NAME, "prompt": "x", "max_tokens": 1})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"


def test_cors_from_another_origin_gets_no_headers(cors, server):
    for url in (cors.url, server.url):  # another origin; and a server without --allowed-origins
        r = httpx.options(url + "/v1/chat/completions", headers={"Origin": "https://evil.example", **PREFLIGHT})
        assert not [h for h in r.headers if h.lower().startswith("access-control-")], dict(r.headers)
        r = httpx.get(url + "/health", headers={"Origin": "https://evil.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def run_serve(*argv) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "paraseek", "serve", *argv], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def test_batch_file_in_openai_format(folder, tmp_path, tokenizer):
    rows = [{"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": NAME, "messages": [{"role": "user", "content": "Who begat Enos?"}], "max_tokens": 5}},
            {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": "In the beginning", "max_tokens": 4, "temperature": 0}},  # model defaults
            {"custom_id": "bad-1", "method": "POST", "url": "/v1/completions",
             "body": {"model": NAME, "prompt": "x", "max_tokens": 0}},
            {"custom_id": "seeded-1", "method": "POST", "url": "/v1/completions",
             "body": {"model": NAME, "prompt": "x", "max_tokens": 3, "temperature": 1.0, "seed": 1, "n": 2}}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = run_serve(str(folder), "--served-model-name", NAME, "--batch-file", str(src), "--output", str(out))
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["custom_id"] for g in got] == ["chat-1", "cmpl-1", "bad-1", "seeded-1"]
    chat, cmpl, bad, seeded = got
    for g in (chat, cmpl, seeded):
        assert g["error"] is None and g["response"]["status_code"] == 200 and g["id"].startswith("batch_req_")
        assert g["response"]["request_id"] == g["response"]["body"]["id"]
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["body"]["usage"]["completion_tokens"] == 5
    assert cmpl["response"]["body"]["usage"]["completion_tokens"] == 4
    assert len(seeded["response"]["body"]["choices"]) == 2
    assert bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["param"] == "max_tokens"
    assert bad["error"] == {"code": "invalid_request_error", "message": bad["response"]["body"]["error"]["message"]}


@pytest.mark.parametrize("line,says", [
    ("not json", "not valid JSON"), ('{"custom_id": "a", "url": "/v1/embeddings", "body": {}}', "url must be"),
    ('{"url": "/v1/completions", "body": {}}', "custom_id"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"stream": true}}', "cannot stream")])
def test_a_bad_batch_file_is_one_line_before_loading(folder, tmp_path, line, says):
    src = tmp_path / "in.jsonl"
    src.write_text(line + "\n")
    r = run_serve(str(folder), "--batch-file", str(src), "--output", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "o.jsonl").exists()
