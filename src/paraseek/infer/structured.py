"""Grammar-constrained decoding with xgrammar: a request's `structured` spec (SamplingParams.structured) becomes a
matcher that, before each of the request's tokens is sampled, writes the tokens the grammar allows as a bitmask
(int32 words, token v = bit v % 32 of word v // 32); the sampler applies the masks of the step's rows on the device
(sampling.apply_masks) and the matcher then advances by the token that was sampled.

Why xgrammar (measured on this machine, 2 cores, a five-field JSON schema with a nested object, an integer range,
an enum, a pattern and length limits; masks along random walks through the grammar, 1,000 steps):

| vocabulary | xgrammar: compile, mask median / p99 | llguidance: compile, mask median / p99 |
| --- | --- | --- |
| 2,112 (the tests' model) | 4.3 ms, 3.2 / 7.6 us | none (lazy), 3.6 / 95 us |
| 100,096 (byte-level BPE) | 22 ms, 2.9 / 16 us | none (lazy), 6.0 / 824 us |

Both are far below a decode step; xgrammar's tail is lower, and its structural tags express the DeepSeek tool-call
formats (a fixed begin, a JSON-schema body, a fixed end, several calls with a separator) directly.

The spec types: json_schema {schema}, json_object, regex {regex}, ebnf {grammar}, choice {choices}, and tool_calls
{format: v3 | v31, tools: [{name, parameters}], parallel: bool}, which forces the model's own tool-call syntax
around each function's argument schema. Any of them takes `reasoning: true` when the prompt ends inside the model's
<think> block: the output may then reason freely (text without </think>) and the constraint starts after </think>.
"""

from __future__ import annotations

import json
import os
import re
import threading

import torch

from paraseek.errors import UserError, first_line

TOOL_CALLS_BEGIN, TOOL_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
THINK_CLOSE = "</think>"
# Whitespace characters at most between JSON tokens: enough for ", " and a short indent, and a weak model cannot
# spend its whole budget on blank space (xgrammar's default is unbounded).
JSON_MAX_WHITESPACE = 4


def available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def require() -> None:
    if not available():
        raise UserError("grammar-constrained outputs (response_format, guided_*, forced tool calls, --json-schema) "
                        "need xgrammar: pip install 'paraseek[serve]'")


class Backend:
    """One tokenizer's grammar compiler (xgrammar's TokenizerInfo over the model's vocabulary, which may be wider
    than the tokenizer's: the extra ids are never allowed) and a cache of compiled specs."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        require()
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        encoded = [""] * vocab_size
        for token, i in tokenizer.tok.get_vocab(with_added_tokens=True).items():
            if i < vocab_size:
                encoded[i] = token
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.tok.to_str())
        self.info = xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                                      stop_token_ids=sorted(stop_token_ids), add_prefix_space=meta["add_prefix_space"])
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._lock = threading.Lock()
        self._compiled: dict[str, object] = {}

    def compile(self, spec: dict):
        """The compiled grammar of `spec` (cached by its JSON); UserError naming what is wrong with it."""
        key = json.dumps(spec, sort_keys=True)
        with self._lock:
            hit = self._compiled.get(key)
        if hit is not None:
            return hit
        try:
            compiled = self.compiler.compile_grammar(grammar_of(spec))
        except UserError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with the parser's message
            raise UserError(f"cannot build a grammar from this {spec.get('type')}: {_first_line(e)}") from None
        with self._lock:
            if len(self._compiled) > 256:
                self._compiled.clear()
            self._compiled[key] = compiled
        return compiled

    def matcher(self, spec: dict) -> Constraint:
        return Constraint(self, self.compile(spec))


class Constraint:
    """One request's matcher. `advance(output_ids)` feeds the tokens sampled since the last call; `bitmask_W()` is
    the next token's allowed set. When the grammar is complete only the stop tokens are allowed."""

    def __init__(self, backend: Backend, compiled):
        import xgrammar as xgr

        self.backend = backend
        self.matcher = xgr.GrammarMatcher(compiled)
        self.consumed = 0
        self.broken = False  # a token the grammar rejected: the request goes on unconstrained rather than fail
        self._mask_1W = torch.empty((1, backend.words), dtype=torch.int32)

    def advance(self, output_ids: list[int]) -> None:
        for t in output_ids[self.consumed:]:
            if not self.live:
                break
            # Cannot happen for a token its own mask allowed; were it to, raising here would stop the engine
            # thread (every request), so this request alone loses its constraint.
            self.broken = not self.matcher.accept_token(t)
        self.consumed = len(output_ids)

    @property
    def done(self) -> bool:
        return self.matcher.is_terminated()

    @property
    def live(self) -> bool:
        """Whether the next token is constrained (not after the grammar's end or a rejected token)."""
        return not (self.broken or self.matcher.is_terminated())

    def bitmask_W(self) -> torch.Tensor | None:
        if not self.live:
            return None
        self.matcher.fill_next_token_bitmask(self._mask_1W)
        return self._mask_1W[0].clone()


