"""What scripts/gpu/validate.py (training) and scripts/gpu/infer_validate.py (inference) share: the environment of
their runs, a subprocess runner, the peers' launchers, and the loop that runs named suites.

    python scripts/gpu/validate.py SUITE[,SUITE...] --out DIR [--anchors DIR]
    python scripts/gpu/infer_validate.py SUITE[,SUITE...] --out DIR [--anchors DIR]

Each suite's rows go to DIR/results.json ({suite: [row, ...]}, rewritten after every suite, so a run cut short keeps
what it measured) and the last lines printed are one line per row. BENCHMARKS.md ("Reproducing") lists the suites
and the table each one feeds.

Peers. A few suites run a peer in the same run, from launchers that are not part of this repository: TorchTitan
(torchtitan_peer.sh), the HF + FSDP2 training baseline (hf_fsdp2_baseline.py), gpt-fast (gptfast_decode_peer.py)
and a torch.distributed bus-bandwidth reference (nccl_busbw.py). They are looked up in --anchors DIR, else in the
folder $PARASEEK_ANCHORS names; a suite that needs one refuses to start without it. Every other suite runs without.

SUITE_DEADLINE_S=SECONDS cuts every run at that many seconds after the start (each run's own limit still holds):
the runs cut report exit code 124 and the rest are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
# src first, then whatever the caller put on the path (wheels installed with --target: torchao, the serve extra)
ENV = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1",
           PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
MODELS = Path(os.environ.get("VALIDATE_MODELS", "/tmp/validate-models"))  # saved model folders, out of --out
CORPUS = ROOT / "src" / "paraseek" / "assets" / "corpus"
PY = sys.executable
DEADLINE = time.time() + float(os.environ.get("SUITE_DEADLINE_S", "1e9"))


def sh(argv: list[str], timeout: int, env: dict | None = None) -> tuple[int, str]:
    """Run argv from the repository root: its exit code (124 past `timeout` or the deadline) and stdout + stderr."""
    t0 = time.time()
    timeout = max(1, min(timeout, int(DEADLINE - t0)))
    try:
        r = subprocess.run(argv, env=env or ENV, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = 124, (e.stdout or b"").decode(errors="replace"), (e.stderr or b"").decode(errors="replace")
    print(f"  [{time.time() - t0:.0f} s, rc {rc}] {' '.join(Path(x).name if '/' in x else x for x in argv[1:])[:170]}",
          flush=True)
    if rc:
        print("\n".join((out + err).splitlines()[-12:]), flush=True)
    return rc, out + ("\n" + err if err else "")


def stop_server(server: subprocess.Popen, timeout: int) -> int | str:
    """SIGTERM (the server drains and exits), then its exit code; killed if it has not exited within `timeout` s."""
    server.send_signal(signal.SIGTERM)
    try:
        return server.wait(timeout)
    except subprocess.TimeoutExpired:
        server.kill()
        return f"killed after {timeout} s"


# A suite: its function (called with DIR, and with the peers' folder after it when it runs a peer) and the peers'
# launchers it runs, by file name.
Suite = tuple[Callable[..., list[dict]], tuple[str, ...]]


def main(doc: str, suites: dict[str, Suite], line: Callable[[dict], str]) -> None:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suites", help="comma-separated, of: " + ", ".join(suites))
    p.add_argument("--out", required=True, help="folder for results.json and the suites' files")
    p.add_argument("--anchors", default=os.environ.get("PARASEEK_ANCHORS"),
                   help="folder of the peers' launchers (default: $PARASEEK_ANCHORS)")
    a = p.parse_args()
    names = a.suites.split(",")
    unknown = [n for n in names if n not in suites]
    if unknown:
        p.error(f"unknown suite(s) {', '.join(unknown)}; expected: {', '.join(suites)}")
    peers = sorted({f for n in names for f in suites[n][1]})
    missing = [f for f in peers if not (a.anchors and (Path(a.anchors) / f).is_file())]
    if missing:
        where = f"not in {a.anchors}" if a.anchors else "no --anchors DIR and no PARASEEK_ANCHORS"
        p.error(f"the peers' launchers these suites run: {', '.join(missing)} ({where})")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if shutil.which("nvidia-smi"):
        print(subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip())
    import torch

    print(f"torch {torch.__version__}, {torch.cuda.device_count()} GPU(s), "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    results = {}
    for n in names:
        print(f"== {n} ({time.strftime('%H:%M:%S')})", flush=True)
        fn, needs = suites[n]
        results[n] = fn(out, str(Path(a.anchors).resolve())) if needs else fn(out)
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    for n, rows in results.items():
        print(f"== {n} results")
        for r in rows:
            print(line(r), flush=True)
