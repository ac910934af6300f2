"""paraseek.models.tokenizer against transformers (encode/decode and apply_chat_template on real chat templates,
vendored under tests/fixtures/chat_templates), and the streaming helpers against whole-text references."""

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, processors

from paraseek.errors import UserError
from paraseek.models.tokenizer import (IncrementalDetokenizer, ReasoningStreamSplitter, StopStringMatcher,
                                       load_text_tokenizer, split_reasoning)

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "src/paraseek/assets/tokenizer/tokenizer.json"
TEMPLATES = ROOT / "tests/fixtures/chat_templates"

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
# DeepSeek's chat tokens are added tokens but not special ones in the hub tokenizer.json files
DEEPSEEK_TOKENS = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>",
                   "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
                   "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                   "<｜tool▁output▁end｜>"]
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                 "<|eot_id|>", "<|python_tag|>"]
ADDED = {"__type": "AddedToken", "lstrip": False, "normalized": True, "rstrip": False, "single_word": False}

# Per template: the folder's special and plain added tokens, its tokenizer_config.json (the hub's keys), config.json,
# generation_config.json and whether tokenizer.json's post-processor prepends bos (the hub DeepSeek and Llama-3
# files do). config.json's model_type keeps transformers 5 on tokenizer.json as it is (TokenizersBackend): with
# model_type llama or qwen2 and tokenizer_class LlamaTokenizerFast it would rebuild the pre-tokenizer and decoder
# from its own idea of the model family instead, which paraseek deliberately does not copy.
MODELS = {
    "deepseek_r1_distill_qwen": dict(
        special=[BOS, EOS], plain=DEEPSEEK_TOKENS, bos_post=BOS,
        config={"add_bos_token": True, "add_eos_token": False, "bos_token": {**ADDED, "content": BOS},
                "eos_token": {**ADDED, "content": EOS}, "pad_token": {**ADDED, "content": EOS},
                "clean_up_tokenization_spaces": False, "legacy": True, "model_max_length": 16384,
                "tokenizer_class": "LlamaTokenizerFast", "unk_token": None},
        config_json={"model_type": "deepseek_v3"}, generation_config={"bos_token_id": 2048, "eos_token_id": 2049}),
    "deepseek_v3": dict(
        special=[BOS, EOS, "<｜▁pad▁｜>"], plain=DEEPSEEK_TOKENS, bos_post=BOS,
        config={"add_bos_token": True, "add_eos_token": False, "bos_token": BOS, "eos_token": EOS,
                "pad_token": EOS, "clean_up_tokenization_spaces": False, "tokenizer_class": "LlamaTokenizerFast",
                "unk_token": None},
        config_json={"model_type": "deepseek_v3", "eos_token_id": 2049}),
    "deepseek_llm_7b_chat": dict(
        special=[BOS, EOS], plain=[], bos_post=BOS,
        config={"add_bos_token": True, "add_eos_token": False, "bos_token": {**ADDED, "content": BOS},
                "eos_token": {**ADDED, "content": EOS}, "clean_up_tokenization_spaces": False,
                "tokenizer_class": "LlamaTokenizerFast"},
        config_json={"model_type": "deepseek_v3"}),
    "llama_3_1": dict(
        special=LLAMA_SPECIAL, plain=[], bos_post="<|begin_of_text|>",
        config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": True,
                "tokenizer_class": "PreTrainedTokenizerFast"},
        config_json={"model_type": "llama", "eos_token_id": [2049, 2052, 2053]},
        generation_config={"eos_token_id": [2049, 2052, 2053]}),
}


