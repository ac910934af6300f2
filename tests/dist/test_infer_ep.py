"""Expert-parallel serving on gloo (infer/ep.py): a tiny V3-shaped model (MLA, noaux_tc routing with groups and a
bias, a shared expert, 8 routed experts), fp32, two processes. `--ep 2` (attention replicated) and `--tp 2 --ep 2`
(attention by heads) give one process's greedy tokens and log-probabilities within 1e-4; each rank holds, and
reads from the safetensors, only its 4 routed experts; an FP8 block-quantized folder (scripts/write_fp8_checkpoint.py)
loads sharded under --ep 2 and gives one process's tokens of the same folder dequantized. `--ep 2 --dp-attention`
(each rank its own requests and cache, the MoE layers shared) gives them too, with the ranks running different
numbers of requests, each rank's pool holding its own requests' blocks only. The CLI refuses what cannot be split,
in one line, before any weight is read."""

from pathlib import Path

import pytest
import torch

from dist_helpers import SRC, spawn
from fp8_models import TINY_V3, prompts, write_fp8, write_source

pytestmark = pytest.mark.dist

# One MTP-free copy of TINY_V3: the drafter's layer is not what these tests measure.
V3 = dict(TINY_V3, num_nextn_predict_layers=0)
E = V3["n_routed_experts"]
MOE_LAYERS = V3["num_hidden_layers"] - V3["first_k_dense_replace"]


def _engine(model, tp_group=None):
    from paraseek.infer.config import EngineConfig
    from paraseek.infer.engine import Engine

    cfg = EngineConfig(block_size=8, max_batched_tokens=32, max_num_seqs=8, max_model_len=96, num_kv_blocks=96)
    return Engine(model, cfg, tp_group=tp_group, meta_group=tp_group, log=lambda *a, **k: None)


def _generate(engine) -> list[dict]:
    from paraseek.infer.sampling import SamplingParams

    reqs = engine.generate(prompts(4), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5))
    return [{"tokens": r.output_ids, "top": r.top_logprobs} for r in reqs]


def _load(folder: str, tp_group=None, **layout):
    from paraseek.infer.model import InferenceModel
    from paraseek.models.args import ModelArgs, read_hf_config
    from paraseek.models.hf import fp8_block_size

    cfg = read_hf_config(folder)
    return InferenceModel.from_folder(Path(folder), ModelArgs.from_hf_config(cfg), tp_group, dtype=torch.float32,
                                      device="cpu", block=fp8_block_size(cfg, folder), **layout)


def _run(rank: int, world: int, runs: list[tuple[str, dict]]) -> list[dict]:
    """Each run: this rank's model of the folder with the layout, the experts it read and holds, and on rank 0 the
    replica's outputs (rank 1 runs the steps rank 0 broadcasts)."""
    import torch.distributed as dist

    from paraseek.infer.engine import serve_worker
    from paraseek.infer.model import MoELayer
    from paraseek.infer.weights import FolderWeights

    read_names: set[str] = set()
    plain_read = FolderWeights.read

    def read(self, name, *a, **k):
        read_names.add(name)
        return plain_read(self, name, *a, **k)

    FolderWeights.read = read
    out = []
    for folder, layout in runs:
        read_names.clear()
        model = _load(folder, dist.group.WORLD, **layout)
        experts_read = sorted({int(n.split(".")[4]) for n in read_names if ".mlp.experts." in n})
        moe = [L.mlp for L in model.layers if isinstance(L.mlp, MoELayer)]
        held = {"experts_read": experts_read, "w13": [m.w13_EXD.clone() for m in moe],
                "w13_scale": [m.w13_scale for m in moe], "first": [m.expert_first for m in moe]}
        engine = _engine(model, dist.group.WORLD)
        if rank == 0:
            held["outputs"] = _generate(engine)
            engine.shutdown()
        else:
            serve_worker(engine.runner, dist.group.WORLD)
        out.append(held)
    return out


def _assert_same(one: list[dict], two: list[dict]) -> None:
    for a, b in zip(one, two, strict=True):
        assert a["tokens"] == b["tokens"]
        for top_a, top_b in zip(a["top"], b["top"], strict=True):
            assert [t for t, _ in top_a] == [t for t, _ in top_b]
            assert max(abs(x - y) for (_, x), (_, y) in zip(top_a, top_b)) < 1e-4


@pytest.fixture(scope="module")
def v3_folder(tmp_path_factory) -> Path:
    return write_source(tmp_path_factory.mktemp("v3") / "source", V3)


