"""Speculative decoding: a drafter proposes the next K tokens of a request, the target model verifies them all in one
forward, and the step delivers the accepted drafts plus one token of the target's own (Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling").

Verification. A drafting request's step is K + 1 tokens over its paged context (the last known token, then the
drafts: scheduler.Scheduled.num_drafts), laid out as K + 1 decode rows (engine._host_batch: row j at position
start + j with a context of start + j + 1, causal as a chunk, and replayed by the decode CUDA graphs when the step
is decode-only), with logits for every row: row j
is the target's distribution p_j of the token after draft j (after the request's own transforms: masks, penalties
that count drafts 1..j as output, temperature, top-k/p, min-p, exactly as plain sampling, sampling.distributions).
  - greedy: drafts are accepted while each equals the target's argmax at its position; the next token is the
    argmax at the first mismatch (or after the last draft): exactly plain greedy decoding's tokens.
  - sampled: draft x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)), q_j the distribution it was drawn
    from (one-hot for a deterministic draft: accepted with p_j(x_j)); at the first rejection the token is drawn from
    normalize(max(0, p_j - q_j)); after K accepted drafts the bonus token is drawn from p_K. Each emitted token is then
    distributed as the target's (Leviathan et al., appendix A.1). Draws come from the request's own generator.

Drafters.
  - ngram (prompt lookup, Saxena 2023; vLLM's "ngram"): the longest suffix of the sequence of length in
    [--ngram-min, --ngram-max] that occurred earlier in it; the K tokens that followed its latest earlier occurrence
    are the drafts. On the host, from the token ids alone.
  - mtp: DeepSeek-V3's multi-token-prediction module (model.MTPLayer). Its cache row of position i combines the
    target's last-block output h_i with the embedding of token i + 1, so after each step its rows are filled for
    the positions the step verified (from the hidden states that step's forward kept); the row of the last one,
    whose next token is the step's new token, gives draft 1. Further drafts reuse the same module one position on
    (its own output as the hidden state, the previous draft as the token: V3 ships one module; vLLM and SGLang
    draft deeper the same way). A greedy request's drafts are the module's argmax, a sampled request's are drawn
    from its distribution under the request's transforms, which is kept as q.

Which requests draft: every request of a speculative engine except a grammar-constrained one (its mask depends on the
tokens before, which the drafts would have to advance and roll back), at most max_tokens - 1 ahead of its output.
The KV cache: the K + 1 positions write their K/V; the accepted prefix counts as computed, and a rejected position's
slot is simply rewritten later. After the step a request keeps the blocks its next drafts need; blocks that held
only rejected positions go back to the pool. No block holding an unverified token is ever registered in the prefix
cache (registration stops at the last known token). Speculative steps are synchronous (the next drafts need the
accepted tokens on the host). CUDA graphs: a step without prefill chunks (verifications and decodes, all decode rows)
replays the decode graph of its row count; with the MTP drafter those graphs also keep the last block's output, and
the drafter's steps (each position a decode row, its hidden state gathered from the kept output before the replay)
replay graphs of their own (runner.capture_graphs(mtp=True)).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from paraseek.infer.sampling import SampleRow, chosen_logprobs, distributions, draw, sample_rows_per_chunk


# ---- drafting on the host -------------------------------------------------------------------------------------------
def ngram_drafts(token_ids, n_min: int, n_max: int, k: int) -> list[int]:
    """Prompt lookup: for n from n_max down to n_min, the suffix of length n that occurred earlier in the sequence;
    the (up to) k tokens that followed its latest earlier occurrence. [] when no suffix in the range recurs."""
    a = np.asarray(token_ids, dtype=np.int64)
    L = len(a)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        # Windows of a[:L - 1]: the occurrences that end before the last token (the suffix itself starts at L - n).
        windows_Wn = np.lib.stride_tricks.sliding_window_view(a[:L - 1], n)
        hits = np.flatnonzero((windows_Wn == a[L - n:]).all(axis=1))
        if hits.size:
            after = int(hits[-1]) + n
            return a[after:after + k].tolist()
    return []


class NgramIndex:
    """ngram_drafts of one growing sequence without rescanning it: for each n in [n_min, n_max], a dict from every
    n-gram that ends before the sequence's last token to the start of its latest occurrence, extended by the tokens
    appended since the last lookup (a step adds a few: O(new tokens x lengths) per step instead of O(context)). The
    sequence only grows while its request drafts; a sequence that is another list or shorter is indexed anew."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self._reset(None)

    def _reset(self, token_ids: list[int] | None) -> None:
        self.latest: dict[int, dict[tuple, int]] = {n: {} for n in range(self.n_min, self.n_max + 1)}
        self.tokens = token_ids  # the indexed sequence (the request's own list)
        self.length = 0  # its length at the last lookup

    def drafts(self, token_ids: list[int], k: int) -> list[int]:
        """ngram_drafts(token_ids, n_min, n_max, k)."""
        L = len(token_ids)
        if token_ids is not self.tokens or L < self.length:
            self._reset(token_ids)
        for n, latest in self.latest.items():
            # The n-grams of token_ids[:L - 1] not indexed yet: starts from (old L - 1) - n + 1 to (L - 1) - n.
            for i in range(max(0, self.length - n), L - n):
                latest[tuple(token_ids[i:i + n])] = i
        self.length = L
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            i = self.latest[n].get(tuple(token_ids[L - n:]))
            if i is not None:
                return token_ids[i + n:i + n + k]
        return []


