"""Checkpoints: stop at step 4 and resume to 8 gives the uninterrupted losses for steps 5-8 (also on 4 ranks from
a checkpoint written by 2, through torch DCP's resharding); an HF export loads in transformers with our logits;
PowerSGD compression converges next to plain DDP."""

import shutil

import pytest
import torch
from dist_helpers import EXACT, assert_same_losses, run_train, seed_checkpoint, step_losses

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    init = seed_checkpoint("tiny-moe", root / "init")
    run_train(*EXACT, "--steps", "8", "--init-from", str(init), "--nproc", "2", "--micro-batch-size", "2",
              "--metrics-jsonl", "full.jsonl", cwd=root)
    return root, init, step_losses(root / "full.jsonl")


@pytest.fixture(scope="module")
def stopped_at_4(uninterrupted, tmp_path_factory):
    """The first leg of the resume tests: the same run stopped after step 4 (2 ranks), its checkpoint folder. Each
    test resumes from a copy of it (the run is the same for all of them, so it is run once)."""
    _, init, _ = uninterrupted
    root = tmp_path_factory.mktemp("stopped")
    run_train(*EXACT, "--init-from", str(init), "--micro-batch-size", "2", "--checkpoint-dir", "ck", "--steps", "4",
              "--nproc", "2", "--metrics-jsonl", "a.jsonl", cwd=root)
    assert (root / "ck" / "latest").read_text().strip() == "step-000004"
    return root / "ck"


@pytest.mark.parametrize("resume_nproc", ["2", "4"])
def test_resume_continues_the_same_curve(uninterrupted, stopped_at_4, tmp_path, resume_nproc):
    root, init, full = uninterrupted
    common = [*EXACT, "--init-from", str(init), "--micro-batch-size", "2", "--checkpoint-dir", "ck"]
    shutil.copytree(stopped_at_4, tmp_path / "ck")
    r = run_train(*common, "--steps", "8", "--nproc", resume_nproc, "--resume", "--metrics-jsonl", "b.jsonl",
                  cwd=tmp_path)
    assert "resumed from" in r.stdout
    resumed = step_losses(tmp_path / "b.jsonl")
    assert sorted(resumed) == [5, 6, 7, 8]
    # Same ranks: the same reductions, so 1e-6; 2 -> 4 ranks changes the reduction order: 1e-4 as in the plan tests.
    assert_same_losses(resumed, {s: full[s] for s in (5, 6, 7, 8)}, rtol=1e-6 if resume_nproc == "2" else 1e-4)


def test_interrupted_save_keeps_the_last_good_checkpoint(uninterrupted, stopped_at_4, tmp_path):
    root, init, _ = uninterrupted
    common = [*EXACT, "--init-from", str(init), "--nproc", "2", "--micro-batch-size", "2", "--checkpoint-dir", "ck"]
    shutil.copytree(stopped_at_4, tmp_path / "ck")  # a run that saved step 4 (the resume tests' first leg)
    # A save that died half-way leaves only a .tmp folder; resume must ignore it and use step 4.
    (tmp_path / "ck" / "step-000006.tmp").mkdir()
    (tmp_path / "ck" / "step-000006.tmp" / "garbage").write_text("partial")
    r = run_train(*common, "--steps", "5", "--resume", cwd=tmp_path)
    assert "resumed from ck/step-000004 at step 4" in r.stdout


def test_export_hf_loads_in_transformers_with_our_logits(uninterrupted, tmp_path):
    transformers = pytest.importorskip("transformers")
    root, init, _ = uninterrupted
    run_train(*EXACT, "--steps", "3", "--init-from", str(init), "--nproc", "2", "--micro-batch-size", "2",
              "--export-hf", "out", cwd=tmp_path)
    from paraseek.models import load_pretrained

    ours = load_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    ids = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = hf(input_ids=ids).logits, ours(ids)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4
    # and the export holds the trained weights, not the initial ones
    init_model = load_pretrained(init, dtype=torch.float32)
    assert not torch.equal(init_model.embed_tokens.weight, ours.embed_tokens.weight)


def test_powersgd_converges_next_to_plain_ddp(tmp_path):
    """PowerSGD is lossy by design (rank-2 gradient approximation with error feedback after 10 exact steps); over
    30 steps its loss must fall like plain DDP's: the final losses within 5% of each other."""
    from paraseek.train.corpus import BUNDLED_CORPUS

    init = seed_checkpoint("tiny-dense", tmp_path / "init")
    ddp = [*EXACT, "--steps", "30", "--init-from", str(init), "--nproc", "2", "--dp-replicate", "2", "--dp-shard", "1",
           "--micro-batch-size", "4", "--lr", "0.003", "--data", str(BUNDLED_CORPUS), "--seq-len", "64"]
    run_train(*ddp, "--metrics-jsonl", "plain.jsonl", cwd=tmp_path)
    run_train(*ddp, "--grad-compression", "powersgd:2", "--metrics-jsonl", "psgd.jsonl", cwd=tmp_path)
    plain, psgd = step_losses(tmp_path / "plain.jsonl"), step_losses(tmp_path / "psgd.jsonl")
    assert_same_losses({s: psgd[s] for s in range(1, 11)}, {s: plain[s] for s in range(1, 11)}, rtol=1e-5)
    assert psgd[30] < psgd[1] - 1.0  # it learns (real text)
    assert abs(psgd[30] - plain[30]) / plain[30] < 0.05
