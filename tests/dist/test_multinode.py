"""Two "nodes" on this machine: two launchers with --nnodes 2 --node-rank 0/1 --rdzv-endpoint
127.0.0.1:PORT (allowed by PARASEEK_NODES_ON_ONE_HOST=1), 2 gloo processes each, give the single-process losses
within 1e-4 relative (test_data_parallel's tolerance: FSDP2 over 4 ranks only reorders the gradient reductions); the
reference is test_reference_loop's plain-torch loop, which the engine's one process equals within 1e-4 there. Each
launcher names the interface its sockets use; a node that never comes is named in one line, and so is a node started
with other flags, before any worker starts."""

import os
import socket
import subprocess
import sys

import pytest
from dist_helpers import EXACT, SRC, assert_same_losses, seed_checkpoint, step_losses
from test_reference_loop import STEPS, plain_torch_losses

pytestmark = pytest.mark.dist
FLAGS = [*EXACT, "--model", "tiny-dense", "--steps", str(STEPS), "--micro-batch-size", "2", "--nproc", "2",
         "--nnodes", "2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launchers(cwd, *runs):
    """Start every launcher at once (argv per run; each names its --node-rank) and wait for all of them."""
    env = dict(os.environ, PYTHONPATH=SRC, PARASEEK_CACHE=str(cwd / "cache"), PARASEEK_NODES_ON_ONE_HOST="1")
    procs = [subprocess.Popen([sys.executable, "-m", "paraseek", "train", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=cwd) for argv in runs]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def test_two_nodes_give_the_single_process_losses(tmp_path):
    init = seed_checkpoint("tiny-dense", tmp_path / "init")
    common = [*FLAGS, "--dp-shard", "4", "--init-from", str(init), "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
              "--rdzv-timeout", "300", "--metrics-jsonl", "m.jsonl"]
    nodes = _launchers(tmp_path, [*common, "--node-rank", "0"], [*common, "--node-rank", "1"])
    for rank, r in enumerate(nodes):
        assert r.returncode == 0, (rank, r.stdout[-2000:], r.stderr[-2000:])
        first = r.stdout.splitlines()[0]
        assert first.startswith(f"node {rank} of 2 (") and "NCCL_SOCKET_IFNAME=lo, GLOO_SOCKET_IFNAME=lo" in first
    assert "4 x cpu | FSDP2 dp_replicate=1 dp_shard=4" in nodes[0].stdout + nodes[1].stdout  # one job of 4 ranks
    ref = plain_torch_losses(init, STEPS)
    assert_same_losses(step_losses(tmp_path / "m.jsonl"), ref, rtol=1e-4)
    assert ref[STEPS] < ref[1]


def test_a_missing_node_or_other_flags_cost_one_line(tmp_path):
    """On three ports at once: node 0 alone (node 1 is named after --rdzv-timeout), node 1 alone (node 0 is), and
    two nodes whose flags differ (both refuse). No worker starts in any of them."""
    alone, lone, mixed = _free_port(), _free_port(), _free_port()

    def at(port, rank, *extra):
        return [*FLAGS, "--rdzv-endpoint", f"127.0.0.1:{port}", "--node-rank", str(rank), "--metrics-jsonl",
                f"run{port}/m.jsonl", *extra]

    results = _launchers(tmp_path, at(alone, 0, "--rdzv-timeout", "2"), at(lone, 1, "--rdzv-timeout", "2"),
                         at(mixed, 0, "--rdzv-timeout", "120"), at(mixed, 1, "--rdzv-timeout", "120", "--lr", "0.02"))
    lines = [r.stderr.strip().splitlines() for r in results]
    assert [r.returncode for r in results] == [2, 2, 2, 2], lines
    assert lines[0] == [f"paraseek: error: node 1 did not join the rendezvous at 127.0.0.1:{alone} within 2 s (joined: "
                        f"node 0 on {socket.gethostname()}); start paraseek train with the same flags and --node-rank "
                        f"1 there, or check that it reaches 127.0.0.1:{alone}"]
    assert lines[1] == [f"paraseek: error: node 0 did not answer at 127.0.0.1:{lone} within 2 s: start node 0's "
                        f"launcher (--node-rank 0), or check that this node reaches 127.0.0.1 on port {lone}"]
    assert lines[2] == lines[3] == ["paraseek: error: node 1 was started with other flags than node 0 (lr: 0.02 vs "
                                    "0.01); start every node with the same flags"]
    assert not list(tmp_path.glob("run*"))  # no worker ran: no progress records, no metrics
