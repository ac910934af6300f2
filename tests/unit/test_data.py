"""The training data pipeline: formats, the cache, the dp layout rule, resume, epochs, and every user error.

References are computed another way: token streams straight from `tokenizers` on the same documents, step contents
from the layout rule written out by hand (positions [s*B, (s+1)*B), rank slices, micro-batches)."""

import gzip
import json
import random
import re
import sys
import threading
import time

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from paraseek.errors import UserError
from paraseek.models.tokenizer import BUNDLED_TOKENIZER, load_text_tokenizer
from paraseek.train import token_cache
from paraseek.train.corpus import BUNDLED_CORPUS
from paraseek.train.dataset import open_dataset
from paraseek.train.loader import DataLoader

WORDS = "the devil a dictionary of wit and wisdom in which every word is defined by its worst use".split()
TOK = Tokenizer.from_file(str(BUNDLED_TOKENIZER))
EOS = TOK.token_to_id("<|eos|>")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test gets its own empty token cache."""
    monkeypatch.setenv("PARASEEK_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def documents(n: int, words: int = 60, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Document {i}. " + " ".join(rng.choice(WORDS) for _ in range(words)) + "\n" for i in range(n)]


def stream(docs: list[str]) -> list[int]:
    """What the pipeline must produce: each document's ids followed by eos."""
    return [t for d in docs for t in TOK.encode(d, add_special_tokens=False).ids + [EOS]]


def txt_folder(path, docs):
    path.mkdir()
    for i, d in enumerate(docs):
        (path / f"doc{i:03d}.txt").write_text(d)
    return path


def open_(path, seq_len=16, vocab_size=2048, tokenizer=None, seed=0):
    return open_dataset(str(path), seq_len=seq_len, vocab_size=vocab_size, tokenizer=tokenizer, seed=seed)


def steps(ds, n, *, gbs=8, mbs=1, dp=1, position=0):
    """n steps, each the concatenation over ranks (in rank order) of their micro-batches: [B, L] inputs, labels."""
    loaders = [DataLoader(ds, global_batch_size=gbs, micro_batch_size=mbs, dp_rank=r, dp_size=dp, position=position)
               for r in range(dp)]
    out = []
    for _ in range(n):
        mbs_ = [mb for dl in loaders for mb in dl.next_step()]
        out.append((torch.cat([x for x, _ in mbs_]), torch.cat([y for _, y in mbs_])))
    return out


# ---------------------------------------------------------------- formats


def test_txt_folder_is_one_document_per_file_in_sorted_order(tmp_path):
    docs = documents(12)
    folder = txt_folder(tmp_path / "corpus", docs)
    (folder / "README.md").write_text("not part of the corpus")
    (folder / "sub").mkdir()
    (folder / "sub" / "zz.txt").write_text(docs[0])  # recursive, and "sub/zz.txt" sorts after "doc*.txt"
    ds = open_(folder)
    expect = stream(docs + [docs[0]])
    w = ds.seq_len + 1
    assert ds.num_tokens == len(expect) and ds.num_sequences == len(expect) // w  # remainder dropped
    assert np.array_equal(np.asarray(ds.tokens), expect)
    for i in (0, 3, ds.num_sequences - 1):  # non-overlapping consecutive windows
        assert ds.sequence(i).tolist() == expect[i * w:(i + 1) * w]
    assert ds.sequence(0).dtype == torch.int64 and ds.sequence(0).shape == (w,)


def test_jsonl_gives_the_same_stream_as_txt(tmp_path):
    docs = documents(10)
    f = tmp_path / "c.jsonl"
    lines = [json.dumps({"text": d, "id": i}) + "\n" + ("\n" if i == 3 else "") for i, d in enumerate(docs)]  # a blank
    f.write_text("".join(lines))
    assert np.array_equal(np.asarray(open_(f).tokens), stream(docs))


