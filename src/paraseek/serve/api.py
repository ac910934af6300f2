"""`paraseek serve`: the OpenAI API over the inference engine (FastAPI + uvicorn, as vLLM and SGLang serve).

Routes: POST /v1/completions, POST /v1/chat/completions (SSE streaming with `stream`; tool calls, structured
outputs), GET /v1/models, POST /tokenize and /detokenize (vLLM's), /health, /metrics (Prometheus, vLLM's names and
paraseek's), POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; a request's `model` names the base
model or a loaded LoRA adapter). Until the engine is warm every route but /metrics answers 503 (a client that waits
for /v1/models, as scripts written for vLLM do, can send its requests once it gets a 200). Every error is OpenAI's
JSON object with the right status, and the server keeps serving after it; a field the server does not implement is a
400 that names it, never silently ignored. A client that disconnects cancels its request at once; the waiting queue
is bounded (429 with Retry-After); SIGTERM stops admitting, lets running requests finish for --drain-timeout
seconds, aborts the rest and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from paraseek.errors import UserError
from paraseek.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     LoadLoRAAdapterRequest, TokenizeRequest, UnloadLoRAAdapterRequest, error_body,
                                     refused_field)
from paraseek.serve.tools import ToolCallParser, ToolError, check_tools, forced_spec, history_arguments

_PROTECTED = ("/v1/", "/tokenize", "/detokenize")  # the routes --api-key guards (probes and scrapers need no key)


@dataclass
class ServerState:
    served_name: str
    tokenizer: Any
    max_model_len: int
    api_key: str | None = None
    max_queue: int = 512
    request_timeout: float = 600.0
    defaults: dict = field(default_factory=dict)  # sampling defaults (generation_config.json)
    loop: Any = None  # EngineLoop once the engine is warm
    metrics: Any = None
    draining: bool = False
    failed: str | None = None  # why the engine could not start
    created: int = field(default_factory=lambda: int(time.time()))
    allowed_origins: list[str] | None = None  # CORS (--allowed-origins); None: no CORS headers at all
    root: str | None = None  # the model as given (MODEL), /v1/models' root of the base model


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


def bad(param: str | None, message: str) -> HTTPError:
    """A 400 naming the field."""
    return HTTPError(400, message, param=param)


def build_app(state: ServerState, max_body_bytes: int = 8 * 2**20) -> FastAPI:
    app = FastAPI(title="paraseek", docs_url=None, redoc_url=None)

    def error(status: int, message: str, type_: str = "invalid_request_error", param=None, headers=None):
        if state.metrics is not None:
            state.metrics.errors.labels(str(status)).inc()
        return JSONResponse(error_body(message, type_, param, status), status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', '')})".strip())
        locs = [[str(x) for x in e.get("loc", []) if x != "body"] for e in exc.errors()]
        # A union field (prompt: str | list[int] | ...) fails once per member, under the member's name ("prompt.str"):
        # the param is the part those errors share.
        loc = os.path.commonprefix([x for x in locs if x[:1] == locs[0][:1]]) if locs else []
        param = ".".join(loc) or None
        return error(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param=param)

    @app.exception_handler(StarletteHTTPException)  # unknown routes, wrong methods, bodies over the limit
    async def on_starlette(request: Request, exc: StarletteHTTPException):
        type_ = {404: "not_found_error"}.get(exc.status_code, "invalid_request_error")
        return error(exc.status_code, str(exc.detail), type_, headers=getattr(exc, "headers", None))

    @app.exception_handler(HTTPError)
    async def on_http_error(request: Request, exc: HTTPError):
        return error(exc.status, exc.message, exc.type, exc.param, exc.headers)

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception):
        return error(500, f"internal error: {type(exc).__name__}: {exc}"[:500], "server_error")

    @app.get("/health")
    async def health():
        if state.failed:
            return JSONResponse({"status": "failed", "reason": state.failed}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if state.loop is None:
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        if state.metrics is None:
            return PlainTextResponse("", media_type=CONTENT_TYPE_LATEST)
        return PlainTextResponse(generate_latest(state.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        _ready(state)
        card = lambda name, root, parent: {"id": name, "object": "model", "created": state.created,  # noqa: E731
                                           "owned_by": "paraseek", "root": root, "parent": parent,
                                           "max_model_len": state.max_model_len}
        loras = state.loop.engine.loras
        adapters = [card(one.name, one.path, state.served_name) for one in list(loras.by_name.values())] if loras else []
        return {"object": "list", "data": [card(state.served_name, state.root, None), *adapters]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        """Read the PEFT folder off the event loop, then copy it into a free slot between two engine steps."""
        from paraseek.infer.lora import read_adapter

        _ready(state)
        engine, name = state.loop.engine, body.lora_name
        if name == state.served_name:
            raise bad("lora_name", f"{name!r} is the base model's name; give the adapter another name")
        if engine.loras is None:
            raise bad(None, "this server has no adapter slots: start it with --enable-lora (or --lora-modules)")
        with _lora_errors("lora_name"):
            engine.loras.check_new(name)  # already loaded, or no free slot: before reading the folder
        with _lora_errors("lora_path"):
            adapter = await asyncio.to_thread(read_adapter, body.lora_path, engine.args, engine.cfg.max_lora_rank)
        with _lora_errors("lora_name"):
            await state.loop.call(lambda: engine.load_lora(name, body.lora_path, adapter))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        """Refused (400) while requests of the adapter are unfinished; they keep running on it."""
        _ready(state)
        engine = state.loop.engine
        with _lora_errors("lora_name"):
            await state.loop.call(lambda: engine.unload_lora(body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _ready(state, body.model)
        _check_fields(body, chat=False)
        prompts = _completion_prompts(body, state)
        spec, param = _structured(body)
        return await _run(state, request, body, prompts, ChatSetup(structured=spec, structured_param=param),
                          chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        _ready(state, body.model)
        _check_fields(body, chat=True)
        prompt_ids, text, setup = _chat_prompt(body, state)
        return await _run(state, request, body, [(prompt_ids, text)], setup, chat=True)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        _ready(state, body.model)
        tok = _tokenizer(state, "prompt" if body.messages is None else "messages")
        if (body.prompt is None) == (body.messages is None):
            raise bad(None, "give prompt or messages (one of them)")
        if body.prompt is not None:
            ids = tok.encode(body.prompt, add_special_tokens=True if body.add_special_tokens is None
                             else body.add_special_tokens)
        else:
            chat = ChatCompletionRequest.model_construct(
                messages=body.messages, tools=body.tools, tool_choice=None, add_generation_prompt=body.add_generation_prompt,
                chat_template_kwargs=body.chat_template_kwargs, add_special_tokens=bool(body.add_special_tokens),
                response_format=None, parallel_tool_calls=True)
            ids, _, _ = _chat_prompt(chat, state)
        out = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [tok.decode([t], skip_special_tokens=False) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _ready(state, body.model)
        tok = _tokenizer(state, "tokens")
        vocab = state.loop.engine.args.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise bad("tokens", f"token ids must be in 0..{vocab - 1}")
        return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}

    app.add_middleware(_Guard, state=state, limit=max_body_bytes, error=error)
    if state.allowed_origins:  # outermost: answers preflights before the key check, and marks every answer
        app.add_middleware(_Cors, origins=state.allowed_origins)
    app.state.paraseek = state
    return app


class _Cors:
    """Starlette's CORS middleware for the allowed origins only: a request from any other origin (or with none)
    reaches the app as it is, so it gets no Access-Control-* header at all (a browser then refuses the page the
    answer)."""

    def __init__(self, app, origins: list[str]):
        from starlette.middleware.cors import CORSMiddleware

        self.app, self.any = app, "*" in origins
        self.origins = set(origins)
        self.cors = CORSMiddleware(app, allow_origins=origins, allow_methods=["*"], allow_headers=["*"],
                                   allow_credentials=not self.any)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            origin = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"origin"), None)
            if origin is not None and (self.any or origin in self.origins):
                return await self.cors(scope, receive, send)
        return await self.app(scope, receive, send)


class _Guard:
    """Before a guarded route runs: the API key, then the body limit, from Content-Length when the client sends one,
    else counted as the route reads the body (a chunked upload says no size up front): the first byte over the
    limit ends the read with a 413. Plain ASGI rather than @app.middleware, because Starlette's BaseHTTPMiddleware
    wraps `receive` so that request.is_disconnected() never sees a client leave."""

    def __init__(self, app, state: ServerState, limit: int, error):
        self.app, self.state, self.limit, self.error = app, state, limit, error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(_PROTECTED):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        reject = None
        key = self.state.api_key
        if key is not None and headers.get("authorization", "") != f"Bearer {key}":
            reject = self.error(401, "a valid API key is required (Authorization: Bearer KEY)", "authentication_error")
        elif (length := headers.get("content-length", "")).isdigit() and int(length) > self.limit:
            reject = self.error(413, f"the request body is {int(length):,} bytes; the limit is {self.limit:,}")
        if reject is not None:
            return await reject(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # FastAPI passes its own HTTPException on (any other becomes a 400)
                    raise HTTPException(413, f"the request body is over the limit of {self.limit:,} bytes")
            return message

        await self.app(scope, counted, send)


# ---- request -> engine ---------------------------------------------------------------------------------------------
@dataclass
class ChatSetup:
    """What the chat request's tools and formats mean for generation and for its response."""

    tool_format: str | None = None  # the tool-call syntax to parse out of the output (None: no parsing)
    reasoning: bool = False  # the prompt ends inside <think>: the output starts with reasoning
    structured: dict | None = None  # the grammar spec
    structured_param: str | None = None  # the field it came from, for its errors


