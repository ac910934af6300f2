#!/usr/bin/env bash
# `paraseek doctor` on the GPU machine, checked against a reference NCCL bus-bandwidth script in the same run
# (docs/doctor.md):
#   1. nvidia-smi's view (topo -m, nvlink --status) for comparison with the doctor's inventory
#   2. the doctor with all measurements (--json, --save PROFILE)  -> doctor.json, profile.json
#   3. the reference script (an independent torch.distributed busbw measurement, nccl-tests' formulas; not in this
#      repository) under torchrun  -> anchor.txt
#   4. the doctor with NCCL_P2P_DISABLE=1 (all_reduce only)  -> doctor_p2p_disable.json
#   5. the doctor --quick with CUDA_LAUNCH_BLOCKING=1  -> doctor_launch_blocking.json
#   6. the doctor under torchrun: one node (doctor_torchrun.json); two "nodes" of one GPU each (doctor_2nodes.json)
#   7. the GPU tests (tests/gpu/test_doctor_gpu.py)
#   8. a summary: doctor / reference busbw ratios, P2P-disabled vs normal, findings per run
# Everything printed also lands in log.txt.
# Usage (repo root, on the GPU machine): python scripts/gpu/validate.py doctor --out DIR --anchors DIR, or
# bash scripts/gpu/doctor_check.sh [REFERENCE] (default $PARASEEK_ANCHORS/nccl_busbw.py; writes to $OUT)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/doctor_check}
mkdir -p "$OUT"
ANCHOR=${1:-${PARASEEK_ANCHORS:-.}/nccl_busbw.py}
LOG=$OUT/log.txt
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
{
step "machine"
date -u; uname -r; nproc
nvidia-smi -L; nvidia-smi topo -m; nvidia-smi nvlink --status 2>&1 | head -8
python3 -c "import torch, pynvml; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count(), 'pynvml', pynvml.__file__)"

step "doctor, all measurements"
t0=$(date +%s)
timeout 150 python3 -m paraseek doctor --json --save "$OUT/profile.json" > "$OUT/doctor.json"
echo "rc=$? in $(( $(date +%s) - t0 )) s"
COLUMNS=160 python3 -m paraseek doctor --load "$OUT/doctor.json"  # the readable report

step "anchor nccl_busbw.py"
timeout 80 torchrun --standalone --nproc_per_node="$(nvidia-smi -L | wc -l)" "$ANCHOR" > "$OUT/anchor.txt" 2>&1
echo "rc=$?"; grep -E "busbw" "$OUT/anchor.txt"

step "doctor, NCCL_P2P_DISABLE=1"
NCCL_P2P_DISABLE=1 timeout 80 python3 -m paraseek doctor --json --collectives all_reduce \
  --sizes 16M,256M,1G,4G > "$OUT/doctor_p2p_disable.json"
echo "rc=$?"

step "doctor --quick, CUDA_LAUNCH_BLOCKING=1"
CUDA_LAUNCH_BLOCKING=1 timeout 40 python3 -m paraseek doctor --quick --json > "$OUT/doctor_launch_blocking.json"
echo "rc=$?"

step "doctor under torchrun, one node, one rank per GPU"
timeout 80 torchrun --standalone --nproc_per_node="$(nvidia-smi -L | wc -l)" -m paraseek doctor --json \
  --collectives all_reduce --sizes 256M,1G > "$OUT/doctor_torchrun.json"
echo "rc=$?"

step "doctor under torchrun as two nodes of one GPU each (CUDA_VISIBLE_DEVICES=0 and =1)"
port=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
for r in 0 1; do
  if [ $r = 0 ]; then dest="$OUT/doctor_2nodes.json"; else dest=/tmp/doctor_2nodes_rank1.out; fi
  CUDA_VISIBLE_DEVICES=$r timeout 80 torchrun --nnodes 2 --node-rank $r --nproc-per-node 1 --master-addr 127.0.0.1 \
    --master-port "$port" -m paraseek doctor --json --collectives all_reduce --sizes 256M,1G > "$dest" &
done
wait; echo "node 1 printed $(wc -c < /tmp/doctor_2nodes_rank1.out) bytes (expected 0)"

step "GPU tests"
timeout 80 python3 -m pytest -q -m gpu tests/gpu/test_doctor_gpu.py -p no:cacheprovider
echo "rc=$?"

step "summary"
python3 - "$OUT" <<'PY'
import json, re, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(f"{out}/{name}"))
    except Exception as e:
        print(f"{name}: unreadable ({e})"); return None