def test_parquet_gives_the_same_stream_as_txt(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is optional; .parquet support is tested where it is installed")
    import pyarrow.parquet as pq

    docs = documents(10)
    pq.write_table(pa.table({"text": docs, "n": list(range(10))}), tmp_path / "c.parquet", row_group_size=4)
    assert np.array_equal(np.asarray(open_(tmp_path / "c.parquet").tokens), stream(docs))


def test_bundled_assets():
    assert TOK.get_vocab_size() == 2048  # exactly the tiny models' vocab_size
    assert (TOK.token_to_id("<|bos|>"), EOS) == (0, 1)
    ds = open_(BUNDLED_CORPUS, seq_len=128)
    assert ds.num_sequences > 1000 and int(np.max(ds.tokens)) < 2048
    assert sum(1 for f in BUNDLED_CORPUS.glob("*.txt")) == int(np.sum(np.asarray(ds.tokens) == EOS))


def test_synthetic_is_deterministic_per_index_and_in_range():
    a = open_dataset("synthetic", seq_len=32, vocab_size=100, tokenizer=None, seed=3)
    b = open_dataset("synthetic", seq_len=32, vocab_size=100, tokenizer=None, seed=3)
    assert a.num_sequences is None
    assert torch.equal(a.sequence(7), b.sequence(7)) and not torch.equal(a.sequence(7), a.sequence(8))
    assert a.sequence(7).shape == (33,) and 0 <= a.sequence(7).min() and a.sequence(7).max() < 100
    c = open_dataset("synthetic", seq_len=32, vocab_size=100, tokenizer=None, seed=4)
    assert not torch.equal(a.sequence(7), c.sequence(7))


# ---------------------------------------------------------------- the layout rule


@pytest.mark.parametrize("source", ["txt", "synthetic"])
def test_dp_split_union_equals_single_process_step(tmp_path, source):
    if source == "synthetic":
        ds = open_dataset("synthetic", seq_len=16, vocab_size=2048, tokenizer=None, seed=0)
    else:
        ds = open_(txt_folder(tmp_path / "c", documents(6)))
        assert ds.num_sequences < 5 * 8  # the 5 steps below cross at least one epoch boundary
    single = steps(ds, 5, gbs=8, mbs=1, dp=1)
    for dp, mbs in [(1, 8), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2)]:
        got = steps(ds, 5, gbs=8, mbs=mbs, dp=dp)
        for (x1, y1), (x, y) in zip(single, got):
            assert torch.equal(x1, x) and torch.equal(y1, y), (dp, mbs)


def test_rank_slices_and_micro_batches_by_hand():
    ds = open_dataset("synthetic", seq_len=8, vocab_size=2048, tokenizer=None, seed=0)
    dl = DataLoader(ds, global_batch_size=12, micro_batch_size=2, dp_rank=2, dp_size=3, position=24)  # step 2
    mbs = dl.next_step()
    assert len(mbs) == 2 and all(x.shape == (2, 8) and y.shape == (2, 8) for x, y in mbs)
    # rank 2 of 3 at step 2: positions 24 + [8, 12) = 32..35, synthetic position p is sequence p
    for k, (x, y) in enumerate(mbs):
        for j in range(2):
            seq = ds.sequence(32 + 2 * k + j)
            assert torch.equal(x[j], seq[:-1]) and torch.equal(y[j], seq[1:])
    assert dl.state_dict() == {"position": 36}


def test_epochs_cover_every_window_once_in_a_different_order(tmp_path):
    ds = open_(txt_folder(tmp_path / "c", documents(8)))
    n = ds.num_sequences
    dl = DataLoader(ds, global_batch_size=1, micro_batch_size=1, dp_rank=0, dp_size=1)
    windows = {tuple(ds.sequence(i).tolist()): i for i in range(n)}
    order = []
    for _ in range(2 * n):
        (x, y), = dl.next_step()
        order.append(windows[tuple(x[0].tolist()) + (y[0, -1].item(),)])
    first, second = order[:n], order[n:]
    assert sorted(first) == sorted(second) == list(range(n))
    assert first != second and first != list(range(n))


def test_runs_are_deterministic_and_seed_changes_the_order(tmp_path, cache, monkeypatch):
    folder = txt_folder(tmp_path / "c", documents(8))
    a = steps(open_(folder), 3)
    monkeypatch.setenv("PARASEEK_CACHE", str(cache / "other"))  # retokenize from scratch
    b = steps(open_(folder), 3)
    c = steps(open_(folder, seed=1), 3)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))
    assert not torch.equal(a[0][0], c[0][0])


