"""inventory.py's NVML reading, against a stand-in pynvml module (no driver here): what NVML answers becomes the
node inventory the rules read, including the NV# link counts in the three ways NVML reports them."""

import sys
import types

import pytest

from paraseek.hardware import inventory, topology


class NotSupported(Exception):
    pass


def fake_pynvml(n_gpus=2, links=18, remote="peer", p2p_ok=True, names=None, cpu_count=32):
    """A pynvml with `n_gpus` GPUs. remote: 'peer' (each link ends at the other GPU's bus id), 'switch' (NVSwitch),
    'vm' (the remote bus id is the host's, unknown here; NVML's NVLink P2P status says they are linked),
    'vm-no-status' (the same without that status: two GPUs whose links lead somewhere unknown are linked)."""
    bus = [f"00000000:{0x18 + 0x10 * i:02X}:00.0" for i in range(n_gpus)]

    class H:
        def __init__(self, i):
            self.i = i

    def unsupported(*_):
        raise NotSupported()

    def link_state(h, link):
        if link >= links:
            raise NotSupported()
        return 1

    def remote_pci(h, link):
        if remote == "peer":
            return types.SimpleNamespace(busId=bus[1 - h.i])
        return types.SimpleNamespace(busId=f"00000000:{0xA0 + link:02X}:00.0")

    m = types.ModuleType("pynvml")
    m.NVML_CLOCK_SM, m.NVML_CLOCK_MEM, m.NVML_TEMPERATURE_GPU = 1, 2, 0
    m.NVML_P2P_CAPS_INDEX_READ, m.NVML_P2P_CAPS_INDEX_NVLINK = 0, 2
    m.NVML_NVLINK_MAX_LINKS = 18
    m.nvmlInit = lambda: None
    m.nvmlShutdown = lambda: None
    m.nvmlSystemGetDriverVersion = lambda: "580.159.04"
    m.nvmlSystemGetCudaDriverVersion = lambda: 13000
    m.nvmlSystemGetNVMLVersion = lambda: b"13.580.159.04"
    m.nvmlDeviceGetCount = lambda: n_gpus
    m.nvmlDeviceGetHandleByIndex = H
    m.nvmlDeviceGetName = lambda h: (names or ["NVIDIA H200"] * n_gpus)[h.i]
    m.nvmlDeviceGetUUID = lambda h: f"GPU-0000000{h.i}-aaaa-bbbb-cccc-dddddddddddd"
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=bus[h.i])
    m.nvmlDeviceGetArchitecture = lambda h: 9
    m.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=143771 * 2**20)
    m.nvmlDeviceGetMaxClockInfo = lambda h, t: {1: 1980, 2: 3201}[t]
    m.nvmlDeviceGetClockInfo = lambda h, t: {1: 345, 2: 3201}[t]
    m.nvmlDeviceGetPowerManagementLimit = lambda h: 700000
    m.nvmlDeviceGetPowerManagementDefaultLimit = lambda h: 700000
    m.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: 1  # idle GPUs drop the generation
    m.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: 5
    m.nvmlDeviceGetCurrPcieLinkWidth = lambda h: 16
    m.nvmlDeviceGetMaxPcieLinkWidth = lambda h: 16
    m.nvmlDeviceGetNumaNodeId = unsupported  # falls back to sysfs, absent here -> None
    m.nvmlDeviceGetCpuAffinity = lambda h, words: [0xFFFF if h.i == 0 else 0xFFFF0000] + [0] * (words - 1)
    m.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0x1 | (0x40 if h.i == 1 else 0)
    m.nvmlDeviceGetNvLinkState = link_state
    m.nvmlDeviceGetNvLinkVersion = lambda h, link: 6  # NVML_NVLINK_VERSION_4_0
    m.nvmlDeviceGetNvLinkRemotePciInfo = remote_pci
    m.nvmlDeviceGetNvLinkRemoteDeviceType = (lambda h, link: 2) if remote == "switch" else (
        (lambda h, link: 0) if remote == "peer" else unsupported)
    m.nvmlDeviceGetTemperature = lambda h, s: 30 + h.i
    m.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: 30
    m.nvmlDeviceGetP2PStatus = lambda a, b, idx: 0 if p2p_ok else 5
    if remote == "vm-no-status":  # nor does NVML answer the NVLink P2P query
        m.nvmlDeviceGetP2PStatus = lambda a, b, idx: unsupported() if idx == 2 else 0
    return m


