"""What one node has: GPUs and their links read through NVML (nvidia-ml-py, `import pynvml`), versions, and the
host facts the doctor's rules look at (/dev/shm, InfiniBand ports, network interfaces, NCCL/CUDA variables).

Everything returned is plain JSON-serializable data (dicts, lists, numbers, strings), so a node's inventory can be
recorded as a file and the rules run on it with no GPU and no NVML (tests/fixtures/doctor/). pynvml is imported
lazily: without it, or without a driver, the node simply has no GPUs as far as NVML goes, and the error says why.

A node inventory:
  node, hostname, versions {driver, cuda_driver, torch, torch_cuda, nccl, nvml}, nvml {available, error},
  cpu_count, host_memory_gib, shm_gib, infiniband [{device, port, state, rate_gbps, link_layer}],
  net [{name, speed_mbps, operstate}], env {NCCL_*, CUDA_*, PYTORCH_*, ...},
  gpus [{index, name, uuid, pci_bus_id, architecture, compute_capability, memory_gib, clocks_mhz, power_limit_w,
         power_default_limit_w, pcie {gen, width, gen_max, width_max}, numa_node, cpu_affinity,
         nvlink {active_links, generation, to_switch}, throttle_reasons, temperature_c}],
  nvlink_counts, pcie_path, p2p   (N x N matrices, see topology.py)
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Callable

GIB = 2**30

ARCH_NAMES = {2: "Kepler", 3: "Maxwell", 4: "Pascal", 5: "Volta", 6: "Turing", 7: "Ampere", 8: "Ada", 9: "Hopper",
              10: "Blackwell"}
# NVML's nvmlTopologyCommonAncestor levels -> nvidia-smi topo labels (U: NVML did not say).
TOPO_LABELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
# NVML's nvmlGpuP2PStatus -> nvidia-smi topo -p2p letters.
P2P_STATUS = {0: "OK", 1: "CNS", 2: "GNS", 3: "TNS", 4: "DIS", 5: "NS", 6: "U"}
# nvmlNvlinkVersion enum -> NVLink generation.
NVLINK_VERSION = {1: 1, 2: 2, 3: 2, 4: 3, 5: 3, 6: 4, 7: 5, 8: 6}
# Clock event ("throttle") reason bits. gpu_idle, applications_clocks and sw_power_cap are normal states.
THROTTLE_BITS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                 0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
                 0x80: "hw_power_brake_slowdown", 0x100: "display_clocks", 0x200: "board_limit",
                 0x400: "reliability"}
ENV_PREFIXES = ("NCCL_", "CUDA_", "PYTORCH_", "TORCH_NCCL_", "TORCH_DISTRIBUTED", "NVSHMEM_", "GLOO_")


def arch_from_cc(cc: str | None) -> str | None:
    """Architecture name from a compute capability "major.minor"."""
    if not cc:
        return None
    major, minor = (int(x) for x in cc.split("."))
    if major == 7:
        return "Volta" if minor < 5 else "Turing"
    if major == 8:
        return "Ada" if minor == 9 else "Ampere"
    return {6: "Pascal", 9: "Hopper", 10: "Blackwell", 12: "Blackwell"}.get(major)


def cpu_ranges(cpus: list[int]) -> str:
    """[0,1,2,3,8,9] -> "0-3,8-9" (the CPU Affinity column of nvidia-smi topo -m)."""
    out, start, prev = [], None, None
    for c in sorted(cpus):
        if start is None:
            start = prev = c
        elif c == prev + 1:
            prev = c
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = c
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(out)


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """An NVML query that may be unsupported on this GPU/driver: its value, or None."""
    try:
        v = fn(*args)
    except Exception:  # pynvml.NVMLError_NotSupported and friends; a missing symbol in an old driver
        return None
    return v.decode() if isinstance(v, bytes) else v


def _bus_id(pci: Any) -> str | None:
    if pci is None:
        return None
    b = pci.busId
    b = b.decode() if isinstance(b, bytes) else b
    return normalize_bus_id(b)


def normalize_bus_id(b: str | None) -> str | None:
    """NVML writes 00000000:18:00.0, sysfs 0000:18:00.0, CUDA 0000:18:00.0 in any case: compare on the last 12."""
    return b.lower()[-12:] if b else None


def _nvml_gpu(nv: Any, h: Any, index: int, cpu_count: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    cc = _call(nv.nvmlDeviceGetCudaComputeCapability, h)
    cc_s = f"{cc[0]}.{cc[1]}" if cc else None
    arch = ARCH_NAMES.get(_call(nv.nvmlDeviceGetArchitecture, h)) or arch_from_cc(cc_s)
    mem = _call(nv.nvmlDeviceGetMemoryInfo, h)
    pci = _call(nv.nvmlDeviceGetPciInfo, h)
    bus = _bus_id(pci)
    power = _call(nv.nvmlDeviceGetPowerManagementLimit, h)
    power_default = _call(nv.nvmlDeviceGetPowerManagementDefaultLimit, h)
    numa = _call(nv.nvmlDeviceGetNumaNodeId, h)
    if numa is None and bus:
        try:
            numa = int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text())
        except (OSError, ValueError):
            numa = None
    if numa is not None and numa < 0:
        numa = None
    words = max(1, (cpu_count + 63) // 64)
    mask = _call(nv.nvmlDeviceGetCpuAffinity, h, words)
    affinity = None
    if mask is not None:
        affinity = cpu_ranges([w * 64 + b for w in range(words) for b in range(64) if (int(mask[w]) >> b) & 1])
    reasons = _call(getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or
                    nv.nvmlDeviceGetCurrentClocksThrottleReasons, h)
    links = []
    for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
        if not _call(nv.nvmlDeviceGetNvLinkState, h, link):
            continue  # inactive, or no such link (NotSupported)
        rtype = _call(getattr(nv, "nvmlDeviceGetNvLinkRemoteDeviceType", lambda *_: None), h, link)
        links.append({"link": link, "generation": NVLINK_VERSION.get(_call(nv.nvmlDeviceGetNvLinkVersion, h, link)),
                      "remote_bus_id": _bus_id(_call(nv.nvmlDeviceGetNvLinkRemotePciInfo, h, link)),
                      "remote_type": {0: "gpu", 1: "ibmnpu", 2: "switch"}.get(rtype, "unknown")})
    gpu = {
        "index": index,
        "name": _call(nv.nvmlDeviceGetName, h),
        "uuid": _call(nv.nvmlDeviceGetUUID, h),
        "pci_bus_id": bus,
        "architecture": arch,
        "compute_capability": cc_s,
        "memory_gib": round(mem.total / GIB, 2) if mem is not None else None,
        "clocks_mhz": {
            "sm_max": _call(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM),
            "mem_max": _call(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_MEM),
            "sm": _call(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
            "mem": _call(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM),
        },
        "power_limit_w": round(power / 1000) if power else None,
        "power_default_limit_w": round(power_default / 1000) if power_default else None,
        "pcie": {
            "gen": _call(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
            "width": _call(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
            "gen_max": _call(nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
            "width_max": _call(nv.nvmlDeviceGetMaxPcieLinkWidth, h),
        },
        "numa_node": numa,
        "cpu_affinity": affinity,
        "nvlink": {
            "active_links": len(links),
            "generation": max((lk["generation"] or 0 for lk in links), default=0) or None,
            "to_switch": sum(lk["remote_type"] == "switch" for lk in links),
            "remote_types": sorted({lk["remote_type"] for lk in links}),
        },
        "throttle_reasons": [name for bit, name in THROTTLE_BITS.items() if reasons and reasons & bit],
        "temperature_c": _call(nv.nvmlDeviceGetTemperature, h, getattr(nv, "NVML_TEMPERATURE_GPU", 0)),
    }
    return gpu, links


def nvlink_count_matrix(gpus: list[dict[str, Any]], links: list[list[dict[str, Any]]],
                        nvlink_p2p: list[list[bool]]) -> list[list[int]]:
    """Links between each pair: direct links whose remote end is the other GPU's bus id; through NVSwitches, the
    fewer of the two GPUs' switch links (what nvidia-smi shows as NV18 on an HGX H100). Links whose remote end is
    neither a local GPU nor a switch (seen in VMs, where the remote id is the host's) are shared out among the
    peers NVML says are reachable over NVLink."""
    n = len(gpus)
    counts = [[0] * n for _ in range(n)]
    by_bus = {g["pci_bus_id"]: p for p, g in enumerate(gpus) if g.get("pci_bus_id")}
    unknown = [0] * n
    switch = [0] * n
    for i, lks in enumerate(links):
        for lk in lks:
            j = by_bus.get(lk["remote_bus_id"])
            if j is not None and j != i:
                counts[i][j] += 1
            elif lk["remote_type"] == "switch":
                switch[i] += 1
            else:
                unknown[i] += 1
    for i in range(n):
        for j in range(n):
            if i != j and counts[i][j] == 0 and switch[i] and switch[j]:
                counts[i][j] = min(switch[i], switch[j])
        peers = [j for j in range(n) if j != i and counts[i][j] == 0 and nvlink_p2p[i][j]]
        if not peers and n == 2 and unknown[i] and unknown[1 - i]:
            peers = [1 - i]  # two GPUs, both with links to somewhere unknown: to each other
        for j in peers:
            counts[i][j] = unknown[i] // len(peers)
    for i in range(n):  # make it symmetric (each side counted its own links)
        for j in range(i + 1, n):
            counts[i][j] = counts[j][i] = min(counts[i][j], counts[j][i]) or max(counts[i][j], counts[j][i])
    return counts


def _nvml_inventory(cpu_count: int) -> dict[str, Any]:
    try:
        import pynvml as nv
    except ImportError:
        return {"nvml": {"available": False, "error": "pynvml is not installed (pip install nvidia-ml-py)"}}
    try:
        nv.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound (no driver), NVMLError_DriverNotLoaded, ...
        return {"nvml": {"available": False, "error": f"NVML did not initialize: {e}"}}
    try:
        cuda = _call(nv.nvmlSystemGetCudaDriverVersion)
        versions = {"driver": _call(nv.nvmlSystemGetDriverVersion),
                    "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None,
                    "nvml": _call(nv.nvmlSystemGetNVMLVersion)}
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        gpus, links = [], []
        for i, h in enumerate(handles):
            g, lk = _nvml_gpu(nv, h, i, cpu_count)
            gpus.append(g)
            links.append(lk)
        n = len(handles)
        pcie_path = [["X"] * n for _ in range(n)]
        p2p = [["X"] * n for _ in range(n)]
        nvlink_p2p = [[False] * n for _ in range(n)]
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                level = _call(nv.nvmlDeviceGetTopologyCommonAncestor, handles[i], handles[j])
                pcie_path[i][j] = TOPO_LABELS.get(level, "U") if level is not None else "U"
                st = _call(nv.nvmlDeviceGetP2PStatus, handles[i], handles[j], nv.NVML_P2P_CAPS_INDEX_READ)
                p2p[i][j] = P2P_STATUS.get(st, "U")
                nvlink_p2p[i][j] = _call(nv.nvmlDeviceGetP2PStatus, handles[i], handles[j],
                                         nv.NVML_P2P_CAPS_INDEX_NVLINK) == 0
        return {"nvml": {"available": True, "error": None}, "versions": versions, "gpus": gpus,
                "nvlink_counts": nvlink_count_matrix(gpus, links, nvlink_p2p), "pcie_path": pcie_path, "p2p": p2p}
    finally:
        _call(nv.nvmlShutdown)


def _torch_inventory() -> dict[str, Any]:
    """Without NVML but with a CUDA torch: names, memory and peer access from the CUDA runtime; links unknown."""
    import torch

    n = torch.cuda.device_count()
    gpus = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        cc = f"{p.major}.{p.minor}"
        uuid = getattr(p, "uuid", None)
        bus = None
        if hasattr(p, "pci_bus_id"):
            bus = f"{getattr(p, 'pci_domain_id', 0):04x}:{p.pci_bus_id:02x}:{getattr(p, 'pci_device_id', 0):02x}.0"
        gpus.append({"index": i, "name": p.name, "uuid": f"GPU-{uuid}" if uuid else None, "pci_bus_id": bus,
                     "architecture": arch_from_cc(cc), "compute_capability": cc,
                     "memory_gib": round(p.total_memory / GIB, 2), "clocks_mhz": {}, "pcie": {},
                     "numa_node": None, "cpu_affinity": None, "nvlink": {"active_links": 0}, "throttle_reasons": []})
    p2p = [["X" if i == j else ("OK" if torch.cuda.can_device_access_peer(i, j) else "NS") for j in range(n)]
           for i in range(n)]
    return {"gpus": gpus, "nvlink_counts": [[0] * n for _ in range(n)],
            "pcie_path": [["X" if i == j else "SYS" for j in range(n)] for i in range(n)], "p2p": p2p,
            "links_unknown": True}


def _infiniband() -> list[dict[str, Any]]:
    """RDMA ports from sysfs: /sys/class/infiniband/<dev>/ports/<n>/{state,rate,link_layer}."""
    out = []
    root = Path("/sys/class/infiniband")
    for dev in sorted(root.iterdir()) if root.is_dir() else []:
        for port in sorted((dev / "ports").iterdir()) if (dev / "ports").is_dir() else []:
            def read(name: str) -> str:
                try:
                    return (port / name).read_text().strip()
                except OSError:
                    return ""
            rate = read("rate").split()  # "400 Gb/sec (4X NDR)"
            out.append({"device": dev.name, "port": int(port.name),
                        "state": read("state").split(":")[-1].strip(),  # "4: ACTIVE"
                        "rate_gbps": float(rate[0]) if rate and rate[0].replace(".", "").isdigit() else None,
                        "link_layer": read("link_layer") or None})
    return out


def _net() -> list[dict[str, Any]]:
    out = []
    root = Path("/sys/class/net")
    for dev in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            speed = int((dev / "speed").read_text())
        except (OSError, ValueError):
            speed = None
        try:
            state = (dev / "operstate").read_text().strip()
        except OSError:
            state = None
        out.append({"name": dev.name, "speed_mbps": speed if speed and speed > 0 else None, "operstate": state})
    return out


def _host_memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) * 1024 / GIB, 1)
    except OSError:
        pass
    return None


def _shm_gib() -> float | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return round(st.f_blocks * st.f_frsize / GIB, 3)


def relevant_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    environ = dict(os.environ) if environ is None else environ
    return {k: v for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIXES)}


def software_versions() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": None, "torch_cuda": None, "nccl": None}
    try:
        import torch
    except ImportError:
        return out
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    try:
        v = torch.cuda.nccl.version()
        out["nccl"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    except Exception:  # a CPU build has no NCCL
        pass
    return out


def collect_node(node: int = 0, hostname: str | None = None) -> dict[str, Any]:
    """This node's inventory (see the module docstring). Never raises for missing GPUs or drivers."""
    cpu_count = os.cpu_count() or 1
    inv = _nvml_inventory(cpu_count)
    nvml_gpus = inv.get("gpus") or []
    if not nvml_gpus:
        try:
            import torch
            if torch.cuda.is_available() and torch.cuda.device_count() > 0:
                inv.update(_torch_inventory())
        except Exception:
            pass
    versions = {"driver": None, "cuda_driver": None, "nvml": None, **inv.get("versions", {}), **software_versions()}
    gpus = inv.get("gpus", [])
    n = len(gpus)
    return {
        "node": node,
        "hostname": hostname or socket.gethostname(),
        "versions": versions,
        "nvml": inv["nvml"],
        "cpu_count": cpu_count,
        "host_memory_gib": _host_memory_gib(),
        "shm_gib": _shm_gib(),
        "infiniband": _infiniband(),
        "net": _net(),
        "env": relevant_env(),
        "gpus": gpus,
        "nvlink_counts": inv.get("nvlink_counts", [[0] * n for _ in range(n)]),
        "pcie_path": inv.get("pcie_path", [["X"] * n for _ in range(n)]),
        "p2p": inv.get("p2p", [["X"] * n for _ in range(n)]),
        **({"links_unknown": True} if inv.get("links_unknown") else {}),
    }
