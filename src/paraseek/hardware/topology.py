"""Links between GPUs as pure functions of a node's inventory: the `nvidia-smi topo -m` matrix, NVLink islands,
a GPU order that keeps islands contiguous, and the bandwidth each link type should give.

A node inventory (see inventory.py) carries three N x N matrices over its GPUs:
  nvlink_counts[i][j]  active NVLink links between GPU i and GPU j (through an NVSwitch: the fewer of the two
                       GPUs' switch links), 0 for none
  pcie_path[i][j]      the PCIe relation: PIX (one switch), PXB (several switches), PHB (host bridge), NODE (same
                       NUMA node, across host bridges), SYS (across the CPU interconnect), X on the diagonal
  p2p[i][j]            CUDA peer-to-peer read status: OK, or why not (CNS chipset, GNS GPU, TNS topology,
                       NS not supported, DIS disabled by the driver's registry key, U unknown)
"""

from __future__ import annotations

from typing import Any

# nvidia-smi topo -m's legend, in the order of increasing distance.
LEGEND = {
    "X": "self",
    "NV#": "connection traversing a bonded set of # NVLinks",
    "PIX": "connection traversing at most a single PCIe bridge",
    "PXB": "connection traversing multiple PCIe bridges (without traversing the PCIe host bridge)",
    "PHB": "connection traversing PCIe as well as a PCIe host bridge (typically the CPU)",
    "NODE": "connection traversing PCIe and the interconnect between PCIe host bridges within a NUMA node",
    "SYS": "connection traversing PCIe and the SMP interconnect between NUMA nodes (e.g. QPI/UPI)",
    "U": "unknown (NVML did not report the PCIe path)",
}
PCIE_ORDER = ["PIX", "PXB", "PHB", "NODE", "SYS"]

# Per-lane, per-direction PCIe payload rate in GB/s after line coding (gen1/2 8b/10b, gen3+ 128b/130b).
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.877}

# Per-link, per-direction NVLink rate in GB/s by NVLink generation (NVLink 2-4 are all 25 GB/s a link: V100 has
# 6 links = 150, A100 12 = 300, H100/H200 18 = 450; NVLink 5 on Blackwell doubles it: 18 x 50 = 900).
NVLINK_LINK_GBPS = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0, 6: 100.0}
ARCH_NVLINK_GENERATION = {"Pascal": 1, "Volta": 2, "Ampere": 3, "Hopper": 4, "Blackwell": 5}


def link_label(node: dict[str, Any], i: int, j: int) -> str:
    """The `nvidia-smi topo -m` label of the pair (i, j): X, NV#, or the PCIe relation."""
    if i == j:
        return "X"
    n = node["nvlink_counts"][i][j]
    return f"NV{n}" if n else node["pcie_path"][i][j]


def link_matrix(node: dict[str, Any]) -> list[list[str]]:
    n = len(node["gpus"])
    return [[link_label(node, i, j) for j in range(n)] for i in range(n)]


def nvlink_islands(node: dict[str, Any]) -> list[list[int]]:
    """Connected components of the NVLink graph (GPU positions in node['gpus']), each sorted, ordered by their
    smallest member. A GPU without NVLink is an island of one."""
    n = len(node["gpus"])
    seen: set[int] = set()
    islands = []
    for start in range(n):
        if start in seen:
            continue
        comp, stack = [], [start]
        seen.add(start)
        while stack:
            i = stack.pop()
            comp.append(i)
            for j in range(n):
                if j not in seen and node["nvlink_counts"][i][j] > 0:
                    seen.add(j)
                    stack.append(j)
        islands.append(sorted(comp))
    return islands


def _pcie_rank(label: str) -> int:
    return PCIE_ORDER.index(label) if label in PCIE_ORDER else len(PCIE_ORDER)


