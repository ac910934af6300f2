"""LoRA adapters behind the OpenAI API, through the official client against a live server: two adapters trained by
`paraseek train --lora-rank` on the served model (different data) and exported with --export-adapter; a request's
model picks the base or an adapter, and each answer equals `paraseek generate` on that adapter's merged export (token
for token, base and adapter requests in flight together); adapters load and unload at runtime (vLLM's routes);
unknown names, bad folders, too large ranks, full slots and an unload under a running request are JSON errors and
the server keeps serving."""

import asyncio
import json
import time

import httpx
import openai
import pytest
import torch
from serve_helpers import NAME, PROMPTS, Server, free_port, generate, token_strings
from safetensors.torch import load_file, save_file

from paraseek.cli import main

N = 10  # new tokens per request


@pytest.fixture(scope="module")
def adapters(folder, tmp_path_factory):
    """{seed: (adapter folder, merged folder)} of two 3-step LoRA runs (rank 4 on every projection, synthetic data
    of seeds 1 and 2) on the served model."""
    root = tmp_path_factory.mktemp("lora-serve")
    out = {}
    for seed in (1, 2):
        ck = root / f"ck{seed}"
        assert main(["train", "--init-from", str(folder), "--device", "cpu", "--nproc", "1", "--precision", "fp32",
                     "--lr", "0.02", "--lr-schedule", "constant", "--warmup-steps", "0", "--data", "synthetic",
                     "--seq-len", "32", "--global-batch-size", "4", "--micro-batch-size", "4", "--steps", "3",
                     "--lora-rank", "4", "--lora-alpha", "8", "--checkpoint-dir", str(ck), "--seed", str(seed),
                     "--log-every", "100"]) == 0
        assert main(["export", str(ck), str(root / f"adapter{seed}"), "--export-adapter", "--dtype", "float32"]) == 0
        assert main(["export", str(ck), str(root / f"merged{seed}"), "--merge-lora", "--dtype", "float32"]) == 0
        out[seed] = (root / f"adapter{seed}", root / f"merged{seed}")
    return out


@pytest.fixture(scope="module")
def references(folder, adapters):
    """`paraseek generate` (greedy) on PROMPTS[:2] with the base model and each merged export."""
    refs = {None: generate(folder, PROMPTS[:2], N)}
    for seed, name in ((1, "alpha"), (2, "beta")):
        refs[name] = generate(adapters[seed][1], PROMPTS[:2], N)
        assert [r["token_ids"] for r in refs[name]] != [r["token_ids"] for r in refs[None]]  # the adapter matters
    return refs


@pytest.fixture(scope="module")
def lora_server(folder, adapters):
    """alpha from the start; two slots of rank 8 (beta is loaded by the tests)."""
    s = Server(folder, "--lora-modules", f"alpha={adapters[1][0]}", "--max-loras", "2", "--max-lora-rank", "8")
    yield s
    s.stop()


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=60)


def _error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert all(w in err["message"] for w in words), err
    return err


def test_models_lists_the_adapters_with_their_parent(lora_server, adapters):
    models = {m.id: m for m in lora_server.client().models.list().data}
    assert list(models) == [NAME, "alpha"]
    assert models["alpha"].model_extra["parent"] == NAME and models[NAME].model_extra["parent"] is None
    assert models["alpha"].model_extra["root"] == str(adapters[1][0])


def test_adapter_and_base_requests_together_equal_their_merged_models(lora_server, references, tokenizer):
    async def run():
        client = lora_server.async_client()
        jobs = [(model, ref) for i in range(2) for model, ref in ((None, references[None][i]),
                                                                 ("alpha", references["alpha"][i]))]
        answers = await asyncio.gather(*(client.completions.create(
            model=model or NAME, prompt=ref["prompt"], max_tokens=N, temperature=0, logprobs=0) for model, ref in jobs))
        return jobs, answers

    for (model, ref), r in zip(*asyncio.run(run())):
        assert r.model == (model or NAME)
        assert r.choices[0].text == ref["text"], model
        assert r.choices[0].logprobs.tokens == token_strings(tokenizer, ref["token_ids"])


def test_chat_on_an_adapter_equals_generate_chat_on_its_merged_model(lora_server, adapters):
    ref = generate(adapters[1][1], PROMPTS[2:3], N, "--chat")[0]
    r = lora_server.client().chat.completions.create(model="alpha", messages=[{"role": "user", "content": PROMPTS[2]}],
                                                     max_tokens=N, temperature=0)
    msg = r.choices[0].message
    assert (msg.model_extra.get("reasoning_content") or "") + (msg.content or "") == ref["text"]
    assert r.usage.completion_tokens == ref["completion_tokens"] and r.model == "alpha"


