"""`paraseek export`: a training checkpoint -> an HF folder that transformers loads with the tokenizer the run trained
with (AutoTokenizer gives the same ids, config.json's bos/eos are the tokenizer's) and the same logits."""

import json

import pytest
import torch

from dist_helpers import run_train
from paraseek.cli import main
from paraseek.train.data import BUNDLED_CORPUS

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    run_train("--model", "tiny-moe", "--nproc", "1", "--device", "cpu", "--steps", "2", "--seq-len", "32",
              "--global-batch-size", "2", "--data", str(BUNDLED_CORPUS), "--checkpoint-dir", str(d / "ckpt"), cwd=d)
    return d / "ckpt"


def test_export_loads_in_transformers_with_the_training_tokenizer(checkpoint, tmp_path, capsys):
    from paraseek.infer.load import _from_checkpoint, _load_checkpoint, _checkpoint_step
    from paraseek.models.tokenizer import load_text_tokenizer
    from paraseek.train.data import BUNDLED_TOKENIZER

    out = tmp_path / "hf"
    assert main(["export", str(checkpoint), str(out), "--dtype", "float32"]) == 0
    assert "tokenizer: the one it was trained with" in capsys.readouterr().out
    ours = load_text_tokenizer(BUNDLED_TOKENIZER)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "And God said, Let there be light: and there was light."
    assert hf_tok.encode(text) == ours.encode(text)
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (ours.bos_token_id, ours.eos_token_id)
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (ours.bos_token_id, ours.eos_token_id)

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    src = _from_checkpoint(str(checkpoint), _checkpoint_step(checkpoint), None)
    model = _load_checkpoint(src, torch.float32, "cpu")
    ids = torch.tensor([ours.encode(text)])
    with torch.no_grad():
        ref, got = model(ids), hf(input_ids=ids).logits
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4


def test_export_refuses_bad_input_with_one_line(checkpoint, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    cases = [([str(checkpoint), str(out)], "exists and is not empty"),
             ([str(checkpoint), str(tmp_path / "x"), "--step", "7"], "no complete checkpoint for step 7"),
             ([str(tmp_path), str(tmp_path / "y")], "not a paraseek checkpoint folder")]
    for argv, message in cases:
        assert main(["export", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert (out / "keep.txt").read_text() == "mine"
