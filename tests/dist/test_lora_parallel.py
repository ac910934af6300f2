"""LoRA in the engine (`paraseek train --lora-rank`, gloo, fp32) on tiny-moe, which has every kind of target: MLA's
projections, a dense MLP, shared and routed experts. Against one process: FSDP2 over 2 ranks and --ep 2 give the
same losses (1e-4 relative, as every plan in test_data_parallel.py), and a checkpoint written by FSDP2 resumes on one
process with the same curve. Step 1's loss is the base model's, computed here by hand from the same batch (B starts
at zero). Checkpoints and optimizer state hold the adapters only. `paraseek export --merge-lora` equals the unmerged
forward, and `--export-adapter` loads in peft on transformers' model of the base folder with the same logits."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dist_helpers import EXACT, assert_same_losses, run_train, run_trains, seed_checkpoint, step_losses
from numerics import rel_error
from paraseek.cli import main
from paraseek.errors import UserError

pytestmark = pytest.mark.dist

LORA = ["--lora-rank", "4", "--lora-alpha", "8"]  # all targets
COMMON = [*EXACT, *LORA, "--micro-batch-size", "2"]  # fp32, lr 0.01 constant, 8 x 32 tokens per step


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, 4 steps, a checkpoint every 2; trained in one batch (dist_helpers.run_trains: processes start
    slowly) with the tests' first runs on 2 ranks, each in its own folder: FSDP2 for 2 steps with a checkpoint
    ("fsdp2"), and EP for 4 steps with an HF export ("ep2"). (root, init, reference losses, {name: (folder,
    result)})."""
    root = tmp_path_factory.mktemp("lora")
    init = seed_checkpoint("tiny-moe", root / "init")
    runs = {"fsdp2": [*COMMON, "--init-from", str(init), "--checkpoint-dir", "ck", "--steps", "2", "--nproc", "2",
                      "--dp-shard", "2", "--metrics-jsonl", "a.jsonl"],
            "ep2": [*COMMON, "--steps", "4", "--init-from", str(init), "--nproc", "2", "--dp-shard", "2", "--ep", "2",
                    "--metrics-jsonl", "ep.jsonl", "--export-hf", "out"]}
    folders = {name: tmp_path_factory.mktemp(name) for name in runs}
    r, *results = run_trains([([*COMMON, "--steps", "4", "--init-from", str(init), "--nproc", "1",
                                 "--metrics-jsonl", "ref.jsonl", "--checkpoint-dir", "ck", "--checkpoint-every", "2"],
                                root)] + [(argv, folders[name]) for name, argv in runs.items()], check=False)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return root, init, step_losses(root / "ref.jsonl"), {name: (folders[name], res)
                                                         for name, res in zip(runs, results, strict=True)}


