"""Datasheet numbers of the GPUs the planner knows without a measured profile.

Peaks are dense (no 2:4 sparsity) tensor-core rates; bandwidths are per direction per GPU, in GB/s (1e9 B/s).
`nvlink_gbps` 0 means no NVLink (PCIe only). MFU is quoted against `bf16_tflops`, as the peers do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from paraseek.errors import UserError


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_gib: float  # usable HBM/GDDR as the driver reports it, GiB
    bf16_tflops: float  # dense bf16 tensor-core peak (fp16 where the GPU has no bf16)
    fp16_tflops: float
    hbm_gbps: float  # memory bandwidth, GB/s
    nvlink_gbps: float  # NVLink bandwidth per GPU per direction, GB/s (0 = none)
    pcie_gbps: float  # PCIe bandwidth per direction, GB/s
    host_memory_gib: float  # typical host memory of a node of these GPUs (for offload planning)
    has_bf16: bool = True
    has_fp8: bool = False  # float8 tensor cores (compute capability 8.9+: Ada, Hopper): --fp8 runs
    hopper: bool = False  # compute capability 9.0: torch._scaled_grouped_mm's float8 kernels, --fp8-experts runs


GPU_SPECS: dict[str, GPUSpec] = {
    s.name: s
    for s in [
        # H100 SXM5, NVLink4 18 links
        GPUSpec("H100", 79.6, 989.0, 989.0, 3350, 450, 64, 2048, has_fp8=True, hopper=True),
        GPUSpec("H100-PCIe", 79.6, 756.0, 756.0, 2000, 0, 64, 1024, has_fp8=True, hopper=True),
        GPUSpec("H200", 140.4, 989.0, 989.0, 4800, 450, 64, 2048, has_fp8=True, hopper=True),
        # export variant: NVLink 400 GB/s bidirectional
        GPUSpec("H800", 79.6, 989.0, 989.0, 3350, 200, 64, 2048, has_fp8=True, hopper=True),
        GPUSpec("H20", 95.6, 148.0, 148.0, 4000, 450, 64, 2048, has_fp8=True, hopper=True),
        GPUSpec("A100-40GB", 39.4, 312.0, 312.0, 1555, 300, 32, 1024),
        # DGX A100 640GB: 8 x A100-80GB with 2 TB of system memory (the 320GB model, of 40GB cards: 1 TB)
        GPUSpec("A100-80GB", 79.1, 312.0, 312.0, 2039, 300, 32, 2048),
        GPUSpec("A800", 79.1, 312.0, 312.0, 2039, 200, 32, 1024),
        GPUSpec("L40S", 44.4, 362.0, 362.0, 864, 0, 32, 512, has_fp8=True),
        GPUSpec("RTX4090", 23.6, 165.0, 165.0, 1008, 0, 32, 256, has_fp8=True),  # 4th-gen tensor cores, fp32 accumulate
        # No bf16 tensor cores (sm70 / sm75): fp16 compute with dynamic loss scaling; "bf16_tflops" is the fp16 rate.
        GPUSpec("V100-32GB", 31.7, 125.0, 125.0, 900, 150, 16, 512, has_bf16=False),  # SXM2, NVLink2 6 links
        GPUSpec("V100-16GB", 15.8, 125.0, 125.0, 900, 150, 16, 512, has_bf16=False),
        GPUSpec("T4", 15.0, 65.0, 65.0, 320, 0, 16, 256, has_bf16=False),  # 70 W PCIe card, GDDR6
    ]
}
# Names that stand for one of the types above; the planner says which it took (resolve_gpu_type).
ALIASES = {"V100": ("V100-32GB", "--gpu-type V100 taken as V100-32GB; use V100-16GB for the 16 GB card")}


def resolve_gpu_type(name: str) -> tuple[GPUSpec, str]:
    """(spec, note) of a planner GPU type name (case-insensitive): the note says which type an alias was taken as
    ("" for an exact name)."""
    for key, spec in GPU_SPECS.items():
        if key.lower() == name.lower():
            return spec, ""
    for key, (target, note) in ALIASES.items():
        if key.lower() == name.lower():
            return GPU_SPECS[target], note
    raise UserError(f"unknown GPU type {name!r}; known: {', '.join([*GPU_SPECS, *ALIASES])} (or pass --hardware "
                    "PROFILE.json)")


def gpu_spec(name: str) -> GPUSpec:
    """Look a GPU type up by its planner name (case-insensitive), aliases included."""
    return resolve_gpu_type(name)[0]


def spec_for_device_name(device_name: str) -> GPUSpec | None:
    """Map a CUDA device name (torch.cuda.get_device_name, NVML) to a spec, or None if unknown."""
    n = device_name.upper().replace("NVIDIA", "").strip()
    if "H200" in n:
        return GPU_SPECS["H200"]
    if "H800" in n:
        return GPU_SPECS["H800"]
    if "H20" in n and "H200" not in n:
        return GPU_SPECS["H20"]
    if "H100" in n:
        return GPU_SPECS["H100-PCIe"] if "PCIE" in n else GPU_SPECS["H100"]
    if "A800" in n:
        return GPU_SPECS["A800"]
    if "A100" in n:
        return GPU_SPECS["A100-40GB"] if "40GB" in n else GPU_SPECS["A100-80GB"]
    if "L40S" in n:
        return GPU_SPECS["L40S"]
    if "4090" in n:
        return GPU_SPECS["RTX4090"]
    if "V100" in n:
        return GPU_SPECS["V100-16GB"] if "16GB" in n else GPU_SPECS["V100-32GB"]
    if re.search(r"\bT4\b", n):
        return GPU_SPECS["T4"]
    return None


def peak_flops(device_name: str, dtype: str = "bf16") -> float | None:
    """Datasheet dense peak in FLOP/s for MFU, or None (CPU, unknown GPU)."""
    spec = spec_for_device_name(device_name)
    if spec is None:
        return None
    return (spec.fp16_tflops if dtype == "fp16" else spec.bf16_tflops) * 1e12
