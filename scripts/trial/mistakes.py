"""The new-user trial: mistakes a new user makes on a fresh clone, across every `paraseek` command, each run as
that user would run it -- `paraseek ARGS` in a folder of their own -- and judged by the project's rule: a mistake
costs exit code 2 and one readable line on stderr that says what is wrong (no traceback, no usage block), and
nothing is lost or left behind (the folder holds exactly what it held before: no file written, changed or removed,
no partial output). A few entries are no mistake but a flag that cannot act in that run: they expect exit code 0
and the one line on stderr that says why (and may leave the run's own files).

    PYTHONPATH=src .venv/bin/python scripts/trial/mistakes.py            # all of them, about 6 minutes on 2 cores
    PYTHONPATH=src .venv/bin/python scripts/trial/mistakes.py -k export  # those whose name holds "export"
    PYTHONPATH=src .venv/bin/python scripts/trial/mistakes.py --list     # the table only
    PYTHONPATH=src .venv/bin/python scripts/trial/mistakes.py --as-user nobody   # from root: as a non-root user

Each entry runs in a fresh temporary folder (sequentially, with a timeout), prints `OK name` or `WRONG name: why`,
and the run ends with "N of M handled right" (exit code 1 when any is wrong). A few entries need a real training
checkpoint: it is made once, by `paraseek train` (tiny-dense, one step), and copied where they need it.

Who runs it matters: root may write where a user may not, but not on /proc or /sys, which the entries for paths
no one can write use. `--as-user USER` (from root) runs every command as USER (setpriv, no login needed) in folders
given to USER; the entries about permissions (a read-only folder, a file no one may read) run only as a non-root
user, and are skipped as root. A full disk is not made here: it needs a mount.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import pwd
import shlex
import shutil
import site
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
sys.path.insert(0, str(SRC))
from paraseek.models.args import TINY_CONFIGS  # noqa: E402  (pure Python: no torch)

TOKENIZER = SRC / "paraseek" / "assets" / "tokenizer" / "tokenizer.json"
CORPUS = SRC / "paraseek" / "assets" / "corpus"
ALWAYS_ABSENT = ("Traceback", "usage:")


@dataclass
class Mistake:
    name: str  # "command: what the user did"
    argv: list[str]  # after `paraseek`; {tok} {corpus} {port} {longprompt} are filled in
    phrase: str  # what the one stderr line must say (case-insensitive)
    files: dict[str, object] = field(default_factory=dict)  # path -> str | bytes | dict/list (JSON) | DIR
    fixtures: dict[str, str] = field(default_factory=dict)  # path -> fixture name (a copy of it is put there)
    absent: tuple[str, ...] = ()  # also must not appear on stderr
    no_gpu: bool = False  # a mistake only where no GPU is visible (skipped elsewhere)
    hold_port: bool = False  # {port} is a port something already listens on
    timeout: float = 90.0
    env: dict[str, str] = field(default_factory=dict)  # set for the command (a relative path is the entry folder's)
    setup: Callable[[Path, Path], None] | None = None  # setup(entry folder, token cache root) after the files
    user_only: bool = False  # a mistake only for a non-root user (root may write there): skipped as root
    rc: int = 2  # 0: a flag that cannot act, said in the one line while the run goes on or ends as it should
    leaves: tuple[str, ...] = ()  # with rc 0: what the run may leave in the folder (its checkpoint, its run folder)


DIR = object()  # an empty folder


@dataclass
class Perm:
    """A file (its content) or a folder (DIR) with these permission bits, e.g. 0o555: a read-only folder."""
    content: object
    mode: int


# ---- the files a user has lying around ------------------------------------------------------------------------------
TINY = json.dumps(TINY_CONFIGS["tiny-dense"], indent=2)
TEXT = "In the beginning God created the heaven and the earth. " * 40


def _safetensors() -> bytes:
    """A well-formed safetensors file holding one tensor that is no part of any model."""
    header = json.dumps({"junk": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + b"\0\0\0\0"


SAFETENSORS = _safetensors()
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


def hf(prefix: str = "hf", weights: bool | bytes = True, tokenizer: bool = True, config: str = TINY,
       chat: bool = False) -> dict[str, object]:
    """An HF model folder of tiny-dense's shape. Its one weight file is well-formed but holds no tensor of the
    model: every mistake here must be caught before the weights are read (a command that gets that far fails on
    them, and so has not caught it). `weights` may be the file's bytes."""
    out: dict[str, object] = {f"{prefix}/config.json": config}
    if weights:
        out[f"{prefix}/model.safetensors"] = SAFETENSORS if weights is True else weights
    if tokenizer:
        out[f"{prefix}/tokenizer.json"] = TOKENIZER.read_bytes()
    if chat:
        out[f"{prefix}/tokenizer_config.json"] = json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|eos|>"})
    return out


def big_tokenizer(n: int = 5000) -> str:
    """A valid tokenizer.json with more tokens than tiny-dense's 2,048-token vocabulary."""
    vocab = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i for i in range(2, n)}}
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
                       "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
                       "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}})


def jsonl(*rows: object) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
CK = {"ck": "checkpoint"}  # a real checkpoint folder of tiny-dense, trained one step on text
# A small run that would otherwise go through: the mistake added to it is the only thing wrong.
T = "train --model tiny-dense --device cpu --nproc 1 --seq-len 16 --global-batch-size 2 --steps 1"
G = "generate hf --device cpu"
S = "serve hf --device cpu --port 18931"
P = "plan --model deepseek-v2-lite --gpus 8 --gpu-type H100 --global-batch-size 64"
BI = "bench-infer tiny-dense --random-weights --device cpu --input-len 64:256 --output-len 16:128"
BS = "bench-serve http://127.0.0.1:{freeport}"


def m(name: str, argv: str, phrase: str, files: dict | None = None, **kw) -> Mistake:
    return Mistake(name, shlex.split(argv), phrase, files or {}, **kw)


# ---- damage done after the files are written (setup hooks: the entry folder, the token cache's root) -------------
def damaged_text_cache(work: Path, cache: Path) -> None:
    """The token cache of work/book.txt with the bundled tokenizer, cut off inside a token id."""
    from paraseek.models.tokenizer import load_text_tokenizer
    from paraseek.train.token_cache import cache_path, document_end

    tok = load_text_tokenizer(TOKENIZER)
    name = cache_path([work / "book.txt"], tok, document_end(tok)).name
    (cache / "tokens").mkdir(parents=True, exist_ok=True)
    (cache / "tokens" / name).write_bytes(b"\1\0\0\0\2\0")


def damaged_chat_cache(work: Path, cache: Path) -> None:
    """The token cache of work/chats.jsonl rendered with work/hf's template: a folder holding the token ids only."""
    from paraseek.models.tokenizer import load_text_tokenizer
    from paraseek.train.token_cache import chat_cache_path

    name = chat_cache_path([work / "chats.jsonl"], load_text_tokenizer(work / "hf")).name
    (cache / "tokens" / name).mkdir(parents=True, exist_ok=True)
    (cache / "tokens" / name / "tokens.u32").write_bytes(b"\1\0\0\0")


def cut_short(pattern: str) -> Callable[[Path, Path], None]:
    """Each file of the checkpoint fixture matching `pattern` cut to half its size."""
    def setup(work: Path, cache: Path) -> None:
        for f in (work / "ck").glob(pattern):
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return setup


