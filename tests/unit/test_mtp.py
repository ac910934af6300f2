"""Multi-token prediction (DeepSeek-V3 report, sec. 2.2) on one process: the model's MTP losses and their gradients
against the report's equations written out in plain torch (tests/mtp_reference.py), the targets of packed documents,
the chunked head, the HF layout of the MTP weights (and transformers loading it), and the --mtp-* flags' checks."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from paraseek.errors import UserError
from paraseek.models import ModelArgs, build_model, load_pretrained, preset_config, save_pretrained
from paraseek.models.loss import IGNORE_INDEX, mtp_labels
from paraseek.train.config import TrainConfig
from paraseek.train.mtp import describe, loss_weight
from paraseek.train.validate import validate

from mtp_reference import v3_losses


def _model(preset: str, n_mtp: int, seed: int = 0):
    args = ModelArgs.from_hf_config({**preset_config(preset), "num_nextn_predict_layers": n_mtp})
    torch.manual_seed(seed)
    model = build_model(args, "cpu", torch.float32)
    with torch.no_grad():  # norms away from 1, so that a norm applied to the wrong tensor shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.mark.parametrize("preset,depths", [("tiny-moe", 2), ("tiny-dense", 1)])
def test_mtp_losses_and_gradients_equal_the_v3_equations(preset, depths):
    model = _model(preset, depths)
    ref = copy.deepcopy(model)
    window = torch.randint(0, model.args.vocab_size, (3, 21), generator=torch.Generator().manual_seed(5))
    B, T = window.shape[0], window.shape[1] - 1
    model.mtp_depth = depths
    logits, mtp_D = model(window[:, :-1], mtp_labels_BT=window[:, 1:])
    l_main = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
    r_main, r_mtp = v3_losses(ref, window, depths)
    assert mtp_D.shape == (depths,)
    for k in range(depths):
        got, want = mtp_D[k].item() / (B * T), r_mtp[k].item()
        assert abs(got - want) <= 1e-5 * abs(want), (k + 1, got, want)
    lam = 0.3
    (l_main + lam / depths * mtp_D.sum() / (B * T)).backward()
    (r_main + lam / depths * sum(r_mtp)).backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g, r = p.grad, ref_grads[name].grad
        assert g is not None and r is not None, name
        assert (g - r).abs().max() <= 1e-5 * r.abs().max().clamp_min(1e-30), name
    # every MTP parameter and the shared embedding and head get a gradient from the MTP losses
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n.startswith("mtp.")
               and not n.endswith("e_score_correction_bias"))


def test_mtp_labels_equal_a_loop_over_positions_and_documents():
    gen = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 50, (2, 12), generator=gen)
    labels[0, 3] = labels[1, 7] = IGNORE_INDEX  # untrained tokens
    positions = torch.tensor([list(range(5)) + list(range(4)) + list(range(3)), list(range(12))])
    doc = (positions == 0).cumsum(1)
    for k in (1, 2, 3):
        for pos in (None, positions):
            got = mtp_labels(labels, k, pos)
            for b in range(2):
                for i in range(12):
                    j = i + k
                    ok = j < 12 and labels[b, j] != IGNORE_INDEX and (pos is None or doc[b, j] == doc[b, i])
                    assert got[b, i] == (labels[b, j] if ok else IGNORE_INDEX), (k, pos is None, b, i)


def test_packed_documents_give_the_losses_of_each_document_alone():
    """A row packing two documents (positions restart, attention stays inside each) has the MTP losses of the
    two documents run as rows of their own: no depth predicts across the boundary, in its targets or its
    attention."""
    model = _model("tiny-moe", 2)
    model.mtp_depth = 2
    gen = torch.Generator().manual_seed(9)
    a, b = torch.randint(0, 2048, (1, 10), generator=gen), torch.randint(0, 2048, (1, 8), generator=gen)
    window = torch.cat([a, b], dim=1)[:, :17]  # W = 17: all of a, b's first 7 tokens
    inputs, labels = window[:, :-1], window[:, 1:].clone()
    labels[0, 9] = IGNORE_INDEX  # b's first token: nothing in its document predicts it (train/dataset.py)
    positions = torch.tensor([list(range(10)) + list(range(6))])
    with torch.no_grad():
        _, packed = model(inputs, positions_BT=positions, mtp_labels_BT=labels)
        _, alone_a = model(a[:, :-1], mtp_labels_BT=a[:, 1:])
        _, alone_b = model(b[:, :6], mtp_labels_BT=b[:, 1:7])
    torch.testing.assert_close(packed, alone_a + alone_b, rtol=1e-5, atol=0)


def test_chunked_head_gives_the_same_mtp_losses():
    model = _model("tiny-moe", 2)
    model.mtp_depth = 2
    window = torch.randint(0, 2048, (2, 17), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, whole = model(window[:, :-1], mtp_labels_BT=window[:, 1:])
        main, chunked = model(window[:, :-1], window[:, 1:], 3, mtp_labels_BT=window[:, 1:])
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=0)
    torch.testing.assert_close(main, F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten(), reduction="sum"),
                               rtol=1e-5, atol=0)


def test_without_mtp_labels_forward_is_unchanged():
    model = _model("tiny-moe", 1)
    ids = torch.randint(0, 2048, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids)
        model.mtp_depth = 1
        again = model(ids)  # no labels: logits alone, no MTP run
    assert torch.equal(plain, again)


@pytest.mark.parametrize("preset,depths", [("tiny-moe", 2), ("tiny-dense", 1)])
def test_hf_folder_keeps_mtp_weights_bit_for_bit_in_v3_layout(preset, depths, tmp_path):
    model = _model(preset, depths, seed=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("mtp."):
                p.add_(torch.randn_like(p))
    save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == depths
    from safetensors.torch import load_file

    keys = set(load_file(tmp_path / "model.safetensors"))
    n = model.args.n_layers
    for k in range(depths):
        for own in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                    "shared_head.head.weight", "embed_tokens.weight", "input_layernorm.weight",
                    "post_attention_layernorm.weight"):
            assert f"model.layers.{n + k}.{own}" in keys
    assert not any(key.startswith("mtp.") for key in keys)
    loaded = load_pretrained(tmp_path, dtype=torch.float32, device="cpu")
    assert loaded.args.n_mtp_layers == depths
    got = loaded.state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(got[name], t), name


def test_transformers_loads_an_export_with_mtp_layers_and_ignores_them(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _model("tiny-moe", 1, seed=3).eval()
    save_pretrained(model, tmp_path)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                 output_loading_info=True)
    n = model.args.n_layers
    assert not info["missing_keys"]
    assert info["unexpected_keys"] and all(k.startswith(f"model.layers.{n}.") for k in info["unexpected_keys"])
    ids = torch.randint(0, 2048, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(input_ids=ids).logits, model(ids), rtol=1e-4, atol=1e-5)


def test_a_folder_without_mtp_weights_holds_none_and_loads_with_fresh_modules(tmp_path):
    """transformers writes DeepSeek-V3 without its MTP layers but keeps num_nextn_predict_layers: such a folder
    holds no module (the default trains none), and a run that asks for one gets it fresh beside the loaded weights."""
    transformers = pytest.importorskip("transformers")
    from paraseek.models.deepseek import Transformer
    from paraseek.models.hf import load_state_into
    from paraseek.models.weights import held_mtp_modules

    save_pretrained(_model("tiny-moe", 1, seed=4), tmp_path / "ours")
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).save_pretrained(
        tmp_path / "hf")
    args = ModelArgs.from_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert args.n_mtp_layers == 1
    assert held_mtp_modules(args, tmp_path / "ours") == 1 and held_mtp_modules(args, tmp_path / "hf") == 0
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    fresh = load_state_into(model, tmp_path / "hf", fresh_mtp=True)
    assert fresh and all(name.startswith("mtp.0.") for name in fresh)
    assert fresh == {n for n in model.state_dict() if n.startswith("mtp.")}
    with pytest.raises(UserError, match="the checkpoint lacks mtp.0"):
        load_state_into(model, tmp_path / "hf")


# ---- the flags ------------------------------------------------------------------------------------------------------
def _cfg(**kw) -> TrainConfig:
    return TrainConfig(**{**dict(device="cpu", precision="fp32", nproc=1, dp_shard=1, seq_len=32,
                                 global_batch_size=2), **kw})


def test_the_header_says_where_the_modules_come_from():
    assert describe(_cfg(), 1, 1) == ("MTP: 1 depth (the model's own), loss weight 0.1 / 1 per depth; logged as "
                                      "mtp_loss_1")
    assert describe(_cfg(), 2, 0).startswith("MTP: 2 depths (created fresh), ")
    assert describe(_cfg(mtp_loss_weight=0.3), 3, 1).startswith(
        "MTP: 3 depths (1 the model's own, 2 created fresh), loss weight 0.3 / 3 per depth; logged as mtp_loss_1, ")


def test_the_loss_weight_follows_the_v3_switch():
    assert loss_weight(_cfg(), 1) == 0.1
    cfg = _cfg(mtp_loss_weight=0.3, mtp_loss_weight_final=0.1, mtp_loss_weight_switch_step=5)
    assert [loss_weight(cfg, s) for s in (1, 5, 6, 100)] == [0.3, 0.3, 0.1, 0.1]


@pytest.mark.parametrize("changes,words", [
    (dict(model="tiny-dense", mtp_loss_weight=0.3), "tiny-dense holds no MTP modules"),
    (dict(model="tiny-moe", mtp_layers=0, mtp_loss_weight=0.3), "--mtp-layers 0 trains none"),
    (dict(mtp_layers=1, mtp_loss_weight_final=0.1), "go together"),
    (dict(mtp_layers=1, mtp_loss_weight_switch_step=10), "go together"),
    (dict(mtp_layers=-2), "--mtp-layers must be >= 0 (or -1: the default)"),
    (dict(mtp_layers=1, mtp_loss_weight=-0.5), "--mtp-loss-weight must be >= 0"),
    (dict(mtp_layers=32), "use --mtp-layers 31 or fewer"),
])
def test_bad_mtp_flags_are_refused(changes, words):
    with pytest.raises(UserError, match=words.replace("(", r"\(").replace(")", r"\)")):
        validate(_cfg(**changes), False, 0)


def test_fresh_mtp_modules_under_lora_are_refused(tmp_path):
    save_pretrained(_model("tiny-dense", 0), tmp_path / "base")
    base = str(tmp_path / "base")
    validate(_cfg(init_from=base, model=base, lora_rank=4), False, 0)
    with pytest.raises(UserError, match="would stay at its random start; use --mtp-layers 0 or fewer"):
        validate(_cfg(init_from=base, model=base, lora_rank=4, mtp_layers=1), False, 0)
    validate(_cfg(model="tiny-dense", mtp_layers=2), False, 0)  # fresh modules, all trained: fine
