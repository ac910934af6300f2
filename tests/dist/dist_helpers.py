"""Run `paraseek train` as a user would (a subprocess through torch's launcher) and read its metrics back."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

SRC = str(Path(__file__).resolve().parents[2] / "src")
# The training-issue settings for exact comparisons: fp32, constant lr 0.01, no warm-up.
EXACT = ["--device", "cpu", "--precision", "fp32", "--lr", "0.01", "--lr-schedule", "constant", "--warmup-steps", "0",
         "--data", "synthetic", "--seq-len", "32", "--global-batch-size", "8"]


def run_train(*argv: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC, PARASEEK_CACHE=str(cwd / "cache"))
    r = subprocess.run([sys.executable, "-m", "paraseek", "train", *argv], capture_output=True, text=True, env=env,
                       cwd=cwd, timeout=600)
    if check and r.returncode != 0:
        raise AssertionError(f"paraseek train failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


_REFUSALS = """
import json, os, sys, tempfile, traceback, warnings
from paraseek.cli import main
results = []
for argv, cwd in json.loads(sys.argv[1]):
    os.chdir(cwd)
    os.environ["PARASEEK_CACHE"] = os.path.join(cwd, "cache")
    getattr(warnings, "_filters_mutated", lambda: None)()  # every warning prints again, as in a fresh process
    # The case's own stdout and stderr at the file-descriptor level: what torch's C++ side writes is caught too.
    files = [tempfile.TemporaryFile("w+") for _ in range(2)]
    saved = [os.dup(1), os.dup(2)]
    for fd, f in zip((1, 2), files):
        os.dup2(f.fileno(), fd)
    try:
        code = main(["train", *argv])  # what `python -m paraseek train ARGV` runs: raise SystemExit(main())
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else print(e.code, file=sys.stderr) or 1
    except BaseException:
        traceback.print_exc()  # as the interpreter prints an exception that escapes
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, old in zip((1, 2), saved):
        os.dup2(old, fd)
        os.close(old)
    out, err = (f.seek(0) or f.read() for f in files)
    results.append([code, out, err])
with open(sys.argv[2], "w") as f:
    json.dump(results, f)
"""


def run_train_refusals(runs: list[tuple[list[str], Path]]) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of `paraseek train ARGV` run in folder CWD for each (argv, cwd) that the parent
    must refuse before any worker starts, all in one Python process (one torch import instead of one per case): each
    goes through paraseek.cli.main as `python -m paraseek` does, in its folder (PARASEEK_CACHE=CWD/cache, as
    run_train sets it), with its own stdout and stderr (file descriptors 1 and 2); an exception that escapes main is
    printed with its traceback, as the interpreter would."""
    import tempfile

    env = dict(os.environ, PYTHONPATH=SRC)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        r = subprocess.run([sys.executable, "-c", _REFUSALS, json.dumps([[list(a), str(c)] for a, c in runs]),
                            str(out)], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return [tuple(row) for row in json.loads(out.read_text())]


def step_losses(jsonl: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "event" not in r}


def seed_checkpoint(model: str, folder: Path) -> Path:
    """One random initialization saved as an HF folder, so every plan starts from the same weights.

    The router weights get std 1 instead of 0.02: with near-uniform initial scores, a 1e-7 difference in the order
    of a gradient reduction can flip one token's top-k expert and move the loss by ~1e-4 a few steps later. A
    decisive router keeps top-k choices away from ties, so the comparison measures the plan, not a coin flip."""
    from paraseek.models import resolve_model, save_pretrained

    if not (folder / "config.json").exists():
        args, _, _ = resolve_model(model)
        save_pretrained(seeded_model(args), folder)
    return folder


def seeded_model(args):
    """The tests' one random initialization of `args` (seed 1234, fp32, CPU) with decisive routers (std 1)."""
    from paraseek.models import build_model
    from paraseek.models.deepseek import Gate

    torch.manual_seed(1234)
    model = build_model(args, "cpu", torch.float32)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Gate):
                m.weight.normal_(0.0, 1.0)
    return model


def plain_torch_losses(folder, steps: int, lr_of=lambda step: 0.01) -> dict[int, float]:
    """The engine's losses computed another way: about 30 lines that share nothing with the engine but the model code
    and the data (EXACT's synthetic data, batch and sequence; `lr_of(step)` the learning rate of each step)."""
    import torch.nn.functional as F

    from paraseek.models import load_pretrained
    from paraseek.train.dataset import open_dataset

    global_batch, seq = 8, 32
    model = load_pretrained(folder, dtype=torch.float32)
    # The engine's documented settings: AdamW(0.9, 0.95), eps 1e-8, weight decay 0.1, global-norm clip 1.0.
    opt = torch.optim.AdamW(model.parameters(), lr=lr_of(1), betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    data = open_dataset("synthetic", seq_len=seq, vocab_size=model.args.vocab_size, seed=0)
    losses = {}
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_of(step)
        batch = torch.stack([data.sequence(i) for i in range((step - 1) * global_batch, step * global_batch)])
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())  # the mean over the global batch
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses[step] = loss.item()
    return losses


def assert_same_losses(got: dict[int, float], ref: dict[int, float], rtol: float) -> None:
    assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))
    for step in ref:
        assert abs(got[step] - ref[step]) <= rtol * abs(ref[step]), (step, got[step], ref[step])


# ---- in-process workers for module-level tests (torch.multiprocessing spawn, a FileStore in the test's folder) ------
def _spawn_worker(rank: int, world: int, workdir: str, fn, kwargs: dict) -> None:
    import traceback

    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(os.path.join(workdir, "store"), world)
        if kwargs.get("device") == "cuda":
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", store=store, rank=rank, world_size=world,
                                    device_id=torch.device("cuda", rank))
        else:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        try:
            out = fn(rank, world, **kwargs)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        torch.save(out, os.path.join(workdir, f"out{rank}.pt"))
    except BaseException:
        Path(workdir, f"err{rank}.txt").write_text(traceback.format_exc())
        raise


def spawn(fn, world: int, workdir: Path, **kwargs) -> list:
    """Run fn(rank, world, **kwargs) in `world` fresh processes joined in one gloo (or nccl, with device="cuda")
    group; returns each rank's result. A worker's traceback fails the test."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_spawn_worker, args=(r, world, str(workdir), fn, kwargs)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    errors = [Path(workdir, f"err{r}.txt").read_text() for r in range(world) if Path(workdir, f"err{r}.txt").exists()]
    if errors or any(p.exitcode != 0 for p in procs):
        for p in procs:
            if p.is_alive():
                p.kill()
        raise AssertionError(f"worker failed ({[p.exitcode for p in procs]}):\n" + "\n".join(errors))
    return [torch.load(Path(workdir) / f"out{r}.pt") for r in range(world)]
