"""Multi-token-prediction training through `paraseek train` (gloo, fp32, real processes).

A 4-layer tiny-moe with two MTP modules (V3-shaped: MLA, one dense layer, shared + routed experts; each MTP module
a MoE block) starts from one seeded HF folder (routers with std 1, see dist_helpers.seed_checkpoint) and trains 3
steps of 8 sequences at dist_helpers.EXACT's settings (fp32, constant lr 0.01), with V3's loss-weight switch (0.3,
then 0.1 after step 2) and without V3's routing-bias update: the engine runs each depth over whole rows, whose last k
positions have no target but count in the MTP modules' expert loads, which the equations' shorter sequences do not
have (tests/dist/test_pipeline_parallel.py trains an MTP module with the update on). One process is the reference, and it equals the V3 report's equations written out in plain torch (mtp_reference:
every depth on its own shorter sequence, its own shifts), the step-1 losses within 1e-5 and a plain AdamW loop's
losses within 1e-4. FSDP2, tp = 2, ep = 2 and pp = 2 (1F1B, and ZBVZeroBubble: the MTP modules on rank 0's second
stage, the V's end) on 2 processes give the reference's losses, per depth too, within 1e-4 relative, its step-1
gradient norm within 1e-5, and the same expert loads (the MTP modules' MoE layers included). Also: the MTP weights
reach the HF export, a checkpoint resumes only under the MTP depth it was written with, and bad flags fail in one
line.
"""

import json

import pytest
import torch

from dist_helpers import EXACT, run_train, run_train_refusals, run_trains, seeded_model
from mtp_reference import v3_losses

from paraseek.models import load_pretrained, save_pretrained
from paraseek.models.args import ModelArgs, preset_config

pytestmark = pytest.mark.dist

STEPS, RTOL, DEPTHS = 3, 1e-4, 2
WEIGHTS = ("--mtp-loss-weight", "0.3", "--mtp-loss-weight-final", "0.1", "--mtp-loss-weight-switch-step", "2",
           "--moe-bias-gamma", "0")


def _weight(step: int) -> float:
    return 0.3 if step <= 2 else 0.1


def _rows(jsonl) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, jsonl.read_text().splitlines()) if "event" not in r}


def _command(init, *plan: str, jsonl: str = "m.jsonl", extra: tuple = ()) -> list[str]:
    return [*EXACT, "--steps", str(STEPS), "--init-from", str(init), *WEIGHTS, *plan, "--metrics-jsonl", jsonl, *extra]