PAGE = "<!DOCTYPE html><html><head><title>Sign in</title></head><body>Sign in to continue</body></html>\n"
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256))
RO = Perm(DIR, 0o555)  # a folder its owner may read but not write


MISTAKES: list[Mistake] = [
    # ---- the command itself ---------------------------------------------------------------------------------------
    m("paraseek: no command", "", "COMMAND"),
    m("paraseek: subcommand typo trian", "trian --steps 10", "invalid choice: 'trian'"),
    m("paraseek: subcommand typo generat", "generat hf --prompt hi", "invalid choice: 'generat'"),
    m("paraseek: 'benchmark' for bench", "benchmark", "invalid choice: 'benchmark'"),
    m("paraseek: a flag before the subcommand", "--model tiny-moe train", "--model"),
    m("paraseek: help as a command", "help", "invalid choice: 'help'"),
    # ---- train: flags (checked before torch is imported) ----------------------------------------------------------
    m("train: --stpes typo", "train --stpes 10", "did you mean --steps?"),
    m("train: --learning-rate (other trainers' name)", "train --learning-rate 1e-3", "did you mean --lr?"),
    m("train: --batch-size (other trainers' name)", "train --batch-size 8", "did you mean --global-batch-size?"),
    m("train: --gradient-checkpointing", "train --gradient-checkpointing", "--activation-checkpointing"),
    m("train: model given as a positional", "train tiny-moe", "unexpected argument 'tiny-moe'"),
    m("train: --model without a value", "train --model", "expected one argument"),
    m("train: --steps ten", "train --steps ten", "invalid int value: 'ten'"),
    m("train: --steps 0", "train --steps 0", "--steps must be >= 1"),
    m("train: --lr -1e-3 (read as a flag)", "train --lr -1e-3", "--flag=VALUE"),
    m("train: --lr=-1", "train --lr=-1", "--lr must be >= 0"),
    m("train: --precision fp8", "train --precision fp8", "--precision must be one of"),
    m("train: --precision BF16 (case)", "train --precision BF16", "did you mean bf16?"),
    m("train: --activation-checkpointing partial", "train --activation-checkpointing partial",
      "--activation-checkpointing must be one of"),
    m("train: --compile maybe", "train --compile maybe", "expected true or false"),
    m("train: --min-lr-ratio 2", "train --min-lr-ratio 2", "--min-lr-ratio must be between 0 and 1"),
    m("train: --nproc -1", "train --nproc=-1", "--nproc"),
    m("train: --seq-len 0", "train --seq-len 0", "--seq-len must be positive"),
    m("train: --keep-last -1", "train --checkpoint-dir ck --keep-last=-1", "--keep-last"),
    m("train: --nnodes 0", "train --nnodes 0", "--nnodes must be >= 1"),
    m("train: --lora-rank 0", "train --lora-rank 0", "--lora-rank must be a positive rank"),
    # ---- train: the TOML file ---------------------------------------------------------------------------------------
    m("train: --config that does not exist", "train --config run.toml", "--config run.toml: no such file"),
    m("train: --config not valid TOML", "train --config run.toml", "not valid TOML", {"run.toml": "steps = \n"}),
    m("train: --config written as YAML", "train --config run.yaml", "not valid TOML",
      {"run.yaml": "model: tiny-moe\nsteps: 10\n"}),
    m("train: --config unknown key learning_rate", "train --config run.toml", "did you mean lr?",
      {"run.toml": "learning_rate = 1e-3\n"}),
    m("train: --config key typo stpes", "train --config run.toml", "did you mean steps?", {"run.toml": "stpes = 3\n"}),
    m("train: --config steps as a string", "train --config run.toml", "must be an integer",
      {"run.toml": 'steps = "10"\n'}),
    m("train: --config precision fp8", "train --config run.toml", "precision in run.toml must be one of",
      {"run.toml": 'precision = "fp8"\n'}),
    m("train: --config keys under a [train] table", "train --config run.toml", "top level",
      {"run.toml": "[train]\nsteps = 3\n"}),
    m("train: --config is a folder", "train --config cfg", "--config cfg: a folder", {"cfg": DIR}),
    # ---- train: model (checked before torch is imported) -------------------------------------------------------------
    m("train: unknown preset", "train --model deepseek-v4", "unknown model 'deepseek-v4'"),
    m("train: --model folder that does not exist", "train --model ./DeepSeek-V2-Lite", "no such folder"),
    m("train: --model folder without config.json", "train --model dl", "no config.json", {"dl/readme.md": "x"}),
    m("train: --model folder with a broken config.json", "train --model hf", "not valid JSON",
      hf(config='{"model_type": "llama",')),
    m("train: --model of an unsupported architecture", "train --model hf", "model_type",
      hf(config=json.dumps({"model_type": "gpt2", "vocab_size": 100}))),
    # ---- train: the plan and the machine -----------------------------------------------------------------------------
    m("train: --seq-len longer than the model's positions", f"{T} --seq-len 100000", "longer than"),
    m("train: degrees that do not multiply to the world", f"{T} --nproc 3 --dp-shard 2", "world size is 3"),
    m("train: global batch not divisible", f"{T} --nproc 2 --global-batch-size 3", "not divisible"),
    m("train: --tp 3 does not divide the heads", f"{T} --nproc 3 --tp 3 --global-batch-size 3", "--tp 3"),
    m("train: --device cuda without a GPU", f"{T} --device cuda", "no CUDA device", no_gpu=True),
    m("train: --plan auto on CPU", f"{T} --plan auto", "--plan auto plans for GPUs"),
    m("train: --moe-bias-gamma on a dense model", f"{T} --moe-bias-gamma 0.001", "--moe-bias-gamma"),
    # ---- train: data and tokenizer -----------------------------------------------------------------------------------
    m("train: --data that does not exist", f"{T} --data corpus.txt", "--data corpus.txt: no such file or folder"),
    m("train: --data a .csv file", f"{T} --data notes.csv", "unsupported file type '.csv'", {"notes.csv": "a,b\n"}),
    m("train: --data .jsonl with a broken line", f"{T} --data docs.jsonl", "docs.jsonl:2",
      {"docs.jsonl": jsonl({"text": TEXT}, '{"text": "unterminated', {"text": TEXT})}),
    m("train: chat and text files in one --data folder", f"{T} --data mixed", "one kind of data",
      {"mixed/chat.jsonl": jsonl(CHAT), "mixed/book.txt": TEXT}),
    m("train: chat data with a tokenizer that has no chat template", f"{T} --data chats.jsonl", "chat template",
      {"chats.jsonl": jsonl(CHAT, CHAT)}),
    m("train: --tokenizer not a tokenizer.json", f"{T} --data book.txt --tokenizer tok.json",
      "not a valid HF tokenizer.json", {"book.txt": TEXT, "tok.json": '{"hello": 1}'}),
    m("train: --tokenizer larger than the model's vocabulary", f"{T} --data book.txt --tokenizer big.json",
      "vocab_size", {"book.txt": TEXT, "big.json": big_tokenizer()}),
    m("train: --eval-split of synthetic data", f"{T} --eval-split 0.1", "synthetic"),
    # ---- train: checkpoints, resume, outputs -------------------------------------------------------------------------
    m("train: --resume without --checkpoint-dir", f"{T} --resume", "--resume needs --checkpoint-dir"),
    m("train: --keep-last without --checkpoint-dir", f"{T} --keep-last 3", "--checkpoint-dir"),
    m("train: --overwrite without --checkpoint-dir", f"{T} --overwrite", "--overwrite"),
    m("train: --lr-schedule-reset without --resume", f"{T} --lr-schedule-reset", "--resume"),
    m("train: --checkpoint-dir that holds checkpoints, no --resume", f"{T} --checkpoint-dir ck",
      "already holds checkpoints", fixtures=CK),
    m("train: --resume a checkpoint of another model", f"{T} --model tiny-moe --checkpoint-dir ck --resume",
      "holds another model", fixtures=CK),
    m("train: --resume where every checkpoint is damaged", f"{T} --checkpoint-dir ck --resume",
      "no complete checkpoint", {"ck/step-000005/trainer_state.json": '{"step": 5}'}),
    m("train: --checkpoint-dir is a file", f"{T} --checkpoint-dir notes.txt", "--checkpoint-dir notes.txt",
      {"notes.txt": "keep me\n"}),
    m("train: --export-hf into the --init-from folder", f"{T} --init-from hf --export-hf hf", "--export-hf hf",
      hf()),
    m("train: --export-hf into a folder that holds files", f"{T} --export-hf out", "--export-hf out",
      {"out/config.json": "{}\n", "out/model.safetensors": b"someone's weights"}),
    m("train: --init-from a folder without weights", f"{T} --init-from hf", "safetensors", hf(weights=False)),
    m("train: --init-from a broken download", f"{T} --init-from hf", "model.safetensors",
      hf(weights=b"\x10\0\0\0\0\0\0\0{\"a\": ")),
    # ---- train: LoRA, several nodes, SLURM ---------------------------------------------------------------------------
    m("train: --lora-rank without --init-from", f"{T} --lora-rank 8", "--init-from"),
    m("train: --nnodes 2 without --rdzv-endpoint", f"{T} --nnodes 2", "needs --rdzv-endpoint"),
    m("train: --rdzv-endpoint without a port", f"{T} --nnodes 2 --rdzv-endpoint 10.1.2.3", "HOST:PORT"),
    m("train: --rdzv-endpoint localhost", f"{T} --nnodes 2 --rdzv-endpoint localhost:29500", "loopback"),
    m("train: --slurm without --nproc", "train --slurm --nnodes 2 --checkpoint-dir ck", "--slurm needs --nproc"),
    # ---- export ------------------------------------------------------------------------------------------------------
    m("export: checkpoint folder that does not exist", "export ckpt out", "ckpt: no such folder"),
    m("export: the run folder instead of its checkpoints", "export runs/demo out", "not a paraseek checkpoint",
      {"runs/demo/metrics.jsonl": jsonl({"step": 1, "loss": 8.0})}),
    m("export: --step that does not exist", "export ck out --step 99", "no complete checkpoint for step 99",
      fixtures=CK),
    m("export: OUT_DIR that holds files", "export ck out", "out exists and is not empty",
      {"out/config.json": "{}\n"}, fixtures=CK),
    m("export: OUT_DIR is a file", "export ck model.safetensors", "model.safetensors",
      {"model.safetensors": b"keep me"}, fixtures=CK),
    m("export: OUT_DIR is the checkpoint folder", "export ck ck --overwrite", "checkpoint", fixtures=CK),
    m("export: --merge-lora on a run without LoRA", "export ck out --merge-lora", "holds no LoRA adapters",
      fixtures=CK),
    m("export: --merge-lora and --export-adapter", "export ck out --merge-lora --export-adapter", "choose one",
      fixtures=CK),
    m("export: a damaged checkpoint only", "export ck out", "trainer_state.json",
      {"ck/step-000004/trainer_state.json": "{not json"}),
    m("export: without OUT_DIR", "export ck", "out", fixtures=CK),
    m("export: --dtype fp16", "export ck out --dtype fp16", "invalid choice: 'fp16'", fixtures=CK),
    m("export: --step 1.5", "export ck out --step 1.5", "invalid int value: '1.5'", fixtures=CK),
    # ---- generate ----------------------------------------------------------------------------------------------------
    m("generate: without a model", "generate --prompt hi", "model"),
    m("generate: model folder that does not exist", "generate ./DeepSeek-R1-Distill-Qwen-1.5B --prompt hi",
      "no such folder"),
    m("generate: unknown preset", "generate deepseek-v4 --prompt hi", "unknown model"),
    m("generate: a preset without --random-weights", "generate tiny-dense --prompt hi", "--random-weights"),
    m("generate: folder without weights", f"{G} --prompt hi", "no *.safetensors", hf(weights=False)),
    m("generate: a truncated model.safetensors (broken download)", f"{G} --prompt hi", "model.safetensors",
      hf(weights=SAFETENSORS[:-2])),
    m("generate: an empty folder", "generate model --prompt hi", "neither an HF model folder", {"model": DIR}),
    m("generate: no prompt", G, "nothing to generate", hf()),
    m("generate: prompt as a positional", f"{G} hello", "unexpected argument 'hello'", hf()),
    m("generate: --promt typo", f"{G} --promt hi", "did you mean --prompt?", hf()),
    m("generate: prompt longer than the context", f"{G} --max-model-len 64 --prompt {{longprompt}}",
      "exceeds the context", hf()),
    m("generate: --max-model-len past the model's positions", f"{G} --max-model-len 100000 --prompt hi",
      "--max-model-len 100000", hf()),
    m("generate: --temperature -1", f"{G} --temperature -1 --prompt hi", "temperature must be >= 0", hf()),
    m("generate: --top-p 1.5", f"{G} --top-p 1.5 --prompt hi", "top_p", hf()),
    m("generate: --stop-token-ids with names", f"{G} --stop-token-ids eos,eot --prompt hi", "--stop-token-ids",
      hf(), absent=("<lambda>",)),
    m("generate: --temperature hot", f"{G} --temperature hot --prompt hi", "--temperature", hf()),
    m("generate: --dtype fp16", f"{G} --dtype fp16 --prompt hi", "invalid choice: 'fp16'", hf()),
    m("generate: --tp 3 does not divide the heads", f"{G} --tp 3 --prompt hi", "--tp 3", hf()),
    m("generate: more GPUs than exist (--device cuda --tp 2)", "generate hf --device cuda --tp 2 --prompt hi",
      "no CUDA", hf(), no_gpu=True),
    m("generate: --tokenizer that does not exist", f"{G} --tokenizer tok.json --prompt hi", "tok.json", hf()),
    m("generate: --random-weights with a checkpoint folder", "generate ck --random-weights --prompt hi",
      "--random-weights", fixtures=CK),
    m("generate: --prompts with a broken line", f"{G} --prompts p.jsonl", "p.jsonl:2",
      {**hf(), "p.jsonl": jsonl({"prompt": "hi"}, "{'prompt': 'single quotes'}")}),
    m("generate: --prompts rows with a text field", f"{G} --prompts p.jsonl", "unknown field 'text'",
      {**hf(), "p.jsonl": jsonl({"text": "hi"})}),
    m("generate: --prompts token id past the vocabulary", f"{G} --prompts p.jsonl", "999999",
      {**hf(), "p.jsonl": jsonl({"prompt_token_ids": [5, 999999]})}),
    m("generate: --prompts empty prompt_token_ids", f"{G} --prompts p.jsonl", "empty",
      {**hf(), "p.jsonl": jsonl({"prompt_token_ids": []})}),
    m("generate: --prompts row with temperature -1", f"{G} --prompts p.jsonl", "p.jsonl:2",
      {**hf(), "p.jsonl": jsonl({"prompt": "hi"}, {"prompt": "hi", "temperature": -1})}),
    m("generate: --prompts messages that are a string", f"{G} --prompts p.jsonl", "p.jsonl:1",
      {**hf(chat=True), "p.jsonl": jsonl({"messages": "hi"})}),
    # ---- serve (start-up only) ---------------------------------------------------------------------------------------
    m("serve: without a model", "serve --port 18931", "model"),
    m("serve: model folder that does not exist", "serve ./DeepSeek-R1-Distill-Qwen-1.5B --port 18931",
      "no such folder"),
    m("serve: a preset without --random-weights", "serve tiny-dense --port 18931", "--random-weights"),
    m("serve: folder without weights", S, "no *.safetensors", hf(weights=False)),
    m("serve: --port 0", "serve hf --port 0", "--port must be in 1..65535", hf()),
    m("serve: --port 70000", "serve hf --port 70000", "--port must be in 1..65535", hf()),
    m("serve: --port http", "serve hf --port http", "--port", hf()),
    m("serve: --port already in use", "serve hf --device cpu --port {port}", "{port}", hf(), hold_port=True),
    m("serve: --host that is not an address here", f"{S} --host 203.0.113.7", "203.0.113.7", hf()),
    m("serve: --max-queue 0", f"{S} --max-queue 0", "--max-queue must be >= 1", hf()),
    m("serve: --drain-timeout -5", f"{S} --drain-timeout=-5", "--drain-timeout", hf()),
    m("serve: --request-timeout 0", f"{S} --request-timeout 0", "--request-timeout", hf()),
    m("serve: --max-body-bytes 100", f"{S} --max-body-bytes 100", "--max-body-bytes", hf()),
    m("serve: --api-key empty (an unset variable)", f"{S} --api-key ''", "--api-key", hf()),
    m("serve: a sampling flag", f"{S} --temperature 0.7", "unknown flag --temperature", hf()),
    m("serve: --tp 3 does not divide the heads", f"{S} --tp 3", "--tp 3", hf()),
    m("serve: --max-model-len past the model's positions", f"{S} --max-model-len 100000", "--max-model-len", hf()),
    # ---- plan --------------------------------------------------------------------------------------------------------
    m("plan: without --model", "plan --gpus 8 --gpu-type H100 --global-batch-size 64", "--model"),
    m("plan: unknown model", "plan --model deepseek-v4 --gpus 8 --gpu-type H100 --global-batch-size 64",
      "unknown model 'deepseek-v4'"),
    m("plan: unknown --gpu-type", "plan --model deepseek-v2-lite --gpus 8 --gpu-type H1000 --global-batch-size 64",
      "H1000"),
    m("plan: --gpu-type MI300X", "plan --model deepseek-v2-lite --gpus 8 --gpu-type MI300X --global-batch-size 64",
      "MI300X"),
    m("plan: --gpus 0", "plan --model deepseek-v2-lite --gpus 0 --gpu-type H100 --global-batch-size 64", "--gpus"),
    m("plan: --gpus -8", "plan --model deepseek-v2-lite --gpus=-8 --gpu-type H100 --global-batch-size 64", "--gpus"),
    m("plan: --gpus not whole nodes", f"{P} --gpus 12", "whole nodes"),
    m("plan: --gpus-per-node 0", f"{P} --gpus-per-node 0", "--gpus-per-node"),
    m("plan: --inter-node-gbps 0", f"{P} --inter-node-gbps 0", "--inter-node-gbps"),
    m("plan: neither --gpus nor --hardware", "plan --model deepseek-v2-lite --global-batch-size 64", "--gpus"),
    m("plan: --gpus without --gpu-type", "plan --model deepseek-v2-lite --gpus 8 --global-batch-size 64",
      "--gpu-type"),
    m("plan: --mode inference", f"{P} --mode inference", "--mode"),
    m("plan: --mode Train", f"{P} --mode Train", "--mode"),
    m("plan: training without --global-batch-size", "plan --model deepseek-v2-lite --gpus 8 --gpu-type H100",
      "--global-batch-size"),
    m("plan: --global-batch-size 0", f"{P} --global-batch-size 0", "--global-batch-size"),
    m("plan: --seq-len 0", f"{P} --seq-len 0", "--seq-len"),
    m("plan: --top -1", f"{P} --top=-1", "--top"),
    m("plan: --hardware that does not exist", "plan --model deepseek-v2-lite --hardware h.json --global-batch-size 8",
      "h.json"),
    m("plan: --hardware not JSON", "plan --model deepseek-v2-lite --hardware h.json --global-batch-size 8", "h.json",
      {"h.json": "gpu_name: H100\n"}),
    m("plan: --hardware and --gpu-type", "plan --model deepseek-v2-lite --hardware h.json --gpu-type H100 "
      "--global-batch-size 8", "not both", {"h.json": '{"gpu_name": "H100"}'}),
    m("plan: --plot without --scaling", f"{P} --plot p.png", "--scaling"),
    m("plan: --plot under a file", f"{P} --scaling 8,16 --plot notes.txt/p.png", "notes.txt",
      {"notes.txt": "keep\n"}),
    m("plan: --strong without --scaling", f"{P} --strong", "--scaling"),
    m("plan: --scaling with words", f"{P} --scaling eight,sixteen", "--scaling"),
    m("plan: --scaling with a 0", f"{P} --scaling 0,8", "--scaling"),
    m("plan: --compile maybe", f"{P} --compile maybe", "--compile"),
    m("plan: --weight-dtype int4", f"{P} --mode infer --weight-dtype int4", "--weight-dtype"),
    m("plan: bf16 weights on a V100", "plan --model deepseek-llm-7b --gpus 8 --gpu-type V100 --mode infer "
      "--weight-dtype bf16", "bf16"),
    m("plan: inference context past the model's positions", f"{P} --mode infer --seq-len 10000000", "--seq-len"),
    # ---- bench -------------------------------------------------------------------------------------------------------
    m("bench: --warmup -1", "bench --warmup=-1", "--warmup"),
    m("bench: --scaling with a 0", "bench --scaling 0,2", "--scaling"),
    m("bench: --scaling with words", "bench --scaling one,two", "--scaling"),
    m("bench: --save without --calibrate", "bench --save p.json", "--calibrate"),
    m("bench: --steps 0", "bench --steps 0", "--steps"),
    m("bench: unknown model", "bench --model deepseek-v4", "unknown model"),
    m("bench: --data (benchmarks run on synthetic tokens)", "bench --model tiny-dense --nproc 1 --data book.txt",
      "--data", {"book.txt": TEXT}),
    m("bench: --checkpoint-dir (benchmarks write no checkpoint)", "bench --model tiny-dense --nproc 1 "
      "--checkpoint-dir ck", "--checkpoint-dir"),
    m("bench: --calibrate without a GPU", "bench --calibrate", "no CUDA", no_gpu=True),
    m("bench: --plot under a file", "bench --model tiny-dense --device cpu --nproc 1 --seq-len 16 "
      "--global-batch-size 1 --steps 1 --warmup 0 --plot notes.txt/bench.png", "notes.txt", {"notes.txt": "keep\n"}),
    # ---- bench-infer -------------------------------------------------------------------------------------------------
    m("bench-infer: a preset without --random-weights", "bench-infer tiny-dense", "--random-weights"),
    m("bench-infer: model folder that does not exist", "bench-infer ./DeepSeek-V2-Lite", "no such folder"),
    m("bench-infer: --workloads typo", f"{BI} --workloads latncy", "latncy"),
    m("bench-infer: --input-len 0:10", f"{BI} --input-len 0:10", "--input-len"),
    m("bench-infer: --concurrency with a word", f"{BI} --concurrency 1,many", "--concurrency"),
    m("bench-infer: --latency-output 0", f"{BI} --latency-output 0", "--latency-output"),
    m("bench-infer: --input-len past the model's context", f"{BI} --workloads throughput --input-len 600",
      "--input-len"),
    m("bench-infer: --tp 2", f"{BI} --tp 2", "one replica"),
    m("bench-infer: --concurrency above --max-num-seqs", f"{BI} --workloads concurrency --max-num-seqs 4 "
      "--concurrency 1,8", "--max-num-seqs"),
    m("bench-infer: --plot under a file", f"{BI} --workloads concurrency --concurrency 1 --concurrency-output 4 "
      "--plot notes.txt/c.png", "notes.txt", {"notes.txt": "keep\n"}),
    # ---- bench-serve -------------------------------------------------------------------------------------------------
    m("bench-serve: URL without http://", "bench-serve 127.0.0.1:8000", "http://"),
    m("bench-serve: nothing listens at the URL", BS, "does not answer"),
    m("bench-serve: without a URL", "bench-serve --num-prompts 10", "url"),
    m("bench-serve: --num-prompts 0", f"{BS} --num-prompts 0", "--num-prompts"),
    m("bench-serve: --max-concurrency 0", f"{BS} --max-concurrency 0", "--max-concurrency"),
    m("bench-serve: --request-rate fast", f"{BS} --request-rate fast", "--request-rate"),
    m("bench-serve: --request-rate 0", f"{BS} --request-rate 0", "--request-rate"),
    m("bench-serve: --timeout 0", f"{BS} --timeout 0", "--timeout"),
    m("bench-serve: --sweep with a word", f"{BS} --sweep 1,2,lots", "--sweep"),
    m("bench-serve: --input-len 0", f"{BS} --input-len 0", "--input-len"),
    m("bench-serve: --slo-ttft-ms -5", f"{BS} --slo-ttft-ms=-5", "--slo-ttft-ms"),
    m("bench-serve: --endpoint completion", f"{BS} --endpoint completion", "invalid choice: 'completion'"),
    m("bench-serve: --prompts that does not exist", f"{BS} --prompts p.jsonl", "p.jsonl"),
    m("bench-serve: --prompts with a broken line", f"{BS} --prompts p.jsonl", "p.jsonl:2",
      {"p.jsonl": jsonl({"prompt": "hi"}, "prompt: hi")}),
    m("bench-serve: --plot under a file", f"{BS} --plot notes.txt/s.png", "notes.txt", {"notes.txt": "keep\n"}),
    m("bench-serve: --prompts token ids for the chat endpoint", f"{BS} --endpoint chat --prompts p.jsonl",
      "--endpoint chat", {"p.jsonl": jsonl({"prompt_token_ids": [1, 2, 3]})}),
    # ---- doctor ------------------------------------------------------------------------------------------------------
    m("doctor: --save into a folder that does not exist", "doctor --quick --save profiles/h200.json", "profiles"),
    m("doctor: --iters 0", "doctor --quick --iters 0", "--iters"),
    m("doctor: --warmup -1", "doctor --quick --warmup=-1", "--warmup"),
    m("doctor: --timeout 0", "doctor --quick --timeout 0", "--timeout"),
    m("doctor: --collectives allreduce", "doctor --collectives allreduce", "allreduce"),
    m("doctor: --sizes 1X", "doctor --sizes 1X,16M", "--sizes"),
    m("doctor: --load that does not exist", "doctor --load report.json", "report.json"),
    m("doctor: --load not JSON", "doctor --load report.json", "not JSON", {"report.json": "GPU 0: H100\n"}),
    m("doctor: --load another JSON document", "doctor --load report.json", "not a paraseek doctor document",
      {"report.json": '{"loss": 1.0}'}),
    m("doctor: --fail-on errors", "doctor --quick --fail-on errors", "invalid choice: 'errors'"),
    m("doctor: a positional", "doctor all", "unexpected argument 'all'"),
    # ---- diagnose ----------------------------------------------------------------------------------------------------
    m("diagnose: without a folder", "diagnose", "run_dir"),
    m("diagnose: folder that does not exist", "diagnose runs/last", "no such folder"),
    m("diagnose: an empty folder", "diagnose run", "not a run folder", {"run": DIR}),
    m("diagnose: the checkpoint folder instead of the run folder", "diagnose ck", "not a run folder", fixtures=CK),
    m("diagnose: a file", "diagnose metrics.jsonl", "metrics.jsonl", {"metrics.jsonl": jsonl({"step": 1})}),
    # ---- demo --------------------------------------------------------------------------------------------------------
    m("demo: --steps -5", "demo --steps=-5", "--steps"),
    m("demo: a positional", "demo tiny-moe", "unexpected argument 'tiny-moe'"),
    m("demo: --nproc (not a demo flag)", "demo --nproc 2", "unknown flag --nproc"),
    m("demo: --stpes typo", "demo --stpes 5", "did you mean --steps?"),
    m("demo: runs/demo is a file", "demo --steps 1", "runs/demo", {"runs/demo": "my notes\n"}),
    # ---- info --------------------------------------------------------------------------------------------------------
    m("info: without a model", "info --json", "model"),
    m("info: unknown preset", "info deepseek-v4", "unknown model 'deepseek-v4'"),
    m("info: folder that does not exist", "info ./DeepSeek-V3", "no such folder"),
    m("info: folder without config.json", "info model", "no config.json", {"model": DIR}),
    m("info: config.json missing a key", "info hf", "lacks", hf(config='{"model_type": "llama"}')),
    m("info: --seq-len 0", "info tiny-moe --seq-len 0", "--seq-len"),
    # ---- output paths that cannot be written, for root too: /proc and /sys take no new files ------------------------
    m("train: --checkpoint-dir on /proc", f"{T} --checkpoint-dir /proc/paraseek-ckpt", "--checkpoint-dir"),
    m("train: --checkpoint-dir on /sys", f"{T} --checkpoint-dir /sys/paraseek-ckpt", "--checkpoint-dir"),
    m("train: --checkpoint-dir in a read-only folder", f"{T} --checkpoint-dir ro/ck", "--checkpoint-dir ro/ck",
      {"ro": RO}, user_only=True),
    m("train: --checkpoint-dir a read-only folder that holds notes", f"{T} --checkpoint-dir ck", "--checkpoint-dir",
      {"ck/notes.md": "keep\n", "ck": RO}, user_only=True),
    m("train: --metrics-jsonl on /proc", f"{T} --metrics-jsonl /proc/paraseek/run.jsonl", "--metrics-jsonl"),
    m("train: --metrics-jsonl a read-only file", f"{T} --metrics-jsonl run.jsonl", "--metrics-jsonl",
      {"run.jsonl": Perm(jsonl({"step": 1, "loss": 8.0}), 0o444)}, user_only=True),
    m("train: --tensorboard on /sys", f"{T} --tensorboard /sys/paraseek-tb", "--tensorboard"),
    m("train: --run-dir on /proc", f"{T} --run-dir /proc/paraseek-run", "--run-dir"),
    m("train: --metrics-jsonl in a read-only folder", f"{T} --metrics-jsonl ro/run.jsonl",
      "ro", {"ro": RO}, user_only=True),
    m("train: --export-hf on /proc", f"{T} --export-hf /proc/paraseek-hf", "--export-hf"),
    m("train: the token cache ($PARASEEK_CACHE) on /proc", f"{T} --data book.txt", "PARASEEK_CACHE",
      {"book.txt": TEXT}, env={"PARASEEK_CACHE": "/proc/paraseek-cache"}),
    m("train: the token cache ($PARASEEK_CACHE) in a read-only folder", f"{T} --data book.txt", "PARASEEK_CACHE",
      {"book.txt": TEXT, "ro": RO}, env={"PARASEEK_CACHE": "ro/cache"}, user_only=True),
    m("export: OUT_DIR on /proc", "export ck /proc/paraseek-out", "/proc", fixtures=CK),
    m("export: OUT_DIR in a read-only folder", "export ck ro/out", "ro/out", {"ro": RO}, fixtures=CK,
      user_only=True),
    m("doctor: --save on /proc", "doctor --quick --save /proc/h200.json", "--save"),
    m("doctor: --save into a read-only folder", "doctor --quick --save ro/h200.json", "--save", {"ro": RO},
      user_only=True),
    m("plan: --plot on /proc", f"{P} --scaling 8,16 --plot /proc/p.png", "--plot"),
    m("bench: --plot on /sys", "bench --model tiny-dense --device cpu --nproc 1 --seq-len 16 --global-batch-size 1 "
      "--steps 1 --warmup 0 --plot /sys/bench.png", "--plot"),
    m("bench-infer: --plot on /proc", f"{BI} --workloads concurrency --concurrency 1 --concurrency-output 4 "
      "--plot /proc/c.png", "--plot"),
    m("bench-serve: --plot on /proc", f"{BS} --plot /proc/s.png", "--plot"),
    # ---- files that are not what their name says, for every reader --------------------------------------------------
    m("train: --data a .parquet file that is not parquet", f"{T} --data rows.parquet", "rows.parquet",
      {"rows.parquet": "text\nIn the beginning\n"}),
    m("train: --data a folder with a damaged .parquet shard", f"{T} --data shards", "b.parquet",
      {"shards/a.txt": TEXT, "shards/b.parquet": b"PAR1" + bytes(64) + b"PAR1"}),
    m("train: --data a .jsonl shard that is gzip-compressed", f"{T} --data shards", "b.jsonl:1",
      {"shards/a.jsonl": jsonl({"text": TEXT}), "shards/b.jsonl": gzip.compress(jsonl({"text": TEXT}).encode())}),
    m("train: --data a .jsonl shard of zeros (a lost block)", f"{T} --data shards", "b.jsonl:1",
      {"shards/a.jsonl": jsonl({"text": TEXT}), "shards/b.jsonl": bytes(4096)}),
    m("train: --data a .txt that is a binary file", f"{T} --data book.txt", "book.txt", {"book.txt": PNG}),
    m("train: --data a .txt file no one may read", f"{T} --data book.txt", "book.txt",
      {"book.txt": Perm(TEXT, 0o000)}, user_only=True),
    m("train: --data a .jsonl file no one may read", f"{T} --data docs.jsonl", "docs.jsonl",
      {"docs.jsonl": Perm(jsonl({"text": TEXT}), 0o000)}, user_only=True),
    m("train: a damaged token cache of text", f"{T} --data book.txt", "token cache", {"book.txt": TEXT},
      setup=damaged_text_cache),
    m("train: a damaged token cache of chats", f"{T} --data chats.jsonl --tokenizer hf", "token cache",
      {"chats.jsonl": jsonl(CHAT, CHAT), **hf(chat=True)}, setup=damaged_chat_cache),
    m("train: --tokenizer a web page saved as tokenizer.json", f"{T} --data book.txt --tokenizer tok.json",
      "tok.json", {"book.txt": TEXT, "tok.json": PAGE}),
    m("train: chat data with a tokenizer.json that is not JSON", f"{T} --data chats.jsonl --tokenizer hf",
      "tokenizer.json", {"chats.jsonl": jsonl(CHAT), **hf(chat=True), "hf/tokenizer.json": PAGE}),
    m("train: chat data with a tokenizer_config.json that is not JSON", f"{T} --data chats.jsonl --tokenizer hf",
      "tokenizer_config.json", {"chats.jsonl": jsonl(CHAT), **hf(), "hf/tokenizer_config.json": PAGE}),
    m("train: --init-from a model.safetensors cut short", f"{T} --init-from hf", "model.safetensors",
      hf(weights=SAFETENSORS[:-2])),
    m("train: --init-from a config.json that is a picture", f"{T} --init-from hf", "config.json", hf(config=PNG)),
    m("train: --model a config.json with a word for a number", "train --model hf", "config.json",
      hf(config=json.dumps({**TINY_CONFIGS["tiny-dense"], "hidden_size": "wide"}))),
    m("train: --config a binary file", "train --config run.toml", "run.toml", {"run.toml": PNG}),
    m("train: --hardware profile that is a binary file", f"{T} --plan auto --hardware h.json", "h.json",
      {"h.json": PNG}),
    m("train: --resume a checkpoint whose shards are cut short", f"{T} --checkpoint-dir ck --resume",
      "no complete checkpoint", fixtures=CK, setup=cut_short("step-*/*.distcp")),
    m("export: a checkpoint whose .metadata is cut short", "export ck out", "no complete checkpoint", fixtures=CK,
      setup=cut_short("step-*/.metadata")),
    m("generate: a tokenizer.json that is a web page", f"{G} --prompt hi", "tokenizer.json",
      {**hf(), "hf/tokenizer.json": PAGE}),
    m("generate: a model.safetensors whose header is cut off", f"{G} --prompt hi", "model.safetensors",
      hf(weights=SAFETENSORS[:20])),
    m("serve: a tokenizer.json that is not JSON", S, "tokenizer.json", {**hf(), "hf/tokenizer.json": "{\"model\": "}),
    m("plan: --hardware a binary file", "plan --model deepseek-v2-lite --hardware h.json --global-batch-size 8",
      "h.json", {"h.json": PNG}),
    m("plan: --hardware with a number for gpu_name", "plan --model deepseek-v2-lite --hardware h.json "
      "--global-batch-size 8", "gpu_name", {"h.json": '{"gpu_name": 80}'}),
    m("doctor: --load a binary file", "doctor --load report.json", "report.json", {"report.json": PNG}),
    m("info: a config.json that is a picture", "info hf", "config.json", hf(config=PNG)),
    m("info: a config.json that is a JSON list", "info hf", "config.json", hf(config="[1, 2]")),
    # ---- flags that cannot act in this run ---------------------------------------------------------------------------
    m("train: --profile-steps past the last step", f"{T} --profile-steps 5:6", "--profile-steps 5:6"),
    m("train: --profile-steps window that ends past the run", f"{T} --steps 3 --profile-steps 2:4",
      "--profile-steps 2:4"),
    m("train: --profile-steps before the step a --resume continues from",
      f"{T} --steps 3 --checkpoint-dir ck --resume --profile-steps 1:2", "--profile-steps 1:2", fixtures=CK),
    m("train: --sequence-parallel false without --tp", f"{T} --sequence-parallel false", "--sequence-parallel"),
    m("train: --config sequence_parallel = false without tp", f"{T} --config run.toml", "--sequence-parallel",
      {"run.toml": "sequence_parallel = false\n"}),
    m("train: --pp-schedule without --pp", f"{T} --pp-schedule GPipe", "--pp-schedule GPipe"),
    m("train: --pp-virtual-stages without --pp", f"{T} --pp-virtual-stages 2", "--pp-virtual-stages 2"),
    m("train: --resume of a run that is done", f"{T} --checkpoint-dir ck --resume", "nothing left to train",
      fixtures=CK, rc=0),
    m("train: --resume into a folder that does not exist", f"{T} --checkpoint-dir ckpt --resume",
      "no checkpoint found in", rc=0, leaves=("ckpt", "runs"), timeout=180),
    m("plan: --weight-dtype fp8 on a GPU without FP8", "plan --model deepseek-v2-lite --gpus 8 --gpu-type A100-80GB "
      "--mode infer --weight-dtype fp8 --global-batch-size 8", "--weight-dtype fp8"),
    m("info: --seq-len past the model's positions", "info tiny-moe --seq-len 100000", "--seq-len 100000"),
    m("bench: --seq-len past the model's positions", "bench --model tiny-dense --device cpu --nproc 1 "
      "--seq-len 100000", "--seq-len 100000"),
    # ---- names from other tools: "did you mean" by meaning, not only by spelling -----------------------------------
    m("train: --sequence-length", "train --sequence-length 512", "did you mean --seq-len?"),
    m("train: --max-seq-length", "train --max-seq-length 512", "did you mean --seq-len?"),
    m("train: --config key sequence_len", "train --config run.toml", "did you mean seq_len?",
      {"run.toml": "sequence_len = 512\n"}),
    m("train: --config key batch_size", "train --config run.toml", "did you mean global_batch_size?",
      {"run.toml": "batch_size = 8\n"}),
    m("train: --lr-warmup", "train --lr-warmup 100", "did you mean --warmup-steps?"),
    m("train: --num-gpus", "train --num-gpus 8", "did you mean --nproc?"),
    m("train: --tensor-parallel (Megatron's word)", "train --tensor-parallel 2", "did you mean --tp?"),
    m("train: --train-iters", "train --train-iters 100", "did you mean --steps?"),
    m("serve: --tensor-parallel-size (vLLM's name)", f"{S} --tensor-parallel-size 2", "did you mean --tp?", hf()),
    m("bench-infer: --max-seq-len", f"{BI} --max-seq-len 256", "did you mean --max-model-len?"),
]


