"""Training measurements on the GPU machine, as named suites (scripts/gpu/suites.py runs them; BENCHMARKS.md,
"Reproducing", lists each one with the table it feeds):

    python scripts/gpu/validate.py SUITE[,SUITE...] --out DIR [--anchors DIR]

Suites (the tables' runs: 2x H200, or one H200 where a suite says one GPU):
  dense        [peer: HF + FSDP2] Llama-3.1-8B (R1-Distill-Llama-8B) and DeepSeek-LLM-7B, best plans (compiled,
               parameters kept gathered) against the HF + FSDP2 baseline in the same run, micro-batch 2.
  v2lite       [peer: HF + FSDP2] DeepSeek-V2-Lite cut to 14 layers against the baseline at micro-batch 2 and 4,
               paraseek without checkpointing, compiled, parameters kept gathered.
  weak         7B weak scaling 1 -> 2 GPUs, same flags and per-GPU batch.
  long_seq     7B at 16,384 and 32,768 tokens a sequence, full checkpointing.
  v2lite_ep    V2-Lite (14 layers) compiled without checkpointing: FSDP2 with parameters kept gathered against
               --ep 2, micro-batch 2 and 4.
  plan         nine eager plans on 1 and 2 GPUs: the 7B under FSDP2 with full, selective and no checkpointing, on
               one GPU, with --tp 2 and --pp 2; V2-Lite (14 layers) under FSDP2 and --ep 2.
  loss         DeepSeek-LLM-7B and DeepSeek-V2-Lite widths cut to 4 layers, one saved bf16 initialization, 20 steps
               on the bundled corpus: 1 GPU against FSDP2, tp=2, pp=2 (dense) and ep=2, pp=2 (MoE); the largest
               relative loss difference to the 1-GPU curve, tokens/s/GPU and peak memory of each.
  loss_chunks  the Llama-8B shape's best plan with and without --loss-chunks 8, and micro-batch 3 with it.
  moe_layer    one GPU: one DeepSeek-V2-Lite MoE layer, grouped GEMM against the per-expert loop and transformers'
               layer (scripts/gpu/bench_moe_layer.py).
  fp8peer      [peer: TorchTitan] one GPU: TorchTitan's float8 tensorwise and rowwise (torchtitan_peer.sh ds7b,
               compiled), then DeepSeek-LLM-7B with its best bf16 flags, with --fp8 tensorwise and rowwise.
  fp8llama     one GPU: the Llama-3.1-8B shape cut to 16 layers, the same flags, bf16 and both recipes.
  fp8parity    one GPU: 500 steps (seq 2048) of the 7B width cut to 4 layers from one seeded bf16 initialization on
               the bundled corpus, bf16 against each recipe (PARITY_RECIPES=off,tensorwise for fewer; bf16 first):
               the curves (JSONL under DIR) and the gap of the last 50 steps' mean loss.
  fp8moeparity fp8parity on the V2-Lite width cut to 4 layers, every fp8 run with --fp8-experts on
               (PARITY_EXPERTS=off: the routed experts in bf16).
  fp8moe       one GPU: DeepSeek-V2-Lite cut to 6 layers (compiled, micro-batch 2 and 4, or FP8MOE_MBS=8,16; no
               checkpointing, or FP8MOE_AC=full): bf16, --fp8 tensorwise, and with --fp8-experts on.
  fp8_experts  one GPU: one V2-Lite MoE layer's experts in float8 against bf16 at 8,192 and 32,768 tokens, speed and
               error (scripts/gpu/bench_fp8_experts.py).
  mtp          one GPU: the 7B and V2-Lite widths cut to 4 layers, 10 steps each with the flags of `paraseek plan
               --gpus 1 --gpu-type H200 --compile false --mtp-layers 1`'s first plan, with and without --mtp-layers
               1; the plan's step time and allocated peak beside each, with the errors.
  finetune     one GPU: R1-Distill-Qwen-1.5B fine-tuned on text, on chat (full) and on chat (LoRA), the planner's
               memory beside each; then export (merged, adapter), `generate --chat` and `serve` answering a chat
               request (scripts/gpu/finetune_loop.py; FINETUNE_TINY=1 runs it on CPU with the tiny presets).
  finetune_v2lite  one GPU: the same three runs on DeepSeek-V2-Lite cut to 6 layers.
  doctor       [peer: nccl_busbw.py] `paraseek doctor` against a reference bus-bandwidth script in the same run, with
               NCCL_P2P_DISABLE=1, CUDA_LAUNCH_BLOCKING=1 and under torchrun (scripts/gpu/doctor_check.sh).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch

import finetune_loop
from suites import CORPUS, ENV, MODELS, PY, ROOT, main, sh

sys.path.insert(0, str(ROOT / "src"))
N = torch.cuda.device_count()


def folder(name: str, preset: str, layers: int, weights: bool) -> str:
    """An HF folder of `preset` cut to `layers` layers: config only (random init per run) or with one seeded bf16
    initialization that every plan loads."""
    from paraseek.models import build_model, save_pretrained
    from paraseek.models.args import ModelArgs, preset_config

    path = MODELS / name
    if (path / "config.json").exists():
        return str(path)
    cfg = {**preset_config(preset), "num_hidden_layers": layers}
    if not weights:
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps(cfg, indent=1))
        return str(path)
    torch.manual_seed(1234)
    model = build_model(ModelArgs.from_hf_config(cfg), "cuda", torch.bfloat16)
    save_pretrained(model, path)
    del model
    torch.cuda.empty_cache()
    return str(path)


def train_run(out: Path, name: str, nproc: int, argv: list[str], timeout: int = 240) -> dict:
    jsonl = out / f"{name}.jsonl"
    jsonl.unlink(missing_ok=True)
    rc, text = sh([PY, "-m", "paraseek", "train", "--device", "cuda", "--nproc", str(nproc),
                   "--metrics-jsonl", str(jsonl), "--log-every", "5", *argv], timeout)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    steps = [r for r in rows if "event" not in r]
    tail = steps[2:] or steps
    tps = sorted(r["tokens_per_s_per_gpu"] for r in tail)
    return {"name": name, "rc": rc, "gpus": nproc, "losses": [r["loss"] for r in steps],
            "tokens_per_s_per_gpu": tps[len(tps) // 2] if tps else None,
            "mem_peak_gib": max((r["mem_peak_gib"] for r in steps), default=None)}


def bench_run(name: str, nproc: int, argv: list[str], timeout: int = 300) -> dict:
    rc, text = sh([PY, "-m", "paraseek", "bench", "--json", "--device", "cuda", "--nproc", str(nproc),
                   "--warmup", "3", "--steps", "5", *argv], timeout)
    m = re.search(r'^\{\s*"runs".*', text, re.S | re.M)
    rows = json.loads(text[m.start():text.rindex("}") + 1])["runs"] if rc == 0 and m else []
    r = {"name": name, "rc": rc, **(rows[-1] if rows else {}), "runs": rows}
    print(f"    {name}: {r.get('tokens_per_s_per_gpu')} tokens/s/GPU, MFU {r.get('mfu')}, {r.get('mem_peak_gib')} GiB",
          flush=True)
    return r


def baseline(anchors: str, argv: list[str], timeout: int = 300) -> dict:
    rc, text = sh(["torchrun", "--standalone", f"--nproc_per_node={N}", f"{anchors}/hf_fsdp2_baseline.py", *argv],
                  timeout)
    line = next((ln for ln in text.splitlines() if ln.startswith("RESULT")), "")
    fields = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
    return {"name": "baseline " + " ".join(argv), "rc": rc, "result": line, **fields}


def logged(out: Path, name: str, argv: list[str], timeout: int, env: dict | None = None) -> list[dict]:
    """A script's run, its output saved as DIR/NAME.txt: its exit code and the table lines it printed."""
    rc, text = sh(argv, timeout, env)
    (out / f"{name}.txt").write_text(text)
    return [{"name": name, "rc": rc, "lines": [ln for ln in text.splitlines() if ln.startswith(("|", "CORRECTNESS"))]}]


