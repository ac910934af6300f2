"""Training data: tokenize a corpus once (cached), cut it into fixed windows, and give each data-parallel rank its
slice of every optimizer step.

The layout rule that makes 1 process and N processes train on exactly the same tokens, step by step:
  step s consumes the global positions [s*B, (s+1)*B)            (B = global batch size, in sequences)
  dp rank r of dp takes the contiguous slice [r*B/dp, (r+1)*B/dp) of them, cut into micro-batches of m in order
  position p -> sequence perm_e[p % N], e = p // N                 (N sequences, perm_e seeded by (seed, epoch e))
So the union over ranks of a step is the same for every dp size, and one process that accumulates B/m micro-batches
sees the same sequences in the same order. Synthetic data has no epochs: sequence i is drawn from a generator seeded
by (seed, i).

Shapes (models/deepseek.py's letters): a window is W = T + 1 tokens (inputs [:-1], labels [1:]); one rank reads B =
global batch / dp of them per step, in micro-batches of m.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from paraseek.errors import UserError
from paraseek.seeding import derive_seed

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUNDLED_CORPUS = ASSETS / "corpus"  # public-domain English text, see its SOURCE.md
BUNDLED_TOKENIZER = ASSETS / "tokenizer" / "tokenizer.json"  # byte-level BPE, 2048 tokens, built by scripts/
SUFFIXES = (".txt", ".jsonl", ".parquet")
# End-of-document token names, tried in order when no tokenizer_config.json names one: ours, DeepSeek's, then the
# Llama/Qwen/GPT family's.
EOS_NAMES = ("<|eos|>", "<｜end▁of▁sentence｜>", "<|end_of_text|>", "<|endoftext|>", "</s>")
CACHE_VERSION = 1  # bump when the cached stream's meaning changes, so old caches are not reused
PROGRESS_MIN_BYTES = 4 << 20  # below this tokenizing takes about a second: no progress bar


class Dataset:
    """Fixed windows of seq_len + 1 tokens: cut from a cached token stream, or random tokens (data="synthetic")."""

    def __init__(self, *, seq_len: int, vocab_size: int, seed: int, tokens: np.ndarray | None = None,
                 source: str = "synthetic", eos_id: int | None = None, tokenizer_vocab: int | None = None):
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed
        self.tokens, self.source, self.eos_id = tokens, source, eos_id
        self.tokenizer_vocab = tokenizer_vocab  # the tokenizer's size, with added tokens (None: synthetic)
        # the remainder after the last full window is dropped
        self.num_sequences: int | None = None if tokens is None else len(tokens) // (seq_len + 1)

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


def open_dataset(data: str, *, seq_len: int, vocab_size: int, tokenizer: str | None = None, seed: int = 0) -> Dataset:
    """`data` is "synthetic", a .txt (one document per file), .jsonl ("text" per line) or .parquet ("text" column)
    file, or a folder of them (searched recursively, read in sorted order). `tokenizer` is an HF tokenizer.json or a
    folder holding one; None or "" = the bundled one."""
    assert seq_len > 0 and vocab_size > 0, (seq_len, vocab_size)
    if data == "synthetic":
        return Dataset(seq_len=seq_len, vocab_size=vocab_size, seed=seed)
    files = list_files(data)
    tok, tok_file = load_tokenizer(tokenizer or BUNDLED_TOKENIZER)
    n_vocab = tok.get_vocab_size(with_added_tokens=True)
    if n_vocab > vocab_size:
        raise UserError(f"tokenizer {tok_file} has {n_vocab:,} tokens but the model's vocab_size is {vocab_size:,}: "
                        f"use a model whose vocab_size is at least {n_vocab:,}, or a smaller tokenizer")
    eos = eos_id(tok, tok_file)
    tokens = cached_tokens(files, tok, tok_file, eos)
    if len(tokens) < seq_len + 1:
        raise UserError(f"{data}: the corpus has {len(tokens):,} tokens, one sequence of --seq-len {seq_len} needs "
                        f"{seq_len + 1:,}; add text or lower --seq-len")
    return Dataset(seq_len=seq_len, vocab_size=vocab_size, seed=seed, tokens=tokens, source=str(data), eos_id=eos,
                   tokenizer_vocab=n_vocab)


def list_files(data: str | os.PathLike) -> list[Path]:
    path = Path(data).expanduser()
    if not path.exists():
        raise UserError(f"--data {data}: no such file or folder (give 'synthetic', a .txt/.jsonl/.parquet file or a "
                        f"folder of them)")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise UserError(f"--data {data}: the folder holds no {', '.join(SUFFIXES)} files")
    elif path.suffix in SUFFIXES:
        files = [path]
    else:
        raise UserError(f"--data {data}: unsupported file type {path.suffix!r} (use {', '.join(SUFFIXES)})")
    if any(f.suffix == ".parquet" for f in files):
        _pyarrow(files[0])  # fail now, not after tokenizing the other files
    return files


def _pyarrow(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path}: reading .parquet files needs pyarrow: pip install pyarrow") from None
    return pq


def load_tokenizer(path: str | os.PathLike):
    """(tokenizers.Tokenizer, the tokenizer.json it came from)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError("tokenizing a corpus needs the tokenizers library: pip install tokenizers") from None
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise UserError(f"--tokenizer {path}: no tokenizer file at {file} (give an HF tokenizer.json or a folder "
                        f"holding one)")
    try:
        return Tokenizer.from_file(str(file)), file
    except Exception as e:  # the Rust side raises a plain Exception for any malformed file
        raise UserError(f"--tokenizer {file}: not a valid HF tokenizer.json ({e})") from None


