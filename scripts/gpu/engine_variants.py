"""The engine on a GPU under each combination of sampling (greedy / temperature 1), CUDA graphs (on / off) and MoE
path (fused kernels / sorted grouped GEMMs), on DeepSeek-V2-Lite's layer shapes cut to a few layers, each variant in
its own process (a device-side error ends only that one), every kernel launch synchronous so a failure names its op.

    python scripts/gpu/engine_variants.py [--layers 3] [--batch 4]
    VARIANTS="1,0,fused 0,0,fused" python scripts/gpu/engine_variants.py   # temperature,eager,moe of each run

Prints one VARIANT line per combination: ok with the first tokens of each request, or the error's last line.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

CHILD = r'''
import sys, torch
from paraseek.infer import model as infer_model
from paraseek.infer.engine import Engine, EngineConfig
from paraseek.infer.sampling import SamplingParams
from paraseek.models import ModelArgs, build_model, preset_config
temp, eager, path, layers, batch = float(sys.argv[1]), sys.argv[2] == "1", sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
infer_model.MOE_PATH = path
cfg = dict(preset_config("deepseek-v2-lite"), num_hidden_layers=layers)
torch.manual_seed(0)
m = build_model(ModelArgs.from_hf_config(cfg), "cuda", torch.bfloat16).eval()
e = Engine(m, EngineConfig(num_kv_blocks=2000, max_num_seqs=16, max_model_len=2048, enforce_eager=eager), log=lambda *_: None)
reqs = [e.add_request(f"r{i}", [(7 * i + j) % 1000 + 1 for j in range(128)],
                      SamplingParams(max_tokens=48, temperature=temp, seed=i, ignore_eos=True)) for i in range(batch)]
while e.has_work():
    e.step()
torch.cuda.synchronize()
print("TOKENS", [r.output_ids[:6] for r in reqs])
'''


def main() -> None:
    args = sys.argv[1:]
    layers = args[args.index("--layers") + 1] if "--layers" in args else "3"
    batch = args[args.index("--batch") + 1] if "--batch" in args else "4"
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    variants = [v.split(",") for v in os.environ.get("VARIANTS", "").split()] or list(
        itertools.product(("0", "1"), ("0", "1"), ("fused", "grouped")))
    for temp, eager, path in variants:
        r = subprocess.run([sys.executable, "-c", CHILD, temp, eager, path, layers, batch], env=env,
                           capture_output=True, text=True, timeout=300)
        out = r.stdout + r.stderr
        tok = next((l for l in out.splitlines() if l.startswith("TOKENS")), None)
        where = [l for l in out.splitlines() if l.strip().startswith("File \"/work") or "Error" in l][-4:]
        print(f"VARIANT temperature={temp} eager={eager} moe={path}: " + (f"ok {tok}" if r.returncode == 0 and tok
              else f"rc {r.returncode} " + " | ".join(x.strip() for x in where)), flush=True)


if __name__ == "__main__":
    main()
