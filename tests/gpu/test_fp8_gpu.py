"""--fp8 on the GPU, through `paraseek train` as a user runs it: from one seeded bf16 initialization of a 7B-width
model cut to 2 blocks (every projection a real float8 GEMM), on the bundled corpus, each recipe follows the bf16
curve, and tensorwise composes with --compile and selective checkpointing. The routed experts' float8 grouped GEMM
(--fp8-experts on, Hopper): the kernel equals its CPU emulation on uneven groups, and a V2-Lite-width MoE model
trained compiled with it follows bf16.

Run on the GPU machine (compute capability 8.9+, torchao installed): `make test-gpu`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "src" / "paraseek" / "assets" / "corpus"
_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _FP8, reason="needs a GPU with float8 tensor cores")]
# 40 steps at lr 3e-4 from the same weights: float8's rounding moves the curve by well under this (TorchTitan's
# tensorwise ran 4% above its bf16 at step 30 of a 7B run at a higher lr; we measure the gap in BENCHMARKS.md).
TOLERANCE = 0.03


def _cut(tmp_path_factory, preset: str, name: str) -> Path:
    """`preset` cut to 2 layers, one seeded bf16 initialization saved as an HF folder."""
    from paraseek.models import build_model, save_pretrained
    from paraseek.models.args import ModelArgs, preset_config

    path = tmp_path_factory.mktemp("fp8") / name
    cfg = {**preset_config(preset), "num_hidden_layers": 2}
    torch.manual_seed(1234)
    save_pretrained(build_model(ModelArgs.from_hf_config(cfg), "cuda", torch.bfloat16), path)
    return path


@pytest.fixture(scope="module")
def init(tmp_path_factory) -> Path:
    return _cut(tmp_path_factory, "deepseek-llm-7b", "ds7b-2l")


@pytest.fixture(scope="module")
def moe_init(tmp_path_factory) -> Path:
    """DeepSeek-V2-Lite's widths: a dense layer, then a MoE of 64 experts 1408 wide (top-6)."""
    return _cut(tmp_path_factory, "deepseek-v2-lite", "v2lite-2l")


def _tail_loss(tmp_path: Path, init: Path, name: str, *flags: str) -> float:
    out = tmp_path / f"{name}.jsonl"
    argv = [sys.executable, "-m", "paraseek", "train", "--init-from", str(init), "--device", "cuda", "--nproc", "1",
            "--data", str(CORPUS), "--seq-len", "1024", "--global-batch-size", "4", "--steps", "40", "--lr", "3e-4",
            "--warmup-steps", "4", "--lr-schedule", "constant", "--log-every", "10", "--metrics-jsonl", str(out),
            *flags]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=600,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                                                     os.environ.get("PYTHONPATH")]))))
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in out.read_text().splitlines() if '"event"' not in line]
    assert len(losses) == 40 and losses[-1] < losses[0] - 1.0, losses  # it learns
    return sum(losses[-5:]) / 5


def test_each_recipe_follows_bf16(tmp_path, init):
    ref = _tail_loss(tmp_path, init, "bf16")
    for recipe in ("tensorwise", "rowwise", "rowwise-gw-hp"):
        got = _tail_loss(tmp_path, init, recipe, "--fp8", recipe)
        assert abs(got - ref) / ref < TOLERANCE, (recipe, got, ref)


def test_tensorwise_composes_with_compile_and_selective_checkpointing(tmp_path, init):
    ref = _tail_loss(tmp_path, init, "bf16-compiled", "--compile", "--activation-checkpointing", "selective")
    got = _tail_loss(tmp_path, init, "tensorwise-compiled", "--compile", "--activation-checkpointing", "selective",
                     "--fp8", "tensorwise")
    assert abs(got - ref) / ref < TOLERANCE, (got, ref)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layout", [["--dp-shard", "2"], ["--pp", "2"]], ids=["fsdp2-float8-all-gather", "pp2"])
def test_tensorwise_on_two_gpus_follows_bf16(tmp_path, init, layout):
    """Two ranks: the float8 all-gather with its per-step scale precompute (dp_shard 2), and the pipeline's stages
    each converted (pp 2; CPU-equal to one process through torchao's emulation: tests/dist/test_fp8_training.py)."""
    flags = ["--nproc", "2", *layout, "--compile", "--activation-checkpointing", "selective"]
    ref = _tail_loss(tmp_path, init, "bf16-2gpu", *flags)
    got = _tail_loss(tmp_path, init, "tensorwise-2gpu", *flags, "--fp8", "tensorwise")
    assert abs(got - ref) / ref < TOLERANCE, (layout, got, ref)


@pytest.mark.skipif(not _HOPPER, reason="the float8 grouped GEMM's kernels are Hopper's")
def test_fp8_grouped_mm_equals_its_emulation_on_uneven_groups(monkeypatch):
    """torch._scaled_grouped_mm through Experts (rows padded to 16 per expert, fast accumulation) against the CPU
    tests' emulation (the same float8 values and scales, fp32 GEMMs): output and every gradient."""
    from paraseek.models.deepseek import Experts

    torch.manual_seed(0)
    experts = Experts(8, 256, 128).cuda().bfloat16()
    for p in experts.parameters():
        torch.nn.init.normal_(p, 0, 0.02)
    experts.fp8 = True
    counts = torch.tensor([37, 0, 5, 130, 16, 1, 64, 47], device="cuda")  # none a multiple of 16 but two
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16)

    def run():
        x.grad = None
        for p in experts.parameters():
            p.grad = None
        y = experts(x, counts)
        y.backward(dy)
        return [y, x.grad, *(p.grad for p in experts.parameters())]

    got = run()
    monkeypatch.setenv("PARASEEK_FP8_EMULATE", "1")
    want = run()
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        assert ((g.float() - w.float()).norm() / w.float().norm()).item() < 1e-2


@pytest.mark.skipif(not _HOPPER, reason="the float8 grouped GEMM's kernels are Hopper's")
def test_fp8_experts_follow_bf16_compiled(tmp_path, moe_init):
    ref = _tail_loss(tmp_path, moe_init, "moe-bf16", "--compile")
    got = _tail_loss(tmp_path, moe_init, "moe-fp8-experts", "--compile", "--fp8", "tensorwise", "--fp8-experts", "on")
    assert got != ref and abs(got - ref) / ref < TOLERANCE, (got, ref)
