"""The planner's predictions for validate.py's `holdout2` group, printed before the group runs (the file they were
written to is committed first): python scripts/gpu/predict_holdout2.py > benchmarks/2026-11-30/holdout2-predictions.txt"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from validate import HOLDOUT2  # noqa: E402

from paraseek.models.args import ModelArgs, preset_config  # noqa: E402
from paraseek.planner import evaluate, make_cluster  # noqa: E402
from paraseek.planner.plan import Plan  # noqa: E402

for name, n, spec in HOLDOUT2:
    cfg = preset_config(spec["model"])
    if spec.get("layers"):
        cfg["num_hidden_layers"] = spec["layers"]
    plan = Plan(1, n, micro_batch_size=spec["mbs"], activation_checkpointing=spec["ac"])
    ev = evaluate(ModelArgs.from_hf_config(cfg), make_cluster("H200", n, gpus_per_node=2), plan, spec["seq"],
                  spec["gbs"])
    print(f"{name}: predicted {ev.memory.total / 2**30:.1f} GiB, step {ev.time.total:.3f} s, "
          f"{ev.tokens_per_s_per_gpu:,.0f} tok/s/GPU")