def make_folder(folder: Path, model: str, with_template: bool = True) -> Path:
    """The bundled 2,048-token byte-level BPE grown into a hub-like model folder for `model`."""
    spec = MODELS[model]
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(BUNDLED))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["special"]])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["plain"]])
    if spec.get("bos_post"):
        bos = spec["bos_post"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(folder / "tokenizer.json"))
    config = dict(spec["config"])
    if with_template:
        config["chat_template"] = (TEMPLATES / f"{model}.jinja").read_text(encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")
    for name in ("config_json", "generation_config"):
        if name in spec:
            file = "config.json" if name == "config_json" else "generation_config.json"
            (folder / file).write_text(json.dumps(spec[name]))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {m: make_folder(root / m, m) for m in MODELS}


@pytest.fixture(scope="module")
def hf(folders):
    """AutoTokenizer.from_pretrained for each folder (transformers is a test dependency, not a runtime one)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return {m: transformers.AutoTokenizer.from_pretrained(str(f)) for m, f in folders.items()}


@pytest.fixture(scope="module")
def ours(folders):
    return {m: load_text_tokenizer(f) for m, f in folders.items()}


TEXTS = ["Hello, world!", "  leading and trailing  ", "line one\nline two\n\n\ttab", "ünïcödé çàfé — “quotes”",
         "中文测试，你好世界。", "emoji 🤖🎉👍🏽 and 🇫🇷", f"{BOS}inside{EOS} the text", "<｜User｜>hi<｜Assistant｜>",
         "<think>\nreasoning\n</think>\n\nanswer", "<|start_header_id|>user<|end_header_id|>", "it's 12345 ok?",
         "", " ", "x" * 300]

# ------------------------------------------------------------------------------------------- encode / decode


@pytest.mark.parametrize("model", MODELS)
def test_encode_decode_match_transformers(model, ours, hf):
    tok, ref = ours[model], hf[model]
    assert tok.vocab_size == len(ref)
    assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text


def test_special_tokens_and_stop_ids(ours):
    v3, r1, llama = ours["deepseek_v3"], ours["deepseek_r1_distill_qwen"], ours["llama_3_1"]
    assert v3.tok.id_to_token(v3.bos_token_id) == BOS and v3.tok.id_to_token(v3.eos_token_id) == EOS
    assert v3.add_bos_token and v3.encode("hi")[0] == v3.bos_token_id
    assert v3.stop_token_ids == [v3.eos_token_id]  # config.json's eos is the same id
    assert r1.stop_token_ids == [r1.eos_token_id]
    # Llama-3.1 stops on <|eot_id|> (eos), <|end_of_text|> and <|eom_id|> (generation_config.json)
    assert [llama.tok.id_to_token(i) for i in llama.stop_token_ids] == ["<|eot_id|>", "<|end_of_text|>",
                                                                        "<|eom_id|>"]
    bundled = load_text_tokenizer(BUNDLED)  # no config beside it: the known names
    assert (bundled.bos_token_id, bundled.eos_token_id, bundled.vocab_size) == (0, 1, 2048)
    assert not bundled.add_bos_token and bundled.chat_template is None


@pytest.mark.parametrize("with_decoder", [False, True])
def test_special_tokens_map_json(tmp_path, with_decoder):
    """The legacy special_tokens_map.json overrides tokenizer_config.json, unless the config has an
    added_tokens_decoder (then transformers does not read it)."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "m"
    folder.mkdir()
    Tokenizer.from_file(str(BUNDLED)).save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": "{{ bos_token }}|{{ eos_token }}"}
    if with_decoder:
        config["added_tokens_decoder"] = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                                   "single_word": False, "special": True}
                                          for i, t in enumerate(["<|bos|>", "<|eos|>"])}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": {**ADDED, "content": "<|bos|>"}}))
    ours, ref = load_text_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    assert ours.eos_token_id == ref.eos_token_id == (1 if with_decoder else 0)
    msgs = [{"role": "user", "content": "x"}]
    assert ours.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False)


def test_clean_up_tokenization_spaces_for_non_bpe_models(tmp_path):
    """transformers applies clean_up_tokenization_spaces only to non-BPE models (the Llama-3 folder above sets it
    and is BPE); a word-level model with the flag gets " ," -> "," like transformers does it."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import models, pre_tokenizers
    folder = tmp_path / "m"
    folder.mkdir()
    words = ["[UNK]", "hello", ",", "world", ".", "it", "'s", "n't"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"clean_up_tokenization_spaces": True,
                                                              "unk_token": "[UNK]"}))
    ours, ref = load_text_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    ids = [1, 2, 3, 4, 5, 6]
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == "hello, world. it's"
    assert load_text_tokenizer(folder / "tokenizer.json").decode(ids) == "hello, world. it's"  # the file, too


def test_config_add_bos_token_is_ignored_like_transformers(tmp_path):
    """transformers 5 drops tokenizer_config.json's add_bos_token when a tokenizer.json exists: the tokenizer.json
    post-processor alone decides. This folder says add_bos_token but its tokenizer.json has no post-processor."""
    transformers = pytest.importorskip("transformers")
    folder = make_folder(tmp_path / "m", "deepseek_v3")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.post_processor = None
    tok.save(str(folder / "tokenizer.json"))
    ours = load_text_tokenizer(folder)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert ours.encode("hello") == ref.encode("hello") and not ours.add_bos_token
    assert ours.encode("hello")[0] != ours.bos_token_id


def test_special_tokens_missing_from_the_vocab_are_added(tmp_path):
    """A config naming tokens the vocabulary lacks (and an extra special token): transformers adds them."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "m"
    folder.mkdir()
    Tokenizer.from_file(str(BUNDLED)).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {**ADDED, "content": "</s>"}, "pad_token": "<pad>",
        "image_token": "<image>"}))
    ours = load_text_tokenizer(folder)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    text = "<s>a picture <image> here</s><pad>"
    assert ours.vocab_size == len(ref) == 2052
    assert ours.encode(text) == ref.encode(text)
    assert ours.decode(ours.encode(text)) == ref.decode(ref.encode(text), skip_special_tokens=True) == "a picture  here"
    assert ours.specials["image_token"] == "<image>"