# Threads that fill a step's masks (xgrammar's BatchGrammarMatcher, the GIL released meanwhile): half the cores, as
# xgrammar's own default, at most 8 (a step of 32 rows at ~160 us a row of a 128K vocabulary is then ~0.6 ms).
FILL_THREADS = min(8, max(1, (os.cpu_count() or 2) // 2))


class StepMasks:
    """The grammar work of a step for all its rows at once: each row's matcher advanced by the tokens sampled since
    (xgrammar's batch_accept_token), then every row's mask filled by FILL_THREADS C++ threads (batch_fill_next_token_
    bitmask) into one int32 [rows, W] host buffer, allocated once (pinned when the logits are on a GPU, so that its
    copy to the device does not wait for the stream) and reused every step."""

    def __init__(self, rows: int, words: int, pin: bool):
        import xgrammar as xgr

        self.words_BW = torch.full((rows, words), -1, dtype=torch.int32, pin_memory=pin)
        self.batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)

    def fill(self, constraints: list[Constraint | None], new_tokens: list[list[int]]) -> torch.Tensor | None:
        """Row i's mask for a step whose row i is a request with constraint constraints[i] (None: unconstrained)
        that sampled new_tokens[i] since the constraint last advanced: a view words_BW[:B], every token allowed in a
        row without a live constraint; None when no row has one. The view is overwritten by the next call."""
        advance_all(constraints, new_tokens)
        live = [i for i, c in enumerate(constraints) if c is not None and c.live]
        if not live:
            return None
        B = len(constraints)
        if B > len(self.words_BW):  # more rows than the engine's max_num_seqs: cannot happen, but stay correct
            self.words_BW = torch.full((B, self.words_BW.shape[1]), -1, dtype=torch.int32,
                                       pin_memory=self.words_BW.is_pinned())
        words_BW = self.words_BW[:B]
        if len(live) < B:
            words_BW.fill_(-1)
        self.batch.batch_fill_next_token_bitmask([constraints[i].matcher for i in live], words_BW, live)
        return words_BW


def advance_all(constraints: list[Constraint | None], new_tokens: list[list[int]]) -> None:
    """Constraint.advance for many requests given only the tokens each sampled since (the caller slices them: no
    copy of a whole output per step), one batch_accept_token per position (a row has one new token a step unless it
    was just admitted with some already known)."""
    import xgrammar as xgr

    pending = [(c, new) for c, new in zip(constraints, new_tokens) if c is not None and new]
    for k in range(max((len(new) for _, new in pending), default=0)):
        batch = [(c, new[k]) for c, new in pending if k < len(new) and c.live]
        if batch:
            accepted = xgr.BatchGrammarMatcher.batch_accept_token([c.matcher for c, _ in batch], [t for _, t in batch])
            for (c, _), ok in zip(batch, accepted):
                c.broken = not ok  # see Constraint.advance
    for c, new in pending:
        c.consumed += len(new)


def backend_for(tokenizer, vocab_size: int, stop_token_ids) -> Backend:
    """The shared Backend of a tokenizer (one per process: the server's handlers compile, the engine matches)."""
    if tokenizer is None:
        raise UserError("structured outputs need the model's tokenizer; this model has none")
    require()
    with _BACKEND_LOCK:
        key = (id(tokenizer), vocab_size, tuple(sorted(stop_token_ids)))
        entry = _BACKENDS.get(key)
        if entry is None:  # the tokenizer is kept with its backend, so that its id cannot be reused by another
            entry = _BACKENDS[key] = (tokenizer, Backend(tokenizer, vocab_size, list(stop_token_ids)))
        return entry[1]


_BACKENDS: dict = {}
_BACKEND_LOCK = threading.Lock()


# ---- specs -> xgrammar grammars --------------------------------------------------------------------------------------
def grammar_of(spec: dict):
    """An xgrammar Grammar for a spec (see the module's docstring)."""
    import xgrammar as xgr

    kind = spec.get("type")
    if kind == "tool_calls":
        body = _tool_calls_format(spec)
    elif kind in ("json_schema", "json_object"):
        schema = spec.get("schema", {"type": "object"}) if kind == "json_schema" else {"type": "object"}
        body = {"type": "json_schema", "json_schema": json_safe(schema), "max_whitespace_cnt": JSON_MAX_WHITESPACE}
    elif kind == "regex":
        body = {"type": "regex", "pattern": spec["regex"]}
    elif kind == "choice":
        body = {"type": "or", "elements": [{"type": "const_string", "value": c} for c in spec["choices"]]}
    elif kind == "ebnf":
        body = {"type": "grammar", "grammar": spec["grammar"]}
    else:
        raise UserError(f"unknown structured output type {kind!r}")
    if spec.get("reasoning"):  # free reasoning first, then the answer (R1's "</think>\n\n")
        body = {"type": "sequence", "elements": [
            {"type": "any_text", "excludes": [THINK_CLOSE]}, {"type": "const_string", "value": THINK_CLOSE},
            {"type": "regex", "pattern": r"\n{0,2}"}, body]}
    return xgr.Grammar.from_structural_tag({"type": "structural_tag", "format": body})


def _tool_calls_format(spec: dict) -> dict:
    """DeepSeek's tool-call block around each function's argument schema. v3 (V3, R1, R1-Distill):
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>, calls
    separated by a newline; v31 (V3.1): <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>, calls back to back."""
    fmt = spec.get("format", "v3")
    tags = []
    for tool in spec["tools"]:
        name, params = tool["name"], tool.get("parameters") or {"type": "object", "properties": {}}
        if fmt == "v3":
            begin, end = f"{TOOL_CALL_BEGIN}function{TOOL_SEP}{name}\n```json\n", f"\n```{TOOL_CALL_END}"
        else:
            begin, end = f"{TOOL_CALL_BEGIN}{name}{TOOL_SEP}", TOOL_CALL_END
        tags.append({"type": "tag", "begin": begin, "end": end, "content": {
            "type": "json_schema", "json_schema": json_safe(params), "max_whitespace_cnt": JSON_MAX_WHITESPACE}})
    calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n" if fmt == "v3" else "",
             "at_least_one": True, "stop_after_first": not spec.get("parallel", True)}
    return {"type": "tag", "begin": TOOL_CALLS_BEGIN, "content": calls, "end": TOOL_CALLS_END}


_BOUNDED_STRING = '^[^\\x00-\\x1f"\\\\]{%d,%s}$'


def json_safe(schema):
    """The schema as given to xgrammar, with one work-around: xgrammar 0.2.9's rule for strings with minLength /
    maxLength admits raw control characters (U+0000-U+001F), which JSON forbids inside strings, so such a string
    becomes the equivalent pattern of plain characters (no escape sequences, no control characters)."""
    if isinstance(schema, list):
        return [json_safe(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: json_safe(v) for k, v in schema.items()}
    if (out.get("type") == "string" and ("minLength" in out or "maxLength" in out) and "pattern" not in out
            and "format" not in out):
        lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = _BOUNDED_STRING % (lo, "" if hi is None else int(hi))
    return out


def _first_line(e: Exception) -> str:
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", first_line(e))[:300]  # xgrammar's "[time] file.cc:line: " prefix
