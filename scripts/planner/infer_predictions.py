"""The inference speed model's predictions for the `bench-infer` runs made on one H200, written before they are
measured, and the check of measured runs against them.

    python scripts/planner/infer_predictions.py --out FILE.json          # any machine, no GPU: the predictions
    python scripts/planner/infer_predictions.py --check MEASURED.json [MORE.json ...] --predictions FILE.json

The runs (RUNS below; each one's exact command is in the file) are `paraseek bench-infer MODEL --random-weights
--json` at the engine's default flags on one H200: the latency workload (a 128-token prompt, 256 new tokens), the
concurrency sweep at 1, 8, 64 and 256 sequences of 128 + 128 tokens, the throughput workload (1,000 requests, 500
for V2-Lite, prompts U(64, 1024), outputs U(64, 512), seed 0), and V2-Lite at 64 sequences of 2,048 + 128 tokens.
The engine's flags are priced as `plan --mode infer` takes them by default on an H200 (planner.infer.engine_defaults:
1,024 sequences, 16,384 tokens a step), the KV pool as the planner sizes it at max_model_len 32,768.

--check reads bench-infer's JSON (one document, or a list of them such as scripts/gpu/infer_validate.py's results.json),
matches each of its workloads to a predicted run of the same model (concurrency: the run with the same levels
first) and prints predicted vs measured with the error of each row; a measured engine setting that differs from
the predicted one is noted first (runs at other settings are not the predicted ones).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

LLAMA, QWEN, V2LITE = "deepseek-r1-distill-llama-8b", "deepseek-r1-distill-qwen-1.5b", "deepseek-v2-lite"
MAX_MODEL_LEN = 32768  # bench-infer's default: min(the model's positions, 32768)
BLOCK = 16  # the engine's default block size (the pool holds whole blocks)
# bench-infer's defaults (bench/infer.py): the latency workload, the concurrency prompt and output, the throughput
# ranges; --concurrency is given (1,8,64,256), --num-requests for V2-Lite.
LATENCY = (128, 256)
SWEEP = [1, 8, 64, 256]
# (name, model, workloads, concurrency levels, concurrency prompt + output, throughput requests)
RUNS = [
    ("llama8b", LLAMA, ("latency", "throughput", "concurrency"), SWEEP, (128, 128), 1000),
    ("qwen", QWEN, ("latency", "throughput", "concurrency"), SWEEP, (128, 128), 1000),
    ("v2lite", V2LITE, ("latency", "throughput", "concurrency"), SWEEP, (128, 128), 500),
    ("v2lite-2048", V2LITE, ("concurrency",), [64], (2048, 128), 0),
]


def command(model: str, workloads, levels, conc, requests) -> str:
    argv = ["paraseek", "bench-infer", model, "--random-weights", "--json"]
    if tuple(workloads) != ("latency", "throughput", "concurrency"):
        argv += ["--workloads", ",".join(workloads)]
    argv += ["--concurrency", ",".join(map(str, levels))]
    if conc != (128, 128):
        argv += ["--concurrency-input", str(conc[0]), "--concurrency-output", str(conc[1])]
    if "throughput" in workloads and requests != 1000:
        argv += ["--num-requests", str(requests)]
    return shlex.join(argv)


def predict_all() -> dict:
    from paraseek.models.args import resolve_model
    from paraseek.planner import infer_speed as S
    from paraseek.planner import make_cluster
    from paraseek.planner.infer import engine_defaults, plan_inference
    from paraseek.planner.report import _sig, hardware_dict

    c = make_cluster("H200", 1)
    seqs, step_tokens = engine_defaults(c)
    runs = []
    for name, model, workloads, levels, (c_in, c_out), requests in RUNS:
        a = resolve_model(model)[0]
        row = plan_inference(a, c, min(MAX_MODEL_LEN, a.max_seq_len), None, "bf16",
                             max_batched_tokens=step_tokens, max_num_seqs=seqs)[0]
        kv = row.max_context // BLOCK * BLOCK

        def run(prompts, outputs):
            return S.run_requests(a, c, 1, 2, prompts, outputs, seqs, step_tokens, kv)

        pred: dict = {"engine": {"max_num_seqs": seqs, "max_batched_tokens": step_tokens,
                                 "max_model_len": MAX_MODEL_LEN}, "kv_cache": {"tokens": kv}}
        if "latency" in workloads:
            r = run([LATENCY[0]], [LATENCY[1]])
            pred["latency"] = {"input_len": LATENCY[0], "output_len": LATENCY[1], "ttft_ms": r["median_ttft_s"] * 1e3,
                               "ms_per_token": r["decode_ms_per_step"]}
        if "throughput" in workloads:
            prompts, outputs = S.Workload(requests).lengths()
            r = run(prompts, outputs)
            pred["throughput"] = {k: r[k] for k in ("requests", "input_tokens", "output_tokens", "wall_s",
                                                    "output_tokens_per_s", "total_tokens_per_s", "steps",
                                                    "preemptions", "median_ttft_s")}
            pred["throughput"].update(input_len="64:1024", output_len="64:512", eager_steps=r["eager_steps"])
        if "concurrency" in workloads:
            pred["concurrency"] = []
            for n in levels:
                r = run([c_in] * n, [c_out] * n)
                pred["concurrency"].append({"concurrency": n, "input_len": c_in, "output_len": c_out,
                                            "decode_ms_per_step": r["decode_ms_per_step"],
                                            "decode_tokens_per_s": r["decode_tokens_per_s"],
                                            "output_tokens_per_s": r["output_tokens_per_s"]})
        runs.append({"name": name, "model": model, "workloads": list(workloads), "concurrency": levels,
                     "command": command(model, workloads, levels, (c_in, c_out), requests), "predicted": _sig(pred)})
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"what": "paraseek plan --mode infer's speed model for bench-infer runs on one H200, before measuring",
            "code": commit or None, "hardware": hardware_dict(c), "terms": S.terms(), "runs": runs}


def measured_docs(x) -> list[dict]:
    """Every bench-infer result inside a JSON value (one document, or lists and objects holding them)."""
    if isinstance(x, dict):
        if "model" in x and any(k in x for k in ("latency", "throughput", "concurrency")):
            return [x]
        return [d for v in x.values() for d in measured_docs(v)]
    if isinstance(x, list):
        return [d for v in x for d in measured_docs(v)]
    return []


def pick(doc: dict, runs: list[dict], workload: str) -> dict | None:
    """The predicted run of doc's model with this workload; for concurrency, the one with doc's levels first."""
    mine = [r for r in runs if r["model"] == doc["model"] and workload in r["predicted"]]
    levels = [m["concurrency"] for m in doc.get("concurrency", [])]
    return next((r for r in mine if workload != "concurrency" or r["concurrency"] == levels), None) or \
        next(iter(mine), None)


def check(pred: dict, files: list[str]) -> int:
    rows = []
    for f in files:
        for doc in measured_docs(json.loads(Path(f).read_text())):
            work = [w for w in ("latency", "throughput", "concurrency") if w in doc]
            runs = {w: pick(doc, pred["runs"], w) for w in work}
            if not any(runs.values()):
                print(f"{f}: {doc['model']} ({', '.join(work)}): no predicted run of this model")
                continue
            for run in {id(r): r for r in runs.values() if r}.values():
                for key in ("max_num_seqs", "max_batched_tokens", "max_model_len"):
                    got = doc.get("engine", {}).get(key)
                    if got is not None and got != run["predicted"]["engine"][key]:
                        print(f"note: {f} ({doc['model']}) ran with {key} {got}; {run['name']} is predicted for "
                              f"{run['predicted']['engine'][key]}")
            first = next(r for r in runs.values() if r)
            if "kv_cache" in doc:
                rows.append((first["name"], "KV cache tokens", first["predicted"]["kv_cache"]["tokens"],
                             doc["kv_cache"]["tokens"]))
            if runs.get("latency"):
                p = runs["latency"]["predicted"]["latency"]
                for k in ("ttft_ms", "ms_per_token"):
                    rows.append((runs["latency"]["name"], f"latency {k}", p[k], doc["latency"][k]))
            if runs.get("throughput"):
                p, m = runs["throughput"]["predicted"]["throughput"], doc["throughput"]
                same = [(k, p[k], m.get(k)) for k in ("requests", "input_len", "output_len") if p[k] != m.get(k)]
                if same:
                    print(f"note: {f} ({doc['model']}): throughput workload not the predicted one ("
                          + ", ".join(f"{k} {b} vs {a}" for k, a, b in same) + "): not compared")
                    runs["throughput"] = None
            if runs.get("throughput"):
                p = runs["throughput"]["predicted"]["throughput"]
                for k in ("output_tokens_per_s", "total_tokens_per_s", "wall_s", "steps", "preemptions",
                          "median_ttft_s"):
                    rows.append((runs["throughput"]["name"], f"throughput {k}", p[k], doc["throughput"][k]))
            for m in doc.get("concurrency", []):
                run = runs.get("concurrency")
                q = next((x for x in run["predicted"]["concurrency"] if x["concurrency"] == m["concurrency"]),
                         None) if run else None
                if q is not None:
                    for k in ("decode_ms_per_step", "decode_tokens_per_s", "output_tokens_per_s"):
                        rows.append((run["name"], f"concurrency {m['concurrency']} {k}", q[k], m[k]))
    if not rows:
        print("nothing to compare")
        return 1
    print(f"{'run':<12} {'quantity':<38} {'predicted':>12} {'measured':>12} {'error':>8}")
    for n, what, p, m in rows:
        err = f"{(p - m) / m:+.1%}" if m else "-"
        print(f"{n:<12} {what:<38} {p:>12,.4g} {m:>12,.4g} {err:>8}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", metavar="FILE.json", help="write the predictions")
    ap.add_argument("--check", nargs="+", metavar="MEASURED.json", help="bench-infer JSON output(s) to compare")
    ap.add_argument("--predictions", metavar="FILE.json",
                    help="with --check: the predictions written before the runs (default: computed now)")
    ns = ap.parse_args()
    if not ns.out and not ns.check:
        ap.error("give --out FILE.json or --check MEASURED.json")
    pred = json.loads(Path(ns.predictions).read_text()) if ns.predictions else predict_all()
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(pred, indent=2) + "\n")
        for run in pred["runs"]:
            print(run["command"])
        print(f"wrote {ns.out}")
    if ns.check:
        if not ns.predictions:
            print("note: no --predictions file: comparing with predictions computed now, from this checkout")
        return check(pred, ns.check)
    return 0


if __name__ == "__main__":
    sys.exit(main())