# ----------------------------------------------------------------------------------------------- chat templates

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Réponds en français si besoin 🙂."}
CHAT = [SYSTEM,
        {"role": "user", "content": "What is 2+2? 中文也可以。"},
        {"role": "assistant", "content": "2+2 = 4 🎉"},
        {"role": "user", "content": "And in words?"}]
CHAT_DONE = [*CHAT, {"role": "assistant", "content": "Four."}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. \"Paris\""}},
                   "required": ["city"]}}}
# DeepSeek templates concatenate arguments (a JSON string) into the prompt; Llama-3.1's runs them through tojson
DEEPSEEK_TOOL_CHAT = [
    SYSTEM, {"role": "user", "content": "Weather in Paris and in 東京?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "東京"}'}}]},
    {"role": "tool", "content": "18°C, sunny"}, {"role": "tool", "content": "22°C, rain"},
    {"role": "assistant", "content": "Paris: 18°C and sunny; Tokyo: 22°C with rain."},
    {"role": "user", "content": "Thanks!"}]
LLAMA_TOOL_CHAT = [
    SYSTEM, {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}], "content": None},
    {"role": "tool", "content": {"temperature": "18°C"}},
    {"role": "assistant", "content": "It is 18°C in Paris."}]

CASES = [(m, chat, None, {}) for m in MODELS for chat in (CHAT, CHAT_DONE, CHAT[1:])]
CASES += [("deepseek_v3", DEEPSEEK_TOOL_CHAT, None, {}), ("deepseek_r1_distill_qwen", DEEPSEEK_TOOL_CHAT, None, {}),
          ("llama_3_1", CHAT, [WEATHER_TOOL], {}), ("llama_3_1", LLAMA_TOOL_CHAT, [WEATHER_TOOL], {}),
          ("llama_3_1", CHAT, [WEATHER_TOOL], {"tools_in_user_message": False, "date_string": "01 Jan 2025"}),
          # R1 drops the reasoning of earlier assistant turns from the prompt
          ("deepseek_r1_distill_qwen", [CHAT[1], {"role": "assistant", "content": "<think>\nhmm\n</think>\n\n4"},
                                        CHAT[3]], None, {})]


@pytest.mark.parametrize("model,messages,tools,kwargs", CASES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(model, messages, tools, kwargs, add_generation_prompt, ours, hf):
    tok, ref = ours[model], hf[model]
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
    assert text == ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                           tokenize=False, **kwargs)
    ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools, tokenize=True,
                                  **kwargs)
    assert ids == ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                          tokenize=True, return_dict=False, **kwargs)
    assert ids.count(tok.bos_token_id) == 1  # the template's bos, and no second one from the post-processor


def test_r1_generation_prompt_opens_the_think_block(ours):
    text = ours["deepseek_r1_distill_qwen"].apply_chat_template(CHAT)
    assert text.startswith(BOS + SYSTEM["content"] + "<｜User｜>") and text.endswith("<｜Assistant｜><think>\n")


