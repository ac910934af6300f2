"""The chunked head + cross-entropy (models/loss.py) equals F.cross_entropy on whole logits: loss and gradients."""

import pytest
import torch
import torch.nn.functional as F

from paraseek.models import build_model, resolve_model
from paraseek.models.loss import IGNORE_INDEX, chunked_head_loss


@pytest.mark.parametrize("n_chunks", [1, 3, 8])
def test_loss_and_gradients_equal_whole_logits(n_chunks):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 13, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (2, 13), generator=g)
    labels[0, 3] = labels[1, 7] = IGNORE_INDEX
    ref = F.cross_entropy((h @ w.t()).flatten(0, 1), labels.flatten(), reduction="sum")
    ref_gh, ref_gw = torch.autograd.grad(ref * 0.5, (h, w))
    got = chunked_head_loss(h, w, labels, n_chunks)
    got_gh, got_gw = torch.autograd.grad(got * 0.5, (h, w))
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(got_gh, ref_gh)
    torch.testing.assert_close(got_gw, ref_gw)


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe"])
def test_model_forward_with_labels_matches_logits_path(model):
    args, _, _ = resolve_model(model)
    torch.manual_seed(0)
    net = build_model(args, "cpu", torch.float32)
    ids = torch.randint(0, args.vocab_size, (2, 16))
    labels = torch.randint(0, args.vocab_size, (2, 16))
    ref = F.cross_entropy(net(ids).flatten(0, 1), labels.flatten(), reduction="sum")
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    net.zero_grad()
    got = net(ids, labels, 4)
    got.backward()
    torch.testing.assert_close(got, ref)
    for n, p in net.named_parameters():
        if n in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)
