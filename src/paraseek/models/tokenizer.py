"""The text side of inference: a model folder's tokenizer, its chat template rendered the way HF transformers'
`apply_chat_template` renders it, and the streaming helpers of a server (incremental detokenization, stop strings,
DeepSeek-R1's <think> split).

Parity target is transformers 5 (`AutoTokenizer.from_pretrained(folder)` with a tokenizer.json, i.e. its
TokenizersBackend): tokenizer.json is used as it is (its post-processor alone decides whether encode() adds bos;
transformers 5 ignores tokenizer_config.json's add_bos_token/add_eos_token when a tokenizer.json exists), the named
special tokens of the config are registered as special added tokens, and templates run in the same sandboxed Jinja
environment (`transformers/utils/chat_template_utils.py`: trim_blocks, lstrip_blocks, loopcontrols, the
{% generation %} tag, a tojson that does not HTML-escape, raise_exception, strftime_now).

A leaf module: stdlib, tokenizers and jinja2 only, so the server and the data pipeline can import it without torch.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

from paraseek.errors import UserError, first_line

# Tried in order when tokenizer_config.json does not name the token: ours, DeepSeek's, then the Llama/Qwen/GPT
# family's. The eos found is also the token that training data writes between documents.
BOS_NAMES = ("<|bos|>", "<｜begin▁of▁sentence｜>", "<|begin_of_text|>", "<s>")
EOS_NAMES = ("<|eos|>", "<｜end▁of▁sentence｜>", "<|end_of_text|>", "<|endoftext|>", "</s>")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# byte-level BPE, 2048 tokens, built by scripts/; `paraseek train`'s tokenizer when none is given
BUNDLED_TOKENIZER = Path(__file__).resolve().parent.parent / "assets" / "tokenizer" / "tokenizer.json"


class TextTokenizer:
    """A tokenizers.Tokenizer plus what a model folder says around it (special tokens, stop ids, chat templates).
    Build it with `load_text_tokenizer`."""

    def __init__(self, tok: Tokenizer, *, name: str, specials: dict[str, str], bos_token_id: int | None,
                 eos_token_id: int | None, stop_token_ids: list[int], chat_templates: dict[str, str],
                 clean_up_spaces: bool = False):
        self.tok, self.name, self.specials = tok, name, specials
        self.bos_token_id, self.eos_token_id, self.stop_token_ids = bos_token_id, eos_token_id, stop_token_ids
        self.chat_templates = chat_templates  # name -> template; "default" is the one used unless tools pick "tool_use"
        # transformers skips this clean-up for BPE models (it deletes real spaces before punctuation), so do we
        self.clean_up_spaces = clean_up_spaces and type(tok.model).__name__ != "BPE"
        # Whether encode() puts bos first, read off the post-processor: transformers 5 ignores the config's
        # add_bos_token when there is a tokenizer.json, and so do we.
        self.add_bos_token = bos_token_id is not None and tok.encode("").ids[:1] == [bos_token_id]

    @property
    def file(self) -> Path:
        """The tokenizer.json it was read from."""
        given = Path(self.name)
        return given / "tokenizer.json" if given.is_dir() else given

    @property
    def vocab_size(self) -> int:
        """Including added tokens: the smallest embedding table that holds every id encode() can return."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self.chat_templates = {} if template is None else {"default": template}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """encode() of each text, on all cores (the Rust side)."""
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_spaces else text

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, tokenize: bool = False, chat_template: str | None = None,
                            **template_kwargs):
        """The rendered chat (str), or its ids with tokenize=True. Like transformers, the ids are the rendered text
        encoded with add_special_tokens=False: the template writes bos itself, a post-processor must not add a
        second one. `chat_template`: a template to render with instead of the tokenizer's (transformers' argument)."""
        template = chat_template if chat_template is not None else self._template(tools)
        text = _render(template, self._variables(messages, tools, add_generation_prompt, template_kwargs),
                       self.name)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def render_chat_with_spans(self, messages: list[dict], *, add_generation_prompt: bool = False,
                               tools: list[dict] | None = None, through: tuple[str, ...] = (),
                               **template_kwargs) -> tuple[str, list[tuple]]:
        """(rendered text, [(start_char, end_char)]) where the spans are what fine-tuning trains on.

        A template with {% generation %} tags gives transformers' spans (`return_assistant_tokens_mask`): the
        text rendered inside each tag. Any other template: the content of each assistant message (string content),
        found by rendering the chat with every such content wrapped in two private-use marker characters and
        checking that the render without the markers is the real render, each span then extended over one of the
        `through` strings when the template writes it right after the content (the end-of-turn token: a model
        trained on a turn must also learn to end it, as the tagged templates' spans include it). A template that
        trims or rewrites the content (R1's drops everything up to </think>) moves the markers, and that is an
        error rather than a guess."""
        template = self._template(tools)
        variables = self._variables(messages, tools, add_generation_prompt, template_kwargs)
        if re.search(r"\{%-?\s*generation\s*-?%\}", template):
            return _render(template, variables, self.name, track=True)
        text = _render(template, variables, self.name)
        contents = [m["content"] for m in messages if m["role"] == "assistant" and isinstance(m["content"], str)]
        if any(_OPEN in c or _CLOSE in c for c in contents):
            raise UserError(f"assistant content holds the marker characters U+E000/U+E001 that locating its "
                            f"spans relies on; remove them from the messages")
        marked = [{**m, "content": _OPEN + m["content"] + _CLOSE}
                  if m["role"] == "assistant" and isinstance(m["content"], str) else m for m in messages]
        marked_text = _render(template, {**variables, "messages": marked}, self.name)
        plain, spans = _strip_markers(marked_text)
        if plain != text or len(spans) != len(contents):
            raise UserError(f"the chat template of {self.name} trims or rewrites assistant content (found "
                            f"{len(spans)} of {len(contents)} assistant turns intact), so their spans cannot be "
                            f"located in its render: give assistant turns as the template renders them (e.g. "
                            f"without the reasoning it drops), or use a template with {{% generation %}} tags")
        return text, [(a, b + next((len(s) for s in through if s and text.startswith(s, b)), 0)) for a, b in spans]

    def tool_template(self) -> ToolTemplate | None:
        """The template that renders a request with `tools`, and the tool-call syntax it teaches: the model's own
        when it renders `tools` (transformers' "tool_use" template first), else a tool-capable template shipped
        for its family when the model's template is a DeepSeek one that renders tool calls but not the tools
        themselves (the hub templates of V3, R1, the R1-Distills and V3.1 all do that); None when neither."""
        if "tool_use" in self.chat_templates:
            template = self.chat_templates["tool_use"]
        elif "default" in self.chat_templates:
            template = self.chat_templates["default"]
        else:
            return None
        fmt = tool_call_format(template)
        if "tools" in _variables_of(template):
            return ToolTemplate(template, fmt, None)
        family = deepseek_family(template)
        if family is None:
            return None
        name = f"deepseek_{family}_tools.jinja"
        return ToolTemplate(_shipped_template(name), "v31" if family == "v31" else "v3", name)

    def _template(self, tools) -> str:
        # transformers' get_chat_template: "tool_use" when tools are given and the model has one, else "default"
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        if self.chat_templates:
            raise UserError(f"{self.name} has several chat templates ({', '.join(sorted(self.chat_templates))}) "
                            f"and none named 'default'; give one with --chat-template FILE")
        raise UserError(f"{self.name} has no chat template in tokenizer_config.json; give one with "
                        f"--chat-template FILE (a Jinja file), or use a model folder that ships one")

    def _variables(self, messages, tools, add_generation_prompt, template_kwargs) -> dict:
        _check_messages(messages)
        if tools is not None and (not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools)):
            raise UserError("tools must be a list of JSON-schema dicts ({type: function, function: {...}})")
        # the special tokens first so that template kwargs override them, as in transformers
        return {**self.specials, "messages": messages, "tools": tools, "documents": None,
                "add_generation_prompt": add_generation_prompt, **template_kwargs}


@dataclass(frozen=True)
class ToolTemplate:
    template: str
    format: str | None  # the tool-call syntax: "v3" (V3, R1, R1-Distill), "v31" (V3.1), None (not a DeepSeek one)
    shipped: str | None  # the file name under paraseek/assets/chat_templates when it is ours, not the model's


def tool_call_format(template: str) -> str | None:
    """Which DeepSeek tool-call syntax a template writes: v3 puts the call's type and a ```json fence around the
    arguments (`function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```), v31 the bare name and JSON
    (`NAME<｜tool▁sep｜>{...}`)."""
    if "<｜tool▁calls▁begin｜>" not in template:
        return None
    return "v3" if "'<｜tool▁sep｜>' + tool['function']['name']" in template else "v31"


def deepseek_family(template: str) -> str | None:
    """v3, r1 (R1 and the R1-Distills: the generation prompt opens <think>) or v31 for a DeepSeek chat template."""
    fmt = tool_call_format(template)
    if fmt is None or "<｜Assistant｜>" not in template:
        return None
    if fmt == "v31":
        return "v31"
    return "r1" if "<｜Assistant｜><think>" in template else "v3"


@lru_cache(maxsize=8)
def _shipped_template(name: str) -> str:
    return (Path(__file__).resolve().parents[1] / "assets" / "chat_templates" / name).read_text(encoding="utf-8")


@lru_cache(maxsize=32)
def _variables_of(template: str) -> frozenset[str]:
    """The variables a template reads (Jinja's undeclared names)."""
    import jinja2.meta

    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(template)))
    except jinja2.TemplateSyntaxError:
        return frozenset()


def load_text_tokenizer(path: str | os.PathLike, chat_template: str | os.PathLike | None = None) -> TextTokenizer:
    """A model folder (tokenizer.json, optionally tokenizer_config.json, special_tokens_map.json,
    generation_config.json, config.json, chat_template.jinja) or a tokenizer.json file (its siblings are read too).
    `chat_template`: a Jinja file that replaces the folder's templates."""
    given = Path(path).expanduser()
    file = given / "tokenizer.json" if given.is_dir() else given
    if not file.is_file():
        raise UserError(f"{path}: no tokenizer file at {file} (give a model folder holding tokenizer.json, or the "
                        f"tokenizer.json itself)")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises a plain Exception for any malformed file
        raise UserError(f"{file}: not a valid HF tokenizer.json ({first_line(e)}); download it again or give "
                        f"another model folder") from None
    folder = file.parent
    config = _read_json(folder / "tokenizer_config.json")

    # Named special tokens. special_tokens_map.json is the legacy place: transformers reads it only when the config
    # has no added_tokens_decoder, and then it wins. Other keys ending in "_token" are model-specific tokens, which
    # transformers also hands to templates.
    specials = _token_names(config)
    if "added_tokens_decoder" not in config:
        specials.update(_token_names(_read_json(folder / "special_tokens_map.json")))
    extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
    if isinstance(extra, dict):  # transformers 5's named extras ({"image_token": ...}) are template variables too
        specials.update({k: c for k, v in extra.items() if (c := _token_content(v)) is not None})
    extra = [c for c in map(_token_content, extra if isinstance(extra, list) else []) if c]
    # Like transformers, make every named token a special added token (an id of its own, matched whole in text,
    # skipped by skip_special_tokens), adding it when the vocabulary lacks it.
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in [*specials.values(), *extra]])
    # split_special_tokens: special tokens written in the text are tokenized as plain text (transformers does the same)
    tok.encode_special_tokens = bool(config.get("split_special_tokens", False))

    def resolve(key: str, names: tuple[str, ...]) -> int | None:
        if key in specials:
            return tok.token_to_id(specials[key])
        if key in config:  # named as null (Qwen has no bos): no guessing
            return None
        return next((i for n in names if (i := tok.token_to_id(n)) is not None), None)

    bos, eos = resolve("bos_token", BOS_NAMES), resolve("eos_token", EOS_NAMES)
    # Stop ids: eos, then generation_config.json's eos_token_id (Llama-3 and R1-Distill list several), then
    # config.json's, as transformers' generate() would stop on them.
    stops = [] if eos is None else [eos]
    for source in ("generation_config.json", "config.json"):
        ids = _read_json(folder / source).get("eos_token_id")
        for i in ids if isinstance(ids, list) else [ids]:
            if isinstance(i, int) and i not in stops:
                stops.append(i)

    templates = (_chat_templates(folder, config) if chat_template is None else
                 {"default": _read_text(Path(chat_template).expanduser(), "--chat-template")})
    return TextTokenizer(tok, name=str(given), specials=specials, bos_token_id=bos, eos_token_id=eos,
                         stop_token_ids=stops, chat_templates=templates,
                         clean_up_spaces=bool(config.get("clean_up_tokenization_spaces", False)))


