"""The OOM advice: the planner's breakdown of the plan that ran out, and the fastest single change that fits."""

from paraseek.models import ModelArgs, preset_config
from paraseek.planner import Plan, evaluate, make_cluster
from paraseek.monitor.oom import cheapest_fix
from paraseek.train.config import TrainConfig


def test_7b_on_one_a100_is_told_to_offload_or_checkpoint():
    args = ModelArgs.from_hf_config(preset_config("deepseek-llm-7b"))
    cfg = TrainConfig(model="deepseek-llm-7b", device="cuda", nproc=1, dp_shard=1, seq_len=4096,
                      global_batch_size=8, micro_batch_size=4, activation_checkpointing="none")
    text = cheapest_fix(args, cfg, "NVIDIA A100-SXM4-80GB")
    first, second = text.splitlines()
    assert first.startswith("predicted ") and "GiB/GPU for this plan" in first
    # 7B states alone (16 B/param = 103 GiB) exceed 80 GiB: every fix offloads them (and trims activations)
    assert second.startswith("cheapest fix:") and "--cpu-offload" in second


def test_7b_on_two_h200_without_checkpointing_is_told_to_checkpoint():
    args = ModelArgs.from_hf_config(preset_config("deepseek-llm-7b"))
    cfg = TrainConfig(model="deepseek-llm-7b", device="cuda", nproc=2, dp_shard=2, seq_len=16384,
                      global_batch_size=4, micro_batch_size=2, activation_checkpointing="none")
    text = cheapest_fix(args, cfg, "NVIDIA H200")
    assert "cheapest fix: --activation-checkpointing" in text or "cheapest fix: --micro-batch-size 1" in text


def test_a_pipelined_run_is_priced_as_a_pipeline():
    """A `--pp 2` run's advice prices the pp = 2 plan it ran (each rank holds half of the layers), not a plan where
    every rank holds the whole model."""
    args = ModelArgs.from_hf_config(preset_config("deepseek-llm-7b"))
    cfg = TrainConfig(model="deepseek-llm-7b", device="cuda", nproc=2, dp_shard=1, pp=2, pp_schedule="1F1B",
                      pp_virtual_stages=1, seq_len=4096, global_batch_size=8, micro_batch_size=2)
    first = cheapest_fix(args, cfg, "NVIDIA H200").splitlines()[0]
    cluster = make_cluster("H200", 2, gpus_per_node=2)
    piped = evaluate(args, cluster, Plan(pp=2, pp_schedule="1F1B", micro_batch_size=2), 4096, 8)
    whole = evaluate(args, cluster, Plan(dp_shard=1, micro_batch_size=2), 4096, 8)
    assert first.startswith(f"predicted {piped.memory.total / 2**30:.1f} GiB/GPU for this plan")
    assert piped.memory.total < 0.75 * whole.memory.total
