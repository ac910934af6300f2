"""The new-user trial (scripts/trial/mistakes.py): its table is well formed and covers every command and every class
of mistake, and a few of its cheap entries (caught before torch is imported, under a second each) pass here, as
this user and, from root, as nobody. The whole trial (minutes) is run by hand:
`PYTHONPATH=src .venv/bin/python scripts/trial/mistakes.py` (and `--as-user nobody` from root)."""

import importlib.util
import os
import shutil
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
    "train: --sequence-length",
    "train: --config key sequence_len",
    "train: --config a binary file",
]


def _commands() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return set(sub.choices)


def test_the_table_is_well_formed_and_covers_every_command():
    names = [mk.name for mk in trial.MISTAKES]
    assert len(names) >= 280
    assert len(set(names)) == len(names), "two entries with one name"
    commands = _commands()
    for mk in trial.MISTAKES:
        command, _, what = mk.name.partition(": ")
        assert what and command in commands | {"paraseek"}, mk.name
        assert mk.phrase and all(isinstance(a, str) for a in mk.argv), mk.name
        assert all(isinstance(k, str) and k and not k.startswith("/") for k in mk.files), mk.name
        assert set(mk.fixtures.values()) <= {"checkpoint"}, mk.name
        assert mk.rc in (0, 2) and (not mk.leaves or mk.rc == 0), mk.name  # only a run that goes on leaves files
    covered = {mk.name.partition(": ")[0] for mk in trial.MISTAKES}
    assert commands <= covered, f"no mistake of {sorted(commands - covered)}"


def test_the_table_has_every_class_of_mistake():
    def count(test):
        return sum(1 for mk in trial.MISTAKES if test(mk))

    assert count(lambda mk: any(a.startswith(("/proc/", "/sys/")) for a in mk.argv) or
                 any(v.startswith("/proc/") for v in mk.env.values())) >= 12  # no one may write there, root neither
    assert count(lambda mk: mk.user_only) >= 8  # read-only folders and files, unreadable data: a non-root user's
    assert count(lambda mk: mk.setup is not None) >= 4  # damaged caches and checkpoints
    for reader in ("parquet", ".jsonl", ".txt", "safetensors", "tokenizer.json", "token cache", "hardware",
                   "--config a binary", "config.json"):
        assert count(lambda mk: reader in mk.name) >= 1, reader
    for flag in ("--profile-steps", "--sequence-parallel false", "--pp-schedule", "fp8", "--seq-len past",
                 "--resume of a run that is done", "--resume into a folder that does not exist"):
        assert count(lambda mk: flag in mk.name) >= 1, flag
    assert count(lambda mk: mk.rc == 0) >= 2


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return trial.Trial(tmp_path_factory.mktemp("trial"))


@pytest.mark.parametrize("name", CHEAP)
def test_a_cheap_entry_is_handled_right(runner, name):
    mk = next(mk for mk in trial.MISTAKES if mk.name == name)
    why, err, _ = runner.check(mk)
    assert not why, f"{name}: {'; '.join(why)}\n{err}"


def _as_nobody(root: Path):
    """A Trial whose commands run as nobody, with an interpreter nobody can run, or None where there is none."""
    root.mkdir()
    runner = trial.Trial(root, "nobody")
    if not runner.run_problem():
        return runner
    # a venv made from a Python under /root: the system's own Python of the same version, given the venv's packages
    python = shutil.which(f"python{sys.version_info.major}.{sys.version_info.minor}", path="/usr/bin:/usr/local/bin")
    runner = trial.Trial(root, "nobody", python) if python else None
    return runner if runner is not None and not runner.run_problem() else None


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="drops from root to nobody")
def test_cheap_entries_run_as_nobody_from_root(tmp_path):
    runner = _as_nobody(tmp_path / "trial")
    if runner is None:
        pytest.skip("no Python here that nobody can run")
    assert not runner.as_root
    for name in ("train: --stpes typo", "train: --config a binary file"):
        mk = next(mk for mk in trial.MISTAKES if mk.name == name)
        why, err, _ = runner.check(mk)
        assert not why, f"{name}: {'; '.join(why)}\n{err}"
