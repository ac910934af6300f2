"""Chat data (train/chat.py, train/dataset.py): rendering with real chat templates against transformers, the trained
tokens (roles, --loss-on) against transformers' assistant masks and against spans found by hand, packing, padding,
truncation, the evaluation split and the bad-input lines.

References are computed another way: transformers' apply_chat_template (token ids, return_assistant_tokens_mask), the
templates' own structure (an assistant turn is what follows <｜Assistant｜> up to its end-of-sentence token), and
the model run on each conversation alone."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from paraseek.errors import UserError
from paraseek.models import build_model
from paraseek.models.args import ModelArgs, preset_config
from paraseek.models.loss import IGNORE_INDEX
from paraseek.models.tokenizer import load_text_tokenizer
from paraseek.train import token_cache
from paraseek.train.chat import ASSISTANT, LAST
from paraseek.train.dataset import open_dataset, split_eval
from paraseek.train.loader import DataLoader, EvalLoader

from test_tokenizer import (CHAT_DONE, DEEPSEEK_TOOL_CHAT, EOS, LLAMA_TOOL_CHAT, MODELS, SYSTEM, WEATHER_TOOL,
                            make_folder)

VOCAB = 4096  # the bundled 2,048 tokens plus the templates' added ones
CHATS = [
    CHAT_DONE,
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [SYSTEM, {"role": "user", "content": "Name three colours."}, {"role": "assistant", "content": "Red, green, blue."},
     {"role": "user", "content": "And two more?"}, {"role": "assistant", "content": "Black and white."},
     {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "You're welcome."}],
]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PARASEEK_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {m: make_folder(root / m, m) for m in MODELS}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def open_chat(path, folder, seq_len=4095, **kw):
    return open_dataset(str(path), seq_len=seq_len, vocab_size=VOCAB, tokenizer=str(folder), **kw)


def documents(ds):
    """Each conversation's (ids, roles) from the dataset's cache."""
    starts = ds.seg_off.tolist() + [len(ds.tokens)]
    return [(np.asarray(ds.tokens[a:b]).tolist(), np.asarray(ds.roles[a:b]).tolist())
            for a, b in zip(starts, starts[1:])]


# ------------------------------------------------------------------------------------- rendering vs transformers

ROWS = {m: [{"messages": c} for c in CHATS] for m in MODELS}
ROWS["deepseek_v3"] += [{"messages": DEEPSEEK_TOOL_CHAT}]
ROWS["deepseek_r1_distill_qwen"] += [{"messages": DEEPSEEK_TOOL_CHAT}]
ROWS["llama_3_1"] += [{"messages": LLAMA_TOOL_CHAT, "tools": [WEATHER_TOOL]}]


@pytest.mark.parametrize("model", MODELS)
def test_rendering_equals_transformers_token_for_token(model, folders, tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    ref = transformers.AutoTokenizer.from_pretrained(str(folders[model]))
    ds = open_chat(write_jsonl(tmp_path / "c.jsonl", ROWS[model]), folders[model], pack=False, loss_on="all")
    assert ds.num_sequences == len(ROWS[model])
    for (ids, _), row in zip(documents(ds), ROWS[model]):
        assert ids == ref.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=True,
                                              return_dict=False)


def test_trained_tokens_equal_transformers_assistant_masks(folders, tmp_path):
    """With a {% generation %} template the trained tokens are transformers' return_assistant_tokens_mask."""
    transformers = pytest.importorskip("transformers")
    template = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}<｜Assistant｜>"
                "{% generation %}{{ m.content | trim }}{{ eos_token }}{% endgeneration %}"
                "{% else %}<｜User｜>{{ m.content }}{% endif %}{% endfor %}")
    (tmp_path / "t.jinja").write_text(template, encoding="utf-8")
    rows = [{"messages": c} for c in CHATS]
    ds = open_chat(write_jsonl(tmp_path / "c.jsonl", rows), folders["deepseek_v3"], pack=False,
                   chat_template=str(tmp_path / "t.jinja"))
    ref = transformers.AutoTokenizer.from_pretrained(str(folders["deepseek_v3"]))
    for (ids, roles), row in zip(documents(ds), rows):
        out = ref.apply_chat_template(row["messages"], chat_template=template, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        assert ids == out["input_ids"]
        assert [int(r >= ASSISTANT) for r in roles] == out["assistant_masks"]


@pytest.mark.parametrize("model", ["deepseek_v3", "deepseek_r1_distill_qwen"])
def test_assistant_spans_by_hand(model, folders, tmp_path):
    """DeepSeek templates write each assistant turn as <｜Assistant｜> content <｜end▁of▁sentence｜>: the trained
    tokens are exactly those after <｜Assistant｜> through that end token, the last turn's marked LAST."""
    ds = open_chat(write_jsonl(tmp_path / "c.jsonl", ROWS[model][:3]), folders[model], pack=False)
    tok = load_text_tokenizer(folders[model])
    assistant, eos = tok.tok.token_to_id("<｜Assistant｜>"), tok.eos_token_id
    for ids, roles in documents(ds):
        by_hand, inside = [], False
        for t in ids:
            by_hand.append(inside)
            inside = (inside and t != eos) or t == assistant
        assert [r >= ASSISTANT for r in roles] == by_hand
        last = max(i for i, r in enumerate(roles) if r == LAST)
        assert ids[last] == eos and all(r != LAST for r in roles[:ids.index(assistant, 0)])
        turns = tok.decode([t for t, r in zip(ids, roles) if r == LAST], skip_special_tokens=False)
        assert turns.endswith(EOS)


def test_tool_call_turns_without_generation_tags_are_counted(folders, tmp_path):
    ds = open_chat(write_jsonl(tmp_path / "c.jsonl", [{"messages": DEEPSEEK_TOOL_CHAT}]), folders["deepseek_v3"])
    assert "1 assistant tool-call turns not trained" in ds.summary


# ----------------------------------------------------------------------------------------------- --loss-on, rows

def test_loss_on_modes_and_prompt_completion_rows(folders, tmp_path):
    folder = folders["deepseek_v3"]
    tok = load_text_tokenizer(folder)
    chat = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[2]}])
    trained = {}
    for mode in ("assistant", "all", "last-turn"):
        ds = open_chat(chat, folder, pack=False, loss_on=mode)
        _, trained_W, _ = ds.window(0)
        trained[mode] = trained_W[:len(documents(ds)[0][0])].tolist()
    ids, roles = documents(open_chat(chat, folder, pack=False))[0]
    assert trained["all"] == [False] + [True] * (len(ids) - 1)  # every token but the first
    assert trained["assistant"] == [r >= ASSISTANT for r in roles]
    assert trained["last-turn"] == [r == LAST for r in roles] and sum(trained["last-turn"]) < sum(trained["assistant"])

    # plain prompt/completion: prompt ids (with bos) + completion ids + eos, the completion and eos trained
    pc = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Translate: chat", "completion": " cat"}])
    (pc_ids, pc_roles), = documents(open_chat(pc, folder, pack=False))
    head, tail = tok.encode("Translate: chat"), tok.encode(" cat", add_special_tokens=False) + [tok.eos_token_id]
    assert pc_ids == head + tail and pc_roles == [0] * len(head) + [LAST] * len(tail)
    assert head[0] == tok.bos_token_id

    # conversational prompt/completion: one chat, only the completion's assistant turns trained
    conv = write_jsonl(tmp_path / "conv.jsonl", [{"prompt": CHATS[2][:5], "completion": CHATS[2][5:]}])
    (ids2, roles2), = documents(open_chat(conv, folder, pack=False))
    assert ids2 == ids
    assert [r >= ASSISTANT for r in roles2] == [r == LAST for r in roles]