def _run(reference, name: str) -> Path:
    folder, r = reference[3][name]
    assert r.returncode == 0, (name, r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    return folder


def _spec(init: Path):
    from paraseek.models import resolve_model
    from paraseek.models.lora_spec import lora_spec

    args, _, _ = resolve_model(str(init))
    return args, lora_spec(4, 8.0, "", args, str(init))


def test_step_one_is_the_base_models_loss(reference):
    from paraseek.models import load_pretrained
    from paraseek.train.dataset import open_dataset
    from paraseek.train.loader import DataLoader

    _, init, ref, _ = reference
    base = load_pretrained(init, dtype=torch.float32)
    loader = DataLoader(open_dataset("synthetic", seq_len=32, vocab_size=base.args.vocab_size, seed=0),
                        global_batch_size=8, micro_batch_size=8, dp_rank=0, dp_size=1)
    loader.load_state_dict({"position": 0})
    [(inputs, labels)] = loader.next_step()
    with torch.no_grad():
        loss = F.cross_entropy(base(inputs).flatten(0, 1), labels.flatten()).item()
    assert abs(ref[1] - loss) <= 1e-5 * loss, (ref[1], loss)
    assert ref[4] < ref[1]  # and the adapters learn


def test_fsdp2_equals_one_process_holds_only_adapters_and_resumes(reference):
    import torch.distributed.checkpoint as dcp

    from paraseek.models.lora import is_adapter
    from paraseek.models.lora_spec import adapter_params, adapted
    from paraseek.planner.memory import lora_state_bytes
    from paraseek.planner.plan import Plan

    _, init, ref, _ = reference
    folder = _run(reference, "fsdp2")  # 2 steps on 2 ranks (FSDP2), a checkpoint in ck
    common = [*COMMON, "--init-from", str(init), "--checkpoint-dir", "ck"]
    assert_same_losses(step_losses(folder / "a.jsonl"), {s: ref[s] for s in (1, 2)}, rtol=1e-4)

    # Only the adapters have gradients and AdamW moments (the engine's own byte count per rank, summed), and the
    # planner's LoRA term predicts each rank's share.
    args, spec = _spec(init)
    n = adapter_params(args, spec)
    rows = [json.loads(line) for line in (folder / "a.jsonl").read_text().splitlines()]
    layout = next(r for r in rows if r.get("event") == "model_state")
    assert (sum(layout["params"]), sum(layout["grads"]), sum(layout["optimizer"])) == (4 * n, 4 * n, 8 * n)
    predicted = lora_state_bytes(args, Plan(dp_shard=2), spec, base_bytes=4)["optimizer"]
    assert all(abs(b - predicted) <= 0.1 * predicted for b in layout["optimizer"]), (layout, predicted)

    # The checkpoint: the adapters and their optimizer state, not the frozen base.
    meta = dcp.FileSystemReader(str(folder / "ck" / "step-000002")).read_metadata().state_dict_metadata
    model_keys = {k[len("model."):] for k in meta if k.startswith("model.")}
    assert all(is_adapter(k) for k in model_keys)
    assert len(model_keys) == 2 * len(adapted(args, spec))  # A and B of every adapted weight
    optim_params = {k[len("optim.state."):].rsplit(".", 1)[0] for k in meta if k.startswith("optim.state.")}
    assert optim_params == model_keys

    # Resume on one process (another layout: DCP reshards the adapters and their moments): the same curve.
    r = run_train(*common, "--steps", "4", "--nproc", "1", "--resume", "--metrics-jsonl", "b.jsonl", cwd=folder)
    assert "resumed from" in r.stdout
    assert_same_losses(step_losses(folder / "b.jsonl"), {s: ref[s] for s in (3, 4)}, rtol=1e-4)


def test_expert_parallel_equals_one_process(reference):
    from paraseek.models.checkpoint_read import checkpoint_source, checkpoint_step, load_checkpoint_model
    from paraseek.models import load_pretrained

    root, init, ref, _ = reference
    folder = _run(reference, "ep2")  # 4 steps on 2 ranks (--ep 2), exported to HF in out
    assert_same_losses(step_losses(folder / "ep.jsonl"), ref, rtol=1e-4)
    # --export-hf gathers the EP-sharded adapters and merges them: the one-process run's model, up to the 1e-4
    # of its losses.
    src = checkpoint_source(str(root / "ck"), checkpoint_step(root / "ck"), None)
    ids = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        one = load_checkpoint_model(src, torch.float32, "cpu", merge_lora=False)(ids)
        assert rel_error(load_pretrained(folder / "out", dtype=torch.float32)(ids), one) < 1e-3


@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match")  # see unit/test_lora.py
def test_export_merged_and_as_a_peft_adapter(reference, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from paraseek.models.checkpoint_read import checkpoint_source, checkpoint_step, load_checkpoint_model
    from paraseek.models import load_pretrained
    from paraseek.train.export import _check_lora_choice

    root, init, _, _ = reference
    ck = root / "ck"
    src = checkpoint_source(str(ck), checkpoint_step(ck), None)
    ours = load_checkpoint_model(src, torch.float32, "cpu", merge_lora=False)  # base + adapters, unmerged
    assert main(["export", str(ck), str(tmp_path / "merged"), "--merge-lora", "--dtype", "float32"]) == 0
    assert main(["export", str(ck), str(tmp_path / "adapter"), "--export-adapter", "--dtype", "float32"]) == 0
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    ids = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ours(ids)
        assert rel_error(load_pretrained(init, dtype=torch.float32)(ids), ref) > 1e-3  # trained adapters
        assert rel_error(load_pretrained(tmp_path / "merged", dtype=torch.float32)(ids), ref) < 1e-5
        hf = transformers.AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32).eval()
        got = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(input_ids=ids).logits
    assert rel_error(got, ref) < 1e-4  # the transformers parity tolerance

    # Neither flag on a LoRA checkpoint, or both, is one line; a plain checkpoint has no adapters to write.
    capsys.readouterr()
    for argv, message in [([], "holds LoRA adapters"), (["--merge-lora", "--export-adapter"], "choose one")]:
        assert main(["export", str(ck), str(tmp_path / "x"), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    with pytest.raises(UserError, match="holds no LoRA adapters"):
        _check_lora_choice(SimpleNamespace(lora=None), ck, True, False)