def test_ep2_and_tp2_ep2_equal_one_process_each_rank_holding_its_experts(v3_folder, tmp_path):
    src = v3_folder
    fp8 = write_fp8(src, tmp_path / "fp8")
    ranks = spawn(_run, 2, tmp_path, runs=[(str(src), {"ep": 2, "tp": 1}), (str(src), {"ep": 2, "tp": 2}),
                                           (str(fp8), {"ep": 2, "tp": 1})])
    from paraseek.infer.model import MoELayer

    one = _load(str(src))
    whole_w13 = [L.mlp.w13_EXD for L in one.layers if isinstance(L.mlp, MoELayer)]
    one_out = _generate(_engine(one))
    fp8_out = _generate(_engine(_load(str(fp8))))  # one process, the FP8 folder dequantized

    for run, want in zip(range(3), (one_out, one_out, fp8_out)):
        _assert_same(want, ranks[0][run]["outputs"])
        for r in (0, 1):
            held = ranks[r][run]
            mine = list(range(r * E // 2, (r + 1) * E // 2))
            assert held["experts_read"] == mine  # the safetensors' other experts never read
            assert held["first"] == [mine[0]] * MOE_LAYERS
            # Its experts' weights and no other: E / 2 whole experts (the shared one is a separate MLP under ep).
            assert [tuple(w.shape) for w in held["w13"]] == [(E // 2, *whole.shape[1:]) for whole in whole_w13]
            if run < 2:
                for w, whole in zip(held["w13"], whole_w13):
                    assert torch.equal(w, whole[mine[0]:mine[-1] + 1])
            else:  # the checkpoint's FP8 blocks, dequantized on load (the CPU keeps no FP8 weights)
                assert all(s is None for s in held["w13_scale"])


# dp-attention: prompt i runs on rank SPLIT[i] with MAX_NEW[i] new tokens -- four requests on rank 0, two short ones
# on rank 1, which then runs padding steps while rank 0 still prefills and decodes.
SPLIT = [0, 0, 0, 1, 0, 1]
MAX_NEW = [8, 8, 8, 3, 8, 2]


def _dp_params():
    from paraseek.infer.sampling import SamplingParams

    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=5) for n in MAX_NEW]


def _watch_blocks(engine) -> dict:
    """After every step: the blocks the pool has handed out, and the distinct blocks of this engine's running
    requests (they must be equal: nothing else is cached), and the most blocks used at once."""
    seen = {"steps": [], "peak": 0}
    plain_step = engine.step

    def step():
        out = plain_step()
        mine = {b for r in engine.scheduler.running for b in r.blocks}
        seen["steps"].append((engine.pool.num_used, len(mine)))
        seen["peak"] = max(seen["peak"], engine.pool.num_used)
        return out

    engine.step = step
    return seen


def _run_dp_attention(rank: int, world: int, folder: str) -> dict:
    """This rank's engine over its own prompts (SPLIT), its MoE layers shared with the other rank's."""
    import torch.distributed as dist

    model = _load(folder, dist.group.WORLD, ep=2, tp=1, dp_attention=True)
    from paraseek.infer.config import EngineConfig
    from paraseek.infer.engine import Engine

    cfg = EngineConfig(block_size=8, max_batched_tokens=32, max_num_seqs=8, max_model_len=96, num_kv_blocks=96)
    engine = Engine(model, cfg, dp_group=dist.group.WORLD, log=lambda *a, **k: None)
    agreed = []  # (this rank's tokens, the step's agreed rows) of every step
    plain_agree = engine._agree

    def agree(tokens, eager):
        rows, any_eager = plain_agree(tokens, eager)
        agreed.append((tokens, rows))
        return rows, any_eager

    engine._agree = agree
    blocks = _watch_blocks(engine)
    mine = [i for i, r in enumerate(SPLIT) if r == rank]
    params = _dp_params()
    reqs = engine.generate([prompts(6)[i] for i in mine], [params[i] for i in mine], ids=[f"p{i}" for i in mine])
    return {"index": mine, "outputs": [{"tokens": r.output_ids, "top": r.top_logprobs} for r in reqs],
            "agreed": agreed, "blocks": blocks, "report": engine.report.line()}


def test_ep2_dp_attention_equals_one_process_each_rank_caching_its_own_requests(v3_folder, tmp_path):
    """`--ep 2 --dp-attention` at the engine: the two ranks run different numbers of requests (4 and 2, rank 1 idle
    for most steps) and give one process's greedy tokens and log-probabilities; each rank's pool holds exactly its
    running requests' blocks, fewer than one engine caching every request."""
    ranks = spawn(_run_dp_attention, 2, tmp_path, folder=str(v3_folder))
    one = _engine(_load(str(v3_folder)))
    one_blocks = _watch_blocks(one)
    reqs = one.generate(prompts(6), _dp_params())
    want = [{"tokens": r.output_ids, "top": r.top_logprobs} for r in reqs]

    for r, got in enumerate(ranks):
        assert got["index"] == [i for i, x in enumerate(SPLIT) if x == r]
        _assert_same([want[i] for i in got["index"]], got["outputs"])
        assert all(used == mine for used, mine in got["blocks"]["steps"])  # only its own requests' blocks
        assert 0 < got["blocks"]["peak"] < one_blocks["peak"]
        assert "on each of the 2 dp-attention ranks" in got["report"]
    # Both ranks took part in the same steps; rank 1 ran padding steps (no tokens of its own) while rank 0 worked,
    # its MoE input padded to rank 0's tokens.
    assert len(ranks[0]["agreed"]) == len(ranks[1]["agreed"])
    assert [rows for _, rows in ranks[0]["agreed"]] == [rows for _, rows in ranks[1]["agreed"]]
    assert any(tokens == 0 and rows > 0 for tokens, rows in ranks[1]["agreed"])
    assert all(rows == max(a, b) for (a, rows), (b, _) in zip(ranks[0]["agreed"], ranks[1]["agreed"]))


def _generate_cli(folder: Path, tmp_path: Path, n_prompts: int, *flags: str):
    """`paraseek generate` as a user runs it (through torch's launcher when it needs several processes): the JSON
    rows as _assert_same reads them, and stderr."""
    import json
    import os
    import subprocess
    import sys

    file = tmp_path / "prompts.jsonl"
    file.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts(n_prompts)))
    r = subprocess.run([sys.executable, "-m", "paraseek", "generate", str(folder), "--device", "cpu", "--prompts",
                        str(file), "--json", "--quiet", "--max-new-tokens", "8", "--temperature", "0", "--ignore-eos",
                        "--logprobs", "5", "--block-size", "8", "--max-batched-tokens", "32", *flags],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=SRC), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    return [{"tokens": row["token_ids"], "top": row["top_logprobs"]} for row in rows], r.stderr


