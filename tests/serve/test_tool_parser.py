"""The tool-call parser without a server: whole texts against the reference parser's output stated here (vLLM's
deepseek_v3 / deepseek_v31 parsers: content before the block, each call's name and arguments as written), every
split of the stream giving the same calls, and the forcing grammars accepting exactly the syntax the parser reads."""

import pytest

from paraseek.serve.tools import ToolCallParser, check_tools, forced_spec, parse_tool_calls, ToolError

V3 = ('Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
      '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>noop\n```json\n'
      '{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
V31 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜>'
       '<｜tool▁call▁begin｜>noop<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
CASES = [  # (text, syntax, the reference parser's content and calls)
    (V3, "v3", "Let me look.", [("get_weather", '{"city": "Paris", "days": 2}'), ("noop", "{}")]),
    (V31, "v31", None, [("get_weather", '{"city": "Oslo"}'), ("noop", "{}")]),
    ("Just text, no tools.", "v3", "Just text, no tools.", []),
    ("Half <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1", "v3",
     "Half <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1", []),  # cut off
    ("x<｜tool▁calls▁begin｜>not a call", "v31", "x<｜tool▁calls▁begin｜>not a call", []),
]


@pytest.mark.parametrize("text,fmt,content,calls", CASES)
def test_whole_texts_parse_as_the_reference(text, fmt, content, calls):
    got_content, got = parse_tool_calls(text, fmt)
    assert (got_content, [(c["function"]["name"], c["function"]["arguments"]) for c in got]) == (content, calls)
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got)


@pytest.mark.parametrize("text,fmt,content,calls", CASES[:3])
@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_any_split_of_the_stream_gives_the_same_calls(text, fmt, content, calls, step):
    p = ToolCallParser(fmt)
    out, names, args = "", {}, {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for piece in pieces + [None]:
        c, deltas = p.feed(piece) if piece is not None else p.flush()
        out += c
        for d in deltas:
            if d.name is not None:
                assert d.index not in names and d.id.startswith("call_")
                names[d.index] = d.name
            args[d.index] = args.get(d.index, "") + d.arguments
    assert (out or None, [(names[i], args[i]) for i in sorted(names)]) == (content, calls)


def test_marker_prefixes_are_held_back_not_emitted():
    p = ToolCallParser("v3")
    assert p.feed("Hello <｜tool▁ca") == ("Hello ", [])
    assert p.feed("rs are fine") == ("<｜tool▁cars are fine", [])


@pytest.mark.parametrize("fmt,text", [("v3", V3[len("Let me look."):]), ("v31", V31)])
def test_the_forcing_grammar_accepts_what_the_parser_reads(fmt, text):
    xgr = pytest.importorskip("xgrammar")
    from paraseek.infer.structured import grammar_of

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
                 "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                 "required": ["city"]}}},
             {"type": "function", "function": {"name": "noop"}}]
    functions = check_tools(tools, "required")

    def accepts(spec, s):
        m = xgr.GrammarMatcher(xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(grammar_of(spec)))
        return m.accept_string(s)

    assert accepts(forced_spec(functions, "required", fmt, True), text)
    assert not accepts(forced_spec(functions, "required", fmt, False), text)  # two calls, parallel off
    first = text[:text.index("<｜tool▁call▁end｜>") + len("<｜tool▁call▁end｜>")] + "<｜tool▁calls▁end｜>"
    named = forced_spec(functions, {"type": "function", "function": {"name": "get_weather"}}, fmt, True)
    assert accepts(named, first) and not accepts(named, first.replace("get_weather", "noop"))
    assert not accepts(forced_spec(functions, "required", fmt, True), "plain text")


def test_tool_lists_are_checked():
    with pytest.raises(ToolError) as e:
        check_tools([{"type": "function", "function": {"name": "f"}}] * 2, None)
    assert e.value.param == "tools.1.function.name"
    assert forced_spec(check_tools([{"type": "function", "function": {"name": "f"}}], "auto"), "auto", "v3",
                       True) is None
