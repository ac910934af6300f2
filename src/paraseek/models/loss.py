"""The output head and its cross-entropy in row chunks, so that [N, V] logits never exist whole.

With a 102k-129k vocabulary the logits of one micro-batch of 2 x 4096 tokens are 2 GiB in bf16, plus the fp32 copy
the loss takes and its fp32 gradient: ~10 GiB at the loss. Here each chunk of rows computes its logits in fp32,
the loss, and at once the gradients with respect to the hidden states and the head weight (softmax minus one-hot,
times the other operand), and drops its logits; backward only scales the saved gradients. Peak extra memory: one
chunk's [N / chunks, V] fp32 logits plus the [V, D] fp32 weight-gradient accumulator. The same idea as the fused
linear cross-entropy kernels of Liger and others, written with plain matmuls.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # F.cross_entropy's default: labels with this value add nothing


class ChunkedHeadLoss(torch.autograd.Function):
    """sum over valid rows of cross_entropy(h_ND @ w_VD.T, labels_N), computed `n_chunks` rows at a time."""

    @staticmethod
    def forward(ctx, h_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor, n_chunks: int) -> torch.Tensor:
        loss = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        grad_h_ND = torch.empty_like(h_ND)
        grad_w_VD = torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device)
        rows = -(-h_ND.shape[0] // max(1, n_chunks))
        for start in range(0, h_ND.shape[0], rows):
            h_CD, y_C = h_ND[start:start + rows], labels_N[start:start + rows]
            valid_C = y_C != IGNORE_INDEX
            y_C = y_C.clamp_min(0)
            logits_CV = (h_CD @ w_VD.t()).float()
            lse_C = torch.logsumexp(logits_CV, dim=-1)
            target_C = logits_CV.gather(1, y_C[:, None]).squeeze(1)
            loss += ((lse_C - target_C) * valid_C).sum()
            # d loss / d logits = softmax - one_hot, zero on ignored rows (in place: the logits are not needed again)
            dlogits_CV = logits_CV.sub_(lse_C[:, None]).exp_()
            dlogits_CV[torch.arange(len(y_C), device=y_C.device), y_C] -= 1.0
            dlogits_CV *= valid_C[:, None]
            dlogits_CV = dlogits_CV.to(h_ND.dtype)
            grad_h_ND[start:start + rows] = dlogits_CV @ w_VD
            grad_w_VD += (dlogits_CV.t() @ h_CD).float()
            del logits_CV, dlogits_CV
        ctx.save_for_backward(grad_h_ND, grad_w_VD.to(w_VD.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        grad_h_ND, grad_w_VD = ctx.saved_tensors
        return grad_h_ND * grad_loss.to(grad_h_ND.dtype), grad_w_VD * grad_loss.to(grad_w_VD.dtype), None, None


def chunked_head_loss(h_BTD: torch.Tensor, w_VD: torch.Tensor, labels_BT: torch.Tensor, n_chunks: int) -> torch.Tensor:
    """The summed token cross-entropy of the head `w_VD` on hidden states `h_BTD` (fp32 scalar)."""
    return ChunkedHeadLoss.apply(h_BTD.flatten(0, 1), w_VD, labels_BT.flatten(), n_chunks)


def mtp_labels(labels_BT: torch.Tensor, depth: int, positions_BT: torch.Tensor | None = None) -> torch.Tensor:
    """The targets of multi-token-prediction depth k = `depth` (DeepSeek-V3 report, sec. 2.2): position i predicts
    t_{i+k+1}, which is the next-token label of position i + k -- `labels_BT` shifted k to the left. A position has
    no target (IGNORE_INDEX) where i + k runs past the row, where the next-token label is ignored (padding, a
    document's first token, an untrained chat role) and, for rows that pack several documents (`positions_BT`, each
    token's position in its document), where a document starts between i and i + k: the target lies in another
    document than the position predicting it."""
    T = labels_BT.shape[1]
    out_BT = torch.full_like(labels_BT, IGNORE_INDEX)
    if depth >= T:
        return out_BT
    shifted = labels_BT[:, depth:]
    if positions_BT is not None:  # i and i + k in one document: their positions differ by k
        same_doc = positions_BT[:, depth:] == positions_BT[:, :T - depth] + depth
        shifted = shifted.masked_fill(~same_doc, IGNORE_INDEX)
    out_BT[:, :T - depth] = shifted
    return out_BT


def token_cross_entropy(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """The summed token cross-entropy in fp32 (ignored labels add nothing): train/optim.py's token_loss, here so
    that the model's MTP head can use it. Vocab-sharded DTensor logits need tensor.loss_context, as there."""
    import torch.nn.functional as F

    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), labels_BT.flatten(), reduction="sum")