PLANS = {"fsdp2": ("--nproc", "2"), "tp2": ("--nproc", "2", "--tp", "2"), "ep2": ("--nproc", "2", "--ep", "2"),
         "pp2": ("--nproc", "2", "--pp", "2"),
         "pp2-zbv": ("--nproc", "2", "--pp", "2", "--pp-schedule", "ZBVZeroBubble", "--pp-virtual-stages", "2")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-process run (its folder, result and rows; with a checkpoint and an HF export) and every plan's
    (result, rows), trained in one batch (dist_helpers.run_trains: processes start slowly)."""
    root = tmp_path_factory.mktemp("mtp")
    args = ModelArgs.from_hf_config({**preset_config("tiny-moe"), "num_hidden_layers": 4,
                                     "num_nextn_predict_layers": DEPTHS})
    save_pretrained(seeded_model(args), root / "init")
    folders = {name: tmp_path_factory.mktemp(name) for name in PLANS}
    r, *results = run_trains([(_command(root / "init", "--nproc", "1", jsonl="ref.jsonl",
                                        extra=("--checkpoint-dir", "ck", "--export-hf", "out")), root)]
                             + [(_command(root / "init", *plan), folders[name]) for name, plan in PLANS.items()],
                             check=False)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    plans = {name: (res, _rows(folders[name] / "m.jsonl") if res.returncode == 0 else None)
             for name, res in zip(PLANS, results, strict=True)}
    return root, r, _rows(root / "ref.jsonl"), plans


def test_one_process_equals_the_v3_equations_and_a_plain_training_loop(reference):
    root, r, rows, _ = reference
    assert "MTP: 2 depths (the model's own), loss weight 0.3, 0.1 after step 2 / 2 per depth" in r.stdout
    assert "| mtp " in r.stdout  # the progress line carries each depth's loss
    ref = _plain_torch(root / "init", steps=STEPS)
    # step 1: the same weights, the same batch: the losses and the objective's gradient norm
    for key, value in ref[1].items():
        assert abs(rows[1][key] - value) <= 1e-5 * abs(value), (key, rows[1][key], value)
    for step in range(2, STEPS + 1):  # through AdamW
        for key in ("loss", "mtp_loss_1", "mtp_loss_2"):
            assert abs(rows[step][key] - ref[step][key]) <= RTOL * abs(ref[step][key]), (step, key)


def _plain_torch(init, steps: int) -> dict[int, dict]:
    """The engine's settings (AdamW 0.9/0.95, eps 1e-8, weight decay 0.1, clip 1.0, lr 0.01) on the objective
    L_main + lambda / D * sum_k L^k_MTP of mtp_reference, the whole batch at once."""
    from paraseek.train.dataset import open_dataset

    model = load_pretrained(init, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    data = open_dataset("synthetic", seq_len=32, vocab_size=model.args.vocab_size, seed=0)
    out = {}
    for step in range(1, steps + 1):
        window = torch.stack([data.sequence(i) for i in range((step - 1) * 8, step * 8)])
        l_main, l_mtp = v3_losses(model, window, DEPTHS)
        (l_main + _weight(step) / DEPTHS * sum(l_mtp)).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        opt.zero_grad()
        out[step] = {"loss": l_main.item(), "mtp_loss_1": l_mtp[0].item(), "mtp_loss_2": l_mtp[1].item(),
                     "grad_norm": grad_norm}
    return out


@pytest.mark.parametrize("plan", PLANS)
def test_each_plan_equals_one_process(reference, plan):
    _, _, ref, plans = reference
    r, got = plans[plan]
    assert r.returncode == 0, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    if "--pp" in PLANS[plan]:
        assert "2 MTP modules" in r.stdout  # on the last stage, in the split the header prints
    assert sorted(got) == sorted(ref)
    for step in ref:
        for key in ("loss", "mtp_loss_1", "mtp_loss_2"):
            assert abs(got[step][key] - ref[step][key]) <= RTOL * abs(ref[step][key]), (step, key, got[step][key])
        # the same tokens to the same experts in every MoE layer, the two MTP modules' last
        assert got[step]["expert_load_max_over_mean_per_layer"] == ref[step]["expert_load_max_over_mean_per_layer"]
    assert len(ref[1]["expert_load_max_over_mean_per_layer"]) == 3 + DEPTHS
    assert abs(got[1]["grad_norm"] - ref[1]["grad_norm"]) <= 1e-5 * ref[1]["grad_norm"]


def test_export_holds_the_trained_mtp_modules(reference):
    root, _, _, _ = reference
    init = load_pretrained(root / "init", dtype=torch.float32).state_dict()
    out = load_pretrained(root / "out", dtype=torch.float32)
    assert out.args.n_mtp_layers == DEPTHS
    trained = {n: t for n, t in out.state_dict().items() if n.startswith("mtp.") and n.endswith("weight")}
    assert trained and all(not torch.equal(t, init[n]) for n, t in trained.items())


def test_a_checkpoint_resumes_only_under_its_mtp_depth(reference):
    root, _, _, _ = reference
    r = run_train(*EXACT, "--steps", str(STEPS + 1), "--init-from", str(root / "init"), "--nproc", "1",
                  "--checkpoint-dir", "ck", "--resume", "--mtp-layers", "1", cwd=root, check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    line = [x for x in r.stderr.splitlines() if "MTP" in x]
    assert len(line) == 1 and "trained 2 MTP depth(s), and this one trains 1: resume with --mtp-layers 2" in line[0]
    assert "Traceback" not in r.stderr


def test_bad_mtp_flags_fail_in_one_line(tmp_path):
    cases = [(("--model", "tiny-dense", "--mtp-loss-weight", "0.3"), "tiny-dense holds no MTP modules"),
             (("--mtp-layers", "-3"), "--mtp-layers must be >= 0 (or -1: the default)"),
             (("--mtp-layers", "two"), "--mtp-layers: invalid int value"),
             (("--mtp-layers", "1", "--mtp-loss-weight-final", "0.1"), "go together"),
             (("--mtp-layers", "40"), "use --mtp-layers 31 or fewer")]
    results = run_train_refusals([([*EXACT, "--nproc", "1", "--steps", "1", *flags], tmp_path) for flags, _ in cases])
    for (flags, words), (code, _, stderr) in zip(cases, results, strict=True):
        assert code == 2, (flags, stderr)
        assert words in stderr and "Traceback" not in stderr and len(stderr.strip().splitlines()) <= 2, (flags, stderr)
