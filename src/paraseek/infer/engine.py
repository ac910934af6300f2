"""The engine: load the model once, size the KV cache from the memory that is left, then step the scheduler.

One `Engine` per model replica, on its first tp rank (the driver): it owns the scheduler and the sampler, builds
each step's inputs and broadcasts them to the replica's other ranks, which only run the forward (`serve_worker`).
`generate` is the offline loop; the server (serve/) calls `add_request`/`step`/`abort` from its own loop.

Under dp-attention (`--ep N --dp-attention`, infer/ep.py) every rank of the replica is a driver: its own Engine,
requests, scheduler and cache, nothing broadcast. Only the MoE layers are shared, so the ranks step together: each
step begins with one small all-reduce on `dp_group` (`_agree`), and a rank with nothing scheduled still runs a
padding step while any rank has work.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch
import torch.distributed as dist

from paraseek.errors import UserError
from paraseek.infer import attention, kv_fp8, ops
from paraseek.infer.cache import BlockPool, CacheShape
from paraseek.infer.config import ALLOCATOR_FRACTION, EngineConfig
from paraseek.infer.model import InferenceModel
from paraseek.infer.platform import for_device
from paraseek.infer.runner import HostBatch, ModelRunner
from paraseek.infer.sampling import SampleRow, Sampled, SamplingParams, bitmask_words, sample
from paraseek.infer.scheduler import Request, Scheduled, Scheduler, Status, StepPlan

GiB = 2**30


@dataclass
class CacheReport:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    max_model_len: int
    weights_gib: float = 0.0
    peak_gib: float = 0.0  # profiling peak (weights + largest step's workspace)
    total_gib: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def line(self) -> str:
        seqs = self.tokens / self.max_model_len
        out = (f"KV cache: {self.num_blocks - 1:,} blocks = {self.tokens:,} tokens = {seqs:,.1f} sequences of "
               f"{self.max_model_len:,} tokens ({self.bytes_per_token:,} B/token, "
               f"{self.tokens * self.bytes_per_token / GiB:.2f} GiB)")
        if "model_dtype_tokens" in self.extra:  # an fp8 cache: beside what the model's dtype would hold
            other = self.extra["model_dtype_bytes_per_token"]
            out += (f"; fp8 e4m3 + scales: {other / self.bytes_per_token:.2f}x the tokens of "
                    f"{self.extra['model_dtype']} ({other:,} B/token: {self.extra['model_dtype_tokens']:,} tokens in "
                    f"the same memory)")
        if "dp_attention" in self.extra:  # each rank caches its own requests only (infer/ep.py)
            n = self.extra["dp_attention"]
            out += (f"; that on each of the {n} dp-attention ranks, for its own requests only "
                    f"({n * self.tokens:,} tokens in all)")
        planned, measured = self.extra.get("planned_tokens"), self.extra.get("memory_tokens")
        if planned and measured:
            out += f"; plan --mode infer: {planned:,} tokens ({(planned - measured) / measured:+.1%})"
        return out


@dataclass
class InFlight:
    """A launched step whose tokens are still on the device (the runner keeps them as the next step's inputs): row i
    is items[i]'s next token, to be written at token_ids[positions[i]] of its request."""

    items: list[Scheduled]
    positions: list[int]
    host: torch.Tensor  # [n] the step's tokens on the host (pinned; filled once `event` has happened)
    event: object | None


class TextStream:
    """A request's text as its tokens arrive: incremental detokenization, then the stop strings (OpenAI excludes
    the stop string; text that could still start one is held back). `delta` is what the last token added."""

    def __init__(self, tokenizer, params: SamplingParams):
        from paraseek.models.tokenizer import IncrementalDetokenizer, StopStringMatcher

        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.stops = StopStringMatcher(params.stop) if params.stop else None
        self.text, self.delta = "", ""

    def push(self, token_id: int) -> bool:
        """Add a token; True when a stop string was reached."""
        new = self.detok.push([token_id])
        stopped = False
        if self.stops is not None:
            new, stopped = self.stops.feed(new)
        self.delta = new
        self.text += new
        return stopped

    def finish(self) -> None:
        """The end of generation for another reason: release what was held back."""
        rest = self.detok.flush()
        if self.stops is not None:
            rest, _ = self.stops.feed(rest)
            rest += self.stops.flush()
        self.delta += rest
        self.text += rest


class Engine:
    def __init__(self, model, cfg: EngineConfig, *, tokenizer=None, tp_group=None, meta_group=None,
                 stop_token_ids: list[int] | None = None, log=print, lora_modules: dict[str, str] | None = None,
                 dp_group=None):
        """`dp_group` (dp-attention, infer/ep.py): the gloo group of the ranks whose MoE layers this engine's
        steps join, each rank with an Engine of its own (tp_group and meta_group None: nothing is broadcast)."""
        cfg.validate()
        self.cfg, self.tokenizer, self.log = cfg, tokenizer, log
        self.args = model.args
        self.max_model_len = cfg.context_length(self.args)
        self.tp_group, self.meta_group = tp_group, meta_group
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        mtp = cfg.speculative == "mtp"
        if not isinstance(model, InferenceModel):  # a whole training model: laid out for inference (and emptied)
            if mtp and not len(model.mtp or []):
                raise UserError(no_mtp_module("this model"))
            model = InferenceModel.from_training(model, tp_group, mtp=mtp)
        elif mtp and model.mtp is None:
            raise UserError(no_mtp_module("this model"))
        self.dp_group = dp_group
        # dp-attention: whether any rank had work, or was asked to stop, at the last step's agreement (_agree)
        self.group_busy, self.group_stop = dp_group is not None, False
        self.stop_requested = False  # this rank asks the group to stop at the next step (serve's shutdown)
        if dp_group is not None:
            if not getattr(model, "dp_attention", False):
                raise ValueError("an engine with a dp_group needs a model built with dp_attention=True")
            if cfg.speculative is not None or cfg.max_loras or lora_modules:
                raise UserError("--dp-attention with speculative decoding or LoRA adapters is not supported: leave "
                                "out --speculative and the LoRA flags")
        self.runner = ModelRunner(model, self.max_model_len, cfg.block_size)
        self.device = self.runner.device
        self.loras = None  # infer/lora.LoRARegistry: adapters by name, each in a slot of every adapted projection
        if cfg.max_loras or lora_modules:
            self._attach_loras(lora_modules or {}, log)
        self.platform = for_device(self.device)
        ops.use_kernels(self.platform.triton_kernels)
        attention.USE_FLASH = self.platform.flash_prefill
        log(self.platform.line())
        self.drafter = None  # speculative decoding (infer/spec.py)
        if cfg.speculative is not None:
            from paraseek.infer.spec import make_drafter

            self.drafter = make_drafter(cfg)
            log(f"speculative decoding: {cfg.speculative}, {cfg.spec_tokens} draft token(s) a step"
                + (f", n-grams of {cfg.ngram_range[0]}..{cfg.ngram_range[1]} tokens" if cfg.speculative == "ngram"
                   else "") + f"; while at most {cfg.spec_max_batch} requests run (--speculative-max-batch), plain "
                "decode steps above")
        refusal = kv_fp8.refusal(cfg.kv_cache_dtype, self.device)
        if refusal:
            raise UserError(refusal)
        # Attention's tp (the runner's model's), not the replica's ranks: under --ep with tp 1 the cache is whole.
        self.shape = CacheShape.of(self.args, self.runner.tp, mtp_layers=int(mtp), fp8=cfg.kv_cache_dtype == "fp8")
        # With the MTP drafter the decode graphs keep the target's hidden states, and its own steps have graphs too.
        self.use_graphs = self.platform.cuda_graphs and not cfg.enforce_eager
        self.report = self._size_cache()
        self.runner.allocate_cache(self.report.num_blocks, self.shape)
        if self.use_graphs:
            t0 = time.perf_counter()
            try:
                self.runner.capture_graphs(self._graph_batch_sizes(), self._graph_widths(), mtp=mtp)
            except RuntimeError as e:  # a kernel that cannot be captured: run eagerly, and say so
                self.runner.graphs.clear()
                self.runner.mtp_graphs.clear()
                self.runner._h_in = self.runner._h_out = None
                log(f"warning: CUDA graphs off, decode runs eagerly ({str(e).splitlines()[0][:160]})")
            self.report.extra["graphs_s"] = time.perf_counter() - t0
            self.report.extra["graphs"] = len(self.runner.graphs) + len(self.runner.mtp_graphs)
        if "allocator_fraction" in self.report.extra:
            # From here on the allocator is held to the share: past it, it releases cached blocks and retries
            # instead of growing. Set after the pool and the graphs exist: blocks the build left cached would count
            # against the share and keep the pool's one large allocation from fitting (seen on an H200).
            torch.cuda.set_per_process_memory_fraction(self.report.extra["allocator_fraction"], self.device)
        self.pool = BlockPool(self.report.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, cfg.max_num_seqs, cfg.max_batched_tokens, self.max_model_len,
                                   drafter_reads_next_token=mtp)
        if stop_token_ids is None:
            stop_token_ids = list(getattr(tokenizer, "stop_token_ids", None) or
                                  ([self.args.eos_token_id] if self.args.eos_token_id is not None else []))
        self.stop_token_ids = frozenset(stop_token_ids)
        self.requests: dict[str, Request] = {}
        self.num_generated = self.num_prompt_tokens = 0
        self._step_masks = None  # structured.StepMasks, made at the first grammar-constrained step
        self._host_sampled = 0  # requests that need host-side state to sample (penalties, log-probabilities...)
        self._in_flight: InFlight | None = None
        self._pinned_tokens = [torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)]
        self._flip = 0

    # ---- KV cache sizing ----------------------------------------------------------------------------------------------
    def _size_cache(self) -> CacheReport:
        """Blocks from measured memory: after the weights, a profiling step at max_batched_tokens (the largest
        prefill workspace) and a decode step at max_num_seqs (what the CUDA graphs keep), what is left under
        gpu_memory_utilization goes to the cache. All tp ranks take the smallest count."""
        cfg = self.cfg
        per_token = self.shape.bytes_per_token(self.runner.dtype)
        block_bytes = per_token * cfg.block_size
        useful = cfg.max_num_seqs * math.ceil(self.max_model_len / cfg.block_size) + 1  # more could never be used
        rep = CacheReport(0, cfg.block_size, per_token, self.max_model_len)
        pool_bytes = None  # the memory the pool may take (None: --num-kv-blocks sets it)
        if cfg.num_kv_blocks is not None:
            rep.num_blocks = cfg.num_kv_blocks
        elif self.device.type != "cuda":
            pool_bytes = cfg.kv_cache_gib * GiB
            rep.num_blocks = min(useful, max(2, int(pool_bytes // block_bytes) + 1))
        else:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            weights = torch.cuda.memory_allocated()
            prefill_ws, decode_ws, sample_ws = (peak - weights for peak in self._profile_run())
            peak = weights + max(prefill_ws, sample_ws)
            free, total = torch.cuda.mem_get_info()
            non_torch = total - free - torch.cuda.memory_reserved()  # CUDA context, NCCL, cuBLAS workspaces
            # The CUDA graphs' private pool keeps the largest decode forward's workspace for the engine's life (and
            # their logits buffer sits beside it), while an eager step or the sampler allocates on top: both are
            # held back from the KV pool.
            # With MTP: the hidden-state buffers of the drafter's graphs (in and out) too.
            mtp = cfg.speculative == "mtp"
            graphs = (decode_ws + max_decode_rows(cfg) * (self.args.vocab_size + 2 * self.args.dim * mtp)
                      * self.runner.dtype.itemsize if self.use_graphs else 0)
            # The caching allocator's rounding and fragmentation (config.ALLOCATOR_FRACTION): without it
            # the reserved memory of a long run creeps past the limit even when the allocated memory does not.
            budget = (total * cfg.gpu_memory_utilization - non_torch - peak - (peak - weights) * 0.1 - graphs
                      - ALLOCATOR_FRACTION * total)
            if budget < block_bytes * 2:
                raise UserError(
                    f"no memory left for the KV cache: weights {weights / GiB:.1f} GiB and a {cfg.max_batched_tokens}"
                    f"-token step ({(peak - weights) / GiB:.1f} GiB) use the {cfg.gpu_memory_utilization:.0%} of "
                    f"{total / GiB:.0f} GiB allowed; raise --gpu-memory-utilization, lower --max-batched-tokens, or "
                    f"use more GPUs (--tp)")
            pool_bytes = budget
            rep.num_blocks = min(useful, int(budget // block_bytes) + 1)
            rep.weights_gib, rep.peak_gib, rep.total_gib = weights / GiB, peak / GiB, total / GiB
            rep.extra["non_torch_gib"] = non_torch / GiB
            rep.extra["prefill_workspace_gib"], rep.extra["decode_workspace_gib"] = prefill_ws / GiB, decode_ws / GiB
            rep.extra["memory_tokens"] = int(budget // per_token)  # before the cap at what max_num_seqs can use
            rep.extra["allocator_fraction"] = max(0.05, cfg.gpu_memory_utilization - non_torch / total)
        if self.shape.fp8 and pool_bytes is not None:  # the same memory as a cache in the model's dtype
            other = dataclasses.replace(self.shape, fp8=False).bytes_per_token(self.runner.dtype)
            rep.extra["model_dtype_tokens"] = int(pool_bytes // (other * cfg.block_size)) * cfg.block_size
            rep.extra["model_dtype_bytes_per_token"] = other
            rep.extra["model_dtype"] = str(self.runner.dtype).removeprefix("torch.")
        # The same count on every rank of a replica: tp's ranks share each block; dp-attention's each hold their own
        # requests, and one count keeps every rank's capacity (the log line's) the same.
        group = self.meta_group if self.tp_group is not None and self.tp > 1 else self.dp_group
        if group is not None:
            n = torch.tensor([rep.num_blocks], dtype=torch.int64)
            dist.all_reduce(n, op=dist.ReduceOp.MIN, group=group)
            rep.num_blocks = int(n)
        if self.dp_group is not None:
            rep.extra["dp_attention"] = dist.get_world_size(self.dp_group)
        return rep

    @torch.no_grad()
    def _profile_run(self) -> tuple[int, int, int]:
        """The largest step the scheduler can build, run once on a scratch cache: max_batched_tokens of prefill in
        sequences of up to max_model_len tokens, then max_num_seqs decodes of the longest block tables, with
        sampling. Returns the peak allocated memory of the prefill, of the decode forward and of it with sampling."""
        cfg, bs = self.cfg, self.cfg.block_size
        self.runner.allocate_cache(2, self.shape)
        N = cfg.max_batched_tokens
        lens, left = [], N
        while left > 0:
            n = min(left, self.max_model_len)
            lens.append((n, n))
            left -= n
        zeros = np.zeros(N, dtype=np.int64)
        pos = np.concatenate([np.arange(n) for n, _ in lens]) % bs  # slots of block 0 (scratch)
        li = np.cumsum([n for n, _ in lens]) - 1
        lora = (lambda n: np.zeros(n, np.int64) if self.loras is not None else None)  # noqa: E731 (an adapter's work)
        hb = HostBatch(zeros, pos, pos, 0, np.zeros((0, 1), np.int32), np.zeros(0, np.int32), lens, pos, li, lora(N),
                       keep_hidden=self.drafter is not None and self.drafter.keeps_hidden)
        torch.cuda.reset_peak_memory_stats()
        self.runner.run(hb)
        if hb.keep_hidden:  # the MTP drafter's rows of the same tokens, on the kept hidden states
            self.runner.run(HostBatch(zeros, pos, pos, 0, hb.block_tables, hb.context_lens, lens, pos, li,
                                      hidden_rows=np.arange(N)))
            self.runner.hidden_NE = None
        torch.cuda.synchronize()
        prefill_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        # Block tables as wide as max_model_len allows: the decode kernels' split-KV workspace grows with the width,
        # and the widest CUDA graph keeps that workspace for as long as the engine lives.
        B, M = max_decode_rows(cfg), math.ceil(self.max_model_len / bs)
        hb = HostBatch(np.zeros(B, np.int64), np.zeros(B, np.int64), np.zeros(B, np.int64), B,
                       np.zeros((B, M), np.int32), np.ones(B, np.int32), [], np.zeros(0, np.int64), np.arange(B),
                       lora(B))
        logits = self.runner.run(hb)
        torch.cuda.synchronize()
        decode_peak = torch.cuda.max_memory_allocated()  # the forward alone: what a decode graph keeps
        sample(logits, [SampleRow(SamplingParams(temperature=1.0, top_p=0.9, top_k=50), [], [])] * B)
        del logits
        torch.cuda.synchronize()
        sample_peak = torch.cuda.max_memory_allocated()
        self.runner.cache = None
        torch.cuda.empty_cache()  # the profile's blocks back to the device: the pool is one large allocation
        return prefill_peak, decode_peak, sample_peak

    def _graph_batch_sizes(self) -> list[int]:
        """Decode rows to capture: up to max_num_seqs, or under speculative decoding up to max_num_seqs x (K + 1)
        (max_decode_rows): 1, 2, 4, 8, then every 16 to 256, every 32 to 1024, and the most rows (planner/infer.py's
        graph_batch keeps a copy of this list)."""
        rows = max_decode_rows(self.cfg) if getattr(self.cfg, "speculative", None) else self.cfg.max_num_seqs
        sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
        return [s for s in sizes if s < rows] + [rows]

    def _graph_widths(self) -> list[int]:
        """Block-table widths to capture: the decode kernel's grid grows with the width, so short contexts get a
        narrow graph."""
        most = math.ceil(self.max_model_len / self.cfg.block_size)
        # Up to 256 tokens the decode kernel runs one partition and needs no combine pass.
        widths = [w for w in (t // self.cfg.block_size for t in (256, 1024, 4096, 16384)) if 0 < w < most]
        return widths + [most]

    # ---- requests ---------------------------------------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise UserError if the request can never run: too long for the context or for the whole cache, a token
        id outside the vocabulary, a grammar that does not compile."""
        params.validate()
        if not prompt_ids:
            raise UserError("the prompt is empty")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.args.vocab_size:
            raise UserError(f"prompt token ids must be in 0..{self.args.vocab_size - 1}")
        for name, ids in (("logit_bias", params.logit_bias or {}), ("allowed_token_ids", params.allowed_token_ids or [])):
            if any(t >= self.args.vocab_size for t in ids):
                raise UserError(f"{name}: token ids must be in 0..{self.args.vocab_size - 1}")
        if params.structured is not None:
            from paraseek.infer import structured

            if params.ignore_eos or params.min_tokens:
                raise UserError("a structured output ends where its grammar ends: ignore_eos and min_tokens cannot "
                                "be combined with it")
            structured.backend_for(self.tokenizer, self.args.vocab_size, self.stop_token_ids).compile(params.structured)
        n = len(prompt_ids)
        if n + params.max_tokens > self.max_model_len:
            raise UserError(f"this model's maximum context length is {self.max_model_len} tokens; the request asks for "
                            f"{n + params.max_tokens} ({n} in the prompt, {params.max_tokens} to generate)")
        need = math.ceil((n + params.max_tokens) / self.cfg.block_size)
        if need > self.pool.num_blocks - 1:
            raise UserError(f"the request needs {need} KV blocks but the whole cache holds {self.pool.num_blocks - 1}")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    stream_text: bool = False, priority: int = 0, lora: str | None = None) -> Request:
        """Queue a request. Its text is kept as it grows (`req.stream`) when asked or when it has stop strings;
        stop strings need the tokenizer. Lower `priority` values are admitted first. `lora`: the name of a loaded
        LoRA adapter to run it on (None: the base model)."""
        self.check_request(prompt_ids, params)
        if params.stop and self.tokenizer is None:
            raise UserError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        if request_id in self.requests:
            raise UserError(f"request id {request_id!r} is already running")
        adapter = self.lora_adapter(lora) if lora is not None else None
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.stop_token_ids))
        req = Request(request_id, list(prompt_ids), params, frozenset(stop), priority=priority)
        if adapter is not None:  # its slot for the forward, its salt for the prefix cache
            req.lora_slot, req.cache_salt = adapter.slot, adapter.salt
        # Sampled from the logits alone (greedy, or temperature/top-k/top-p/min-p with its seed) or with a grammar's
        # mask (built on the host from the tokens so far, while the step's forward runs: see _launch): the step's
        # tokens can stay on the device, so steps overlap. Penalties, log-probabilities, min_tokens,
        # allowed_token_ids and logit_bias read the host: those requests take the synchronous step path.
        req.device_sampled = (not params.penalized and params.logprobs is None and params.min_tokens == 0
                              and not params.logit_bias and params.allowed_token_ids is None)
        if params.structured is not None:
            from paraseek.infer import structured

            req.grammar = structured.backend_for(self.tokenizer, self.args.vocab_size,
                                                 self.stop_token_ids).matcher(params.structured)
        if self.tokenizer is not None and (stream_text or params.stop):
            req.stream = TextStream(self.tokenizer, params)
        if params.seed is not None:  # speculative verification's accept-or-reject draws (spec.py)
            req.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        # The sampler's noise key (sampling.race_reference); an unseeded request's from torch's default generator.
        req.sample_seed = params.seed if params.seed is not None else int(torch.randint(-2**63, 2**63 - 1, ()))
        self.requests[request_id] = req
        self._host_sampled += not req.device_sampled
        if adapter is not None:
            adapter.running += 1  # until _forget: an adapter with unfinished requests is not unloaded
        self.scheduler.add(req)
        self.num_prompt_tokens += len(prompt_ids)
        return req

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            del req.token_ids[len(req.token_ids) - req.pending:]
            req.pending = 0
            self.scheduler.finish(req, "abort")
            self._forget(req)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    # ---- one step ----------------------------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one scheduler step; returns the requests that received a token (finished ones included).

        When every request is sampled from the logits alone (greedy, or temperature / top-k / top-p / min-p, seeded
        or not) or with a grammar's mask, and the replica is one process, steps overlap (vLLM's async scheduling):
        a step is launched before the previous step's tokens are read back, its decode inputs taken from those
        tokens on the device, so the host's scheduling, input building and delivery run while the GPU computes. A
        token is then delivered one step after it was computed, and a request that ends on a stop token has run one
        extra step whose token is dropped. Anything else (penalties, log-probabilities, min_tokens, tp > 1,
        dp-attention) reads each step back before the next."""
        if self.drafter is not None:
            # Above --speculative-max-batch requests, plain decode steps: a big batch is no longer host-bound and
            # the verification rows and drafting cost more than the accepted drafts save (config.SPEC_MAX_BATCH).
            self.drafter.paused = len(self.scheduler.running) > self.cfg.spec_max_batch
            self.drafter.stats.plain_steps += self.drafter.paused
            if not self.drafter.paused:
                return self.flush() + self._step_speculative()
            if self.drafter.keeps_hidden:  # MTP: the drafter still fills its cache rows, no drafts (spec.Drafter)
                return self._step_speculative()
            self._drop_drafts()
        if self._host_sampled or self.tp > 1 or self.dp_group is not None:
            return self.flush() + self._step_synchronous()
        prev, self._in_flight = self._in_flight, None
        plan = self.scheduler.schedule()
        if plan.items:
            self._in_flight, touched = self._launch(plan, prev)
            if touched is not None:
                return touched
        return self._read_back(prev) if prev else []

    def flush(self) -> list[Request]:
        """Read back the step still on the device, if any: its tokens are delivered (returned) now."""
        prev, self._in_flight = self._in_flight, None
        return self._read_back(prev) if prev else []

    def _step_synchronous(self) -> list[Request]:
        plan = self.scheduler.schedule()
        if self.dp_group is not None:
            logits = self._step_in_group(plan)
            if not plan.items:
                return []
        elif not plan.items:
            return []
        else:
            hb, _ = self._host_batch(plan)
            self._broadcast(hb)
            logits = self.runner.run(hb)
        items = [s for s in plan.items if s.sample]
        if all(s.request.device_sampled and s.request.params.greedy and s.request.grammar is None for s in items):
            out = Sampled(self.runner.greedy(logits).tolist())
        else:
            reqs = [s.request for s in items]
            out = sample(logits, [self._sample_row(r, mask=False) for r in reqs], bitmask_BW=self._masks(reqs))
        for s in plan.items:
            s.request.num_computed = s.start + s.n
        now = time.perf_counter()
        for i, s in enumerate(items):
            req = s.request
            req.token_ids.append(out.token_ids[i])
            if out.logprobs is not None and req.params.logprobs is not None:
                req.logprobs.append(out.logprobs[i])
                req.top_logprobs.append(out.top_logprobs[i])
            self._accept(req, len(req.token_ids) - 1, now)
        return [s.request for s in items]

    def _step_in_group(self, plan: StepPlan) -> torch.Tensor | None:
        """dp-attention: agree on the step with the other ranks, then run this rank's part of it (a padding step when
        it has nothing scheduled and another rank has); None when no rank has tokens (no forward at all). As
        SGLang's dp-attention schedulers do, every rank takes part in every step: each MoE layer is a collective."""
        hb = self._host_batch(plan)[0] if plan.items else None
        # Eager when this rank's step fits no captured graph (a prefill chunk, too many rows, too wide a table).
        eager = not self.runner.graphs or (hb is not None and self.runner.graph_key(hb) is None)
        rows, eager = self._agree(len(hb.ids) if hb is not None else 0, eager)
        if rows == 0:
            return None
        # Every rank pads its MoE layers' input to the most rows any rank has, or replays that count's graph bucket.
        return self.runner.run(hb if hb is not None else padding_step(), moe_rows=rows, eager=eager)

    def _agree(self, tokens: int, eager: bool) -> tuple[int, bool]:
        """The step's one host sync under dp-attention (infer/ep.py): the max over the ranks of (has work, tokens,
        runs eagerly, asked to stop), one all-reduce of four integers on the gloo group, before the forward. Sets
        group_busy and group_stop; returns (the most tokens of any rank, whether any rank runs eagerly)."""
        t = torch.tensor([self.has_work(), tokens, eager, self.stop_requested], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.dp_group)
        busy, rows, any_eager, stop = t.tolist()
        self.group_busy, self.group_stop = bool(busy), bool(stop)
        return rows, bool(any_eager)

    def _step_speculative(self) -> list[Request]:
        """A step of a speculative engine (infer/spec.py): each drafting request's last token and drafts are one
        chunk whose rows all get logits; the drafts are verified and the accepted ones delivered with the target's
        own next token; then the drafter proposes the next drafts. Synchronous: those need this step's tokens."""
        from paraseek.infer.spec import Verify, verify, verify_greedy, verify_rows

        plan = self.scheduler.schedule()
        if not plan.items:
            return []
        plan.items = rows_first(plan.items)
        hb, _ = self._host_batch(plan)
        hb.keep_hidden = self.drafter.keeps_hidden
        logits = self._forward(hb)
        sampled = [s.sample for s in plan.items]
        items = [s for s, got_token in zip(plan.items, sampled) if got_token]
        if all(s.request.device_sampled and s.request.params.greedy for s in items):  # the argmax alone decides
            verdicts = verify_greedy(self.runner.greedy(logits), [s.request.drafts[:s.num_drafts] for s in items])
        else:
            groups = []
            for s in items:
                req = s.request
                drafts = req.drafts[:s.num_drafts]
                q = req.draft_probs[:s.num_drafts] if req.draft_probs is not None and drafts else None
                groups.append(Verify(drafts, q, verify_rows(self._sample_row(req), req, drafts)))
            verdicts = verify(logits, groups)
        for s in plan.items:
            s.request.num_computed = s.start + s.n - s.num_drafts
        now = time.perf_counter()
        for s, v in zip(items, verdicts):
            req = s.request
            req.num_computed += v.accepted  # the accepted drafts' K/V came with this step
            req.drafts, req.draft_probs = [], None
            self.drafter.stats.add(s.num_drafts, v.accepted)
            req.num_draft_tokens += s.num_drafts
            req.num_accepted_tokens += v.accepted
            self._deliver(req, v, now)
        self.drafter.propose(self, plan.items, sampled)
        for s in items:  # keep the blocks of the positions the next step writes: the last token and the drafts
            if s.request.status is Status.RUNNING:
                self.scheduler.release_past(s.request, len(s.request.token_ids) + len(s.request.drafts))
        return [s.request for s in items]

    def _drop_drafts(self) -> None:
        """Before a plain step of a speculative engine: the running requests' drafts, and the blocks kept for them."""
        for req in self.scheduler.running:
            if req.drafts:
                req.drafts, req.draft_probs = [], None
                self.scheduler.release_past(req, len(req.token_ids))

    def _deliver(self, req: Request, v, now: float) -> None:
        """A verification's tokens, one by one as a plain step's (the text of all of them is the stream's delta);
        the rest is dropped once one ends the request."""
        req.step_token_ids = []
        delta = ""
        for j, tok in enumerate(v.tokens):
            req.token_ids.append(tok)
            req.step_token_ids.append(tok)
            if v.logprobs is not None:
                req.logprobs.append(v.logprobs[j])
                req.top_logprobs.append(v.top_logprobs[j])
            self._accept(req, len(req.token_ids) - 1, now)
            if req.stream is not None:
                delta += req.stream.delta
            if req.status is Status.FINISHED:
                break
        if req.stream is not None:
            req.stream.delta = delta

    def _forward(self, hb: HostBatch) -> torch.Tensor:
        """Broadcast a step to the other tp ranks and run it."""
        self._broadcast(hb)
        return self.runner.run(hb)

    def _launch(self, plan: StepPlan, prev: InFlight | None) -> tuple[InFlight, list[Request] | None]:
        """Start a step on the device; its tokens stay there (and in a placeholder at the end of each request's
        token_ids) until `_read_back`. With grammar-constrained rows the previous step is read back here, after this
        step's forward is launched and before it is sampled: the grammars advance by those tokens and fill this
        step's masks while the forward runs. Returns the step and the requests that step delivered (None: not
        read back yet)."""
        hb, src = self._host_batch(plan)
        # Decode rows whose input is the previous step's token, still on the device: the runner takes it from there.
        logits = self.runner.run(hb, src if prev is not None else None)
        items = [s for s in plan.items if s.sample]
        rows = [SampleRow(s.request.params, [], [], s.request.generator, seed=s.request.sample_seed,
                          position=s.request.num_output) for s in items]
        for s in plan.items:
            s.request.num_computed = s.start + s.n
        positions = []
        for i, s in enumerate(items):
            req = s.request
            positions.append(len(req.token_ids))
            req.token_ids.append(-1)
            req.pending += 1
            req.sample_row = i
            req.last_pending = (req.num_output >= req.params.max_tokens or len(req.token_ids) >= self.max_model_len)
        touched = masks_BW = None
        if any(s.request.grammar is not None for s in items):
            touched = self._read_back(prev) if prev is not None else []
            masks_BW = self._masks([s.request for s in items])
        if masks_BW is None and all(s.request.params.greedy for s in items):
            tokens = self.runner.greedy(logits)
        else:  # on the device, every row's noise in one launch; read back with the step's tokens
            tokens = sample(logits, rows, to_host=False, bitmask_BW=masks_BW).token_ids
        self.runner.keep_tokens(tokens)
        host, event = tokens, None
        if tokens.is_cuda:  # copied to pinned memory behind the step; the host waits only when it reads them
            self._flip ^= 1
            if self._pinned_tokens[self._flip].numel() < len(items):
                self._pinned_tokens[self._flip] = torch.empty(len(items), dtype=torch.int64, pin_memory=True)
            host = self._pinned_tokens[self._flip][:len(items)]
            host.copy_(tokens, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return InFlight(items, positions, host, event), touched

    def _read_back(self, f: InFlight) -> list[Request]:
        if f.event is not None:
            f.event.synchronize()
        now, bs = time.perf_counter(), self.cfg.block_size
        touched = []
        for s, pos, tok in zip(f.items, f.positions, f.host.tolist()):
            req = s.request
            if req.status is Status.FINISHED:  # aborted, or ended by an earlier token while this step ran
                continue
            req.token_ids[pos] = tok
            req.pending -= 1
            if len(req.block_hashes) < min(req.num_computed, pos + 1) // bs:  # the blocks the placeholder kept back
                self.scheduler.register_full_blocks(req, req.num_computed)
            self._accept(req, pos, now)
            touched.append(req)
        return touched

    def _accept(self, req: Request, pos: int, now: float) -> None:
        """The token at token_ids[pos] is known: count it, stream its text, end the request if it is the last."""
        tok = req.last_token_id = req.token_ids[pos]
        if req.first_token_time is None:
            req.first_token_time = now
        self.num_generated += 1
        reason = self._finish_reason(req, tok, pos + 1)
        if req.stream is not None:
            if reason == "stop":  # an end token: no text of its own, but what was held back is released
                req.stream.delta = ""
                req.stream.finish()
            elif req.stream.push(tok):
                reason = "stop"
            elif reason:
                req.stream.finish()
        if reason:
            del req.token_ids[pos + 1:]  # a placeholder of the step launched meanwhile
            req.pending = 0
            self.scheduler.finish(req, reason)
            self._forget(req)

    def _forget(self, req: Request) -> None:
        if self.requests.pop(req.request_id, None) is not None:
            self._host_sampled -= not req.device_sampled
            if req.lora_slot >= 0:
                self.loras.by_slot[req.lora_slot].running -= 1

    def _masks(self, reqs: list[Request]) -> torch.Tensor | None:
        """The grammar masks of a step whose rows are `reqs` (structured.StepMasks), filled on the host while the
        step's forward runs on the device; None when no row is constrained."""
        if not any(r.grammar is not None for r in reqs):
            return None
        if self._step_masks is None:
            from paraseek.infer import structured

            self._step_masks = structured.StepMasks(self.cfg.max_num_seqs, bitmask_words(self.args.vocab_size),
                                                    pin=self.device.type == "cuda")
        # the tokens known and not yet given to the grammar: a step launched and not yet read back holds a
        # placeholder (-1) per request at the end
        return self._step_masks.fill([r.grammar for r in reqs],
                                     [r.token_ids[r.num_prompt + r.grammar.consumed:len(r.token_ids) - r.pending]
                                      if r.grammar is not None else [] for r in reqs])

    def _sample_row(self, req: Request, mask: bool = True) -> SampleRow:
        """mask=False: the grammar's mask is left to `_masks`."""
        p = req.params
        suppress = sorted(req.stop_ids) if req.num_output < p.min_tokens else []
        bitmask = None
        if req.grammar is not None and mask:  # on the host while the step's forward runs on the device
            req.grammar.advance(req.output_ids)
            bitmask = req.grammar.bitmask_W()
        return SampleRow(p, req.prompt_ids, req.output_ids if p.penalized else [], req.generator, suppress, bitmask,
                         seed=req.sample_seed, position=req.num_output)

    def _finish_reason(self, req: Request, tok: int, n_tokens: int) -> str | None:
        """Why the request ends with its first n_tokens tokens (the last is `tok`), if it does."""
        n_output = n_tokens - req.num_prompt
        if tok in req.stop_ids and n_output >= req.params.min_tokens:
            return "stop"
        if n_output >= req.params.max_tokens or n_tokens >= self.max_model_len:
            return "length"
        return None

    def _host_batch(self, plan: StepPlan) -> tuple[HostBatch, np.ndarray]:
        """The step's int arrays (the leading row items -- decodes, one-token chunks and verifications -- as decode
        rows, then prefill chunks), and for each decode row the row of the previous step's sampled tokens that is its
        input when that token is still on the device (its placeholder, -1 in token_ids), else -1.

        A verification (infer/spec.py: the last known token, then the drafts) is K + 1 decode rows, row j the token
        at position start + j with a context of start + j + 1 over the request's block table: every row's K/V is
        written before attention reads any, so row j attends to the drafts before it and to none after (the same
        causal attention as a chunk), and the step is decode-only, which the CUDA graphs replay."""
        bs = self.cfg.block_size
        items = plan.items
        n_row_items = 0
        while n_row_items < len(items) and is_row_item(items[n_row_items]):
            n_row_items += 1
        ids, pos, src, blocks, logits_idx, lora_d = [], [], [], [], [], []
        for s in items[:n_row_items]:
            req, p = s.request, s.start
            tok = req.token_ids[p]
            ids.append(tok)
            src.append(req.sample_row if tok < 0 else -1)
            ids += req.drafts[:s.num_drafts]
            src += [-1] * s.num_drafts
            pos += range(p, p + s.n)
            blocks += [req.blocks] * s.n
            lora_d += [req.lora_slot] * s.n
            if s.num_drafts:  # the verification reads every row (infer/spec.py)
                logits_idx.extend(range(len(ids) - s.n, len(ids)))
            elif s.sample:
                logits_idx.append(len(ids) - 1)
        nd = len(ids)
        # Block tables in one pass: every row's blocks flattened, then spread into the rows (row-major order).
        n_blocks = np.fromiter(map(len, blocks), np.int64, nd)
        M = int(n_blocks.max()) if nd else 1
        bt = np.zeros((nd, M), dtype=np.int32)
        bt[np.arange(M) < n_blocks[:, None]] = np.fromiter(chain.from_iterable(blocks), np.int32, int(n_blocks.sum()))
        pos_d = np.asarray(pos, dtype=np.int64)
        slots_d = bt[np.arange(nd), pos_d // bs].astype(np.int64) * bs + pos_d % bs
        ctx = (pos_d + 1).astype(np.int32)
        ids_np, pos_np, slots_np = [np.asarray(ids, np.int64)], [pos_d], [slots_d]
        lens, k_slots, row = [], [], nd
        for s in items[n_row_items:]:
            req = s.request
            blocks = np.asarray(req.blocks, dtype=np.int64)
            p = np.arange(s.start, s.start + s.n)
            ids_np.append(np.asarray(req.token_ids[s.start:s.start + s.n] if not s.num_drafts else
                                     req.token_ids[s.start:] + req.drafts[:s.num_drafts], dtype=np.int64))
            pos_np.append(p)
            slots_np.append(blocks[p // bs] * bs + p % bs)
            ctx_p = np.arange(s.start + s.n)
            k_slots.append(blocks[ctx_p // bs] * bs + ctx_p % bs)
            lens.append((s.n, s.start + s.n))
            row += s.n
            if s.num_drafts:  # a verification laid out as a chunk (after a prefill chunk: see rows_first)
                logits_idx.extend(range(row - s.n, row))
            elif s.sample:
                logits_idx.append(row - 1)
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)  # noqa: E731
        lora = None
        if self.loras is not None:  # each token's adapter slot (-1: the base model)
            lora = cat([np.asarray(lora_d, np.int64)]
                       + [np.full(s.n, s.request.lora_slot, np.int64) for s in items[n_row_items:]])
        hb = HostBatch(cat(ids_np), cat(pos_np), cat(slots_np), nd, bt, ctx, lens, cat(k_slots),
                       np.asarray(logits_idx, dtype=np.int64), lora)
        return hb, np.asarray(src, dtype=np.int64)

    def _broadcast(self, hb: HostBatch | None) -> None:
        """Send the step to the replica's other tp ranks (None: tell them to stop)."""
        if self.tp == 1:
            return
        flat = hb.pack() if hb is not None else torch.full((HostBatch.HEADER,), -1, dtype=torch.int64)
        src = dist.get_global_rank(self.meta_group, 0)
        dist.broadcast(torch.tensor([flat.numel()]), src=src, group=self.meta_group)
        dist.broadcast(flat, src=src, group=self.meta_group)

    def shutdown(self) -> None:
        self._broadcast(None)

    # ---- LoRA adapters (infer/lora.py) ----------------------------------------------------------------------------
    def _attach_loras(self, modules: dict[str, str], log) -> None:
        """Slots in every adapted projection (before the cache is sized and the graphs are captured: both count
        them), then the adapters given at start, on every tp rank."""
        from paraseek.infer import lora

        cfg = self.cfg
        if len(modules) > cfg.max_loras:
            raise UserError(f"{len(modules)} LoRA adapters given but --max-loras is {cfg.max_loras}: raise "
                            "--max-loras")
        self.loras = lora.LoRARegistry(lora.attach(self.runner.model, cfg.max_loras, cfg.max_lora_rank))
        for name, path in modules.items():
            self.loras.add(name, lora.read_adapter(path, self.args, cfg.max_lora_rank))
        log(f"LoRA: {cfg.max_loras} adapter slots of rank {cfg.max_lora_rank} "
            f"({self.loras.slots.nbytes() / 2**20:,.1f} MiB on each rank); loaded: "
            f"{', '.join(f'{n} (r={a.rank})' for n, a in self.loras.by_name.items()) or 'none'}")

    def lora_adapter(self, name: str):
        """The loaded adapter `name` (infer/lora.Loaded); lora.AdapterNotFound if there is none."""
        from paraseek.infer.lora import AdapterNotFound

        if self.loras is None:
            raise AdapterNotFound(f"no LoRA adapter named {name!r}: this engine serves none (start it with "
                                  "--enable-lora or --lora-modules)")
        return self.loras.get(name)

    def load_lora(self, name: str, path: str, adapter=None):
        """Load a PEFT adapter folder into a free slot (`adapter`: the folder already read by lora.read_adapter)
        and tell the other tp ranks to load it into the same slot. Call it between steps, on the engine's thread."""
        from paraseek.infer import lora

        if self.loras is None:
            raise UserError("this engine has no adapter slots: start it with --enable-lora (or --lora-modules)")
        self.loras.check_new(name)
        if adapter is None:
            adapter = lora.read_adapter(path, self.args, self.cfg.max_lora_rank)
        one = self.loras.add(name, adapter)
        if self.tp > 1:  # the others read their shares of the same folder
            src = dist.get_global_rank(self.meta_group, 0)
            dist.broadcast(torch.tensor([2]), src=src, group=self.meta_group)
            dist.broadcast(torch.tensor([-2, one.slot]), src=src, group=self.meta_group)
            dist.broadcast_object_list([str(path)], src=src, group=self.meta_group)
        return one

    def unload_lora(self, name: str):
        """Free the adapter's slot; refused (UserError) while requests of it are unfinished. The other tp ranks
        need no word: the slot is unused until a load overwrites it everywhere."""
        if self.loras is None:
            self.lora_adapter(name)  # raises
        return self.loras.remove(name)

    # ---- offline generation ---------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 progress: bool = False, ids: list[str] | None = None,
                 loras: list[str | None] | None = None) -> list[Request]:
        """All prompts to completion, in the order given (`loras`: each prompt's adapter name, None the base)."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = ids or [f"gen-{i}" for i in range(len(prompts))]
        loras = loras or [None] * len(prompts)
        for p, sp, name in zip(prompts, params, loras):
            self.check_request(p, sp)
            if name is not None:
                self.lora_adapter(name)
        reqs = [self.add_request(rid, p, dataclasses.replace(sp), lora=name)
                for rid, p, sp, name in zip(ids, prompts, params, loras)]
        bar = _progress(len(reqs)) if progress else None
        done = 0
        # dp-attention: every rank steps until no rank has work (the last agreement says so, on every rank alike)
        self.group_busy = self.dp_group is not None
        while self.has_work() or self.group_busy:
            for r in self.step():
                if r.finish_reason:
                    done += 1
                    if bar:
                        bar[0].update(bar[1], completed=done)
        if bar:
            bar[0].stop()
        return reqs

    def stats(self) -> dict:
        pool = self.pool
        spec = {}
        if self.drafter is not None:  # vLLM's spec_decode counters (serve/metrics.py)
            st = self.drafter.stats
            spec = {"spec_num_drafts": st.num_drafts, "spec_num_draft_tokens": st.num_draft_tokens,
                    "spec_num_accepted_tokens": st.num_accepted_tokens,
                    "spec_accepted_per_pos": list(st.accepted_per_pos)}
        return spec | {
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "kv_blocks_used": pool.num_used, "kv_blocks_free": pool.num_free, "kv_blocks_total": pool.num_blocks - 1,
            "prefix_cache_queries": pool.queries, "prefix_cache_hits": pool.hits,
            "preemptions": self.scheduler.num_preemptions, "generated_tokens": self.num_generated,
            "prompt_tokens": self.num_prompt_tokens, "kv_usage": pool.num_used / max(pool.num_blocks - 1, 1),
            "prefix_hit_rate": pool.hits / pool.queries if pool.queries else 0.0,
        } | (self._lora_stats() if self.loras is not None else {})

    def _lora_stats(self) -> dict:
        """The adapters of the running and of the waiting requests (vLLM's lora_requests_info)."""
        names = lambda reqs: sorted({self.loras.by_slot[r.lora_slot].name for r in list(reqs)  # noqa: E731
                                     if r.lora_slot in self.loras.by_slot})
        return {"lora_running": names(self.scheduler.running), "lora_waiting": names(self.scheduler.waiting),
                "max_loras": self.cfg.max_loras}


def is_row_item(s: Scheduled) -> bool:
    """A plan item laid out as decode rows (one query token each): a decode or one-token chunk, or a verification."""
    return s.n == 1 or s.num_drafts > 0


def rows_first(items: list[Scheduled]) -> list[Scheduled]:
    """The plan's items with the row items first (the scheduler puts verifications among the prefill chunks), in
    their order otherwise: a speculative step's rows, logits and drafter inputs all follow this order."""
    return [s for s in items if is_row_item(s)] + [s for s in items if not is_row_item(s)]


def max_decode_rows(cfg: EngineConfig) -> int:
    """The most decode rows a step can have: one per sequence, K + 1 per verifying sequence under speculative
    decoding (bounded by the step's token budget)."""
    return min(cfg.max_num_seqs * (1 + cfg.spec_tokens), max(cfg.max_num_seqs, cfg.max_batched_tokens))


def no_mtp_module(what: str) -> str:
    return (f"--speculative mtp: {what} has no MTP module (num_nextn_predict_layers 0, or its folder holds no "
            "model.layers.{num_hidden_layers}.* weights, as transformers writes DeepSeek-V3); use --speculative "
            "ngram, or a checkpoint with its MTP layer (paraseek train --mtp-layers 1, then paraseek export)")


def padding_step() -> HostBatch:
    """dp-attention: the step of a rank with nothing scheduled, so that its MoE layers still take part -- one decode
    row of token 0 at position 0 in the padding block's slot 0 (block 0 is never handed out: a CUDA graph's padding
    rows write there too) and no row sampled."""
    z = np.zeros(1, dtype=np.int64)
    return HostBatch(z, z, z, 1, np.zeros((1, 1), np.int32), np.ones(1, np.int32), [], np.zeros(0, np.int64),
                     np.zeros(0, np.int64))


def serve_worker(runner: ModelRunner, meta_group) -> None:
    """A tp rank other than the driver: run every step the driver broadcasts until it says stop."""
    src = dist.get_global_rank(meta_group, 0)
    while True:
        n = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(n, src=src, group=meta_group)
        flat = torch.empty(int(n), dtype=torch.int64)
        dist.broadcast(flat, src=src, group=meta_group)
        if int(flat[0]) == -2:  # a LoRA adapter into a slot (Engine.load_lora)
            from paraseek.infer.lora import read_adapter

            path = [None]
            dist.broadcast_object_list(path, src=src, group=meta_group)
            slots = runner.model.lora
            slots.load(int(flat[1]), read_adapter(path[0], runner.args, slots.max_rank))
            continue
        if int(flat[0]) < 0:
            return
        runner.run(HostBatch.unpack(flat))


def _progress(total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rich.console import Console

    bar = Progress(TextColumn("generate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=False)
    bar.start()
    return bar, bar.add_task("generate", total=total)