def _ready(state: ServerState, model: str | None = None) -> None:
    if state.failed:
        raise HTTPError(503, f"the engine failed to start: {state.failed}", "service_unavailable")
    if state.draining:
        raise HTTPError(503, "the server is shutting down", "service_unavailable")
    if state.loop is None:
        raise HTTPError(503, "the model is still loading", "service_unavailable", headers={"Retry-After": "5"})
    if state.loop.error is not None:
        raise HTTPError(503, f"the engine stopped: {type(state.loop.error).__name__}: {state.loop.error}",
                        "service_unavailable")
    loras = state.loop.engine.loras
    if model is not None and model != state.served_name and (loras is None or model not in loras.by_name):
        adapters = sorted(loras.by_name) if loras is not None else []
        also = f" and the LoRA adapter{'s' if len(adapters) > 1 else ''} {', '.join(adapters)}" if adapters else ""
        raise HTTPError(404, f"The model `{model}` does not exist; this server serves `{state.served_name}`{also}",
                        "not_found_error", "model")


@contextlib.contextmanager
def _lora_errors(param: str):
    """An adapter's UserError as its HTTP answer: 404 when it is not found (lora.AdapterNotFound), else 400."""
    try:
        yield
    except UserError as e:
        status = getattr(e, "status", 400)
        raise HTTPError(status, str(e), "not_found_error" if status == 404 else "invalid_request_error",
                        param) from None


