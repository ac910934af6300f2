"""Training windows: a corpus (train/corpus.py), tokenized through the cache (train/token_cache.py), as fixed
windows of seq_len + 1 tokens, each with which tokens are trained and, under a document mask, their positions.

What a window holds (W = seq_len + 1 tokens):
  text, --pack true (default)   the corpus' token stream (each document's ids, then eos) cut into consecutive
                                windows, as pre-training does; attention spans the documents of a window unless
                                --doc-mask true, which restarts positions after each eos (TorchTitan finds document
                                boundaries the same way) and masks attention to each document
  chat, --pack true (default)   whole conversations, next-fit in file order (a new window when the next one does not
                                fit), the rest padded; --doc-mask defaults to true for chat: positions restart and
                                attention stays inside each conversation. A conversation is never cut across windows
                                (its second half would lose the context its answers depend on): one longer than W
                                keeps its first W tokens (--overlong truncate) or is dropped (--overlong drop), and
                                one left with no trained token is dropped; both are counted in the data summary
  --pack false                  one conversation per row (text: one W-token piece of a document per row), padded
The labels are the window's tokens shifted by one; a label is ignored (models/loss.py IGNORE_INDEX) where the token is
not trained: padding, a document's first token (nothing in its document predicts it), and for chat the tokens
`--loss-on` leaves out (train/chat.py: roles). A micro-batch is (inputs [m, T], labels [m, T]), plus positions
[m, T] (each token's position in its document) when attention is masked per document.

Shapes (models/deepseek.py's letters): a window is W = T + 1 tokens (inputs [:-1], labels [1:]); one rank reads B =
global batch / dp of them per step, in micro-batches of m.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from paraseek.errors import UserError
from paraseek.models.tokenizer import BUNDLED_TOKENIZER, load_text_tokenizer
from paraseek.seeding import derive_seed
from paraseek.train.chat import ASSISTANT, LAST
from paraseek.train.corpus import data_kind, list_files
from paraseek.train.token_cache import cached_chat, cached_tokens, document_end


class Dataset:
    """Fixed windows of seq_len + 1 tokens: cut from a cached token stream, or random tokens (data="synthetic").
    `doc_mask`: positions restart after each eos and attention stays inside each document."""

    def __init__(self, *, seq_len: int, vocab_size: int, seed: int, tokens: np.ndarray | None = None,
                 source: str = "synthetic", eos_id: int | None = None, tokenizer_vocab: int | None = None,
                 doc_mask: bool = False):
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed
        self.tokens, self.source, self.eos_id = tokens, source, eos_id
        self.tokenizer_vocab = tokenizer_vocab  # the tokenizer's size, with added tokens (None: synthetic)
        # the remainder after the last full window is dropped
        self.num_sequences: int | None = None if tokens is None else len(tokens) // (seq_len + 1)
        self.has_positions = doc_mask
        self.every_label_counts = not doc_mask  # the loss normalizer is then known without counting
        self.summary = "" if tokens is None else (
            f"{source}: {len(tokens):,} tokens -> {self.num_sequences:,} windows of {seq_len + 1:,} tokens (the "
            f"stream cut into windows; " + ("attention masked to each document, positions restarting after each "
                                            "eos)" if doc_mask else "attention across the documents of a window)"))

    @property
    def num_tokens(self) -> int | None:
        return None if self.tokens is None else len(self.tokens)

    def sequence(self, index: int) -> torch.Tensor:
        """Window `index` as int64 [W] (W = T + 1: seq_len + 1 tokens)."""
        if self.tokens is None:
            g = torch.Generator().manual_seed(derive_seed(self.seed, "synthetic", index))
            return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=g)
        if not 0 <= index < self.num_sequences:
            raise IndexError(f"sequence {index} of {self.num_sequences}")
        w = self.seq_len + 1
        return torch.from_numpy(self.tokens[index * w:(index + 1) * w].astype(np.int64))

    def window(self, index: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(tokens [W], which are trained (None: all), positions [W] (None: 0..W-1))."""
        tokens_W = self.sequence(index)
        if not self.has_positions:
            return tokens_W, None, None
        t_W = torch.arange(len(tokens_W))
        starts_W = torch.zeros(len(tokens_W), dtype=torch.bool)
        starts_W[1:] = tokens_W[:-1] == self.eos_id  # a document starts after each eos
        last_start_W = torch.where(starts_W, t_W, 0).cummax(0).values
        positions_W = t_W - last_start_W
        return tokens_W, positions_W != 0, positions_W


