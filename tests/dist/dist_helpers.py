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


# ---- many `paraseek train` commands in a few process starts (run_trains) ---------------------------------------------
_TRAINS = """
import json, os, sys, tempfile, time, traceback, warnings
import torch
torch.set_num_threads(1)  # no thread pool in this process, which forks the workers (each sets its command's count)
import torch.distributed.run as torch_run
from paraseek.cli import main

def redirected(paths, fn):
    # fn() with file descriptors 1 and 2 (what torch's C++ side writes too) going to the files `paths`
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    for fd, path in zip((1, 2), paths):
        with open(path, "w") as f:
            os.dup2(f.fileno(), fd)
    try:
        return fn()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)

def launch(argv):  # `python -m paraseek train ARGV` up to its call of torch's launcher
    getattr(warnings, "_filters_mutated", lambda: None)()  # every warning prints again, as in a fresh process
    try:
        return main(["train", *argv])
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0 if e.code is None else print(e.code, file=sys.stderr) or 1
    except BaseException:
        traceback.print_exc()
        return 1

runs, port, tmp = json.loads(open(sys.argv[1]).read()), int(sys.argv[2]), sys.argv[3]
base_env, launched = dict(os.environ), []
for i, (argv, cwd) in enumerate(runs):
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(base_env, PARASEEK_CACHE=os.path.join(cwd, "cache"))
    row = {}

    def capture(args, row=row):  # torch's launcher, with what `paraseek train` hands it
        assert args.standalone, "one node only"
        row["nproc"] = int(args.nproc_per_node)
        row["env"] = {k: v for k, v in os.environ.items() if base_env.get(k) != v}

    torch_run.run = capture
    row["code"] = redirected((f"{tmp}/launch{i}.out", f"{tmp}/launch{i}.err"), lambda: launch(argv))
    launched.append(row)
os.chdir(tmp)
os.environ.clear()
os.environ.update(base_env)

def worker(rank, world, commands):  # paraseek.train.worker for each command in turn, in a forked process
    import torch.distributed as dist
    import torch.distributed.tensor.debug as dtensor_debug
    from paraseek.train.config import TrainConfig
    from paraseek.train.stop import STOP
    from paraseek.train.worker import CONFIG_ENV, train_code

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    init_process_group = dist.init_process_group
    STOP.install()
    codes = {}
    for i in commands:
        cwd, env = runs[i][1], launched[i]["env"]
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(base_env, **env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=f"run{i}", TORCHELASTIC_RESTART_COUNT="0")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # the launcher's choice for the command
        getattr(warnings, "_filters_mutated", lambda: None)()
        # DTensor caches its sharding decisions by mesh shape and names, not by process group: an earlier
        # command's entry would send this one's collectives to that command's (destroyed) groups.
        dtensor_debug._clear_python_sharding_prop_cache()
        dtensor_debug._clear_fast_path_sharding_prop_cache()
        # each command's process group on keys of its own in the one store
        dist.init_process_group = lambda backend, *a, i=i, **kw: init_process_group(
            backend, *a, store=dist.PrefixStore(f"run{i}/", store), rank=rank, world_size=world, **kw)

        def run():  # paraseek.train.worker.run without its exit: the next command follows in this process
            try:
                return train_code(TrainConfig(**json.loads(env[CONFIG_ENV])))
            except BaseException:
                traceback.print_exc()
                return 1

        codes[i] = redirected((f"{tmp}/out{i}.{rank}", f"{tmp}/err{i}.{rank}"), run)
        if dist.is_initialized():  # a failed command leaves its group: the next one makes its own
            dist.destroy_process_group()
    with open(f"{tmp}/codes{world}.{rank}", "w") as f:
        json.dump(codes, f)

groups = {}
for i, row in enumerate(launched):
    if "nproc" in row:
        groups.setdefault(row["nproc"], []).append(i)
for world, commands in groups.items():
    pids = []
    for rank in range(world):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                worker(rank, world, commands)
                code = 0
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # as paraseek.train.worker leaves (gloo's threads may abort an interpreter's teardown)
        pids.append(pid)
    deadline = time.monotonic() + 600
    while pids and time.monotonic() < deadline:
        for pid in list(pids):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                pids.remove(pid)
                assert os.waitstatus_to_exitcode(status) == 0, f"a worker of {world} failed"
        time.sleep(0.05)
    for pid in pids:
        os.kill(pid, 9)
    assert not pids, f"the workers of {world} did not finish in 600 s"
with open(f"{tmp}/launched.json", "w") as f:
    json.dump([[row.get("nproc"), row["code"]] for row in launched], f)
"""


def run_trains(runs: list[tuple[list[str], Path]], check: bool = True,
               env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """`paraseek train ARGV` in folder CWD for each (argv, cwd), in one process start instead of one launch each (a
    worker's imports take seconds; its training here, a fraction of one). One Python process runs every command's
    launcher (paraseek.cli.main in the command's folder, PARASEEK_CACHE=CWD/cache as run_train sets it) up to its
    call of torch's launcher; then, for each process count, it forks that many workers, which train the commands of
    that count one after the other (paraseek.train.worker.train_code with the configuration and environment the
    launcher handed over), each command in a process group of its own.

    What each command printed (its launcher's lines, then each rank's) and its exit code come back as run_train's
    would, and its files are where the command writes them: the same losses to the bit as one launch each
    (PARASEEK_TEST_LAUNCH_EACH=1 runs them that way). Every launcher runs before any worker: a command that needs
    another's output (a resume) goes in a later call. `env`: added to the commands' environment."""
    import tempfile

    import torch.distributed as dist

    env = dict(os.environ, **(env or {}), PYTHONPATH=SRC)
    if os.environ.get("PARASEEK_TEST_LAUNCH_EACH") == "1":
        saved = dict(os.environ)
        os.environ.update(env)
        try:
            return [run_train(*argv, cwd=cwd, check=check) for argv, cwd in runs]
        finally:
            os.environ.clear()
            os.environ.update(saved)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "runs.json").write_text(json.dumps([[list(a), str(c)] for a, c in runs]))
        store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)  # the workers' rendezvous
        r = subprocess.run([sys.executable, "-c", _TRAINS, str(Path(tmp) / "runs.json"), str(store.port), tmp],
                           capture_output=True, text=True, env=env, timeout=1200)
        del store
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        results, launched = [], json.loads((Path(tmp) / "launched.json").read_text())
        for i, ((argv, _), (nproc, code)) in enumerate(zip(runs, launched)):
            files = [(f"launch{i}.out", f"launch{i}.err")] + [(f"out{i}.{rank}", f"err{i}.{rank}")
                                                            for rank in range(nproc or 0)]
            if nproc:  # the launcher started workers: the command's code is the first failing rank's
                codes = [json.loads((Path(tmp) / f"codes{nproc}.{rank}").read_text())[str(i)] for rank in range(nproc)]
                code = next((c for c in codes if c != 0), 0)
            out, err = ("".join((Path(tmp) / f[k]).read_text() for f in files) for k in (0, 1))
            results.append(subprocess.CompletedProcess(["paraseek", "train", *argv], code, out, err))
    for res in results if check else ():
        if res.returncode != 0:
            raise AssertionError(f"paraseek train failed ({res.returncode}):\n{res.stdout[-3000:]}\n"
                                 f"{res.stderr[-3000:]}")
    return results


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
