"""The paged KV cache: fixed-size blocks of token slots, a block table per sequence, reference counts, and a prefix
cache of full blocks keyed by their contents (PagedAttention, Kwon et al. 2023; automatic prefix caching as vLLM's).

Block 0 is never handed out: padded rows of a CUDA-graph batch write their K/V there.

A full block is registered under SHA-256 of (the previous block's hash, its token ids), so equal prefixes map to
equal chains. The first block's "previous hash" is the request's cache salt when it has one (a LoRA adapter's,
infer/lora.py): K/V computed under one adapter are found by prompts of that adapter only, never by another's or the
base model's. The hash is collision-resistant because a hit serves the cached K/V without comparing tokens: with a
64-bit hash (Python's hash() of the tuple) two different prefixes could share a key, and a request would be served
another request's cache, another tenant's on a shared server (vLLM moved to SHA-256 for the same reason,
CVE-2025-25183). A block whose last user finished stays cached until it is needed for new tokens; free blocks are
reused least recently freed first, blocks that never held a full prefix before cached ones.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from paraseek.infer.kv_fp8 import SCALE_BYTES, dequantize_rows
from paraseek.models.args import ModelArgs
from paraseek.models.hf import E4M3


@dataclass(frozen=True)
class CacheShape:
    """The per-layer, per-token layout of this model's cache on one tp rank."""

    n_layers: int
    mla: bool
    kv_heads: int  # local kv heads (MHA/GQA); 1 for MLA's shared latent
    k_dim: int  # head dim (MHA/GQA) or kv_lora_rank + qk_rope_head_dim (MLA: latent then rope key)
    v_dim: int  # head dim (MHA/GQA); 0 for MLA (the value is the latent itself)
    fp8: bool = False  # e4m3 rows with one fp32 scale each (infer/kv_fp8.py), else the model's dtype

    @classmethod
    def of(cls, a: ModelArgs, tp: int, mtp_layers: int = 0, fp8: bool = False) -> CacheShape:
        """`mtp_layers`: the MTP drafter's blocks (infer/spec.py), cached after the model's layers (layer index
        n_layers + k), in the same blocks and slots: a sequence's drafter K/V comes and goes with its own."""
        n = a.n_layers + mtp_layers
        if a.is_mla:  # not split by heads: every tp rank holds the whole latent (as the planner assumes)
            return cls(n, True, 1, a.kv_lora_rank + a.qk_rope_head_dim, 0, fp8)
        return cls(n, False, max(a.n_kv_heads // tp, 1), a.head_dim, a.head_dim, fp8)

    @property
    def rows_per_token(self) -> int:
        """Rows per token and layer, one scale each in fp8: MLA's one latent row; K and V of each kv head."""
        return 1 if self.mla else 2 * self.kv_heads

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """All layers' bytes of one token: in `dtype` (the model's), or e4m3 plus the rows' scales when fp8."""
        values = self.n_layers * self.kv_heads * (self.k_dim + self.v_dim)
        if self.fp8:
            return values + self.n_layers * self.rows_per_token * SCALE_BYTES
        return values * torch.empty((), dtype=dtype).element_size()


class KVCache:
    """The cache tensors. MHA/GQA: per layer `kv[l]` [S, 2, G, D] (a token's K and V side by side, so one copy
    writes both), with `k[l]`, `v[l]` its [S, G, D] views; MLA: `k[l]` [S, C + R]. S = slots.

    FP8 (shape.fp8): the same tensors in e4m3, and beside them each row's fp32 scale: `kv_scale[l]` [S, 2, G] with
    `k_scale[l]`, `v_scale[l]` its [S, G] views (MHA/GQA), `k_scale[l]` [S] (MLA). Otherwise the scale lists hold
    None, which the ops read as "no scales". `dtype` is the model's: what prefill reads the context back in."""

    def __init__(self, shape: CacheShape, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        self.shape, self.num_blocks, self.block_size, self.dtype = shape, num_blocks, block_size, dtype
        S, L = num_blocks * block_size, shape.n_layers
        store = E4M3 if shape.fp8 else dtype
        self.kv_scale, self.k_scale, self.v_scale = [None] * L, [None] * L, [None] * L
        if shape.mla:
            whole = torch.zeros((L, S, shape.k_dim), dtype=store, device=device)
            self.kv, self.k, self.v = [None] * L, list(whole), [None] * L
            if shape.fp8:
                self.k_scale = list(torch.zeros((L, S), dtype=torch.float32, device=device))
        else:
            whole = torch.zeros((L, S, 2, shape.kv_heads, shape.k_dim), dtype=store, device=device)
            self.kv = list(whole)
            self.k, self.v = [w[:, 0] for w in whole], [w[:, 1] for w in whole]
            if shape.fp8:
                self.kv_scale = list(torch.zeros((L, S, 2, shape.kv_heads), dtype=torch.float32, device=device))
                self.k_scale, self.v_scale = [s[:, 0] for s in self.kv_scale], [s[:, 1] for s in self.kv_scale]

    def context_kv(self, layer: int, slots_K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MHA/GQA: the K and V rows [K, G, D] of these slots in the model's dtype (prefill's context)."""
        if not self.shape.fp8:
            return self.k[layer][slots_K], self.v[layer][slots_K]
        kv_K2GD = dequantize_rows(self.kv[layer][slots_K], self.kv_scale[layer][slots_K], self.dtype)
        return kv_K2GD[:, 0], kv_K2GD[:, 1]

    def context_latent(self, layer: int, slots_K: torch.Tensor) -> torch.Tensor:
        """MLA: the latent rows [K, C + R] of these slots in the model's dtype (prefill's context)."""
        if not self.shape.fp8:
            return self.k[layer][slots_K]
        return dequantize_rows(self.k[layer][slots_K], self.k_scale[layer][slots_K], self.dtype)


class BlockPool:
    """Block ids 1..num_blocks-1 with reference counts and the prefix cache. Pure Python: the scheduler's."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError("the KV pool needs at least 2 blocks (block 0 is the padding block)")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks  # the prefix hash a block is registered under
        self.cached: dict[bytes, int] = {}  # prefix hash -> block id
        # Blocks with ref 0, first out first. Never-registered blocks go to the front, registered ones to the back.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.hits = self.queries = 0  # prefix-cache hit rate, in blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free)} free")  # the scheduler checks first
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            if self.hash_of[b] is not None:  # evict its cached prefix
                del self.cached[self.hash_of[b]]
                self.hash_of[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        # Last block first, so that a sequence's tail (the least shared part) is evicted before its head.
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
                if self.hash_of[b] is None:
                    self.free.move_to_end(b, last=False)

    # ---- the prefix cache -------------------------------------------------------------------------------------------
    @staticmethod
    def chain_hash(parent: bytes | None, tokens) -> bytes:
        """SHA-256 of the parent block's hash (32 zero bytes for the first block) and the block's token ids as
        little-endian int64s: deterministic across processes, and no two prefixes share a key in practice."""
        h = hashlib.sha256(parent if parent is not None else bytes(32))
        h.update(np.asarray(tokens, dtype="<i8").tobytes())
        return h.digest()

    def register(self, block: int, block_hash: bytes) -> None:
        """Make a full block findable by later prompts (a second block with the same contents stays private)."""
        if self.prefix_caching and block_hash not in self.cached and self.hash_of[block] is None:
            self.cached[block_hash] = block
            self.hash_of[block] = block_hash

    def match_prefix(self, token_ids: list[int], max_blocks: int,
                     salt: bytes | None = None) -> tuple[list[int], list[bytes]]:
        """The longest chain of cached full blocks that starts `token_ids` (at most max_blocks) under `salt` (the
        first block's parent), taken by the caller (reference counts raised): (block ids, their hashes)."""
        blocks: list[int] = []
        hashes: list[bytes] = []
        if not self.prefix_caching:
            return blocks, hashes
        bs, parent = self.block_size, salt
        for i in range(max_blocks):
            h = self.chain_hash(parent, tuple(token_ids[i * bs:(i + 1) * bs]))
            b = self.cached.get(h)
            self.queries += 1
            if b is None:
                break
            self.hits += 1
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
            blocks.append(b)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def reset_prefix_cache(self) -> None:
        for h, b in list(self.cached.items()):
            self.hash_of[b] = None
        self.cached.clear()
