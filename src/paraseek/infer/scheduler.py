"""Continuous batching (Orca, Yu et al. 2022) with chunked prefill (Sarathi, Agrawal et al. 2023) over the paged
cache: every step spends a token budget on, in order, one token for each running decode, the next chunk of each
running prefill, then new requests in order of priority (lower first, as vLLM's `priority`; equal priorities in
arrival order) while KV blocks and sequence slots are free.

When a running request needs a block and none is free, the most recently admitted running request is preempted by
recompute: its blocks are released (its full blocks stay in the prefix cache, so the recompute is mostly hits) and
it goes back to the front of the waiting queue with its generated tokens kept. Nothing is ever allocated that the
pool does not have, so a full cache slows requests down instead of ending the process.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import torch

from paraseek.infer.cache import BlockPool
from paraseek.infer.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int] = frozenset()  # the model's end tokens (unless ignore_eos) plus the request's own
    arrival: float = field(default_factory=time.perf_counter)
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_computed: int = 0  # tokens whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks registered so far
    status: Status = Status.WAITING
    finish_reason: str | None = None  # stop | length | abort
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    priority: int = 0  # lower is admitted first (vLLM's); equal priorities in arrival order
    first_scheduled_time: float | None = None  # first admission: the queue time ends, the prefill starts
    first_token_time: float | None = None
    finish_time: float | None = None
    generator: torch.Generator | None = None
    sample_seed: int = 0  # the sampler's noise key with the output position (sampling.race_reference)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    stream: object | None = None  # engine.TextStream when the text is kept as it grows
    grammar: object | None = None  # structured.Constraint of a grammar-constrained request
    device_sampled: bool = False  # no penalties, log-probabilities or min_tokens: sampled from the logits alone
    # Overlapped steps (engine.py): a token sampled by the step still on the device sits at the tail of token_ids
    # as a placeholder until it is read back; `pending` counts them (0, 1 or 2), `sample_row` is the row of that
    # step's sampled tokens the newest one comes from, and `last_pending` says it will be the request's last.
    pending: int = 0
    sample_row: int = -1
    last_pending: bool = False
    last_token_id: int = -1  # the newest token read back: what a step's caller delivers
    lora_slot: int = -1  # the LoRA adapter's slot (infer/lora.py); -1: the base model
    cache_salt: bytes | None = None  # the prefix-cache key's seed (the adapter's): BlockPool.match_prefix
    # Speculative decoding (infer/spec.py): the drafts its next step verifies after its last token (not part of
    # token_ids until accepted), their draft distributions [len(drafts), V] (MTP drafts of a sampled request;
    # None: drafted deterministically), the tokens its last step delivered, and its drafts proposed and accepted.
    drafts: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    step_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt


@dataclass(slots=True)
class Scheduled:
    """One request's share of a step: tokens [start, start + n) of its token_ids, the last `num_drafts` of them its
    first drafts (request.drafts, verified by this step); `sample` when the chunk reaches the last known token, so
    the step yields the request's next token (and its accepted drafts)."""

    request: Request
    start: int
    n: int
    num_drafts: int = 0

    @property
    def sample(self) -> bool:
        return self.start + self.n - self.num_drafts == len(self.request.token_ids)


