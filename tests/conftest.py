import os
import sys

# Tests run from a checkout without installing (the Makefile also sets PYTHONPATH=src).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

# Under pytest-xdist (`make test` runs two workers) each worker gets its share of the cores: torch's default (one thread
# per core) in every worker would oversubscribe them. Set before torch is imported, so its first pool has that size.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _threads = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    os.environ.setdefault("OMP_NUM_THREADS", _threads)
    os.environ.setdefault("MKL_NUM_THREADS", _threads)


# Under `pytest -n N --dist loadgroup` (the Makefile's) a worker runs a whole group: a test file (its module fixtures
# are built once), or all of tests/serve (the servers its conftest shares between files start once). The longest
# groups start first, so that the run does not end on one worker with a long group while the other idles; the rest
# follow in collection order.
LONGEST_FIRST = ("tests/serve", "tests/dist/test_faults.py", "tests/dist/test_pipeline_parallel.py",
                 "tests/dist/test_data_parallel.py", "tests/dist/test_sharded_load.py",
                 "tests/dist/test_fp8_training.py", "tests/dist/test_stop_and_resume.py",
                 "tests/dist/test_mtp_training.py", "tests/dist/test_expert_parallel.py",
                 "tests/dist/test_infer_parallel.py", "tests/dist/test_speculative_parallel.py",
                 "tests/dist/test_checkpoint_resume.py",
                 # the unit tier's
                 "tests/unit/test_fp8.py", "tests/unit/test_fp8_infer.py", "tests/unit/test_speculative.py",
                 "tests/unit/test_infer_lora.py", "tests/unit/test_infer_engine.py",
                 "tests/unit/test_init_from_export.py", "tests/unit/test_doctor_cli.py",
                 "tests/unit/test_compile_moe.py")


def _group(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return "tests/serve" if path.startswith("tests/serve/") else path


def _rank(nodeid: str) -> int:
    group = _group(nodeid)
    return LONGEST_FIRST.index(group) if group in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup by _group. (pytest-xdist's own loadgroup reads its xdist_group marks through item._nodeid,
    which pytest 9 no longer uses for the node id: every test would be scheduled on its own.)"""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    config.option.loadscopereorder = False  # the collection's order, which puts the longest groups first
    return ByGroup(config, log)


def pytest_collection_modifyitems(config, items):
    """The `unit` tier: tests/unit's single-process tests (`make test-unit`; `make test` runs them first, then the
    rest). Under pytest-xdist, the longest groups first (a stable sort: a file's tests keep their order)."""
    import pytest

    for item in items:
        if "/tests/unit/" in item.path.as_posix() and item.get_closest_marker("dist") is None:
            item.add_marker(pytest.mark.unit)
    if config.pluginmanager.hasplugin("xdist") and os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: _rank(item.nodeid))