# ---- accepted-draft counts ------------------------------------------------------------------------------------------
@dataclass
class SpecStats:
    """Verification steps with drafts, drafts proposed and accepted, and both per draft position (vLLM's
    spec_decode counters)."""

    k: int
    num_drafts: int = 0  # verification steps of one request that had drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    proposed_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    plain_steps: int = 0  # engine steps without drafting: more requests ran than --speculative-max-batch

    def __post_init__(self) -> None:
        self.proposed_per_pos = self.proposed_per_pos or [0] * self.k
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.k

    def add(self, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for j in range(proposed):
            self.proposed_per_pos[j] += 1
            self.accepted_per_pos[j] += j < accepted

    def summary(self) -> dict:
        """The share of drafts accepted per draft position (accepted / proposed) and the mean accepted length: tokens a verification
        step delivers on average, its own token included (1 + accepted / steps, as vLLM reports it)."""
        return {"drafts": self.num_drafts, "draft_tokens": self.num_draft_tokens,
                "accepted_tokens": self.num_accepted_tokens,
                "accept_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None,
                "accepted_per_position": [a / p if p else None for a, p in zip(self.accepted_per_pos,
                                                                                 self.proposed_per_pos)],
                "mean_accepted_length": 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None,
                "plain_steps": self.plain_steps}

    def since(self, before: SpecStats) -> SpecStats:
        """The counts added after the snapshot `before` (a copy taken with dataclasses.replace)."""
        return SpecStats(self.k, self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
                         self.num_accepted_tokens - before.num_accepted_tokens,
                         [a - b for a, b in zip(self.proposed_per_pos, before.proposed_per_pos)],
                         [a - b for a, b in zip(self.accepted_per_pos, before.accepted_per_pos)],
                         self.plain_steps - before.plain_steps)

    def snapshot(self) -> SpecStats:
        return dataclasses.replace(self, proposed_per_pos=list(self.proposed_per_pos),
                                   accepted_per_pos=list(self.accepted_per_pos))


# ---- verification ---------------------------------------------------------------------------------------------------
@dataclass
class Verify:
    """One request's rows of a verification step: its drafts, the distributions they were drawn from ([k, V]; None:
    deterministic drafts), and k + 1 sample rows (row j: the token after draft j, with drafts 1..j as output)."""

    drafts: list[int]
    draft_probs: torch.Tensor | None
    rows: list[SampleRow]


@dataclass
class Verdict:
    tokens: list[int]  # the accepted drafts, then the target's own token
    accepted: int
    logprobs: list[float | None] | None = None  # of each token, when its request asked for them
    top_logprobs: list[list[tuple[int, float]]] | None = None


def verify(logits_RV: torch.Tensor, groups: list[Verify]) -> list[Verdict]:
    """The tokens each group's step delivers, from the target's logits of its rows (groups' rows in order). In
    chunks of whole groups of at most sampling.SAMPLE_CHUNK_LOGITS logits (a lone group larger than that alone), as
    plain sampling bounds its memory."""
    step = sample_rows_per_chunk(logits_RV.shape[1])
    out: list[Verdict] = []
    r0 = i0 = rows = 0
    for i, g in enumerate(groups + [None]):
        if g is None or (rows and rows + len(g.rows) > step):
            out += _verify(logits_RV[r0:r0 + rows], groups[i0:i])
            r0, i0, rows = r0 + rows, i, 0
        if g is not None:
            rows += len(g.rows)
    return out


def verify_greedy(tokens_R: torch.Tensor, drafts: list[list[int]]) -> list[Verdict]:
    """verify for greedy requests whose logits need no transform (no penalty, mask, bias, min_tokens or
    log-probabilities): from the target's argmax of every row (groups' rows in order, len(drafts) + 1 each), one
    read back and the accepted counts in one array pass: a draft is accepted while it and every draft before it
    equal the argmax at their rows; the last token is the argmax at the row after the accepted ones."""
    tok_R = tokens_R.cpu().numpy()
    n_G = np.fromiter(map(len, drafts), np.int64, len(drafts))
    start_G = np.cumsum(n_G + 1) - (n_G + 1)
    K = int(n_G.max()) if len(drafts) else 0
    accepted_G = np.zeros(len(drafts), np.int64)
    if K:
        d_GK = np.full((len(drafts), K), -1, np.int64)  # -1: no draft, never a token
        d_GK[np.arange(K) < n_G[:, None]] = np.fromiter(chain.from_iterable(drafts), np.int64, int(n_G.sum()))
        rows_GK = np.minimum(start_G[:, None] + np.arange(K), len(tok_R) - 1)
        accepted_G = np.cumprod(d_GK == tok_R[rows_GK], axis=1).sum(axis=1)
    last_G = tok_R[start_G + accepted_G].tolist()
    return [Verdict(d[:a] + [t], a) for d, a, t in zip(drafts, accepted_G.tolist(), last_G)]


def _verify(logits_RV: torch.Tensor, groups: list[Verify]) -> list[Verdict]:
    rows = [r for g in groups for r in g.rows]
    d = distributions(logits_RV, rows)
    dev = logits_RV.device
    starts = np.cumsum([0] + [len(g.rows) for g in groups]).tolist()
    accepted = [0] * len(groups)
    greedy_RL = d.x_BV.argmax(dim=-1).tolist() if any(d.greedy) else None
    sampled = [i for i, g in enumerate(groups) if not g.rows[0].params.greedy]
    for i, g in enumerate(groups):
        if g.rows[0].params.greedy:
            while accepted[i] < len(g.drafts) and g.drafts[accepted[i]] == greedy_RL[starts[i] + accepted[i]]:
                accepted[i] += 1
    final: dict[int, int] = {}
    if sampled:
        # p normalized: top-p and min-p zero tokens without rescaling the rest (the draw does not need it).
        p_RV = d.probs_BV / d.probs_BV.sum(dim=-1, keepdim=True)
        drafting = [i for i in sampled if groups[i].drafts]
        if drafting:
            rows_D = torch.tensor([starts[i] + j for i in drafting for j in range(len(groups[i].drafts))], device=dev)
            toks_D = torch.tensor([t for i in drafting for t in groups[i].drafts], device=dev)
            p_D = p_RV[rows_D, toks_D]
            q_D = torch.cat([g.draft_probs[torch.arange(len(g.drafts), device=dev), torch.tensor(g.drafts, device=dev)]
                             if g.draft_probs is not None else torch.ones(len(g.drafts), device=dev)
                             for g in (groups[i] for i in drafting)])
            u_D = torch.cat([torch.rand(len(groups[i].drafts), device=dev, generator=groups[i].rows[0].generator)
                             for i in drafting])
            ok = (u_D * q_D < p_D).tolist()  # u < p / q, without dividing by a q of 0
            o = 0
            for i in drafting:
                k = len(groups[i].drafts)
                while accepted[i] < k and ok[o + accepted[i]]:
                    accepted[i] += 1
                o += k
        last_SV = []
        for i in sampled:
            g, a = groups[i], accepted[i]
            p_V = p_RV[starts[i] + a]
            if a < len(g.drafts):  # rejected: the residual max(0, p - q), q one-hot for a deterministic draft
                if g.draft_probs is not None:
                    res_V = (p_V - g.draft_probs[a].to(p_V.dtype)).clamp(min=0)
                else:
                    res_V = p_V.clone()
                    res_V[g.drafts[a]] = 0
                # An empty residual (p <= q everywhere: p = q up to rounding) leaves p itself.
                p_V = torch.where(res_V.sum() > 0, res_V, p_V)
            last_SV.append(p_V)
        tokens_S = draw(torch.stack(last_SV), [groups[i].rows[0].generator for i in sampled]).tolist()
        final = dict(zip(sampled, tokens_S))
    out = []
    for i, g in enumerate(groups):
        a = accepted[i]
        last = final[i] if i in final else greedy_RL[starts[i] + a]
        out.append(Verdict(g.drafts[:a] + [last], a))
    if d.logprobs_BV is not None:  # of the delivered tokens, at the rows that gave them
        want = [i for i, g in enumerate(groups) if g.rows[0].params.logprobs is not None]
        idx = [starts[i] + j for i in want for j in range(len(out[i].tokens))]
        lps, tops = chosen_logprobs(d.logprobs_BV[idx], torch.tensor([t for i in want for t in out[i].tokens],
                                                                     device=dev), [rows[r] for r in idx])
        o = 0
        for i in want:
            n = len(out[i].tokens)
            out[i].logprobs, out[i].top_logprobs = lps[o:o + n], tops[o:o + n]
            o += n
    return out


def verify_rows(first: SampleRow, req, drafts: list[int]) -> list[SampleRow]:
    """The sample rows of a drafting request's verification: `first` is its plain sample row (the engine's);
    row j sees drafts 1..j as output (the penalties count them, min_tokens' suppression counts them)."""
    p = first.params
    rows = [first]
    for j in range(1, len(drafts) + 1):
        rows.append(dataclasses.replace(
            first, output_ids=req.output_ids + drafts[:j] if p.penalized else [],
            suppress_ids=sorted(req.stop_ids) if req.num_output + j < p.min_tokens else []))
    return rows


# ---- the drafters ---------------------------------------------------------------------------------------------------
class Drafter:
    """What a speculative engine asks of its drafter: `propose` the next drafts of the requests of a step just
    verified (the step's plan items, whether each gave its request a token, and for MTP the hidden states the
    step's forward kept)."""

    keeps_hidden = False  # whether the target's forwards keep their hidden states for the drafter

    def __init__(self, k: int):
        self.k = k
        self.stats = SpecStats(k)
        # While more requests run than --speculative-max-batch: no drafts. The MTP drafter still fills its cache
        # rows of every verified position (its steps stay speculative steps without drafts), so that its drafts
        # after speculation resumes are the ones it would have made had it never paused.
        self.paused = False

    def limit(self, req) -> int:
        """The drafts a request may take now: K, at most max_tokens - 1 beyond its output (the step delivers one
        token of its own), none for a grammar-constrained request or while drafting is paused."""
        if req.grammar is not None or self.paused:
            return 0
        return max(0, min(self.k, req.params.max_tokens - req.num_output - 1))

    def propose(self, engine, items, sampled: list[bool]) -> None:
        raise NotImplementedError


class NgramDrafter(Drafter):
    def __init__(self, k: int, n_min: int, n_max: int):
        super().__init__(k)
        self.n_min, self.n_max = n_min, n_max
        self.index: dict[str, NgramIndex] = {}  # by request id, of the running requests

    def propose(self, engine, items, sampled: list[bool]) -> None:
        from paraseek.infer.scheduler import Status

        for s, got_token in zip(items, sampled):
            req = s.request
            if req.status is not Status.RUNNING:
                self.index.pop(req.request_id, None)
            elif got_token:
                k = self.limit(req)
                index = self.index.get(req.request_id)
                if index is None:
                    index = self.index[req.request_id] = NgramIndex(self.n_min, self.n_max)
                req.drafts = index.drafts(req.token_ids, k) if k else []
                req.draft_probs = None
        if len(self.index) > 2 * len(engine.requests) + 16:  # aborted requests' indexes
            self.index = {rid: ix for rid, ix in self.index.items() if rid in engine.requests}


@dataclass
class _Segment:
    """Rows of one request in a drafter forward: positions start.., their input tokens and input hidden rows."""

    req: object
    start: int
    ids: list[int]
    hidden: list[int]


class MtpDrafter(Drafter):
    keeps_hidden = True

    def propose(self, engine, items, sampled: list[bool]) -> None:
        from paraseek.infer.scheduler import Status

        # 1. The drafter's cache rows of the positions this step verified, from the target's hidden states of
        # those rows; the last row of a request that got a token gives its first draft.
        segs, drafting, row = [], [], 0
        for s, got_token in zip(items, sampled):
            req = s.request
            if req.status is Status.RUNNING and req.num_computed > s.start:
                n = req.num_computed - s.start  # row i reads token i + 1, known for every verified position
                segs.append(_Segment(req, s.start, req.token_ids[s.start + 1:s.start + n + 1],
                                     list(range(row, row + n))))
                if got_token and self.limit(req):
                    drafting.append(req)
            row += s.n
        for req in drafting:
            req.drafts, req.draft_probs = [], None
        if not segs:
            return
        want = {id(r) for r in drafting}
        hb, order = _drafter_batch(segs, engine.cfg.block_size, want, self.k + 1)
        logits_SV = engine._forward(hb)
        out_rows = {id(g.req): r for g, r in zip(order, _last_rows(order))}
        live = [g.req for g in order if id(g.req) in want]
        probs: dict[int, list[torch.Tensor]] = {id(r): [] for r in live}
        # 2. Each further draft: the module one position on, from its own output at the position before.
        while live:
            step = sample_rows_per_chunk(logits_SV.shape[1])  # bounded memory, as plain sampling's chunks
            for i in range(0, len(live), step):
                self._take(logits_SV[i:i + step], live[i:i + step], probs)
            live = [r for r in live if len(r.drafts) < self.limit(r)
                    and engine.scheduler.grow(r, r.num_computed + len(r.drafts))]  # the slot of its new row
            if not live:
                break
            segs = [_Segment(r, r.num_computed + len(r.drafts) - 1, [r.drafts[-1]], [out_rows[id(r)]]) for r in live]
            hb, order = _drafter_batch(segs, engine.cfg.block_size, {id(r) for r in live}, self.k + 1)
            logits_SV = engine._forward(hb)
            out_rows = {id(g.req): r for g, r in zip(order, _last_rows(order))}
            live = [g.req for g in order]
        for r in drafting:
            if probs[id(r)]:
                r.draft_probs = torch.stack(probs[id(r)])

    @staticmethod
    def _take(logits_SV: torch.Tensor, reqs: list, probs: dict) -> None:
        """Each request's next draft from the drafter's logits (rows in `reqs` order): a greedy request's argmax,
        a sampled request's draw from its distribution under the request's transforms (kept as q)."""
        if all(r.params.greedy and r.device_sampled for r in reqs):  # no transform: the argmax alone
            for r, t in zip(reqs, logits_SV.argmax(dim=-1).tolist()):
                r.drafts.append(t)
            return
        rows = [SampleRow(r.params, r.prompt_ids, [], r.generator) for r in reqs]
        d = distributions(logits_SV, rows)
        tokens = d.x_BV.argmax(dim=-1)
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if sampled:
            q_SV = d.probs_BV[sampled] / d.probs_BV[sampled].sum(dim=-1, keepdim=True)
            drawn = draw(q_SV, [reqs[i].generator for i in sampled])
            tokens[torch.tensor(sampled, device=tokens.device)] = drawn
            for i, q_V in zip(sampled, q_SV):
                probs[id(reqs[i])].append(q_V)
        for r, t in zip(reqs, tokens.tolist()):
            r.drafts.append(t)


def _last_rows(order: list[_Segment]) -> list[int]:
    """The row of each segment's last position in a drafter batch built by _drafter_batch."""
    out, row = [], 0
    for g in order:
        row += len(g.ids)
        out.append(row - 1)
    return out


def _drafter_batch(segs: list[_Segment], bs: int, want: set[int], max_rows: int):
    """The drafter's forward over the segments, with logits at the last row of each segment whose request is in `want`.
    A segment of up to `max_rows` positions (a verified step's, K + 1 at most, or one further draft) is decode rows
    over the request's block table in the drafter's cache layer (the row at position p: a context of p + 1, causal
    within the segment as a chunk; a step of decode rows alone replays the MTP graphs); a longer one (a prefill
    chunk's) is a chunk over its whole context, after the rows: per-row contexts would read its context once a row.
    Returns (HostBatch, the segments in row order)."""
    from paraseek.infer.runner import HostBatch

    order = [g for g in segs if len(g.ids) <= max_rows] + [g for g in segs if len(g.ids) > max_rows]
    rows = [g for g in order if len(g.ids) <= max_rows]
    nd = sum(len(g.ids) for g in rows)
    M = max([len(g.req.blocks) for g in rows], default=1)
    bt = np.zeros((nd, M), dtype=np.int32)
    ids, pos, slots, hidden, lens, k_slots, logits_idx = [], [], [], [], [], [], []
    row = 0
    for g in order:
        k = len(g.ids)
        blocks = np.asarray(g.req.blocks, dtype=np.int64)
        p = np.arange(g.start, g.start + k)
        ids += g.ids
        hidden += g.hidden
        pos.append(p)
        slots.append(blocks[p // bs] * bs + p % bs)
        if row < nd:
            bt[row:row + k, :len(blocks)] = blocks
        else:
            c = np.arange(g.start + k)
            k_slots.append(blocks[c // bs] * bs + c % bs)
            lens.append((k, g.start + k))
        row += k
        if id(g.req) in want:
            logits_idx.append(row - 1)
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)  # noqa: E731
    pos_N = cat(pos)
    hb = HostBatch(np.asarray(ids, np.int64), pos_N, cat(slots), nd, bt, (pos_N[:nd] + 1).astype(np.int32), lens,
                   cat(k_slots), np.asarray(logits_idx, np.int64), hidden_rows=np.asarray(hidden, np.int64))
    return hb, order


def make_drafter(cfg) -> Drafter:
    if cfg.speculative == "ngram":
        return NgramDrafter(cfg.spec_tokens, *cfg.ngram_range)
    return MtpDrafter(cfg.spec_tokens)
