"""The new-user trial (scripts/trial/mistakes.py, issue 16): its table is well formed and covers every command, and a
few of its cheap entries (caught before torch is imported, under a second each) pass here. The whole trial (minutes)
is run by hand: `PYTHONPATH=src .venv/bin/python scripts/trial/mistakes.py`."""

import importlib.util
import sys
from pathlib import Path

import pytest

from paraseek.cli import build_parser

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "trial" / "mistakes.py"
_spec = importlib.util.spec_from_file_location("paraseek_trial_mistakes", _PATH)
trial = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = trial  # dataclasses look their module up
_spec.loader.exec_module(trial)

# Entries whose mistake is caught before torch is imported: the sample run here.
CHEAP = [
    "paraseek: a flag before the subcommand",
    "train: --stpes typo",
    "train: --config not valid TOML",
    "train: --steps 0",
    "generate: --stop-token-ids with names",
    "serve: --api-key empty (an unset variable)",
    "plan: --gpus-per-node 0",
    "plan: --scaling with a 0",
    "doctor: --collectives allreduce",
    "bench-serve: --prompts with a broken line",
    "diagnose: an empty folder",
]


def _commands() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return set(sub.choices)


def test_the_table_is_well_formed_and_covers_every_command():
    names = [mk.name for mk in trial.MISTAKES]
    assert len(names) >= 160
    assert len(set(names)) == len(names), "two entries with one name"
    commands = _commands()
    for mk in trial.MISTAKES:
        command, _, what = mk.name.partition(": ")
        assert what and command in commands | {"paraseek"}, mk.name
        assert mk.phrase and all(isinstance(a, str) for a in mk.argv), mk.name
        assert all(isinstance(k, str) and k and not k.startswith("/") for k in mk.files), mk.name
        assert set(mk.fixtures.values()) <= {"checkpoint"}, mk.name
    covered = {mk.name.partition(": ")[0] for mk in trial.MISTAKES}
    assert commands <= covered, f"no mistake of {sorted(commands - covered)}"


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return trial.Trial(tmp_path_factory.mktemp("trial"))


@pytest.mark.parametrize("name", CHEAP)
def test_a_cheap_entry_is_handled_right(runner, name):
    mk = next(mk for mk in trial.MISTAKES if mk.name == name)
    why, err, _ = runner.check(mk)
    assert not why, f"{name}: {'; '.join(why)}\n{err}"
