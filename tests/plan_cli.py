"""`paraseek plan ARGS` run in this process, its exit code and stdout: the planner's CLI tests share it."""

import argparse
import io
from contextlib import redirect_stdout

from paraseek.planner.cli import register


def run_plan_cli(*argv: str) -> tuple[int, str]:
    p = argparse.ArgumentParser(prog="paraseek")
    register(p.add_subparsers(dest="command", required=True))
    ns = p.parse_args(["plan", *argv])
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = ns.func(ns)
    return rc, buf.getvalue()