def test_template_sources(tmp_path):
    """chat_template.jinja beats the config's entry (as transformers 5 writes it); a list of named templates picks
    "default", or "tool_use" when tools are given; the --chat-template file beats both."""
    transformers = pytest.importorskip("transformers")
    folder = make_folder(tmp_path / "m", "deepseek_llm_7b_chat")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "D{{ messages[0].content }}"},
                               {"name": "tool_use", "template": "T{{ tools | length }}"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    msgs = [{"role": "user", "content": "x"}]
    tok, ref = load_text_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False) == "Dx"
    assert tok.apply_chat_template(msgs, tools=[WEATHER_TOOL]) == "T1" == \
        ref.apply_chat_template(msgs, tools=[WEATHER_TOOL], tokenize=False)
    (folder / "chat_template.jinja").write_text("J{{ bos_token }}{{ messages | length }}", encoding="utf-8")
    tok, ref = load_text_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tok.chat_template == "J{{ bos_token }}{{ messages | length }}"
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False) == f"J{BOS}1"
    (tmp_path / "mine.jinja").write_text("M{{ eos_token }}")
    assert load_text_tokenizer(folder, chat_template=tmp_path / "mine.jinja").apply_chat_template(msgs) == f"M{EOS}"


def test_environment_matches_transformers(tmp_path):
    """The environment's pieces: tojson without HTML escaping (and its options), loopcontrols, trim/lstrip blocks,
    strftime_now, and the {% generation %} tag rendering its body."""
    transformers = pytest.importorskip("transformers")
    template = ("{%- for m in messages %}\n  {%- if loop.index > 2 %}{% break %}{% endif %}\n"
                "  {{ m | tojson(indent=1, sort_keys=True) }}|{{ m.content | tojson }}\n"
                "  {% generation %}<{{ m.role }}>{% endgeneration %}\n{% endfor %}"
                "{{ strftime_now('%Y') }}{{ foo }}")
    folder = make_folder(tmp_path / "m", "deepseek_v3", with_template=False)
    (folder / "chat_template.jinja").write_text(template)
    msgs = [{"role": "user", "content": "<b>&'\"ü"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "never"}]
    tok, ref = load_text_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    ours_text = tok.apply_chat_template(msgs, foo="F")
    assert ours_text == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, foo="F")
    assert '"<b>&\'\\"ü"' in ours_text and "never" not in ours_text


# ------------------------------------------------------------------------------------------------ assistant spans

@pytest.mark.parametrize("model", MODELS)
def test_assistant_spans_are_the_rendered_contents(model, ours):
    tok = ours[model]
    for chat in (CHAT_DONE, DEEPSEEK_TOOL_CHAT if model.startswith("deepseek_") and model != "deepseek_llm_7b_chat"
                 else CHAT_DONE[1:]):
        text, spans = tok.render_chat_with_spans(chat)
        assert text == tok.apply_chat_template(chat, add_generation_prompt=False)
        contents = [m["content"] for m in chat if m["role"] == "assistant" and m["content"] is not None]
        assert [text[a:b] for a, b in spans] == contents
        assert all(b0 <= a1 for (_, b0), (a1, _) in zip(spans, spans[1:]))


def test_generation_tag_spans_match_transformers(ours):
    """With {% generation %} tags the spans are transformers' own (what return_assistant_tokens_mask uses)."""
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template
    template = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}<｜Assistant｜>"
                "{% generation %}{{ m.content | trim }}{{ eos_token }}{% endgeneration %}"
                "{% else %}<｜User｜>{{ m.content }}{% endif %}{% endfor %}")
    tok = ours["deepseek_v3"]
    chat = [CHAT[1], {"role": "assistant", "content": "  padded  "}, CHAT[3], {"role": "assistant", "content": "ü"}]
    saved = tok.chat_templates
    try:
        tok.chat_template = template
        text, spans = tok.render_chat_with_spans(chat)
    finally:
        tok.chat_templates = saved
    rendered, indices = render_jinja_template(conversations=[chat], chat_template=template,
                                              return_assistant_tokens_mask=True, bos_token=BOS, eos_token=EOS)
    assert (text, spans) == (rendered[0], indices[0])
    assert [text[a:b] for a, b in spans] == ["padded" + EOS, "ü" + EOS]


def test_spans_refuse_templates_that_rewrite_content(ours):
    chat = [CHAT[1], {"role": "assistant", "content": "<think>\nhmm\n</think>\n\n4"}]
    with pytest.raises(UserError, match="trims or rewrites assistant content") as e:
        ours["deepseek_r1_distill_qwen"].render_chat_with_spans(chat)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="trims or rewrites"):  # Llama-3.1 trims
        ours["llama_3_1"].render_chat_with_spans([CHAT[1], {"role": "assistant", "content": " four "}])


