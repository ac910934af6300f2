"""What `paraseek train`'s launcher adds to its workers' environment, and that glibc reads the malloc settings as
meant (its loader lists the tunables it parsed)."""

import gc
import glob
import os
import subprocess

import pytest

from paraseek.monitor.metrics import GcClock
from paraseek.train.config import TrainConfig
from paraseek.train.launch import worker_env


def test_gpu_workers_keep_large_blocks_on_the_heap():
    env = worker_env(TrainConfig(device="cuda", nproc=2))
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    loaders = sorted(glob.glob("/lib64/ld-linux-*.so*") + glob.glob("/lib/ld-linux-*.so*"))
    if not loaders or not os.confstr("CS_GNU_LIBC_VERSION"):
        pytest.skip("no glibc loader here to parse GLIBC_TUNABLES")
    listed = subprocess.run([loaders[0], "--list-tunables"], env={"GLIBC_TUNABLES": env["GLIBC_TUNABLES"]},
                            capture_output=True, text=True, check=True).stdout
    values = {line.split(":")[0]: int(line.split(":")[1].split()[0], 16) for line in listed.splitlines()
              if line.startswith("glibc.malloc.")}
    assert values["glibc.malloc.mmap_threshold"] == 32 << 20
    assert values["glibc.malloc.trim_threshold"] == 4 << 30


def test_cpu_workers_get_no_gpu_settings():
    env = worker_env(TrainConfig(device="cpu", nproc=4))
    assert "GLIBC_TUNABLES" not in env and "PYTORCH_CUDA_ALLOC_CONF" not in env
    assert int(env["OMP_NUM_THREADS"]) == max(1, (os.cpu_count() or 1) // 4)


def test_gc_clock_counts_collections_and_resets():
    clock = GcClock()
    try:
        garbage = [[] for _ in range(1000)]
        for a, b in zip(garbage, garbage[1:]):
            a.append(b)
            b.append(a)  # cycles: only the collector frees them
        del garbage, a, b
        gc.collect()
        assert clock.take() > 0
        assert clock.take() == 0
    finally:
        clock.close()
    assert clock._on not in gc.callbacks
