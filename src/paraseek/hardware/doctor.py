"""`paraseek doctor`: inventory (inventory.py) + measurements (probe.py) -> findings (rules.py) -> the document
(document.py) -> a report (report.py) or the planner's hardware profile (profile.py). docs/doctor.md documents the
output. Under torchrun: `torchrun ... -m paraseek doctor`.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from paraseek.errors import UserError, check_writable
from paraseek.hardware.document import build_document, load_document, nodes_from_document
from paraseek.hardware.profile import build_profile, save_profile
from paraseek.hardware.rules import SEVERITIES, diagnose


def parse_size(text: str) -> int:
    """'64K', '1M', '4G' (powers of 1024, as nccl-tests), or plain bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if not m or int(m.group(1)) <= 0:
        raise UserError(f"--sizes: cannot read {text!r}; write sizes like 1M,16M,256M,1G,4G")
    return int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2).upper()]


def register(subparsers: Any) -> None:
    """Add the `doctor` subcommand to the CLI's subparsers."""
    p = subparsers.add_parser(
        "doctor", help="GPUs, links and measured bandwidths -> findings with fixes",
        description="Inventory the GPUs through NVML (models, memory, clocks, PCIe, NUMA, NVLink, P2P), measure "
        "matmul rate, memory and P2P bandwidth and NCCL collective bus bandwidth (nccl-tests conventions), and "
        "report findings, each with why it matters and the fix. On a machine without GPUs it measures gloo on CPU. "
        "Multi-node: run it under torchrun on every node (torchrun --nnodes N --nproc-per-node GPUS -m paraseek "
        "doctor); rank 0 reports all nodes.")
    p.add_argument("--quick", action="store_true", help="inventory and rules only, no measurements")
    p.add_argument("--json", action="store_true", help="print one JSON document (gpus, topology, measurements, "
                   "findings, nodes)")
    p.add_argument("--save", metavar="PROFILE.json", help="write the hardware profile the planner reads "
                   "(docs/doctor.md); an existing file is replaced only with --overwrite")
    p.add_argument("--overwrite", action="store_true", help="let --save replace an existing profile (and the "
                   "calibration `bench --calibrate` added to it)")
    p.add_argument("--load", metavar="REPORT.json", help="no hardware: run the rules on a saved --json document")
    p.add_argument("--sizes", help="collective message sizes, e.g. 1M,16M,256M,1G,4G (default that with NCCL; "
                   "64K,1M,16M with gloo)")
    p.add_argument("--collectives", default=",".join(_collectives()),
                   help="which collectives to measure (default all_reduce,all_gather,reduce_scatter,all_to_all)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per collective and size (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls first (default 5)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds each measurement (one P2P pair, one collective at one size) may take before it "
                   "is reported as hung (default 60)")
    p.add_argument("--fail-on", choices=("never", "error", "warning"), default="never",
                   help="exit 1 if a finding of this severity or worse is found (default never)")
    p.set_defaults(func=run_doctor)


def _has_calibration(path: Path) -> bool:
    try:
        return "calibration" in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False


def _collectives() -> tuple[str, ...]:
    from paraseek.hardware.probe import COLLECTIVES

    return COLLECTIVES


def _config(ns: argparse.Namespace):
    from paraseek.hardware.probe import ProbeConfig

    if ns.iters <= 0 or ns.warmup < 0:
        raise UserError(f"--iters must be positive and --warmup not negative, got {ns.iters} and {ns.warmup}")
    if ns.timeout <= 0:
        raise UserError(f"--timeout must be positive, got {ns.timeout}")
    colls = tuple(c.strip() for c in ns.collectives.split(",") if c.strip())
    unknown = [c for c in colls if c not in _collectives()]
    if unknown or not colls:
        raise UserError(f"--collectives: unknown {', '.join(unknown) or '(none given)'}; choose from "
                        f"{','.join(_collectives())}")
    sizes = tuple(parse_size(s) for s in ns.sizes.split(",")) if ns.sizes else None
    return ProbeConfig(sizes=sizes, collectives=colls, iters=ns.iters, warmup=ns.warmup, timeout_s=ns.timeout,
                       startup_timeout_s=max(180.0, ns.timeout))


def run_doctor(ns: argparse.Namespace) -> int:
    from paraseek.hardware import probe
    from paraseek.hardware.inventory import collect_node

    if ns.save and not Path(ns.save).resolve().parent.is_dir():
        raise UserError(f"--save {ns.save}: the folder {Path(ns.save).parent} does not exist")
    if ns.save and Path(ns.save).exists() and not ns.overwrite:
        held = " and its calibration" if _has_calibration(Path(ns.save)) else ""
        raise UserError(f"--save {ns.save}: the file exists; pass --overwrite to replace it{held} (or save "
                        f"elsewhere)")
    if ns.save:
        check_writable("--save", ns.save, folder=False)
    cfg = _config(ns)
    if ns.load:
        doc = load_document(ns.load)
        nodes, measurements = nodes_from_document(doc), doc.get("measurements")
    elif probe.launched():
        got = probe.run_launched(collect_node, cfg, ns.quick)
        if got is None:
            return 0  # not global rank 0: rank 0 reports for everyone
        nodes, measurements = got
    else:
        nodes = [collect_node(0)]
        measurements = None if ns.quick else probe.measure_local(nodes[0], cfg)
    findings = diagnose(nodes, measurements)
    doc = build_document(nodes, measurements, findings)
    if ns.save:
        save_profile(ns.save, build_profile(doc))
    if ns.json:
        print(json.dumps(doc, indent=2))
    else:
        from paraseek.hardware.report import render

        render(doc)
        if ns.save:
            print(f"hardware profile written to {ns.save}")
    worst = {"never": -1, "error": 0, "warning": 1}[ns.fail_on]
    return 1 if any(SEVERITIES.index(f.severity) <= worst for f in findings) else 0


def measure_profile(collectives: tuple[str, ...] = ("all_reduce",)) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """This machine's profile as `paraseek doctor --save` makes it (inventory, per-GPU matmul and copy, P2P, and
    with more than one GPU the NCCL `collectives` in watched processes), and the measurement errors. Only
    all_reduce by default: it is the one the planner reads (`paraseek bench --calibrate` starts from it)."""
    from paraseek.hardware import probe
    from paraseek.hardware.inventory import collect_node

    nodes = [collect_node(0)]
    measurements = probe.measure_local(nodes[0], probe.ProbeConfig(collectives=collectives))
    return build_profile(build_document(nodes, measurements, [])), measurements.get("errors", [])
