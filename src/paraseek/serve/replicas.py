"""`paraseek serve --dp N`: N model replicas behind one HTTP server. The first process serves HTTP and runs replica 0;
the driver of every other replica (its first tp rank) connects back over a local socket (the standard library's
multiprocessing.connection, authenticated with a random key) and runs its own engine loop. Requests go to the
replica with the fewest in flight; deltas, errors and engine counters come back on the same connection.
Under `--ep N --dp-attention` each rank is such a replica (its own requests and cache) whose MoE layers are shared
with the other ranks' (infer/ep.py): routing is the same, and the ranks' loops step together (serve/loop.py).
"""

from __future__ import annotations

import secrets
import threading
import time
from multiprocessing.connection import Client, Connection, Listener

from paraseek.serve.loop import Delta, EngineLoop

STATS_EVERY_S = 0.2  # how often a remote replica sends its engine counters


class RemoteReplica:
    """Replica r > 0 as the HTTP process sees it: EngineLoop's submit/abort over a connection."""

    def __init__(self, conn: Connection, metrics=None):
        self.conn, self.metrics = conn, metrics
        self._send_lock = threading.Lock()
        self._outputs: dict[str, object] = {}
        self.stats: dict = {}
        self.error: BaseException | None = None
        self.pending = 0  # sent, not yet taken by the replica's engine thread
        self._pending_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="paraseek-replica", daemon=True)
        self._reader.start()

    def _send(self, msg) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def submit(self, request_id, prompt_ids, params, out, tag=0, priority=0) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        self._outputs[request_id] = lambda item: loop.call_soon_threadsafe(
            out.put_nowait, (tag, item) if isinstance(item, Delta) else item)
        with self._pending_lock:
            self.pending += 1
        self._send(("add", request_id, prompt_ids, params, priority))

    def abort(self, request_id) -> None:
        if self._outputs.pop(request_id, None) is not None:
            self._send(("abort", request_id))

    def abort_all(self, error: BaseException) -> None:
        for rid, emit in list(self._outputs.items()):
            self.abort(rid)
            emit(error)

    def in_flight(self) -> int:
        return len(self._outputs)

    def waiting(self) -> int:
        return self.stats.get("waiting", 0) + self.pending

    def stop(self) -> None:
        try:
            self._send(("stop",))
        except OSError:
            pass

    def _read(self) -> None:
        try:
            while True:
                kind, *rest = self.conn.recv()
                if kind == "delta":
                    rid, d = rest
                    emit = self._outputs.get(rid)
                    if self.metrics is not None:
                        self.metrics.token(rid)
                    if d.finished:
                        self._outputs.pop(rid, None)
                        if self.metrics is not None:
                            self.metrics.finished(d.finish_reason, d.timing, rid)
                    if emit is not None:
                        emit(d)
                elif kind == "error":
                    rid, status, message = rest
                    from paraseek.errors import UserError

                    emit = self._outputs.pop(rid, None)
                    if emit is not None:
                        emit(UserError(message) if status == 400 else RuntimeError(message))
                elif kind == "added":  # with the replica's waiting count, itself included, taken after the add
                    with self._pending_lock:
                        self.stats = {**self.stats, "waiting": rest[0]}
                        self.pending -= 1
                elif kind == "aborted":
                    if self.metrics is not None:
                        self.metrics.finished("abort", rest[1], rest[0])
                elif kind == "stats":
                    self.stats = rest[0]
        except (EOFError, OSError) as e:  # the replica went away: its requests fail, the server says so
            self.error = RuntimeError(f"a model replica stopped ({type(e).__name__})")
            for emit in list(self._outputs.values()):
                emit(self.error)