class PackedDataset:
    """Windows of whole documents (the module docstring's chat and --pack false rows), built once at open from the
    tokenized documents: a table of segments (token offset, length), window i holding segments
    win_start[i]:win_start[i+1], padded with `pad_id` to W tokens."""

    def __init__(self, *, seq_len: int, vocab_size: int, seed: int, tokens: np.ndarray, starts: np.ndarray,
                 roles: np.ndarray | None, source: str, pad_id: int, pack: bool, doc_mask: bool,
                 loss_on: str = "all", overlong: str = "truncate", meta: dict | None = None,
                 tokenizer_vocab: int | None = None):
        self.seq_len, self.vocab_size, self.seed, self.source = seq_len, vocab_size, seed, source
        self.tokenizer_vocab = tokenizer_vocab  # the tokenizer's size, with added tokens
        self.tokens, self.roles, self.pad_id, self.loss_on = tokens, roles, pad_id, loss_on
        self.has_positions, self.every_label_counts = doc_mask, False
        W = seq_len + 1
        off, n = starts[:-1].astype(np.int64), np.diff(starts).astype(np.int64)
        n_docs, notes = len(n), []
        if roles is None:  # text, one row per piece: every W-token piece of every document
            pieces = -(-n // W)
            doc = np.repeat(np.arange(len(n)), pieces)
            k = np.arange(len(doc)) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # the piece's index in its doc
            off, n = off[doc] + k * W, np.minimum(W, n[doc] - k * W)
            keep = n > 1  # a 1-token piece predicts nothing
            if (~keep).any():
                notes.append(f"{int((~keep).sum()):,} one-token pieces dropped")
        else:
            long_ = n > W
            keep = ~long_ if overlong == "drop" else np.ones(len(n), dtype=bool)
            n = np.minimum(n, W)
            useful = self._segment_trained(off, n) > 0  # what a (truncated) conversation keeps
            if long_.any():
                notes.append(f"{int(long_.sum()):,} longer than {W:,} tokens " +
                             ("dropped" if overlong == "drop" else f"truncated to their first {W:,}"))
            if (keep & ~useful).any():
                notes.append(f"{int((keep & ~useful).sum()):,} dropped with no trained token (--loss-on {loss_on})")
            keep &= useful
        self.seg_off, self.seg_len = off[keep], n[keep]
        if len(self.seg_len) == 0:
            raise UserError(f"{source}: no document is left to train on ({'; '.join(notes) or 'empty'})")
        self.win_start = _next_fit(self.seg_len, W) if pack else np.arange(len(self.seg_len) + 1)
        self.num_sequences = len(self.win_start) - 1
        n_trained = int(self._segment_trained(self.seg_off, self.seg_len).sum())
        padding = 1 - self.seg_len.sum() / (self.num_sequences * W)
        what = (f"{meta['rows']:,} conversations" if meta else f"{n_docs:,} documents")
        layout = ((f"packed, attention {'masked to each document' if doc_mask else 'across the documents of a window'}")
                  if pack else "one per row")
        if meta and meta.get("unlocated"):
            notes.append(f"{meta['unlocated']:,} assistant tool-call turns not trained (content null: the template "
                         f"has no {{% generation %}} tags to locate them by)")
        self.summary = (f"{source}: {what}, {len(tokens):,} tokens -> {self.num_sequences:,} windows of {W:,} tokens "
                        f"({layout}, {padding:.1%} padding); loss on {'every token' if roles is None else loss_on} "
                        f"({n_trained:,} trained tokens){''.join('; ' + x for x in notes)}")

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def _trained(self, a: int, b: int) -> np.ndarray:
        """Which of tokens[a:b] --loss-on trains (every token of text)."""
        if self.roles is None or self.loss_on == "all":
            return np.ones(b - a, dtype=bool)
        roles = np.asarray(self.roles[a:b])
        return roles == LAST if self.loss_on == "last-turn" else roles >= ASSISTANT

    def _segment_trained(self, off: np.ndarray, n: np.ndarray, chunk: int = 1 << 24) -> np.ndarray:
        """Trained tokens of each segment tokens[off:off + n] but its first (nothing in its document predicts it),
        for segments in corpus order; the roles are read `chunk` tokens at a time (a cumulative count over the whole
        corpus would hold 9 bytes per token)."""
        if self.roles is None:
            return np.maximum(n - 1, 0)
        out = np.zeros(len(off), dtype=np.int64)
        i = 0
        while i < len(off):
            j = max(i + 1, int(np.searchsorted(off, off[i] + chunk)))
            a, b = int(off[i]), int((off[i:j] + n[i:j]).max())
            counts = np.concatenate([[0], np.cumsum(self._trained(a, b), dtype=np.int64)])
            out[i:j] = np.maximum(counts[off[i:j] - a + n[i:j]] - counts[np.minimum(off[i:j] - a + 1, b - a)], 0)
            i = j
        return out

    def window(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if not 0 <= index < self.num_sequences:
            raise IndexError(f"window {index} of {self.num_sequences}")
        W = self.seq_len + 1
        segs = range(int(self.win_start[index]), int(self.win_start[index + 1]))
        pieces = [(int(self.seg_off[s]), int(self.seg_len[s])) for s in segs]
        used = sum(n for _, n in pieces)
        tokens_W = np.full(W, self.pad_id, dtype=np.int64)
        trained_W = np.zeros(W, dtype=bool)
        positions_W = np.arange(W) - used  # the padding: a document of its own
        at = 0
        for a, n in pieces:
            tokens_W[at:at + n] = self.tokens[a:a + n]
            trained_W[at + 1:at + n] = self._trained(a + 1, a + n)  # a document's first token predicts nothing
            positions_W[at:at + n] = np.arange(n)
            at += n
        positions = torch.from_numpy(positions_W) if self.has_positions else None
        return torch.from_numpy(tokens_W), torch.from_numpy(trained_W), positions

    def sequence(self, index: int) -> torch.Tensor:
        return self.window(index)[0]


def _next_fit(lengths: np.ndarray, W: int) -> np.ndarray:
    """Window boundaries over segments taken in order: a segment that does not fit the current window starts a new
    one (next-fit: order kept, deterministic, at most one window in flight)."""
    bounds, fill = [0], 0
    for i, n in enumerate(lengths.tolist()):
        if fill + n > W:
            bounds.append(i)
            fill = 0
        fill += n
    bounds.append(len(lengths))
    return np.asarray(bounds, dtype=np.int64)


class Subset:
    """The windows `indices` of a dataset (an --eval-split carve-out, or the rest for training), in that order."""

    def __init__(self, dataset, indices):
        self.dataset, self.indices = dataset, [int(i) for i in indices]
        self.num_sequences, self.seed = len(self.indices), dataset.seed
        self.seq_len, self.has_positions = dataset.seq_len, dataset.has_positions
        self.every_label_counts = dataset.every_label_counts

    def window(self, index: int):
        return self.dataset.window(self.indices[index])

    def sequence(self, index: int) -> torch.Tensor:
        return self.window(index)[0]


def split_eval(dataset, fraction: float, seed: int) -> tuple[Subset, Subset]:
    """(train, eval): round(fraction x windows) windows (at least one), picked by a permutation seeded by (seed,
    "eval-split") before any epoch shuffle, so every layout and every resume holds out the same ones. A chat window
    holds whole conversations, so a held-out conversation is never trained on; a text document cut across a held-out
    window's edge is partly on both sides."""
    n = dataset.num_sequences
    if n is None:
        raise UserError("--eval-split carves windows out of a corpus; synthetic data has none (give --eval-data, "
                        "or --data FILES)")
    k = max(1, round(fraction * n))
    if k >= n:
        raise UserError(f"--eval-split {fraction}: holding out {k:,} of {n:,} windows leaves none to train on")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(seed, "eval-split"))).tolist()
    return Subset(dataset, sorted(perm[k:])), Subset(dataset, sorted(perm[:k]))


