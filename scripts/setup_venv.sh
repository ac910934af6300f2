#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment. Never pulls a multi-GB CUDA wheel:
#  - a machine whose python3 already has a CUDA torch (the GPU machine, offline) reuses it;
#  - anywhere else we install the CPU wheel torch==2.13.0 first, so "torch>=2.11" is already satisfied.
set -euo pipefail
venv=${1:-.venv}
if python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  # The GPU machine's python3 is itself a virtualenv: a venv made from it (even --system-site-packages) sees the
  # base interpreter's packages, not its torch. So .venv/bin/python is that very interpreter, and the Makefile runs
  # the checkout with PYTHONPATH=src (nothing is installed; the machine is offline).
  # A wrapper, not a symlink: a symlink outside that venv's folder would lose the venv's site-packages.
  mkdir -p "$venv/bin"
  printf '#!/bin/sh\nexec %s "$@"\n' "$(python3 -c 'import sys; print(sys.executable)')" > "$venv/bin/python"
  chmod +x "$venv/bin/python"
else
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q torch==2.13.0
  "$venv/bin/python" -m pip install -q -e ".[test]"
fi
