#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment. Never pulls a multi-GB CUDA wheel:
#  - a machine whose python3 already has a CUDA torch (the GPU machine, offline) reuses it;
#  - anywhere else we install the CPU wheel torch==2.13.0 first, so "torch>=2.11" is already satisfied.
set -euo pipefail
venv=${1:-.venv}
if python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  python3 -m venv --system-site-packages "$venv"
  "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e . \
    || echo "setup_venv: editable install skipped; the Makefile runs with PYTHONPATH=src"
else
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q torch==2.13.0
  "$venv/bin/python" -m pip install -q -e ".[test]"
fi
