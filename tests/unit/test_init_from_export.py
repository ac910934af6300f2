"""--init-from a folder paraseek exported, beside --model of the same model: accepted, because what makes weights
interchangeable (the architecture's fields and so every tensor's shape) is the same, although the export's bos/eos
ids are those of the tokenizer the run trained with, not the preset's (and MTP modules a run added ride beside the
model). A real architecture change is still refused.

Every preset's config goes through the export's own writers (ModelArgs.to_hf_config, then write_tokenizer, as
train's --export-hf and `paraseek export` call them); a small model of every preset family is exported with
weights and re-initialised from, its loaded tensors compared with the exported ones; tiny-dense goes through two
real runs, the second one starting from the first one's --export-hf."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from paraseek.cli import main
from paraseek.errors import UserError
from paraseek.models import build_model, preset_config, preset_names, resolve_model
from paraseek.models.args import architecture_difference
from paraseek.models.hf import load_state_into, save_hf_state
from paraseek.train import launch
from paraseek.train.flags import _check_same_model
from paraseek.train.corpus import BUNDLED_CORPUS
from paraseek.models.tokenizer import BUNDLED_TOKENIZER
from paraseek.train.export import model_tokenizer, write_tokenizer

SRC = Path(__file__).resolve().parents[2] / "src"
SMALL = ["--device", "cpu", "--nproc", "1", "--seq-len", "16", "--global-batch-size", "2", "--steps", "1"]


def export_as_paraseek_does(args, out: Path, state=None) -> None:
    """The folder an export writes: config.json (with the weights when `state` is given), then the trained-with
    tokenizer's files and its bos/eos ids in config.json."""
    if state is None:
        out.mkdir()
        (out / "config.json").write_text(json.dumps(args.to_hf_config(), indent=2) + "\n")
    else:
        save_hf_state(state, args, out)
    write_tokenizer(BUNDLED_TOKENIZER, model_tokenizer(BUNDLED_TOKENIZER, args), out, args.max_seq_len)


@pytest.mark.parametrize("preset", preset_names())
def test_an_export_of_every_preset_is_the_same_model(preset, tmp_path):
    args = resolve_model(preset)[0]
    out = tmp_path / "export"
    export_as_paraseek_does(args, out)
    exported = resolve_model(str(out))[0]
    tok = model_tokenizer(BUNDLED_TOKENIZER, args)
    assert (exported.bos_token_id, exported.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    assert architecture_difference(args, exported) == ""
    if (args.bos_token_id, args.eos_token_id) != (tok.bos_token_id, tok.eos_token_id):
        assert exported != args  # the ids differ, and still:
    _check_same_model(preset, str(out))
    # Another architecture is still another model, named by the field that differs.
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=args.n_layers + 1)))
    with pytest.raises(UserError, match=rf"--model {preset} and --init-from .* are different models \(n_layers "
                                        rf"{args.n_layers} vs {args.n_layers + 1}\)"):
        _check_same_model(preset, str(out))


def test_only_the_special_token_ids_and_mtp_depth_are_left_out_of_the_comparison():
    args = resolve_model("tiny-moe")[0]
    assert architecture_difference(args, args.replace(bos_token_id=7, eos_token_id=None, n_mtp_layers=1)) == ""
    for field, value in (("dim", 128), ("n_routed_experts", 16), ("rope_factor", 8.0), ("tie_embeddings", True),
                         ("vocab_size", 4096), ("max_seq_len", 1024), ("kv_lora_rank", 16)):
        assert architecture_difference(args, args.replace(**{field: value})).startswith(f"{field} ")


def small_family_member(preset: str) -> dict:
    """`preset`'s config.json shrunk to a few thousand parameters, its kind of attention, MLP, MoE routing and
    RoPE kept: one small model per preset family."""
    cfg = dict(preset_config(preset), vocab_size=2048, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4)
    heads = preset_config(preset)["num_attention_heads"]
    grouped = preset_config(preset).get("num_key_value_heads", heads) < heads
    cfg["num_key_value_heads"] = 2 if grouped else 4
    cfg.pop("head_dim", None)
    if cfg.get("kv_lora_rank"):  # MLA
        cfg.update(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                   q_lora_rank=32 if cfg.get("q_lora_rank") else None)
    if cfg.get("n_routed_experts"):  # DeepSeekMoE
        groups = cfg.get("n_group") or 1
        cfg.update(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                   n_shared_experts=min(cfg.get("n_shared_experts") or 0, 1), n_group=min(groups, 4),
                   topk_group=min(cfg.get("topk_group") or 1, 2), num_nextn_predict_layers=0)
    return cfg


FAMILIES = {}
for _name in preset_names():  # the first preset of each model_type
    FAMILIES.setdefault(preset_config(_name)["model_type"], _name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_small_model_of_every_family_reinitialises_from_its_export(family, tmp_path, monkeypatch):
    model_dir, out = tmp_path / "model", tmp_path / "export"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(small_family_member(FAMILIES[family])))
    args = resolve_model(str(model_dir))[0]
    assert args.model_type == family
    trained = {k: v.clone() for k, v in build_model(args, "cpu").state_dict().items()}
    export_as_paraseek_does(args, out, trained)
    # `paraseek train --model MODEL --init-from EXPORT`: every check passes, up to the launch
    launched = []
    monkeypatch.setattr(launch, "launch", lambda cfg: launched.append(cfg) or 0)
    monkeypatch.setenv("PARASEEK_CACHE", str(tmp_path / "cache"))
    assert main(["train", "--model", str(model_dir), "--init-from", str(out), "--data", str(BUNDLED_CORPUS),
                 *SMALL]) == 0
    assert [cfg.init_from for cfg in launched] == [str(out)]
    # and the export's weights fill a model of --model's architecture, tensor for tensor
    fresh = build_model(args, "cpu")
    load_state_into(fresh, out)
    for name, tensor in fresh.state_dict().items():
        if name in trained:
            torch.testing.assert_close(tensor, trained[name], rtol=0, atol=0, msg=name)


def test_a_run_starts_from_the_export_of_another_run_of_the_same_preset(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(SRC), "PARASEEK_CACHE": str(tmp_path / "cache")}

    def train(*argv):
        return subprocess.run([sys.executable, "-m", "paraseek", "train", "--model", "tiny-dense", *SMALL,
                               "--data", str(BUNDLED_CORPUS), *argv], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)

    first = train("--export-hf", "export")
    assert first.returncode == 0, first.stderr
    assert json.loads((tmp_path / "export" / "config.json").read_text())["bos_token_id"] == 0  # the tokenizer's
    second = train("--init-from", "export", "--export-hf", "again", "--lr", "0")
    assert second.returncode == 0, second.stderr
    # lr 0: the second run's export holds exactly the weights it started from
    a, b = load_file(tmp_path / "export" / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
