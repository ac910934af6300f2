#!/usr/bin/env bash
# 2x H200: expert parallelism (ep=2) on a V2-Lite-shaped model (8 of 27 layers), after final_checks.sh's FSDP run.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
mkdir -p /tmp/v2l8 && python3 -c "
import json, sys; sys.path.insert(0, 'src')
from paraseek.models import preset_config
cfg = dict(preset_config('deepseek-v2-lite'), num_hidden_layers=8); cfg.pop('auto_map', None)
json.dump(cfg, open('/tmp/v2l8/config.json', 'w'))"
timeout 150 python3 -m paraseek train --model /tmp/v2l8 --ep 2 --nproc 2 --data synthetic --seq-len 4096 \
  --global-batch-size 4 --micro-batch-size 2 --activation-checkpointing selective --steps 8 --log-every 4 \
  --lr 1e-4 --warmup-steps 2 --metrics-jsonl "${1:-/tmp}/v2l_ep2.jsonl" 2>&1 | grep -E "^(paraseek|step|done)" | tail -5
