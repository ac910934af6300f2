"""`paraseek serve MODEL`: check everything, start the HTTP server at once (/health says "loading"), build the engine
on its own thread, serve until SIGTERM/SIGINT, drain, exit 0."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

from paraseek.errors import UserError


def _check(ns: argparse.Namespace) -> None:
    checks = [
        (0 < ns.port < 65536, f"--port must be in 1..65535, got {ns.port}"),
        (ns.max_queue >= 1, f"--max-queue must be >= 1, got {ns.max_queue}"),
        (ns.drain_timeout >= 0, f"--drain-timeout must be >= 0 seconds, got {ns.drain_timeout}"),
        (ns.request_timeout > 0, f"--request-timeout must be > 0 seconds, got {ns.request_timeout}"),
        (ns.max_body_bytes >= 1024, f"--max-body-bytes must be >= 1024, got {ns.max_body_bytes}"),
        # `--api-key "$KEY"` with KEY unset would otherwise serve without a key
        (ns.api_key is None or ns.api_key.strip() != "",
         "--api-key is empty (an unset variable?): give the key, or leave the flag out to serve without one"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UserError(msg)
    if (ns.batch_file is None) != (ns.output is None):
        raise UserError("--batch-file IN.jsonl and --output OUT.jsonl go together")
    if ns.batch_file is not None and (ns.dp > 1 or ns.dp_attention):
        raise UserError("--batch-file runs one engine: leave out --dp and --dp-attention")
    from paraseek.infer.flags import lora_enabled, parse_lora_modules

    ns.lora_modules = parse_lora_modules(ns.lora_modules or [], "--lora-modules")
    if lora_enabled(ns) and ns.dp > 1:
        raise UserError("LoRA adapters with --dp > 1 are not supported: serve them from one replica (--tp for more "
                        "GPUs)")
    if ns.served_model_name is not None and ns.served_model_name in ns.lora_modules:
        raise UserError(f"--lora-modules: {ns.served_model_name!r} is the base model's --served-model-name; give the "
                        "adapter another name")
    ns.allowed_origins = _origins(ns.allowed_origins)
    for mod in ("fastapi", "uvicorn", "pydantic", "prometheus_client"):
        try:
            __import__(mod)
        except ImportError as e:  # the cause too: an installed package whose own dependency is missing reads the same
            raise UserError(f"paraseek serve needs {mod} ({e}): pip install 'paraseek[serve]'") from None


def _origins(text: str | None) -> list[str] | None:
    """--allowed-origins: a JSON list (vLLM's form, '["https://a.example"]') or comma-separated origins."""
    if text is None:
        return None
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = [x.strip() for x in text.split(",") if x.strip()]
    if not isinstance(value, list) or not value or not all(isinstance(x, str) and x for x in value):
        raise UserError(f"--allowed-origins must be a JSON list of origins or comma-separated origins, got {text!r}")
    for origin in value:
        if origin != "*" and not origin.startswith(("http://", "https://")):
            raise UserError(f"--allowed-origins: {origin!r} is not an origin (scheme://host[:port]) or *")
    return value


def check_capacity(num_blocks: int, block_size: int, max_len: int, given: bool) -> None:
    """Refuse a KV cache that cannot hold one sequence of max_len tokens (block 0 is padding, never handed out):
    every request of full length would be refused while /health said ok."""
    tokens = (num_blocks - 1) * block_size
    if tokens >= max_len:
        return
    need = -(-max_len // block_size) + 1
    how = (f"give --num-kv-blocks {need} or more" if given else "raise --gpu-memory-utilization or --kv-cache-gib, "
           "or use more GPUs (--tp)")
    raise UserError(f"the KV cache holds {tokens:,} tokens ({num_blocks - 1} blocks of {block_size}), less than one "
                    f"sequence of --max-model-len {max_len:,}: {how}, or serve --max-model-len {tokens} or less")


def _check_address(host: str, port: int) -> None:
    """Bind the address as uvicorn will, now: a port in use or a host that is not this machine's costs one line
    before the model loads, not a bind error after it."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); choose another "
                            "--port, or a --host of this machine") from None


def cmd_serve(ns: argparse.Namespace) -> int:
    import os

    from paraseek.infer.build import build_engine, check_lora_modules, check_speculative
    from paraseek.infer.flags import engine_config, generation_defaults
    from paraseek.infer.load import load_tokenizer, resolve_source
    from paraseek.infer.ranks import WORKER_ENV, check_parallel, device_for, finish, place, replica_gpus
    from paraseek.launcher import spawn

    _check(ns)
    if ns.batch_file is not None:
        from paraseek.serve.batch import read_batch

        read_batch(ns.batch_file)  # a bad file costs one line before the model loads
    elif os.environ.get(WORKER_ENV) != "1":  # the launching process; its rank 0 listens
        _check_address(ns.host, ns.port)
    src = resolve_source(ns.model, random_weights=ns.random_weights, tokenizer=ns.tokenizer)
    device = device_for(ns)
    check_parallel(ns, src.args, device)
    if ns.served_model_name is None and ns.model in ns.lora_modules:
        raise UserError(f"--lora-modules: {ns.model!r} is the base model's name; give the adapter another name")
    check_lora_modules(ns, src.args, "--lora-modules")
    check_speculative(ns, src)
    max_len = engine_config(ns).context_length(src.args)
    if ns.num_kv_blocks is not None:
        check_capacity(ns.num_kv_blocks, ns.block_size, max_len, given=True)
    if ns.chat_template and src.tokenizer is None:
        raise UserError("--chat-template needs a tokenizer; this model has none")
    tokenizer = load_tokenizer(src, ns.chat_template)
    defaults, why = generation_defaults(src)
    # Engine loops behind the server: one per replica, or under --dp-attention one per rank (its own requests; the
    # ranks' loops step together, serve/loop.py), each routed to as a replica.
    loops = ns.dp * (ns.ep if ns.dp_attention else 1)
    if replica_gpus(ns) * ns.dp > 1 and os.environ.get(WORKER_ENV) != "1":
        return spawn(replica_gpus(ns) * ns.dp, ns.argv, {WORKER_ENV: "1"})
    pl = place(ns, device)
    listener = None
    if loops > 1:  # the HTTP process listens for the other loops' drivers; everyone learns where
        import torch.distributed as dist

        from paraseek.serve.replicas import listen

        box = [None]
        if pl.rank == 0:
            listener, address, key = listen(loops - 1)
            box = [(address, key)]
        dist.broadcast_object_list(box, src=0, group=pl.world_gloo)
        address, key = box[0]
    if pl.rank != 0:
        from paraseek.infer.engine import serve_worker

        for sig in (signal.SIGTERM, signal.SIGINT):  # the HTTP process decides when to stop, and tells this rank
            signal.signal(sig, signal.SIG_IGN)
        engine = build_engine(ns, src, pl, log=lambda *a, **k: None)
        if not pl.driver and not ns.dp_attention:
            serve_worker(engine.runner, pl.meta_group)
        else:  # the driver of replica 1, 2, ... (every rank under --dp-attention): its own loop, fed over HTTP
            from paraseek.serve.loop import EngineLoop
            from paraseek.serve.replicas import serve_remote

            serve_remote(EngineLoop(engine), address, key, pl.rank if ns.dp_attention else pl.replica)
            engine.shutdown()
        return finish(0, pl)

    import uvicorn

    from paraseek.serve.api import ServerState, build_app
    from paraseek.serve.loop import EngineLoop
    from paraseek.serve.metrics import ServerMetrics

    name = ns.served_model_name or ns.model
    state = ServerState(name, tokenizer, max_len, ns.api_key, ns.max_queue, ns.request_timeout, defaults,
                        allowed_origins=ns.allowed_origins, root=ns.model)
    say = lambda msg: print(f"serve: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    tools = tokenizer.tool_template() if tokenizer is not None and tokenizer.chat_templates else None
    tools_why = ("no tool calls (the chat template renders no tools)" if tools is None else
                 f"tool calls in the {tools.format or 'template'} syntax"
                 f"{f' with the shipped {tools.shipped} (the model template renders no tools)' if tools.shipped else ''}")
    if ns.batch_file is not None:
        from paraseek.serve.batch import run_batch

        say(f"{src.spec} ({src.kind}) as {name!r}, batch {ns.batch_file} -> {ns.output} | {tools_why}")
        engine = build_engine(ns, src, pl, log=say)
        check_capacity(engine.report.num_blocks, ns.block_size, max_len, given=ns.num_kv_blocks is not None)
        say(engine.report.line())
        try:
            rc = run_batch(ns, state, engine, EngineLoop)
        finally:
            engine.shutdown()
        return finish(rc, pl)
    app = build_app(state, ns.max_body_bytes)
    say(f"{src.spec} ({src.kind}) as {name!r} on http://{ns.host}:{ns.port} | tokenizer: {src.tokenizer_why} | "
        f"sampling defaults: {why} | {tools_why}{' | API key required' if ns.api_key else ''}"
        f"{f' | CORS: {ns.allowed_origins}' if ns.allowed_origins else ''}")

    loop_box: list = []

    def cut_off() -> None:  # the drain ran out: what still runs ends with a 503 (an error event when streamed)
        if loop_box:
            from paraseek.serve.api import HTTPError

            loop_box[-1].abort_all(HTTPError(503, f"the server shut down before this request finished "
                                             f"(--drain-timeout {ns.drain_timeout:g} s)", "service_unavailable"))

    # uvicorn's own deadline comes a little later: by then the handlers have answered and nothing is cancelled
    server = _Server(uvicorn.Config(app, host=ns.host, port=ns.port, log_level="warning", access_log=False,
                                    timeout_graceful_shutdown=ns.drain_timeout + 2, timeout_keep_alive=5), state,
                     ns.drain_timeout, cut_off)
    failure = [0]  # the exit code when the engine could not start or died: 2 for a user mistake, 1 otherwise

    def engine_thread() -> None:
        try:
            t0 = time.perf_counter()
            engine = build_engine(ns, src, pl, log=say)
            check_capacity(engine.report.num_blocks, ns.block_size, max_len, given=ns.num_kv_blocks is not None)
            loop = EngineLoop(engine)
            loop_box.append(loop)
            if listener is None:
                loop.metrics = state.metrics = ServerMetrics(engine.stats, name, ns.block_size, max_len)
                state.loop = loop
            else:
                from paraseek.serve.replicas import ReplicaSet, accept

                replicas = ReplicaSet(loop, accept(listener, loops - 1))
                loop_box.append(replicas)
                state.metrics = replicas.metrics = ServerMetrics(replicas.stats, name, ns.block_size, max_len)
                for r in replicas.replicas:
                    r.metrics = state.metrics
                state.loop = replicas
            ranks = f" of {ns.ep} dp-attention ranks each" if ns.dp_attention else ""
            say(f"{engine.report.line()} | {ns.dp} replica(s){ranks} ready in {time.perf_counter() - t0:.1f} s")
            loop.run()
        except UserError as e:
            state.failed, failure[0] = str(e), 2
            say(f"error: {e}")
            server.should_exit = True
        except BaseException as e:  # the engine died: /health says so, requests get 503, the process exits 1
            state.failed, failure[0] = f"{type(e).__name__}: {e}", 1
            say(f"error: the engine stopped: {state.failed}")
            server.should_exit = True

    t = threading.Thread(target=engine_thread, name="paraseek-engine", daemon=True)
    t.start()
    server.run()
    state.draining = True
    if len(loop_box) > 1:
        for r in loop_box[1].remotes:  # the other replicas stop their loops and their tp ranks
            r.stop()
    if loop_box:
        loop_box[0].stop()
        t.join(30)
        loop_box[0].engine.shutdown()
    say(f"stopped ({server.stop_reason})")
    return failure[0] or finish(0, pl)


class _Server:
    """uvicorn's Server with our own signal handling: the first SIGTERM/SIGINT starts the drain (new requests get
    503, running ones have --drain-timeout seconds), and the process then exits 0 instead of re-raising the signal
    as uvicorn does."""

    def __new__(cls, config, state, drain_timeout: float, cut_off):
        import asyncio

        import uvicorn

        class Server(uvicorn.Server):
            stop_reason = "engine failed"

            def install_signal_handlers(self) -> None:  # older uvicorn
                pass

            def capture_signals(self):
                import contextlib

                @contextlib.contextmanager
                def handlers():
                    if threading.current_thread() is not threading.main_thread():
                        yield
                        return
                    old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
                    try:
                        yield
                    finally:
                        for s, h in old.items():
                            signal.signal(s, h)

                return handlers()

            def handle_exit(self, sig, frame) -> None:
                if not state.draining:  # the first signal: start the drain's clock (on the server's event loop)
                    loop = asyncio.get_event_loop()
                    loop.call_soon_threadsafe(loop.call_later, drain_timeout, cut_off)
                state.draining = True
                self.stop_reason = signal.Signals(sig).name
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True  # a second Ctrl-C: abort at once
                self.should_exit = True

        return Server(config)


# The server's tokens per step. Measured on one H200 (R1-Distill-Llama-8B shape, 512-token prompts, 128 output
# tokens, BENCHMARKS.md "Serving"), at concurrency 32: 8,192 gave a median TTFT of 373 ms and 3,390 output tokens/s,
# 2,048 gave 275 ms and 3,538, 1,024 gave 177 ms and 3,237 (86% of the offline engine). A burst of prompts is
# prefilled a few per step instead of 16 at once, so first tokens (and the next arrivals) spread out; the price is
# throughput at high concurrency (4,254 against 4,830 tokens/s at 64) and long prompts prefilled in more steps.
# --max-batched-tokens 8192 is the throughput setting.
SERVE_MAX_BATCHED_TOKENS = 1024


def register(subparsers) -> None:
    from paraseek.infer.flags import add_engine_arguments

    p = subparsers.add_parser(
        "serve", help="an OpenAI-compatible server on the inference engine (completions, chat, streaming, metrics)",
        description="Serve MODEL behind the OpenAI API: POST /v1/completions and /v1/chat/completions (streaming "
        "with SSE; the chat template of the model folder), GET /v1/models, /health (200 once the engine is warm), "
        "/metrics (Prometheus). Errors are OpenAI's JSON objects; a client that disconnects frees its KV blocks at "
        "once; the waiting queue is bounded (429); SIGTERM drains and exits 0.")
    add_engine_arguments(p, SERVE_MAX_BATCHED_TOKENS, ": fewer than generate's 8192, so that a burst of prompts is "
                         "prefilled a few per step and each gets its first token sooner; 8192 for throughput")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="default 8000")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ routes")
    s.add_argument("--served-model-name", help="the model name clients send (default: MODEL as given)")
    s.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                   help="LoRA adapters to serve from the start (PEFT folders, as `paraseek export --export-adapter` "
                   "writes): a request whose model is NAME runs on that adapter; more can be loaded and unloaded "
                   "while serving (POST /v1/load_lora_adapter, /v1/unload_lora_adapter)")
    s.add_argument("--chat-template", metavar="FILE.jinja", help="use this chat template instead of the model folder's")
    s.add_argument("--max-queue", type=int, default=512,
                   help="waiting requests at most; more get 429 with Retry-After (default 512)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM (default 30)")
    s.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take before it is aborted with 504 (default 600)")
    s.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="request body limit (default 8 MiB)")
    s.add_argument("--allowed-origins", metavar="ORIGINS",
                   help="CORS: origins browsers may call from, as a JSON list ('[\"https://app.example\"]', "
                   "'[\"*\"]') or comma-separated; default: no CORS headers (other origins' pages cannot read "
                   "answers)")
    b = p.add_argument_group("batch (OpenAI's batch file format, run offline through the same routes)")
    b.add_argument("--batch-file", metavar="IN.jsonl", help="requests, one a line ({custom_id, method, url, body}); "
                   "with --output, run them all and exit instead of serving")
    b.add_argument("--output", metavar="OUT.jsonl", help="where --batch-file's answers go, one a line in input order")
    p.set_defaults(func=cmd_serve)
