"""Packing with document masking (models/deepseek.py: positions -> RoPE restarting per document + document_mask):
a packed row gives each document the losses and gradients it gets when run alone, for GQA (tiny-dense) and MLA +
MoE (tiny-moe, YaRN RoPE), in fp32. The reference is the model called once per document, with no mask at all."""

import pytest
import torch
import torch.nn.functional as F

from paraseek.models import build_model, resolve_model
from paraseek.models.deepseek import document_mask
from paraseek.models.loss import IGNORE_INDEX

from numerics import rel_error

# Two rows of packed documents (lengths, the last one the row's padding), 24 tokens each.
ROWS = [[5, 9, 3, 7], [11, 13]]


def _model(name: str):
    args, _, _ = resolve_model(name)
    torch.manual_seed(0)
    model = build_model(args, "cpu", torch.float32)
    for m in model.modules():  # decisive routers: a 1e-7 difference cannot flip a token's top-k
        if type(m).__name__ == "Gate":
            torch.nn.init.normal_(m.weight, std=1.0)
    return model


def _packed_batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    docs = [[torch.randint(0, vocab, (n + 1,), generator=g) for n in row] for row in ROWS]  # each doc's window
    inputs = torch.stack([torch.cat([d[:-1] for d in row]) for row in docs])
    labels = torch.stack([torch.cat([d[1:] for d in row]) for row in docs])
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ROWS])
    return docs, inputs, labels, positions


def test_document_mask_predicate():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = document_mask(positions)[0, 0]
    doc = [0, 0, 0, 1, 1, 2]
    for q in range(6):
        for k in range(6):
            assert bool(mask[q, k]) == (k <= q and doc[k] == doc[q]), (q, k)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_packed_documents_equal_documents_one_by_one(name):
    model = _model(name)
    docs, inputs, labels, positions = _packed_batch(model.args.vocab_size)

    logits = model(inputs, positions_BT=positions)
    packed_losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    packed_losses.sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    alone_losses = []
    for row in docs:
        per_row = []
        for d in row:
            out = F.cross_entropy(model(d[None, :-1])[0], d[1:], reduction="none")
            out.sum().backward()  # accumulates: the sum over documents of their own gradients
            per_row.append(out.detach())
        alone_losses.append(torch.cat(per_row))
    assert rel_error(packed_losses.detach(), torch.stack(alone_losses)) < 1e-5
    for n, p in model.named_parameters():
        if p.grad is not None or n in packed_grads:
            assert rel_error(packed_grads[n], p.grad) < 1e-5, n


def test_without_the_mask_documents_would_see_each_other():
    """The check above is not vacuous: the same packed row without positions (one causal sequence) differs."""
    model = _model("tiny-dense")
    _, inputs, _, positions = _packed_batch(model.args.vocab_size)
    with torch.no_grad():
        assert rel_error(model(inputs), model(inputs, positions_BT=positions)) > 1e-3


def test_masked_labels_add_nothing():
    """IGNORE_INDEX labels (padding, prompt tokens, a document's first token) contribute no loss and no gradient."""
    model = _model("tiny-dense")
    _, inputs, labels, positions = _packed_batch(model.args.vocab_size)
    keep = torch.rand(labels.shape, generator=torch.Generator().manual_seed(2)) < 0.5
    masked = labels.masked_fill(~keep, IGNORE_INDEX)
    logits = model(inputs, positions_BT=positions)
    got = F.cross_entropy(logits.flatten(0, 1), masked.flatten(), reduction="sum")
    by_hand = -(logits.log_softmax(-1).gather(-1, labels[..., None])[..., 0] * keep).sum()
    assert rel_error(got.detach(), by_hand.detach()) < 1e-6


def test_chunked_head_loss_takes_the_positions_too():
    """--loss-chunks computes the same masked sum from the same document-masked hidden states."""
    model = _model("tiny-moe")
    _, inputs, labels, positions = _packed_batch(model.args.vocab_size)
    labels = labels.masked_fill(positions == 0, IGNORE_INDEX)
    with torch.no_grad():
        whole = F.cross_entropy(model(inputs, positions_BT=positions).flatten(0, 1), labels.flatten(),
                                reduction="sum")
        chunked = model(inputs, labels, 3, positions_BT=positions)
    assert rel_error(chunked, whole) < 1e-5