def _chat_templates(folder: Path, config: dict) -> dict[str, str]:
    """transformers' order: chat_template.jinja and additional_chat_templates/*.jinja (as transformers 5 saves
    them) take priority over tokenizer_config.json's chat_template, a string or a list of {name, template}."""
    templates = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = _read_text(folder / "chat_template.jinja")
    if (folder / "additional_chat_templates").is_dir():
        for f in sorted((folder / "additional_chat_templates").glob("*.jinja")):
            templates[f.stem] = _read_text(f)
    if templates:
        return templates
    value = config.get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(isinstance(t, dict) and {"name", "template"} <= t.keys() for t in value):
        return {t["name"]: t["template"] for t in value}
    if value is not None:
        raise UserError(f"{folder / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                        f"{{name, template}} objects, not {type(value).__name__}")
    return {}


def _read_json(file: Path) -> dict:
    """A JSON object from `file`, {} when the file does not exist."""
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{file}: not valid JSON ({first_line(e)}); fix or delete the file") from None
    if not isinstance(value, dict):
        raise UserError(f"{file}: expected a JSON object, found {type(value).__name__}; fix or delete the file")
    return value


def _read_text(file: Path, what: str = "") -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{what + ' ' if what else ''}{file}: cannot read the chat template ({first_line(e)})") \
            from None


def _token_content(value) -> str | None:
    """A token given as a string or as an AddedToken dict ({"__type": "AddedToken", "content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _token_names(config: dict) -> dict[str, str]:
    return {k: s for k, v in config.items() if k.endswith("_token") and (s := _token_content(v)) is not None}


def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization (for WordPiece-style decoders)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def _check_messages(messages) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise UserError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            shown = json.dumps(m, ensure_ascii=False, default=str)
            raise UserError(f"messages[{i}] is not a {{role, content}} object: {shown[:80]} (a tool-call turn "
                            f"gives content: null)")


# ----------------------------------------------------------------------------------------------- Jinja rendering

# Private-use characters that wrap assistant content to find it in a render (render_chat_with_spans).
_OPEN, _CLOSE = "\ue000", "\ue001"


class _Generation(jinja2.ext.Extension):
    """The {% generation %}...{% endgeneration %} tag of transformers' templates: renders its body and, when the
    render is tracked, records the body's (start, end) in the output. The record lives in the render's own
    variables (`_generation`), not on the shared environment, so concurrent renders cannot mix."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_track", [jinja2.nodes.ContextReference()]), [], [],
                                      body).set_lineno(lineno)

    @staticmethod
    def _track(context, caller):
        text = caller()
        record = context.get("_generation")
        if record is not None:  # the length rendered so far: the blocks the generator has yielded (as transformers)
            start = sum(map(len, record["blocks"]))
            record["spans"].append((start, start + len(text)))
        return text


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes (<, >, &, '), which chat templates must not do; transformers' signature
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format):
    return datetime.now().strftime(format)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