def _tokenizer(state: ServerState, param: str):
    if state.tokenizer is None:
        raise bad(param, "this model has no tokenizer")
    return state.tokenizer


def _check_fields(body, chat: bool) -> None:
    """The fields that are known but not implemented, and the combinations that make no sense: a 400 each."""
    refused = refused_field(body)
    if refused is not None:
        raise bad(*refused)
    if body.best_of is not None and body.best_of != body.n:
        raise bad("best_of", f"best_of must equal n ({body.n}): returning the best of more candidates than choices "
                  "is not supported")
    if chat and body.top_logprobs is not None and not body.logprobs:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    if not chat and body.echo and body.logprobs is not None:
        raise bad("echo", "echo with logprobs needs the prompt's log-probabilities, which are not supported")
    if body.guided_decoding_backend not in (None, "auto", "xgrammar"):
        raise bad("guided_decoding_backend", "the only guided decoding backend is xgrammar")
    if body.stream_options is not None and not body.stream:
        raise bad("stream_options", "stream_options needs stream: true")


def _completion_prompts(body, state: ServerState) -> list[tuple[list[int], str | None]]:
    p = body.prompt
    if isinstance(p, str):
        p = [p]
    elif p and isinstance(p[0], int):
        p = [p]
    if not p:
        raise bad("prompt", "prompt is empty")
    out = []
    for x in p:
        if isinstance(x, str):
            if state.tokenizer is None:
                raise bad("prompt", "this model has no tokenizer: send prompt as token ids")
            ids, text = state.tokenizer.encode(x, add_special_tokens=body.add_special_tokens), x
        else:
            ids, text = list(x), None
        if body.truncate_prompt_tokens is not None and len(ids) > body.truncate_prompt_tokens:
            ids, text = ids[-body.truncate_prompt_tokens:], None
        out.append((ids, text))
    return out


