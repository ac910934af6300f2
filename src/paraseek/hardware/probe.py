"""Measurements: bf16 matmul rate and memory bandwidth per GPU, P2P copy bandwidth between every pair of GPUs,
and collective bus bandwidth (all_reduce, all_gather, reduce_scatter, all_to_all) over message sizes.

Conventions are nccl-tests' (doc/PERFORMANCE.md): a message of S bytes is the all_reduce buffer, the all_gather
output, the reduce_scatter input and the all_to_all send buffer; algbw = S / t; busbw = algbw x factor with
factor 2(n-1)/n for all_reduce and (n-1)/n for the others, so busbw compares with the link rate whatever n is.
t is the slowest rank's mean time per call over `iters` calls after `warmup` calls.

Every measurement runs in spawned processes that the parent watches: each task (one GPU's compute, one P2P pair,
one collective at one size) must report within `timeout_s`, otherwise its processes are killed, the task is
recorded as timed out and the remaining tasks continue in fresh processes. A P2P path or a collective that hangs
is thereby reported instead of hanging the doctor.

Under a launcher (torchrun on every node; WORLD_SIZE > 1), `run_launched` measures inside the launched ranks:
collectives over all ranks (the inter-node figure) and inside each node; a hang there ends the job through the
process group's timeout (NCCL's watchdog), since a rank cannot kill itself out of a collective and continue.
"""

from __future__ import annotations

