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


def pytest_collection_modifyitems(config, items):
    """The `unit` tier: tests/unit's single-process tests (`make test-unit`; `make test` runs them first, then the
    rest). Groups for `pytest -n N --dist loadgroup`: one worker runs a whole test file (its module fixtures are built
    once), and one worker runs all of tests/serve (the servers its conftest shares between files start once)."""
    import pytest

    for item in items:
        if "/tests/unit/" in item.path.as_posix() and item.get_closest_marker("dist") is None:
            item.add_marker(pytest.mark.unit)
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        path = item.path.as_posix()
        group = "serve" if "/tests/serve/" in path else path
        item.add_marker(pytest.mark.xdist_group(group))
