"""Several nodes: the rendezvous endpoint checked before launch, the interface NCCL and gloo will use, a join of every
node's launcher before torch's own rendezvous (so that a node that never comes is named: torch's c10d rendezvous only
says that it timed out, and a node started with other flags is refused), and the SLURM batch script.

The join runs on the rendezvous port itself: node 0 hosts a multi-tenant TCPStore there, which torch's c10d
rendezvous in the same process then shares (`torch.distributed.elastic.rendezvous.c10d_rendezvous_backend`), so no
second port needs to be open between the nodes.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import shlex
import socket
import sys
import time

from paraseek.errors import UserError

# "1" allows a loopback rendezvous endpoint with --nnodes > 1: every node's launcher runs on this machine (tests,
# trying a multi-node command on one host). Anywhere else a loopback endpoint cannot be reached by the other nodes.
ONE_HOST_ENV = "PARASEEK_NODES_ON_ONE_HOST"
_KEY = "paraseek/nodes/"  # the join's keys in the store (torch's rendezvous uses its own prefix)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT (or [IPv6]:PORT) -> (host, port)."""
    host, _, port = endpoint.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UserError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT with a port from 1 to 65535, e.g. "
                        "node0:29500")
    return host, int(port)


def check_endpoint(endpoint: str) -> str:
    """The endpoint's address as this node resolves it; refused when it does not resolve, or resolves to a loopback
    address the other nodes cannot reach (unless PARASEEK_NODES_ON_ONE_HOST=1)."""
    host, port = parse_endpoint(endpoint)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UserError(f"--rdzv-endpoint {endpoint}: {host!r} does not resolve on this node ({e.strerror}); give "
                        "node 0's hostname or IP address") from None
    address = infos[0][4][0]
    if ipaddress.ip_address(address.split("%")[0]).is_loopback and os.environ.get(ONE_HOST_ENV) != "1":
        raise UserError(f"--rdzv-endpoint {endpoint} resolves to the loopback address {address} on this node, which "
                        f"the other nodes cannot reach; give node 0's hostname or IP address ({ONE_HOST_ENV}=1 allows "
                        "it when every node's launcher runs on this one machine)")
    return address


