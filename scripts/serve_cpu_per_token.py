"""The CPU that `paraseek serve` spends per streamed token, by thread (main = HTTP/asyncio; the others = the engine
thread and torch's), for tiny-dense with random weights on CPU under `paraseek bench-serve` at concurrency 32
(32-token prompts, 256 output tokens). From the repository root: `.venv/bin/python scripts/serve_cpu_per_token.py`.
The GPU version is `scripts/gpu/infer_validate.py serve_profile`; both read /proc the same way (_thread_cpu_s)."""

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "gpu"))
from infer_validate import ENV, PY, _thread_cpu_s  # noqa: E402

PORT = "8197"
url = f"http://127.0.0.1:{PORT}"
server = subprocess.Popen([PY, "-m", "paraseek", "serve", "tiny-dense", "--random-weights", "--port", PORT,
                           "--served-model-name", "t"], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    for _ in range(240):
        try:
            if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                break
        except OSError:
            time.sleep(0.5)
    before = _thread_cpu_s(server.pid)
    r = subprocess.run([PY, "-m", "paraseek", "bench-serve", url, "--model", "t", "--input-len", "32", "--output-len",
                        "256", "--max-concurrency", "32", "--num-prompts", "64", "--seed", "7", "--json"],
                       env=ENV, capture_output=True, text=True, check=True)
    after = _thread_cpu_s(server.pid)
finally:
    server.terminate()
    server.wait(30)
run = json.loads(r.stdout[r.stdout.find("{"):])["runs"][0]
tokens = run["output_throughput"] * run["duration_s"]
print(f"{tokens:.0f} tokens at {run['output_throughput']:.0f} tokens/s; " + "; ".join(
    f"{k}: {1e3 * (after[k] - before.get(k, 0.0)) / tokens:.3f} ms CPU per token" for k in after))