# ------------------------------------------------------------------------------------------------------ bad input

def one_line_error(fn, *args, match=None, **kwargs) -> str:
    with pytest.raises(UserError, match=match) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_folders(tmp_path):
    (tmp_path / "empty").mkdir()
    assert "tokenizer.json" in one_line_error(load_text_tokenizer, tmp_path / "empty", match="no tokenizer file")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    one_line_error(load_text_tokenizer, tmp_path / "broken", match="not a valid HF tokenizer.json")
    folder = make_folder(tmp_path / "m", "deepseek_v3")
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<s>",\n oops}')
    assert "tokenizer_config.json" in one_line_error(load_text_tokenizer, folder, match="not valid JSON")
    (folder / "tokenizer_config.json").write_text('["a list"]')
    one_line_error(load_text_tokenizer, folder, match="expected a JSON object")
    (folder / "tokenizer_config.json").write_text('{"chat_template": 3}')
    one_line_error(load_text_tokenizer, folder, match="chat_template must be a string")
    one_line_error(load_text_tokenizer, BUNDLED, chat_template=tmp_path / "nope.jinja", match="cannot read")


def test_no_chat_template_is_an_error(tmp_path):
    tok = load_text_tokenizer(make_folder(tmp_path / "m", "deepseek_v3", with_template=False))
    assert tok.chat_template is None
    msg = one_line_error(tok.apply_chat_template, CHAT, match="has no chat template in tokenizer_config.json")
    assert "--chat-template" in msg


@pytest.mark.parametrize("messages", [[], "hello", [{"role": "user"}], [{"content": "x"}], ["user: hi"],
                                      [{"role": 3, "content": "x"}]])
def test_bad_messages(messages, ours):
    one_line_error(ours["deepseek_v3"].apply_chat_template, messages, match="messages")


def test_template_errors_are_one_line(ours, tmp_path):
    llama = ours["llama_3_1"]
    two_calls = [CHAT[1], {"role": "assistant", "content": None, "tool_calls": [WEATHER_TOOL, WEATHER_TOOL]}]
    one_line_error(llama.apply_chat_template, two_calls, match="only supports single tool-calls")  # raise_exception
    # content parts where the template adds strings: the template's TypeError, as a user error
    one_line_error(ours["deepseek_v3"].apply_chat_template, [{"role": "user", "content": [{"type": "text"}]}],
                   match="failed on these messages")
    one_line_error(llama.apply_chat_template, CHAT, tools="get_weather", match="tools must be a list")
    broken = load_text_tokenizer(BUNDLED)
    broken.chat_template = "{% for m in messages %}{{ m.content }"
    one_line_error(broken.apply_chat_template, CHAT, match="does not parse")


# ------------------------------------------------------------------------------------------- incremental decoding

STREAM = "Grüße! 你好，世界 🤖🎉👍🏽🇫🇷 — naïve café ✓\nend 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"