# ------------------------------------------------------------------------------- packing, masks, truncation, loss

def small_model():
    torch.manual_seed(0)
    return build_model(ModelArgs.from_hf_config({**preset_config("tiny-dense"), "vocab_size": VOCAB}), "cpu",
                       torch.float32)


def test_assistant_only_loss_is_the_hand_computed_masked_cross_entropy(folders, tmp_path):
    """The packed, document-masked micro-batch's loss (what the loop computes: summed token loss over the trained
    tokens) equals the mean over assistant targets of -log p, computed by running each conversation alone and
    picking its assistant tokens by the template's structure."""
    folder = folders["deepseek_v3"]
    rows = [{"messages": c} for c in CHATS]
    ds = open_chat(write_jsonl(tmp_path / "c.jsonl", rows), folder, seq_len=255)
    assert ds.num_sequences == 1 and ds.has_positions  # the three conversations packed into one window
    (inputs, labels, positions), = DataLoader(ds, global_batch_size=1, micro_batch_size=1, dp_rank=0,
                                              dp_size=1).next_step()
    model = small_model()
    with torch.no_grad():
        got = F.cross_entropy(model(inputs, positions_BT=positions)[0], labels[0], reduction="sum") / \
            (labels != IGNORE_INDEX).sum()
    tok = load_text_tokenizer(folder)
    assistant, eos = tok.tok.token_to_id("<｜Assistant｜>"), tok.eos_token_id
    nll, n = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor(tok.apply_chat_template(row["messages"], add_generation_prompt=False, tokenize=True))
            logp = model(ids[None, :-1])[0].log_softmax(-1)
            inside = False
            for t in range(len(ids) - 1):  # token t + 1 is a target iff it is in an assistant turn
                inside = (inside and ids[t] != eos) or ids[t] == assistant
                if inside:
                    nll -= logp[t, ids[t + 1]].item()
                    n += 1
    assert n == int((labels != IGNORE_INDEX).sum())
    assert abs(got.item() - nll / n) <= 1e-5 * nll / n


