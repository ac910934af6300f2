"""The runner: a step's inputs from the host to the device, the inference model's forward over them (infer/model.py)
and the paged cache it reads and writes.

Decode-only steps replay CUDA graphs captured per (batch bucket, block-table width); everything else runs eagerly.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from paraseek.infer.cache import KVCache
from paraseek.infer.model import InferenceModel


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
    lora: torch.Tensor | None = None  # [N] int64: each token's adapter slot, -1 the base (infer/lora.py); None: none

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


class HostBatch:
    """The same step as int arrays on the host: what the driver builds from the scheduler's plan and broadcasts to
    the other tp ranks as one int64 tensor."""

    HEADER = 8

    def __init__(self, ids, pos, slots, n_decode, block_tables, context_lens, lens, k_slots, logits_idx, lora=None):
        self.ids, self.pos, self.slots, self.n_decode = ids, pos, slots, n_decode
        self.block_tables, self.context_lens, self.lens = block_tables, context_lens, lens
        self.k_slots, self.logits_idx = k_slots, logits_idx
        self.lora = lora  # [N] adapter slot per token (-1: the base model), or None when the engine has no adapters

    def pack(self) -> torch.Tensor:
        M = self.block_tables.shape[1] if self.n_decode else 0
        lens = np.asarray(self.lens, dtype=np.int64).reshape(-1)
        header = np.array([len(self.ids), self.n_decode, M, len(self.lens), len(self.k_slots), len(self.logits_idx),
                           self.lora is not None, 0], dtype=np.int64)
        parts = [header, self.ids, self.pos, self.slots, self.block_tables.reshape(-1), self.context_lens, lens,
                 self.k_slots, self.logits_idx] + ([self.lora] if self.lora is not None else [])
        return torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))

    @classmethod
    def unpack(cls, flat: torch.Tensor) -> HostBatch:
        a = flat.numpy()
        N, nd, M, npf, K, ns, has_lora = (int(x) for x in a[:7])
        o = cls.HEADER
        take = []
        for size in (N, N, N, nd * M, nd, 2 * npf, K, ns) + ((N,) if has_lora else ()):
            take.append(a[o:o + size])
            o += size
        ids, pos, slots, bt, cl, lens, k_slots, li = take[:8]
        return cls(ids, pos, slots, nd, bt.reshape(nd, M), cl, [tuple(x) for x in lens.reshape(npf, 2).tolist()],
                   k_slots, li, take[8] if has_lora else None)

    def to_device(self, device) -> StepBatch:
        def t(x, dtype=torch.int64):
            return _to_device(torch.as_tensor(np.asarray(x), dtype=dtype), device)

        cu_q = np.concatenate([[0], np.cumsum([q for q, _ in self.lens], dtype=np.int64)])
        cu_k = np.concatenate([[0], np.cumsum([k for _, k in self.lens], dtype=np.int64)])
        every = len(self.logits_idx) == len(self.ids) and bool((np.asarray(self.logits_idx) == np.arange(len(self.ids))).all())
        lora = self.lora if self.lora is not None and (np.asarray(self.lora) >= 0).any() else None  # eager: skipped
        return StepBatch(t(self.ids), t(self.pos), t(self.slots), self.n_decode,
                         t(self.block_tables, torch.int32), t(self.context_lens, torch.int32),
                         t(cu_q, torch.int32), t(cu_k, torch.int32), t(self.k_slots), list(self.lens),
                         t(self.logits_idx), every, None if lora is None else t(lora))


class ModelRunner:
    """The inference model of one tp rank (infer/model.py), its cache, the step's inputs on the device and the CUDA
    graphs of decode steps."""

    def __init__(self, model: InferenceModel, max_model_len: int, block_size: int):
        self.model, self.args = model, model.args
        self.block_size, self.max_model_len = block_size, max_model_len
        self.tp = model.tp
        self.device, self.dtype = model.device, model.dtype
        self.cache: KVCache | None = None
        self.vocab_size = self.args.vocab_size
        model.set_positions(max_model_len)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_batch_sizes: list[int] = []

    # ---- the cache -----------------------------------------------------------------------------------------------------
    def allocate_cache(self, num_blocks: int, shape) -> None:
        self.cache = KVCache(shape, num_blocks, self.block_size, self.dtype, self.device)

    # ---- forward -----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, b: StepBatch, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n_sample, vocab] of the rows b.logits_idx (into `logits_out` when given)."""
        return self.model.forward(b, self.cache, logits_out)

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
        if self.model.lora is not None:  # each row's adapter slot (infer/lora.py); the graphs always apply them
            self._static["lora"] = torch.full((bmax,), -1, dtype=torch.int64, device=dev)
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
                               empty32, empty32, s["slots"][:0], [], s["idx"][:bsz], every_row=True,
                               lora=s["lora"][:bsz] if "lora" in s else None)
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
        inputs = [("ids", hb.ids, 0), ("pos", hb.pos, 0), ("slots", hb.slots, 0), ("cl", hb.context_lens, 1)]
        if "lora" in s:
            inputs.append(("lora", hb.lora if hb.lora is not None else -1, -1))
        for name, values, pad in inputs:
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
