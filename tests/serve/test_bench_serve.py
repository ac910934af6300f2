"""`paraseek bench-serve` against the live tiny servers: the counts it reports are the server's own (forced output
lengths, /metrics deltas), percentiles are ordered, goodput follows the SLOs, failures are counted by status, and
bad input is one line with exit code 2."""

import json

import matplotlib.image
import pytest
from serve_helpers import KEY, free_port

from paraseek.cli import main


def bench(capsys, *argv) -> dict:
    rc = main(["bench-serve", *argv, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def check_ordered(run: dict) -> None:
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        p = run[name]
        assert 0 <= p["p50"] <= p["p90"] <= p["p99"], (name, p)
        assert p["mean"] > 0
    assert run["ttft_ms"]["p50"] <= run["e2e_ms"]["p50"] and run["ttft_ms"]["p99"] <= run["e2e_ms"]["p99"] * 1.0001


def test_bench_serve_is_also_bench_with_serve(server, capsys):
    """`paraseek bench --serve URL` (vLLM's spelling, as in `vllm bench serve`) runs bench-serve on URL with the
    other flags."""
    rc = main(["bench", "--num-prompts", "4", "--serve", server.url, "--input-len", "8", "--output-len", "3", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    (run,) = json.loads(out)["runs"]
    assert run["requests"] == run["completed"] == 4 and run["output_tokens"] == 4 * 3


def test_completions_at_a_poisson_rate(server, capsys):
    m0 = server.metrics()
    doc = bench(capsys, server.url, "--num-prompts", "16", "--input-len", "4:40", "--output-len", "3:9",
                "--request-rate", "50", "--slo-ttft-ms", "1e7", "--slo-tpot-ms", "1e7")
    m1 = server.metrics()
    assert doc["model"] == "tiny"  # asked of /v1/models
    (run,) = doc["runs"]
    assert run["requests"] == run["completed"] == 16 and run["failed"] == {}
    # the whole output of the 16 requests plus the untimed first request (at most 4 tokens)
    generated = m1["paraseek_generation_tokens_total"] - m0["paraseek_generation_tokens_total"]
    assert 16 * 3 <= run["output_tokens"] <= 16 * 9
    assert generated - run["output_tokens"] in range(1, 5)
    prompts = m1["paraseek_prompt_tokens_total"] - m0["paraseek_prompt_tokens_total"]
    assert 16 * 4 <= run["input_tokens"] <= 16 * 40 and prompts - run["input_tokens"] in range(4, 41)
    assert run["request_throughput"] == pytest.approx(16 / run["duration_s"])
    assert run["output_throughput"] == pytest.approx(run["output_tokens"] / run["duration_s"])
    total = run["input_tokens"] + run["output_tokens"]
    assert run["total_token_throughput"] == pytest.approx(total / run["duration_s"])
    assert run["goodput"] == pytest.approx(run["request_throughput"])  # SLOs nobody misses
    # 16 Poisson arrivals at 50/s take about 0.3 s; the run cannot be shorter than the last arrival
    assert run["duration_s"] > 0.05
    check_ordered(run)


def test_chat_sweep_over_concurrency_with_a_plot(server, capsys, tmp_path):
    png = tmp_path / "sweep.png"
    doc = bench(capsys, server.url, "--endpoint", "chat", "--num-prompts", "6", "--input-len", "5",
                "--output-len", "6", "--max-concurrency", "1", "--sweep", "1,3", "--slo-tpot-ms", "1e-6",
                "--plot", str(png))
    assert [r["max_concurrency"] for r in doc["runs"]] == [1, 3] and doc["sweep"] == "concurrency"
    for run in doc["runs"]:
        assert run["completed"] == 6 and run["output_tokens"] == 36  # forced: 6 x 6
        assert run["goodput"] == 0  # nobody makes a 1 ns TPOT
        check_ordered(run)
    assert matplotlib.image.imread(png).shape[:2] == (480, 1320)  # 11 x 4 inches at 120 dpi


def test_each_sweep_point_sends_new_prompts(server, capsys, tmp_path):
    """The same prompts again would be prefix-cache hits: each point draws its own, and the run says what the
    server's cache gave it; a prompts file is sent again, and its second pass hits."""
    # a seed of its own: the other tests' prompts (the default seed) are in the shared server's cache
    doc = bench(capsys, server.url, "--num-prompts", "4", "--input-len", "40", "--output-len", "2",
                "--max-concurrency", "2", "--sweep", "1,2", "--seed", "101")
    assert [r["prefix_cache_hit_rate"] for r in doc["runs"]] == [0.0, 0.0]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt_token_ids": [3 + (i * 7 + j) % 90 for j in range(40)]}) + "\n"
                         for i in range(3)))
    doc = bench(capsys, server.url, "--prompts", str(f), "--output-len", "2", "--max-concurrency", "1",
                "--sweep", "1,1")
    first, second = (r["prefix_cache_hit_rate"] for r in doc["runs"])
    assert second == 1.0 and first < second  # 2 full blocks of each prompt, all cached by the first pass


def test_prompts_file(server, capsys, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [{"prompt": "In the beginning", "max_tokens": 5},
                                                  {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 3},
                                                  {"prompt": "The word"}]) + "\n")
    doc = bench(capsys, server.url, "--prompts", str(f), "--output-len", "2")
    (run,) = doc["runs"]
    assert run["completed"] == 3 and run["output_tokens"] == 5 + 3 + 2


def test_failures_are_counted_by_status(narrow, capsys):
    """Ten at once at a server with one sequence slot and two queue places: the refused ones are 429s."""
    doc = bench(capsys, narrow.url, "--num-prompts", "10", "--input-len", "8", "--output-len", "60")
    (run,) = doc["runs"]
    # two fit the queue, a third too once the engine has moved the first to its one slot
    assert run["completed"] >= 2 and set(run["failed"]) == {"429"}
    assert run["completed"] + run["failed"]["429"] == 10
    assert run["output_tokens"] == 60 * run["completed"]


@pytest.mark.parametrize("argv,message", [
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--input-len", "9:3"], "--input-len must be N or LO:HI"),
    (["--output-len", "x"], "--output-len must be N or LO:HI"),
    (["--request-rate", "-2"], "--request-rate must be > 0"),
    (["--sweep", "1,fast"], "--sweep must be a number"),
    (["--max-concurrency", "2", "--sweep", "1,0"], "concurrencies must be >= 1"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--prompts", "/nonexistent.jsonl"], "no such file"),
    (["--model", "nope"], "The model `nope` does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(server, argv, message, capsys):
    assert main(["bench-serve", server.url, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_url_that_does_not_answer(capsys):
    assert main(["bench-serve", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not answer" in err and len(err.splitlines()) == 1, err


def test_api_key(strict, capsys):
    assert main(["bench-serve", strict.url, "--num-prompts", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "wants an API key" in err and len(err.splitlines()) == 1, err
    doc = bench(capsys, strict.url, "--api-key", KEY, "--num-prompts", "2", "--input-len", "4", "--output-len", "2")
    assert doc["runs"][0]["completed"] == 2


def test_a_server_without_a_tokenizer_streams_token_ids(capsys):
    """Random weights of a preset have no tokenizer (the GPU benchmarks serve them): each token still goes out as
    its own chunk, with its id, so that bench-serve times the first token and the gaps, not only the end."""
    import httpx
    from serve_helpers import Server

    s = Server("tiny-dense", "--random-weights")
    try:
        body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 6, "ignore_eos": True, "temperature": 0}
        whole = httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        streamed = []
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed += [json.loads(line[6:])["choices"][0]["token_ids"]]
        assert len(whole["token_ids"]) == 6 and streamed == [[t] for t in whole["token_ids"]]
        run = bench(capsys, s.url, "--num-prompts", "4", "--input-len", "4", "--output-len", "6")["runs"][0]
        assert run["completed"] == 4 and run["output_tokens"] == 24
        assert run["ttft_ms"]["p50"] < run["e2e_ms"]["p50"] and run["tpot_ms"]["p50"] > 0
    finally:
        s.stop()


@pytest.mark.parametrize("mode,endpoint", [("json", "chat"), ("json", "completions"), ("tools", "chat")])
def test_structured_requests(v3_server, capsys, mode, endpoint):
    """--structured sends response_format or tools with tool_choice required; the outputs end where the grammar
    does (no ignore_eos), so the token count is the server's usage of what was generated."""
    m0 = v3_server.metrics()
    doc = bench(capsys, v3_server.url, "--structured", mode, "--endpoint", endpoint, "--num-prompts", "3",
                "--input-len", "6", "--output-len", "300", "--seed", "7")
    m1 = v3_server.metrics()
    (run,) = doc["runs"]
    assert doc["structured"] == mode and run["completed"] == 3 and run["failed"] == {}
    assert 3 <= run["output_tokens"] <= 3 * 300
    generated = m1["paraseek_generation_tokens_total"] - m0["paraseek_generation_tokens_total"]
    assert generated - run["output_tokens"] in range(1, 5)  # plus the untimed first request


def test_structured_tools_need_chat(server, capsys):
    assert main(["bench-serve", server.url, "--structured", "tools"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--structured tools needs --endpoint chat" in err and len(err.splitlines()) == 1, err
