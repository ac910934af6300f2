"""The kill drill of test_stop_and_resume.py, as a script: `python checkpoint_drill.py ROOT ROUNDS SEED` prints one
JSON summary.

Each round forks two ranks (gloo, FSDP2 over both: two shard files per save) that resume as training does
(latest_checkpoint, then load_checkpoint into the sharded model, the optimizer and a GradScaler), check that they got
exactly the step they resumed from, then save step after step without pause through the real save_checkpoint (DCP
shards, trainer state, rename, `latest`, --keep-last 2) until the driver SIGKILLs both at a random moment. The ranks
are forked from this one process, which imported torch and ran one save and load on a world of one first (FSDP2's
and DCP's lazy imports and first calls, seconds on a busy machine): a round costs a fork, not an interpreter start.

At the end one shard of the newest step is overwritten with junk of its own length, which no size check sees:
loading it must end in one UserError line on both ranks."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from paraseek.errors import UserError
from paraseek.models.checkpoint_read import latest_checkpoint
from paraseek.train.checkpoint import load_checkpoint, save_checkpoint

WORLD = 2


def _build(world: int = WORLD):
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 256)).sum().backward()
    optimizer.step()  # AdamW's moments exist
    optimizer.zero_grad()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # its scale tensor exists
    return model, optimizer, scaler


@torch.no_grad()
def _fill(model, optimizer, scaler, step: int) -> None:
    """Every saved number made a function of the step, so a load shows which step it read, whole or not."""
    for p in model.parameters():
        p.to_local().fill_(step)
    for state in optimizer.state.values():
        state["exp_avg"].to_local().fill_(step)
        state["exp_avg_sq"].to_local().fill_(2 * step)
    scaler.update(float(step))


def _holds(model, optimizer, scaler, step: int) -> bool:
    return (all(bool((p.to_local() == step).all()) for p in model.parameters())
            and all(bool((s["exp_avg"].to_local() == step).all()) and bool((s["exp_avg_sq"].to_local() == 2 * step).all())
                    for s in optimizer.state.values())
            and scaler.get_scale() == step)


def _rank(rank: int, root: Path, round_: int, save: bool) -> None:
    """One rank of one round, in a forked child; never returns."""
    code = 0
    log = open(root / "log" / f"{round_}-{rank}.jsonl", "a", buffering=1)
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(str(root / f"store-{round_}"), WORLD)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
        model, optimizer, scaler = _build()
        path = latest_checkpoint(root / "ck")
        step = 0
        if path is not None:
            try:
                state = load_checkpoint(path, model, optimizer, scaler)
            except UserError as e:
                log.write(json.dumps({"error": str(e)}) + "\n")
                os._exit(0)
            step = state["step"]
            exact = _holds(model, optimizer, scaler, step) and state["data"]["position"] == step
            log.write(json.dumps({"resumed": step, "exact": exact}) + "\n")
        else:
            log.write(json.dumps({"resumed": 0, "exact": True}) + "\n")
        while save:
            step += 1
            _fill(model, optimizer, scaler, step)
            log.write(json.dumps({"saving": step}) + "\n")
            save_checkpoint(root / "ck", step, model, optimizer, {"data": {"position": step}}, keep_last=2,
                            scaler=scaler)
            log.write(json.dumps({"saved": step}) + "\n")
    except BaseException:
        log.write(json.dumps({"crash": traceback.format_exc()}) + "\n")
        code = 1
    os._exit(code)


def _fork(rank: int, root: Path, round_: int, save: bool) -> int:
    pid = os.fork()
    if pid == 0:
        _rank(rank, root, round_, save)
    return pid


def _rows(root: Path, round_: int, rank: int) -> list[dict]:
    path = root / "log" / f"{round_}-{rank}.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]  # a line cut by the kill: no


def _round(root: Path, round_: int, save: bool, rng: random.Random) -> dict:
    pids = [_fork(rank, root, round_, save) for rank in range(WORLD)]
    if save:
        deadline = time.monotonic() + 120
        while not all(_rows(root, round_, r) for r in range(WORLD)) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))  # a save takes 0.05-0.3 s here: most kills land in one
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        os.waitpid(pid, 0)
    rows = [_rows(root, round_, r) for r in range(WORLD)]
    first = [r[0] if r else {"crash": "no output"} for r in rows]
    return {"first": first, "saved": max([r["saved"] for r in rows[0] if "saved" in r], default=None),
            "killed_mid_save": save and "saving" in rows[0][-1]}


def _warm_up(root: Path) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model, optimizer, scaler = _build(world=1)
    _fill(model, optimizer, scaler, 1)
    path = save_checkpoint(root / "warm-up", 1, model, optimizer, {}, scaler=scaler)
    load_checkpoint(path, model, optimizer, scaler)
    dist.destroy_process_group()  # no process group (and none of gloo's threads) is forked


def main(root: Path, rounds: int, seed: int) -> dict:
    rng = random.Random(seed)
    (root / "log").mkdir(parents=True, exist_ok=True)
    _warm_up(root)
    results = [_round(root, n, True, rng) for n in range(rounds)]
    results.append(_round(root, rounds, False, rng))  # the last kill's leftovers, resumed once more
    newest = latest_checkpoint(root / "ck")
    shard = newest / "__0_0.distcp"
    shard.write_bytes(random.Random(seed).randbytes(shard.stat().st_size))
    damaged = _round(root, rounds + 1, False, rng)["first"]
    return {"rounds": results, "damaged": damaged}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))))