def test_resume_from_state_dict_continues_even_with_another_dp_size(tmp_path):
    ds = open_(txt_folder(tmp_path / "c", documents(6)))
    full = steps(ds, 6, gbs=4, mbs=1, dp=1)
    dl = DataLoader(ds, global_batch_size=4, micro_batch_size=1, dp_rank=0, dp_size=1)
    for _ in range(2):
        dl.next_step()
    state = json.loads(json.dumps(dl.state_dict()))
    assert state == {"position": 8}
    loaders = [DataLoader(ds, global_batch_size=4, micro_batch_size=1, dp_rank=r, dp_size=2) for r in range(2)]
    for d in loaders:
        d.load_state_dict(state)
    for x_ref, _ in full[2:]:
        x = torch.cat([x for d in loaders for x, _ in d.next_step()])
        assert torch.equal(x, x_ref)


# ---------------------------------------------------------------- cache


def test_cache_is_reused_and_invalidated_by_a_changed_file(tmp_path, cache, monkeypatch):
    folder = txt_folder(tmp_path / "c", documents(5))
    first = np.asarray(open_(folder).tokens).copy()
    assert len(list((cache / "tokens").glob("*.u32"))) == 1

    def boom(*a, **k):
        raise AssertionError("retokenized")

    monkeypatch.setattr(token_cache, "tokenize_into", boom)
    assert np.array_equal(open_(folder, seq_len=4).tokens, first)  # another seq_len reuses the same stream
    (folder / "doc000.txt").write_text("Edited. " * 20)
    with pytest.raises(AssertionError, match="retokenized"):
        open_(folder)


def test_concurrent_opens_tokenize_once(tmp_path, monkeypatch):
    folder = txt_folder(tmp_path / "c", documents(20))
    calls = []
    real = token_cache.tokenize_into

    def slow(*a, **k):  # long enough that, without the lock, the other threads would also find no cache
        calls.append(1)
        time.sleep(0.2)
        real(*a, **k)

    monkeypatch.setattr(token_cache, "tokenize_into", slow)
    results = [None] * 4

    def run(i):
        results[i] = np.asarray(open_(folder).tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and all(np.array_equal(r, results[0]) for r in results)


# ---------------------------------------------------------------- user errors


def test_missing_data_path(tmp_path):
    with pytest.raises(UserError, match="no such file or folder"):
        open_(tmp_path / "nope")


def test_folder_without_supported_files(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.md").write_text("hello")
    with pytest.raises(UserError, match=r"holds no \.txt, \.jsonl, \.parquet files"):
        open_(tmp_path / "c")


def test_jsonl_line_without_text_names_file_and_line(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "oops"}) + "\n")
    with pytest.raises(UserError, match=rf'{f}:2: no "text" field'):
        open_(f)
    assert not list((tmp_path / "cache" / "tokens").glob("*.u32"))  # nothing half-written is cached


def test_corpus_too_small_says_how_many_tokens(tmp_path):
    f = tmp_path / "tiny.txt"
    f.write_text("Hi.")
    n = len(stream(["Hi."]))
    with pytest.raises(UserError, match=rf"has {n} tokens, one sequence of --seq-len 64 needs 65"):
        open_(f, seq_len=64)


def test_tokenizer_missing(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(UserError, match="no tokenizer file"):
        open_(tmp_path / "a.txt", tokenizer=str(tmp_path / "missing.json"))
    with pytest.raises(UserError, match="no tokenizer file"):
        open_(tmp_path / "a.txt", tokenizer=str(tmp_path))  # a folder without tokenizer.json


def test_documents_end_with_the_eos_every_command_resolves(tmp_path):
    """Text data ends each document with models/tokenizer.py's eos (the rule generate, serve, export and chat data
    use): the token a tokenizer_config.json names, added when the vocabulary lacks it, else a known name."""
    docs = documents(4)
    f = tmp_path / "c.txt"
    f.write_text(docs[0])
    folder = tmp_path / "tok"
    folder.mkdir()
    TOK.save(str(folder / "tokenizer.json"))
    assert np.asarray(open_(f, tokenizer=str(folder)).tokens)[-1] == EOS  # no config: the known name <|eos|>
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    named = load_text_tokenizer(folder)
    assert (named.eos_token_id, named.vocab_size) == (2048, 2049)  # added after the vocabulary
    ds = open_(f, tokenizer=str(folder), vocab_size=2049)
    assert np.asarray(ds.tokens).tolist() == TOK.encode(docs[0], add_special_tokens=False).ids + [2048]
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))  # named as none
    with pytest.raises(UserError, match="no end-of-document token"):
        open_(f, tokenizer=str(folder))