def group_loss(out: Path) -> list[dict]:
    dense = folder("dense4", "deepseek-llm-7b", 4, weights=True)
    moe = folder("moe4", "deepseek-v2-lite", 4, weights=True)
    common = ["--data", str(CORPUS), "--seq-len", "2048", "--global-batch-size", "8", "--micro-batch-size", "1",
              "--steps", "20", "--lr", "3e-4", "--warmup-steps", "2", "--lr-schedule", "constant"]
    runs = []
    for model, plans in ((dense, [("1gpu", 1, []), ("fsdp2", 2, []), ("tp2", 2, ["--tp", "2"]),
                                  ("pp2", 2, ["--pp", "2", "--pp-schedule", "1F1B"])]),
                         (moe, [("1gpu", 1, []), ("ep2", 2, ["--ep", "2"]),
                                ("pp2", 2, ["--pp", "2", "--pp-schedule", "Interleaved1F1B"])])):
        ref = None
        for name, n, plan in plans:
            r = train_run(out, f"{Path(model).name}-{name}", n, ["--init-from", model, *common, *plan])
            ref = ref or r["losses"]
            if r["losses"] and ref:
                r["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
            runs.append(r)
    return runs


def group_plan(out: Path) -> list[dict]:
    v2 = folder("v2lite14", "deepseek-v2-lite", 14, weights=False)
    seq = ["--seq-len", "4096"]
    specs = [
        ("7b fsdp full-AC mbs2", 2, ["--model", "deepseek-llm-7b", "--global-batch-size", "4", "--micro-batch-size", "2",
                                     "--activation-checkpointing", "full"]),
        ("7b fsdp selective mbs2", 2, ["--model", "deepseek-llm-7b", "--global-batch-size", "4", "--micro-batch-size",
                                       "2", "--activation-checkpointing", "selective"]),
        ("7b fsdp selective mbs1", 2, ["--model", "deepseek-llm-7b", "--global-batch-size", "2", "--micro-batch-size",
                                       "1", "--activation-checkpointing", "selective"]),
        ("7b fsdp no-AC mbs1", 2, ["--model", "deepseek-llm-7b", "--global-batch-size", "2", "--micro-batch-size", "1"]),
        ("7b 1gpu selective mbs2", 1, ["--model", "deepseek-llm-7b", "--global-batch-size", "2", "--micro-batch-size",
                                       "2", "--activation-checkpointing", "selective"]),
        ("v2lite14 fsdp selective mbs2", 2, ["--model", v2, "--global-batch-size", "4", "--micro-batch-size", "2",
                                             "--activation-checkpointing", "selective"]),
        ("v2lite14 ep2 selective mbs2", 2, ["--model", v2, "--global-batch-size", "4", "--micro-batch-size", "2",
                                            "--activation-checkpointing", "selective", "--ep", "2"]),
        ("7b tp2 selective mbs2", 2, ["--model", "deepseek-llm-7b", "--global-batch-size", "2", "--micro-batch-size",
                                      "2", "--activation-checkpointing", "selective", "--tp", "2"]),
        ("7b pp2 1F1B selective mbs1", 2, ["--model", "deepseek-llm-7b", "--global-batch-size", "4",
                                           "--micro-batch-size", "1", "--activation-checkpointing", "selective",
                                           "--pp", "2"]),
    ]
    return [bench_run(name, n, [*seq, *argv]) for name, n, argv in specs]

def group_loss_chunks(out: Path) -> list[dict]:
    """The chunked head loss (--loss-chunks) on the llama-8b shape: the best plan of 2026-11-30 with and without it,
    and the micro-batch it may make room for."""
    llama = ["--model", "deepseek-r1-distill-llama-8b", "--seq-len", "4096", "--compile", "--reshard-after-forward",
             "false", "--activation-checkpointing", "none"]
    return [bench_run(f"llama-8b no-AC+compile zero2 mbs{mbs}{' loss-chunks 8' if chunks else ''}", N,
                      [*llama, "--micro-batch-size", str(mbs), "--global-batch-size", str(mbs * N),
                       "--loss-chunks", str(chunks)])
            for mbs, chunks in ((2, 0), (2, 8), (3, 8))]


def group_long_seq(out: Path) -> list[dict]:
    return [bench_run(f"7b seq {seq} full-AC mbs1", N, ["--model", "deepseek-llm-7b", "--seq-len", str(seq),
                                                        "--global-batch-size", str(N), "--micro-batch-size", "1",
                                                        "--activation-checkpointing", "full"])
            for seq in (16384, 32768)]


def group_v2lite(out: Path, anchors: str) -> list[dict]:
    """The HF + FSDP2 baseline on the V2-Lite shape (14 layers) at micro-batch 2 (its published setting) and 4, and
    paraseek's best plan at each: no checkpointing, compiled, parameters kept gathered."""
    v2 = folder("v2lite14", "deepseek-v2-lite", 14, weights=False)
    runs = []
    for mbs in (2, 4):
        runs.append(baseline(anchors, ["--model", "deepseek-v2-lite", "--layers", "14", "--seq", "4096", "--mbs",
                                       str(mbs), "--ac", "1"]))
        runs.append(bench_run(f"v2lite14 no-AC+compile mbs{mbs} zero2", N,
                              ["--model", v2, "--seq-len", "4096", "--micro-batch-size", str(mbs),
                               "--global-batch-size", str(mbs * N), "--activation-checkpointing", "none",
                               "--compile", "--reshard-after-forward", "false"]))
    return runs


def group_weak(out: Path) -> list[dict]:
    """7B weak scaling 1 -> N GPUs, same flags and per-GPU batch (--reshard-after-forward false is a no-op on 1 GPU)."""
    return [bench_run(f"7b weak scaling 1,{N} selective+compile mbs2 zero2", N,
                      ["--model", "deepseek-llm-7b", "--seq-len", "4096", "--micro-batch-size", "2",
                       "--global-batch-size", "2", "--activation-checkpointing", "selective", "--compile",
                       "--reshard-after-forward", "false", "--scaling", f"1,{N}"], timeout=420)]


def group_dense(out: Path, anchors: str) -> list[dict]:
    """The two dense shapes against the HF + FSDP2 baseline in the same run: llama-8b (no AC, compiled, params
    kept gathered) and the 7B (selective AC, compiled, params kept gathered), micro-batch 2 like the baseline."""
    runs = []
    for base_model, model, ac in (("llama3-8b", "deepseek-r1-distill-llama-8b", "none"),
                                  ("deepseek-7b", "deepseek-llm-7b", "selective")):
        runs.append(baseline(anchors, ["--model", base_model, "--seq", "4096", "--mbs", "2", "--ac", "1"]))
        runs.append(bench_run(f"{model} {ac}-AC+compile mbs2 zero2", N,
                              ["--model", model, "--seq-len", "4096", "--micro-batch-size", "2", "--global-batch-size",
                               str(2 * N), "--activation-checkpointing", ac, "--compile", "--reshard-after-forward",
                               "false"]))
    return runs


def group_v2lite_ep(out: Path) -> list[dict]:
    """V2-Lite (14 layers) compiled without checkpointing: parameters kept gathered against EP over every GPU."""
    v2 = folder("v2lite14", "deepseek-v2-lite", 14, weights=False)
    common = ["--model", v2, "--seq-len", "4096", "--activation-checkpointing", "none", "--compile"]

    def mbs(n: int) -> list[str]:
        return ["--micro-batch-size", str(n), "--global-batch-size", str(n * N)]

    return [bench_run("v2lite14 no-AC+compile mbs2 zero2", N, [*common, *mbs(2), "--reshard-after-forward", "false"]),
            bench_run("v2lite14 no-AC+compile mbs4 zero2", N, [*common, *mbs(4), "--reshard-after-forward", "false"]),
            bench_run("v2lite14 ep2 no-AC+compile mbs2", N, [*common, *mbs(2), "--ep", str(N)]),
            bench_run("v2lite14 ep2 no-AC+compile mbs4", N, [*common, *mbs(4), "--ep", str(N)])]


def group_moe_layer(out: Path) -> list[dict]:
    return logged(out, "moe-layer", [PY, "scripts/gpu/bench_moe_layer.py", "--json", str(out / "moe-layer.json")], 600)


def group_fp8_experts(out: Path) -> list[dict]:
    return logged(out, "fp8-experts", [PY, "scripts/gpu/bench_fp8_experts.py", "--tokens", "8192,32768", "--json",
                                       str(out / "fp8-experts.json")], 600)


def group_doctor(out: Path, anchors: str) -> list[dict]:
    return logged(out, "doctor", ["bash", "scripts/gpu/doctor_check.sh", f"{anchors}/nccl_busbw.py"], 600,
                  dict(ENV, OUT=str(out)))


SEVEN_BEST = ["--seq-len", "4096", "--micro-batch-size", "2", "--global-batch-size", str(2 * N),
              "--activation-checkpointing", "selective", "--compile"]  # the 7B's best flags on one H200


def torchtitan(anchors: str, name: str, flavor: str, *flags: str, timeout: int = 300) -> dict:
    """One TorchTitan peer run: its step-30 line (tps = tokens/s/GPU, MFU against 989 TFLOP/s)."""
    rc, text = sh(["bash", f"{anchors}/torchtitan_peer.sh", flavor, "--compile.enable", *flags], timeout)
    steps = [ln for ln in text.splitlines() if re.search(r"step: *\d+ ", ln)]
    last = steps[-1] if steps else ""
    num = lambda pat: (lambda m: float(m.group(1).replace(",", "")) if m else None)(re.search(pat, last))
    r = {"name": f"torchtitan {name}", "rc": rc, "tokens_per_s_per_gpu": num(r"tps: *([\d,]+)"),
         "mfu": num(r"mfu: *([\d.]+)%"), "loss": num(r"loss: *([\d.]+)"),
         "mem_peak_gib": num(r"memory: *([\d.]+)GiB"), "lines": steps}
    print(f"    {last[-200:]}", flush=True)
    return r

def group_fp8peer(out: Path, anchors: str) -> list[dict]:
    fp8 = ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name"]
    runs = [torchtitan(anchors, "ds7b float8 tensorwise", "ds7b", *fp8, "tensorwise"),
            torchtitan(anchors, "ds7b float8 rowwise", "ds7b", *fp8, "rowwise")]
    for recipe in ("off", "tensorwise", "rowwise"):
        runs.append(bench_run(f"deepseek-llm-7b best bf16 flags, fp8 {recipe}", N,
                              ["--model", "deepseek-llm-7b", *SEVEN_BEST, "--fp8", recipe]))
    return runs


def group_fp8llama(out: Path) -> list[dict]:
    llama = folder("llama8b16", "deepseek-r1-distill-llama-8b", 16, weights=False)
    return [bench_run(f"llama-8b 16 layers selective+compile, fp8 {recipe}", N,
                      ["--model", llama, *SEVEN_BEST, "--fp8", recipe]) for recipe in ("off", "tensorwise", "rowwise")]


def fp8parity_run(out: Path, recipe: str, name: str = "", moe: bool = False) -> dict:
    """One 500-step parity run (the 7B width cut to 4 layers, or with `moe` the V2-Lite width cut to 4 layers and
    --fp8-experts on, or PARITY_EXPERTS=off for the routed experts in bf16; seq 2048, from one seeded bf16
    initialization on the bundled corpus) and the mean loss of its last 50 steps."""
    init = (folder("v2lite4-init", "deepseek-v2-lite", 4, weights=True) if moe
            else folder("ds7b4-init", "deepseek-llm-7b", 4, weights=True))
    common = ["--init-from", init, "--data", str(CORPUS), "--seq-len", "2048", "--global-batch-size", "2",
              "--micro-batch-size", "2", "--steps", "500", "--lr", "3e-4", "--warmup-steps", "20",
              "--activation-checkpointing", "selective", "--compile", "--seed", "0"]
    experts = ["--fp8-experts", os.environ.get("PARITY_EXPERTS", "on")] if moe and recipe != "off" else []
    r = train_run(out, name or f"fp8parity-{'moe-' if moe else ''}{recipe}", 1,
                  [*common, "--fp8", recipe, *experts], timeout=300)
    tail = r["losses"][-50:]
    r["tail_loss"] = sum(tail) / len(tail) if tail else None
    r.pop("losses")
    return r


def group_fp8parity(out: Path, moe: bool = False) -> list[dict]:
    runs = [fp8parity_run(out, recipe, moe=moe)
            for recipe in os.environ.get("PARITY_RECIPES", "off,tensorwise,rowwise,rowwise-gw-hp").split(",")]
    ref = runs[0]["tail_loss"]
    for r in runs[1:]:
        if ref and r["tail_loss"]:
            r["max_rel_loss_diff"] = (r["tail_loss"] - ref) / ref
    return runs


def v2lite6_bench(name: str, mbs: int, flags: list[str], timeout: int = 300) -> dict:
    """`paraseek bench` of DeepSeek-V2-Lite cut to 6 layers (config only), seq 4096, micro-batch `mbs` on every GPU,
    no checkpointing (or FP8MOE_AC's mode), compiled, with `flags` (the --fp8 ones)."""
    v2 = folder("v2lite6", "deepseek-v2-lite", 6, weights=False)
    ac = os.environ.get("FP8MOE_AC", "none")  # none, selective or full
    return bench_run(name, N, ["--model", v2, "--seq-len", "4096", "--micro-batch-size", str(mbs),
                               "--global-batch-size", str(mbs * N), "--activation-checkpointing", ac, "--compile",
                               *flags], timeout)


def group_fp8moe(out: Path) -> list[dict]:
    ac = os.environ.get("FP8MOE_AC", "none")
    return [v2lite6_bench(f"v2lite-6l AC {ac}+compile mbs{mbs}, {' '.join(flags)}", mbs, flags)
            for mbs in map(int, os.environ.get("FP8MOE_MBS", "2,4").split(","))
            for flags in (["--fp8", "off"], ["--fp8", "tensorwise"], ["--fp8", "tensorwise", "--fp8-experts", "on"])]


MTP_MODELS = (("7b-4l", "ds7b4", "deepseek-llm-7b"), ("v2lite-4l", "v2lite4", "deepseek-v2-lite"))
MTP_SEQ, MTP_BATCH, MTP_STEPS = 4096, 4, 10


def mtp_predictions() -> list[dict]:
    """The plan half of the mtp suite (runs on a CPU too): per model, `paraseek plan ... --mtp-layers 1 --json`'s first
    plan on one H200, its train flags, and the predicted step time and allocated peak with and without the modules."""
    from paraseek.planner.memory import ALLOCATOR_BASE, ALLOCATOR_FRACTION, CUDA_CONTEXT, GiB

    def allocated(total_gib: float) -> float:  # the planner's total less the CUDA context and allocator items
        return (total_gib - (CUDA_CONTEXT + ALLOCATOR_BASE) / GiB) / (1 + ALLOCATOR_FRACTION)

    out = []
    for name, cut, preset in MTP_MODELS:
        model = folder(cut, preset, 4, weights=False)
        rc, text = sh([PY, "-m", "paraseek", "plan", "--model", model, "--gpus", "1", "--gpu-type", "H200",
                       "--seq-len", str(MTP_SEQ), "--global-batch-size", str(MTP_BATCH), "--compile", "false",
                       "--mtp-layers", "1", "--top", "1", "--json"], 300)
        if rc or "{" not in text:
            out.append({"name": name, "rc": rc or 1})
            continue
        best = json.JSONDecoder().raw_decode(text[text.index("{"):])[0]["plans"][0]
        argv = best["command"].split()
        mtp = best["mtp"]
        out.append({"name": name, "rc": 0, "model": model,
                    # the plan's train flags; --mtp-layers 1 comes last (Plan.flags), each run adds its own depth
                    "flags": argv[argv.index("--micro-batch-size"):argv.index("--mtp-layers")],
                    "predicted": {1: {"step_time_s": best["step_time_s"],
                                      "mem_gib": allocated(best["memory_gib_per_gpu"])},
                                  0: {"step_time_s": best["step_time_s"] - mtp["step_time_s"],
                                      "mem_gib": allocated(best["memory_gib_per_gpu"] - mtp["memory_gib"])}},
                    "mtp_step_share": mtp["step_share"]})
        print(f"    {name}: {' '.join(out[-1]['flags'])}; predicted {out[-1]['predicted']}", flush=True)
    return out


def group_mtp(out: Path) -> list[dict]:
    runs = []
    for pred in mtp_predictions():
        if pred["rc"]:
            runs.append(pred)
            continue
        for depth in (0, 1):
            argv = ["--model", pred["model"], "--seq-len", str(MTP_SEQ), "--global-batch-size", str(MTP_BATCH),
                    "--data", "synthetic", "--steps", str(MTP_STEPS), *pred["flags"]]
            r = train_run(out, f"mtp-{pred['name']}-d{depth}", 1, [*argv, "--mtp-layers", str(depth)], timeout=150)
            tps, p = r["tokens_per_s_per_gpu"], pred["predicted"][depth]
            r["step_time_s"] = round(MTP_BATCH * MTP_SEQ / tps, 4) if tps else None
            r["predicted"] = {k: round(v, 4) for k, v in p.items()}
            if r["step_time_s"]:
                r["step_time_error"] = round(p["step_time_s"] / r["step_time_s"] - 1, 4)
            if r["mem_peak_gib"]:
                r["mem_error"] = round(p["mem_gib"] / r["mem_peak_gib"] - 1, 4)
            r["flags"] = [*pred["flags"], "--mtp-layers", str(depth)]
            runs.append(r)
    print(f"    {'run':<22} {'step s':>8} {'pred':>8} {'err':>7}   {'GiB':>7} {'pred':>7} {'err':>7}")
    for r in runs:
        p = r.get("predicted") or {}
        num = lambda x, f: format(x, f) if x is not None else "-"  # noqa: E731
        print(f"    {r['name']:<22} {num(r.get('step_time_s'), '8.3f')} {num(p.get('step_time_s'), '8.3f')} "
              f"{num(r.get('step_time_error'), '+7.1%')}   {num(r.get('mem_peak_gib'), '7.2f')} "
              f"{num(p.get('mem_gib'), '7.2f')} {num(r.get('mem_error'), '+7.1%')}", flush=True)
    return runs


KEYS = ("rc", "gpus", "tokens_per_s_per_gpu", "mfu", "mem_peak_gib", "step_time_s", "max_rel_loss_diff", "predicted",
        "weak_scaling_efficiency", "result", "loss", "tail_loss", "step_time_error", "mem_error", "memory_error",
        "memory_error_allocated", "loss_first_last", "files")


def line(r: dict) -> str:
    keep = {k: r.get(k) for k in KEYS if r.get(k) is not None}
    return f"{r['name']}: {json.dumps(keep)[:400]}" + "".join(f"\n  {ln}" for ln in r.get("lines", [])[-30:])


SUITES = {
    "dense": (group_dense, ("hf_fsdp2_baseline.py",)),
    "v2lite": (group_v2lite, ("hf_fsdp2_baseline.py",)),
    "weak": (group_weak, ()),
    "long_seq": (group_long_seq, ()),
    "v2lite_ep": (group_v2lite_ep, ()),
    "plan": (group_plan, ()),
    "loss": (group_loss, ()),
    "loss_chunks": (group_loss_chunks, ()),
    "moe_layer": (group_moe_layer, ()),
    "fp8peer": (group_fp8peer, ("torchtitan_peer.sh",)),
    "fp8llama": (group_fp8llama, ()),
    "fp8parity": (group_fp8parity, ()),
    "fp8moeparity": (lambda out: group_fp8parity(out, moe=True), ()),
    "fp8moe": (group_fp8moe, ()),
    "fp8_experts": (group_fp8_experts, ()),
    "mtp": (group_mtp, ()),
    "finetune": (lambda out: finetune_loop.group_qwen(out) + finetune_loop.group_loop(out), ()),
    "finetune_v2lite": (finetune_loop.group_v2lite, ()),
    "doctor": (group_doctor, ("nccl_busbw.py",)),
}

if __name__ == "__main__":
    main(__doc__, SUITES, line)
