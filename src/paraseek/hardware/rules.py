"""The doctor's findings: pure functions of the nodes' inventories (each with its NCCL/CUDA environment) and the
measurements. They never touch NVML or a GPU, so they are tested on recorded machines (tests/fixtures/doctor/).
Each finding says what was seen, why it matters and the fix; `diagnose` runs every rule.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

from paraseek.hardware import topology as topo
from paraseek.hardware.specs import spec_for_device_name

SEVERITIES = ("error", "warning", "info")
ABNORMAL_THROTTLE = {"hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown"}


@dataclass
class Finding:
    severity: str  # error: broken or badly slow; warning: slower or riskier than it should be; info: worth knowing
    code: str  # stable identifier (tests and scripts match on it)
    seen: str  # what was observed, with the numbers
    why: str  # why it matters for training
    fix: str  # what to do
    node: int | None = None
    gpus: list[int] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------------------
# A read-only view over nodes + measurements for the rules


class Machine:
    def __init__(self, nodes: list[dict[str, Any]], measurements: dict[str, Any] | None):
        self.meas = measurements or {}
        self.multi = len(nodes) > 1
        # The rules see each node's effective P2P status (NVML's is kept as p2p_nvml).
        self.nodes = [dict(n, p2p=self._effective_p2p(n), p2p_nvml=n["p2p"]) for n in nodes]

    def _effective_p2p(self, node: dict[str, Any]) -> list[list[str]]:
        """NVML's P2P status, corrected by what was seen: CUDA's peer access where the doctor measured it, and
        OK for NVLink pairs NVML answers U (unknown) for (seen in the VMs of the GPU machine here, whose P2P
        copies ran at 388 GB/s)."""
        pa = next((m.get("peer_access") for m in self.meas.get("p2p", []) if m.get("node") == node["node"]), None)
        out = [list(row) for row in node["p2p"]]
        for i, row in enumerate(out):
            for j, st in enumerate(row):
                if i == j:
                    continue
                if pa and pa[i][j] is not None:
                    out[i][j] = "OK" if pa[i][j] else (st if st not in ("OK", "U") else "NS")
                elif st == "U" and node["nvlink_counts"][i][j] > 0:
                    out[i][j] = "OK"
        return out

    def gpu_name(self, node: dict[str, Any], pos: int) -> str:
        return f"node {node['node']} GPU {node['gpus'][pos]['index']}" if self.multi else \
            f"GPU {node['gpus'][pos]['index']}"

    def all_gpus(self) -> list[tuple[dict[str, Any], int, dict[str, Any]]]:
        return [(n, p, g) for n in self.nodes for p, g in enumerate(n["gpus"])]

    def compute(self, node: dict[str, Any], pos: int) -> dict[str, Any] | None:
        return next((c for c in self.meas.get("gpus", []) if c.get("node") == node["node"] and
                     c.get("position") == pos), None)

    def p2p(self, node: dict[str, Any]) -> dict[str, Any] | None:
        return next((m for m in self.meas.get("p2p", []) if m.get("node") == node["node"]), None)

    def busbw(self, scope: str, collective: str = "all_reduce", min_bytes: int = 0) -> tuple[int, float] | None:
        """(bytes, busbw GB/s) of `collective` at the largest size measured in `scope`, or None."""
        rows = (self.meas.get("collectives", {}).get(scope) or {}).get("results", {}).get(collective, [])
        ok = [r for r in rows if "busbw_gbps" in r and r["bytes"] >= min_bytes]
        if not ok:
            return None
        r = max(ok, key=lambda r: r["bytes"])
        return r["bytes"], r["busbw_gbps"]


def _truthy(v: str | None) -> bool:
    return v is not None and v.strip().lower() in ("1", "true", "yes", "on")


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def _pairs(idx: Iterable[tuple[int, int]]) -> str:
    return ", ".join(f"{a}-{b}" for a, b in idx)


def _env_nodes(m: Machine, pred) -> list[dict[str, Any]]:
    return [n for n in m.nodes if pred(n.get("env", {}), n)]


def _where(m: Machine, nodes: list[dict[str, Any]]) -> str:
    if not m.multi:
        return ""
    return f" on node{'s' if len(nodes) > 1 else ''} {', '.join(str(n['node']) for n in nodes)}"


# ----------------------------------------------------------------------------------------------------------------
# Rules: each takes the Machine and yields findings


def rule_no_gpu(m: Machine) -> Iterable[Finding]:
    if any(n["gpus"] for n in m.nodes):
        for n in m.nodes:
            if not n["gpus"]:
                yield Finding("error", "NODE_WITHOUT_GPU", f"node {n['node']} ({n['hostname']}) has no GPU "
                              f"({n['nvml'].get('error') or 'NVML lists none'}) while the others have some",
                              "a job over all nodes puts ranks where there is no GPU; NCCL fails or the rank "
                              "falls back to CPU and everyone waits for it",
                              "check the driver on that node (nvidia-smi) or leave it out of the job", n["node"])
        return
    errs = "; ".join(sorted({n["nvml"].get("error") or "NVML lists no GPU" for n in m.nodes}))
    gloo = m.busbw("intra_node") or m.busbw("world")
    measured = (f"; measured gloo all_reduce on CPU instead: {gloo[1]:.2f} GB/s busbw at {_fmt_bytes(gloo[0])}"
                if gloo else "")
    yield Finding("warning", "NO_GPU", f"no NVIDIA GPU found ({errs}){measured}",
                  "paraseek trains and plans for GPUs; on CPU only the tiny test models run, over gloo",
                  "run on a GPU machine; if this one has GPUs, check the driver (nvidia-smi), install nvidia-ml-py "
                  "and a CUDA build of torch")


def rule_software(m: Machine) -> Iterable[Finding]:
    for n in m.nodes:
        if not n["gpus"]:
            continue
        if not n["nvml"].get("available"):
            yield Finding("info", "NVML_UNAVAILABLE", f"GPUs seen through CUDA, but NVML is not available "
                          f"({n['nvml'].get('error')}){_where(m, [n])}",
                          "without NVML the doctor cannot see NVLink, PCIe, NUMA, clocks or throttling, so link "
                          "findings and the GPU order are missing", "pip install nvidia-ml-py", n["node"])
        if n["versions"].get("torch") and not n["versions"].get("torch_cuda"):
            yield Finding("error", "TORCH_WITHOUT_CUDA", f"torch {n['versions']['torch']} is a CPU build but "
                          f"{len(n['gpus'])} GPU(s) are present{_where(m, [n])}",
                          "nothing will run on the GPUs", "install a CUDA build of torch matching driver CUDA "
                          f"{n['versions'].get('cuda_driver')} (pip install torch --index-url "
                          "https://download.pytorch.org/whl/cu<version>)", n["node"])


def rule_mixed_gpus(m: Machine) -> Iterable[Finding]:
    groups: dict[str, list[tuple[dict[str, Any], int, dict[str, Any]]]] = defaultdict(list)
    for n, p, g in m.all_gpus():
        groups[g["name"]].append((n, p, g))
    if len(groups) > 1:
        parts, fixes = [], []
        for name, members in groups.items():
            g0 = members[0][2]
            parts.append(f"{len(members)}x {name} ({g0.get('architecture')}, cc {g0.get('compute_capability')}, "
                         f"{g0.get('memory_gib')} GiB) on {', '.join(m.gpu_name(n, p) for n, p, _ in members)}")
            idx = ",".join(str(g["index"]) for n, p, g in members)
            fixes.append(f"CUDA_VISIBLE_DEVICES={idx} for the {name}")
        no_bf16 = [name for name in groups if (s := spec_for_device_name(name)) is not None and not s.has_bf16]
        why = ("every synchronous step (data, tensor, pipeline or expert parallel) waits for the slowest GPU, and "
               "the plan must fit the smallest memory")
        if no_bf16:
            why += f"; {', '.join(no_bf16)} has no bf16, so the whole job would fall back to fp16 with loss scaling"
        archs = {g.get("architecture") for _, _, g in m.all_gpus()}
        archs_s = ", ".join(sorted(map(str, archs)))
        yield Finding("warning", "MIXED_GPUS", "; ".join(parts) + f" (architectures: {archs_s})",
                      why, "run one job per group (with CUDA_DEVICE_ORDER=PCI_BUS_ID): " + "; ".join(fixes) +
                      ". If they must share one job, keep each tensor/expert group on one kind and give the faster "
                      "GPUs more pipeline layers")
    for n in m.nodes:
        names = {g["name"] for g in n["gpus"]}
        if len(names) > 1 and n.get("env", {}).get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
            yield Finding("warning", "CUDA_DEVICE_ORDER", f"different GPU models on one node{_where(m, [n])} and "
                          f"CUDA_DEVICE_ORDER is {n.get('env', {}).get('CUDA_DEVICE_ORDER', 'unset')}",
                          "CUDA numbers GPUs fastest first, nvidia-smi and NVML by PCI bus, so CUDA_VISIBLE_DEVICES=0 "
                          "may not be nvidia-smi's GPU 0", "export CUDA_DEVICE_ORDER=PCI_BUS_ID", n["node"])


def rule_unequal_memory(m: Machine) -> Iterable[Finding]:
    mems = [(n, p, g["memory_gib"]) for n, p, g in m.all_gpus() if g.get("memory_gib")]
    if len(mems) < 2:
        return
    lo, hi = min(x[2] for x in mems), max(x[2] for x in mems)
    if hi > lo * 1.05:
        by: dict[float, list[str]] = defaultdict(list)
        for n, p, mem in mems:
            by[mem].append(m.gpu_name(n, p))
        seen = "; ".join(f"{mem:g} GiB on {', '.join(names)}" for mem, names in sorted(by.items()))
        yield Finding("warning", "UNEQUAL_MEMORY", seen,
                      f"sharded training (FSDP/ZeRO) and pipeline stages size every rank alike: the {lo:g} GiB GPUs "
                      f"set the batch and the split, and {hi - lo:g} GiB on the larger ones stays unused",
                      f"plan for {lo:g} GiB per GPU (paraseek plan takes the smallest), or run the larger GPUs as "
                      "their own job")


def rule_p2p(m: Machine) -> Iterable[Finding]:
    for n in m.nodes:
        k = len(n["gpus"])
        if k < 2:
            continue
        bad = [(i, j) for i in range(k) for j in range(i + 1, k) if n["p2p"][i][j] not in ("OK", "U")]
        if bad and not n.get("links_unknown"):
            status = sorted({n["p2p"][i][j] for i, j in bad})
            yield Finding(
                "warning", "NO_P2P",
                f"no CUDA peer-to-peer between {len(bad)} of {k * (k - 1) // 2} GPU pairs{_where(m, [n])}: "
                f"{_pairs((n['gpus'][i]['index'], n['gpus'][j]['index']) for i, j in bad)} "
                f"(NVML status {', '.join(status)})",
                "NCCL then moves intra-node traffic through host memory (SHM): collectives run at a fraction of "
                "the PCIe rate and tensor parallelism over these pairs stalls on every layer",
                "keep tensor parallelism off these pairs (FSDP/data or pipeline parallel over them). " + (
                    "P2P across CPU sockets (SYS) is unsupported on most platforms: keep each tensor group on one "
                    "socket" if all(n["pcie_path"][i][j] == "SYS" for i, j in bad) else
                    "GeForce cards have P2P disabled by the driver; on server GPUs under one root complex, "
                    "CNS/TNS usually means IOMMU or PCIe ACS is on (turn ACS off in the BIOS, boot with iommu=pt)"),
                n["node"],
                sorted({n["gpus"][x]["index"] for pair in bad for x in pair}))
        pm = m.p2p(n)
        if not pm:
            continue
        broken = [(i, j) for i in range(k) for j in range(k) if pm.get("intact") and pm["intact"][i][j] is False]
        hung = pm.get("errors", {})
        if broken or hung:
            seen = []
            if broken:
                seen.append(f"data arrived corrupted on {_pairs(broken)}")
            if hung:
                seen.append("; ".join(f"{pair}: {err}" for pair, err in hung.items()))
            yield Finding("error", "P2P_BROKEN", "P2P copies " + "; ".join(seen) + _where(m, [n]),
                          "a P2P path that hangs or corrupts data hangs NCCL or silently corrupts gradients",
                          "set NCCL_P2P_DISABLE=1 as a workaround; then fix the platform: disable IOMMU/ACS in the "
                          "BIOS (or iommu=pt), update the driver and the BIOS", n["node"])
        slow = []
        for i in range(k):
            for j in range(k):
                got = pm["gbps"][i][j] if i != j else None
                want = topo.expected_pair_gbps(n, i, j)
                if got is not None and want and got < 0.5 * want:
                    slow.append(f"{n['gpus'][i]['index']}->{n['gpus'][j]['index']} {got:.0f} GB/s "
                                f"({topo.link_label(n, i, j)} should give {want:.0f}, {got / want:.0%})")
        if slow:
            yield Finding("warning", "SLOW_P2P", "measured P2P bandwidth far below the link's rate"
                          f"{_where(m, [n])}: " + "; ".join(slow),
                          "a slow pair drags every ring and every tensor-parallel group that uses it",
                          "check links and errors: nvidia-smi nvlink --status and -e, nvidia-smi topo -m, the PCIe "
                          "link (lspci -vv: LnkSta); reseat or service the GPU/baseboard", n["node"])


def _splits(order: list[int], islands: list[list[int]]) -> bool:
    """Does `order` (GPU positions) put the members of some island apart?"""
    for isl in islands:
        at = sorted(order.index(p) for p in isl if p in order)
        if at and at[-1] - at[0] + 1 != len(at):
            return True
    return False


def _node_links(m: Machine, n: dict[str, Any]) -> Finding | None:
    """The NVLink layout of one node as a finding (without the node's name, so equal nodes merge)."""
    k = len(n["gpus"])
    if k < 2 or n.get("links_unknown"):
        return None
    islands = topo.nvlink_islands(n)
    idx = [g["index"] for g in n["gpus"]]
    order_s = ",".join(str(idx[p]) for p in topo.gpu_order(n))
    multi = [isl for isl in islands if len(isl) > 1]
    if len(islands) == 1:
        labels = sorted({topo.link_label(n, i, j) for i in range(k) for j in range(k) if i != j})
        return Finding("info", "NVLINK_DOMAIN", f"all {k} GPUs on NVLink ({'/'.join(labels)} between every pair)",
                       f"tensor and expert parallel groups of up to {k} stay on NVLink",
                       "nothing to do" + ("; put data/pipeline parallelism across nodes" if m.multi else ""))
    if not multi:
        paths = sorted({n["pcie_path"][i][j] for i in range(k) for j in range(k) if i != j},
                       key=lambda s: topo.PCIE_ORDER.index(s) if s in topo.PCIE_ORDER else 9)
        return Finding("info", "NO_NVLINK", f"no NVLink; GPUs talk over PCIe ({'/'.join(paths)})",
                       "tensor parallelism sends activations every layer and needs NVLink-class bandwidth; over "
                       "PCIe prefer FSDP/data and pipeline parallelism",
                       f"keep TP at 1 (2 at most, inside one PCIe switch); GPU order by PCIe closeness: "
                       f"CUDA_VISIBLE_DEVICES={order_s}")
    visible = topo.visible_order(n, n.get("env", {}).get("CUDA_VISIBLE_DEVICES"))
    natural_splits = _splits(list(range(k)), multi)
    visible_splits = visible is not None and _splits(visible, multi)
    smallest = min(len(isl) for isl in multi)
    alone = [idx[isl[0]] for isl in islands if len(isl) == 1]
    seen = "NVLink islands " + " ".join("[" + ",".join(str(idx[p]) for p in isl) + "]" for isl in islands)
    if alone:
        seen += f" (GPU{'s' if len(alone) > 1 else ''} {', '.join(map(str, alone))} without NVLink)"
    if natural_splits:
        seen += "; GPU index order splits them"
    if visible_splits:
        seen += f"; CUDA_VISIBLE_DEVICES={n['env']['CUDA_VISIBLE_DEVICES']} splits them"
    return Finding("warning" if natural_splits or visible_splits else "info", "NVLINK_ISLANDS", seen,
                   f"a tensor/expert group that spans two islands runs at PCIe speed; groups of up to {smallest} "
                   "fit inside every NVLink island",
                   f"order the GPUs so islands are contiguous, CUDA_VISIBLE_DEVICES={order_s}, and keep tensor x "
                   f"expert parallel groups within {smallest} GPUs; put pipeline/data parallelism across islands")


def rule_nvlink_topology(m: Machine) -> Iterable[Finding]:
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for n in m.nodes:
        f = _node_links(m, n)
        if f is not None:
            groups[(f.severity, f.code, f.seen, f.why, f.fix)].append(n)
    for (sev, code, seen, why, fix), nodes in groups.items():
        yield Finding(sev, code, seen + _where(m, nodes), why, fix, nodes[0]["node"] if len(nodes) == 1 else None)


def rule_pcie(m: Machine) -> Iterable[Finding]:
    for n, p, g in m.all_gpus():
        pc = g.get("pcie") or {}
        if pc.get("width") and pc.get("width_max") and pc["width"] < pc["width_max"]:
            yield Finding("warning", "PCIE_DOWNGRADED", f"{m.gpu_name(n, p)} PCIe link at x{pc['width']} of "
                          f"x{pc['width_max']} (gen {pc.get('gen')}/{pc.get('gen_max')})",
                          "host<->GPU copies, checkpoint loads and any P2P or NCCL traffic over PCIe run at a "
                          "fraction of the rate", "reseat the card or riser, check the slot's wiring (x8 slot?) and "
                          "lspci -vv LnkSta vs LnkCap", n["node"], [g["index"]])


def rule_slow_gpu(m: Machine) -> Iterable[Finding]:
    by_name: dict[str, list[tuple[dict[str, Any], int, dict[str, Any], dict[str, Any]]]] = defaultdict(list)
    for n, p, g in m.all_gpus():
        c = m.compute(n, p)
        if c:
            by_name[g["name"]].append((n, p, g, c))
    for name, members in by_name.items():
        for metric, unit, label in (("matmul_tflops", "TFLOP/s", "bf16 matmul"), ("hbm_gbps", "GB/s", "memory copy")):
            vals = [c[metric] for *_, c in members if c.get(metric)]
            if len(vals) >= 2:
                med = statistics.median(vals)
                for n, p, g, c in members:
                    if c.get(metric) and c[metric] < 0.85 * med:
                        extra = ""
                        if g.get("throttle_reasons"):
                            extra += f"; throttle reasons: {', '.join(g['throttle_reasons'])}"
                        if g.get("temperature_c") is not None:
                            extra += f"; {g['temperature_c']} C"
                        clk = g.get("clocks_mhz") or {}
                        if clk.get("sm") and clk.get("sm_max"):
                            extra += f"; SM clock {clk['sm']} of {clk['sm_max']} MHz"
                        yield Finding("warning", "SLOW_GPU", f"{m.gpu_name(n, p)} {label} {c[metric]:.0f} {unit} vs "
                                      f"median {med:.0f} of its {len(vals)} {name} ({c[metric] / med:.0%}){extra}",
                                      f"every synchronous step waits for the slowest rank: one GPU at "
                                      f"{c[metric] / med:.0%} slows all {len(m.all_gpus())} to that pace",
                                      "check cooling and power (nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER); "
                                      f"leave it out until fixed (CUDA_VISIBLE_DEVICES without {g['index']})",
                                      n["node"], [g["index"]])
        spec = spec_for_device_name(name)
        rates = [c["matmul_tflops"] for *_, c in members if c.get("matmul_tflops")]
        if spec and rates and max(rates) < 0.5 * spec.bf16_tflops:
            yield Finding("warning", "BELOW_DATASHEET", f"{name}: best measured bf16 matmul {max(rates):.0f} TFLOP/s, "
                          f"{max(rates) / spec.bf16_tflops:.0%} of the datasheet's {spec.bf16_tflops:.0f}",
                          "healthy GPUs reach 75-90% of the datasheet on a large matmul; far below points at clocks, "
                          "power capping or a shared GPU", "check clocks and power limits (nvidia-smi -q -d "
                          "CLOCK,POWER) and other processes on the GPU (nvidia-smi)")


def rule_throttle_power(m: Machine) -> Iterable[Finding]:
    for n, p, g in m.all_gpus():
        bad = sorted(set(g.get("throttle_reasons") or []) & ABNORMAL_THROTTLE)
        if bad:
            yield Finding("warning", "GPU_THROTTLED", f"{m.gpu_name(n, p)} clocks held down: {', '.join(bad)}"
                          + (f" at {g['temperature_c']} C" if g.get("temperature_c") is not None else ""),
                          "a throttled GPU runs every kernel slower and the whole job waits for it",
                          "check airflow, fans and the power supply; nvidia-smi -q -d PERFORMANCE shows the reason",
                          n["node"], [g["index"]])
        lim, dflt = g.get("power_limit_w"), g.get("power_default_limit_w")
        if lim and dflt and lim < 0.9 * dflt:
            yield Finding("warning", "POWER_LIMIT_LOWERED", f"{m.gpu_name(n, p)} power limit {lim} W of the default "
                          f"{dflt} W", "matmul-heavy training is power-bound: a lower limit lowers the clocks",
                          f"restore it (nvidia-smi -i {g['index']} -pl {dflt}, as an administrator) unless it was set "
                          "on purpose", n["node"], [g["index"]])


def _working_p2p(m: Machine, n: dict[str, Any]) -> bool:
    """Some GPU pair of node n has P2P, and no measured copy hung or arrived corrupted."""
    k = len(n["gpus"])
    measured = m.p2p(n) or {}
    ok = any(n["p2p"][i][j] == "OK" for i in range(k) for j in range(k) if i != j)
    corrupted = any(v is False for row in measured.get("intact") or [] for v in row)
    return ok and not measured.get("errors") and not corrupted


def _active_rdma(n: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in n.get("infiniband", []) if p.get("state") == "ACTIVE"]


def rule_nccl_p2p_disable(m: Machine) -> Iterable[Finding]:
    nodes = _env_nodes(m, lambda e, n: _truthy(e.get("NCCL_P2P_DISABLE")) and len(n["gpus"]) > 1 and _working_p2p(m, n))
    if not nodes:
        return
    bw = m.busbw("intra_node")
    meas = f"; measured all_reduce busbw {bw[1]:.1f} GB/s at {_fmt_bytes(bw[0])}" if bw else ""
    n0 = nodes[0]
    i, j = next((i, j) for i in range(len(n0["gpus"])) for j in range(len(n0["gpus"]))
                if i != j and n0["p2p"][i][j] == "OK")
    yield Finding("warning", "NCCL_P2P_DISABLE", f"NCCL_P2P_DISABLE=1 while the GPUs have working P2P "
                  f"({topo.link_label(n0, i, j)} between GPUs {n0['gpus'][i]['index']} and "
                  f"{n0['gpus'][j]['index']}){_where(m, nodes)}{meas}",
                  "NCCL then moves every intra-node byte through host shared memory instead of GPU-to-GPU "
                  "copies: intra-node collectives slow down several times",
                  "unset NCCL_P2P_DISABLE (it is a workaround for broken P2P, which was not found here)",
                  nodes[0]["node"])


def rule_nccl_shm_disable(m: Machine) -> Iterable[Finding]:
    nodes = _env_nodes(m, lambda e, n: _truthy(e.get("NCCL_SHM_DISABLE")) and len(n["gpus"]) > 1)
    if nodes:
        yield Finding("warning", "NCCL_SHM_DISABLE", f"NCCL_SHM_DISABLE=1 with {len(nodes[0]['gpus'])} GPUs per "
                      f"node{_where(m, nodes)}",
                      "shared memory is NCCL's intra-node path where P2P is missing or disabled; without it traffic "
                      "between local GPUs goes through the network stack", "unset NCCL_SHM_DISABLE (if /dev/shm is "
                      "too small, enlarge it instead: docker --shm-size or --ipc=host)", nodes[0]["node"])


def rule_nccl_ib_disable(m: Machine) -> Iterable[Finding]:
    nodes = _env_nodes(m, lambda e, n: _truthy(e.get("NCCL_IB_DISABLE")) and bool(_active_rdma(n)))
    if nodes:
        ports = _active_rdma(nodes[0])
        yield Finding("error" if m.multi else "warning", "NCCL_IB_DISABLE",
                      f"NCCL_IB_DISABLE=1 with {len(ports)} active RDMA port(s) ({ports[0]['device']}, "
                      f"{ports[0].get('rate_gbps')} Gb/s){_where(m, nodes)}",
                      "NCCL falls back to TCP sockets between nodes: inter-node collectives run at a fraction of the "
                      "InfiniBand rate", "unset NCCL_IB_DISABLE", nodes[0]["node"])


_LOCAL_INTERFACE = re.compile(r"^(lo|docker|virbr|veth|br-)")  # loopback and container bridges


def _unreachable_ifname(value: str | None) -> bool:
    """NCCL_SOCKET_IFNAME selects (not excludes, no leading ^) an interface other nodes cannot reach."""
    return value is not None and not value.startswith("^") and any(
        _LOCAL_INTERFACE.match(x.lstrip("=")) for x in value.split(","))


def rule_nccl_socket_ifname(m: Machine) -> Iterable[Finding]:
    nodes = _env_nodes(m, lambda e, n: _unreachable_ifname(e.get("NCCL_SOCKET_IFNAME")))
    if nodes:
        v = nodes[0]["env"]["NCCL_SOCKET_IFNAME"]
        yield Finding("error" if m.multi else "warning", "NCCL_SOCKET_IFNAME",
                      f"NCCL_SOCKET_IFNAME={v}{_where(m, nodes)}",
                      "NCCL's bootstrap (and its socket transport) then use loopback or a container bridge that "
                      "other nodes cannot reach: multi-node jobs hang at init or crawl",
                      "set it to the cluster network's interface (e.g. NCCL_SOCKET_IFNAME=eth0 or ib0), or exclude "
                      "the bad ones: NCCL_SOCKET_IFNAME=^lo,docker", nodes[0]["node"])


def _forced(m: Machine, var: str, what: str) -> Iterable[Finding]:
    nodes = _env_nodes(m, lambda e, n: bool(e.get(var)))
    if nodes:
        yield Finding("warning", f"{var}_FORCED", f"{var}={nodes[0]['env'][var]}{_where(m, nodes)}",
                      f"forces one {what} for every message size and topology; NCCL's tuner picks per size (LL for "
                      "small, Simple for large messages)",
                      f"unset {var} unless you are benchmarking that choice", nodes[0]["node"])


def rule_nccl_algo(m: Machine) -> Iterable[Finding]:
    return _forced(m, "NCCL_ALGO", "algorithm")


def rule_nccl_proto(m: Machine) -> Iterable[Finding]:
    return _forced(m, "NCCL_PROTO", "protocol")


def rule_nccl_debug_trace(m: Machine) -> Iterable[Finding]:
    nodes = _env_nodes(m, lambda e, n: (e.get("NCCL_DEBUG") or "").upper() == "TRACE")
    if nodes:
        yield Finding("warning", "NCCL_DEBUG_TRACE", f"NCCL_DEBUG=TRACE{_where(m, nodes)}",
                      "NCCL logs every call: slower collectives and gigabytes of logs on long runs",
                      "NCCL_DEBUG=WARN for training (INFO for one debugging run)", nodes[0]["node"])


def rule_cuda_launch_blocking(m: Machine) -> Iterable[Finding]:
    nodes = _env_nodes(m, lambda e, n: _truthy(e.get("CUDA_LAUNCH_BLOCKING")))
    if nodes:
        yield Finding("warning", "CUDA_LAUNCH_BLOCKING", f"CUDA_LAUNCH_BLOCKING=1{_where(m, nodes)}",
                      "every kernel launch waits for the kernel to finish: no overlap of compute, copies and "
                      "communication, often several times slower. It is a debugging aid; it does not fix memory "
                      "fragmentation", "unset CUDA_LAUNCH_BLOCKING; for fragmentation use "
                      "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", nodes[0]["node"])


def rule_shm_size(m: Machine) -> Iterable[Finding]:
    nodes = [n for n in m.nodes if n.get("shm_gib") is not None and n["shm_gib"] < 1.0]
    if nodes:
        yield Finding("warning", "SHM_SMALL", f"/dev/shm is {nodes[0]['shm_gib'] * 1024:.0f} MiB{_where(m, nodes)}",
                      "NCCL's shared-memory transport and DataLoader workers allocate there; a container's default "
                      "64 MiB ends in 'unhandled system error' from NCCL or bus errors in workers",
                      "docker run --shm-size=16g (or --ipc=host); in Kubernetes mount an emptyDir with medium: Memory "
                      "at /dev/shm", nodes[0]["node"])


def _expandable_segments(env: dict[str, str]) -> bool:
    conf = (env.get("PYTORCH_CUDA_ALLOC_CONF") or "") + "," + (env.get("PYTORCH_ALLOC_CONF") or "")
    return "expandable_segments:true" in conf.lower().replace(" ", "")


def rule_allocator(m: Machine) -> Iterable[Finding]:
    nodes = _env_nodes(m, lambda e, n: bool(n["gpus"]) and not _expandable_segments(e))
    if nodes:
        yield Finding("info", "ALLOCATOR", f"PYTORCH_CUDA_ALLOC_CONF is "
                      f"{nodes[0]['env'].get('PYTORCH_CUDA_ALLOC_CONF') or 'unset'} (no expandable segments)"
                      f"{_where(m, nodes)}",
                      "with varying sequence lengths the caching allocator fragments: OOM with gigabytes reserved "
                      "but unallocated", "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (paraseek train "
                      "sets it by default)", nodes[0]["node"])


# The environment's variables, one rule each (the checks above, in the order they report).
ENVIRONMENT_RULES = (rule_nccl_p2p_disable, rule_nccl_shm_disable, rule_nccl_ib_disable, rule_nccl_socket_ifname,
                     rule_nccl_algo, rule_nccl_proto, rule_nccl_debug_trace, rule_cuda_launch_blocking, rule_shm_size,
                     rule_allocator)


def rule_collectives(m: Machine) -> Iterable[Finding]:
    bw = m.busbw("intra_node", min_bytes=64 * 2**20)
    node = m.nodes[0] if m.nodes else None
    if bw and node and len(node["gpus"]) > 1 and m.meas.get("backend") == "nccl" and not node.get("links_unknown"):
        want = topo.ring_expected_gbps(node)
        if want and bw[1] < 0.4 * want:
            env = node.get("env", {})
            hint = [v for v in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "CUDA_LAUNCH_BLOCKING") if _truthy(env.get(v))]
            hint += [v for v in ("NCCL_ALGO", "NCCL_PROTO") if env.get(v)]
            yield Finding("warning", "SLOW_COLLECTIVES", f"intra-node all_reduce busbw {bw[1]:.1f} GB/s at "
                          f"{_fmt_bytes(bw[0])}, {bw[1] / want:.0%} of the {want:.0f} GB/s its slowest link should "
                          "carry" + (f" ({', '.join(hint)} set)" if hint else ""),
                          "gradient reduction, FSDP gathers and tensor-parallel traffic all run at this rate",
                          ("unset " + ", ".join(hint)) if hint else
                          "run with NCCL_DEBUG=INFO and look at the transports chosen (P2P/SHM/NET) and the "
                          "channel count", node["node"])
    for e in m.meas.get("errors", []):
        if e["what"].startswith("p2p"):
            continue  # P2P_BROKEN reports them
        yield Finding("error", "MEASUREMENT_FAILED", f"{e['what']}: {e['error']}",
                      "a collective or a GPU that hangs or fails here will hang or fail a training job",
                      "rerun with NCCL_DEBUG=INFO to see where it stops; check the GPU with nvidia-smi and the "
                      "kernel log (dmesg: Xid errors)")


