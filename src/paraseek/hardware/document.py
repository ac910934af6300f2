"""The doctor's JSON document (`paraseek doctor --json`, schema paraseek.doctor/1): gpus, topology, measurements,
findings, and the nodes' inventories so that a saved document can be read back (`--load`) and diagnosed again."""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from paraseek.errors import UserError, read_parsed
from paraseek.hardware import topology as topo
from paraseek.hardware.rules import Finding, Machine
from paraseek.hardware.specs import spec_for_device_name

SCHEMA = "paraseek.doctor/1"
NODE_KEYS_IN_TOPOLOGY = ("nvlink_counts", "pcie_path", "p2p")


def build_document(nodes: list[dict[str, Any]], measurements: dict[str, Any] | None,
                   findings: list[Finding]) -> dict[str, Any]:
    """The document of these nodes, measurements and findings."""
    m = Machine(nodes, measurements)
    gpus = []
    for n, p, g in m.all_gpus():
        spec = spec_for_device_name(g.get("name") or "")
        c = m.compute(n, p)
        gpus.append({"node": n["node"], "hostname": n["hostname"], **g, "spec": spec.name if spec else None,
                     "measured": {k: c.get(k) for k in ("matmul_tflops", "hbm_gbps")} if c else None})
    topology = {"legend": topo.LEGEND, "nodes": []}
    for n in nodes:
        t: dict[str, Any] = {"node": n["node"], "hostname": n["hostname"], **{k: n[k] for k in NODE_KEYS_IN_TOPOLOGY}}
        if n["gpus"]:
            t["matrix"] = topo.link_matrix(n)
            t["nvlink_islands"] = [[n["gpus"][p]["index"] for p in isl] for isl in topo.nvlink_islands(n)]
            t["gpu_order"] = [n["gpus"][p]["index"] for p in topo.gpu_order(n)]
            t["cuda_visible_devices"] = ",".join(str(i) for i in t["gpu_order"])
        if n.get("links_unknown"):
            t["links_unknown"] = True
        topology["nodes"].append(t)
    return {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpus": gpus,
        "topology": topology,
        "measurements": measurements,
        "findings": [asdict(f) for f in findings],
        "nodes": [{k: v for k, v in n.items() if k not in ("gpus", "links_unknown", *NODE_KEYS_IN_TOPOLOGY)}
                  for n in nodes],
    }


def nodes_from_document(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The node inventories back from a document (a --json output or a fixture)."""
    try:
        nodes = []
        tops = {t["node"]: t for t in doc["topology"]["nodes"]}
        for n in doc["nodes"]:
            gpus = [{k: v for k, v in g.items() if k not in ("node", "hostname", "spec", "measured")}
                    for g in doc["gpus"] if g["node"] == n["node"]]
            t = tops.get(n["node"], {})
            k = len(gpus)
            node = {**n, "gpus": gpus,
                    "nvlink_counts": t.get("nvlink_counts", [[0] * k for _ in range(k)]),
                    "pcie_path": t.get("pcie_path", [["X"] * k for _ in range(k)]),
                    "p2p": t.get("p2p", [["X"] * k for _ in range(k)])}
            node.setdefault("env", {})
            node.setdefault("versions", {})
            node.setdefault("nvml", {"available": bool(gpus), "error": None})
            if t.get("links_unknown"):
                node["links_unknown"] = True
            nodes.append(node)
        return nodes
    except (KeyError, TypeError) as e:
        raise UserError(f"not a paraseek doctor document (missing {e}); make one with `paraseek doctor --json`")


def load_document(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--load {path}: no such file; give a document written by `paraseek doctor --json`")
    doc = read_parsed(p, f"--load {path}", "JSON")
    if not isinstance(doc, dict) or "gpus" not in doc or "nodes" not in doc:
        raise UserError(f"--load {path}: not a paraseek doctor document (needs 'gpus' and 'nodes'); make one with "
                        "`paraseek doctor --json`")
    return doc