# ---- running them ---------------------------------------------------------------------------------------------------
def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [env.get("PYTHONPATH")])])
    env["PARASEEK_CACHE"] = str(cache)  # the token cache: outside the user's folder
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _snapshot(folder: Path) -> dict[str, str]:
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_symlink():
            out[rel] = "link " + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            try:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            except PermissionError:  # a file this user may not read (an entry's own): its size and time then
                st = p.stat()
                out[rel] = f"unreadable {st.st_size} {st.st_mtime_ns}"
    return out


def _fs_change(before: dict[str, str], after: dict[str, str], leaves: tuple[str, ...] = ()) -> str:
    def allowed(rel: str) -> bool:
        return any(rel == x or rel.startswith(x + "/") for x in leaves)

    new = sorted(k for k in set(after) - set(before) if not allowed(k))
    gone = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    parts = [f"{what} {', '.join(xs[:3])}{' ...' if len(xs) > 3 else ''}"
             for what, xs in (("left behind", new), ("removed", gone), ("changed", changed)) if xs]
    return "; ".join(parts)


def _write(folder: Path, files: dict[str, object]) -> None:
    for rel, content in files.items():
        p = folder / rel
        if isinstance(content, Perm):
            _write(folder, {rel: content.content})
            continue
        if content is DIR:
            p.mkdir(parents=True, exist_ok=True)
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        elif isinstance(content, str):
            p.write_text(content)
        else:
            p.write_text(json.dumps(content))