def rule_nodes(m: Machine) -> Iterable[Finding]:
    if not m.multi:
        return
    diffs, severe = [], False
    for key, label in (("driver", "driver"), ("cuda_driver", "CUDA (driver)"), ("torch", "torch"),
                       ("torch_cuda", "torch CUDA"), ("nccl", "NCCL")):
        vals: dict[str, list[int]] = defaultdict(list)
        for n in m.nodes:
            vals[str(n["versions"].get(key))].append(n["node"])
        if len(vals) > 1:
            severe |= key in ("nccl", "torch")
            diffs.append(f"{label} " + " vs ".join(f"{v} (node {', '.join(map(str, ns))})" for v, ns in vals.items()))
    if diffs:
        yield Finding("error" if severe else "warning", "VERSION_MISMATCH", "versions differ across nodes: " +
                      "; ".join(diffs),
                      "NCCL of different versions can disagree on protocols and hang at the first collective; "
                      "different drivers and torch builds give different kernels and numerics",
                      "install the same driver, CUDA, torch and NCCL on every node (one container image)")
    counts = {n["node"]: len(n["gpus"]) for n in m.nodes}
    if len(set(counts.values())) > 1:
        yield Finding("warning", "GPU_COUNT_MISMATCH", "GPUs per node: " + ", ".join(
            f"node {k}: {v}" for k, v in counts.items()), "torchrun and the parallel plan assume the same number of "
            "ranks per node", "use --nproc-per-node equal to the smallest count, or fix the missing GPUs")
    ports = {n["node"]: [p for p in n.get("infiniband", []) if p.get("state") == "ACTIVE"] for n in m.nodes}
    rdma_gbps = min((sum(p.get("rate_gbps") or 0 for p in ps) / 8 for ps in ports.values()), default=0)
    bw = m.busbw("world")
    meas = f"{bw[1]:.1f} GB/s all_reduce busbw over all {len(m.nodes)} nodes at {_fmt_bytes(bw[0])}" if bw else None
    if not any(ports.values()):
        yield Finding("warning", "NO_RDMA", "no active InfiniBand/RoCE port on any node"
                      + (f"; measured {meas}" if meas else ""),
                      "NCCL goes over TCP sockets between nodes: a fraction of what RDMA gives; data parallelism "
                      "across nodes then dominates the step", "use RDMA NICs (and GPUDirect RDMA); meanwhile keep "
                      "only pipeline or hierarchical (HSDP) data parallelism across nodes")
    elif bw and rdma_gbps and bw[1] < 0.5 * rdma_gbps:
        yield Finding("warning", "SLOW_INTER_NODE", f"measured {meas}, {bw[1] / rdma_gbps:.0%} of the "
                      f"{rdma_gbps:.0f} GB/s of active RDMA ports per node",
                      "inter-node collectives are the step's bottleneck for data/expert parallelism across nodes",
                      "check NCCL_DEBUG=INFO for 'NET/IB' (not 'NET/Socket'), NCCL_IB_HCA, GPUDirect RDMA "
                      "(nvidia-peermem) and the ports' rates (ibstat)")
    elif bw:
        yield Finding("info", "INTER_NODE", f"measured {meas}; active RDMA per node: {rdma_gbps:.0f} GB/s",
                      "this is the rate data/expert parallel traffic across nodes gets", "nothing to do")


RULES = (rule_no_gpu, rule_software, rule_mixed_gpus, rule_unequal_memory, rule_p2p, rule_nvlink_topology, rule_pcie,
         rule_slow_gpu, rule_throttle_power, *ENVIRONMENT_RULES, rule_collectives, rule_nodes)


def diagnose(nodes: list[dict[str, Any]], measurements: dict[str, Any] | None = None) -> list[Finding]:
    """All findings for these nodes and measurements, errors first."""
    m = Machine(nodes, measurements)
    out = [f for rule in RULES for f in rule(m)]
    return sorted(out, key=lambda f: SEVERITIES.index(f.severity))