def test_next_fit_packing_padding_and_positions(folders, tmp_path):
    folder = folders["deepseek_v3"]
    rows = [{"messages": c} for c in CHATS] * 3
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    docs = documents(open_chat(path, folder, pack=False))
    lengths = [len(ids) for ids, _ in docs]
    W = max(lengths) + 10
    ds = open_chat(path, folder, seq_len=W - 1)
    # next-fit by hand: conversations in order, a new window when the next one does not fit
    windows, fill = [[]], 0
    for i, n in enumerate(lengths):
        if fill + n > W:
            windows.append([])
            fill = 0
        windows[-1].append(i)
        fill += n
    assert ds.num_sequences == len(windows) > 1
    counted = ds._segment_trained(ds.seg_off, ds.seg_len)  # read in chunks of the corpus: any chunk size agrees
    assert counted.sum() > 0 and np.array_equal(counted, ds._segment_trained(ds.seg_off, ds.seg_len, chunk=7))
    for k, members in enumerate(windows):
        tokens, trained, positions = ds.window(k)
        expect = [t for i in members for t in docs[i][0]]
        assert tokens[:len(expect)].tolist() == expect and len(tokens) == W
        assert positions.tolist() == [p for i in members for p in range(lengths[i])] + list(range(W - len(expect)))
        assert not trained[len(expect):].any()  # padding
        assert not trained[positions == 0].any()  # no document's first token
    # --pack false: one conversation per row; --doc-mask false: packed windows without positions
    padded = open_chat(path, folder, seq_len=W - 1, pack=False)
    assert padded.num_sequences == len(rows) and padded.window(0)[2] is None and not padded.has_positions
    assert open_chat(path, folder, seq_len=W - 1, doc_mask="false").window(0)[2] is None


def test_overlong_conversations_truncated_or_dropped_and_counted(folders, tmp_path):
    folder = folders["deepseek_v3"]
    rows = [{"messages": c} for c in CHATS] + [{"messages": [{"role": "user", "content": "no answer"}]}]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    lengths = [len(ids) for ids, _ in documents(open_chat(path, folder, pack=False, loss_on="all"))]
    W = max(lengths) - 1
    n_long = sum(n > W for n in lengths)
    ds = open_chat(path, folder, seq_len=W - 1)
    assert f"{n_long} longer than {W} tokens truncated to their first {W}" in ds.summary
    assert "1 dropped with no trained token (--loss-on assistant)" in ds.summary  # the user-only chat
    assert sorted(ds.seg_len.tolist()) == sorted(min(n, W) for n in lengths[:3])
    dropped = open_chat(path, folder, seq_len=W - 1, overlong="drop")
    assert f"{n_long} longer than {W} tokens dropped" in dropped.summary
    assert sorted(dropped.seg_len.tolist()) == sorted(n for n in lengths[:3] if n <= W)
    # a conversation whose assistant turns all lie past the cut is dropped, not trained on its prompt
    long_prompt = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]
    ds = open_chat(write_jsonl(tmp_path / "l.jsonl", [rows[1], {"messages": long_prompt}]), folder, seq_len=63)
    assert "1 dropped with no trained token" in ds.summary


