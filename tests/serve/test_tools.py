"""Tool calling through the official client: tools rendered into the prompt as transformers renders the same
template, the standard agent history accepted, the model's tool-call text parsed into `tool_calls` (whole and as
streamed deltas) in each DeepSeek syntax, and tool_choice required / a named function forced by constrained
decoding, so that even a random tiny model returns a valid call."""

import json

import httpx
import jsonschema
import pytest
from conftest import TEMPLATES
from serve_helpers import NAME
from test_errors import check_error, post

from paraseek.models.tokenizer import _shipped_template

pytest.importorskip("xgrammar")  # the grammar library of [serve]

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "metric": {"type": "boolean"}}, "required": ["city", "days", "metric"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.",
                                           "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
# The agent's history in OpenAI's standard form: a tool-call turn with content null, then the tool's result.
LOOP = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Oslo for 2 days?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "days": 2, "metric": true}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "rain"}'}]


@pytest.fixture(scope="module")
def hf_tokenizer(long_folder):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(str(long_folder.parent / "tokenizer"))


def tokenize(server, messages, tools=None) -> list[int]:
    body = {"model": NAME, "messages": messages, **({"tools": tools} if tools else {})}
    r = httpx.post(server.url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# ---- rendering ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which,own,shipped", [("tool_server", "deepseek_r1_distill_qwen.jinja",
                                                 "deepseek_r1_tools.jinja"),
                                                ("v3_server", "deepseek_v3.jinja", "deepseek_v3_tools.jinja")])