def _render(template: str, variables: dict, name: str, track: bool = False):
    """The rendered text; with track=True, (text, generation spans). Errors of the template, including those the
    messages provoke (raise_exception, a missing key, a list where it adds strings), become one-line UserErrors."""
    try:
        compiled = _compile(template)
        if not track:
            return compiled.render(**variables)
        record = {"blocks": [], "spans": []}
        for block in compiled.generate(**variables, _generation=record):
            record["blocks"].append(block)
        return "".join(record["blocks"]), record["spans"]
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"the chat template of {name} does not parse: {first_line(e)} (line {e.lineno})") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise UserError(f"the chat template of {name} failed on these messages: {first_line(e)}") from None


def _strip_markers(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """The text without the _OPEN/_CLOSE markers and the (start, end) each marked pair enclosed; an unpaired marker
    ends the scan (the caller then finds the text differs from the real render)."""
    out, spans, pos, length = [], [], 0, 0
    while (a := marked.find(_OPEN, pos)) != -1 and (b := marked.find(_CLOSE, a)) != -1:
        out += [marked[pos:a], marked[a + 1:b]]
        start = length + a - pos
        spans.append((start, start + b - a - 1))
        length, pos = start + b - a - 1, b + 1
    out.append(marked[pos:])
    return "".join(out), spans


# ------------------------------------------------------------------------------------------------------ streaming

class IncrementalDetokenizer:
    """Text of a growing token stream, a piece per push. Decodes only a window: the tokens of the last emitted
    piece (context, so decoders that treat a leading token specially agree with a full decode) plus the new ones,
    and cuts the context's text off the front (the prefix-offset method of TGI and vLLM). While the window's text
    ends in U+FFFD the newest bytes are an incomplete UTF-8 character: hold back the tokens from the last one that
    ends a character until it completes, or until MAX_HELD tokens say the bytes are really invalid."""

    MAX_HELD = 6  # a character is at most 4 bytes, and every byte-level token carries at least one

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = True):
        self._tokenizer, self._skip = tokenizer, skip_special_tokens
        self._ids: list[int] = []  # the window: context tokens, then tokens not yet emitted
        self._read = 0  # where the not-yet-emitted tokens start in the window
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def push(self, token_ids: list[int]) -> str:
        """The new text these tokens complete ("" while a character is still incomplete)."""
        self._ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """What is held back at the end of generation (an incomplete character decodes to U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        def decode(ids):
            return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

        context = decode(self._ids[:self._read])
        end, full = len(self._ids), decode(self._ids)
        if not final:
            # back off to the last token that ends a character (a push of several tokens emits its clean part)
            while full.endswith("\ufffd") and end > self._read:
                end -= 1
                full = decode(self._ids[:end]) if end > self._read else context
            if end == self._read:
                if len(self._ids) - self._read < self.MAX_HELD:
                    return ""
                end, full = len(self._ids), decode(self._ids)  # invalid bytes, not a character to wait for
        piece = full[len(context):]
        # the tokens just emitted become the next context; those after `end` stay pending
        self._ids, self._read = self._ids[self._read:], end - self._read
        self._pieces.append(piece)
        return piece


class StopStringMatcher:
    """Cuts a text stream at the first stop string (OpenAI's `stop`: the stop string itself is not returned).
    Text that could still be the start of a stop string is held back until the next piece settles it."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.stopped = False
        self._held = ""

    def feed(self, new_text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was reached)."""
        if self.stopped:
            return "", True
        text = self._held + new_text
        # _held never holds a whole stop string, so the earliest match is in `text`
        hits = [i for i in (text.find(s) for s in self.stops) if i != -1]
        if hits:
            self.stopped, self._held = True, ""
            return text[:min(hits)], True
        keep = next((k for k in range(min(len(text), max(map(len, self.stops), default=1) - 1), 0, -1)
                     if any(s.startswith(text[-k:]) for s in self.stops)), 0)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """The held-back text, at the end of generation (nothing after a stop)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


def split_reasoning(text: str, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
    """(reasoning_content, content) of a finished DeepSeek-R1 style output. The reasoning is the text inside
    <think>...</think>; R1-Distill templates end the prompt with "<think>\\n", so their output starts inside the
    block (starts_in_reasoning=True) and only closes it. Without the flag and without a leading <think> there is no
    reasoning (None) and everything is content; an unclosed block is all reasoning (generation cut it short)."""
    if not starts_in_reasoning:
        if not text.startswith(THINK_OPEN):
            return None, text
        text = text[len(THINK_OPEN):]
    reasoning, _, content = text.partition(THINK_CLOSE)
    return reasoning, content


class ReasoningStreamSplitter:
    """split_reasoning for a stream: feed(delta) -> (reasoning_delta, content_delta). Holds back text that could be
    the start of a tag until the next delta settles it; flush() releases it at the end."""

    def __init__(self, starts_in_reasoning: bool = False):
        self.state = "reasoning" if starts_in_reasoning else "start"  # start -> reasoning -> content
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        if self.state == "start":
            if text.startswith(THINK_OPEN):
                self.state, text = "reasoning", text[len(THINK_OPEN):]
            elif THINK_OPEN.startswith(text):
                self._held = text
                return "", ""
            else:
                self.state = "content"
        if self.state == "content":
            return "", text
        reasoning, close, content = text.partition(THINK_CLOSE)
        if close:
            self.state = "content"
            return reasoning, content
        keep = next((k for k in range(min(len(text), len(THINK_CLOSE) - 1), 0, -1)
                     if THINK_CLOSE.startswith(text[-k:])), 0)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], ""

    def flush(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return (held, "") if self.state == "reasoning" else ("", held)