@dataclass
class StepPlan:
    items: list[Scheduled]  # single-token items (decodes) first, then multi-token prefill chunks
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.n for s in self.items)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_batched_tokens: int, max_model_len: int,
                 drafter_reads_next_token: bool = False):
        self.pool = pool
        self.max_num_seqs, self.max_batched_tokens, self.max_model_len = max_num_seqs, max_batched_tokens, max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is the first to be preempted
        self.num_preemptions = 0
        # The MTP drafter's cache row of position i is computed from token i + 1 (infer/spec.py), which the prefix
        # cache's key of i's block does not cover when i ends the block: a prefix hit's last block is recomputed
        # (vLLM drops it for EAGLE likewise), so that every drafter row a request reads was made from its own tokens.
        self.drafter_reads_next_token = drafter_reads_next_token

    def add(self, req: Request) -> None:
        """Queue behind every waiting request of the same or a better (lower) priority."""
        w = self.waiting
        if not w or w[-1].priority <= req.priority:
            w.append(req)
        else:
            w.insert(next(i for i, r in enumerate(w) if r.priority > req.priority), req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        budget = self.max_batched_tokens
        decodes: list[Scheduled] = []
        prefills: list[Scheduled] = []
        preempted: list[Request] = []
        scheduled: set[int] = set()
        bs = self.pool.block_size

        # 1. Running requests: decodes (one token) before unfinished prefills, each in admission order.
        running = list(self.running)
        order = [r for r in running if len(r.token_ids) - r.num_computed == 1 and not r.last_pending]
        order += [r for r in running if len(r.token_ids) - r.num_computed > 1]
        for req in order:
            if budget == 0:
                break
            if req.status is not Status.RUNNING:  # preempted earlier in this step
                continue
            remaining = len(req.token_ids) - req.num_computed
            drafts = self._drafts_that_fit(req, budget) if remaining == 1 and req.drafts else 0
            if remaining == 1 and not drafts and req.num_computed < len(req.blocks) * bs:  # room in its last block
                decodes.append(Scheduled(req, req.num_computed, 1))
                scheduled.add(id(req))
                budget -= 1
                continue
            n = min(remaining + drafts, budget)
            upto = req.num_computed + n
            need = 0 if upto <= len(req.blocks) * bs else self._blocks_needed(req, upto)
            while need > self.pool.num_free:
                victim = next((r for r in reversed(self.running) if id(r) not in scheduled), None)
                if victim is None:
                    break
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING or need > self.pool.num_free:
                continue
            if need:
                req.blocks += self.pool.allocate(need)
            (decodes if remaining == 1 and not drafts else prefills).append(Scheduled(req, req.num_computed, n, drafts))
            scheduled.add(id(req))
            budget -= n

        # 2. New (and preempted) requests, first come first served, only in a step that preempted nobody.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_computed == 0 and not req.blocks:
                # Keep at least the last token to compute: its logits give the next token.
                hit, hashes = self.pool.match_prefix(req.token_ids, (len(req.token_ids) - 1) // bs, req.cache_salt)
                if self.drafter_reads_next_token and hit:
                    self.pool.release(hit[-1:])
                    hit, hashes = hit[:-1], hashes[:-1]
                req.blocks, req.block_hashes, req.num_computed = hit, hashes, len(hit) * bs
                if req.num_preemptions == 0:
                    req.num_cached_tokens = req.num_computed
            n = min(len(req.token_ids) - req.num_computed, budget)
            need = self._blocks_needed(req, req.num_computed + n)
            if need > self.pool.num_free:  # wait for blocks; give back the prefix hits until then
                self.pool.release(req.blocks)
                req.blocks, req.block_hashes, req.num_computed = [], [], 0
                break
            self.waiting.popleft()
            req.blocks += self.pool.allocate(need)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.perf_counter()
            req.status = Status.RUNNING
            self.running.append(req)
            (decodes if n == 1 else prefills).append(Scheduled(req, req.num_computed, n))
            scheduled.add(id(req))
            budget -= n

        items = decodes + prefills
        for s in items:
            if len(s.request.block_hashes) < (s.start + s.n) // bs:  # checked here: a call per item costs
                self.register_full_blocks(s.request, s.start + s.n)
        return StepPlan(items, preempted)

    def _drafts_that_fit(self, req: Request, budget: int) -> int:
        """How many of a decode's drafts its step verifies: what the token budget leaves after its last token and
        the slots it holds or the pool has free. Drafts are optional: no request is preempted for them."""
        room = (len(req.blocks) + self.pool.num_free) * self.pool.block_size - req.num_computed - 1
        return max(0, min(len(req.drafts), budget - 1, room))

    def release_past(self, req: Request, upto: int) -> None:
        """Give back the blocks that hold no position below `upto` (after a verification: blocks that held only
        rejected drafts and that the next drafts do not need). They were never registered: they held no full
        block of known tokens."""
        keep = -(-upto // self.pool.block_size)
        if len(req.blocks) > keep:
            self.pool.release(req.blocks[keep:])
            del req.blocks[keep:]

    def grow(self, req: Request, upto: int) -> bool:
        """Blocks for positions below `upto` from the free pool, without preempting; False if there are too few."""
        need = self._blocks_needed(req, upto)
        if need > self.pool.num_free:
            return False
        if need:
            req.blocks += self.pool.allocate(need)
        return True

    def _blocks_needed(self, req: Request, upto: int) -> int:
        bs = self.pool.block_size
        return max(0, -(-upto // bs) - len(req.blocks))

    def register_full_blocks(self, req: Request, upto: int) -> None:
        """Blocks that this step fills become findable by later prompts (their K/V are written in this step's
        forward, which runs before any later step's). A block that holds a placeholder waits until it is read back
        (the engine registers it then)."""
        bs = self.pool.block_size
        upto = min(upto, len(req.token_ids) - req.pending)
        while len(req.block_hashes) < upto // bs:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else req.cache_salt
            h = self.pool.chain_hash(parent, tuple(req.token_ids[i * bs:(i + 1) * bs]))
            self.pool.register(req.blocks[i], h)
            req.block_hashes.append(h)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pool.release(req.blocks)
        req.blocks, req.block_hashes, req.num_computed = [], [], 0
        req.drafts, req.draft_probs = [], None  # they followed its last token; the recompute samples the next anew
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        w = self.waiting  # first among its priority: it was admitted before them
        if not w or w[0].priority >= req.priority:
            w.appendleft(req)
        else:
            w.insert(next((i for i, r in enumerate(w) if r.priority >= req.priority), len(w)), req)

    # ---- after the step -----------------------------------------------------------------------------------------
    def finish(self, req: Request, reason: str) -> None:
        """Release a request's blocks (running, waiting or being aborted); its full blocks stay cached."""
        if req.status is Status.FINISHED:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.pool.release(req.blocks)
        req.blocks = []
        req.status, req.finish_reason = Status.FINISHED, reason
        req.finish_time = time.perf_counter()
