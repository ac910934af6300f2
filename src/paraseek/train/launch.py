"""`paraseek train`: validate in the parent, then re-launch through torch's own launcher (torch.distributed.run)
with N processes per node; the workers read the resolved config from the environment, so every rank runs
exactly the same configuration."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

from paraseek.errors import UserError
from paraseek.train.config import TrainConfig, from_namespace, resolve_defaults, validate

_ENV = "PARASEEK_TRAIN_CONFIG"


def cmd_train(ns: argparse.Namespace) -> int:
    if _ENV in os.environ:  # a worker started by the launcher below
        cfg = TrainConfig(**json.loads(os.environ[_ENV]))
        return _run_worker(cfg)
    import torch

    cfg = from_namespace(ns)
    cuda = torch.cuda.is_available() and cfg.device != "cpu"
    gpus = torch.cuda.device_count() if cuda else 0
    cfg = resolve_defaults(cfg, cuda, gpus)
    validate(cfg, cuda, gpus)
    _check_model_and_data(cfg)
    return launch(cfg)


def _check_model_and_data(cfg: TrainConfig) -> None:
    """Resolve the model and open the data in the parent: those mistakes cost one line and no processes, and a
    corpus is tokenized once here (with a progress bar) into the cache the workers then read."""
    from paraseek.models import resolve_model
    from paraseek.train.data import open_dataset

    args, _, _ = resolve_model(cfg.init_from or cfg.model)
    if cfg.data != "synthetic":
        open_dataset(cfg.data, seq_len=cfg.seq_len, vocab_size=args.vocab_size, tokenizer=cfg.tokenizer or None,
                     seed=cfg.seed)


def launch(cfg: TrainConfig) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.nproc}"]
    if cfg.nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={cfg.nnodes}", f"--node-rank={cfg.node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={cfg.rdzv_endpoint}"]
    cmd += ["-m", "paraseek", "train"]
    env = dict(os.environ)
    env[_ENV] = json.dumps(dataclasses.asdict(cfg))
    # Share the cores between processes instead of oversubscribing them (and silence torchrun's warning).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc)))
    if cfg.device == "cuda":
        # Fewer fragmentation OOMs on long or variable sequences (the fix CUDA_LAUNCH_BLOCKING is not).
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        return subprocess.run(cmd, env=env).returncode
    except KeyboardInterrupt:
        return 130


def _run_worker(cfg: TrainConfig) -> int:
    from paraseek.train.loop import train

    try:
        return train(cfg)
    except UserError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"paraseek: error: {e}", file=sys.stderr, flush=True)
        return 2


def register(subparsers: argparse._SubParsersAction) -> None:
    from paraseek.train.config import add_arguments

    p = subparsers.add_parser(
        "train", help="train a model on torch.distributed (FSDP2 / HSDP / DDP), one node or many",
        description="Train a preset or HF model with data parallelism (FSDP2 per block, HSDP, or DDP with gradient "
        "compression), checkpoints (torch DCP, resumable under another layout), HF import/export and per-step "
        "metrics. Re-launches itself through torch.distributed.run with --nproc processes.",
    )
    add_arguments(p)
    p.set_defaults(func=cmd_train)
