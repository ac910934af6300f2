"""DeepSeek-V3's multi-token-prediction loss written out from the report (sec. 2.2, eqs. 21-25), for the tests to
compare the engine with: its own loop over depths, its own shifts (each depth on a shorter sequence, as the report
indexes it), its own norms and projections; only the transformer blocks are the model's."""

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def v3_losses(model, window_BW: torch.Tensor, depths: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(L_main, [L^1_MTP, ..., L^D_MTP]) of windows [B, T + 1] on `model` (a paraseek Transformer with D MTP
    modules), each averaged over the B * T predicted positions of the main objective:

        h'^k_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]    i = 1 .. T - k    (M_k = eh_proj; the hub's
                                                                                      columns take the embedding first)
        h^k_{1:T-k} = TRM_k(h'^k_{1:T-k})
        P^k_{i+k+1} = Softmax(head(RMSNorm_k(h^k_i)))                 (RMSNorm_k: the hub's shared_head.norm)
        L^k_MTP = -1/T sum_{i=2+k}^{T+1} log P^k_i[t_i]

    with h^0 the main model's last block output before its final norm."""
    B, W = window_BW.shape
    T = W - 1
    emb_VD, head_VD, eps = model.embed_tokens.weight, model.lm_head.weight, model.args.norm_eps
    cos, sin = model.rope_cos_sin(T, window_BW.device)
    h = emb_VD[window_BW[:, :T]]
    for layer in model.layers.values():
        h = layer(h, cos, sin)
    main_logits = rms_norm(h, model.norm.weight, eps) @ head_VD.t()
    l_main = F.cross_entropy(main_logits.flatten(0, 1), window_BW[:, 1:].flatten())
    losses, h_prev = [], h
    for k in range(1, depths + 1):
        mod = model.mtp[k - 1]
        n = T - k  # the positions whose target t_{i+k+1} is inside the window
        e = rms_norm(emb_VD[window_BW[:, k:k + n]], mod.enorm.weight, eps)  # Emb(t_{i+k}), i = 0 .. n - 1
        hh = rms_norm(h_prev[:, :n], mod.hnorm.weight, eps)
        w_e, w_h = mod.eh_proj.weight.split(model.args.dim, dim=1)
        h_k = mod.block(e @ w_e.t() + hh @ w_h.t(), cos[:n], sin[:n])
        logits = rms_norm(h_k, mod.norm.weight, eps) @ head_VD.t()
        targets = window_BW[:, k + 1:k + 1 + n]
        losses.append(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / (B * T))
        h_prev = h_k
    return l_main, losses
