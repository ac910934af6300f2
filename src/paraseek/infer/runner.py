"""The model forward over a step's flattened tokens and the paged cache, on one tp rank.

The model (models/deepseek.py) stays single-device math; this file applies the cache from outside: it reads the
model's weights (fused where one read beats several: q|k|v, gate|up, MLA's two projections of the block input),
runs the same pre-norm block (x + attn(norm(x)), then x + mlp(norm(x))) with attention over the cache, and only the
rows that are sampled go through the final norm and the head. MoE layers call the model's own MoE module.

Decode-only steps replay CUDA graphs captured per (batch bucket, block-table width); everything else runs eagerly.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paraseek.infer import ops
from paraseek.infer.attention import prefill_attention
from paraseek.infer.cache import KVCache
from paraseek.models.deepseek import MLA, MoE, Transformer


@dataclass
class StepBatch:
    """A step's inputs on the device. Rows [0, n_decode) are single-token items (decodes), then prefill chunks."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slots: torch.Tensor  # [N] int64: where each token's K/V go
    n_decode: int
    block_tables: torch.Tensor  # [n_decode, M] int32
    context_lens: torch.Tensor  # [n_decode] int32 (the new token included)
    cu_q: torch.Tensor  # [n_prefill + 1] int32
    cu_k: torch.Tensor  # [n_prefill + 1] int32
    k_slots: torch.Tensor  # [K] int64: every prefill chunk's whole context, packed
    lens: list[tuple[int, int]]  # (queries, keys) per prefill chunk
    logits_idx: torch.Tensor  # [n_sample] int64: rows whose logits are sampled
    every_row: bool = False  # logits_idx is every row in order (decode steps): no gather

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


class HostBatch:
    """The same step as int arrays on the host: what the driver builds from the scheduler's plan and broadcasts to
    the other tp ranks as one int64 tensor."""

    HEADER = 8

    def __init__(self, ids, pos, slots, n_decode, block_tables, context_lens, lens, k_slots, logits_idx):
        self.ids, self.pos, self.slots, self.n_decode = ids, pos, slots, n_decode
        self.block_tables, self.context_lens, self.lens = block_tables, context_lens, lens
        self.k_slots, self.logits_idx = k_slots, logits_idx

    def pack(self) -> torch.Tensor:
        M = self.block_tables.shape[1] if self.n_decode else 0
        lens = np.asarray(self.lens, dtype=np.int64).reshape(-1)
        header = np.array([len(self.ids), self.n_decode, M, len(self.lens), len(self.k_slots), len(self.logits_idx),
                           0, 0], dtype=np.int64)
        parts = [header, self.ids, self.pos, self.slots, self.block_tables.reshape(-1), self.context_lens, lens,
                 self.k_slots, self.logits_idx]
        return torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))

    @classmethod
    def unpack(cls, flat: torch.Tensor) -> HostBatch:
        a = flat.numpy()
        N, nd, M, npf, K, ns = (int(x) for x in a[:6])
        o = cls.HEADER
        take = []
        for size in (N, N, N, nd * M, nd, 2 * npf, K, ns):
            take.append(a[o:o + size])
            o += size
        ids, pos, slots, bt, cl, lens, k_slots, li = take
        return cls(ids, pos, slots, nd, bt.reshape(nd, M), cl, [tuple(x) for x in lens.reshape(npf, 2).tolist()],
                   k_slots, li)

    def to_device(self, device) -> StepBatch:
        def t(x, dtype=torch.int64):
            return _to_device(torch.as_tensor(np.asarray(x), dtype=dtype), device)

        cu_q = np.concatenate([[0], np.cumsum([q for q, _ in self.lens], dtype=np.int64)])
        cu_k = np.concatenate([[0], np.cumsum([k for _, k in self.lens], dtype=np.int64)])
        every = len(self.logits_idx) == len(self.ids) and bool((np.asarray(self.logits_idx) == np.arange(len(self.ids))).all())
        return StepBatch(t(self.ids), t(self.pos), t(self.slots), self.n_decode,
                         t(self.block_tables, torch.int32), t(self.context_lens, torch.int32),
                         t(cu_q, torch.int32), t(cu_k, torch.int32), t(self.k_slots), list(self.lens),
                         t(self.logits_idx), every)


