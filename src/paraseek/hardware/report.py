"""The doctor's readable report: rich tables over the JSON document (document.build_document)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def _v(x: Any, fmt: str = "{}") -> str:
    return "-" if x is None or x == "" else fmt.format(x)


def _size(n: int) -> str:
    for unit, s in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= s and n % s == 0:
            return f"{n // s}{unit}"
    return str(n)


def render(doc: dict[str, Any], console: Console | None = None) -> None:
    con = console or Console()
    multi = len(doc["nodes"]) > 1
    for n in doc["nodes"]:
        v = n.get("versions", {})
        ports = Counter(" ".join(str(x) for x in (f"{p.get('rate_gbps') or 0:g} Gb/s", p.get("link_layer"), p["state"])
                                 if x) for p in n.get("infiniband") or [])
        rdma = ", ".join(f"{c}x {k}" for k, c in ports.items())
        con.print(f"[bold]{n['hostname']}[/bold]" + (f" (node {n['node']})" if multi else "") +
                  f": driver {_v(v.get('driver'))}, CUDA {_v(v.get('cuda_driver'))} (torch built for "
                  f"{_v(v.get('torch_cuda'))}), torch {_v(v.get('torch'))}, NCCL {_v(v.get('nccl'))}; "
                  f"{n.get('cpu_count')} CPUs, /dev/shm {_v(n.get('shm_gib'), '{:g}')} GiB" +
                  (f"; RDMA: {rdma}" if rdma else ""))

    if doc["gpus"]:
        t = Table(title="GPUs")
        cols = (["node"] if multi else []) + ["#", "name", "arch / cc", "memory GiB", "SM max MHz", "power W",
                                               "PCIe", "NUMA", "CPUs", "NVLinks", "matmul TFLOP/s", "copy GB/s"]
        for c in cols:
            t.add_column(c, justify="right" if c not in ("name", "arch / cc", "CPUs") else "left")
        for g in doc["gpus"]:
            pc, nv, meas = g.get("pcie") or {}, g.get("nvlink") or {}, g.get("measured") or {}
            row = ([str(g["node"])] if multi else []) + [
                str(g["index"]), g["name"], f"{_v(g.get('architecture'))} / {_v(g.get('compute_capability'))}",
                _v(g.get("memory_gib"), "{:g}"), _v((g.get("clocks_mhz") or {}).get("sm_max")),
                _v(g.get("power_limit_w")),
                f"gen{_v(pc.get('gen'))}/{_v(pc.get('gen_max'))} x{_v(pc.get('width'))}" if pc else "-",
                _v(g.get("numa_node")), _v(g.get("cpu_affinity")),
                _v(nv.get("active_links")) if nv.get("active_links") else "-",
                _v(meas.get("matmul_tflops"), "{:.0f}"), _v(meas.get("hbm_gbps"), "{:.0f}")]
            t.add_row(*row)
        con.print(t)

    for tn in doc["topology"]["nodes"]:
        if not tn.get("matrix") or len(tn["matrix"]) < 2:
            continue
        ids = [g["index"] for g in doc["gpus"] if g["node"] == tn["node"]]
        gp = [g for g in doc["gpus"] if g["node"] == tn["node"]]
        t = Table(title="Topology" + (f" (node {tn['node']})" if multi else "") +
                  (" - links unknown (no NVML)" if tn.get("links_unknown") else ""))
        t.add_column("")
        for i in ids:
            t.add_column(f"GPU{i}", justify="center")
        t.add_column("CPU affinity")
        t.add_column("NUMA")
        for r, i in enumerate(ids):
            t.add_row(f"GPU{i}", *tn["matrix"][r], _v(gp[r].get("cpu_affinity")), _v(gp[r].get("numa_node")))
        con.print(t)
        p2p = {f"{ids[i]}-{ids[j]} {tn['p2p'][i][j]}" for i in range(len(ids)) for j in range(i + 1, len(ids))
               if tn["p2p"][i][j] != "OK"}
        con.print(f"P2P read status (NVML): {'OK between all pairs' if not p2p else ', '.join(sorted(p2p))}"
                  f"; NVLink islands {tn.get('nvlink_islands')}; GPU order {tn.get('cuda_visible_devices')}")
        con.print("Legend: " + "; ".join(f"{k} = {v}" for k, v in doc["topology"]["legend"].items() if k != "X"),
                  style="dim")

    meas = doc.get("measurements")
    if meas:
        for p in meas.get("p2p", []):
            ids = [g["index"] for g in doc["gpus"] if g["node"] == p["node"]] or list(range(len(p["gbps"])))
            t = Table(title="P2P copy GB/s" + (f" (node {p['node']})" if multi else ""),
                      caption=f"row -> column, {_size(p['bytes'])} per copy")
            t.add_column("")
            for i in ids:
                t.add_column(f"GPU{i}", justify="right")
            for r, i in enumerate(ids):
                t.add_row(f"GPU{i}", *["X" if r == c else _v(p["gbps"][r][c], "{:.0f}") for c in range(len(ids))])
            con.print(t)
        for scope, block in (meas.get("collectives") or {}).items():
            res = block["results"]
            if not res:
                continue
            sizes = sorted({r["bytes"] for rows in res.values() for r in rows})
            t = Table(title=f"{meas['backend']} busbw GB/s, {scope.replace('_', '-')}, {block['ranks']} ranks",
                      caption=f"{meas.get('dtype')}; busbw = algbw x nccl-tests factor")
            t.add_column("size", justify="right")
            for c in res:
                t.add_column(c, justify="right")
            for s in sizes:
                cells = []
                for c in res:
                    r = next((r for r in res[c] if r["bytes"] == s), None)
                    cells.append("-" if r is None else ("failed" if "error" in r else f"{r['busbw_gbps']:.1f}"))
                t.add_row(_size(s), *cells)
            con.print(t)
        if meas.get("skipped"):
            con.print("skipped: " + "; ".join(meas["skipped"]), style="dim")

    if not doc["findings"]:
        con.print("[green]No findings.[/green]")
        return
    t = Table(title="Findings", show_lines=True)
    t.add_column("severity", no_wrap=True)
    t.add_column("code", no_wrap=True)
    for c in ("seen", "why it matters", "fix"):
        t.add_column(c, overflow="fold")
    for f in doc["findings"]:
        t.add_row(Text(f["severity"], style=STYLE[f["severity"]]), f["code"], f["seen"], f["why"], f["fix"])
    con.print(t)