def _messages(body) -> list[dict]:
    """The request's messages as the chat template takes them: content null kept (a tool-call turn), text parts
    joined, tool calls with their arguments as JSON strings, `developer` as `system` (OpenAI's new name)."""
    messages = []
    for i, m in enumerate(body.messages):
        d = m.model_dump(exclude_none=True)
        d["content"] = m.content
        content = m.content
        if isinstance(content, list):  # OpenAI content parts: the text ones, joined
            texts = [part.get("text", "") for part in content if part.get("type") == "text"]
            if len(texts) != len(content):
                raise bad(f"messages.{i}.content", "only text content parts are supported")
            d["content"] = "".join(texts)
        if d["role"] == "developer":
            d["role"] = "system"
        if m.tool_calls is not None:
            d["tool_calls"] = [{"id": c.id or f"call_{j}", "type": "function",
                                "function": {"name": c.function.name, "arguments": history_arguments(c.function.arguments)}}
                               for j, c in enumerate(m.tool_calls)]
        if d["content"] is None:
            if d["role"] != "assistant":
                raise bad(f"messages.{i}.content", f"a {d['role']} message needs content (only an assistant turn "
                          "with tool_calls may give null)")
            if not d.get("tool_calls"):
                d["content"] = ""
        messages.append(d)
    return messages


def _chat_prompt(body, state: ServerState) -> tuple[list[int], str, ChatSetup]:
    tok = _tokenizer(state, "messages")
    messages = _messages(body)
    try:
        functions = check_tools(body.tools, body.tool_choice)
    except ToolError as e:
        raise bad(e.param, str(e)) from None
    tool_choice = body.tool_choice if body.tool_choice is not None else ("auto" if functions else "none")
    setup, template = ChatSetup(), None
    if functions:
        tt = tok.tool_template()
        if tt is None:
            raise bad("tools", "this model's chat template does not render tools (and is not a DeepSeek template "
                      "this server has a tool-capable one for); give --chat-template with one that does")
        if tt.format is None and tool_choice != "none":
            raise bad("tools", "this model's chat template renders tools, but in a tool-call syntax this server does "
                      "not parse (it parses DeepSeek's); send tool_choice none, or serve a DeepSeek template")
        template = tt.template
        if tool_choice != "none":
            setup.tool_format = tt.format
    kwargs = dict(body.chat_template_kwargs or {})
    if clash := sorted({"messages", "tools", "chat_template", "tokenize"} & set(kwargs)):
        raise bad("chat_template_kwargs", f"chat_template_kwargs cannot set {clash[0]} (a field of the request)")
    kwargs.setdefault("add_generation_prompt", body.add_generation_prompt)
    try:
        text = tok.apply_chat_template(messages, tools=body.tools if functions else None, chat_template=template,
                                       **kwargs)
    except UserError as e:
        raise bad("messages", str(e)) from None
    ids = tok.encode(text, add_special_tokens=body.add_special_tokens)
    if body.truncate_prompt_tokens is not None and len(ids) > body.truncate_prompt_tokens:
        ids = ids[-body.truncate_prompt_tokens:]
    setup.reasoning = text.rstrip().endswith("<think>")
    forced = forced_spec(functions, tool_choice, setup.tool_format, body.parallel_tool_calls) \
        if setup.tool_format else None
    spec, param = _structured(body)
    if forced is not None and spec is not None:
        raise bad(param, f"{param} cannot be combined with tool_choice {json.dumps(body.tool_choice)}: both constrain "
                  "the whole output")
    if forced is not None:
        spec, param = forced, "tool_choice"
    if spec is not None and setup.reasoning and param in ("response_format", "tool_choice"):
        spec["reasoning"] = True  # the constraint applies to the answer after </think>
    setup.structured, setup.structured_param = spec, param
    return ids, text, setup


