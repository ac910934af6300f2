"""One engine loop for many concurrent HTTP requests: the engine lives on its own thread (it is not thread-safe and
its steps block), requests and aborts reach it through a queue, and each step's new tokens go back to the waiting
request handlers on the asyncio loop.

Under dp-attention (infer/ep.py) each rank of the replica runs such a loop for its own requests, and the loops turn
together: every turn steps the engine, which first agrees with the other ranks (Engine._agree), so a rank with no
requests still runs the padding steps the busy ones' MoE layers need, and all of them stop at the same turn.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from paraseek.infer.sampling import SamplingParams


@dataclass
class Delta:
    """What one step added to a request: its new token (and text, log-probabilities), and whether it finished."""

    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    timing: Timing | None = None  # once finished, for the metrics


@dataclass
class Timing:
    """A finished request's phases in seconds (vLLM's: queue = arrival to first scheduling, prefill = that to the
    first token, decode = first to last token) and its token counts."""

    ttft: float
    e2e: float
    n_out: int
    n_prompt: int
    max_tokens: int
    queue: float | None
    prefill: float | None
    decode: float


def timing_of(req) -> Timing | None:
    if req.first_token_time is None:
        return None
    end = req.finish_time or req.first_token_time
    scheduled = getattr(req, "first_scheduled_time", None)
    return Timing(req.first_token_time - req.arrival, end - req.arrival, req.num_output, req.num_prompt,
                  req.params.max_tokens, None if scheduled is None else scheduled - req.arrival,
                  None if scheduled is None else req.first_token_time - scheduled, end - req.first_token_time)


class EngineLoop:
    def __init__(self, engine, metrics=None):
        self.engine, self.metrics = engine, metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._outputs: dict[str, object] = {}  # request id -> emit(item), callable from any thread
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self.pending = 0  # submitted, not yet seen by the engine thread
        self._engine_thread: int | None = None
        self._gathered: dict | None = None  # loop -> [(fn, arg)] of the step being delivered (engine thread only)

    def run(self) -> None:
        """The loop, on the calling thread (the one that built the engine) until stop()."""
        self._run()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(("wake",))

    def stopped(self) -> bool:
        return self._stop.is_set()

    def waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self.pending

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, out: asyncio.Queue,
               tag: int = 0, priority: int = 0, lora: str | None = None) -> None:
        """Queue a request (already checked with engine.check_request) on the base model or the LoRA adapter
        `lora`; (tag, Delta) pairs arrive on `out`, or an exception if the engine failed it."""
        loop = asyncio.get_running_loop()

        def emit(item) -> None:
            self._post(loop, out.put_nowait, (tag, item) if isinstance(item, Delta) else item)

        self.submit_to(request_id, prompt_ids, params, emit, priority, lora)

    async def call(self, fn):
        """fn() on the engine thread between two steps (loading an adapter into the slots the steps read);
        returns its result or raises its exception."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(ok: bool, value) -> None:
            if not done.done():
                done.set_result(value) if ok else done.set_exception(value)

        self._commands.put(("call", fn, lambda ok, value: loop.call_soon_threadsafe(settle, ok, value)))
        return await done

    def _post(self, loop: asyncio.AbstractEventLoop, fn, arg) -> None:
        """fn(arg) on `loop`'s thread. A step's deliveries (on the engine thread) are gathered and posted at once:
        one wake-up of the HTTP loop per step, not one per streaming request, so that at 32+ streams the engine
        thread does not spend its step writing to the loop's self-pipe while the HTTP side holds the GIL."""
        if self._gathered is not None and threading.get_ident() == self._engine_thread:
            self._gathered.setdefault(loop, []).append((fn, arg))
        else:
            loop.call_soon_threadsafe(fn, arg)

    def submit_to(self, request_id: str, prompt_ids: list[int], params: SamplingParams, emit,
                  priority: int = 0, lora: str | None = None) -> None:
        """Queue a request whose Deltas (or the exception that failed it) go to `emit`, from the engine thread."""
        self._outputs[request_id] = emit
        with self._lock:
            self.pending += 1
        self._commands.put(("add", request_id, prompt_ids, params, priority, lora))

    def abort(self, request_id: str) -> None:
        """Cancel a request (its client went away): its blocks are freed by the next loop turn."""
        if self._outputs.pop(request_id, None) is not None:
            self._commands.put(("abort", request_id))

    def abort_all(self, error: BaseException) -> None:
        """End every request in flight with `error` (its handler answers it) and free them in the engine. Call it
        on the asyncio loop's thread, as submit and abort."""
        for rid, emit in list(self._outputs.items()):
            self.abort(rid)
            emit(error)

    # ---- the engine thread ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        self._engine_thread = threading.get_ident()
        grouped = getattr(engine, "dp_group", None) is not None
        try:
            while not (engine.group_stop if grouped else self._stop.is_set()):
                if grouped:  # a stop is agreed at the next step, so that no rank waits in a collective alone
                    engine.stop_requested = self._stop.is_set()
                idle = not engine.has_work() and not (grouped and (engine.group_busy or engine.stop_requested))
                self._drain(block=idle)  # idle everywhere: wait for a request (at most 50 ms) before the next turn
                if not grouped and not engine.has_work():
                    continue
                self._gathered = {}
                try:
                    for req in engine.step():
                        self._deliver(req)
                finally:
                    gathered, self._gathered = self._gathered, None
                    for loop, calls in gathered.items():
                        loop.call_soon_threadsafe(_call_all, calls)
        except BaseException as e:  # the server answers 500/503 from here on and says why
            self.error = e
            for emit in list(self._outputs.values()):
                emit(e)
            raise

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd[0] == "add":
                _, rid, prompt_ids, params, priority, lora = cmd
                emit = self._outputs.get(rid)
                try:
                    if emit is not None:  # not aborted meanwhile
                        self.engine.add_request(rid, prompt_ids, params, stream_text=True, priority=priority,
                                                lora=lora)
                except Exception as e:  # checked by the handler already; whatever slipped through is its 400
                    self._outputs.pop(rid, None)
                    emit(e)
                finally:  # only once it is in the scheduler's queue, so that waiting() never misses it
                    with self._lock:
                        self.pending -= 1
            elif cmd[0] == "call":
                try:
                    result = (True, cmd[1]())
                except Exception as e:  # the caller's answer (a UserError is its 400/404)
                    result = (False, e)
                cmd[2](*result)
            elif cmd[0] == "abort":
                req = self.engine.requests.get(cmd[1])
                self.engine.abort(cmd[1])
                if req is not None and self.metrics is not None:
                    self.metrics.finished("abort", timing_of(req), cmd[1])
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, req) -> None:
        emit = self._outputs.get(req.request_id)
        finished = req.finish_reason is not None
        timing = timing_of(req) if finished else None
        if self.metrics is not None and hasattr(self.metrics, "token"):
            self.metrics.token(req.request_id)
        if finished:
            self._outputs.pop(req.request_id, None)
            if self.metrics is not None:
                self.metrics.finished(req.finish_reason, timing, req.request_id)
        if emit is None:
            return
        # A speculative step delivers its accepted drafts with its own token (engine._deliver): all of them.
        tokens = req.step_token_ids or [req.last_token_id]
        n, k = len(req.logprobs), len(tokens)
        emit(Delta(list(tokens), req.stream.delta if req.stream is not None else "", finished,
                   req.finish_reason, req.logprobs[n - k:] if n and req.params.logprobs is not None else [],
                   req.top_logprobs[n - k:] if n and req.params.logprobs is not None else [], timing))


def _call_all(calls: list) -> None:
    for fn, arg in calls:
        fn(arg)


def now() -> int:
    return int(time.time())
