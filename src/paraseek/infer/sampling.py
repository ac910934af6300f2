"""Sampling parameters (validated once, when a request arrives) and the batched sampler that runs on the logits'
device: token masks (a grammar's, allowed_token_ids), logit_bias, penalties, temperature, top-k, top-p, min-p,
per-request seeds, log-probabilities.

Order of the transforms (as vLLM and HF apply them): the masks and logit_bias on the raw logits ->
repetition/frequency/presence penalties ->
log-probabilities reported from those -> temperature -> top-k -> top-p -> min-p -> sample. top-k and top-p share
one sort (a top-k of the largest k in the batch when every row has a top-k) and one softmax.

Sampling is the exponential race, the Gumbel-max trick in its exponential form: argmax_v p_v / E_v with E_v ~ Exp(1)
i.i.d. is a sample from p / sum(p) (the first arrival of independent exponential clocks of rates p_v; Gumbel 1954,
Maddison et al. 2014 "A* Sampling", Huijben et al. 2022 "A Review of the Gumbel-max Trick"). Each E_v = -log u_v
comes from a stateless hash of (the request's seed, its output position, v) -- splitmix64 (Steele, Lea, Flood 2014)
-- so one launch draws every row's noise, a row's token does not depend on the rest of the batch, and a seeded
request's tokens are the same run to run. The engine gives an unseeded request a seed when it arrives.
`race_reference` is the plain-torch form (CPU); sampling_kernels.race computes the same integers and floats on the
GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from paraseek.errors import UserError


@dataclass
class SamplingParams:
    """What one request asks of the sampler; names and meanings as OpenAI's API and vLLM have them."""

    max_tokens: int = 16  # new tokens at most
    min_tokens: int = 0  # stop tokens are suppressed before this many new tokens
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/CTRL style on prompt and output tokens (> 1 discourages repeats)
    frequency_penalty: float = 0.0  # OpenAI: minus count x this, output tokens only
    presence_penalty: float = 0.0  # OpenAI: minus this once a token appeared in the output
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings (excluded from the text)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # benchmarks: outputs forced to max_tokens
    logprobs: int | None = None  # None = off; k >= 0: the chosen token's log-probability and the k most likely
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM's: every other token is masked out
    # Grammar-constrained decoding (infer/structured.py): {"type": "json_schema", "schema": {...}} | {"type":
    # "json_object"} | {"type": "regex", "regex": ...} | {"type": "ebnf", "grammar": ...} | {"type": "choice", ...}
    # | {"type": "tool_calls", ...}; "reasoning": true lets the output reason up to </think> first. A plain dict, so
    # it travels to --dp replicas.
    structured: dict | None = None

    def validate(self) -> SamplingParams:
        """Raise UserError (one line) for a value outside its range; returns self so calls can chain."""
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise UserError(what)

        need(isinstance(self.max_tokens, int) and self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        need(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}")
        need(_finite(self.temperature) and self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        need(_finite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1),
             f"top_k must be -1, 0 (off) or a positive number of tokens, got {self.top_k}")
        need(_finite(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        need(_finite(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        need(_finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        need(_finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        need(self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed < 2**64),
             f"seed must be an integer in [-2^63, 2^64), got {self.seed!r}")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             f"logprobs must be in 0..20, got {self.logprobs}")
        need(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids")
        need(self.logit_bias is None or all(isinstance(t, int) and t >= 0 and _finite(b) and -100 <= b <= 100
                                            for t, b in self.logit_bias.items()),
             "logit_bias must map token ids to numbers in [-100, 100]")
        need(self.allowed_token_ids is None or (bool(self.allowed_token_ids) and all(
            isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)),
             "allowed_token_ids must be a non-empty list of token ids")
        need(self.structured is None or (isinstance(self.structured, dict) and "type" in self.structured),
             "structured must be a dict with a type")
        if self.top_k == -1:
            self.top_k = 0
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def masked(self) -> bool:
        """Whether the logits are changed before sampling by a mask or a bias (no bare argmax)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or self.structured is not None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class SampleRow:
    """One row of the logits to sample from: its request's parameters and what the penalties and seed need."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None = None
    suppress_ids: list[int] = field(default_factory=list)  # stop tokens before min_tokens
    bitmask_W: torch.Tensor | None = None  # a grammar's allowed tokens: int32 [ceil(V / 32)], bit v % 32 of word v // 32
    # The race's noise key (race_reference): the request's seed and the output position of the token sampled.
    # None: drawn from `generator` (or torch's default generator) by `draw` instead.
    seed: int | None = None
    position: int = 0


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[float] | None = None  # the chosen tokens' (rows that asked for logprobs)
    top_logprobs: list[list[tuple[int, float]]] | None = None


# Rows sampled at once: top-k and top-p sort whole rows of the vocabulary in fp32 (values and int64 indices), so a
# batch of 1,024 rows of a 128K vocabulary would need several GiB at its peak; in chunks of at most this many logits
# the peak stays near 32 B x SAMPLE_CHUNK_LOGITS whatever the batch.
SAMPLE_CHUNK_LOGITS = 2**25


def sample_rows_per_chunk(vocab_size: int) -> int:
    return max(1, SAMPLE_CHUNK_LOGITS // vocab_size)


def sample(logits_BV: torch.Tensor, rows: list[SampleRow], to_host: bool = True,
           bitmask_BW: torch.Tensor | None = None) -> Sampled:
    """One token per row. logits_BV are the model's logits (any float dtype); the work is done in fp32, in chunks
    of rows (SAMPLE_CHUNK_LOGITS) when the batch is large. to_host=False: `token_ids` is the [B] int64 tensor on the
    logits' device (no wait for the step; no log-probabilities). bitmask_BW: the rows' grammar masks as one host
    tensor (int32 [B, ceil(V / 32)], all ones in an unconstrained row; structured.StepMasks), instead of the rows'
    own bitmask_W."""
    B, V = logits_BV.shape
    step = sample_rows_per_chunk(V)
    if B <= step or all(r.params.greedy and not r.params.masked and not r.params.penalized and
                        r.params.logprobs is None for r in rows):
        return _sample(logits_BV, rows, to_host, bitmask_BW)
    parts = [_sample(logits_BV[i:i + step], rows[i:i + step], to_host,
                     None if bitmask_BW is None else bitmask_BW[i:i + step]) for i in range(0, B, step)]
    if not to_host:
        return Sampled(torch.cat([p.token_ids for p in parts]))
    out = Sampled([t for p in parts for t in p.token_ids])
    if any(p.logprobs is not None for p in parts):
        out.logprobs = [x for p in parts for x in (p.logprobs or [None] * len(p.token_ids))]
        out.top_logprobs = [x for p in parts for x in (p.top_logprobs or [[]] * len(p.token_ids))]
    return out


@dataclass
class Distributions:
    """What a batch of rows samples from, after the request's transforms: `x_BV` the fp32 logits after the masks,
    logit_bias and penalties (a greedy row takes its argmax); `logprobs_BV` their log-softmax (rows that asked for
    log-probabilities); `probs_BV` the distribution after temperature, top-k, top-p and min-p (None when every row
    is greedy; a greedy row's is at temperature 1 and unused). Speculative verification (infer/spec.py) reads the
    same distributions as plain sampling."""

    x_BV: torch.Tensor
    logprobs_BV: torch.Tensor | None
    probs_BV: torch.Tensor | None
    greedy: list[bool]


def distributions(logits_BV: torch.Tensor, rows: list[SampleRow],
                  bitmask_BW: torch.Tensor | None = None) -> Distributions:
    B, V = logits_BV.shape
    dev = logits_BV.device
    x_BV = logits_BV.float()
    if any(r.suppress_ids for r in rows):
        x_BV = x_BV.clone()
        for i, r in enumerate(rows):
            if r.suppress_ids:
                x_BV[i, r.suppress_ids] = float("-inf")
    if bitmask_BW is not None or any(r.params.masked or r.bitmask_W is not None for r in rows):
        x_BV = apply_masks(x_BV if x_BV is not logits_BV else x_BV.clone(), rows, bitmask_BW)
    if any(r.params.penalized for r in rows):
        x_BV = _apply_penalties(x_BV, rows)
    want_logprobs = any(r.params.logprobs is not None for r in rows)
    logprobs_BV = torch.log_softmax(x_BV, dim=-1) if want_logprobs else None
    greedy = [r.params.greedy for r in rows]
    if all(greedy):
        return Distributions(x_BV, logprobs_BV, None, greedy)
    p = [r.params for r in rows]
    temp_B = _rows_tensor([1.0 if g else q.temperature for g, q in zip(greedy, p)], dev)
    t_BV = x_BV / temp_B[:, None]
    if any(q.top_k for q in p) or any(q.top_p < 1 for q in p):
        probs_BV = _top_k_top_p(t_BV, p, greedy)
    else:
        probs_BV = t_BV.softmax(dim=-1)
    if any(q.min_p > 0 for q in p):
        min_p_B = _rows_tensor([q.min_p for q in p], dev)
        probs_BV = probs_BV.masked_fill(probs_BV < min_p_B[:, None] * probs_BV.amax(-1, keepdim=True), 0.0)
    return Distributions(x_BV, logprobs_BV, probs_BV, greedy)


def _top_k_top_p(t_BV: torch.Tensor, p: list[SamplingParams], greedy: list[bool]) -> torch.Tensor:
    """Probabilities of the tempered logits t_BV after each row's top-k and top-p, from one sort of the row (or one
    torch.topk of the batch's largest k when every sampled row has a top-k) and one softmax over the sorted values;
    the dropped tokens get probability 0. top-k keeps exactly k tokens (the first k of the sort on ties). A greedy
    row's probabilities are unused: it neither widens the top-k nor takes a top-p."""
    B, V = t_BV.shape
    dev = t_BV.device
    k_max = min(V, max(q.top_k or V for q, g in zip(p, greedy) if not g))
    p = [SamplingParams(top_k=k_max) if g else q for q, g in zip(p, greedy)]
    if k_max < V:
        sorted_BK, order_BK = t_BV.topk(k_max, dim=-1)
    else:
        sorted_BK, order_BK = t_BV.sort(dim=-1, descending=True)
    if any(q.top_k and q.top_k < k_max for q in p):
        k_B = _rows_tensor([min(q.top_k or V, k_max) for q in p], dev, torch.int64)
        rank_K = torch.arange(k_max, device=dev)
        sorted_BK = sorted_BK.masked_fill(rank_K[None, :] >= k_B[:, None], float("-inf"))
    probs_BK = sorted_BK.softmax(dim=-1)  # = the softmax over V with the tokens outside the top k at -inf
    if any(q.top_p < 1 for q in p):
        # Keep the smallest set of tokens whose probability reaches top_p (the most likely token always stays). A row
        # without top-p keeps every token: its cumulative sum may round up to 1 before the tail.
        top_p_B = _rows_tensor([q.top_p if q.top_p < 1 else math.inf for q in p], dev)
        probs_BK = probs_BK.masked_fill((probs_BK.cumsum(dim=-1) - probs_BK) >= top_p_B[:, None], 0.0)
    return torch.zeros_like(t_BV).scatter_(1, order_BK, probs_BK)


def draw(probs_BV: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of (unnormalized) probabilities: the Gumbel-max trick in its exponential form, argmax
    p_i / q_i with q_i ~ Exp(1), each seeded row's noise from its own generator."""
    noise_BV = torch.empty_like(probs_BV).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise_BV[i].exponential_(generator=g)
    return (probs_BV / noise_BV).argmax(dim=-1)


GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment: 2^64 / the golden ratio, odd
MIX_1 = 0xBF58476D1CE4E5B9
MIX_2 = 0x94D049BB133111EB


def _signed64(x: int) -> int:
    """The int64 with the bits of x mod 2^64 (torch has no uint64 arithmetic; int64's wraps the same)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


def _shr64(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 tensors holding uint64 bits (>> on int64 is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on int64 tensors holding uint64 bits (products wrap mod 2^64)."""
    z = (z ^ _shr64(z, 30)) * _signed64(MIX_1)
    z = (z ^ _shr64(z, 27)) * _signed64(MIX_2)
    return z ^ _shr64(z, 31)


def uniform_noise(seed_B: torch.Tensor, position_B: torch.Tensor, V: int) -> torch.Tensor:
    """[B, V] float32 u in (0, 1) for (seed, position, v): z = mix64(key + v * GOLDEN_GAMMA) with
    key = mix64(mix64(seed) + position), u = ((z >> 40) + 0.5) / 2^24 (24 bits: exact in float32, never 0 or 1).
    seed_B and position_B are int64 (a seed's bits mod 2^64)."""
    key_B = _mix64(_mix64(seed_B) + position_B)
    v_V = torch.arange(V, device=seed_B.device, dtype=torch.int64)
    z_BV = _mix64(key_B[:, None] + v_V[None, :] * _signed64(GOLDEN_GAMMA))
    return (_shr64(z_BV, 40).float() + 0.5) * 2.0**-24


def race_reference(probs_BV: torch.Tensor, seed_B: torch.Tensor, position_B: torch.Tensor) -> torch.Tensor:
    """[B] tokens argmax_v p_v / E_v, E_v = -log u_v (uniform_noise): the exponential race in plain torch."""
    e_BV = -torch.log(uniform_noise(seed_B, position_B, probs_BV.shape[1]))
    return (probs_BV.float() / e_BV).argmax(dim=-1)


def draw_keyed(probs_BV: torch.Tensor, seeds: list[int], positions: list[int]) -> torch.Tensor:
    """One token per row of (unnormalized) probabilities, row b's noise keyed by (seeds[b], positions[b]): one
    Triton launch for the whole batch on CUDA, race_reference elsewhere."""
    dev = probs_BV.device
    seed_B = _rows_tensor([_signed64(s) for s in seeds], dev, torch.int64)
    position_B = _rows_tensor(positions, dev, torch.int64)
    if dev.type == "cuda":
        from paraseek.infer import sampling_kernels

        return sampling_kernels.race(probs_BV.contiguous(), seed_B, position_B)
    return race_reference(probs_BV, seed_B, position_B)


def _draw_rows(probs_BV: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """The keyed race when every sampled row has a seed (a greedy row's draw is unused: key 0), else `draw`."""
    if all(r.seed is not None or r.params.greedy for r in rows):
        return draw_keyed(probs_BV, [r.seed or 0 for r in rows], [r.position for r in rows])
    return draw(probs_BV, [r.generator for r in rows])


def _sample(logits_BV: torch.Tensor, rows: list[SampleRow], to_host: bool,
            bitmask_BW: torch.Tensor | None = None) -> Sampled:
    d = distributions(logits_BV, rows, bitmask_BW)
    logprobs_BV = d.logprobs_BV
    if d.probs_BV is None:
        tokens_B = d.x_BV.argmax(dim=-1)
    else:
        tokens_B = _draw_rows(d.probs_BV, rows)
        if any(d.greedy):
            tokens_B = torch.where(_rows_tensor(d.greedy, logits_BV.device, torch.bool), d.x_BV.argmax(dim=-1),
                                   tokens_B)
    if not to_host:
        return Sampled(tokens_B)
    out = Sampled(tokens_B.tolist())
    if logprobs_BV is not None:
        out.logprobs, out.top_logprobs = chosen_logprobs(logprobs_BV, tokens_B, rows)
    return out


def chosen_logprobs(logprobs_BV: torch.Tensor, tokens_B: torch.Tensor,
                    rows: list[SampleRow]) -> tuple[list[float | None], list[list[tuple[int, float]]]]:
    """Each row's chosen token's log-probability (None where its request asked for none) and its request's
    `logprobs` most likely (token, log-probability) pairs."""
    chosen = logprobs_BV.gather(1, tokens_B[:, None])[:, 0].tolist()
    k = max(r.params.logprobs or 0 for r in rows)
    top_vals, top_ids = (logprobs_BV.topk(k, dim=-1) if k else (None, None))
    lps, tops = [], []
    for i, r in enumerate(rows):
        n = r.params.logprobs
        lps.append(chosen[i] if n is not None else None)
        tops.append(list(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist())) if n else [])
    return lps, tops


def apply_masks(x_BV: torch.Tensor, rows: list[SampleRow], bitmask_BW: torch.Tensor | None = None) -> torch.Tensor:
    """logit_bias, allowed_token_ids and grammar bitmasks, in place on x_BV (fp32). Each kind is one batched
    operation on the device; the grammar masks (built on the host while the forward ran: bitmask_BW, else the rows'
    bitmask_W) go over in one copy and are applied by xgrammar's kernel (Triton on a GPU, C++ on the CPU)."""
    B, V = x_BV.shape
    dev = x_BV.device
    rows_i, ids, vals = [], [], []
    for i, r in enumerate(rows):
        for t, b in (r.params.logit_bias or {}).items():
            if t < V:
                rows_i.append(i)
                ids.append(t)
                vals.append(float(b))
    if ids:
        x_BV.index_put_((torch.tensor(rows_i, device=dev), torch.tensor(ids, device=dev)),
                        torch.tensor(vals, device=dev), accumulate=True)
    allowed = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    if allowed:
        keep_BV = torch.ones((B, V), dtype=torch.bool, device=dev)
        keep_BV[allowed] = False
        ri = [i for i in allowed for t in rows[i].params.allowed_token_ids if t < V]
        ti = [t for i in allowed for t in rows[i].params.allowed_token_ids if t < V]
        keep_BV[torch.tensor(ri, device=dev, dtype=torch.long), torch.tensor(ti, device=dev, dtype=torch.long)] = True
        x_BV.masked_fill_(~keep_BV, float("-inf"))
    if bitmask_BW is None and any(r.bitmask_W is not None for r in rows):
        bitmask_BW = torch.full((B, bitmask_words(V)), -1, dtype=torch.int32)
        for i, r in enumerate(rows):
            if r.bitmask_W is not None:
                bitmask_BW[i] = r.bitmask_W
        if dev.type == "cuda":
            bitmask_BW = bitmask_BW.pin_memory()
    if bitmask_BW is not None:
        import xgrammar as xgr  # only grammar-constrained requests have masks, and they need xgrammar

        # From pinned memory the copy does not wait for the stream (a pageable one would); the sampled tokens are
        # read back before the buffer is filled again.
        xgr.apply_token_bitmask_inplace(x_BV, bitmask_BW.to(dev, non_blocking=True), vocab_size=V)
    return x_BV


def bitmask_words(V: int) -> int:
    """int32 words of a bitmask over V tokens."""
    return (V + 31) // 32


def unpack_bitmask(words_MW: torch.Tensor, V: int) -> torch.Tensor:
    """int32 words [M, W] (token v is bit v % 32 of word v // 32, as xgrammar and llguidance write them) ->
    bool [M, V]."""
    shifts_32 = torch.arange(32, device=words_MW.device, dtype=torch.int32)
    bits_MW32 = (words_MW[:, :, None] >> shifts_32) & 1
    return bits_MW32.reshape(words_MW.shape[0], -1)[:, :V].bool()


def _rows_tensor(values: list, device, dtype=torch.float32) -> torch.Tensor:
    """A per-row parameter tensor on `device` without waiting for the work queued there: a copy from pageable host
    memory waits for the stream (it would undo the engine's overlapped steps), one from pinned memory does not."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t


def _apply_penalties(x_BV: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    B, V = x_BV.shape
    dev = x_BV.device
    x_BV = x_BV.clone()
    out_counts_BV = torch.zeros((B, V), device=dev)
    for i, r in enumerate(rows):
        if r.output_ids and (r.params.frequency_penalty or r.params.presence_penalty):
            ids = torch.tensor(r.output_ids, device=dev)
            out_counts_BV[i].scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
    freq_B = torch.tensor([r.params.frequency_penalty for r in rows], device=dev)
    pres_B = torch.tensor([r.params.presence_penalty for r in rows], device=dev)
    x_BV -= freq_B[:, None] * out_counts_BV + pres_B[:, None] * (out_counts_BV > 0)
    for i, r in enumerate(rows):
        rp = r.params.repetition_penalty
        if rp != 1:
            seen = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), device=dev, dtype=torch.long)
            vals = x_BV[i, seen]
            x_BV[i, seen] = torch.where(vals > 0, vals / rp, vals * rp)
    return x_BV