def open_training_data(cfg, vocab_size: int) -> tuple:
    """(training data, evaluation data or None) of a TrainConfig: --data with its packing flags, and --eval-data
    (read with the same tokenizer and rules) or the --eval-split windows carved out of --data."""
    opts = dict(seq_len=cfg.seq_len, vocab_size=vocab_size, tokenizer=cfg.tokenizer or None, seed=cfg.seed,
                pack=cfg.pack, doc_mask=cfg.doc_mask, loss_on=cfg.loss_on, overlong=cfg.overlong,
                chat_template=cfg.chat_template or None)
    train = open_dataset(cfg.data, **opts)
    if cfg.eval_data:
        return train, open_dataset(cfg.eval_data, **opts)
    if cfg.eval_split > 0:
        return split_eval(train, cfg.eval_split, cfg.seed)
    return train, None


def open_dataset(data: str, *, seq_len: int, vocab_size: int, tokenizer: str | None = None, seed: int = 0,
                 pack: bool = True, doc_mask: str = "auto", loss_on: str = "assistant", overlong: str = "truncate",
                 chat_template: str | None = None):
    """`data` is "synthetic", a .txt (one document per file), .jsonl (a "text", "messages" or "prompt" +
    "completion" field per line) or .parquet (the same columns) file, or a folder of them (searched recursively, read
    in sorted order); one kind of rows per corpus. `tokenizer` is an HF tokenizer.json or a folder holding one (a
    chat corpus needs the folder's chat template, or `chat_template`, a Jinja file); None or "" = the bundled one.
    `pack`, `doc_mask` (auto: on for chat, off for text), `loss_on` and `overlong`: the module docstring."""
    assert seq_len > 0 and vocab_size > 0, (seq_len, vocab_size)
    if data == "synthetic":
        if doc_mask == "true" or not pack:
            raise UserError("--data synthetic is random tokens without documents: --doc-mask true and --pack false "
                            "need a corpus")
        return Dataset(seq_len=seq_len, vocab_size=vocab_size, seed=seed)
    files = list_files(data)
    if data_kind(files) == "chat":
        return _open_chat(files, str(data), seq_len=seq_len, vocab_size=vocab_size, tokenizer=tokenizer, seed=seed,
                          pack=pack, doc_mask=doc_mask != "false", loss_on=loss_on, overlong=overlong,
                          chat_template=chat_template)
    tok = load_text_tokenizer(tokenizer or BUNDLED_TOKENIZER)
    n_vocab = tok.vocab_size
    _check_vocab(n_vocab, tok.file, vocab_size)
    eos = document_end(tok)
    tokens = cached_tokens(files, tok, eos)
    if not pack:
        starts = np.concatenate([[0], np.flatnonzero(np.asarray(tokens) == eos) + 1])
        return PackedDataset(seq_len=seq_len, vocab_size=vocab_size, seed=seed, tokens=tokens, starts=starts,
                             roles=None, source=str(data), pad_id=eos, pack=False, doc_mask=False,
                             tokenizer_vocab=n_vocab)
    if len(tokens) < seq_len + 1:
        raise UserError(f"{data}: the corpus has {len(tokens):,} tokens, one sequence of --seq-len {seq_len} needs "
                        f"{seq_len + 1:,}; add text or lower --seq-len")
    return Dataset(seq_len=seq_len, vocab_size=vocab_size, seed=seed, tokens=tokens, source=str(data), eos_id=eos,
                   tokenizer_vocab=n_vocab, doc_mask=doc_mask == "true")


def _check_vocab(n_vocab: int, tok_file, vocab_size: int) -> None:
    if n_vocab > vocab_size:
        raise UserError(f"tokenizer {tok_file} has {n_vocab:,} tokens but the model's vocab_size is {vocab_size:,}: "
                        f"use a model whose vocab_size is at least {n_vocab:,}, or a smaller tokenizer")


def _open_chat(files: list[Path], source: str, *, seq_len: int, vocab_size: int, tokenizer: str | None, seed: int,
               pack: bool, doc_mask: bool, loss_on: str, overlong: str, chat_template: str | None) -> PackedDataset:
    tok = load_text_tokenizer(tokenizer or BUNDLED_TOKENIZER, chat_template or None)
    _check_vocab(tok.vocab_size, tok.name, vocab_size)
    tokens, roles, starts, meta = cached_chat(files, tok)
    pad = tok.eos_token_id if tok.eos_token_id is not None else 0
    return PackedDataset(seq_len=seq_len, vocab_size=vocab_size, seed=seed, tokens=tokens, starts=starts,
                         roles=roles, source=source, pad_id=pad, pack=pack, doc_mask=doc_mask and pack,
                         loss_on=loss_on, overlong=overlong, meta=meta, tokenizer_vocab=tok.vocab_size)