def test_text_document_masking_and_padding(tmp_path):
    from test_data import EOS as TEXT_EOS, documents as texts, stream, txt_folder

    docs = texts(5, words=12)
    folder = txt_folder(tmp_path / "t", docs)
    expect = stream(docs)
    plain = open_dataset(str(folder), seq_len=31, vocab_size=2048)
    assert plain.window(0)[1] is None and plain.window(0)[2] is None  # today's windows
    masked = open_dataset(str(folder), seq_len=31, vocab_size=2048, doc_mask="true")
    for i in range(masked.num_sequences):
        tokens, trained, positions = masked.window(i)
        assert tokens.tolist() == expect[i * 32:(i + 1) * 32]
        for j in range(1, 32):  # a document starts after each eos: positions restart, its first token untrained
            assert positions[j] == (0 if tokens[j - 1] == TEXT_EOS else positions[j - 1] + 1)
        assert trained.tolist() == (positions != 0).tolist()
    padded = open_dataset(str(folder), seq_len=15, vocab_size=2048, pack=False)
    pieces = [d[k:k + 16] for d in (stream([t]) for t in docs) for k in range(0, len(d), 16)]  # ids + eos
    pieces = [p for p in pieces if len(p) > 1]
    assert padded.num_sequences == len(pieces)
    for i, p in enumerate(pieces):
        tokens, trained, _ = padded.window(i)
        assert tokens[:len(p)].tolist() == p and trained.tolist() == [False] + [True] * (len(p) - 1) + \
            [False] * (16 - len(p))


# ------------------------------------------------------------------------------------------ loaders and eval split

def test_eval_split_is_deterministic_and_disjoint(folders, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS] * 10)
    ds = open_chat(path, folders["deepseek_v3"], pack=False)
    train, held = split_eval(ds, 0.1, seed=0)
    assert held.num_sequences == 3 and train.num_sequences == 27
    assert sorted(train.indices + held.indices) == list(range(30))
    assert split_eval(ds, 0.1, seed=0)[1].indices == held.indices != split_eval(ds, 0.1, seed=1)[1].indices
    assert torch.equal(held.window(0)[0], ds.window(held.indices[0])[0])
    with pytest.raises(UserError, match="leaves none to train on"):
        split_eval(ds, 0.99, seed=0)


@pytest.mark.parametrize("dp,m", [(1, 1), (2, 2), (3, 1)])
def test_eval_loader_shares_add_up_to_the_whole_set(dp, m, folders, tmp_path):
    ds = open_chat(write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS] * 3), folders["deepseek_v3"],
                   seq_len=127)
    whole = [mb for mb in EvalLoader(ds, micro_batch_size=1, dp_rank=0, dp_size=1).batches()]
    ranks = [EvalLoader(ds, micro_batch_size=m, dp_rank=r, dp_size=dp, multiple=2).batches() for r in range(dp)]
    assert len({len(b) for b in ranks}) == 1 and len(ranks[0]) % 2 == 0  # the same number of forwards everywhere
    labels = torch.cat([mb[1] for b in ranks for mb in b])
    real = labels[(labels != IGNORE_INDEX).any(1)]
    assert torch.equal(real, torch.cat([mb[1] for mb in whole]))


def test_train_loader_layouts_agree_with_positions(folders, tmp_path):
    ds = open_chat(write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS] * 4), folders["deepseek_v3"],
                   seq_len=127)
    one = DataLoader(ds, global_batch_size=4, micro_batch_size=4, dp_rank=0, dp_size=1).next_step()
    two = [mb for r in range(2) for mb in DataLoader(ds, global_batch_size=4, micro_batch_size=1, dp_rank=r,
                                                     dp_size=2).next_step()]
    assert all(len(mb) == 3 for mb in one + two)
    for k in range(3):
        assert torch.equal(one[0][k], torch.cat([mb[k] for mb in two]))


# ---------------------------------------------------------------------------------------------------- bad input

def one_line(match, fn, *args, **kwargs):
    with pytest.raises(UserError, match=match) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)


