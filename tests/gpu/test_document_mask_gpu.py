"""Document masking on CUDA, where it runs on FlexAttention (models/deepseek.py: document_mask builds a BlockMask,
attention calls the compiled flex_attention): a packed row's per-document losses and gradients equal the documents
run one by one (fp32, no TF32), MLA's unequal q/k and v head dims at V2-Lite's shape in bf16, and `paraseek train`
on chat data with bf16, torch.compile and selective checkpointing.

Run on the GPU machine: `make test-gpu` or `python3 -m pytest -q -m gpu tests/gpu`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from paraseek.models import build_model, resolve_model
from paraseek.models.deepseek import attention, document_mask

from chat_corpus import chat_corpus
from numerics import rel_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROWS = [[100, 300, 27, 85], [512]]  # documents per row (512 tokens each row)


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_flex_packed_documents_equal_documents_one_by_one(name):
    args, _, _ = resolve_model(name)
    torch.manual_seed(0)
    model = build_model(args, "cuda", torch.float32)
    for m in model.modules():  # decisive routers: a 1e-7 difference cannot flip a token's top-k
        if type(m).__name__ == "Gate":
            torch.nn.init.normal_(m.weight, std=1.0)
    g = torch.Generator().manual_seed(1)
    docs = [[torch.randint(0, args.vocab_size, (n + 1,), generator=g).cuda() for n in row] for row in ROWS]
    inputs = torch.stack([torch.cat([d[:-1] for d in row]) for row in docs])
    labels = torch.stack([torch.cat([d[1:] for d in row]) for row in docs])
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ROWS]).cuda()
    assert not isinstance(document_mask(positions), torch.Tensor)  # the BlockMask path
    losses = F.cross_entropy(model(inputs, positions_BT=positions).flatten(0, 1), labels.flatten(), reduction="none")
    losses.sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    alone = []
    for row in docs:
        for d in row:
            out = F.cross_entropy(model(d[None, :-1])[0], d[1:], reduction="none")
            out.sum().backward()
            alone.append(out.detach())
    assert rel_error(losses.detach(), torch.cat(alone)) < 1e-4
    for n, p in model.named_parameters():
        if n in packed:
            assert rel_error(packed[n], p.grad) < 1e-4, n


def test_flex_mla_head_dims_bf16():
    """q/k head dim 192, v 128, 16 heads (V2-Lite's MLA) over 4,096 packed tokens: FlexAttention against SDPA run on
    each document alone, forward and backward."""
    torch.manual_seed(0)
    lengths = [1000, 37, 2048, 1011]
    T, H = sum(lengths), 16
    q, k = (torch.randn(1, H, T, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(1, H, T, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    out = attention(q, k, v, 192**-0.5, document_mask(positions))
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dy)
    ref, ref_grads, a = [], [[], [], []], 0
    for n in lengths:
        parts = [x[:, :, a:a + n].detach().requires_grad_(True) for x in (q, k, v)]
        o = F.scaled_dot_product_attention(*parts, is_causal=True, scale=192**-0.5)
        for lst, gr in zip(ref_grads, torch.autograd.grad(o, parts, dy[:, :, a:a + n])):
            lst.append(gr)
        ref.append(o)
        a += n
    assert rel_error(out, torch.cat(ref, 2)) < 2e-2
    for got, want in zip(grads, ref_grads):
        assert rel_error(got, torch.cat(want, 2)) < 2e-2


@pytest.mark.parametrize("extra", [[], ["--compile", "--activation-checkpointing", "selective"]])
def test_train_chat_data_on_cuda(extra, tmp_path):
    chat_corpus(tmp_path, n=200)
    src = Path(__file__).resolve().parents[2] / "src"
    env = dict(os.environ, PYTHONPATH=str(src), PARASEEK_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "paraseek", "train", "--device", "cuda", "--nproc", "1",
                        "--model", "tiny-moe", "--data", "chat.jsonl", "--tokenizer", "tok", "--seq-len", "256",
                        "--global-batch-size", "8", "--micro-batch-size", "4", "--steps", "6", "--lr", "3e-3",
                        "--eval-split", "0.1", "--eval-every", "3", "--metrics-jsonl", "m.jsonl", *extra],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    evals = [row for row in rows if row.get("event") == "eval"]
    assert [e["step"] for e in evals] == [3, 6] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert "attention masked to each document" in r.stdout
