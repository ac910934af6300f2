#!/usr/bin/env bash
# 2x H200, one call: the baseline and paraseek's best 7B configuration in the same run, a profiled FSDP2 run,
# CPU offload, and expert parallelism on a V2-Lite-shaped model (8 of its 27 layers, so its states fit 2 GPUs).
# Usage: bash scripts/gpu/final_checks.sh ANCHORS_DIR OUT_DIR
set -u
anchors=${1:-.carry}; out=${2:-/tmp/out}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
date -u
echo "== baseline: HF + FSDP2, deepseek-7b shape, seq 4096, mbs 2, AC"
torchrun --standalone --nproc_per_node=$n "$anchors/hf_fsdp2_baseline.py" --model deepseek-7b --seq 4096 --mbs 2 --ac 1 2>&1 | grep RESULT
t() { local name=$1; shift; echo "== $name"; timeout 200 python3 -m paraseek train --nproc $n --data synthetic \
  --lr 1e-4 --warmup-steps 2 "$@" 2>&1 | grep -vE "^\s*$|Warning|warn\(" | grep -E "^(paraseek|step|done|rank|  )" | tail -14; }
t compile-selective-7b --model deepseek-llm-7b --seq-len 4096 --global-batch-size $((2*n)) --micro-batch-size 2 \
  --activation-checkpointing selective --compile --steps 12 --log-every 6 --metrics-jsonl "$out/compile.jsonl"
t profiled-7b --model deepseek-llm-7b --seq-len 4096 --global-batch-size $((2*n)) --micro-batch-size 2 \
  --activation-checkpointing selective --steps 5 --log-every 5 --profile-steps 3:4 --run-dir "$out/prof"
t offload-1.5b --model deepseek-r1-distill-qwen-1.5b --cpu-offload --seq-len 2048 --global-batch-size $((2*n)) \
  --micro-batch-size 2 --steps 3 --log-every 1
mkdir -p /tmp/v2l8 && python3 - <<'PY'
import json, sys; sys.path.insert(0, "src")
from paraseek.models import preset_config
cfg = dict(preset_config("deepseek-v2-lite"), num_hidden_layers=8); cfg.pop("auto_map", None)
json.dump(cfg, open("/tmp/v2l8/config.json", "w"))
PY
t v2lite8-fsdp --model /tmp/v2l8 --seq-len 4096 --global-batch-size $((2*n)) --micro-batch-size 2 \
  --activation-checkpointing selective --steps 8 --log-every 4 --metrics-jsonl "$out/v2l_fsdp.jsonl"
t v2lite8-ep2 --model /tmp/v2l8 --ep 2 --seq-len 4096 --global-batch-size $((2*n)) --micro-batch-size 2 \
  --activation-checkpointing selective --steps 8 --log-every 4 --metrics-jsonl "$out/v2l_ep2.jsonl"