@pytest.mark.parametrize("remote", ["peer", "switch", "vm", "vm-no-status"])
def test_nvml_inventory_of_two_linked_gpus(monkeypatch, remote):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(remote=remote))
    node = inventory.collect_node(0, hostname="h200")
    assert node["nvml"] == {"available": True, "error": None}
    assert node["versions"]["driver"] == "580.159.04" and node["versions"]["cuda_driver"] == "13.0"
    g0, g1 = node["gpus"]
    assert (g0["name"], g0["architecture"], g0["compute_capability"]) == ("NVIDIA H200", "Hopper", "9.0")
    assert g0["memory_gib"] == 140.4 and g0["power_limit_w"] == 700
    assert g0["pcie"] == {"gen": 1, "width": 16, "gen_max": 5, "width_max": 16}
    assert g0["pci_bus_id"] == "0000:18:00.0" and g0["numa_node"] is None
    assert g0["cpu_affinity"] == "0-15" and g1["cpu_affinity"] == "16-31"
    assert g0["nvlink"]["active_links"] == 18 and g0["nvlink"]["generation"] == 4
    assert g1["throttle_reasons"] == ["gpu_idle", "hw_thermal_slowdown"]
    assert node["nvlink_counts"] == [[0, 18], [18, 0]]
    assert topology.link_matrix(node) == [["X", "NV18"], ["NV18", "X"]]
    assert node["pcie_path"][0][1] == "PHB" and node["p2p"][0][1] == "OK"
    # NVLink 4 at 25 GB/s a link: 18 links = 450 GB/s per direction
    assert topology.expected_pair_gbps(node, 0, 1) == 450


def test_nvml_without_nvlink_or_p2p(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(n_gpus=2, links=0, p2p_ok=False))
    node = inventory.collect_node(0)
    assert node["nvlink_counts"] == [[0, 0], [0, 0]]
    assert topology.link_matrix(node) == [["X", "PHB"], ["PHB", "X"]]
    assert node["p2p"] == [["X", "NS"], ["NS", "X"]]
    assert topology.expected_pair_gbps(node, 0, 1) is None


def test_no_pynvml_means_no_gpus_and_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    node = inventory.collect_node(0)
    if node["gpus"]:
        pytest.skip("this machine has CUDA GPUs (seen through torch)")
    assert node["nvml"]["available"] is False and "nvidia-ml-py" in node["nvml"]["error"]
    assert node["nvlink_counts"] == [] and node["p2p"] == []


def test_nvml_init_failure(monkeypatch):
    m = fake_pynvml()

    def boom():
        raise RuntimeError("NVML Shared Library Not Found")

    m.nvmlInit = boom
    monkeypatch.setitem(sys.modules, "pynvml", m)
    node = inventory.collect_node(0)
    assert node["nvml"]["available"] is False and "Shared Library Not Found" in node["nvml"]["error"]


def test_cpu_ranges_and_arch():
    assert inventory.cpu_ranges([0, 1, 2, 3, 8, 9, 11]) == "0-3,8-9,11"
    assert inventory.cpu_ranges([]) == ""
    assert [inventory.arch_from_cc(c) for c in ("7.0", "7.5", "8.0", "8.9", "9.0")] == [
        "Volta", "Turing", "Ampere", "Ada", "Hopper"]


def test_env_capture_keeps_only_the_relevant_variables():
    env = inventory.relevant_env({"NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0,1", "HOME": "/root",
                                  "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "AWS_SECRET": "x"})
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1", "NCCL_DEBUG": "INFO",
                   "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
