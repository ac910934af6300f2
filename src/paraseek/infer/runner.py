"""The runner: a step's inputs from the host to the device, the inference model's forward over them (infer/model.py)
and the paged cache it reads and writes.

Decode-only steps replay CUDA graphs captured per (batch bucket, block-table width) that hold the whole step, input
patching and greedy sampling included; everything else runs eagerly. A speculative verification is decode rows too
(the engine lays a request's last token and K drafts out as K + 1 rows), so its steps replay the same graphs.
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
    moe_rows: int = 0  # dp-attention: the step's agreed rows per rank, which the MoE layers pad to (infer/ep.py)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


class HostBatch:
    """The same step as int arrays on the host: what the driver builds from the scheduler's plan and broadcasts to
    the other tp ranks as one int64 tensor.

    Speculative decoding (infer/spec.py) adds two kinds of step: `keep_hidden`, a target forward whose last-block
    output the runner keeps for the MTP drafter; and a drafter forward (`hidden_rows` given: row i's input hidden
    state is row hidden_rows[i] of the previous forward's kept output), which keeps its own output in turn. Every
    tp rank runs the same sequence of steps, so every rank holds the same hidden states."""

    HEADER = 8

    def __init__(self, ids, pos, slots, n_decode, block_tables, context_lens, lens, k_slots, logits_idx, lora=None,
                 keep_hidden: bool = False, hidden_rows=None):
        self.ids, self.pos, self.slots, self.n_decode = ids, pos, slots, n_decode
        self.block_tables, self.context_lens, self.lens = block_tables, context_lens, lens
        self.k_slots, self.logits_idx = k_slots, logits_idx
        self.lora = lora  # [N] adapter slot per token (-1: the base model), or None when the engine has no adapters
        self.keep_hidden = keep_hidden
        self.hidden_rows = hidden_rows  # [N] a drafter forward's input rows of the kept hidden states, else None

    def pack(self) -> torch.Tensor:
        M = self.block_tables.shape[1] if self.n_decode else 0
        lens = np.asarray(self.lens, dtype=np.int64).reshape(-1)
        kind = 2 if self.hidden_rows is not None else int(self.keep_hidden)
        header = np.array([len(self.ids), self.n_decode, M, len(self.lens), len(self.k_slots), len(self.logits_idx),
                           self.lora is not None, kind], dtype=np.int64)
        parts = [header, self.ids, self.pos, self.slots, self.block_tables.reshape(-1), self.context_lens, lens,
                 self.k_slots, self.logits_idx] + ([self.lora] if self.lora is not None else []) \
            + ([self.hidden_rows] if self.hidden_rows is not None else [])
        return torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))

    @classmethod
    def unpack(cls, flat: torch.Tensor) -> HostBatch:
        a = flat.numpy()
        N, nd, M, npf, K, ns, has_lora, kind = (int(x) for x in a[:8])
        o = cls.HEADER
        take = []
        for size in (N, N, N, nd * M, nd, 2 * npf, K, ns) + ((N,) if has_lora else ()) + ((N,) if kind == 2 else ()):
            take.append(a[o:o + size])
            o += size
        ids, pos, slots, bt, cl, lens, k_slots, li = take[:8]
        return cls(ids, pos, slots, nd, bt.reshape(nd, M), cl, [tuple(x) for x in lens.reshape(npf, 2).tolist()],
                   k_slots, li, take[8] if has_lora else None, keep_hidden=kind == 1,
                   hidden_rows=take[-1] if kind == 2 else None)

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
    graphs of decode steps.

    A decode step's graph holds the whole step: its inputs are views of two flat device buffers (int64: input ids,
    positions, slots, and for each row the row of the previous step's tokens that is its input, or -1; int32: context
    lengths and block tables), filled by one copy each from pinned host memory; inside the graph the rows whose input
    is a token still on the device (the overlapped steps of engine.py) take it from the token buffer, the forward runs,
    and the greedy tokens (argmax) are written back into that buffer. Outside the graph a step costs two host-to-device
    copies, the replay and the copy of its tokens to the host."""

    def __init__(self, model: InferenceModel, max_model_len: int, block_size: int):
        self.model, self.args = model, model.args
        self.block_size, self.max_model_len = block_size, max_model_len
        self.tp = model.tp
        self.device, self.dtype = model.device, model.dtype
        self.cache: KVCache | None = None
        self.vocab_size = self.args.vocab_size
        model.set_positions(max_model_len)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.mtp_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # the MTP drafter's
        self._h_in = self._h_out = None  # with MTP graphs: the drafter graphs' input and every graph's output hidden
        self.graph_batch_sizes: list[int] = []
        self.tokens: torch.Tensor | None = None  # the last step's sampled tokens on the device ([n_sample] int64)
        self._tok: torch.Tensor | None = None  # with graphs: the static buffer `tokens` lives in
        self._replayed = 0  # rows of the last step if it was a graph replay (its greedy tokens are in _tok), else 0
        self.hidden_NE: torch.Tensor | None = None  # the last keep_hidden or drafter forward's output (infer/spec.py)

    # ---- the cache -----------------------------------------------------------------------------------------------------
    def allocate_cache(self, num_blocks: int, shape) -> None:
        self.cache = KVCache(shape, num_blocks, self.block_size, self.dtype, self.device)

    # ---- forward -----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, b: StepBatch, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n_sample, vocab] of the rows b.logits_idx (into `logits_out` when given)."""
        return self.model.forward(b, self.cache, logits_out)

    def greedy(self, logits_SV: torch.Tensor) -> torch.Tensor:
        """The greedy tokens [n_sample] int64 of the last step's logits: computed inside its graph if it was replayed."""
        if self._replayed:
            return self._tok[:self._replayed]
        return logits_SV.argmax(dim=-1)

    def keep_tokens(self, tokens_S: torch.Tensor) -> None:
        """The step's sampled tokens (on the device): the inputs of the next step's decode rows that name them."""
        if self._tok is None or not tokens_S.is_cuda:
            self.tokens = tokens_S
            return
        if tokens_S.data_ptr() != self._tok.data_ptr():
            self._tok[:len(tokens_S)].copy_(tokens_S)
        self.tokens = self._tok

    # ---- CUDA graphs ------------------------------------------------------------------------------------------------
    def graph_key(self, b: HostBatch, rows: int = 0) -> tuple[int, int] | None:
        """The captured graph that can run this step: decode-only, batch padded up to a captured size, block tables
        padded up to a captured width. A target step that keeps its hidden states, or an MTP drafter step, needs the
        MTP graphs (capture_graphs(mtp=True)); its key is then one of `mtp_graphs` for a drafter step. `rows`:
        under dp-attention the step's agreed rows per rank, so that every rank replays the same batch size."""
        mtp = b.keep_hidden or b.hidden_rows is not None
        if not self.graphs or b.n_decode != len(b.ids) or (mtp and self._h_out is None):
            return None
        i = bisect.bisect_left(self.graph_batch_sizes, max(b.n_decode, rows))
        if i == len(self.graph_batch_sizes):
            return None
        j = bisect.bisect_left(self._widths, b.block_tables.shape[1])
        return (self.graph_batch_sizes[i], self._widths[j]) if j < len(self._widths) else None

    def _graph_inputs(self, bsz: int, m: int) -> tuple[StepBatch, torch.Tensor]:
        """The step of graph (bsz, m) as views of the flat input buffers (int64: ids, positions, slots, input-token
        sources, adapter slots; int32: context lengths, block tables), and its input-token sources."""
        i64, i32 = self._i64, self._i32
        ids, pos, slots, src = (i64[k * bsz:(k + 1) * bsz] for k in range(4))
        empty32 = i32[:0]
        sb = StepBatch(ids, pos, slots, bsz, i32[bsz:bsz + bsz * m].view(bsz, m), i32[:bsz], empty32, empty32,
                       slots[:0], [], self._rows[:bsz], every_row=True,
                       lora=i64[4 * bsz:5 * bsz] if self._fields == 5 else None)
        return sb, src

    def _graph_step(self, bsz: int, m: int) -> torch.Tensor:
        sb, src = self._graph_inputs(bsz, m)
        # Rows whose input token is still on the device take it from the previous step's tokens.
        sb.input_ids = torch.where(src >= 0, self._tok[src.clamp(min=0)], sb.input_ids)
        if self._h_out is None:
            logits = self.forward(sb, self._logits[:bsz])
        else:  # the last block's output kept for the MTP drafter
            x_NE = self.model.trunk(sb, self.cache)
            self._h_out[:bsz].copy_(x_NE)
            logits = self.model.head(x_NE, sb, self._logits[:bsz])
        torch.argmax(logits, dim=-1, out=self._tok[:bsz])
        return logits

    def _mtp_graph_step(self, bsz: int, m: int) -> torch.Tensor:
        """The MTP drafter over decode rows: input hidden states from _h_in (gathered before the replay), its
        output into _h_out (the next draft's input)."""
        sb, _ = self._graph_inputs(bsz, m)
        logits, x_NE = self.model.forward_mtp(sb, self.cache, self._h_in[:bsz])
        self._h_out[:bsz].copy_(x_NE)
        return self._logits[:bsz].copy_(logits)

    @torch.no_grad()
    def capture_graphs(self, batch_sizes: list[int], widths: list[int], mtp: bool = False) -> None:
        """Capture the decode step for each (batch size, block-table width), largest first, sharing one memory pool.
        `mtp`: the decode steps also keep their hidden states (in _h_out), and the MTP drafter's step over decode
        rows is captured for the same keys."""
        bmax, wmax, dev = max(batch_sizes), max(widths), self.device
        # A fifth int64 field with adapters (infer/lora.py): each row's slot, -1 the base; the graphs always apply them.
        self._fields = 5 if self.model.lora is not None else 4
        self._i64 = torch.zeros(self._fields * bmax, dtype=torch.int64, device=dev)
        self._i32 = torch.zeros(bmax * (1 + wmax), dtype=torch.int32, device=dev)
        self._rows = torch.arange(bmax, dtype=torch.int64, device=dev)
        self._tok = torch.zeros(bmax, dtype=torch.int64, device=dev)
        # Pinned host twins, two of each: the next step fills one while the other may still be copying.
        self._pinned = [(torch.zeros(self._fields * bmax, dtype=torch.int64).pin_memory(),
                         torch.zeros(bmax * (1 + wmax), dtype=torch.int32).pin_memory()) for _ in range(2)]
        self._flip = 0
        pool = torch.cuda.graph_pool_handle()
        self._logits = torch.empty((bmax, self.vocab_size), dtype=self.dtype, device=dev)
        if mtp:
            self._h_in, self._h_out = (torch.zeros((bmax, self.args.dim), dtype=self.dtype, device=dev)
                                       for _ in range(2))
        steps = [(self.graphs, self._graph_step)] + ([(self.mtp_graphs, self._mtp_graph_step)] if mtp else [])
        for m in sorted(widths, reverse=True):
            for bsz in sorted(batch_sizes, reverse=True):
                for graphs, step in steps:
                    self._fill(bsz, m, None)  # a valid step: padding rows throughout
                    step(bsz, m)  # warm-up: kernels compiled, workspaces sized, outside capture
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool):
                        out = step(bsz, m)
                    graphs[(bsz, m)] = (g, out)
        self.graph_batch_sizes, self._widths = sorted(batch_sizes), sorted(widths)
        torch.cuda.synchronize()

    def _fill(self, bsz: int, m: int, hb: HostBatch | None, src=None) -> None:
        """Write the step's inputs into the pinned twins and copy them to the graph's buffers (asynchronously).
        Padding rows: token 0 at position 0 written into the padding block (slot 0), a context of one token. Block
        table entries past a row's context are never read (the decode kernels mask their loads by the context), so
        only the padding rows' first entry is set."""
        self._flip ^= 1
        h64, h32 = self._pinned[self._flip]
        a, b = h64.numpy(), h32.numpy()
        n = hb.n_decode if hb is not None else 0
        F = self._fields
        a[:F * bsz] = 0
        a[3 * bsz:F * bsz] = -1  # no input from the device; the base model (no adapter)
        b[:bsz] = 1
        bt = b[bsz:bsz + bsz * m].reshape(bsz, m)
        bt[n:, 0] = 0
        if n:
            a[:n], a[bsz:bsz + n], a[2 * bsz:2 * bsz + n] = hb.ids, hb.pos, hb.slots
            if src is not None:
                a[3 * bsz:3 * bsz + n] = src
            if F == 5 and hb.lora is not None:
                a[4 * bsz:4 * bsz + n] = hb.lora[:n]
            b[:n] = hb.context_lens
            bt[:n, :hb.block_tables.shape[1]] = hb.block_tables
        self._i64[:F * bsz].copy_(h64[:F * bsz], non_blocking=True)
        self._i32[:bsz * (1 + m)].copy_(h32[:bsz * (1 + m)], non_blocking=True)

    @torch.no_grad()
    def run(self, hb: HostBatch, src=None, moe_rows: int = 0, eager: bool = False) -> torch.Tensor:
        """The step's logits. `src`: for each decode row, the row of `self.tokens` (a previous step's sampled tokens,
        still on the device) that is its input token, or -1 (its token is hb.ids[row]). Under dp-attention
        (infer/ep.py) `moe_rows` is the step's agreed rows per rank and `eager` the ranks' agreement to run it
        eagerly: every rank then takes the same path with the same MoE sizes."""
        key = None if eager else self.graph_key(hb, moe_rows)
        if hb.hidden_rows is not None:  # the MTP drafter
            self._replayed = 0
            rows = _to_device(torch.from_numpy(np.asarray(hb.hidden_rows, dtype=np.int64)), self.device)
            if key is None:
                b = hb.to_device(self.device)
                logits, self.hidden_NE = self.model.forward_mtp(b, self.cache, self.hidden_NE.index_select(0, rows))
                return logits
            torch.index_select(self.hidden_NE, 0, rows, out=self._h_in[:len(rows)])
            return self._replay(self.mtp_graphs, key, hb, None)
        if key is None:
            self._replayed = 0
            b = hb.to_device(self.device)
            b.moe_rows = moe_rows
            if src is not None and (np.asarray(src) >= 0).any():
                _patch_ids(b.input_ids, src, self.tokens)
            if hb.keep_hidden:  # for the MTP drafter: eager, its last-block output kept
                self.hidden_NE = self.model.trunk(b, self.cache)
                return self.model.head(self.hidden_NE, b)
            return self.forward(b)
        return self._replay(self.graphs, key, hb, src)

    def _replay(self, graphs: dict, key: tuple[int, int], hb: HostBatch, src) -> torch.Tensor:
        """Replay graph `key` on the step; its logits of the rows hb.logits_idx (every row: a view of the graph's
        output, whose greedy tokens the graph computed)."""
        bsz, m = key
        self._fill(bsz, m, hb, src)
        g, out = graphs[key]
        g.replay()
        n = hb.n_decode
        if self._h_out is not None:
            self.hidden_NE = self._h_out[:n]
        idx = np.asarray(hb.logits_idx)
        if len(idx) == n and (idx == np.arange(n)).all():
            self._replayed = n if graphs is self.graphs else 0
            return out[:n]
        self._replayed = 0
        return out.index_select(0, _to_device(torch.from_numpy(idx.astype(np.int64)), self.device))


def _to_device(x: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on the device without waiting for the GPU: a copy from pageable memory may wait for the work
    already queued on the stream (it would undo the overlapped steps), one from pinned memory does not (torch's
    pinned-memory cache keeps the buffer until the copy has run)."""
    if torch.device(device).type != "cuda":
        return x
    return x.pin_memory().to(device, non_blocking=True)


def _patch_ids(ids_N: torch.Tensor, src, tokens: torch.Tensor) -> None:
    """ids_N[i] = tokens[src[i]] for the decode rows i with src[i] >= 0 (an eager step's inputs)."""
    src = np.asarray(src, dtype=np.int64)
    rows = np.flatnonzero(src >= 0)
    dev = ids_N.device
    ids_N.index_copy_(0, _to_device(torch.from_numpy(rows), dev),
                      tokens.index_select(0, _to_device(torch.from_numpy(src[rows]), dev)))
