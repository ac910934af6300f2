#!/usr/bin/env bash
# On the GPU machine (2 GPUs): paraseek train vs the HF+FSDP2 baseline of ../shared/anchors, same run, same machine.
# Usage: bash scripts/gpu/train_vs_baseline.sh ANCHORS_DIR OUT_DIR
set -u
anchors=${1:-.carry}; out=${2:-/tmp/out}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
date -u
echo "== baseline: HF + FSDP2, deepseek-7b shape, seq 4096, mbs 2, AC"
torchrun --standalone --nproc_per_node=$n "$anchors/hf_fsdp2_baseline.py" --model deepseek-7b --seq 4096 --mbs 2 --ac 1 2>&1 | grep RESULT
run() {  # name, then paraseek train flags
  local name=$1; shift
  echo "== paraseek: $name"
  python3 -m paraseek train --model deepseek-llm-7b --device cuda --nproc $n --data synthetic --seq-len 4096 \
    --steps 10 --lr 1e-4 --warmup-steps 2 --log-every 5 --metrics-jsonl "$out/$name.jsonl" "$@" 2>&1 \
    | grep -E "^(paraseek|step|done|paraseek: error)|Error|error" | tail -6
}
run fsdp2-ac-full-mbs2 --global-batch-size $((2 * n)) --micro-batch-size 2 --activation-checkpointing full
run fsdp2-ac-selective-mbs2 --global-batch-size $((2 * n)) --micro-batch-size 2 --activation-checkpointing selective
run fsdp2-no-ac-mbs1 --global-batch-size $((2 * n)) --micro-batch-size 1 --activation-checkpointing none