class ReplicaSet:
    """What the HTTP side calls `state.loop`: the replicas, with requests sent to the least busy one."""

    def __init__(self, local: EngineLoop, remotes: list[RemoteReplica]):
        self.local, self.remotes = local, remotes
        self.engine = local.engine  # request checks (every replica runs the same model and settings)
        self._where: dict[str, object] = {}
        self.metrics = None

    @property
    def replicas(self) -> list:
        return [self.local, *self.remotes]

    @property
    def error(self):
        return next((r.error for r in self.replicas if r.error is not None), None)

    def waiting(self) -> int:
        return sum(r.waiting() for r in self.replicas)

    def submit(self, request_id, prompt_ids, params, out, tag=0, priority=0, lora=None) -> None:
        assert lora is None, "serve refuses LoRA adapters with --dp > 1"
        loads = [len(self.local._outputs)] + [r.in_flight() for r in self.remotes]
        i = min(range(len(loads)), key=loads.__getitem__)
        if self.metrics is not None:
            self.metrics.routed.labels(str(i)).inc()
        self._where[request_id] = self.replicas[i]
        self.replicas[i].submit(request_id, prompt_ids, params, out, tag, priority)

    def abort(self, request_id) -> None:
        replica = self._where.pop(request_id, None)
        if replica is not None:
            replica.abort(request_id)

    def abort_all(self, error: BaseException) -> None:
        for r in self.replicas:
            r.abort_all(error)

    def stats(self) -> dict:
        """The replicas' engine counters summed (the hit rate recomputed from the sums)."""
        parts = [self.local.engine.stats()] + [r.stats for r in self.remotes]
        out: dict = {}
        for p in parts:
            for k, v in p.items():
                if k == "spec_accepted_per_pos":  # one count per draft position
                    out[k] = [a + b for a, b in zip(out.get(k, [0] * len(v)), v)]
                else:
                    out[k] = out.get(k, 0) + v
        out["prefix_hit_rate"] = out.get("prefix_cache_hits", 0) / out["prefix_cache_queries"] \
            if out.get("prefix_cache_queries") else 0.0
        total = out.get("kv_blocks_total", 0)
        out["kv_usage"] = out.get("kv_blocks_used", 0) / total if total else 0.0
        return out


# ---- set-up ---------------------------------------------------------------------------------------------------------
def listen(n_remotes: int) -> tuple[Listener, tuple, bytes]:
    """On the HTTP process: a local socket the other replicas' drivers connect to."""
    key = secrets.token_bytes(32)
    listener = Listener(("127.0.0.1", 0), authkey=key)
    return listener, listener.address, key


def accept(listener: Listener, n: int, metrics=None, timeout: float = 600.0) -> list[RemoteReplica]:
    """The n other replicas, in the order they connect (each says its replica index first)."""
    replicas: dict[int, RemoteReplica] = {}
    deadline = time.time() + timeout
    while len(replicas) < n:
        if time.time() > deadline:
            raise RuntimeError(f"only {len(replicas)} of {n} replicas connected within {timeout:.0f} s")
        conn = listener.accept()
        index = conn.recv()
        replicas[index] = RemoteReplica(conn, metrics)
    return [replicas[i] for i in sorted(replicas)]


def serve_remote(loop: EngineLoop, address, key: bytes, index: int) -> None:
    """On a replica's driver: connect, then run the engine loop here; commands arrive on a reader thread."""
    conn = Client(tuple(address), authkey=key)
    conn.send(index)
    send_lock = threading.Lock()

    def send(msg) -> None:
        with send_lock:
            conn.send(msg)

    def emitter(rid):
        def emit(item) -> None:
            if isinstance(item, Delta):
                send(("delta", rid, item))
            else:
                from paraseek.errors import UserError

                send(("error", rid, 400 if isinstance(item, UserError) else 500, str(item)))
        return emit

    def read() -> None:
        try:
            while True:
                kind, *rest = conn.recv()
                if kind == "add":
                    rid, prompt_ids, params, priority = rest
                    loop.submit_to(rid, prompt_ids, params, emitter(rid), priority)
                    with send_lock:  # counted and sent under one lock: counts arrive in the order they were taken
                        conn.send(("added", loop.waiting()))
                elif kind == "abort":
                    loop.abort(rest[0])
                elif kind == "stop":
                    break
        except (EOFError, OSError):
            pass
        loop.stop()

    def push_stats() -> None:
        while not loop.stopped():
            try:
                stats = loop.engine.stats()
                with send_lock:
                    conn.send(("stats", {**stats, "waiting": loop.waiting()}))
            except OSError:
                return
            time.sleep(STATS_EVERY_S)

    threading.Thread(target=read, name="paraseek-replica-commands", daemon=True).start()
    threading.Thread(target=push_stats, name="paraseek-replica-stats", daemon=True).start()
    loop.metrics = _AbortReporter(send)
    loop.run()
    conn.close()


class _AbortReporter:
    """A remote replica's stand-in for the metrics: it reports aborts to the HTTP process, which keeps the counts
    (finished requests are counted there from their last delta)."""

    def __init__(self, send):
        self._send = send

    def finished(self, finish_reason, timing, request_id=None) -> None:
        if finish_reason == "abort":
            try:
                self._send(("aborted", request_id, timing))
            except OSError:
                pass
