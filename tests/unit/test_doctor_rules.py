"""The doctor's rules on inventories of machine types kept as JSON (tests/fixtures/doctor/, in the `--json` format):
each machine gives exactly the expected findings; each environment mistake is caught, and the right settings
are left alone."""

import copy
import json
from pathlib import Path

import pytest

from paraseek.errors import UserError
from paraseek.hardware import topology as topo
from paraseek.hardware.document import build_document, nodes_from_document
from paraseek.hardware.rules import diagnose
from paraseek.hardware.profile import build_profile, load_profile

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "doctor"


def load(name):
    doc = json.loads((FIXTURES / name).read_text())
    return nodes_from_document(doc), doc.get("measurements")


def codes(nodes, meas=None):
    return {f.code for f in diagnose(nodes, meas)}


def by_code(nodes, meas=None):
    return {f.code: f for f in diagnose(nodes, meas)}


EXPECTED = {
    "h100_sxm_8x_nvswitch.json": {"NVLINK_DOMAIN"},
    "rtx4090_4x_pcie_no_p2p.json": {"NO_P2P", "PCIE_DOWNGRADED", "SHM_SMALL", "NO_NVLINK", "ALLOCATOR"},
    "a100_v100_mixed.json": {"MIXED_GPUS", "CUDA_DEVICE_ORDER", "UNEQUAL_MEMORY", "NO_P2P", "NVLINK_ISLANDS"},
    "two_nodes_h100_ib.json": {"VERSION_MISMATCH", "NCCL_IB_DISABLE", "SLOW_INTER_NODE", "NVLINK_DOMAIN"},
    "a100_sxm_8x_one_throttled.json": {"SLOW_GPU", "GPU_THROTTLED", "NVLINK_DOMAIN"},
    "cpu_only.json": {"NO_GPU"},
    # recorded on the GPU machine (2x H200, NV18 through NVSwitch; scripts/gpu/doctor_check.sh)
    "h200_x2.json": {"NVLINK_DOMAIN", "ALLOCATOR"},
    "h200_x2_nccl_p2p_disable.json": {"NCCL_P2P_DISABLE", "SLOW_COLLECTIVES", "NVLINK_DOMAIN", "ALLOCATOR"},
    "h200_x2_cuda_launch_blocking.json": {"CUDA_LAUNCH_BLOCKING", "NVLINK_DOMAIN", "ALLOCATOR"},
    "h200_x2_as_two_nodes.json": {"NO_RDMA", "NVLINK_DOMAIN", "ALLOCATOR"},
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_machine_gives_the_expected_findings(name):
    nodes, meas = load(name)
    assert codes(nodes, meas) == EXPECTED[name]


def test_fixture_set_is_complete():
    assert {p.name for p in FIXTURES.glob("*.json")} >= set(EXPECTED)


def test_h100_nvswitch_details():
    nodes, _ = load("h100_sxm_8x_nvswitch.json")
    n = nodes[0]
    assert topo.nvlink_islands(n) == [list(range(8))]
    assert topo.link_matrix(n)[0] == ["X"] + ["NV18"] * 7
    assert topo.expected_pair_gbps(n, 0, 7) == 450  # NVLink 4: 18 x 25 GB/s
    f = by_code(nodes)["NVLINK_DOMAIN"]
    assert f.severity == "info" and "all 8 GPUs" in f.seen and "up to 8" in f.why


def test_rtx4090_details():
    nodes, _ = load("rtx4090_4x_pcie_no_p2p.json")
    f = by_code(nodes)
    assert "6 of 6 GPU pairs" in f["NO_P2P"].seen and "GeForce" in f["NO_P2P"].fix
    assert f["PCIE_DOWNGRADED"].gpus == [3] and "x8 of x16" in f["PCIE_DOWNGRADED"].seen
    assert "64 MiB" in f["SHM_SMALL"].seen and "--shm-size" in f["SHM_SMALL"].fix
    # NCCL_P2P_DISABLE=1 is set there, and right: there is no P2P to disable
    assert nodes[0]["env"]["NCCL_P2P_DISABLE"] == "1" and "NCCL_P2P_DISABLE" not in f


def test_mixed_details_say_how_to_group():
    nodes, _ = load("a100_v100_mixed.json")
    f = by_code(nodes)
    assert "CUDA_VISIBLE_DEVICES=0,1" in f["MIXED_GPUS"].fix and "CUDA_VISIBLE_DEVICES=2,3" in f["MIXED_GPUS"].fix
    assert "no bf16" in f["MIXED_GPUS"].why  # V100
    assert "31.74 GiB" in f["UNEQUAL_MEMORY"].fix
    assert "0-2, 0-3, 1-2, 1-3" in f["NO_P2P"].seen and "socket" in f["NO_P2P"].fix
    assert "[0,1] [2] [3]" in f["NVLINK_ISLANDS"].seen and f["NVLINK_ISLANDS"].severity == "info"
    assert "within 2 GPUs" in f["NVLINK_ISLANDS"].fix
    n = nodes[0]
    assert topo.expected_pair_gbps(n, 0, 1) == 300  # NV12, NVLink 3
    assert topo.expected_pair_gbps(n, 2, 3) == pytest.approx(0.985 * 16)  # PCIe gen3 x16 under one switch
    assert topo.expected_pair_gbps(n, 0, 2) is None  # no P2P across sockets


def test_two_nodes_details():
    nodes, meas = load("two_nodes_h100_ib.json")
    f = by_code(nodes, meas)
    assert f["NCCL_IB_DISABLE"].severity == "error" and "nodes 0, 1" in f["NCCL_IB_DISABLE"].seen
    assert f["VERSION_MISMATCH"].severity == "error"
    assert "NCCL 2.20.5 (node 0) vs 2.19.3 (node 1)" in f["VERSION_MISMATCH"].seen
    assert "driver 550.54.15 (node 0) vs 535.154.05 (node 1)" in f["VERSION_MISMATCH"].seen
    assert "2.7 GB/s" in f["SLOW_INTER_NODE"].seen and "400 GB/s" in f["SLOW_INTER_NODE"].seen
    assert "nodes 0, 1" in f["NVLINK_DOMAIN"].seen  # equal nodes give one finding


def test_throttled_gpu_is_named():
    nodes, meas = load("a100_sxm_8x_one_throttled.json")
    f = by_code(nodes, meas)
    assert f["SLOW_GPU"].gpus == [5] and "63%" in f["SLOW_GPU"].seen and "hw_thermal_slowdown" in f["SLOW_GPU"].seen
    assert f["GPU_THROTTLED"].gpus == [5]
    assert sum(x.code == "SLOW_GPU" for x in diagnose(nodes, meas)) == 1  # the copy rate of GPU 5 is within 85%


def test_cpu_only_says_so_with_the_gloo_number():
    nodes, meas = load("cpu_only.json")
    (f,) = diagnose(nodes, meas)
    assert f.code == "NO_GPU" and f.severity == "warning" and "gloo all_reduce" in f.seen


def test_h200_recording():
    nodes, meas = load("h200_x2.json")
    n = nodes[0]
    assert [g["name"] for g in n["gpus"]] == ["NVIDIA H200"] * 2
    assert topo.link_matrix(n) == [["X", "NV18"], ["NV18", "X"]]
    assert n["p2p"][0][1] == "U"  # NVML does not know there; the rules take the NVLink pair as P2P-capable
    assert meas["backend"] == "nccl" and meas["errors"] == []
    assert all(r["busbw_gbps"] > 0 for rows in meas["collectives"]["intra_node"]["results"].values() for r in rows)
    assert "NO_P2P" not in codes(nodes, meas) and "NO_P2P" not in codes(nodes)


def test_p2p_disabled_on_the_h200_lowers_the_measured_bandwidth():
    nodes, normal = load("h200_x2.json")
    _, disabled = load("h200_x2_nccl_p2p_disable.json")
    base = {r["bytes"]: r["busbw_gbps"] for r in normal["collectives"]["intra_node"]["results"]["all_reduce"]}
    for r in disabled["collectives"]["intra_node"]["results"]["all_reduce"]:
        assert r["busbw_gbps"] < 0.5 * base[r["bytes"]]
    nodes, _ = load("h200_x2_nccl_p2p_disable.json")
    f = by_code(nodes, disabled)["NCCL_P2P_DISABLE"]
    assert "NV18" in f.seen and "measured all_reduce busbw" in f.seen


def test_measured_peer_access_overrides_nvml():
    nodes, _, meas = h100_measured()
    nodes[0]["p2p"][0][1] = nodes[0]["p2p"][1][0] = "U"
    meas["p2p"][0]["peer_access"] = [[None if i == j else not ({i, j} == {0, 1}) for j in range(8)] for i in range(8)]
    f = by_code(nodes, meas)["NO_P2P"]
    assert "1 of 28 GPU pairs: 0-1" in f.seen


# ---- environment mistakes, on the clean H100 node ------------------------------------------------------------

ENV_CASES = [
    ({"NCCL_P2P_DISABLE": "1"}, "NCCL_P2P_DISABLE", "warning"),
    ({"NCCL_SHM_DISABLE": "1"}, "NCCL_SHM_DISABLE", "warning"),
    ({"NCCL_IB_DISABLE": "1"}, "NCCL_IB_DISABLE", "warning"),  # one node: warning, several: error
    ({"NCCL_SOCKET_IFNAME": "lo"}, "NCCL_SOCKET_IFNAME", "warning"),
    ({"NCCL_SOCKET_IFNAME": "docker0"}, "NCCL_SOCKET_IFNAME", "warning"),
    ({"NCCL_SOCKET_IFNAME": "eth0,lo"}, "NCCL_SOCKET_IFNAME", "warning"),
    ({"NCCL_ALGO": "Tree"}, "NCCL_ALGO_FORCED", "warning"),
    ({"NCCL_PROTO": "Simple"}, "NCCL_PROTO_FORCED", "warning"),
    ({"NCCL_DEBUG": "TRACE"}, "NCCL_DEBUG_TRACE", "warning"),
    ({"CUDA_LAUNCH_BLOCKING": "1"}, "CUDA_LAUNCH_BLOCKING", "warning"),
    ({"PYTORCH_CUDA_ALLOC_CONF": ""}, "ALLOCATOR", "info"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, "ALLOCATOR", "info"),
]


@pytest.mark.parametrize("env,code,severity", ENV_CASES)
def test_environment_mistakes(env, code, severity):
    nodes, _ = load("h100_sxm_8x_nvswitch.json")
    nodes[0]["env"].update(env)
    found = by_code(nodes)
    assert code in found, found.keys()
    assert found[code].severity == severity
    assert set(found) - {code} == {"NVLINK_DOMAIN"}  # nothing else changes


@pytest.mark.parametrize("env", [
    {"NCCL_SOCKET_IFNAME": "^lo,docker"},  # exclusion: the right way to keep NCCL off them
    {"NCCL_SOCKET_IFNAME": "eth0"},
    {"NCCL_P2P_DISABLE": "0"},
    {"CUDA_LAUNCH_BLOCKING": "0"},
    {"NCCL_DEBUG": "INFO"},
    {"PYTORCH_ALLOC_CONF": "expandable_segments:True"},  # the newer name of the variable
])
def test_right_settings_are_left_alone(env):
    nodes, _ = load("h100_sxm_8x_nvswitch.json")
    nodes[0]["env"].update(env)
    assert codes(nodes) == {"NVLINK_DOMAIN"}


def test_multi_node_makes_network_mistakes_errors():
    nodes, meas = load("two_nodes_h100_ib.json")
    for n in nodes:
        n["env"]["NCCL_SOCKET_IFNAME"] = "lo"
    assert by_code(nodes, meas)["NCCL_SOCKET_IFNAME"].severity == "error"


def test_small_shm_on_a_gpu_node():
    nodes, _ = load("h100_sxm_8x_nvswitch.json")
    nodes[0]["shm_gib"] = 64 / 1024
    assert by_code(nodes)["SHM_SMALL"].severity == "warning"


# ---- measurements --------------------------------------------------------------------------------------------

def h100_measured(p2p=370.0, busbw=360.0):
    nodes, _ = load("h100_sxm_8x_nvswitch.json")
    n = nodes[0]
    meas = {"backend": "nccl", "gpus": [{"node": 0, "position": i, "cuda_index": i, "matmul_tflops": 760.0,
                                         "hbm_gbps": 2950.0} for i in range(8)],
            "p2p": [{"node": 0, "bytes": 2**29, "gbps": [[None if i == j else p2p for j in range(8)] for i in range(8)],
                     "intact": [[None if i == j else True for j in range(8)] for i in range(8)], "errors": {}}],
            "collectives": {"intra_node": {"ranks": 8, "results": {"all_reduce": [
                {"bytes": 2**30, "time_us": 1.0, "algbw_gbps": busbw / 1.75, "busbw_gbps": busbw}]}}},
            "errors": [], "skipped": []}
    return nodes, n, meas


def test_healthy_measurements_add_nothing():
    nodes, _, meas = h100_measured()
    assert codes(nodes, meas) == {"NVLINK_DOMAIN"}


def test_slow_p2p_pair_is_named_with_its_link_rate():
    nodes, _, meas = h100_measured()
    meas["p2p"][0]["gbps"][2][5] = 40.0
    f = by_code(nodes, meas)["SLOW_P2P"]
    assert "2->5 40 GB/s (NV18 should give 450, 9%)" in f.seen


def test_hung_or_corrupting_p2p_is_an_error():
    nodes, _, meas = h100_measured()
    meas["p2p"][0]["gbps"][1][3] = None
    meas["p2p"][0]["errors"] = {"1->3": "did not finish within 60 s"}
    f = by_code(nodes, meas)["P2P_BROKEN"]
    assert f.severity == "error" and "1->3: did not finish within 60 s" in f.seen
    nodes, _, meas = h100_measured()
    meas["p2p"][0]["intact"][0][1] = False
    assert "corrupted" in by_code(nodes, meas)["P2P_BROKEN"].seen


def test_p2p_disabled_shows_in_the_measured_bandwidth():
    nodes, n, meas = h100_measured(busbw=21.5)
    n["env"]["NCCL_P2P_DISABLE"] = "1"
    f = by_code(nodes, meas)
    assert "21.5 GB/s" in f["NCCL_P2P_DISABLE"].seen and "NV18" in f["NCCL_P2P_DISABLE"].seen
    assert "5% of the 450 GB/s" in f["SLOW_COLLECTIVES"].seen and "NCCL_P2P_DISABLE" in f["SLOW_COLLECTIVES"].fix


def test_broken_p2p_makes_p2p_disable_the_fix_not_a_mistake():
    nodes, n, meas = h100_measured()
    meas["p2p"][0]["errors"] = {"0->1": "did not finish within 60 s"}
    n["env"]["NCCL_P2P_DISABLE"] = "1"
    found = by_code(nodes, meas)
    assert "P2P_BROKEN" in found and "NCCL_P2P_DISABLE" not in found


def test_failed_collective_is_reported():
    nodes, _, meas = h100_measured()
    meas["errors"] = [{"what": "all_to_all 4294967296 B", "error": "did not finish within 60 s"}]
    assert by_code(nodes, meas)["MEASUREMENT_FAILED"].severity == "error"


# ---- GPU order and islands -----------------------------------------------------------------------------------

def interleaved_node(env=None):
    """4 GPUs with NVLink bridges between 0-2 and 1-3 (as some PCIe boards wire them)."""
    nodes, _ = load("a100_v100_mixed.json")
    n = nodes[0]
    for g in n["gpus"]:
        g.update(name="NVIDIA A100 80GB PCIe", memory_gib=79.15, architecture="Ampere")
    n["nvlink_counts"] = [[0, 0, 12, 0], [0, 0, 0, 12], [12, 0, 0, 0], [0, 12, 0, 0]]
    n["pcie_path"] = [["X", "PHB", "PHB", "PHB"] for _ in range(4)]
    for i in range(4):
        n["pcie_path"][i][i] = "X"
    n["p2p"] = [["X" if i == j else "OK" for j in range(4)] for i in range(4)]
    n["env"] = dict(env or {}, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    return nodes


def test_interleaved_islands_get_a_gpu_order():
    nodes = interleaved_node()
    n = nodes[0]
    assert topo.nvlink_islands(n) == [[0, 2], [1, 3]]
    assert topo.gpu_order(n) == [0, 2, 1, 3]
    f = by_code(nodes)["NVLINK_ISLANDS"]
    assert f.severity == "warning" and "CUDA_VISIBLE_DEVICES=0,2,1,3" in f.fix and "index order splits" in f.seen


def test_cuda_visible_devices_that_keeps_islands_together_is_fine():
    nodes = interleaved_node({"CUDA_VISIBLE_DEVICES": "0,2,1,3"})
    assert "CUDA_VISIBLE_DEVICES=0,2,1,3 splits" not in by_code(nodes)["NVLINK_ISLANDS"].seen
    nodes = interleaved_node({"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3 splits them" in by_code(nodes)["NVLINK_ISLANDS"].seen


def test_pcie_order_groups_gpus_under_one_switch():
    nodes, _ = load("a100_v100_mixed.json")
    n = nodes[0]
    n["nvlink_counts"] = [[0] * 4 for _ in range(4)]
    n["pcie_path"] = [["X", "SYS", "PIX", "SYS"], ["SYS", "X", "SYS", "PIX"], ["PIX", "SYS", "X", "SYS"],
                      ["SYS", "PIX", "SYS", "X"]]
    for g, numa in zip(n["gpus"], [0, 1, 0, 1]):
        g["numa_node"] = numa
    assert topo.gpu_order(n) == [0, 2, 1, 3]


# ---- document round trip and the planner's profile ----------------------------------------------------------

def test_document_round_trip():
    nodes, meas = load("two_nodes_h100_ib.json")
    findings = diagnose(nodes, meas)
    doc = json.loads(json.dumps(build_document(nodes, meas, findings)))
    assert set(doc) >= {"gpus", "topology", "measurements", "findings"}
    assert len(doc["gpus"]) == 16 and doc["topology"]["nodes"][1]["matrix"][0][1] == "NV18"
    again = nodes_from_document(doc)
    assert again == nodes


def test_profile_from_measured_machine():
    nodes, meas = load("a100_sxm_8x_one_throttled.json")
    prof = build_profile(build_document(nodes, meas, diagnose(nodes, meas)))
    assert prof["gpu_name"] == "NVIDIA A100-SXM4-80GB" and prof["memory_gib"] == 79.15
    assert (prof["gpus_per_node"], prof["nodes"]) == (8, 1)
    assert prof["matmul_tflops"] == 171.2  # the slowest GPU sets the pace
    assert prof["intra_node_busbw_gbps"] == 228.0 and prof["inter_node_busbw_gbps"] is None
    assert prof["measurements"]["busbw_gbps"]["all_reduce"] == {str(2**28): 205.0, str(2**30): 228.0}
    assert prof["gpus"][0]["spec"] == "A100-80GB" and prof["gpus"][0]["datasheet_bf16_tflops"] == 312.0
    assert prof["links"]["topology"][0]["gpu_order"] == list(range(8))


def test_profile_two_nodes_and_load(tmp_path):
    nodes, meas = load("two_nodes_h100_ib.json")
    prof = build_profile(build_document(nodes, meas, []))
    assert (prof["gpus_per_node"], prof["nodes"]) == (8, 2)
    assert prof["intra_node_busbw_gbps"] == 362.0 and prof["inter_node_busbw_gbps"] == 2.7
    assert prof["matmul_tflops"] is None  # not measured: null, never a guess
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    assert load_profile(path)["inter_node_busbw_gbps"] == 2.7
    with pytest.raises(UserError, match="no such file"):
        load_profile(tmp_path / "missing.json")
    bad = copy.deepcopy(prof)
    del bad["gpu_name"]
    path.write_text(json.dumps(bad))
    with pytest.raises(UserError, match="missing gpu_name"):
        load_profile(path)