import os
import queue
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
MIB, GIB = 2**20, 2**30
GPU_SIZES = (1 * MIB, 16 * MIB, 256 * MIB, 1 * GIB, 4 * GIB)
CPU_SIZES = (64 * 1024, 1 * MIB, 16 * MIB)


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor for n ranks."""
    return 2 * (n - 1) / n if collective == "all_reduce" else (n - 1) / n


@dataclass
class ProbeConfig:
    sizes: tuple[int, ...] | None = None  # None: GPU_SIZES with NCCL, CPU_SIZES with gloo
    collectives: tuple[str, ...] = COLLECTIVES
    iters: int = 20  # timed calls per collective and size (nccl-tests' default is 20)
    warmup: int = 5
    timeout_s: float = 60.0  # per task: one GPU's compute, one P2P pair, one collective at one size
    startup_timeout_s: float = 180.0  # spawning, importing torch, creating CUDA contexts and communicators
    p2p_bytes: int = 512 * MIB
    hbm_bytes: int = 2 * GIB  # capped at 1/8 of the GPU's memory
    matmul_n: int = 8192  # 8192^3 bf16: ~1 ms on an H100-class GPU, well past launch overhead
    gloo_ranks: int = 2
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------------------
# Work done inside the spawned processes


def _sync(device: Any) -> None:
    import torch

    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_compute(dev: int, cfg: ProbeConfig) -> dict[str, Any]:
    """bf16 matmul TFLOP/s (random data: zeros run faster) and device-to-device copy GB/s (read + write) on one
    GPU, each the mean over timed calls after warm-up, timed with CUDA events."""
    import torch

    torch.cuda.set_device(dev)
    props = torch.cuda.get_device_properties(dev)
    uuid = getattr(props, "uuid", None)
    n = cfg.matmul_n
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        a @ b
    iters = 20
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    torch.cuda.synchronize(dev)
    matmul_s = start.elapsed_time(end) / 1e3 / iters
    del a, b
    nbytes = min(cfg.hbm_bytes, props.total_memory // 8)
    x = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    y.copy_(x)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize(dev)
    copy_s = start.elapsed_time(end) / 1e3 / 10
    del x, y
    torch.cuda.empty_cache()
    return {"cuda_index": dev, "uuid": f"GPU-{uuid}" if uuid else None, "name": props.name,
            "matmul_tflops": round(2 * n**3 / matmul_s / 1e12, 1), "hbm_gbps": round(2 * nbytes / copy_s / 1e9, 1)}


def measure_p2p(src: int, dst: int, cfg: ProbeConfig) -> dict[str, Any]:
    """One-direction copy src -> dst in GB/s (host timer around synchronized copies, as nvidia's p2pBandwidth
    test does), after checking that the bytes arrived intact (a broken P2P path can corrupt silently)."""
    import torch

    nbytes = cfg.p2p_bytes
    x = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=src)
    y = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    y.copy_(x)
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)
    step = 4099
    intact = bool(torch.equal(x[::step].cpu(), y[::step].cpu())) and int(x.sum(dtype=torch.int64)) == int(
        y.sum(dtype=torch.int64))
    for _ in range(2):
        y.copy_(x)
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)
    iters = 10
    t0 = time.perf_counter()
    for _ in range(iters):
        y.copy_(x)
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)
    t = (time.perf_counter() - t0) / iters
    peer = torch.cuda.can_device_access_peer(src, dst)
    del x, y
    torch.cuda.empty_cache()
    return {"src": src, "dst": dst, "gbps": round(nbytes / t / 1e9, 1), "intact": intact, "peer_access": peer}


def time_collective(name: str, nbytes: int, device: Any, cfg: ProbeConfig, group: Any = None) -> float:
    """Mean seconds per call of one collective on this rank (caller takes the max over ranks)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size(group)
    dtype = torch.bfloat16 if device is not None and device.type == "cuda" else torch.float32
    esize = torch.finfo(dtype).bits // 8
    numel = max(n, nbytes // esize // n * n)
    kw = {"device": device or "cpu", "dtype": dtype}
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if name == "all_reduce":
        x = torch.randn(numel, **kw)
        fn: Callable[[], Any] = lambda: dist.all_reduce(x, group=group)
    elif name == "all_gather":
        out, inp = torch.empty(numel, **kw), torch.randn(numel // n, **kw)
        fn = lambda: ag(out, inp, group=group)
    elif name == "reduce_scatter":
        out, inp = torch.empty(numel // n, **kw), torch.randn(numel, **kw)
        fn = lambda: rs(out, inp, group=group)
    elif name == "all_to_all":
        out, inp = torch.empty(numel, **kw), torch.randn(numel, **kw)
        fn = lambda: dist.all_to_all_single(out, inp, group=group)
    else:
        raise ValueError(f"unknown collective {name!r}")
    for _ in range(cfg.warmup):
        fn()
    _sync(device)
    dist.barrier(group=group)
    if device is not None and device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(cfg.iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        t = start.elapsed_time(end) / 1e3 / cfg.iters
    else:
        t0 = time.perf_counter()
        for _ in range(cfg.iters):
            fn()
        t = (time.perf_counter() - t0) / cfg.iters
    del fn
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()
    return t


def _max_over_ranks(t: float, device: Any, group: Any = None) -> float:
    import torch
    import torch.distributed as dist

    tt = torch.tensor([t], dtype=torch.float64, device=device or "cpu")
    dist.all_reduce(tt, op=dist.ReduceOp.MAX, group=group)
    return float(tt.item())


def _device_worker(rank: int, world: int, port: int, tasks: list, q: Any, cfg: ProbeConfig, backend: str) -> None:
    """One process, tasks one after another: ("compute", dev) and ("p2p", src, dst)."""
    import torch

    torch.cuda.init()
    q.put(("ready", None, None))
    for k, task in tasks:
        try:
            res = measure_compute(task[1], cfg) if task[0] == "compute" else measure_p2p(task[1], task[2], cfg)
            q.put(("done", k, res))
        except Exception as e:  # an OOM or a CUDA error on one task: report it, go on
            q.put(("error", k, f"{type(e).__name__}: {str(e)[:300]}"))


def _collective_worker(rank: int, world: int, port: int, tasks: list, q: Any, cfg: ProbeConfig,
                       backend: str) -> None:
    """One rank of `world`: tasks ("coll", name, nbytes) in order; rank 0 reports the slowest rank's time."""
    import torch
    import torch.distributed as dist

    device = None
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    kw = {"device_id": device} if device is not None else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=max(cfg.timeout_s, 30)), **kw)
    dist.barrier()
    if rank == 0:
        q.put(("ready", None, None))
    for k, (_, name, nbytes) in tasks:
        try:
            t = _max_over_ranks(time_collective(name, nbytes, device, cfg), device)
            if rank == 0:
                q.put(("done", k, {"time_s": t}))
        except Exception as e:
            if rank == 0:
                q.put(("error", k, f"{type(e).__name__}: {str(e)[:300]}"))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# The watching parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Reporter:
    """What a worker reports through: put((kind, task key, payload)), kind 'ready', 'done' or 'error'."""

    def __init__(self, conn: Any):
        self.conn = conn

    def put(self, msg: tuple) -> None:
        self.conn.send(msg)


def _stop(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


def run_tasks(worker: Callable[..., None], nprocs: int, tasks: list[tuple], cfg: ProbeConfig, backend: str,
              same_fate: Callable[[tuple, tuple], bool] = lambda a, b: False,
              ) -> tuple[dict[int, Any], dict[int, str]]:
    """Run `tasks` through `nprocs` spawned workers, each task within cfg.timeout_s. Returns (results, errors),
    both keyed by the task's position. After a timeout or a crash the workers are killed, the task is an error,
    so are the remaining tasks `same_fate` with it (a collective that hung at 256 MiB will hang at 1 GiB), and
    the rest continue in fresh workers."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    pending = list(enumerate(tasks))
    while pending:
        # A pipe, not a Queue: send() is written before it returns, so a worker that crashes right after
        # reporting a task has still reported it (a Queue's feeder thread would lose it).
        reader, writer = ctx.Pipe(duplex=False)
        q = _Reporter(writer)
        port = _free_port()
        procs = [ctx.Process(target=worker, args=(r, nprocs, port, pending, q, cfg, backend), daemon=True)
                 for r in range(nprocs)]
        for p in procs:
            p.start()
        writer.close()
        ready = False
        deadline = time.monotonic() + cfg.startup_timeout_s
        done: set[int] = set()
        failure = None
        while len(done) < len(pending):
            try:
                if not reader.poll(0.5):
                    raise queue.Empty
                kind, k, payload = reader.recv()
            except (queue.Empty, EOFError):
                time.sleep(0.05)
                codes = [p.exitcode for p in procs]
                if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
                    failure = f"a worker process died (exit codes {codes})"
                elif time.monotonic() > deadline:
                    failure = (f"did not finish within {cfg.timeout_s:g} s" if ready else
                               f"workers did not start within {cfg.startup_timeout_s:g} s")
                if failure:
                    break
                continue
            if kind == "ready":
                ready = True
            elif kind == "done":
                results[k] = payload
                done.add(k)
            else:
                errors[k] = payload
                done.add(k)
            deadline = time.monotonic() + cfg.timeout_s
        if failure is None:
            for p in procs:
                p.join(timeout=30)
            _stop(procs)
            reader.close()
            break
        _stop(procs)
        reader.close()
        rest = [(k, t) for k, t in pending if k not in done]
        if not ready:  # nothing ran: do not retry the same start for every task
            for k, _ in rest:
                errors[k] = failure
            break
        k0, t0 = rest[0]
        errors[k0] = failure
        for k, t in rest[1:]:
            if same_fate(t0, t):
                errors[k] = f"skipped: {t0[1:]} {failure}"
        pending = [(k, t) for k, t in rest if k not in errors]
    return results, errors


def _summarize(name: str, nbytes: int, n: int, t: float) -> dict[str, Any]:
    algbw = nbytes / t / 1e9
    return {"bytes": nbytes, "time_us": round(t * 1e6, 1), "algbw_gbps": round(algbw, 2),
            "busbw_gbps": round(algbw * busbw_factor(name, n), 2)}


def _positions(node: dict[str, Any], compute: list[dict[str, Any]]) -> dict[int, int]:
    """CUDA device index -> position in the node's NVML GPU list, by UUID (CUDA_VISIBLE_DEVICES and CUDA's
    fastest-first enumeration can both reorder them); by index when UUIDs are missing."""
    by_uuid = {g.get("uuid"): p for p, g in enumerate(node["gpus"]) if g.get("uuid")}
    out = {}
    for c in compute:
        p = by_uuid.get(c.get("uuid"))
        out[c["cuda_index"]] = p if p is not None else c["cuda_index"]
    return out


def measure_local(node: dict[str, Any], cfg: ProbeConfig) -> dict[str, Any]:
    """All measurements on this machine, one process per GPU (NCCL) or cfg.gloo_ranks CPU processes (gloo)."""
    import torch

    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if n_cuda > 0 else "gloo"
    sizes = tuple(cfg.sizes or (GPU_SIZES if backend == "nccl" else CPU_SIZES))
    out: dict[str, Any] = {"backend": backend, "dtype": "bfloat16" if backend == "nccl" else "float32",
                           "iters": cfg.iters, "warmup": cfg.warmup, "gpus": [], "p2p": [], "collectives": {},
                           "errors": [], "skipped": []}
    if n_cuda:
        # Compute first (it also maps CUDA indices to NVML positions by UUID), then every ordered pair.
        tasks = [("compute", d) for d in range(n_cuda)] + [("p2p", i, j) for i in range(n_cuda)
                                                           for j in range(n_cuda) if i != j]
        res, err = run_tasks(_device_worker, 1, tasks, cfg, backend)
        compute = [res[k] for k in sorted(res) if tasks[k][0] == "compute"]
        pos = _positions(node, compute)
        for c in compute:
            out["gpus"].append({"node": node["node"], "position": pos[c["cuda_index"]], **c})
        n_node = len(node["gpus"]) or n_cuda
        if n_cuda > 1:
            gbps: list[list[float | None]] = [[None] * n_node for _ in range(n_node)]
            intact: list[list[bool | None]] = [[None] * n_node for _ in range(n_node)]
            peer: list[list[bool | None]] = [[None] * n_node for _ in range(n_node)]
            for k, r in res.items():
                if tasks[k][0] == "p2p":
                    i, j = pos.get(r["src"], r["src"]), pos.get(r["dst"], r["dst"])
                    gbps[i][j], intact[i][j], peer[i][j] = r["gbps"], r["intact"], r["peer_access"]
            out["p2p"].append({"node": node["node"], "bytes": cfg.p2p_bytes, "gbps": gbps, "intact": intact,
                               "peer_access": peer,
                               "errors": {f"{pos.get(tasks[k][1], tasks[k][1])}->{pos.get(tasks[k][2], tasks[k][2])}":
                                          e for k, e in err.items() if tasks[k][0] == "p2p"}})
        for k, e in err.items():
            out["errors"].append({"what": " ".join(str(x) for x in tasks[k]), "error": e})
        world = n_cuda
        mem = min((g["memory_gib"] for g in node["gpus"] if g.get("memory_gib")), default=None)
    else:
        world, mem = cfg.gloo_ranks, None
    if world < 2:
        out["skipped"].append("collectives: one GPU")
        return out
    ctasks = []
    for name in cfg.collectives:
        for s in sizes:
            if mem is not None and 2 * s > 0.4 * mem * GIB:
                out["skipped"].append(f"{name} {s} B: over 40% of GPU memory")
                continue
            ctasks.append(("coll", name, s))
    res, err = run_tasks(_collective_worker, world, ctasks, cfg, backend,
                         same_fate=lambda a, b: a[1] == b[1] and b[2] >= a[2])
    table: dict[str, list[dict[str, Any]]] = {}
    for k, (_, name, s) in enumerate(ctasks):
        if k in res:
            table.setdefault(name, []).append(_summarize(name, s, world, res[k]["time_s"]))
        else:
            table.setdefault(name, []).append({"bytes": s, "error": err.get(k, "not run")})
            out["errors"].append({"what": f"{name} {s} B", "error": err.get(k, "not run")})
    out["collectives"]["intra_node"] = {"ranks": world, "results": table}
    out["sizes"] = list(sizes)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Under a launcher: every rank runs this


def launched() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ and "MASTER_ADDR" in os.environ


def run_launched(collect_node: Callable[[int], dict[str, Any]], cfg: ProbeConfig, quick: bool,
                 ) -> tuple[list[dict[str, Any]], dict[str, Any] | None] | None:
    """Inventory of every node and the measurements, gathered on global rank 0 (which gets (nodes,
    measurements); the other ranks get None). One rank per GPU (torchrun --nproc-per-node=GPUS), or any number
    of CPU ranks with gloo."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    node_rank = int(os.environ.get("GROUP_RANK", rank // local_world))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > local_rank
    backend = "nccl" if use_cuda else "gloo"
    device = torch.device("cuda", local_rank) if use_cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    kw = {"device_id": device} if device is not None else {}
    dist.init_process_group(backend, timeout=timedelta(seconds=max(cfg.timeout_s, 30)), **kw)
    long = timedelta(seconds=max(1800, cfg.timeout_s * 10))  # waits while local rank 0 measures P2P
    objs = dist.new_group(backend="gloo", timeout=long)
    try:
        node = collect_node(node_rank) if local_rank == 0 else None
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, node, group=objs)
        nodes = sorted((n for n in gathered if n), key=lambda n: n["node"])
        if quick:
            return (nodes, None) if rank == 0 else None
        sizes = tuple(cfg.sizes or (GPU_SIZES if use_cuda else CPU_SIZES))
        meas: dict[str, Any] = {"backend": backend, "dtype": "bfloat16" if use_cuda else "float32",
                                "iters": cfg.iters, "warmup": cfg.warmup, "gpus": [], "p2p": [], "collectives": {},
                                "errors": [], "skipped": [], "sizes": list(sizes), "launched": True}
        mine: dict[str, Any] = {"node": node_rank, "errors": []}
        if use_cuda:
            try:
                mine["compute"] = measure_compute(local_rank, cfg)
            except Exception as e:
                mine["errors"].append({"what": f"compute node {node_rank} gpu {local_rank}", "error": repr(e)})
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine, group=objs)
        my_node = next(n for n in nodes if n["node"] == node_rank)
        p2p = None
        if use_cuda and local_rank == 0 and local_world > 1:
            local = [e["compute"] for e in every if e["node"] == node_rank and "compute" in e]
            pos = _positions(my_node, local)
            tasks = [("p2p", i, j) for i in range(local_world) for j in range(local_world) if i != j]
            res, err = run_tasks(_device_worker, 1, tasks, cfg, "nccl")
            n_node = len(my_node["gpus"]) or local_world
            gbps: list[list[Any]] = [[None] * n_node for _ in range(n_node)]
            intact: list[list[Any]] = [[None] * n_node for _ in range(n_node)]
            peer: list[list[Any]] = [[None] * n_node for _ in range(n_node)]
            for r in res.values():
                i, j = pos.get(r["src"], r["src"]), pos.get(r["dst"], r["dst"])
                gbps[i][j], intact[i][j], peer[i][j] = r["gbps"], r["intact"], r["peer_access"]
            p2p = {"node": node_rank, "bytes": cfg.p2p_bytes, "gbps": gbps, "intact": intact, "peer_access": peer,
                   "errors": {f"{tasks[k][1]}->{tasks[k][2]}": e for k, e in err.items()}}
        dist.barrier(group=objs)
        mem = min((g["memory_gib"] for n in nodes for g in n["gpus"] if g.get("memory_gib")), default=None)
        nnodes = len({e["node"] for e in every})
        intra = None
        if nnodes > 1 and local_world > 1:
            intra, _ = dist.new_subgroups(group_size=local_world)
        scopes = [("world", None)] if nnodes > 1 else [("intra_node", None)]
        if intra is not None:
            scopes.append(("intra_node", intra))
        tables: dict[str, Any] = {}
        for scope, group in scopes:
            n = dist.get_world_size(group)
            table: dict[str, list] = {}
            for name in cfg.collectives:
                for s in sizes:
                    if mem is not None and 2 * s > 0.4 * mem * GIB:
                        continue
                    try:
                        t = _max_over_ranks(time_collective(name, s, device, cfg, group), device, group)
                        table.setdefault(name, []).append(_summarize(name, s, n, t))
                    except Exception as e:  # gloo raises on its timeout; NCCL's watchdog ends the process
                        table.setdefault(name, []).append({"bytes": s, "error": repr(e)[:300]})
            tables[scope] = {"ranks": n, "results": table}
        final = {"mine": mine, "p2p": p2p, "tables": tables if rank == 0 else None}
        allres: list[Any] = [None] * world
        dist.all_gather_object(allres, final, group=objs)
        if rank != 0:
            return None
        for r in allres:
            if "compute" in r["mine"]:
                c = r["mine"]["compute"]
                node_r = next(n for n in nodes if n["node"] == r["mine"]["node"])
                meas["gpus"].append({"node": r["mine"]["node"], "position": _positions(node_r, [c])[c["cuda_index"]],
                                     **c})
            meas["errors"].extend(r["mine"]["errors"])
            if r["p2p"]:
                meas["p2p"].append(r["p2p"])
        meas["collectives"] = tables
        if nnodes > 1 and "intra_node" not in tables:
            meas["skipped"].append("intra_node collectives: one GPU per node")
        return nodes, meas
    finally:
        dist.destroy_process_group()
