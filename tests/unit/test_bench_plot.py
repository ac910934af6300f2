"""`paraseek bench --plot`: with the planner's predictions (known GPUs) the PNG has four panels -- throughput,
weak-scaling efficiency, and the predicted memory and step-time breakdowns with the measured totals -- and two
without them (CPU). Rows as `bench` builds them; the predictions are the real planner's for those plans."""

import matplotlib.image

from paraseek.bench.run import _plot
from paraseek.models import resolve_model
from paraseek.planner import Plan, evaluate, make_cluster
from paraseek.train.launch import prediction


def _rows(with_prediction: bool) -> list[dict]:
    args = resolve_model("deepseek-llm-7b")[0]
    rows = []
    for n, tps, mem, step in ((1, 12_000.0, 108.0, 0.68), (2, 11_900.0, 82.0, 0.69)):
        ev = evaluate(args, make_cluster("H200", n), Plan(dp_shard=n, micro_batch_size=2,
                                                          activation_checkpointing="selective"), 4096, 2 * n)
        rows.append({"gpus": n, "model": "deepseek-llm-7b", "tokens_per_s_per_gpu": tps, "mem_peak_gib": mem,
                     "step_time_s": step, "weak_scaling_efficiency": tps / 12_000.0,
                     "predicted": prediction(ev) if with_prediction else None})
    return rows


def test_plot_has_breakdown_panels_with_predictions(tmp_path):
    rows = _rows(True)
    assert rows[0]["predicted"]["memory_breakdown_gib"] and rows[0]["predicted"]["step_time_breakdown_s"]
    assert sum(rows[1]["predicted"]["memory_breakdown_gib"].values()) > 0
    _plot(rows, str(tmp_path / "with.png"))
    _plot(_rows(False), str(tmp_path / "without.png"))
    width_with = matplotlib.image.imread(tmp_path / "with.png").shape[1]
    width_without = matplotlib.image.imread(tmp_path / "without.png").shape[1]
    assert (width_with, width_without) == (2640, 1200)  # 4 panels (22 inches, legends beside) vs 2 (10), 120 dpi