def gpu_order(node: dict[str, Any]) -> list[int]:
    """An order of the node's GPUs in which neighbours are close: NVLink islands stay contiguous (largest first,
    so tensor/expert groups of that size never straddle two), and GPUs without NVLink are grouped by PCIe
    closeness then NUMA node. This is the order to give CUDA_VISIBLE_DEVICES (as NVML/PCI indices)."""
    islands = nvlink_islands(node)
    multi = [isl for isl in islands if len(isl) > 1]
    singles = [isl[0] for isl in islands if len(isl) == 1]
    order: list[int] = []
    for isl in sorted(multi, key=lambda s: (-len(s), s[0])):
        order.extend(isl)
    # Greedy chain over the PCIe-only GPUs: start at the lowest index, always take the closest remaining one
    # (ties by NUMA node, then index), so GPUs under one PCIe switch end up next to each other.
    remaining = list(singles)
    while remaining:
        cur = remaining.pop(0)
        order.append(cur)
        while remaining:
            numa = node["gpus"][cur].get("numa_node")
            nxt = min(remaining, key=lambda j: (_pcie_rank(node["pcie_path"][cur][j]),
                                                 node["gpus"][j].get("numa_node") != numa, j))
            if _pcie_rank(node["pcie_path"][cur][nxt]) >= _pcie_rank("NODE") and node["gpus"][nxt].get(
                    "numa_node") != numa:
                break  # nothing close left: start a new group from the lowest remaining index
            remaining.remove(nxt)
            order.append(nxt)
            cur = nxt
    return order


def pcie_gbps(gpu: dict[str, Any]) -> float | None:
    """Per-direction PCIe bandwidth of a GPU's link at its best generation and width (idle GPUs drop the
    generation to save power, so the current one understates it)."""
    pcie = gpu.get("pcie") or {}
    gen = pcie.get("gen_max") or pcie.get("gen")
    width = pcie.get("width_max") or pcie.get("width")
    if not gen or not width or gen not in PCIE_LANE_GBPS:
        return None
    return PCIE_LANE_GBPS[gen] * width


def nvlink_link_gbps(gpu: dict[str, Any]) -> float | None:
    nv = gpu.get("nvlink") or {}
    gen = nv.get("generation") or ARCH_NVLINK_GENERATION.get(gpu.get("architecture", ""))
    return NVLINK_LINK_GBPS.get(gen) if gen else None


def expected_pair_gbps(node: dict[str, Any], i: int, j: int) -> float | None:
    """What a one-direction copy i -> j should reach by its link type (datasheet rate), or None when the pair has
    no usable peer path or the rate is not known. NVLink: links x per-link rate; PCIe with P2P under one root
    complex: the slower of the two GPUs' links. Across sockets (SYS) P2P rates vary too much to expect one."""
    if i == j:
        return None
    gi, gj = node["gpus"][i], node["gpus"][j]
    n = node["nvlink_counts"][i][j]
    if n:
        per = nvlink_link_gbps(gi) or nvlink_link_gbps(gj)
        return n * per if per else None
    if node["p2p"][i][j] != "OK" or node["pcie_path"][i][j] == "SYS":
        return None
    a, b = pcie_gbps(gi), pcie_gbps(gj)
    return min(a, b) if a and b else None


def ring_expected_gbps(node: dict[str, Any], order: list[int] | None = None) -> float | None:
    """The bus bandwidth a ring over `order` should approach: its slowest hop (nccl-tests' busbw is normalized so
    that it equals the per-GPU link rate of the bottleneck). None if any hop has no expected rate."""
    order = order if order is not None else gpu_order(node)
    if len(order) < 2:
        return None
    hops = [expected_pair_gbps(node, a, b) for a, b in zip(order, order[1:] + order[:1])]
    if any(h is None for h in hops):
        return None
    return min(hops)  # type: ignore[type-var]


def visible_order(node: dict[str, Any], cuda_visible_devices: str | None) -> list[int] | None:
    """Positions of the GPUs CUDA_VISIBLE_DEVICES selects, in its order (indices or UUID prefixes), or None if it
    is unset or names a device this node does not have."""
    if cuda_visible_devices is None or cuda_visible_devices.strip() == "":
        return None
    out = []
    for tok in cuda_visible_devices.split(","):
        tok = tok.strip()
        if tok.isdigit():
            pos = next((p for p, g in enumerate(node["gpus"]) if g.get("index") == int(tok)), None)
        else:
            pos = next((p for p, g in enumerate(node["gpus"]) if str(g.get("uuid", "")).startswith(tok)), None)
        if pos is None:
            return None
        out.append(pos)
    return out