def _structured(body) -> tuple[dict | None, str | None]:
    """The grammar spec of response_format or vLLM's guided_* fields (at most one of them); (None, None) if none."""
    found = []
    rf = body.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            found.append(({"type": "json_object"}, "response_format"))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
                raise bad("response_format.json_schema", 'json_schema must be {"name": ..., "schema": {...}}')
            found.append(({"type": "json_schema", "schema": js.get("schema", {})}, "response_format"))
        elif kind != "text":
            raise bad("response_format.type", f"response_format type must be text, json_object or json_schema, got "
                      f"{kind!r}")
    if body.guided_json is not None:
        schema = body.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise bad("guided_json", f"guided_json is not valid JSON ({e.msg})") from None
        found.append(({"type": "json_schema", "schema": schema}, "guided_json"))
    if body.guided_regex is not None:
        found.append(({"type": "regex", "regex": body.guided_regex}, "guided_regex"))
    if body.guided_choice is not None:
        if not body.guided_choice or not all(body.guided_choice):
            raise bad("guided_choice", "guided_choice must be a non-empty list of non-empty strings")
        found.append(({"type": "choice", "choices": list(body.guided_choice)}, "guided_choice"))
    if body.guided_grammar is not None:
        found.append(({"type": "ebnf", "grammar": body.guided_grammar}, "guided_grammar"))
    if len(found) > 1:
        raise bad(found[1][1], f"{found[0][1]} and {found[1][1]} both constrain the output: give one")
    return found[0] if found else (None, None)


def _params(body, state: ServerState, prompt_len: int, chat: bool, index: int, setup: ChatSetup):
    from paraseek.infer.sampling import SamplingParams

    d = state.defaults
    if prompt_len >= state.max_model_len:  # else the default max_tokens below is <= 0 and the message says only that
        raise HTTPError(400, f"this model's maximum context length is {state.max_model_len} tokens; the prompt has "
                        f"{prompt_len}", param="messages" if chat else "prompt")
    name, max_tokens = "max_tokens", body.max_tokens
    if chat and body.max_completion_tokens is not None:
        name, max_tokens = "max_completion_tokens", body.max_completion_tokens
    if max_tokens is not None and max_tokens < 1:
        raise bad(name, f"{name} must be >= 1, got {max_tokens}")
    if max_tokens is None:  # OpenAI's default for completions is 16; chat runs to the context's end
        max_tokens = min(16, state.max_model_len - prompt_len) if not chat else state.max_model_len - prompt_len
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if chat:
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    seed = body.seed + index if body.seed is not None else None
    bias = None
    if body.logit_bias:
        bias = {}
        vocab = state.loop.engine.args.vocab_size
        for key, value in body.logit_bias.items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab:
                raise bad("logit_bias", f"logit_bias keys must be token ids in 0..{vocab - 1}, got {key!r}")
            if not -100 <= value <= 100:
                raise bad("logit_bias", f"logit_bias values must be in [-100, 100], got {value}")
            bias[int(key)] = float(value)
    if body.allowed_token_ids is not None:
        vocab = state.loop.engine.args.vocab_size
        if not body.allowed_token_ids or any(not 0 <= t < vocab for t in body.allowed_token_ids):
            raise bad("allowed_token_ids", f"allowed_token_ids must be a non-empty list of ids in 0..{vocab - 1}")
    sp = SamplingParams(
        max_tokens=max_tokens, min_tokens=body.min_tokens,
        temperature=_pick(body.temperature, d.get("temperature"), 1.0), top_p=_pick(body.top_p, d.get("top_p"), 1.0),
        top_k=_pick(body.top_k, d.get("top_k"), 0), min_p=_pick(body.min_p, None, 0.0),
        repetition_penalty=_pick(body.repetition_penalty, None, 1.0),
        frequency_penalty=_pick(body.frequency_penalty, None, 0.0),
        presence_penalty=_pick(body.presence_penalty, None, 0.0), seed=seed, stop=stop,
        stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos, logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens, logit_bias=bias, allowed_token_ids=body.allowed_token_ids,
        structured=dict(setup.structured) if setup.structured is not None else None)
    if sp.structured is not None and (sp.ignore_eos or sp.min_tokens):
        raise bad("ignore_eos" if sp.ignore_eos else "min_tokens", f"{setup.structured_param} ends the output where "
                  f"its grammar ends: ignore_eos and min_tokens cannot be combined with it")
    try:
        return sp.validate()
    except UserError as e:
        field_name = str(e).split(" ", 1)[0]
        raise bad(field_name if field_name in type(body).model_fields else None, str(e)) from None


