"""Expert-parallel serving on 2 GPUs (NCCL, Triton kernels, CUDA graphs): the V3-shaped model of tests/fp8_models.py
under --ep 2 and --tp 2 --ep 2 against one GPU, in bf16 (fused-MoE kernels, decode steps captured in CUDA graphs
with the all-reduce inside) and with the FP8 folder's blocks kept (FP8 fused-MoE kernels). The ranks' partial sums
add in another order than one GPU's slot sums, so tokens are compared up to the first step one GPU chose by a
small margin, log-probabilities within bf16's (FP8's) rounding. `--ep 2 --dp-attention` too: each rank its own
prompts (4 and 2, the second rank idle for most steps), the MoE layers' all-gather and reduce-scatter captured in
the decode graphs, a padding graph replayed by the idle rank.

On the GPU machine: `PYTHONPATH=src python3 -m pytest -q -m gpu tests/gpu/test_infer_ep_gpu.py`."""

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 GPUs (expert parallelism over 2 ranks)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
from dist_helpers import spawn  # noqa: E402
from fp8_models import TINY_V3, prompts, write_fp8, write_source  # noqa: E402

V3 = dict(TINY_V3, num_nextn_predict_layers=0)


def _engine(folder: str, device, dtype, group=None, fp8=False, meta=None, **layout):
    from paraseek.infer.engine import Engine, EngineConfig
    from paraseek.infer.model import InferenceModel
    from paraseek.models import ModelArgs

    args = ModelArgs.from_hf_config(json.loads((Path(folder) / "config.json").read_text()))
    block = (128, 128) if fp8 else None
    model = InferenceModel.from_folder(Path(folder), args, group, dtype=dtype, device=device, block=block, fp8=fp8,
                                       **layout)
    return Engine(model, EngineConfig(block_size=16, num_kv_blocks=256, max_batched_tokens=128), tp_group=group,
                  meta_group=meta, log=lambda *_: None)


def _outputs(engine) -> list[dict]:
    from paraseek.infer.sampling import SamplingParams

    reqs = engine.generate(prompts(), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=5))
    return [{"tokens": r.output_ids, "top": r.top_logprobs} for r in reqs]


def _replica(rank: int, world: int, folder: str, fp8: bool, layout: dict, device: str) -> dict:
    import torch.distributed as dist

    from paraseek.infer.engine import serve_worker

    meta = dist.new_group(backend="gloo")  # the driver's step broadcast goes over gloo (host tensors), as the CLI's
    engine = _engine(folder, f"cuda:{rank}", torch.bfloat16, dist.group.WORLD, fp8, meta, **layout)
    out = {"graphs": len(engine.runner.graphs)}
    if rank == 0:
        out["outputs"] = _outputs(engine)
        engine.shutdown()
    else:
        serve_worker(engine.runner, meta)
    return out


def _same_until_unclear(ref: list[dict], got: list[dict], margin: float, tol: float) -> None:
    for a, b in zip(ref, got, strict=True):
        gaps = [top[0][1] - top[1][1] for top in a["top"]]
        n = next((t for t, gap in enumerate(gaps) if gap < margin), len(gaps))
        assert n >= len(gaps) // 2
        assert a["tokens"][:n + 1] == b["tokens"][:n + 1]
        for top_a, top_b in zip(a["top"][:n + 1], b["top"][:n + 1]):
            mine = dict(top_b)
            assert max(abs(x - mine[t]) for t, x in top_a if t in mine) < tol


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("epgpu")
    src = write_source(tmp / "source", V3)
    return {"bf16": src, "fp8": write_fp8(src, tmp / "fp8")}


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("layout", [{"ep": 2, "tp": 1}, {"ep": 2, "tp": 2}], ids=["ep2", "tp2-ep2"])
def test_ep2_on_two_gpus_matches_one_gpu(fmt, layout, folders, tmp_path):
    fp8 = fmt == "fp8"
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 blocks kept need FP8 tensor cores (sm89+)")
    one = _outputs(_engine(str(folders[fmt]), "cuda", torch.bfloat16, fp8=fp8))
    ranks = spawn(_replica, 2, tmp_path, folder=str(folders[fmt]), fp8=fp8, layout=layout, device="cuda")
    assert all(r["graphs"] for r in ranks)  # decode ran through CUDA graphs with the all-reduce captured
    _same_until_unclear(one, ranks[0]["outputs"], 0.05, 5e-2)


def _dp_attention_rank(rank: int, world: int, folder: str, device: str) -> dict:
    """This rank's engine over its own prompts (rank 0: four of 20 tokens, rank 1: two of 4), under dp-attention."""
    import torch.distributed as dist

    from paraseek.infer.engine import Engine, EngineConfig
    from paraseek.infer.model import InferenceModel
    from paraseek.infer.sampling import SamplingParams
    from paraseek.models import ModelArgs

    args = ModelArgs.from_hf_config(json.loads((Path(folder) / "config.json").read_text()))
    model = InferenceModel.from_folder(Path(folder), args, dist.group.WORLD, dtype=torch.bfloat16,
                                       device=f"cuda:{rank}", ep=2, tp=1, dp_attention=True)
    engine = Engine(model, EngineConfig(block_size=16, num_kv_blocks=256, max_batched_tokens=128),
                    dp_group=dist.new_group(backend="gloo"), log=lambda *_: None)
    mine = [0, 1, 2, 4] if rank == 0 else [3, 5]
    n = 20 if rank == 0 else 4
    reqs = engine.generate([prompts()[i] for i in mine],
                           SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=5))
    return {"index": mine, "graphs": len(engine.runner.graphs),
            "outputs": [{"tokens": r.output_ids, "top": r.top_logprobs} for r in reqs]}


def test_ep2_dp_attention_on_two_gpus_matches_one_gpu(folders, tmp_path):
    one = _outputs(_engine(str(folders["bf16"]), "cuda", torch.bfloat16))
    ranks = spawn(_dp_attention_rank, 2, tmp_path, folder=str(folders["bf16"]), device="cuda")
    for r in ranks:
        assert r["graphs"]  # the gather and the reduce-scatter captured in the decode graphs
        n = len(r["outputs"][0]["tokens"])
        cut = [{"tokens": one[i]["tokens"][:n], "top": one[i]["top"][:n]} for i in r["index"]]
        _same_until_unclear(cut, r["outputs"], 0.05, 5e-2)
