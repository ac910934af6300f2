"""`paraseek generate` and `bench-infer` as a user runs them: a JSON object per prompt with the model folder's own
tokenizer; bad input costs one line and exit code 2 before any weight is loaded."""

import json
import shutil

import pytest
import torch

from paraseek.cli import main
from paraseek.models import ModelArgs, build_model, preset_config, save_pretrained
from paraseek.models.tokenizer import BUNDLED_TOKENIZER


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """tiny-dense with random weights and the bundled tokenizer, as an HF folder."""
    d = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    save_pretrained(build_model(ModelArgs.from_hf_config(preset_config("tiny-dense")), "cpu", torch.float32), d)
    shutil.copy(BUNDLED_TOKENIZER, d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>"}))
    return d


@pytest.fixture
def no_weights_loaded(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the input was checked")

    monkeypatch.setattr("paraseek.infer.load.load_model", refuse)


def test_generate_prints_one_json_object_per_prompt(folder, capsys):
    rc = main(["generate", str(folder), "--prompt", "In the beginning", "--prompt", "The word", "--json", "--quiet",
               "--max-new-tokens", "5", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert rc == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == ["In the beginning", "The word"]
    assert all(r["completion_tokens"] == 5 and len(r["token_ids"]) == 5 and r["finish_reason"] == "length"
               for r in rows)
    assert all(isinstance(r["text"], str) for r in rows)
    assert "tokenizer: the model folder's" in err and "greedy" in err and "KV cache:" in err


def test_generate_reads_jsonl_with_token_ids_and_overrides(folder, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5, 6, 7], "max_tokens": 3, "id": "a"}) + "\n"
                       + json.dumps({"prompt": "And God said", "temperature": 0.8, "seed": 3}) + "\n")
    assert main(["generate", str(folder), "--prompts", str(prompts), "--json", "--quiet", "--ignore-eos",
                 "--max-new-tokens", "4"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows[0]["id"] == "a" and rows[0]["completion_tokens"] == 3 and rows[1]["completion_tokens"] == 4


@pytest.mark.parametrize("argv,message", [
    (["--max-new-tokens", "600"], "exceeds the context of 512"),
    (["--tp", "3"], "--tp 3 does not divide the model's 4 attention heads"),
    (["--top-p", "2"], "top_p must be in (0, 1]"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--device", "cuda"], "no CUDA GPU is visible"),
    (["--block-size", "7"], "--block-size must be a power of two"),
    (["--dp", "0"], "--dp must be >= 1"),
])
def test_bad_input_is_one_line_and_exit_2(folder, argv, message, capsys, no_weights_loaded, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # the CPU's answer, also on a GPU machine
    rc = main(["generate", str(folder), "--prompt", "hello", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert message in err and len(err.splitlines()) == 1, err


def test_bad_sources_are_one_line(tmp_path, capsys, no_weights_loaded):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(preset_config("tiny-dense")))
    cases = [
        ([str(tmp_path / "cfg"), "--prompt", "x"], "no *.safetensors weights"),
        (["tiny-dense", "--prompt", "x"], "is a preset, which has no weights"),
        (["tiny-dense", "--random-weights", "--prompt", "x"], "text prompts need a tokenizer"),
        ([str(tmp_path), "--prompt", "x"], "neither an HF model folder"),
        (["tiny-dense", "--random-weights"], "nothing to generate"),
    ]
    for argv, message in cases:
        assert main(["generate", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_bench_infer_reports_every_workload(capsys):
    rc = main(["bench-infer", "tiny-moe", "--random-weights", "--num-requests", "12", "--input-len", "4:40",
               "--output-len", "2:12", "--latency-input", "16", "--latency-output", "8", "--reps", "1",
               "--concurrency", "1,4", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["throughput"]["requests"] == 12 and r["throughput"]["output_tokens"] > 0
    assert r["latency"]["ms_per_token"] > 0
    assert [c["concurrency"] for c in r["concurrency"]] == [1, 4]


def test_more_gpus_than_visible_is_one_line(folder, capsys, monkeypatch, no_weights_loaded):
    """--tp x --dp beyond the visible GPUs stops before anything loads (a 1-GPU machine is simulated)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["generate", str(folder), "--prompt", "x", "--tp", "2", "--dp", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--tp 2 x --dp 1 = 2 GPUs, but 1 is visible" in err and len(err.splitlines()) == 1


def test_offline_batch_defaults_follow_the_gpu_memory_and_are_said(folder, capsys):
    """generate/bench-infer default to 1,024 sequences and 16,384 tokens a step on GPUs of 70 GiB or more (not the
    A100), 256 and 8,192 elsewhere; a flag the user gives is kept; the chosen values are printed."""
    from paraseek.infer.config import offline_defaults

    assert offline_defaults(139.8, "NVIDIA H200")[:2] == (1024, 16384)
    assert offline_defaults(79.3, "NVIDIA A100-SXM4-80GB")[:2] == (256, 8192)
    assert offline_defaults(44.4, "NVIDIA L40S")[:2] == (256, 8192)
    assert offline_defaults(None)[:2] == (256, 8192)
    rc = main(["generate", str(folder), "--prompt", "In the beginning", "--quiet", "--max-new-tokens", "2",
               "--max-num-seqs", "3"])
    err = capsys.readouterr().err
    assert rc == 0
    assert "engine: up to 3 sequences, 8,192 tokens a step (offline defaults for the CPU; set --max-batched-tokens" in err
