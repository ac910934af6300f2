"""The engine with FP8 blocks kept, on a GPU with FP8 (sm89+): the V3-shaped FP8 folder of tests/fp8_models.py served
through the GPU's FP8 GEMMs and fused-MoE kernels against the CPU's plain-torch reference of the same math (fp32
activations), CUDA-graph replays against eager steps, and bf16 FP8 against the dequantized checkpoint in bf16.

On the GPU machine: `python3 -m pytest -q -m gpu tests/gpu/test_fp8_engine_gpu.py`."""

import json

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a GPU with FP8 tensor cores (sm89+)", allow_module_level=True)

from fp8_models import TINY_V3, prompts, write_fp8, write_source  # noqa: E402
from paraseek.infer.engine import Engine, EngineConfig  # noqa: E402
from paraseek.infer.model import InferenceModel  # noqa: E402
from paraseek.infer.sampling import SamplingParams  # noqa: E402
from paraseek.models import ModelArgs  # noqa: E402

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp8gpu")
    return write_fp8(write_source(tmp / "source", TINY_V3), tmp / "fp8")


def _engine(folder, device, dtype, fp8=True, eager=False) -> Engine:
    args = ModelArgs.from_hf_config(json.loads((folder / "config.json").read_text()))
    model = InferenceModel.from_folder(folder, args, dtype=dtype, device=device, block=(128, 128), fp8=fp8)
    return Engine(model, EngineConfig(block_size=16, num_kv_blocks=256, max_batched_tokens=128, enforce_eager=eager),
                  log=lambda *_: None)


def _same_until_unclear(ref, got, margin: float, tol: float) -> None:
    """Tokens equal up to the first step the reference chose by less than `margin`; log-probabilities within tol."""
    for a, b in zip(ref, got, strict=True):
        gaps = [top[0][1] - top[1][1] for top in a.top_logprobs]
        n = next((t for t, gap in enumerate(gaps) if gap < margin), len(gaps))
        assert n >= len(gaps) // 2
        assert a.output_ids[:n + 1] == b.output_ids[:n + 1]
        for top_a, top_b in zip(a.top_logprobs[:n + 1], b.top_logprobs[:n + 1]):
            mine = dict(top_b)
            assert max(abs(x - mine[t]) for t, x in top_a if t in mine) < tol


def test_fp8_on_the_gpu_matches_the_cpu_reference(folder):
    """fp32 activations on both: the same quantization and sums, in another order (an activation an ulp from an e4m3
    boundary may round the other way: log-probabilities within 1e-2)."""
    ps = prompts()
    cpu = _engine(folder, "cpu", torch.float32)
    ref = cpu.generate(ps, GREEDY)
    gpu = _engine(folder, "cuda", torch.float32)  # the engine turns the Triton kernels on
    assert "FP8" in gpu.runner.model.weights
    _same_until_unclear(ref, gpu.generate(ps, GREEDY), 0.02, 1e-2)


def test_fp8_cuda_graphs_equal_eager_steps(folder):
    ps = prompts()
    eager = _engine(folder, "cuda", torch.bfloat16, eager=True).generate(ps, GREEDY)
    graphs = _engine(folder, "cuda", torch.bfloat16).generate(ps, GREEDY)
    assert [r.output_ids for r in eager] == [r.output_ids for r in graphs]


def test_fp8_bf16_against_the_dequantized_checkpoint_in_bf16(folder):
    """bf16 both ways: FP8's activation rounding plus bf16's (tests/unit/test_fp8_infer.py measures FP8 alone)."""
    ps = prompts()
    ref = _engine(folder, "cuda", torch.bfloat16, fp8=False).generate(ps, GREEDY)
    _same_until_unclear(ref, _engine(folder, "cuda", torch.bfloat16).generate(ps, GREEDY), 0.3, 0.5)
