"""The hardware profile `paraseek doctor --save PROFILE.json` writes and the planner reads (docs/doctor.md).

Top-level keys the planner uses (numbers measured on this machine where the doctor measured them, else null):
  gpu_name               the GPUs' model (the most common one if mixed; `mixed` says so)
  memory_gib             the smallest GPU's memory as the driver reports it
  gpus_per_node, nodes
  matmul_tflops          bf16 matmul rate of the slowest GPU (8192^3, random data)
  hbm_gbps               device-to-device copy rate of the slowest GPU, bytes read + written
  intra_node_busbw_gbps  NCCL all_reduce bus bandwidth inside a node at the largest message measured
  inter_node_busbw_gbps  the same over all nodes; null on one node
Below them: `gpus` (per-GPU facts, datasheet numbers from specs.py and the measured ones), `measurements`
(matmul_tflops and hbm_gbps per GPU, p2p_gbps matrices per node, busbw_gbps {collective: {bytes: GB/s}}) and
`links` (intra/inter-node rates, the topology matrix, NVLink islands and the recommended GPU order per node).
`paraseek bench --calibrate` adds `calibration` (bench/calibrate.py): rates measured on typical layer shapes that
the planner prefers to the top-level matmul_tflops / hbm_gbps and to its per-generation efficiency defaults.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from paraseek.errors import UserError, read_parsed
from paraseek.hardware.specs import spec_for_device_name

SCHEMA = "paraseek.hardware_profile/1"
REQUIRED = ("gpu_name", "memory_gib", "gpus_per_node", "nodes", "matmul_tflops", "intra_node_busbw_gbps",
            "inter_node_busbw_gbps")
# What each required key holds (the others: a number, or null where not measured).
_KINDS = {"gpu_name": (str,), "gpus_per_node": (int,), "nodes": (int,)}
_KIND_NAMES = {"gpu_name": "the GPUs' name", "gpus_per_node": "a whole number", "nodes": "a whole number"}


def _busbw_table(meas: dict[str, Any], scope: str) -> dict[str, dict[str, float]]:
    res = ((meas.get("collectives") or {}).get(scope) or {}).get("results", {})
    return {c: {str(r["bytes"]): r["busbw_gbps"] for r in rows if "busbw_gbps" in r} for c, rows in res.items()}


def _largest(table: dict[str, dict[str, float]], collective: str = "all_reduce") -> float | None:
    rows = table.get(collective) or {}
    return rows[max(rows, key=int)] if rows else None


def build_profile(doc: dict[str, Any]) -> dict[str, Any]:
    """A profile from a doctor document (the --json output)."""
    gpus = doc.get("gpus", [])
    meas = doc.get("measurements") or {}
    names = Counter(g["name"] for g in gpus)
    per_node = Counter(g["node"] for g in gpus)
    matmul = [g["measured"]["matmul_tflops"] for g in gpus if g.get("measured") and g["measured"].get("matmul_tflops")]
    hbm = [g["measured"]["hbm_gbps"] for g in gpus if g.get("measured") and g["measured"].get("hbm_gbps")]
    nodes = len(doc.get("nodes", [])) or 1
    intra = _busbw_table(meas, "intra_node")
    world = _busbw_table(meas, "world")
    intra_bw = _largest(intra) if meas.get("backend") == "nccl" else None
    inter_bw = _largest(world) if nodes > 1 and meas.get("backend") == "nccl" else None
    out_gpus = []
    for g in gpus:
        spec = spec_for_device_name(g.get("name") or "")
        out_gpus.append({
            "node": g["node"], "index": g["index"], "name": g["name"], "uuid": g.get("uuid"),
            "architecture": g.get("architecture"), "compute_capability": g.get("compute_capability"),
            "memory_gib": g.get("memory_gib"), "spec": spec.name if spec else None,
            "datasheet_bf16_tflops": spec.bf16_tflops if spec else None,
            "datasheet_hbm_gbps": spec.hbm_gbps if spec else None,
            "has_bf16": spec.has_bf16 if spec else None,
            "matmul_tflops": (g.get("measured") or {}).get("matmul_tflops"),
            "hbm_gbps": (g.get("measured") or {}).get("hbm_gbps"),
        })
    tops = doc.get("topology", {}).get("nodes", [])
    return {
        "schema": SCHEMA,
        "created": doc.get("created"),
        "source": "paraseek doctor",
        "gpu_name": names.most_common(1)[0][0] if names else None,
        "mixed": len(names) > 1,
        "memory_gib": min((g["memory_gib"] for g in gpus if g.get("memory_gib")), default=None),
        "gpus_per_node": min(per_node.values()) if per_node else 0,
        "nodes": nodes,
        "matmul_tflops": min(matmul) if matmul else None,
        "hbm_gbps": min(hbm) if hbm else None,
        "intra_node_busbw_gbps": intra_bw,
        "inter_node_busbw_gbps": inter_bw,
        "gpus": out_gpus,
        "measurements": {
            "backend": meas.get("backend"),
            "matmul_tflops": matmul,
            "hbm_gbps": hbm,
            "p2p_gbps": [{"node": p["node"], "gbps": p["gbps"]} for p in meas.get("p2p", [])],
            "busbw_gbps": intra,
            "inter_node_busbw_gbps": world if nodes > 1 else {},
        },
        "links": {
            "intra_node_gbps": intra_bw,
            "inter_node_gbps": inter_bw,
            "topology": [{"node": t["node"], "matrix": t.get("matrix"), "nvlink_islands": t.get("nvlink_islands"),
                          "gpu_order": t.get("gpu_order")} for t in tops],
        },
    }


def load_profile(path: str | Path, required: tuple[str, ...] = REQUIRED) -> dict[str, Any]:
    """Read a profile written by `paraseek doctor --save` (or by hand, with at least `required`); a UserError says
    what is wrong with it. The planner reads profiles through this too."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"hardware profile {p}: no such file; write one with `paraseek doctor --save {p}`")
    prof = read_parsed(p, f"hardware profile {p}", "JSON")
    missing = [k for k in required if not isinstance(prof, dict) or k not in prof]
    if missing:
        raise UserError(f"hardware profile {p}: missing {', '.join(missing)}; write it again with "
                        f"`paraseek doctor --save {p}`")
    for key in (k for k in REQUIRED if k in prof):  # the planner computes with them
        value, wanted = prof[key], _KINDS.get(key, (int, float, type(None)))
        if not isinstance(value, wanted) or isinstance(value, bool):
            raise UserError(f"hardware profile {p}: {key} is {value!r}, not {_KIND_NAMES.get(key, 'a number or null')}"
                            f"; write it again with `paraseek doctor --save {p}`")
    return prof


def add_calibration(profile: dict[str, Any], calibration: dict[str, Any]) -> dict[str, Any]:
    """The profile with `calibration` set (a newer calibration replaces an older one); everything else as it was,
    so the doctor's link measurements stay."""
    return {**profile, "calibration": calibration}


def save_profile(path: str | Path, profile: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(profile, indent=2) + "\n")