def _pick(value, default, fallback):
    return value if value is not None else (default if default is not None else fallback)


async def _run(state: ServerState, request, body, prompts: list[tuple[list[int], str | None]], setup: ChatSetup,
               chat: bool):
    loop = state.loop
    engine = loop.engine
    n = body.n
    subs = []  # (choice index, request id, prompt index, params)
    key = uuid.uuid4().hex
    base = body.request_id or f"{'chatcmpl' if chat else 'cmpl'}-{key}"
    for pi, (ids, _) in enumerate(prompts):
        for j in range(n):
            params = _params(body, state, len(ids), chat, j, setup)
            try:
                if params.structured is not None and not subs:  # the grammar compiles off the event loop
                    await asyncio.to_thread(engine.check_request, ids, params)
                else:
                    engine.check_request(ids, params)
            except UserError as e:
                param = setup.structured_param if params.structured is not None and "grammar" in str(e) else (
                    "messages" if chat else "prompt")
                raise HTTPError(400, str(e), param=param) from None
            subs.append((pi * n + j, f"{key}-{pi * n + j}", pi, params))
    if loop.waiting() + len(subs) > state.max_queue:
        raise HTTPError(429, f"the server's queue is full ({state.max_queue} waiting requests); retry shortly",
                        "rate_limit_error", headers={"Retry-After": "1"})
    out: asyncio.Queue = asyncio.Queue()
    lora = body.model if body.model != state.served_name else None  # _ready: a loaded adapter's name
    for index, rid, pi, params in subs:
        loop.submit(rid, prompts[pi][0], params, out, index, body.priority, lora)
    ids = [rid for _, rid, _, _ in subs]
    render = _Renderer(state, body, prompts, subs, chat, base, setup)
    deadline = time.perf_counter() + state.request_timeout
    if body.stream:
        gen = _stream(state, request, out, render, ids, deadline)
        return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        done = 0
        while done < len(subs):
            item = await _next(out, request, deadline)
            if item is None:  # the client went away
                return JSONResponse({}, status_code=499)
            index, delta = item
            render.add(index, delta)
            done += delta.finished
        return render.response()
    finally:
        for rid in ids:
            loop.abort(rid)  # no-op for finished requests


_POLL_S = 0.5  # how often a handler asks whether its client is still connected


async def _next(out: asyncio.Queue, request, deadline: float):
    """The next (choice, Delta); None if the client disconnected; HTTPError 504 past the request timeout."""
    while True:
        now = time.perf_counter()
        left = deadline - now
        if left <= 0:
            raise HTTPError(504, "the request took longer than the server's --request-timeout", "timeout")
        # Ask on a clock, not only when no token came for a while: tokens arrive every few ms, so a non-streamed
        # request whose client left would otherwise run to max_tokens.
        if now >= getattr(request.state, "poll_at", 0.0):
            request.state.poll_at = now + _POLL_S
            if await request.is_disconnected():
                return None
        if not out.empty():  # already there (the common case when streaming): no wait_for, whose timer and task
            return _checked(out.get_nowait())  # cost more than the token's own chunk
        try:
            return _checked(await asyncio.wait_for(out.get(), timeout=min(left, _POLL_S)))
        except asyncio.TimeoutError:
            continue


