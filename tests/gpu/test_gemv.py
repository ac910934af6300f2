"""The decode GEMV kernel of paraseek.infer.gemv against a float64 product: shapes that are and are not multiples of
the tiles, with and without bias, every row count 1..16, split-K and not (its deterministic reduction), outputs and
workspaces poisoned with NaN so unwritten elements show; the config file's lookup by GPU, shape and row bucket; and
`Linear`'s dispatch (the kernel only where the file has a config, F.linear everywhere else).

Run on the GPU machine: `python3 -m pytest -q tests/gpu/test_gemv.py` (fp32, fp16 and bf16, and a CUDA-graph replay).
Without a GPU, PARASEEK_TRITON_INTERPRET=1 runs them on CPU through Triton's interpreter in fp32 and fp16:
`PARASEEK_TRITON_INTERPRET=1 PYTHONPATH=src python -m pytest -q tests/gpu/test_gemv.py`."""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

# First: it chooses CUDA or Triton's interpreter before triton is imported. reference_ops is an autouse fixture.
from triton_device import CUDA as _CUDA, DEVICE, gen as _gen, reference_ops, rel as _rel  # noqa: F401

from paraseek.infer import gemv, ops  # noqa: E402
from paraseek.infer.linear import Linear  # noqa: E402

pytestmark = pytest.mark.gpu
# The interpreter runs fp16 but not bf16 (it reads bf16 tensors' bits wrongly).
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if _CUDA else [])
# max|kernel - float64| / max|float64|: fp32 sums in a different order, then one rounding to the output dtype
# (2^-11 relative in fp16, 2^-8 in bf16, at most that much of max|y| an element).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
REPO = Path(__file__).resolve().parents[2]


def _cfg(bn, bk, split=1, warps=4, stages=2):
    return dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages)


def _operands(key, M, N, K, bias, dtype):
    g = _gen(*key)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(DEVICE, dtype)
    b = torch.randn(N, generator=g).to(DEVICE, dtype) if bias else None
    return x, w, b


def _float64(x, w, b):
    y = x.double() @ w.double().t()
    return y + b.double() if b is not None else y


@pytest.fixture
def nan_workspace(monkeypatch):
    """Split-K partials start as NaN: a partial that is read but never written poisons the output."""
    monkeypatch.setattr(gemv, "_workspace",
                        lambda s, M, N, device: torch.full((s, M, N), float("nan"), device=device))


