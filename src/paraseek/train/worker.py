"""The process torch's launcher starts for each rank (`python -m paraseek.train.worker`): it reads the resolved
configuration the parent validated and wrote into the environment -- no argument parser, no CLI: every rank runs
exactly that configuration -- trains, and leaves with the run's exit code. SIGINT/SIGTERM: train/stop.py."""

from __future__ import annotations

import json
import os
import sys

from paraseek.errors import UserError
from paraseek.train.config import TrainConfig
from paraseek.train.stop import STOP

CONFIG_ENV = "PARASEEK_TRAIN_CONFIG"  # the parent's resolved TrainConfig as JSON (train/launch.py)


def train_code(cfg: TrainConfig) -> int:
    """Train; the exit code: 0, 2 for a user error (printed by rank 0), progress.REPORTED or progress.PEER_LOST for
    a failure, 130/143 when SIGINT/SIGTERM stopped it."""
    from paraseek.train.loop import train

    try:
        return train(cfg)
    except UserError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"paraseek: error: {e}", file=sys.stderr, flush=True)
        return 2


def run(cfg: TrainConfig) -> None:
    """Train, then exit with train_code's code."""
    STOP.install()  # first: the imports of train_code take seconds
    rc = train_code(cfg)
    # Leave without the interpreter's teardown: on CPU, gloo's threads occasionally abort the process while
    # static objects are destroyed ("terminate called without an active exception", exit -6) after all work and
    # output is done. Everything we write is closed by now; flush what is buffered and exit with our code.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    run(TrainConfig(**json.loads(os.environ[CONFIG_ENV])))
