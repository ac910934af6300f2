"""Structured outputs by grammar-constrained decoding: response_format json_schema and json_object (and vLLM's
guided_* fields) from a random tiny model give output that validates, non-streamed and streamed; a schema that does
not compile is a 400 naming response_format; before, response_format came back as free text with a 200."""

import json
import re

import jsonschema
import pytest
from serve_helpers import NAME
from test_errors import check_error, post, still_serves

pytest.importorskip("xgrammar")  # the grammar library of [serve]

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"type": "string", "enum": ["king", "prophet", "scribe"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
    "required": ["name", "age", "role", "tags"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK = [{"role": "user", "content": "Describe Solomon as JSON."}]


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 1), (1.0, 2)])
def test_json_schema_output_validates(v3_server, temperature, seed):
    client = v3_server.client()
    r = client.chat.completions.create(model=NAME, messages=ASK, response_format=FORMAT, max_tokens=400,
                                       temperature=temperature, seed=seed)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    chunks = list(client.chat.completions.create(model=NAME, messages=ASK, response_format=FORMAT, max_tokens=400,
                                                 temperature=temperature, seed=seed, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    if seed is not None or temperature == 0:  # the same request streamed is the same output
        assert text == r.choices[0].message.content


def test_json_object_is_a_json_object(v3_server):
    r = v3_server.client().chat.completions.create(model=NAME, messages=ASK, response_format={"type": "json_object"},
                                                   max_tokens=400, temperature=1.0, seed=5)
    if r.choices[0].finish_reason == "stop":  # a random model may fill its budget inside a string; if it ends, it
        assert isinstance(json.loads(r.choices[0].message.content), dict)  # is an object
    else:
        assert r.choices[0].message.content.startswith("{")


def test_without_response_format_the_output_is_free_text(v3_server):
    """The control: the same request unconstrained does not give this JSON (the constraint is what made it)."""
    r = v3_server.client().chat.completions.create(model=NAME, messages=ASK, max_tokens=40, temperature=0)
    with pytest.raises(ValueError):
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_completions_take_response_format_and_guided_fields(v3_server):
    client = v3_server.client()
    r = client.completions.create(model=NAME, prompt="The king was", max_tokens=400, temperature=1.0, seed=3,
                                  extra_body={"response_format": FORMAT})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = client.completions.create(model=NAME, prompt="The king was", max_tokens=20, temperature=1.0, seed=3,
                                  extra_body={"guided_regex": "[a-c]{2,5}-[0-9]{3}"})
    assert re.fullmatch("[a-c]{2,5}-[0-9]{3}", r.choices[0].text)
    r = client.completions.create(model=NAME, prompt="The king was", max_tokens=20, temperature=0,
                                  extra_body={"guided_choice": ["wise", "foolish"]})
    assert r.choices[0].text in ("wise", "foolish")
    r = client.completions.create(model=NAME, prompt="The king was", max_tokens=20, temperature=0,
                                  extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model=NAME, prompt="The king was", max_tokens=400, temperature=1.0, seed=4,
                                  extra_body={"guided_json": json.dumps(PERSON)})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_n_choices_each_follow_the_schema(v3_server):
    r = v3_server.client().chat.completions.create(model=NAME, messages=ASK, response_format=FORMAT, max_tokens=400,
                                                   temperature=1.0, seed=9, n=3)
    outs = [c.message.content for c in r.choices]
    for o in outs:
        jsonschema.validate(json.loads(o), PERSON)
    assert len(set(outs)) > 1  # seeds seed + i: different samples


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "cannot build a grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": "nope"}}, "response_format.json_schema", ""),
    ({"guided_regex": "(("}, "guided_regex", "cannot build a grammar"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", ""),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", ""),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens", ""),
]


@pytest.mark.parametrize("extra,param,says", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_structured_requests_are_400s_naming_the_field(v3_server, extra, param, says):
    body = {"model": NAME, "messages": ASK, "max_tokens": 4, **extra}
    check_error(post(v3_server, body, "/v1/chat/completions"), 400, "invalid_request_error", param, says)
    still_serves(v3_server)


def test_reasoning_templates_constrain_the_answer_after_think(tool_server):
    """R1-Distill's prompt ends inside <think>, so the grammar the server builds for it lets the model reason
    first: it accepts reasoning, </think>, then the schema's JSON; without the reasoning part the same text is
    rejected at its first word."""
    from paraseek.infer import structured
    from paraseek.models.tokenizer import load_text_tokenizer

    tok = load_text_tokenizer(tool_server.argv[4])
    backend = structured.backend_for(tok, 2112, [tok.eos_token_id])
    spec = {"type": "json_schema", "schema": PERSON, "reasoning": True}
    ok = 'Think.\n</think>\n\n{"name": "Solomon", "age": 60, "role": "king", "tags": []}'
    assert accepts(backend, spec, tok.encode(ok, add_special_tokens=False) + [tok.eos_token_id])
    assert not accepts(backend, {**spec, "reasoning": False}, tok.encode(ok, add_special_tokens=False))


def accepts(backend, spec, ids) -> bool:
    import xgrammar as xgr

    m = xgr.GrammarMatcher(backend.compile(spec))
    return all(m.accept_token(t) for t in ids)


def test_generate_json_schema(long_folder, tmp_path, capsys):
    """`paraseek generate --json-schema FILE`: each prompt's output validates; a schema that does not compile is
    one line and exit 2."""
    from serve_helpers import generate

    from paraseek.cli import main

    f = tmp_path / "person.json"
    f.write_text(json.dumps(PERSON))
    for row in generate(long_folder, ["The king was", "A prophet"], 400, "--json-schema", str(f)):
        assert row["finish_reason"] == "stop"
        jsonschema.validate(json.loads(row["text"]), PERSON)
    f.write_text('{"type": "nonsense"}')
    capsys.readouterr()
    assert main(["generate", str(long_folder), "--prompt", "x", "--json-schema", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot build a grammar" in err[0], err