def test_load_and_unload_at_runtime(lora_server, adapters, references):
    r = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "beta", "lora_path": str(adapters[2][0])})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'beta' added successfully."
    client = lora_server.client()
    assert [m.id for m in client.models.list().data] == [NAME, "alpha", "beta"]
    for ref in references["beta"]:
        out = client.completions.create(model="beta", prompt=ref["prompt"], max_tokens=N, temperature=0)
        assert out.choices[0].text == ref["text"]
    r = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "beta"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'beta' removed successfully."
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="beta", prompt="x", max_tokens=2)
    err = _error(_post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "beta"}), 404, "no LoRA adapter named")
    assert err["type"] == "not_found_error" and err["param"] == "lora_name"
    assert [m.id for m in client.models.list().data] == [NAME, "alpha"]


def test_adapter_errors_are_json_and_the_server_keeps_serving(lora_server, adapters, references, tmp_path):
    with pytest.raises(openai.NotFoundError, match="the LoRA adapter alpha"):  # the message lists what is served
        lora_server.client().completions.create(model="gamma", prompt="x", max_tokens=2)
    load = lambda name, path: _post(lora_server, "/v1/load_lora_adapter",  # noqa: E731
                                    {"lora_name": name, "lora_path": str(path)})
    _error(_post(lora_server, "/v1/load_lora_adapter", {"lora_name": "x"}), 400, "lora_path")
    _error(load(NAME, adapters[2][0]), 400, "base model's name")
    _error(load("alpha", adapters[2][0]), 400, "already loaded")
    assert _error(load("gamma", tmp_path / "none"), 404, "no such adapter folder")["param"] == "lora_path"
    _error(load("gamma", tmp_path), 400, "not a PEFT adapter folder")
    wide = tmp_path / "rank16"  # the same adapter padded with zeros to rank 16 (its update unchanged)
    wide.mkdir()
    (wide / "adapter_config.json").write_text(json.dumps({**json.loads(
        (adapters[2][0] / "adapter_config.json").read_text()), "r": 16, "lora_alpha": 32}))
    pad = {k: torch.cat([t, torch.zeros(12, t.shape[1])]) if ".lora_A." in k else
           torch.cat([t, torch.zeros(t.shape[0], 12)], 1)
           for k, t in load_file(str(adapters[2][0] / "adapter_model.safetensors")).items()}
    save_file(pad, str(wide / "adapter_model.safetensors"))
    _error(load("gamma", wide), 400, "rank 16", "above --max-lora-rank 8")
    assert load("beta", adapters[2][0]).status_code == 200
    _error(load("gamma", adapters[2][0]), 400, "all 2 adapter slots")
    assert _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "beta"}).status_code == 200
    ref = references["alpha"][0]
    out = lora_server.client().completions.create(model="alpha", prompt=ref["prompt"], max_tokens=N, temperature=0)
    assert out.choices[0].text == ref["text"]


def test_unloading_an_adapter_with_a_running_request_is_refused(lora_server, adapters):
    """The request keeps its adapter to the end: the unload is a 400 until it is done (here: cancelled)."""
    client = lora_server.client()
    stream = client.completions.create(model="alpha", prompt=PROMPTS[3], max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # running
    assert 'running_lora_adapters="alpha"' in httpx.get(lora_server.url + "/metrics", timeout=10).text
    _error(_post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "alpha"}), 400, "1 unfinished request")
    stream.close()  # the client goes away: its request is aborted, and the adapter is free to go
    deadline = time.monotonic() + 20
    while (r := _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "alpha"})).status_code != 200:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.1)
    assert _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "alpha", "lora_path": str(adapters[1][0])}
                 ).status_code == 200
    idle = 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}'
    assert lora_server.metrics()[idle] > 0


def test_bad_lora_flags_cost_one_line(folder, adapters, tmp_path, capsys):
    port = str(free_port())
    common = ["serve", str(folder), "--port", port, "--device", "cpu"]
    for argv, message in [(["--lora-modules", f"a={tmp_path / 'none'}"], "no such adapter folder"),
                          (["--lora-modules", "a"], "give NAME=PATH"),
                          (["--lora-modules", f"a={adapters[1][0]}", "--max-lora-rank", "2"], "above --max-lora-rank 2"),
                          (["--lora-modules", f"a={adapters[1][0]}", "--dp", "2"], "--dp > 1"),
                          (["--lora-modules", f"{NAME}={adapters[1][0]}", "--served-model-name", NAME],
                           "base model's --served-model-name")]:
        capsys.readouterr()
        assert main([*common, *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, (argv, err)