def test_tokenizer_larger_than_the_model_vocab(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(UserError, match=r"has 2,048 tokens but the model's vocab_size is 1,000.*at least 2,048"):
        open_(tmp_path / "a.txt", vocab_size=1000)


def test_parquet_without_pyarrow_names_the_fix(tmp_path, monkeypatch):
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow...` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(UserError, match="pip install pyarrow"):
        open_(tmp_path / "c.parquet")


@pytest.mark.parametrize("gbs,mbs,dp", [(10, 1, 4), (8, 3, 1), (6, 2, 2)])
def test_global_batch_not_divisible(gbs, mbs, dp):
    ds = open_dataset("synthetic", seq_len=8, vocab_size=2048, tokenizer=None, seed=0)
    with pytest.raises(UserError, match=rf"--global-batch-size {gbs} is not a multiple of dp size {dp} x "
                                        rf"--micro-batch-size {mbs} = {dp * mbs}"):
        DataLoader(ds, global_batch_size=gbs, micro_batch_size=mbs, dp_rank=0, dp_size=dp)


# ---------------------------------------------------------------- files that are not what their name says


def _parquet(path, texts):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts}), path)
    return path


@pytest.mark.parametrize("name, damage, message", [
    ("c.parquet", lambda p: p.write_text("text\nIn the beginning\n"), "c.parquet: not a readable parquet file"),
    ("c.parquet", lambda p: p.write_bytes(_parquet(p, documents(50)).read_bytes()[:300]),
     "c.parquet: not a readable parquet file"),
    ("c.txt", lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256))), "c.txt: not UTF-8 text (it holds NUL"),
    ("c.txt", lambda p: p.write_text("Hello, world.", encoding="utf-16"), "c.txt: not UTF-8 text (it holds NUL"),
    ("c.jsonl", lambda p: p.write_bytes(gzip.compress(b'{"text": "hi"}\n')), "c.jsonl:1: not UTF-8"),
    ("c.jsonl", lambda p: p.write_bytes(bytes(4096)), "c.jsonl:1: not valid JSON"),
])
def test_a_file_that_is_not_what_its_name_says_is_one_line_naming_it(tmp_path, cache, name, damage, message):
    folder = txt_folder(tmp_path / "corpus", documents(3))  # good shards beside the bad one
    damage(folder / name)
    with pytest.raises(UserError, match="^" + re.escape(f"{folder}/{message}")) as e:
        open_(folder)
    assert "\n" not in str(e.value)
    assert not list((cache / "tokens").glob("*.u32"))  # nothing half-made is cached


def test_a_damaged_token_cache_is_one_line_naming_it(tmp_path, cache):
    f = tmp_path / "a.txt"
    f.write_text(" ".join(documents(5)))
    ds = open_(f)
    [cached] = (cache / "tokens").glob("*.u32")
    assert cached.stat().st_size == 4 * ds.num_tokens
    cached.write_bytes(cached.read_bytes()[:-1])  # cut inside the last token id
    with pytest.raises(UserError, match=rf"^the token cache {cached} is damaged \({4 * ds.num_tokens - 1:,} bytes, "
                                        r"not a whole number of 4-byte token ids\): delete it"):
        open_(f)
    cached.unlink()
    assert open_(f).num_tokens == ds.num_tokens  # deleted, it is made again


def test_a_token_cache_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PARASEEK_CACHE", "/proc/paraseek-cache")  # /proc takes no new files, for root too
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(UserError, match=r"^the token cache /proc/paraseek-cache/tokens cannot be written"):
        open_(tmp_path / "a.txt")