def eos_id(tok, tok_file: Path) -> int:
    """The id written between documents: tokenizer_config.json's eos_token when there is one, else a known name."""
    names = list(EOS_NAMES)
    config = tok_file.parent / "tokenizer_config.json"
    if config.is_file():
        try:
            eos = json.loads(config.read_text()).get("eos_token")
        except (json.JSONDecodeError, AttributeError):
            eos = None  # a broken config is not worth failing for: fall back to the known names
        if isinstance(eos, dict):  # older configs store an AddedToken object
            eos = eos.get("content")
        if isinstance(eos, str):
            names.insert(0, eos)
    for name in names:
        if (i := tok.token_to_id(name)) is not None:
            return i
    raise UserError(f"--tokenizer {tok_file}: no end-of-document token (looked for {', '.join(names)}); "
                    f"add one, or name it as eos_token in a tokenizer_config.json beside it")


def cache_dir() -> Path:
    """$PARASEEK_CACHE/tokens, default ~/.cache/paraseek/tokens."""
    root = os.environ.get("PARASEEK_CACHE") or Path.home() / ".cache" / "paraseek"
    return Path(root).expanduser() / "tokens"


def cache_path(files: list[Path], tok_file: Path, eos: int) -> Path:
    """The cache key covers everything the stream depends on: which files (path, size, mtime) and which tokenizer
    (its bytes, not its path, so an edited tokenizer.json in the same place retokenizes)."""
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    tok_hash = hashlib.sha256(tok_file.read_bytes()).hexdigest()
    key = json.dumps({"v": CACHE_VERSION, "files": stats, "tokenizer": tok_hash, "eos": eos})
    return cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.u32"


def cached_tokens(files: list[Path], tok, tok_file: Path, eos: int) -> np.ndarray:
    """The corpus' token stream (uint32, memory-mapped), tokenizing it first when no cache holds it.

    Several ranks of one node start here together: an exclusive flock lets one tokenize while the others wait and
    then read its file. The file appears only complete (tmp + os.replace), so a crash never leaves half a cache, and
    on file systems where flock does not lock across nodes each node tokenizes the same stream and the last rename
    wins harmlessly."""
    path = cache_path(files, tok_file, eos)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            try:
                tokenize_into(tmp, files, tok, eos)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
    if path.stat().st_size == 0:  # np.memmap refuses empty files
        return np.zeros(0, dtype="<u4")
    return np.memmap(path, dtype="<u4", mode="r")