def _checked(item):
    """A queue item as the handler uses it: (choice, Delta), or the HTTPError that the engine's failure means."""
    if isinstance(item, HTTPError):  # the server's own answer (the drain ran out of time)
        raise item
    if isinstance(item, BaseException):  # a UserError's status: 400, or 404 for an adapter unloaded meanwhile
        status = getattr(item, "status", 400) if isinstance(item, UserError) else 500
        raise HTTPError(status, str(item), {400: "invalid_request_error", 404: "not_found_error"}.get(status,
                                                                                                   "server_error"))
    return item


async def _stream(state: ServerState, request, out, render, ids, deadline):
    loop = state.loop
    try:
        yield from_json(render.first_chunk()) if render.chat else ""
        done = 0
        while done < len(ids):
            # This item's chunk and those of whatever else already waits (the handler fell behind, or n > 1) go out
            # in one write, not one per token; the client parses the same SSE events.
            text = []
            try:
                item = await _next(out, request, deadline)
                gone = item is None  # the client went away
                while item is not None:
                    index, delta = item
                    done += delta.finished
                    chunk = render.chunk(index, delta)
                    if chunk is not None:
                        text.append(from_json(chunk))
                    item = _checked(out.get_nowait()) if done < len(ids) and not out.empty() else None
            except HTTPError as e:
                yield "".join(text) + from_json(error_body(e.message, e.type, e.param, e.status))
                break
            if gone:
                break
            if text:
                yield "".join(text)
        else:
            usage = render.usage_chunk()
            if usage is not None:
                yield from_json(usage)
            yield "data: [DONE]\n\n"
    finally:  # also when the client disconnects mid-stream (the generator is cancelled): free its blocks now
        for rid in ids:
            loop.abort(rid)