# (M, N, K, bias, config). N and K not multiples of BLOCK_N / BLOCK_K on purpose (rows past N, masked K tails), and
# equal to them; SPLIT_K that divides K's tiles, that does not (a shorter last range), that exceeds them (fewer
# ranges), and BLOCK_K > K (one range).
CASES = [
    (1, 48, 64, False, _cfg(16, 32)),
    (1, 40, 96, True, _cfg(32, 32)),
    (3, 50, 100, True, _cfg(16, 32)),  # K % BLOCK_K = 4
    (5, 40, 100, False, _cfg(16, 32, split=3)),  # 100 = ranges of 64 + 36
    (8, 72, 160, True, _cfg(16, 32, split=4)),  # ranges of 64, 64, 32
    (16, 33, 200, True, _cfg(32, 64, split=2)),  # 200 = 128 + 72: a masked tail in the last range
    (13, 17, 48, False, _cfg(16, 16, split=16)),  # 3 tiles of K: 3 ranges
    (16, 64, 256, False, _cfg(64, 64, warps=8, stages=3)),
    (2, 24, 80, True, _cfg(16, 128, split=2)),  # BLOCK_K > K: one range, no split
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K,bias,cfg", CASES)
def test_gemv_matches_float64(M, N, K, bias, cfg, dtype, nan_workspace):
    x, w, b = _operands(("gemv", M, N, K, bias, str(cfg), str(dtype)), M, N, K, bias, dtype)
    out = torch.full((M, N), float("nan"), device=DEVICE, dtype=dtype)
    got = gemv.gemv(x, w, b, cfg, out=out)
    want = _float64(x, w, b)
    assert got is out and got.dtype == dtype
    assert torch.isfinite(got).all()  # every element written, no NaN partial read
    assert _rel(got, want) < TOL[dtype]
    assert _rel(gemv.gemv_reference(x, w, b), want) < TOL[dtype]  # the plain-torch contract, the same bound


@pytest.mark.parametrize("split", [1, 4])
def test_gemv_every_row_count(split, nan_workspace):
    """M = 1..16 rows of one shape (x's rows past M are masked off, their columns of the product never stored)."""
    N, K = 40, 96
    cfg = _cfg(16, 16, split=split)
    for M in range(1, 17):
        x, w, b = _operands(("rows", M, split), M, N, K, True, torch.float32)
        got = gemv.gemv(x, w, b, cfg, out=torch.full((M, N), float("nan"), device=DEVICE))
        assert torch.isfinite(got).all(), M
        assert _rel(got, _float64(x, w, b)) < TOL[torch.float32], M


def test_gemv_strided_x_and_out_rows_of_a_wider_buffer(nan_workspace):
    """x a column slice of a wider activation (as MLA's q_b input); out rows of a wider buffer: the columns
    around the output keep their poison, the output's own are all written."""
    M, N, K = 4, 24, 64
    x_wide, w, b = _operands(("strided",), M, N, K + 32, True, torch.float32)
    x = x_wide[:, 16:16 + K]
    w = w[:, :K].contiguous()
    buf = torch.full((M, N + 8), float("nan"), device=DEVICE)
    got = gemv.gemv(x, w, b, _cfg(16, 32, split=2), out=buf[:, 4:4 + N])
    assert torch.isfinite(got).all() and torch.isnan(buf[:, :4]).all() and torch.isnan(buf[:, 4 + N:]).all()
    assert _rel(got, _float64(x, w, b)) < TOL[torch.float32]


def test_split_k_is_deterministic():
    x, w, b = _operands(("det",), 7, 56, 192, True, torch.float32)
    cfg = _cfg(16, 32, split=3)
    first = gemv.gemv(x, w, b, cfg)
    assert all(torch.equal(first, gemv.gemv(x, w, b, cfg)) for _ in range(3))


def test_gemv_refuses_what_it_cannot_compute():
    x, w, b = _operands(("refuse",), 4, 16, 32, True, torch.float32)
    with pytest.raises(ValueError, match="at most 16"):
        gemv.gemv(torch.zeros(17, 32, device=DEVICE), w, b, _cfg(16, 16))
    with pytest.raises(ValueError, match="share a dtype"):
        gemv.gemv(x.half(), w, b, _cfg(16, 16))
    with pytest.raises(ValueError, match="row-major"):
        gemv.gemv(x, torch.zeros(32, 16, device=DEVICE).t(), b, _cfg(16, 16))
    with pytest.raises(ValueError, match="BLOCK_N=24"):
        gemv.gemv(x, w, b, _cfg(24, 16))
    with pytest.raises(ValueError, match="lacks SPLIT_K"):
        gemv.gemv(x, w, b, dict(BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=2))


def test_split_k_ranges_cover_k_without_empty_ranges():
    for K in (1, 15, 16, 100, 4096, 10944):
        for bk in (16, 128, 512):
            for s in (1, 2, 3, 8, 16):
                k_split, ranges = gemv.split_k_ranges(K, bk, s)
                assert k_split % bk == 0 and 1 <= ranges <= s
                assert (ranges - 1) * k_split < K <= ranges * k_split  # the last range holds at least one element


# ---- config file and dispatch ---------------------------------------------------------------------------------------
GPU = gemv.device_name(torch.device(DEVICE))
CFG_1, CFG_4 = _cfg(16, 32), _cfg(32, 32, split=2)


@pytest.fixture
def table(monkeypatch):
    """A config file with configs on this device for W [40, 96], row buckets 1 and 4 only."""
    data = {GPU: {gemv.config_key(40, 96): {"source": "test", "configs": {"1": CFG_1, "4": CFG_4}}},
            "Another GPU": {gemv.config_key(40, 64): {"source": "test", "configs": {"1": CFG_1}}}}
    gemv.gemv_config.cache_clear()
    monkeypatch.setattr(gemv, "_config_file", lambda: data)
    yield data
    gemv.gemv_config.cache_clear()


def test_config_lookup_by_gpu_shape_and_row_bucket(table):
    assert gemv.gemv_config(GPU, 40, 96, 1) == CFG_1
    assert gemv.gemv_config(GPU, 40, 96, 2) is None  # bucket 2 not listed: cuBLAS there
    assert gemv.gemv_config(GPU, 40, 96, 3) == CFG_4 and gemv.gemv_config(GPU, 40, 96, 4) == CFG_4
    assert gemv.gemv_config(GPU, 40, 96, 5) is None  # bucket 8
    assert gemv.gemv_config(GPU, 40, 96, 17) is None and gemv.gemv_config(GPU, 40, 96, 0) is None
    assert gemv.gemv_config(GPU, 96, 40, 1) is None  # another shape
    assert gemv.gemv_config(GPU, 40, 64, 1) is None  # measured on another GPU only
    assert gemv.gemv_config("Another GPU", 40, 64, 1) == CFG_1


class _Spy:
    def __init__(self):
        self.configs = []

    def __call__(self, x, w, b, cfg, out=None):
        self.configs.append(cfg)
        return _REAL_GEMV(x, w, b, cfg, out)


_REAL_GEMV = gemv.gemv


@pytest.fixture
def spy(monkeypatch):
    s = _Spy()
    monkeypatch.setattr(gemv, "gemv", s)
    return s


@pytest.mark.parametrize("M,want", [(1, CFG_1), (3, CFG_4), (4, CFG_4)])
def test_linear_runs_the_kernel_where_the_file_has_a_config(M, want, table, spy, nan_workspace):
    x, w, b = _operands(("dispatch", M), M, 40, 96, True, torch.float16)
    ops.use_kernels(True)
    got = Linear(w, b)(x)
    assert spy.configs == [want]
    assert got.dtype == torch.float16 and _rel(got, _float64(x, w, b)) < TOL[torch.float16]


def _f_linear_cases():
    x, w, b = _operands(("fallback",), 17, 40, 96, True, torch.float16)
    x2 = x[:2]
    return {
        "no config for the shape": (x2, w[:39], b[:39], True),
        "no config for the row bucket": (x2, w, b, True),  # M = 2: bucket 2 is not listed
        "more than 16 rows": (x, w, b, True),
        "3-D x": (x2[:1].unsqueeze(0), w, b, True),
        "fp32 (configs are measured for 2-byte dtypes)": (x[:1].float(), w.float(), b.float(), True),
        "W not row-major": (x[:1], w.t().contiguous().t(), b, True),
        "kernels off": (x[:1], w, b, False),
    }


@pytest.mark.parametrize("case", list(_f_linear_cases()))
def test_linear_keeps_f_linear_everywhere_else(case, table, spy):
    x, w, b, kernels = _f_linear_cases()[case]
    ops.use_kernels(kernels)
    got = Linear(w, b)(x)
    assert spy.configs == []
    assert torch.equal(got, F.linear(x, w, b))


def test_packaged_config_file_is_well_formed():
    """gemv_configs.json (shipped as package data): GPU -> "N=..,K=.." -> source and configs by row bucket, each config valid,
    and the file is what format_config_file writes for its own contents."""
    text = gemv.CONFIG_FILE.read_text()
    data = json.loads(text)
    assert isinstance(data, dict)
    for gpu_name, shapes in data.items():
        for key, entry in shapes.items():
            N, K = (int(part.split("=")[1]) for part in key.split(","))
            assert key == gemv.config_key(N, K) and entry["source"]
            for bucket, cfg in entry["configs"].items():
                assert int(bucket) in gemv.M_BUCKETS
                assert gemv.check_config(cfg) == cfg
    assert gemv.format_config_file(data) == text
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert gemv.CONFIG_FILE.name in pyproject["tool"]["setuptools"]["package-data"]["paraseek.infer"]
    sample = {"GPU A": {gemv.config_key(8, 16): {"source": "s", "configs": {"16": CFG_4, "2": CFG_1}}}}
    assert json.loads(gemv.format_config_file(sample)) == sample


def test_bench_script_dry_run_tunes_and_writes(tmp_path):
    """scripts/gpu/bench_gemv.py's plumbing on CPU: tiny shapes through the interpreter, --tune --write into a
    scratch config file, which the lookup then reads."""
    if _CUDA:
        pytest.skip("the dry run is the CPU path; on the GPU run the script itself")
    out = tmp_path / "gemv_configs.json"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.run([sys.executable, str(REPO / "scripts/gpu/bench_gemv.py"), "--dry-run", "--tune", "--write",
                           "--config-file", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| model |" in proc.stdout
    data = json.loads(out.read_text())
    assert gemv.format_config_file(data) == out.read_text()
    for shapes in data.values():
        for entry in shapes.values():
            for cfg in entry["configs"].values():
                gemv.check_config(cfg)


def test_gemv_cuda_graph_replays_on_new_inputs():
    """Capture a split-K product once, then change x in place: each replay matches the float64 product of the new
    x (the grid and the workspace depend on shapes only)."""
    if not _CUDA:
        pytest.skip("CUDA graphs need a GPU; the interpreter path has none")
    dtype, M, N, K = torch.bfloat16, 8, 2112, 7168
    x, w, b = _operands(("graph",), M, N, K, True, dtype)
    cfg = _cfg(32, 256, split=8, warps=4, stages=4)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and load the kernels before the capture
        gemv.gemv(x, w, b, cfg)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.gemv(x, w, b, cfg)
    for seed in (1, 2):
        new = _operands(("graph", seed), M, N, K, False, dtype)[0]
        x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, _float64(new, w, b)) < TOL[dtype]
