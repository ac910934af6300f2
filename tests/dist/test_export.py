"""`paraseek export`: a training checkpoint -> an HF folder that transformers loads with the tokenizer the run trained
with (AutoTokenizer gives the same ids, config.json's bos/eos are the tokenizer's) and the same logits."""

import json

import pytest
import torch

from dist_helpers import run_train
from paraseek.cli import main
from paraseek.train.corpus import BUNDLED_CORPUS

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    run_train("--model", "tiny-moe", "--nproc", "1", "--device", "cpu", "--steps", "2", "--seq-len", "32",
              "--global-batch-size", "2", "--data", str(BUNDLED_CORPUS), "--checkpoint-dir", str(d / "ckpt"), cwd=d)
    return d / "ckpt"


def test_export_loads_in_transformers_with_the_training_tokenizer(checkpoint, tmp_path, capsys):
    from paraseek.models.checkpoint_read import checkpoint_source, checkpoint_step, load_checkpoint_model
    from paraseek.models.tokenizer import load_text_tokenizer
    from paraseek.models.tokenizer import BUNDLED_TOKENIZER

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
    src = checkpoint_source(str(checkpoint), checkpoint_step(checkpoint), None)
    model = load_checkpoint_model(src, torch.float32, "cpu")
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


def test_train_export_hf_and_export_keep_the_runs_tokenizer_and_chat_template(tmp_path):
    """train's --export-hf writes the tokenizer it trained with, as `paraseek export` does, and a run's
    --chat-template (not its tokenizer folder's) is the template both folders carry; `generate` on the exported
    folder renders a chat with it."""
    from chat_corpus import TEMPLATES, chat_corpus
    from paraseek.models.tokenizer import load_text_tokenizer

    chat_corpus(tmp_path)
    template = TEMPLATES / "deepseek_r1_distill_qwen.jinja"  # the tok folder's is deepseek-llm-7b-chat's
    run_train("--model", "tiny-dense", "--nproc", "1", "--device", "cpu", "--steps", "1", "--seq-len", "64",
              "--global-batch-size", "2", "--data", "chat.jsonl", "--tokenizer", "tok", "--chat-template",
              str(template), "--checkpoint-dir", "ckpt", "--export-hf", "hf", cwd=tmp_path)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "exported")]) == 0
    want = template.read_text(encoding="utf-8")
    ours = load_text_tokenizer(tmp_path / "tok", template)
    for folder in (tmp_path / "hf", tmp_path / "exported"):
        tok = load_text_tokenizer(folder)
        assert tok.chat_template == want, folder
        config = json.loads((folder / "config.json").read_text())
        assert (config["bos_token_id"], config["eos_token_id"]) == (ours.bos_token_id, ours.eos_token_id)
        messages = [{"role": "user", "content": "the devil"}]
        assert tok.apply_chat_template(messages) == ours.apply_chat_template(messages)
