"""fp8 speed comparisons on one GPU: DeepSeek-LLM-7B with its best bf16 flags and --fp8, under variants
of main's code, each a patched copy of src/paraseek (so one run compares them; main is never changed by this).

    python scripts/gpu/fp8_push.py RUN[,RUN...] --out DIR [--anchors DIR]

RUN is RECIPE:VARIANT (bench of deepseek-llm-7b), moe-RECIPE:VARIANT (bench of DeepSeek-V2-Lite cut to 6 layers,
validate.py fp8moe's flags: no checkpointing, compile, micro-batch MBS from FP8_PUSH_MOE_MBS, 2 by default),
parity-RECIPE:VARIANT (validate.py's 500-step fp8parity run;
the gap is to the first parity run, so put parity-off:main first), or tt:RECIPE (--anchors'
torchtitan_peer.sh ds7b, compiled, float8). Variants (joined with +):
  main   main's code.
  save   selective checkpointing also keeps the float8 GEMMs' outputs (aten._scaled_mm) and the abs-maxes the
         scales come from (aten.max), as it keeps the bf16 matmuls' (TorchTitan keeps max, not _scaled_mm).
  epc    inductor's emulate_precision_casts on for the rowwise recipes, as TorchTitan sets it (pytorch#150859: under
         compile + checkpointing the recomputed forward's casts can round differently from the forward's, so the
         backward's rowwise scales and float8 values differ from those the forward used).
  experts  --fp8-experts on added to the run.
  allproj  every block projection in float8 whatever its size (main before fp8_pays).
  autotune inductor's max_autotune_gemm on for the compiled blocks: every GEMM (the grouped ones included: inductor's
         Triton grouped-GEMM templates against the ATen/CUTLASS kernel) picked by timing.

Variants since made main's code: the experts' float8 GEMMs with fast accumulation in both GEMMs, --fp8 with the
experts in bf16 unless --fp8-experts on, and with one data-parallel rank no float8 all-gather (the weights cast
inside the compiled blocks, not in FSDP2's eager pre-gather hook: 9% faster on the 7B).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import validate as v  # noqa: E402

PATCHES = {
    "save": [("parallel/parallelize.py",
              "    torch.ops._c10d_functional.all_to_all_single.default,  # expert dispatch: never redo communication\n",
              "    torch.ops._c10d_functional.all_to_all_single.default,  # expert dispatch: never redo communication\n"
              "    torch.ops.aten._scaled_mm.default,\n    torch.ops.aten.max.default,\n")],
    "epc": [("parallel/fp8.py",
             "                               module_filter_fn=lambda m, fqn: fp8_filter(m, fqn, recipe))\n",
             "                               module_filter_fn=lambda m, fqn: fp8_filter(m, fqn, recipe))\n"
             "    if recipe != 'tensorwise':\n        import torch._inductor.config\n\n"
             "        torch._inductor.config.emulate_precision_casts = True\n")],
    "allproj": [("parallel/fp8.py", "    if emulated():\n        return True\n", "    return True\n")],
    "autotune": [("parallel/parallelize.py",
                  "    for block in model.layers.values():\n        block.compile()\n",
                  "    import torch._inductor.config\n\n    torch._inductor.config.max_autotune_gemm = True\n"
                  "    for block in model.layers.values():\n        block.compile()\n")],
}


def variant_src(name: str) -> str:
    """A copy of src/ with the variant's patches applied (each must match exactly once)."""
    dest = Path("/tmp/fp8-variants") / name
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(v.ROOT / "src", dest)
    for part in name.split("+"):
        for rel, old, new in PATCHES.get(part, []):
            path = dest / "paraseek" / rel
            text = path.read_text()
            assert text.count(old) == 1, f"variant {part}: patch target not found once in {rel}"
            path.write_text(text.replace(old, new))
    return str(dest)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/fp8push"))
    p.add_argument("--anchors", default=str(v.ROOT / ".anchors"))
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {v.N} GPU(s)", flush=True)
    base_path = v.ENV["PYTHONPATH"].split(os.pathsep, 1)[1:]  # what the caller added (torchao), after src
    rows = []
    for run in a.runs.split(","):
        what, how = run.split(":")
        if what == "tt":
            r = v.torchtitan(a.anchors, f"ds7b float8 {how}", "ds7b", "--model.converters", "quantize.linear.float8",
                             "--quantize.linear.float8.recipe_name", how)
        elif what.startswith("parity-"):
            v.ENV["PYTHONPATH"] = os.pathsep.join([variant_src(how), *base_path])
            r = v.fp8parity_run(out, what.removeprefix("parity-"), f"{what}-{how}")
            ref = next((x["tail_loss"] for x in rows if x["name"].startswith("parity-")), None)
            if ref and r["tail_loss"]:
                r["loss_gap"] = (r["tail_loss"] - ref) / ref
        elif what.startswith("moe-"):
            v.ENV["PYTHONPATH"] = os.pathsep.join([variant_src(how), *base_path])
            mbs, recipe = int(os.environ.get("FP8_PUSH_MOE_MBS", "2")), what.removeprefix("moe-")
            experts = ["--fp8-experts", "on"] if "experts" in how.split("+") else []
            r = v.v2lite6_bench(f"v2lite-6l mbs {mbs} fp8 {recipe} [{how}]", mbs, ["--fp8", recipe, *experts], 240)
        else:
            v.ENV["PYTHONPATH"] = os.pathsep.join([variant_src(how), *base_path])
            r = v.bench_run(f"7b fp8 {what} [{how}]", v.N, ["--model", "deepseek-llm-7b", *v.SEVEN_BEST,
                                                              "--fp8", what], timeout=240)
        r.pop("lines", None)
        rows.append(r)
        (out / "results.json").write_text(json.dumps(rows, indent=1))
    print("| run | tokens/s/GPU | MFU | peak GiB | step s | tail loss | gap |")
    for r in rows:
        print(f"| {r['name']} | {r.get('tokens_per_s_per_gpu')} | {r.get('mfu')} | {r.get('mem_peak_gib')} | "
              f"{r.get('step_time_s')} | {r.get('tail_loss')} | {r.get('loss_gap')} |")


if __name__ == "__main__":
    main()