def test_the_agent_loop_renders_as_transformers_does(which, own, shipped, request, hf_tokenizer):
    """user, assistant tool call (content null), tool result, then the assistant's turn: with tools, the shipped
    tool template (the hub templates render tool calls but not the tools); without, the model's own template,
    which used to refuse the history (content null was dropped: "messages[1] is not a {role, content} object")."""
    server = request.getfixturevalue(which)
    want = hf_tokenizer.apply_chat_template(LOOP, tools=TOOLS, chat_template=_shipped_template(shipped),
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tokenize(server, LOOP, TOOLS) == want
    own_template = (TEMPLATES / own).read_text(encoding="utf-8")
    assert tokenize(server, LOOP) == hf_tokenizer.apply_chat_template(
        LOOP, chat_template=own_template, add_generation_prompt=True, tokenize=True, return_dict=False)
    text = hf_tokenizer.decode(want)
    assert "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n" in text  # the call, in the V3 syntax
    assert "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>" in text


def test_tools_reach_the_prompt(tool_server, tokenizer):
    """The hub templates dropped `tools` (the same 7 prompt tokens with or without): now each function's name,
    description and parameter schema are in the system part."""
    plain, with_tools = tokenize(tool_server, ASK), tokenize(tool_server, ASK, TOOLS)
    assert len(with_tools) > len(plain) + 50
    text = tokenizer.decode(with_tools, skip_special_tokens=False)
    assert "### get_weather\nDescription: Forecast for a city.\n\nParameters: " + json.dumps(WEATHER) in text
    assert text.index("### get_time") < text.index("<｜User｜>Weather in Oslo?")


def test_the_v31_template_renders_its_own_syntax(v31_server, hf_tokenizer):
    want = hf_tokenizer.apply_chat_template(LOOP, tools=TOOLS, chat_template=_shipped_template(
        "deepseek_v31_tools.jinja"), add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tokenize(v31_server, LOOP, TOOLS) == want
    text = hf_tokenizer.decode(want)
    assert '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo", "days": 2, "metric": true}' in text


# ---- parsing the model's tool-call text ------------------------------------------------------------------------------
# A forced output (guided_choice makes the model write exactly this) in each syntax, and what vLLM's parsers
# (vllm/entrypoints/openai/tool_parsers/deepseekv3_tool_parser.py, deepseekv31_tool_parser.py) return for it:
# the text before the block as content, each call's name and its arguments as written.
V3_TEXT = ('Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
           '{"city": "Lima", "days": 3, "metric": false}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
           '<｜tool▁sep｜>get_time\n```json\n{"zone": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
V31_TEXT = ('Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Lima", "days": 3, '
            '"metric": false}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "UTC"}'
            '<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
REFERENCE = ("Checking.", [("get_weather", '{"city": "Lima", "days": 3, "metric": false}'),
                           ("get_time", '{"zone": "UTC"}')])


def forced(server, text, stream=False, messages=ASK):
    return server.client().chat.completions.create(
        model=NAME, messages=messages, tools=TOOLS, max_tokens=320, temperature=0, stream=stream,
        extra_body={"guided_choice": [text]})


def assemble(chunks):
    """content, [(name, arguments)], ids, finish_reason and reasoning from streamed chunks."""
    content, reasoning, calls, finish = "", "", {}, None
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        for t in d.tool_calls or []:
            entry = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
            if t.id:
                assert entry["id"] is None  # the id comes once, with the name
                entry["id"] = t.id
            entry["name"] += (t.function.name or "") if t.function else ""
            entry["arguments"] += (t.function.arguments or "") if t.function else ""
        finish = c.choices[0].finish_reason or finish
    return content, [(v["name"], v["arguments"]) for _, v in sorted(calls.items())], \
        [v["id"] for _, v in sorted(calls.items())], finish, reasoning


@pytest.mark.parametrize("which,text", [("v3_server", V3_TEXT), ("v31_server", V31_TEXT)])
def test_forced_tool_call_text_parses_as_the_reference_parser(which, text, request):
    server = request.getfixturevalue(which)
    r = forced(server, text)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert (msg.content, [(t.function.name, t.function.arguments) for t in msg.tool_calls]) == REFERENCE
    assert all(t.type == "function" and t.id.startswith("call_") for t in msg.tool_calls)
    assert len({t.id for t in msg.tool_calls}) == 2
    content, calls, ids, finish, _ = assemble(forced(server, text, stream=True))
    assert (content, calls) == REFERENCE and finish == "tool_calls" and all(ids)


def test_r1_reasoning_then_a_tool_call(tool_server):
    """R1-Distill's prompt ends inside <think>: the reasoning is split off first, the calls come out of the
    content after </think>."""
    server = tool_server
    text = "The user wants the weather.\n</think>\n\n" + V3_TEXT
    r = forced(server, text)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "The user wants the weather.\n"
    assert ((msg.content or "").strip(), [(t.function.name, t.function.arguments) for t in msg.tool_calls]) == \
        REFERENCE
    content, calls, _, finish, reasoning = assemble(forced(server, text, stream=True))
    assert (content.strip(), calls, finish) == (REFERENCE[0], REFERENCE[1], "tool_calls")
    assert reasoning == "The user wants the weather.\n"


def test_text_that_is_not_a_tool_call_stays_content(v3_server):
    text = "No tools needed: <｜tool▁calls▁begin｜>not a call"
    r = forced(v3_server, text)
    assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_tool_choice_none_does_not_parse(v3_server):
    r = v3_server.client().chat.completions.create(
        model=NAME, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=320, temperature=0,
        extra_body={"guided_choice": [V3_TEXT]})
    assert r.choices[0].message.content == V3_TEXT and not r.choices[0].message.tool_calls


# ---- forced calls: a random model returns a valid one ------------------------------------------------------------
def valid_calls(calls):
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    return [name for name, _ in calls]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_named_tool_choice_returns_a_valid_call(v3_server, stream, temperature):
    client = v3_server.client()
    r = client.chat.completions.create(
        model=NAME, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200, temperature=temperature, seed=7, stream=stream)
    if stream:
        _, calls, _, finish, _ = assemble(r)
    else:
        finish = r.choices[0].finish_reason
        calls = [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]
    assert finish == "tool_calls"
    assert valid_calls(calls) == ["get_weather"]


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_returns_valid_calls(v3_server, v31_server, stream):
    for server in (v3_server, v31_server):
        for parallel in (True, False):
            r = server.client().chat.completions.create(
                model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
                max_tokens=300, temperature=1.0, seed=11, stream=stream)
            if stream:
                _, calls, _, finish, _ = assemble(r)
            else:
                finish = r.choices[0].finish_reason
                calls = [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]
            assert finish == "tool_calls"
            names = valid_calls(calls)
            assert names and set(names) <= set(SCHEMAS)
            if not parallel:
                assert len(names) == 1


# ---- bad tool requests -----------------------------------------------------------------------------------------
BAD_TOOLS = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0"),
    ({"tools": [{"type": "function", "function": {"name": "a\nb"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "tool", "content": None}]}, "messages.0.content"),
]


@pytest.mark.parametrize("extra,param", BAD_TOOLS, ids=[b[1] + str(i) for i, b in enumerate(BAD_TOOLS)])
def test_bad_tool_requests_are_400s_naming_the_field(v3_server, extra, param):
    body = {"model": NAME, "messages": ASK, "max_tokens": 4, **extra}
    check_error(post(v3_server, body, "/v1/chat/completions"), 400, "invalid_request_error", param)