def test_generate_cli_ep2_equals_one_process(v3_folder, tmp_path):
    """`paraseek generate --ep 2` (two processes, the replica's group of max(tp, ep) ranks) gives one process's
    greedy tokens and log-probabilities."""
    got, _ = _generate_cli(v3_folder, tmp_path, 4, "--ep", "2")
    _assert_same(_generate(_engine(_load(str(v3_folder)))), got)


def test_generate_cli_ep2_dp_attention_equals_one_process(v3_folder, tmp_path):
    """`paraseek generate --ep 2 --dp-attention`: five prompts spread over the two ranks (3 and 2), each rank its
    own engine and cache, give one process's greedy tokens and log-probabilities, in the prompts' order; the log
    line says each rank's KV capacity."""
    from paraseek.infer.sampling import SamplingParams

    got, err = _generate_cli(v3_folder, tmp_path, 5, "--ep", "2", "--dp-attention", "--num-kv-blocks", "40")
    reqs = _engine(_load(str(v3_folder))).generate(
        prompts(5), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5))
    _assert_same([{"tokens": r.output_ids, "top": r.top_logprobs} for r in reqs], got)
    assert "tp 1 ep 2 dp-attention" in err
    assert "KV cache: 39 blocks = 312 tokens" in err and "on each of the 2 dp-attention ranks" in err, err


@pytest.mark.parametrize("flags,message", [
    (["--ep", "3"], "--ep 3 does not divide the model's 8 routed experts"),
    (["--ep", "2", "--tp", "4"], "--tp 4 with --ep 2"),
    (["--dp-attention"], "--dp-attention needs --ep N with N > 1"),
    (["--ep", "2", "--tp", "2", "--dp-attention"], "--dp-attention with --tp 2"),
    (["--ep", "2", "--dp-attention", "--speculative", "ngram"], "--dp-attention with --speculative"),
])
def test_ep_refusals_are_one_line_exit_2(flags, message, v3_folder, capsys):
    """Refused by `paraseek generate` itself (in this process), before any weight is read or worker started."""
    from paraseek.cli import main

    src = v3_folder
    code = main(["generate", str(src), "--device", "cpu", "--prompt", "hi", *flags])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], lines


def test_ep_on_a_dense_model_is_refused():
    from paraseek.errors import UserError
    from paraseek.infer.ep import check_ep
    from paraseek.models.args import ModelArgs

    from fp8_models import TINY_GQA

    with pytest.raises(UserError, match="dense"):
        check_ep(ModelArgs.from_hf_config(TINY_GQA), 1, 2)
