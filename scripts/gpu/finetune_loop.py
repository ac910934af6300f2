"""The fine-tuning suites of scripts/gpu/validate.py (`finetune`, `finetune_v2lite`): tokens/s/GPU and peak memory
of full fine-tuning and LoRA on a chat .jsonl beside the plain-text run of the same shape (the planner's prediction
beside each), then the whole loop on the R1-Distill-Qwen-1.5B shape: train (full and LoRA) -> export (merged HF
folder, PEFT adapter) -> `paraseek generate --chat` and `paraseek serve` answering a chat request.

    python scripts/gpu/validate.py finetune,finetune_v2lite --out DIR

finetune: R1-Distill-Qwen-1.5B, text, chat full and chat LoRA (the chat runs with a validation loss, an HF export and
a checkpoint), then export, generate and serve. finetune_v2lite: DeepSeek-V2-Lite cut to 6 layers so that full
fine-tuning fits one GPU, the same three runs. Models have random weights saved once as an HF folder (one seeded bf16
initialization, with the bundled tokenizer and R1-Distill's chat template); the chat corpus is built from the bundled
text. FINETUNE_TINY=1 runs the plumbing on CPU with the tiny presets.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from suites import CORPUS, DEADLINE, ENV, MODELS, ROOT, sh, stop_server

TINY = os.environ.get("FINETUNE_TINY") == "1"
TEMPLATE = ROOT / "tests" / "fixtures" / "chat_templates" / "deepseek_r1_distill_qwen.jinja"
DEVICE = "cpu" if TINY else "cuda"
SEQ = "256" if TINY else "4096"
STEPS = "4" if TINY else "20"


def model_folder(name: str, preset: str, layers: int | None) -> str:
    """An HF folder: `preset` (cut to `layers`) with one seeded bf16 initialization, the bundled tokenizer and
    R1-Distill's chat template (bos and eos are the tokenizer's own)."""
    import torch

    from paraseek.models import build_model, save_pretrained
    from paraseek.models.args import ModelArgs, preset_config
    from paraseek.models.tokenizer import BUNDLED_TOKENIZER

    path = MODELS / name
    if (path / "tokenizer_config.json").exists():
        return str(path)
    cfg = preset_config(preset)
    if layers:
        cfg = {**cfg, "num_hidden_layers": layers}
    torch.manual_seed(1234)
    model = build_model(ModelArgs.from_hf_config(cfg), DEVICE, torch.bfloat16)
    save_pretrained(model, path)
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    shutil.copy(BUNDLED_TOKENIZER, path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": TEMPLATE.read_text(encoding="utf-8")}))
    return str(path)


def chat_data(out: Path, n: int) -> str:
    """n conversations (1-3 turns, a system prompt in every fourth) cut from the bundled corpus's lines: user turns
    of 10-60 words, assistant turns of 40-400."""
    path = out / "chat.jsonl"
    if path.exists():
        return str(path)
    words = " ".join(p.read_text(encoding="utf-8") for p in sorted(CORPUS.glob("*.txt"))).split()
    rng = random.Random(0)

    def say(lo: int, hi: int) -> str:
        k = rng.randint(lo, hi)
        i = rng.randrange(len(words) - k)
        return " ".join(words[i:i + k])

    with open(path, "w") as f:
        for i in range(n):
            messages = [{"role": "system", "content": say(5, 20)}] if i % 4 == 0 else []
            for _ in range(1 + i % 3):
                messages += [{"role": "user", "content": say(10, 60)}, {"role": "assistant", "content": say(40, 400)}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return str(path)


def predict(argv: list[str]) -> dict | None:
    """The planner's prediction for a train command, as `paraseek bench` reports it (train/launch.py: _predict)."""
    if TINY:
        return None
    from paraseek.cli import build_parser
    from paraseek.train.config import resolve_defaults
    from paraseek.train.flags import from_namespace
    from paraseek.train.validate import validate
    from paraseek.train.launch import _predict

    ns = build_parser().parse_args(["train", *argv])
    cfg = resolve_defaults(from_namespace(ns), cuda_available=True, gpu_count=1)
    validate(cfg, cuda_available=True, gpu_count=1)
    p = _predict(cfg)
    return {"memory_gib": round(p["memory_gib"], 2), "tokens_per_s_per_gpu": round(p["tokens_per_s_per_gpu"]),
            "memory_breakdown_gib": {k: round(v, 3) for k, v in p["memory_breakdown_gib"].items() if v}} if p else None


def allocated_items(predicted: dict) -> float:
    """The planner's GiB without the two items max_memory_allocated cannot count (the CUDA context, outside the
    caching allocator, and its fragmentation): what the measured allocated peak is compared with like for like."""
    b = predicted["memory_breakdown_gib"]
    return predicted["memory_gib"] - b.get("cuda_context", 0.0) - b.get("allocator_overhead", 0.0)