def tokenize_into(out: Path, files: list[Path], tok, eos: int, batch_chars: int = 8 << 20) -> None:
    """Encode every document, append `eos` after each, and stream the ids to `out` as raw little-endian uint32
    (so memory stays bounded by one batch, whatever the corpus size)."""
    total = sum(f.stat().st_size for f in files)
    show = os.environ.get("LOCAL_RANK", "") in ("", "0") and total >= PROGRESS_MIN_BYTES
    with open(out, "wb") as f, _progress(show, total) as advance:
        texts: list[str] = []

        def flush() -> None:
            # encode_batch runs on all cores (the Rust side); special tokens are not added, we place eos ourselves
            ids = [e.ids + [eos] for e in tok.encode_batch(texts, add_special_tokens=False)]
            if ids:
                f.write(np.concatenate([np.asarray(x, dtype="<u4") for x in ids]).tobytes())
            texts.clear()

        size = 0
        for text, nbytes in iter_documents(files):
            texts.append(text)
            size += len(text)
            advance(nbytes)
            if size >= batch_chars:
                flush()
                size = 0
        flush()


class _progress:
    """A rich progress bar over input bytes on stderr (stdout may carry --json), or nothing."""

    def __init__(self, show: bool, total: int):
        self.bar = None
        if show:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                                console=Console(stderr=True))
            self.task = self.bar.add_task("tokenizing", total=total)

    def __enter__(self):
        if self.bar is None:
            return lambda n: None
        self.bar.start()
        return lambda n: self.bar.advance(self.task, n)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()


def iter_documents(files: list[Path]) -> Iterator[tuple[str, int]]:
    """(document text, input bytes it stands for) in file order; the bytes only drive the progress bar."""
    for path in files:
        if path.suffix == ".txt":  # a stray bad byte becomes U+FFFD rather than stopping a long run
            yield path.read_text(encoding="utf-8", errors="replace"), path.stat().st_size
        elif path.suffix == ".jsonl":
            with open(path, "rb") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        doc = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                    if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                        raise UserError(f'{path}:{lineno}: no "text" field (each line must be an object with a '
                                        f'"text" string)')
                    yield doc["text"], len(line)
        else:  # .parquet
            pf = _pyarrow(path).ParquetFile(path)
            if "text" not in pf.schema_arrow.names:
                raise UserError(f'{path}: no "text" column (columns: {", ".join(pf.schema_arrow.names)})')
            rows = max(pf.metadata.num_rows, 1)
            for batch in pf.iter_batches(columns=["text"], batch_size=1024):
                share = path.stat().st_size * batch.num_rows // rows
                for i, text in enumerate(batch.column(0).to_pylist()):
                    if text is not None:  # a null row is no document
                        yield text, share if i == 0 else 0


class DataLoader:
    """This rank's micro-batches of each optimizer step, following the layout rule at the top of this file. The only
    state is the global position (sequences consumed by all ranks together), so a checkpoint taken with one dp size
    resumes exactly with another."""

    def __init__(self, dataset: Dataset, *, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, position: int = 0):
        per_step = dp_size * micro_batch_size
        if global_batch_size <= 0 or micro_batch_size <= 0 or global_batch_size % per_step:
            raise UserError(f"--global-batch-size {global_batch_size} is not a multiple of dp size {dp_size} x "
                            f"--micro-batch-size {micro_batch_size} = {per_step}: use a multiple of {per_step}")
        assert 0 <= dp_rank < dp_size, (dp_rank, dp_size)
        self.dataset = dataset
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.position = position
        self._perms: dict[int, torch.Tensor] = {}  # epoch -> permutation; a step may straddle two epochs

    def _index(self, position: int) -> int:
        n = self.dataset.num_sequences
        if n is None:
            return position
        epoch = position // n
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(derive_seed(getattr(self.dataset, "seed", 0), "epoch", epoch))
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}  # keep only the previous one
            self._perms[epoch] = torch.randperm(n, generator=g)
        return int(self._perms[epoch][position % n])

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[(inputs [m, T], labels [m, T])] * (B / m): this rank's B = global batch / dp sequences of one optimizer
        step."""
        per_rank = self.global_batch_size // self.dp_size
        start = self.position + self.dp_rank * per_rank
        seqs_BW = torch.stack([self.dataset.sequence(self._index(p)) for p in range(start, start + per_rank)])
        self.position += self.global_batch_size
        m = self.micro_batch_size
        return [(seqs_BW[i:i + m, :-1].contiguous(), seqs_BW[i:i + m, 1:].contiguous())
                for i in range(0, per_rank, m)]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self._perms = {}