def from_json(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n" if obj else ""


class _Renderer:
    """Engine deltas -> OpenAI response objects (whole, or SSE chunks). A chat choice's text goes through the
    reasoning split (R1's <think>), then, when tools are in play, through the tool-call parser."""

    def __init__(self, state, body, prompts, subs, chat, base, setup: ChatSetup):
        self.state, self.body, self.prompts, self.chat, self.id, self.setup = state, body, prompts, chat, base, setup
        self.created = int(time.time())
        self.n_choices = len(subs)
        self.text = [""] * self.n_choices  # content as generated (tool-call text included)
        self.content = [""] * self.n_choices  # content without the tool calls (streamed)
        self.tokens: list[list[int]] = [[] for _ in subs]
        self.lps: list[list] = [[] for _ in subs]
        self.finish: list[str | None] = [None] * self.n_choices
        self.prompt_of = [pi for _, _, pi, _ in subs]
        self.splitters = [None] * self.n_choices
        self.parsers = [ToolCallParser(setup.tool_format) if setup.tool_format else None for _ in subs]
        self.reasoning = [""] * self.n_choices
        self.echoed = [False] * self.n_choices
        self.show_reasoning = not chat or body.include_reasoning
        if chat and state.tokenizer is not None:
            from paraseek.models.tokenizer import ReasoningStreamSplitter

            self.splitters = [ReasoningStreamSplitter(starts_in_reasoning=setup.reasoning) for _ in subs]

    def _split(self, i: int, text: str, final: bool) -> tuple[str, str]:
        sp = self.splitters[i]
        if sp is None:
            return "", text
        r, c = sp.feed(text)
        if final:
            r2, c2 = sp.flush()
            r, c = r + r2, c + c2
        return r, c

    def add(self, i: int, d) -> tuple[str, str, list]:
        """Record a delta; returns its (reasoning, content, tool-call deltas)."""
        r, c = self._split(i, d.text, d.finished)
        self.reasoning[i] += r
        self.text[i] += c
        calls = []
        parser = self.parsers[i]
        if parser is not None:
            c, calls = parser.feed(c)
            if d.finished:
                c2, calls2 = parser.flush()
                c, calls = c + c2, calls + calls2
        self.content[i] += c
        self.tokens[i] += d.token_ids
        self.lps[i] += list(zip(d.token_ids, d.logprobs, d.top_logprobs)) if d.logprobs else []
        if d.finished:
            reason = _reason(d.finish_reason)
            if parser is not None and parser.calls and reason == "stop":
                reason = "tool_calls"
            self.finish[i] = reason
        return r, c, calls

    def _logprobs(self, entries, offset: int = 0):
        tok = self.state.tokenizer
        name = (lambda t: tok.decode([t], skip_special_tokens=False)) if tok else str
        if self.chat:
            return {"content": [{"token": name(t), "logprob": lp, "bytes": list(name(t).encode()),
                                 "top_logprobs": [{"token": name(a), "logprob": b, "bytes": list(name(a).encode())}
                                                  for a, b in top]} for t, lp, top in entries]}
        tokens = [name(t) for t, _, _ in entries]
        offsets, pos = [], offset
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{name(a): b for a, b in top} for _, _, top in entries], "text_offset": offsets}

    def _usage(self) -> dict:
        prompt = sum(len(ids) for ids, _ in self.prompts)
        completion = sum(len(t) for t in self.tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _message(self, i: int) -> dict:
        from paraseek.serve.tools import parse_tool_calls

        msg: dict = {"role": "assistant", "content": self.text[i]}
        if self.parsers[i] is not None:  # parsed whole: a block that does not parse stays content
            content, calls = parse_tool_calls(self.text[i], self.setup.tool_format)
            msg["content"] = content
            if calls:
                msg["tool_calls"] = calls
            elif self.finish[i] == "tool_calls":
                self.finish[i] = "stop"
        if self.show_reasoning and self.splitters[i] is not None and (
                self.reasoning[i] or self.splitters[i].state != "start"):
            msg["reasoning_content"] = self.reasoning[i] or None
        return msg

    def response(self) -> dict:
        choices = []
        for i in range(self.n_choices):
            want_lp = self.body.logprobs if self.chat else self.body.logprobs is not None
            if self.chat:
                msg = self._message(i)
                choices.append({"index": i, "message": msg, "logprobs": self._logprobs(self.lps[i]) if want_lp else None,
                                "finish_reason": self.finish[i]})
            else:
                echo = (self.prompts[self.prompt_of[i]][1] or "") if self.body.echo else ""
                choices.append({"index": i, "text": echo + self.text[i],
                                "logprobs": self._logprobs(self.lps[i], len(echo)) if want_lp else None,
                                "finish_reason": self.finish[i]})
                if self.state.tokenizer is None:
                    choices[-1]["token_ids"] = self.tokens[i]
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.body.model, "choices": choices, "usage": self._usage()}

    def first_chunk(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.body.model,
                "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None} for i in range(self.n_choices)]}

    def chunk(self, i: int, d) -> dict | None:
        r, c, calls = self.add(i, d)
        lp = list(zip(d.token_ids, d.logprobs, d.top_logprobs)) if d.logprobs else []
        finish = self.finish[i] if d.finished else None
        head = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.body.model}
        if self.body.stream_options is not None and self.body.stream_options.continuous_usage_stats:
            head["usage"] = self._usage()
        if self.chat:
            delta = {}
            if r and self.show_reasoning:
                delta["reasoning_content"] = r
            if c:
                delta["content"] = c
            if calls:
                delta["tool_calls"] = [t.as_openai() for t in calls]
            if not delta and finish is None and not lp:
                return None
            return {**head, "choices": [{"index": i, "delta": delta, "logprobs": self._logprobs(lp) if lp else None,
                                         "finish_reason": finish}]}
        if self.body.echo and not self.echoed[i]:
            c = (self.prompts[self.prompt_of[i]][1] or "") + c
            self.echoed[i] = True
        raw = self.state.tokenizer is None  # no text to send: each token goes out as its id (vLLM's token_ids)
        if not c and finish is None and not lp and not raw:
            return None
        choice = {"index": i, "text": c, "logprobs": self._logprobs(lp) if lp else None, "finish_reason": finish}
        if raw:
            choice["token_ids"] = list(d.token_ids)
        return {**head, "choices": [choice]}

    def usage_chunk(self) -> dict | None:
        opts = self.body.stream_options
        if opts is None or not opts.include_usage:
            return None
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.body.model, "choices": [], "usage": self._usage()}


def _reason(engine_reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length"}.get(engine_reason or "", engine_reason)