class ModelRunner:
    """Weights of one tp rank, the cache, and the forward. `tp_group` is None without tensor parallelism."""

    def __init__(self, model: Transformer, max_model_len: int, block_size: int, tp_group=None):
        self.model, self.args = model, model.args
        self.block_size, self.max_model_len = block_size, max_model_len
        self.tp_group = tp_group
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.cache: KVCache | None = None
        self.vocab_size = self.args.vocab_size
        self._prepare_weights()
        inv_freq = model.rope_inv_freq.to(self.device, torch.float32)
        angles_PR = torch.outer(torch.arange(max_model_len, device=self.device, dtype=torch.float32), inv_freq)
        self.cos_PR = angles_PR.cos() * model.rope_attn_factor
        self.sin_PR = angles_PR.sin() * model.rope_attn_factor
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_batch_sizes: list[int] = []

    # ---- weights -----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _prepare_weights(self) -> None:
        """One fused weight per group of projections that read the same input; the modules' weights become views of
        it, so the model's own forward still works and nothing is stored twice."""
        for layer in self.model.layers.values():
            attn = layer.self_attn
            if isinstance(attn, MLA):
                first = attn.q_a_proj if attn.q_lora_rank else attn.q_proj
                _fuse([first, attn.kv_a_proj_with_mqa], attn, "fused_in")
                H = attn.kv_b_proj.weight.shape[0] // (attn.nope_dim + attn.v_dim)
                w_HXC = attn.kv_b_proj.weight.view(H, attn.nope_dim + attn.v_dim, attn.kv_lora_rank)
                attn.w_uk_HDC = w_HXC[:, :attn.nope_dim]  # q_nope -> latent space (absorbed into the query)
                attn.w_uv_HCV = w_HXC[:, attn.nope_dim:].transpose(1, 2)  # attended latent -> each head's value
            else:
                _fuse([attn.q_proj, attn.k_proj, attn.v_proj], attn, "qkv")
            if not isinstance(layer.mlp, MoE):
                _fuse([layer.mlp.gate_proj, layer.mlp.up_proj], layer.mlp, "gate_up")
        m = self.model
        self.head_w = m.lm_head.weight if m.lm_head is not None else m.embed_tokens.weight
        if getattr(m, "tp_head_w", None) is not None:  # tensor parallel: this rank's vocab rows (infer/tp.py)
            self.head_w = m.tp_head_w

    # ---- the cache -----------------------------------------------------------------------------------------------------
    def allocate_cache(self, num_blocks: int, shape) -> None:
        self.cache = KVCache(shape, num_blocks, self.block_size, self.dtype, self.device)

    # ---- forward -----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, b: StepBatch, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n_sample, vocab] of the rows b.logits_idx (written into `logits_out` when given: the CUDA graphs
        share one output buffer instead of keeping one each)."""
        layers = list(self.model.layers.values())
        x_NE = self.model.embed_tokens(b.input_ids)
        h_NE = ops.rms_norm(x_NE, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)
        for i, layer in enumerate(layers):
            a_NE = self._attention(i, layer.self_attn, h_NE, b)
            self._all_reduce(a_NE)
            ln = layer.post_attention_layernorm
            h_NE = ops.add_rms_norm(a_NE, x_NE, ln.weight, ln.eps)
            m_NE = self._mlp(layer.mlp, h_NE)
            self._all_reduce(m_NE)
            if i + 1 < len(layers):
                ln = layers[i + 1].input_layernorm
                h_NE = ops.add_rms_norm(m_NE, x_NE, ln.weight, ln.eps)
            else:
                x_NE.add_(m_NE)
        final = self.model.norm
        h_SE = ops.rms_norm(x_NE if b.every_row else x_NE[b.logits_idx], final.weight, final.eps)
        if logits_out is not None and self.tp == 1:
            return torch.mm(h_SE, self.head_w.t(), out=logits_out)
        logits_SV = self._gather_vocab(F.linear(h_SE, self.head_w))
        return logits_out.copy_(logits_SV) if logits_out is not None else logits_SV

    def _mlp(self, mlp: nn.Module, h_NE: torch.Tensor) -> torch.Tensor:
        if isinstance(mlp, MoE):
            return mlp(h_NE)
        return F.linear(ops.silu_mul(F.linear(h_NE, mlp.gate_up)), mlp.down_proj.weight)

    def _attention(self, i: int, attn: nn.Module, h_NE: torch.Tensor, b: StepBatch) -> torch.Tensor:
        if isinstance(attn, MLA):
            return self._mla(i, attn, h_NE, b)
        N, D = h_NE.shape[0], attn.head_dim
        qkv = F.linear(h_NE, attn.qkv, attn.qkv_bias)
        H = attn.q_proj.weight.shape[0] // D
        G = attn.k_proj.weight.shape[0] // D
        q_NHD = qkv[:, :H * D].view(N, H, D)
        # One launch rotates q and k in the fused output and writes k and v into the cache.
        ops.rope_write_kv_(qkv, H, G, self.cos_PR, self.sin_PR, b.positions, b.slots, self.cache.kv[i])
        k_SGD, v_SGD = self.cache.k[i], self.cache.v[i]
        nd = b.n_decode
        if nd == N:  # decode-only (every CUDA-graph step): the kernel's output is the attention output
            o_NHD = ops.paged_decode_gqa(q_NHD, k_SGD, v_SGD, b.block_tables, b.context_lens, self.block_size,
                                         attn.softmax_scale)
            return F.linear(o_NHD.view(N, H * D), attn.o_proj.weight, attn.o_proj.bias)
        o_NHD = q_NHD.new_empty((N, H, D))
        if nd:
            o_NHD[:nd] = ops.paged_decode_gqa(q_NHD[:nd], k_SGD, v_SGD, b.block_tables, b.context_lens,
                                              self.block_size, attn.softmax_scale)
        if nd < N:
            o_NHD[nd:] = prefill_attention(q_NHD[nd:], k_SGD[b.k_slots], v_SGD[b.k_slots], b.cu_q, b.cu_k,
                                           max(q for q, _ in b.lens), max(k for _, k in b.lens), b.lens,
                                           attn.softmax_scale)
        return F.linear(o_NHD.view(N, H * D), attn.o_proj.weight, attn.o_proj.bias)

    def _mla(self, i: int, attn: MLA, h_NE: torch.Tensor, b: StepBatch) -> torch.Tensor:
        N, C, R, nope, Dv = h_NE.shape[0], attn.kv_lora_rank, attn.rope_dim, attn.nope_dim, attn.v_dim
        y = F.linear(h_NE, attn.fused_in)
        if attn.q_lora_rank:
            q_a, kv_a = y.split([attn.q_lora_rank, C + R], dim=-1)
            q = F.linear(ops.rms_norm(q_a, attn.q_a_layernorm.weight, attn.q_a_layernorm.eps), attn.q_b_proj.weight)
        else:
            q, kv_a = y.split([y.shape[-1] - C - R, C + R], dim=-1)
        q_NHX = q.view(N, -1, nope + R)
        H = q_NHX.shape[1]
        q_pe_NHR = q_NHX[..., nope:]
        latent_NC = ops.rms_norm(kv_a[:, :C], attn.kv_a_layernorm.weight, attn.kv_a_layernorm.eps)
        k_pe_N1R = kv_a[:, C:].unsqueeze(1)
        ops.rope_(q_pe_NHR, self.cos_PR, self.sin_PR, b.positions, attn.interleave)
        ops.rope_(k_pe_N1R, self.cos_PR, self.sin_PR, b.positions, attn.interleave)
        c_SX = self.cache.k[i]
        c_SX.index_copy_(0, b.slots, torch.cat([latent_NC, k_pe_N1R[:, 0]], dim=-1))
        o_NHV = h_NE.new_empty((N, H, Dv))
        nd = b.n_decode
        if nd:
            # Absorbed (DeepSeek-V2 appendix C): W_UK folded into the query, W_UV applied after attention, so the
            # keys and values are the cached latent itself: [H, nd, nope] @ [H, nope, C] -> [H, nd, C].
            q_lat_HnC = torch.bmm(q_NHX[:nd, :, :nope].transpose(0, 1), attn.w_uk_HDC)
            o_lat_nHC = ops.paged_decode_mla(q_lat_HnC.transpose(0, 1), q_pe_NHR[:nd], c_SX, b.block_tables,
                                             b.context_lens, self.block_size, attn.softmax_scale)
            o_NHV[:nd] = torch.bmm(o_lat_nHC.transpose(0, 1), attn.w_uv_HCV).transpose(0, 1)
        if nd < N:
            # Expanded (the model's own form): the context's latents through kv_b_proj to per-head keys and values.
            ctx_KX = c_SX[b.k_slots]
            kv_KHX = F.linear(ctx_KX[:, :C], attn.kv_b_proj.weight).view(-1, H, nope + Dv)
            K = kv_KHX.shape[0]
            k_KHD = torch.cat([kv_KHX[..., :nope], ctx_KX[:, None, C:].expand(K, H, R)], dim=-1)
            o_NHV[nd:] = prefill_attention(q_NHX[nd:], k_KHD, kv_KHX[..., nope:], b.cu_q, b.cu_k,
                                           max(q for q, _ in b.lens), max(k for _, k in b.lens), b.lens,
                                           attn.softmax_scale)
        return F.linear(o_NHV.reshape(N, H * Dv), attn.o_proj.weight)

    # ---- tensor parallel --------------------------------------------------------------------------------------------
    def _all_reduce(self, x: torch.Tensor) -> None:
        if self.tp > 1:
            dist.all_reduce(x, group=self.tp_group)

    def _gather_vocab(self, logits_SV: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return logits_SV
        parts = [torch.empty_like(logits_SV) for _ in range(self.tp)]
        dist.all_gather(parts, logits_SV.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)[:, :self.vocab_size]

    # ---- CUDA graphs ------------------------------------------------------------------------------------------------
    def graph_key(self, b: HostBatch) -> tuple[int, int] | None:
        """The captured graph that can run this step: decode-only, batch padded up to a captured size, block tables
        padded up to a captured width."""
        if not self.graphs or b.n_decode != len(b.ids) or len(b.logits_idx) != b.n_decode:
            return None
        i = bisect.bisect_left(self.graph_batch_sizes, b.n_decode)
        if i == len(self.graph_batch_sizes):
            return None
        widths = sorted({m for _, m in self.graphs})
        j = bisect.bisect_left(widths, b.block_tables.shape[1])
        return (self.graph_batch_sizes[i], widths[j]) if j < len(widths) else None

    @torch.no_grad()
    def capture_graphs(self, batch_sizes: list[int], widths: list[int]) -> None:
        """Capture the decode forward for each (batch size, block-table width), largest first, sharing one memory
        pool. Inputs live in static buffers that `run` fills before a replay."""
        bmax, dev = max(batch_sizes), self.device
        self._static = {
            "ids": torch.zeros(bmax, dtype=torch.int64, device=dev),
            "pos": torch.zeros(bmax, dtype=torch.int64, device=dev),
            "slots": torch.zeros(bmax, dtype=torch.int64, device=dev),  # slot 0: the padding block
            "cl": torch.ones(bmax, dtype=torch.int32, device=dev),
            "idx": torch.arange(bmax, dtype=torch.int64, device=dev),
            "bt": {m: torch.zeros((bmax, m), dtype=torch.int32, device=dev) for m in widths},
        }
        # Pinned host twins of the inputs: the copies before a replay are asynchronous (pageable ones stall the host).
        self._pinned = [{k: (v.cpu().pin_memory() if torch.is_tensor(v) else {m: t.cpu().pin_memory() for m, t in v.items()})
                         for k, v in self._static.items() if k != "idx"} for _ in range(2)]
        self._flip = 0
        pool = torch.cuda.graph_pool_handle()
        self._logits = torch.empty((bmax, self.vocab_size), dtype=self.dtype, device=dev)
        empty32 = torch.zeros(1, dtype=torch.int32, device=dev)
        for m in sorted(widths, reverse=True):
            for bsz in sorted(batch_sizes, reverse=True):
                s = self._static
                sb = StepBatch(s["ids"][:bsz], s["pos"][:bsz], s["slots"][:bsz], bsz, s["bt"][m][:bsz], s["cl"][:bsz],
                               empty32, empty32, s["slots"][:0], [], s["idx"][:bsz], every_row=True)
                self.forward(sb, self._logits[:bsz])  # warm-up: kernels compiled, workspaces sized, outside capture
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = self.forward(sb, self._logits[:bsz])
                self.graphs[(bsz, m)] = (g, out)
        self.graph_batch_sizes = sorted(batch_sizes)
        torch.cuda.synchronize()

    @torch.no_grad()
    def run(self, hb: HostBatch, patch=None) -> torch.Tensor:
        """The step's logits. `patch` = (rows, src, tokens): input ids[rows] are tokens[src], a previous step's
        output still on the device (the engine's overlapped steps)."""
        key = self.graph_key(hb)
        if key is None:
            b = hb.to_device(self.device)
            if patch is not None:
                _patch_ids(b.input_ids, patch)
            return self.forward(b)
        bsz, m = key
        n = hb.n_decode
        self._flip ^= 1  # two sets of pinned twins: the next step fills one while the other may still be copying
        s, h = self._static, self._pinned[self._flip]
        # Fill the pinned twins (padding rows: token 0 at position 0 writing into the padding block, a context of
        # one token), then copy the whole captured batch asynchronously.
        for name, values, pad in (("ids", hb.ids, 0), ("pos", hb.pos, 0), ("slots", hb.slots, 0),
                                  ("cl", hb.context_lens, 1)):
            host = h[name].numpy()
            host[:n] = values
            host[n:bsz] = pad
            s[name][:bsz].copy_(h[name][:bsz], non_blocking=True)
        bt = h["bt"][m].numpy()
        bt[:bsz] = 0
        bt[:n, :hb.block_tables.shape[1]] = hb.block_tables
        s["bt"][m][:bsz].copy_(h["bt"][m][:bsz], non_blocking=True)
        if patch is not None:
            _patch_ids(s["ids"], patch)
        g, out = self.graphs[key]
        g.replay()
        return out[:n]


def _to_device(x: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on the device without waiting for the GPU: a copy from pageable memory may wait for the work
    already queued on the stream (it would undo the overlapped steps), one from pinned memory does not (torch's
    pinned-memory cache keeps the buffer until the copy has run)."""
    if torch.device(device).type != "cuda":
        return x
    return x.pin_memory().to(device, non_blocking=True)


def _patch_ids(ids_N: torch.Tensor, patch) -> None:
    rows, src, tokens = patch
    dev = ids_N.device
    ids_N.index_copy_(0, _to_device(torch.tensor(rows, dtype=torch.int64), dev),
                      tokens.index_select(0, _to_device(torch.tensor(src, dtype=torch.int64), dev)))


def _fuse(linears: list[nn.Linear], owner: nn.Module, name: str) -> None:
    """Concatenate linears that read the same input into `owner.<name>` (and `<name>_bias`); each linear's weight
    (and bias) becomes a view of its rows."""
    w = torch.cat([lin.weight for lin in linears], dim=0)
    biases = [lin.bias for lin in linears]
    b = torch.cat(biases, dim=0) if all(x is not None for x in biases) else None
    setattr(owner, name, w)
    setattr(owner, name + "_bias", b)
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(w[row:row + n], requires_grad=False)
        if b is not None:
            lin.bias = nn.Parameter(b[row:row + n], requires_grad=False)
        row += n