doc, p2pd, lb = load("doctor.json"), load("doctor_p2p_disable.json"), load("doctor_launch_blocking.json")
anchor = {}
for line in open(f"{out}/anchor.txt"):
    m = re.match(r"(\w+)\s+(\d+) MiB .* busbw\s+([\d.]+) GB/s", line)
    if m:
        anchor[(m.group(1), int(m.group(2)) * 2**20)] = float(m.group(3))
if doc:
    print("| GPU | name | matmul TFLOP/s | copy GB/s |\n|---|---|---|---|")
    for g in doc["gpus"]:
        print(f"| {g['index']} | {g['name']} | {(g['measured'] or {}).get('matmul_tflops')} | {(g['measured'] or {}).get('hbm_gbps')} |")
    for t in doc["topology"]["nodes"]:
        print(f"\ntopology: {t.get('matrix')}; islands {t.get('nvlink_islands')}; p2p {t.get('p2p')}")
    for p in doc["measurements"]["p2p"]:
        print(f"P2P copy GB/s (row -> column, {p['bytes'] // 2**20} MiB): {p['gbps']}; intact {p['intact']}")
    res = doc["measurements"]["collectives"]["intra_node"]["results"]
    print("\n| collective | size | doctor busbw GB/s | anchor busbw GB/s | doctor / anchor |\n|---|---|---|---|---|")
    for c, rows in res.items():
        for r in rows:
            a = anchor.get((c, r["bytes"]))
            d = r.get("busbw_gbps")
            ratio = f"{d / a:.3f}" if a and d else "-"
            print(f"| {c} | {r['bytes'] // 2**20} MiB | {d} | {a if a else '-'} | {ratio} |")
    print("\nfindings:", [(f["severity"], f["code"]) for f in doc["findings"]])
    prof = load("profile.json")
    if prof:
        print("profile:", {k: prof[k] for k in ("gpu_name", "memory_gib", "gpus_per_node", "nodes", "matmul_tflops",
                                                "hbm_gbps", "intra_node_busbw_gbps", "inter_node_busbw_gbps")})
if p2pd:
    print("\nNCCL_P2P_DISABLE=1 all_reduce busbw:", [(r["bytes"] // 2**20, r.get("busbw_gbps")) for r in
          p2pd["measurements"]["collectives"]["intra_node"]["results"]["all_reduce"]])
    print("  findings:", [(f["severity"], f["code"]) for f in p2pd["findings"]])
    for f in p2pd["findings"]:
        if f["code"] in ("NCCL_P2P_DISABLE", "SLOW_COLLECTIVES"):
            print(f"  {f['code']}: {f['seen']}")
    if doc:
        base = {r["bytes"]: r["busbw_gbps"] for r in doc["measurements"]["collectives"]["intra_node"]["results"]["all_reduce"]}
        for r in p2pd["measurements"]["collectives"]["intra_node"]["results"]["all_reduce"]:
            if r["bytes"] in base and r.get("busbw_gbps"):
                print(f"  {r['bytes'] // 2**20} MiB: {r['busbw_gbps']} vs {base[r['bytes']]} GB/s normally "
                      f"({r['busbw_gbps'] / base[r['bytes']]:.3f}x)")
if lb:
    print("\nCUDA_LAUNCH_BLOCKING=1 findings:", [(f["severity"], f["code"]) for f in lb["findings"]])
for name in ("doctor_torchrun.json", "doctor_2nodes.json"):
    d = load(name)
    if d:
        print(f"\n{name}: nodes {[(n['node'], n['hostname']) for n in d['nodes']]}, GPUs measured "
              f"{[(g['node'], g['index'], (g['measured'] or {}).get('matmul_tflops')) for g in d['gpus'] if g['measured']]}")
        for scope, block in d["measurements"]["collectives"].items():
            print(f"  {scope} ({block['ranks']} ranks) all_reduce busbw:",
                  [(r["bytes"] // 2**20, r.get("busbw_gbps", r.get("error"))) for r in block["results"]["all_reduce"]])
        print("  p2p:", [p["gbps"] for p in d["measurements"]["p2p"]], "errors:", d["measurements"]["errors"])
        print("  findings:", [(f["severity"], f["code"]) for f in d["findings"]])
PY
} 2>&1 | tee "$LOG"