def _set_modes(folder: Path, files: dict[str, object]) -> None:
    """The Perm entries' permission bits, deepest first (a read-only folder's own files are written before)."""
    for rel in sorted((r for r, c in files.items() if isinstance(c, Perm)), key=len, reverse=True):
        (folder / rel).chmod(files[rel].mode)


def _remove(folder: Path) -> None:
    for p in [folder, *folder.rglob("*")]:
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o755)  # the read-only folders of an entry, so that they can be emptied
    shutil.rmtree(folder, ignore_errors=True)


def _free_port(listen: bool) -> tuple[int, socket.socket | None]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    if listen:
        s.listen(1)
        return port, s
    s.close()
    return port, None


def _paraseek(argv: list[str], cwd: Path, env: dict[str, str], timeout: float, prefix: tuple[str, ...] = (),
              python: str = sys.executable) -> tuple[int | None, str, str]:
    """(exit code or None on a timeout, stdout, stderr); the whole process group goes on a timeout. `prefix` runs it
    as another user (setpriv ...), with the interpreter `python`."""
    proc = subprocess.Popen([*prefix, python, "-m", "paraseek", *argv], cwd=cwd, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        return None, out, err


class Fixtures:
    """Things made once by paraseek itself and copied where an entry needs them."""

    def __init__(self, trial: Trial):
        self.trial, self.made = trial, {}

    def get(self, name: str) -> Path:
        if name not in self.made:
            self.made[name] = getattr(self, f"_make_{name}")()
        return self.made[name]

    def _make_checkpoint(self) -> Path:
        work = self.trial.root / "fixture-checkpoint"
        work.mkdir()
        (work / "book.txt").write_text(TEXT * 4)
        self.trial.give(work)
        t0 = time.perf_counter()
        rc, out, err = self.trial.paraseek(shlex.split(T) + ["--data", "book.txt", "--checkpoint-dir", "ck"], work,
                                           self.trial.env, 300)
        if rc != 0:
            raise SystemExit(f"could not make the checkpoint fixture (exit code {rc}):\n{err[-3000:]}")
        print(f"(fixture: a tiny-dense checkpoint, trained one step, in {time.perf_counter() - t0:.1f} s)", flush=True)
        return work / "ck"


def judge(mk: Mistake, rc: int | None, out: str, err: str, fs: str, timeout: float, phrase: str) -> list[str]:
    """What is wrong with how the mistake was handled (nothing: handled right)."""
    why = []
    lines = [line for line in err.splitlines() if line.strip()]
    if rc is None:
        why.append(f"still running after {timeout:g} s (the mistake was not caught)")
    elif rc != mk.rc:
        why.append(f"exit code {rc}")
    for bad in ALWAYS_ABSENT:
        if bad in err or bad in out:
            why.append("a traceback" if bad == "Traceback" else "the usage block")
    if len(lines) != 1:
        why.append(f"{len(lines)} lines on stderr")
    if not any(phrase.lower() in line.lower() for line in lines[-1:] or [""]):
        why.append(f"the line does not say {phrase!r}")
    for bad in mk.absent:
        if bad in err:
            why.append(f"the line says {bad!r}")
    if fs:
        why.append(f"files: {fs}")
    return why


class Trial:
    """The shared state of a trial: a scratch folder, the environment every entry runs in, the fixtures, and who
    runs the commands (`user`: another one than this process's, from root)."""

    def __init__(self, root: Path, user: str | None = None, python: str | None = None):
        self.root = root
        self.env = _env(root / "cache")
        self.python = python or sys.executable
        if python:  # another interpreter, with this one's packages
            self.env["PYTHONPATH"] += os.pathsep + os.pathsep.join(site.getsitepackages())
        self.user = pwd.getpwnam(user) if user else None
        self.prefix: tuple[str, ...] = ()
        if self.user:
            root.chmod(0o755)  # (a TemporaryDirectory is its maker's alone)
            for folder in ("cache", "home"):
                (root / folder).mkdir(exist_ok=True)
                self.give(root / folder)
            self.env["HOME"] = str(root / "home")  # where matplotlib and torch keep their caches
            self.prefix = ("setpriv", f"--reuid={self.user.pw_uid}", f"--regid={self.user.pw_gid}", "--clear-groups")
        self.fixtures = Fixtures(self)
        self.count = 0

    @property
    def as_root(self) -> bool:
        """Whether the commands run as root (who may write where the entries marked user_only forbid it)."""
        return os.geteuid() == 0 and self.user is None

    def give(self, path: Path) -> None:
        """`path` and all under it to the user the commands run as (nothing to do without --as-user)."""
        if self.user:
            for p in [path, *path.rglob("*")]:
                os.chown(p, self.user.pw_uid, self.user.pw_gid, follow_symlinks=False)

    def paraseek(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float):
        return _paraseek(argv, cwd, env, timeout, self.prefix, self.python)

    def run_problem(self) -> str:
        """Why the commands cannot run as this user with this interpreter ("" when they can): paraseek train starts
        its workers with the interpreter's own path, which must be reachable by the user (a venv made from a Python
        under /root is not, for nobody)."""
        spawn = "import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', 'import torch']))"
        proc = subprocess.run([*self.prefix, self.python, "-c", spawn], cwd=self.root, env=self.env,
                              capture_output=True, text=True)
        if proc.returncode == 0:
            return ""
        return (f"{self.python} cannot start Python processes as {self.user.pw_name if self.user else 'this user'} "
                f"({(proc.stderr.strip().splitlines() or ['exit code ' + str(proc.returncode)])[-1]}); give one "
                f"this user can run with --python, e.g. --python /usr/bin/python3")

    def check(self, mk: Mistake) -> tuple[list[str], str, float]:
        """Run one entry in a fresh folder: (what is wrong, its stderr, seconds)."""
        self.count += 1
        work = self.root / f"entry-{self.count:03d}"
        work.mkdir()
        _write(work, mk.files)
        for rel, name in mk.fixtures.items():
            shutil.copytree(self.fixtures.get(name), work / rel)
        if mk.setup:
            mk.setup(work, self.root / "cache")
            self.give(self.root / "cache")
        self.give(work)
        _set_modes(work, mk.files)
        port, held = _free_port(listen=mk.hold_port)
        fill = {"{tok}": str(TOKENIZER), "{corpus}": str(CORPUS), "{port}": str(port), "{freeport}": str(port),
                "{longprompt}": "the beginning " * 300}
        argv = [_fill(a, fill) for a in mk.argv]
        before = _snapshot(work)
        t0 = time.perf_counter()
        try:
            rc, out, err = self.paraseek(argv, work, {**self.env, **mk.env}, mk.timeout)
        finally:
            if held is not None:
                held.close()
        took = time.perf_counter() - t0
        why = judge(mk, rc, out, err, _fs_change(before, _snapshot(work), mk.leaves), mk.timeout,
                    _fill(mk.phrase, fill))
        _remove(work)
        return why, err, took


def gpu_visible() -> bool:
    return shutil.which("nvidia-smi") is not None and os.environ.get("CUDA_VISIBLE_DEVICES") != ""


def run(selected: list[Mistake], verbose: bool, user: str | None = None, python: str | None = None) -> int:
    started = time.perf_counter()
    gpu = gpu_visible()
    right, wrong, skipped = 0, [], {}
    with tempfile.TemporaryDirectory(prefix="paraseek-trial-") as tmp:
        trial = Trial(Path(tmp), user, python)
        if user and (why := trial.run_problem()):
            print(f"mistakes.py: {why}", file=sys.stderr)
            return 2
        who = f"as {user}" if user else ("as root" if trial.as_root else f"as {pwd.getpwuid(os.geteuid()).pw_name}")
        print(f"(running the commands {who})", flush=True)
        for mk in selected:
            reason = ("a GPU is visible" if mk.no_gpu and gpu else
                      "root is let through there" if mk.user_only and trial.as_root else "")
            if reason:
                skipped[reason] = skipped.get(reason, 0) + 1
                print(f"SKIP  {mk.name} ({reason})")
                continue
            why, err, took = trial.check(mk)
            if why:
                wrong.append(mk.name)
                print(f"WRONG {mk.name}: {'; '.join(why)}  [{took:.1f} s]", flush=True)
                shown = [line for line in err.splitlines() if line.strip()]
                for line in (shown if verbose else shown[-3:]):
                    print(f"      | {line[:300]}")
            else:
                right += 1
                print(f"OK    {mk.name}  [{took:.1f} s]" if verbose else f"OK    {mk.name}", flush=True)
    total = right + len(wrong)
    skips = "; ".join(f"{n} skipped: {reason}" for reason, n in skipped.items())
    print(f"\n{right} of {total} handled right {who}" + (f" ({skips})" if skips else "")
          + f", in {time.perf_counter() - started:.0f} s")
    if wrong:
        print("wrong: " + "; ".join(wrong))
    return 1 if wrong else 0


def _fill(text: str, fill: dict[str, str]) -> str:
    for k, v in fill.items():
        text = text.replace(k, v)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-k", dest="only", action="append", default=[],
                   help="run the entries whose name holds this text (repeatable)")
    p.add_argument("--list", action="store_true", help="print the table and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="every stderr line of a wrong entry, and timings")
    p.add_argument("--as-user", metavar="USER", help="run every command as USER, e.g. nobody (needs root: setpriv)")
    p.add_argument("--python", metavar="PATH", help="the interpreter the commands run with, given this one's packages "
                   "(default: this one; for --as-user, one that user can run)")
    ns = p.parse_args(argv)
    if ns.as_user:
        try:
            pwd.getpwnam(ns.as_user)
        except KeyError:
            p.error(f"--as-user {ns.as_user}: no such user")
        if os.geteuid() != 0:
            p.error("--as-user needs root (it drops to that user for each command); as that user, leave it out")
    selected = [mk for mk in MISTAKES if not ns.only or any(k.lower() in mk.name.lower() for k in ns.only)]
    if ns.list:
        for mk in selected:
            print(f"{mk.name}\n    paraseek {shlex.join(mk.argv)}\n    -> exit {mk.rc}, one line saying {mk.phrase!r}")
        print(f"{len(selected)} mistakes")
        return 0
    if not selected:
        print(f"no entry matches {ns.only}", file=sys.stderr)
        return 2
    return run(selected, ns.verbose, ns.as_user, ns.python)


if __name__ == "__main__":
    sys.exit(main())