def test_bad_chat_input(folders, tmp_path):
    v3 = folders["deepseek_v3"]
    bad = write_jsonl(tmp_path / "b.jsonl", [{"messages": CHATS[1]}, {"text": "a document"}])
    one_line(rf'{bad}:2: no "messages" field', open_chat, bad, v3)
    bad.write_text(json.dumps({"messages": CHATS[1]}) + "\n" + json.dumps({"messages": "hi"}) + "\n")
    one_line(rf'{bad}:2: "messages" must be a non-empty list', open_chat, bad, v3)
    bad.write_text(json.dumps({"prompt": "a", "completion": ["b"]}) + "\n")
    one_line(r":1: \"prompt\" and \"completion\" must both be strings", open_chat, bad, v3)
    r1 = write_jsonl(tmp_path / "r1.jsonl", [{"messages": [CHATS[1][0], {"role": "assistant",
                                                                         "content": "<think>\nhm\n</think>\n\nHi"}]}])
    one_line(rf"{r1}:1: the chat template .* trims or rewrites", open_chat, r1, folders["deepseek_r1_distill_qwen"])
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_jsonl(mixed / "a.jsonl", [{"messages": CHATS[1]}])
    (mixed / "b.txt").write_text("plain text")
    one_line("holds chat rows but .* holds text", open_chat, mixed, v3)
    no_template = make_folder(tmp_path / "nt", "deepseek_v3", with_template=False)
    one_line("has no chat template.*--chat-template", open_chat, write_jsonl(tmp_path / "c.jsonl", [
        {"messages": CHATS[1]}]), no_template)
    one_line("has 2,064 tokens but the model's vocab_size is 2,048", open_dataset, str(tmp_path / "c.jsonl"),
             seq_len=63, vocab_size=2048, tokenizer=str(v3))
    one_line("synthetic is random tokens without documents", open_dataset, "synthetic", seq_len=8, vocab_size=64,
             doc_mask="true")


def test_chat_cache_is_reused(folders, tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS])
    first = open_chat(path, folders["deepseek_v3"])
    monkeypatch.setattr(token_cache, "render_into", lambda *a: (_ for _ in ()).throw(AssertionError("rendered again")))
    again = open_chat(path, folders["deepseek_v3"], seq_len=63, loss_on="all")  # other layouts, same cache
    assert np.array_equal(first.tokens, again.tokens)


def test_train_flags_resolve_doc_mask_and_refuse_contradictions(folders, tmp_path):
    from paraseek.train.config import TrainConfig, resolve_defaults
    from paraseek.train.validate import validate

    chat = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS])
    # The bundled tokenizer: it fits tiny-moe's 2,048-token vocabulary (validate refuses the templates' 2,064).
    base = dict(nproc=1, seq_len=64, global_batch_size=8, data=str(chat))

    def cfg(**changes):
        return resolve_defaults(TrainConfig(**{**base, **changes}), False, 0)

    assert cfg().doc_mask == "true" and cfg(pack=False).doc_mask == "false"
    assert cfg(data="synthetic").doc_mask == "false" and cfg().to_plan().document_mask
    validate(cfg(eval_split=0.1, eval_every=5), False, 0)
    for changes, message in [({"pack": False, "doc_mask": "true"}, "each row holds one document already"),
                             ({"eval_data": str(chat), "eval_split": 0.1}, "not both"),
                             ({"eval_split": 1.5}, r"a fraction in \[0, 1\)"),
                             ({"eval_every": 10}, "--eval-every needs evaluation data"),
                             ({"eval_data": "synthetic"}, "no end to evaluate over"),
                             ({"eval_data": str(tmp_path / "nope")}, "no such file or folder"),
                             ({"chat_template": str(tmp_path / "nope.jinja")}, "--chat-template .*: no such file")]:
        one_line(message, validate, cfg(**changes), False, 0)


@pytest.mark.parametrize("damage, why", [
    (lambda c: (c / "meta.json").unlink(), "meta.json: No such file or directory"),
    (lambda c: (c / "meta.json").write_text("{"), "Expecting property name"),
    (lambda c: (c / "roles.u8").write_bytes((c / "roles.u8").read_bytes()[:-3]), "do not agree"),
    (lambda c: (c / "docs.i64").write_bytes((c / "docs.i64").read_bytes()[:-8]), "do not agree"),
    (lambda c: (c / "tokens.u32").write_bytes((c / "tokens.u32").read_bytes()[:-2]), "do not agree"),
])
def test_a_damaged_chat_cache_is_one_line_naming_it(folders, tmp_path, damage, why):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS])
    first = open_chat(path, folders["deepseek_v3"])
    [cached] = (tmp_path / "cache" / "tokens").glob("*.chat")
    assert (cached / "docs.i64").stat().st_size == 8 * (len(CHATS) + 1) and len(first.tokens) > 0
    damage(cached)
    one_line(rf"^the token cache {cached} is damaged \(.*{why}.*\): delete it", open_chat, path, folders["deepseek_v3"])
