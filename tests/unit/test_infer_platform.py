"""The engine's kernels and dtype by compute capability (infer/platform.py), with the capability faked on CPU: each
GPU the engine supports gets the path its hardware can run, the choice is one printed line, and a dtype the GPU
cannot compute in is refused in one line."""

import pytest
import torch

from paraseek.errors import UserError
from paraseek.infer import model as infer_model
from paraseek.infer.platform import for_capability, for_device

GPUS = {  # name, capability -> dtype, Triton kernels, FlashAttention-2, grouped GEMM, CUDA graphs
    ("Tesla V100-SXM2-32GB", (7, 0)): (torch.float16, False, False, False, False),
    ("Tesla T4", (7, 5)): (torch.float16, False, False, False, False),
    ("NVIDIA A100-SXM4-80GB", (8, 0)): (torch.bfloat16, True, True, False, True),
    ("NVIDIA L40S", (8, 9)): (torch.bfloat16, True, True, False, True),
    ("NVIDIA H100 80GB HBM3", (9, 0)): (torch.bfloat16, True, True, True, True),
    ("NVIDIA H200", (9, 0)): (torch.bfloat16, True, True, True, True),
}


@pytest.mark.parametrize("gpu", sorted(GPUS), ids=[n for n, _ in sorted(GPUS)])
def test_each_gpu_gets_the_path_its_hardware_runs(gpu, monkeypatch):
    name, cc = gpu
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    p = for_device("cuda")
    assert (p.dtype, p.triton_kernels, p.flash_prefill, p.grouped_gemm, p.cuda_graphs) == GPUS[gpu]
    line = p.line()
    assert line.startswith(f"platform: {name} (sm{cc[0]}{cc[1]}): ") and "\n" not in line
    assert str(p.dtype).removeprefix("torch.") in line


def test_cpu_is_fp32_plain_torch_and_eager():
    p = for_device("cpu")
    assert p.capability is None and p.dtype == torch.float32
    assert not (p.triton_kernels or p.flash_prefill or p.grouped_gemm or p.cuda_graphs)


@pytest.mark.parametrize("cc", [(7, 0), (7, 5)])
def test_bf16_refused_where_the_gpu_has_none(cc):
    p = for_capability(cc, "old GPU")
    with pytest.raises(UserError, match="no bfloat16.*--dtype float16"):
        p.check_dtype(torch.bfloat16)
    p.check_dtype(torch.float16)
    for_capability((8, 0), "A100").check_dtype(torch.bfloat16)


def test_moe_path_by_platform():
    """Hopper: the fused kernels up to the crossover, the grouped GEMM beyond; other kernel-capable GPUs: fused at
    every size (their grouped form would be a per-expert loop with a host sync); without kernels: grouped."""
    big = infer_model.FUSED_MAX_SLOTS + 1
    assert infer_model.moe_path(8, kernels=True, grouped_gemm=True) == "fused"
    assert infer_model.moe_path(big, kernels=True, grouped_gemm=True) == "grouped"
    assert infer_model.moe_path(big, kernels=True, grouped_gemm=False) == "fused"
    assert infer_model.moe_path(8, kernels=False, grouped_gemm=False) == "grouped"


def test_the_planners_decode_partitions_are_the_kernels():
    """plan --mode infer sizes the decode kernels' split-KV workspace with infer/kernels.py's partitioning constants
    (copied: the planner does not import Triton)."""
    pytest.importorskip("triton")
    from paraseek.infer import kernels
    from paraseek.planner import infer as planner_infer

    assert (planner_infer.DECODE_PARTITION, planner_infer.DECODE_MAX_PARTITIONS, planner_infer.DECODE_SHORT_PARTITION,
            planner_infer.DECODE_SHORT_CONTEXT) == (kernels.PARTITION, kernels.MAX_PARTITIONS, kernels.SHORT_PARTITION,
                                                    kernels.SHORT_CONTEXT)
