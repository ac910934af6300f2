#!/usr/bin/env bash
# One device call that exercises the engine's GPU-only paths on 2x H200 and prints what BENCHMARKS.md records.
# Usage: bash scripts/gpu/engine_checks.sh OUT_DIR
set -u
out=${1:-/tmp/out}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
date -u; nvidia-smi --query-gpu=name --format=csv,noheader | head -1
t() { local name=$1; shift; echo "== $name"; timeout 240 python3 -m paraseek "$@" 2>&1 \
  | grep -E "^(plan auto|paraseek train|step|done|paraseek:|profile|rank [0-9])|Error|error" | tail -12; }
echo "== doctor with NCCL_P2P_DISABLE=1 (finding expected)"
NCCL_P2P_DISABLE=1 timeout 120 python3 -m paraseek doctor --quick --json > "$out/doctor_p2p_disable.json" 2>/dev/null
python3 -c "import json,sys; d=json.load(open('$out/doctor_p2p_disable.json')); print([f['code'] for f in d['findings']])"
t plan-auto-7b train --model deepseek-llm-7b --plan auto --nproc $n --seq-len 4096 --global-batch-size $((2*n)) \
  --steps 8 --lr 1e-4 --log-every 4 --metrics-jsonl "$out/plan_auto.jsonl"
t compile-7b-selective train --model deepseek-llm-7b --nproc $n --seq-len 4096 --global-batch-size $((2*n)) \
  --micro-batch-size 2 --activation-checkpointing selective --compile --steps 12 --lr 1e-4 --log-every 4 \
  --metrics-jsonl "$out/compile.jsonl"
t fp16-1.5b train --model deepseek-r1-distill-qwen-1.5b --nproc $n --precision fp16 --seq-len 2048 \
  --global-batch-size $((4*n)) --micro-batch-size 4 --steps 6 --lr 1e-4 --log-every 2
t offload-1.5b train --model deepseek-r1-distill-qwen-1.5b --nproc $n --cpu-offload --seq-len 2048 \
  --global-batch-size $((2*n)) --micro-batch-size 2 --steps 3 --lr 1e-4 --log-every 1
t demo demo --steps 20
echo "== MoE layer bench (after the fp32 combine change)"
timeout 120 python3 scripts/gpu/bench_moe_layer.py 2>&1 | grep -E "^\|.*paraseek|CORRECTNESS" | head -8