def route_interface(address: str, port: int) -> tuple[str, str]:
    """(interface name, local address) by which this node reaches `address`: the kernel's route, asked by connecting
    a UDP socket (which sends nothing). The name is "" when it cannot be told (IPv6, or no interface holds it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((address, port))
        local = s.getsockname()[0]
    if family == socket.AF_INET6:
        return "", local
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(packed[20:24]) == local:
                return name, local
    return "", local


def pin_interfaces(cfg) -> str:
    """Set NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME, where the user has not, to the interface that reaches node 0
    (gloo otherwise binds to what the hostname resolves to, often 127.0.1.1, and NCCL guesses), and say which."""
    host, port = parse_endpoint(cfg.rdzv_endpoint)
    address = check_endpoint(cfg.rdzv_endpoint)
    name, local = route_interface(address, port)
    parts = []
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if os.environ.get(var):
            parts.append(f"{var}={os.environ[var]} (yours)")
        elif name:
            os.environ[var] = name
            parts.append(f"{var}={name}")
        else:
            parts.append(f"{var} unset")
    why = (f"{name} ({local}) is the interface that reaches {address}" if name else
           f"no interface holds {local}, the address that reaches {address}: set both to the one to use")
    return (f"node {cfg.node_rank} of {cfg.nnodes} ({socket.gethostname()}): rendezvous at {host}:{port}; sockets "
            f"{', '.join(parts)}; {why}")


def join_nodes(cfg):
    """Wait until every node's launcher has joined at the endpoint, at most --rdzv-timeout seconds; a node that did
    not come, two launchers with one --node-rank, or nodes started with different flags cost one line each.
    Returns the store, which must stay alive through the launch on node 0 (torch's rendezvous shares it)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    print(pin_interfaces(cfg), flush=True)
    host, port = parse_endpoint(cfg.rdzv_endpoint)
    n, me, wait_s = cfg.nnodes, cfg.node_rank, cfg.rdzv_timeout
    deadline = time.monotonic() + wait_s
    if me != 0:  # wait for node 0's port here: TCPStore's own retries log a C++ stack trace each
        while not _accepts(host, port):
            if time.monotonic() > deadline:
                raise UserError(f"node 0 did not answer at {cfg.rdzv_endpoint} within {wait_s:g} s: start node 0's "
                                f"launcher (--node-rank 0), or check that this node reaches {host} on port {port}")
            time.sleep(0.2)
    try:
        store = TCPStore(host, port, is_master=me == 0, multi_tenant=True, wait_for_workers=False,
                         timeout=timedelta(seconds=wait_s))
    except (RuntimeError, TimeoutError) as e:  # torch's DistStoreError is a RuntimeError
        where = f"node 0 cannot listen on port {port}" if me == 0 else f"the store at {cfg.rdzv_endpoint} failed"
        raise UserError(f"{where} ({str(e).splitlines()[0]}); is another job using it? give --rdzv-endpoint "
                        "another port") from None
    if store.add(f"{_KEY}{me}/count", 1) > 1:
        raise UserError(f"two launchers joined as --node-rank {me}; give each node its own rank from 0 to {n - 1}")
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "node_rank"}
    store.set(f"{_KEY}{me}", json.dumps({"host": socket.gethostname(), "config": config}))
    try:
        while missing := [r for r in range(n) if not store.check([f"{_KEY}{r}"])]:
            if time.monotonic() > deadline:
                joined = ", ".join(f"node {r} on {json.loads(store.get(f'{_KEY}{r}'))['host']}"
                                   for r in range(n) if r not in missing)
                ranks = ", ".join(map(str, missing))
                raise UserError(f"node{'s' if len(missing) > 1 else ''} {ranks} did not join the rendezvous at "
                                f"{cfg.rdzv_endpoint} within {wait_s:g} s (joined: {joined}); start paraseek train "
                                f"with the same flags and --node-rank {missing[0]} there, or check that it reaches "
                                f"{host}:{port}")
            time.sleep(0.1)
        reference = json.loads(store.get(f"{_KEY}0"))["config"]
        for r in range(n):
            other = json.loads(store.get(f"{_KEY}{r}"))["config"]
            if diff := [k for k in reference if other.get(k) != reference[k]]:
                k = diff[0]
                raise UserError(f"node {r} was started with other flags than node 0 ({k}: {other.get(k)!r} vs "
                                f"{reference[k]!r}); start every node with the same flags")
    except RuntimeError as e:  # node 0 left, and its store with it
        raise UserError(f"the rendezvous at {cfg.rdzv_endpoint} went away ({str(e).splitlines()[0]}); node 0's "
                        "launcher stopped, and its own message says why") from None
    return store


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def slurm_script(cfg, flags: list[str]) -> str:
    """An sbatch script that runs this training on cfg.nnodes nodes: one `paraseek train` launcher per node (it runs
    torchrun's agent in-process), node 0 the allocation's first host, requeued on preemption or near the time limit
    and continued from the newest checkpoint with --resume."""
    if cfg.nnodes < 2:
        raise UserError("--slurm writes a multi-node job: give --nnodes N (2 or more)")
    if not cfg.checkpoint_dir:
        raise UserError("--slurm requeues the job on preemption and continues it with --resume: give "
                        "--checkpoint-dir (on a file system every node shares)")
    command = [sys.executable, "-m", "paraseek", "train", *flags]
    gpus = [f"#SBATCH --gpus-per-node={cfg.nproc}"] if cfg.device == "cuda" and cfg.nproc else []
    pinned = os.environ.get("NCCL_SOCKET_IFNAME")
    ifname = (f"export NCCL_SOCKET_IFNAME={shlex.quote(pinned)} "
              f"GLOO_SOCKET_IFNAME={shlex.quote(os.environ.get('GLOO_SOCKET_IFNAME') or pinned)}" if pinned
              else "# export NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0")
    return "\n".join([
        "#!/bin/bash",
        "# Written by `paraseek train ... --slurm`. Submit with: sbatch THIS_FILE",
        "# One paraseek train launcher per node (torchrun's agent, in-process); node 0 is the allocation's first",
        "# host. Preempted or near the time limit, every rank checkpoints and stops, the job is requeued and the",
        "# next run continues from the newest checkpoint (--resume).",
        "#SBATCH --job-name=paraseek-train",
        f"#SBATCH --nodes={cfg.nnodes}",
        "#SBATCH --ntasks-per-node=1",
        *gpus,
        "#SBATCH --exclusive",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@300",
        "#SBATCH --open-mode=append",
        "#SBATCH --output=paraseek-train-%j.out",
        "set -uo pipefail",
        "",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "port=${PARASEEK_RDZV_PORT:-29500}",
        "# NCCL's and gloo's sockets. Unset, paraseek train takes on every node the interface that routes to $head",
        "# and prints it; pin the fast fabric's here instead (the same name on every node):",
        ifname,
        "",
        "requeue=0 interrupted=0",
        "# The time limit is 5 minutes away: every rank checkpoints and stops, then the job requeues itself.",
        "trap 'echo \"paraseek: SIGUSR1: checkpoint, stop, requeue\"; requeue=1 interrupted=1; kill -TERM $pid' USR1",
        "# Preempted (or scancel): SLURM signals every rank itself and requeues the job (--requeue).",
        "trap 'echo \"paraseek: SIGTERM: every rank checkpoints and stops\"; interrupted=1' TERM",
        "",
        "srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c 'exec \"$@\" --node-rank \"$SLURM_NODEID\"' paraseek \\",
        "  " + " ".join(shlex.quote(a) for a in command)
        + f' --nnodes {cfg.nnodes} --rdzv-endpoint "$head:$port" --resume &',  # last: it wins over the flags
        "pid=$!",
        'wait "$pid"; rc=$?',
        '# A trap ends the wait early; wait again for the step\'s own exit code (bash keeps it once it has ended).',
        'while [ "$interrupted" = 1 ]; do interrupted=0; wait "$pid"; rc=$?; done',
        'if [ "$requeue" = 1 ]; then scontrol requeue "$SLURM_JOB_ID"; fi',
        'exit "$rc"',
        "",
    ])


def slurm_flags(argv: list[str]) -> list[str]:
    """The `paraseek train` flags of `argv` (after the subcommand) without those the script sets per node."""
    out, skip = [], False
    for a in argv:
        name = a.split("=", 1)[0]
        if skip:
            skip = False
        elif name in ("--nnodes", "--node-rank", "--rdzv-endpoint"):
            skip = "=" not in a  # the value is the next word
        elif name not in ("--slurm", "--print-config"):
            out.append(a)
    return out
