"""Sampling parameters (validated once, when a request arrives) and the batched sampler that runs on the logits'
device: penalties, temperature, top-k, top-p, min-p, per-request seeds, log-probabilities.

Order of the transforms (as vLLM and HF apply them): repetition/frequency/presence penalties on the raw logits ->
log-probabilities reported from those -> temperature -> top-k -> top-p -> min-p -> sample. Sampling is the Gumbel-max
trick in its exponential form (argmax p_i / q_i with q_i ~ Exp(1) is a sample from p), so a seeded request draws its
noise from its own generator and the rest of the batch stays one kernel.
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
        need(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             f"logprobs must be in 0..20, got {self.logprobs}")
        need(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids")
        if self.top_k == -1:
            self.top_k = 0
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0


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


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[float] | None = None  # the chosen tokens' (rows that asked for logprobs)
    top_logprobs: list[list[tuple[int, float]]] | None = None


def sample(logits_BV: torch.Tensor, rows: list[SampleRow]) -> Sampled:
    """One token per row. logits_BV are the model's logits (any float dtype); the work is done in fp32."""
    B, V = logits_BV.shape
    dev = logits_BV.device
    x_BV = logits_BV.float()
    if any(r.suppress_ids for r in rows):
        x_BV = x_BV.clone()
        for i, r in enumerate(rows):
            if r.suppress_ids:
                x_BV[i, r.suppress_ids] = float("-inf")
    if any(r.params.penalized for r in rows):
        x_BV = _apply_penalties(x_BV, rows)
    want_logprobs = any(r.params.logprobs is not None for r in rows)
    logprobs_BV = torch.log_softmax(x_BV, dim=-1) if want_logprobs else None

    greedy = [r.params.greedy for r in rows]
    if all(greedy):
        tokens_B = x_BV.argmax(dim=-1)
    else:
        p = [r.params for r in rows]
        temp_B = torch.tensor([1.0 if g else q.temperature for g, q in zip(greedy, p)], device=dev)
        x_BV = x_BV / temp_B[:, None]
        if any(q.top_k for q in p):
            k_B = torch.tensor([q.top_k if q.top_k else V for q in p], device=dev).clamp(max=V)
            kth_B = x_BV.sort(dim=-1, descending=True).values.gather(1, (k_B - 1)[:, None])
            x_BV = x_BV.masked_fill(x_BV < kth_B, float("-inf"))
        probs_BV = x_BV.softmax(dim=-1)
        if any(q.top_p < 1 for q in p):
            # Keep the smallest set of tokens whose probability reaches top_p (the most likely token always stays).
            sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
            top_p_B = torch.tensor([q.top_p for q in p], device=dev)
            drop_sorted = (sorted_BV.cumsum(dim=-1) - sorted_BV) >= top_p_B[:, None]
            drop_BV = torch.zeros_like(drop_sorted).scatter_(1, order_BV, drop_sorted)
            probs_BV = probs_BV.masked_fill(drop_BV, 0.0)
        if any(q.min_p > 0 for q in p):
            min_p_B = torch.tensor([q.min_p for q in p], device=dev)
            probs_BV = probs_BV.masked_fill(probs_BV < min_p_B[:, None] * probs_BV.amax(-1, keepdim=True), 0.0)
        noise_BV = torch.empty_like(probs_BV).exponential_()
        for i, r in enumerate(rows):
            if r.generator is not None:
                noise_BV[i].exponential_(generator=r.generator)
        tokens_B = (probs_BV / noise_BV).argmax(dim=-1)
        if any(greedy):
            tokens_B = torch.where(torch.tensor(greedy, device=dev), x_BV.argmax(dim=-1), tokens_B)

    out = Sampled(tokens_B.tolist())
    if logprobs_BV is not None:
        chosen = logprobs_BV.gather(1, tokens_B[:, None])[:, 0].tolist()
        k = max(r.params.logprobs or 0 for r in rows)
        top_vals, top_ids = (logprobs_BV.topk(k, dim=-1) if k else (None, None))
        out.logprobs, out.top_logprobs = [], []
        for i, r in enumerate(rows):
            n = r.params.logprobs
            out.logprobs.append(chosen[i] if n is not None else None)
            if n:
                out.top_logprobs.append(list(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist())))
            else:
                out.top_logprobs.append([])
    return out


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