def train(out: Path, name: str, argv: list[str], timeout: int = 300) -> dict:
    jsonl = out / f"{name}.jsonl"
    jsonl.unlink(missing_ok=True)
    full = ["--device", DEVICE, "--nproc", "1", "--seq-len", SEQ, "--steps", STEPS, "--log-every", "1",
            "--metrics-jsonl", str(jsonl), "--lr-schedule", "constant", "--warmup-steps", "2", *argv]
    try:
        predicted = predict(full)
    except Exception as e:  # the run is measured either way
        predicted = {"error": f"{type(e).__name__}: {e}"}
    rc, text = sh([sys.executable, "-m", "paraseek", "train", *full], timeout)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    steps = [r for r in rows if "event" not in r]
    tail = steps[3:] or steps  # past compile and the allocator's warm-up
    tps = sorted(r["tokens_per_s_per_gpu"] for r in tail)
    r = {"name": name, "rc": rc, "tokens_per_s_per_gpu": round(tps[len(tps) // 2]) if tps else None,
         "mem_peak_gib": max((r["mem_peak_gib"] for r in steps), default=None),
         "mfu": sorted(x.get("mfu") or 0 for x in tail)[len(tail) // 2] if tail else None,
         "loss_first_last": [steps[0]["loss"], steps[-1]["loss"]] if steps else None,
         "events": [e for e in rows if "event" in e][:6], "predicted": predicted}
    if predicted and r["mem_peak_gib"] and "memory_gib" in predicted:
        r["memory_error"] = round(predicted["memory_gib"] / r["mem_peak_gib"] - 1, 4)
        r["memory_error_allocated"] = round(allocated_items(predicted) / r["mem_peak_gib"] - 1, 4)
    if rc:
        r["tail"] = text[-1500:]
    print(f"    {name}: {r['tokens_per_s_per_gpu']} tok/s/GPU, {r['mem_peak_gib']} GiB "
          f"(predicted {predicted.get('memory_gib') if predicted else None}), loss {r['loss_first_last']}", flush=True)
    return r


LORA = ["--lora-rank", "16", "--lora-alpha", "32"]
WORK = MODELS / "loop"  # group_qwen's HF export and LoRA checkpoint, which group_loop exports and serves


def three(out: Path, tag: str, init: str, flags: list[str], full: list[str] = (), lora: list[str] = ()) -> list[dict]:
    """Plain text, chat full fine-tuning, chat LoRA: the same shape, initialization and flags (`full`, `lora`: the
    chat runs' own extra flags)."""
    chat = chat_data(out, 400 if TINY else 6000)
    base = ["--init-from", init, "--tokenizer", init, *flags]
    return [train(out, f"{tag}-text-full", [*base, "--data", str(CORPUS)]),
            train(out, f"{tag}-chat-full", [*base, "--data", chat, *full]),
            train(out, f"{tag}-chat-lora", [*base, "--data", chat, *LORA, *lora])]


def group_qwen(out: Path) -> list[dict]:
    """The 1.5B shape; its chat runs also hold out 1% for a validation loss every 10 steps, and write what group_loop
    uses: the full run an HF folder (--export-hf), the LoRA run a checkpoint."""
    init = model_folder("qwen15-chat", "tiny-dense" if TINY else "deepseek-r1-distill-qwen-1.5b", None)
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    flags = ["--global-batch-size", "4", "--micro-batch-size", "2", "--activation-checkpointing", "selective"]
    evals = ["--eval-split", "0.01", "--eval-every", "10"]
    return three(out, "qwen1.5b", init, flags, [*evals, "--export-hf", str(WORK / "full-hf")],
                 [*evals, "--checkpoint-dir", str(WORK / "lora-ck")])


def group_v2lite(out: Path) -> list[dict]:
    init = model_folder("v2lite6-chat", "tiny-moe" if TINY else "deepseek-v2-lite", None if TINY else 6)
    flags = ["--global-batch-size", "2", "--micro-batch-size", "2", "--activation-checkpointing", "selective"]
    return three(out, "v2lite6", init, flags)


def group_loop(out: Path) -> list[dict]:
    """After group_qwen: its LoRA checkpoint exported with --merge-lora and --export-adapter, `generate --chat`
    from the full run's HF folder and from the merged one, and `serve` answering one chat completion."""
    runs = []
    for what, flag in (("merged", "--merge-lora"), ("adapter", "--export-adapter")):
        rc, text = sh([sys.executable, "-m", "paraseek", "export", str(WORK / "lora-ck"), str(WORK / what), flag], 200)
        files = sorted(p.name for p in (WORK / what).iterdir()) if (WORK / what).exists() else []
        runs.append({"name": f"export {flag}", "rc": rc, "files": files, "tail": text[-600:] if rc else ""})
    prompt = "In the beginning God created the heaven and the earth. What came next?"
    for what in ("full-hf", "merged"):
        if not (WORK / what).is_dir():
            continue  # group_qwen cut short
        rc, text = sh([sys.executable, "-m", "paraseek", "generate", str(WORK / what), "--chat", "--prompt", prompt,
                       "--max-new-tokens", "24", "--json", "--quiet", "--device", DEVICE], 240)
        line = next((ln for ln in text.splitlines() if ln.startswith("{")), "")
        runs.append({"name": f"generate --chat {what}", "rc": rc, "result": line[:400]})
    runs.append(serve_chat(WORK / "merged", prompt))
    return runs


def serve_chat(model: Path, prompt: str) -> dict:
    port = 8123
    server = subprocess.Popen([sys.executable, "-m", "paraseek", "serve", str(model), "--port", str(port),
                               "--device", DEVICE, "--served-model-name", "finetuned"], env=ENV, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, t0, answer, rc = f"http://127.0.0.1:{port}", time.time(), "", 1
    while time.time() - t0 < 180 and server.poll() is None and time.time() < DEADLINE:
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                break
        except OSError:
            time.sleep(1)
    try:
        body = json.dumps({"model": "finetuned", "max_tokens": 24, "temperature": 0,
                           "messages": [{"role": "user", "content": prompt}]}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        answer = urllib.request.urlopen(req, timeout=60).read().decode()[:600]
        rc = 0
    except OSError as e:
        answer = f"{type(e).__name__}: {e}"
    code = stop_server(server, 60)
    log = server.stdout.read()[-800:] if server.stdout else ""
    print(f"  serve chat: {answer[:300]} (exit {code})", flush=True)
    return {"name": "serve chat completion (merged)", "rc": rc if code == 0 else 1, "result": answer,
            "exit_code": code, "tail": log if rc else ""}