class CountingTokenizer:
    """Records how many ids each decode() call sees."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_one_token_at_a_time(skip, ours):
    tok = ours["deepseek_v3"]
    ids = tok.encode(STREAM * 3) + [tok.eos_token_id] + tok.encode("after 🎉", add_special_tokens=False)
    # the test is only meaningful if some tokens hold part of a character
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, skip_special_tokens=skip)
    pieces = [detok.push([i]) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text == tok.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in p for p in pieces)
    assert max(counting.sizes) <= 2 * IncrementalDetokenizer.MAX_HELD  # a window, not the whole output


def test_detokenizer_several_tokens_per_push_and_cut_characters(ours):
    tok = ours["deepseek_llm_7b_chat"]
    ids = tok.encode(STREAM, add_special_tokens=False)
    for n in (2, 3, 7):
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.push(ids[i:i + n]) for i in range(0, len(ids), n)]
        assert "".join(pieces) == tok.decode(ids) and not any("\ufffd" in p for p in pieces)
    # generation that stops inside a character: flush gives what decode gives
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok)
    held = "".join(detok.push([i]) for i in ids[:cut])
    assert "\ufffd" not in held and held + detok.flush() == tok.decode(ids[:cut])


# ------------------------------------------------------------------------------------------------- stop strings

def stream_stops(pieces, stops):
    m, out = StopStringMatcher(stops), []
    for p in pieces:
        text, stopped = m.feed(p)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + m.flush(), False


def reference_stop(text, stops):
    hits = [i for i in (text.find(s) for s in stops if s) if i != -1]
    return (text[:min(hits)], True) if hits else (text, False)


def test_stop_across_pushes_and_held_text():
    m = StopStringMatcher(["###END"])
    assert m.feed("result: 42 #") == ("result: 42 ", False)  # "#" could start the stop: held
    assert m.feed("##") == ("", False)
    assert m.feed("E") == ("", False)
    assert m.feed("ND and more") == ("", True)
    assert m.feed("ignored") == ("", True) and m.flush() == ""
    m = StopStringMatcher(["###END"])
    assert m.feed("a ##") == ("a ", False)
    assert m.feed("#EX") == ("###EX", False)  # not the stop after all: released
    assert m.feed("##") == ("", False) and m.flush() == "##"


def test_stop_at_start_and_multiple_stops():
    assert StopStringMatcher(["Stop"]).feed("Stop right there") == ("", True)
    m = StopStringMatcher(["\n\n", "User:", "ab"])
    assert m.feed("one\nUs") == ("one\n", False)
    assert m.feed("er: two") == ("", True)
    assert StopStringMatcher(["xyz", "y"]).feed("axyz") == ("a", True)  # the earliest match wins
    assert StopStringMatcher([]).feed("anything") == ("anything", False)


@pytest.mark.parametrize("text", ["The answer is 4.\n\nUser: next", "no stops here at all", "abcabd", "User:",
                                  "U\nUse\n\nr"])
def test_stop_matches_whole_text_reference_at_every_split(text):
    stops = ["\n\n", "User:", "abd", "Use\n"]
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert stream_stops([text[:i], text[i:j], text[j:]], stops) == reference_stop(text, stops)
    assert stream_stops(list(text), stops) == reference_stop(text, stops)


# ------------------------------------------------------------------------------------------------------ reasoning

def stream_reasoning(pieces, starts_in_reasoning):
    s = ReasoningStreamSplitter(starts_in_reasoning)
    parts = [s.feed(p) for p in pieces] + [s.flush()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


REASONING_TEXTS = ["<think>\nLet me add.\n</think>\n\n4", "I think 2+2 is 4.\n</think>\n\nFour.", "plain answer",
                   "<think>cut short by max_tokens", "</think>", "<thi", "<think></think>", "a </thi b",
                   "<think>x</think>y</think>z", " <think>not at the start</think>"]


def test_split_reasoning():
    assert split_reasoning("<think>\nplan\n</think>\n\nanswer") == ("\nplan\n", "\n\nanswer")
    assert split_reasoning("plan\n</think>\n\nanswer", starts_in_reasoning=True) == ("plan\n", "\n\nanswer")
    assert split_reasoning("just an answer") == (None, "just an answer")
    assert split_reasoning("a </think> b") == (None, "a </think> b")  # no think block opened
    assert split_reasoning("still thinking", starts_in_reasoning=True) == ("still thinking", "")
    assert split_reasoning("<think>unclosed") == ("unclosed", "")


@pytest.mark.parametrize("starts_in_reasoning", [False, True])
@pytest.mark.parametrize("text", REASONING_TEXTS)
def test_reasoning_stream_matches_whole_text_at_every_split(text, starts_in_reasoning):
    reasoning, content = split_reasoning(text, starts_in_reasoning)
    expected = (reasoning or "", content)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert stream_reasoning([text[:i], text[i:j], text[j:]], starts_in_reasoning) == expected, (i, j)
    assert stream_reasoning(list(text), starts_in_reasoning) == expected


def test_reasoning_stream_emits_early():
    s = ReasoningStreamSplitter(starts_in_reasoning=True)
    assert s.feed("thinking hard </th") == ("thinking hard ", "")  # "</th" held: could be the closing tag
    assert s.feed("ink>\n\nThe") == ("", "\n\nThe")
    assert s.feed(" answer") == ("", " answer") and s.flush() == ("", "")
    s = ReasoningStreamSplitter()
    assert s.feed("<th") == ("", "") and s.feed("ink>x") == ("x", "")
    s = ReasoningStreamSplitter()
    assert s.feed("Hi") == ("", "Hi")
