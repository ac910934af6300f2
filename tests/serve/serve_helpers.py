"""What the server tests share: a tiny-dense HF folder with a DeepSeek-R1 tokenizer and chat template, `paraseek
serve` subprocesses on free 127.0.0.1 ports (polled on /health, stopped with SIGTERM), metrics as numbers, and
`paraseek generate` as the reference. (A module of its own, as tests/dist/dist_helpers.py: test modules import it
by name, which they cannot do reliably with a conftest.py.)"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[2]
NAME = "tiny"  # --served-model-name of every test server
KEY = "sk-test-key"
LIMIT = 4096  # --max-body-bytes of the strict server
PROMPTS = ["In the beginning", "The word was", "And God said", "Vanity of vanities", "A soft answer",
           "Blessed are the", "There was a man", "Now the serpent"]


def _tokenizer_helpers():
    """tests/unit/test_tokenizer.py's make_folder (the bundled BPE grown into a hub-like R1 tokenizer folder)."""
    spec = importlib.util.spec_from_file_location("_paraseek_test_tokenizer", ROOT / "tests/unit/test_tokenizer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_model_folder(root: Path, max_len: int | None = None) -> Path:
    """tiny-dense with random weights and DeepSeek-R1-Distill-Qwen's tokenizer files (its real chat template, the
    DeepSeek chat tokens as added tokens). The vocabulary is 2,112 instead of 2,048 so that the 15 added tokens
    (ids 2048..2062) are ids the model can read and emit; everything else is the tiny-dense preset, whose context is
    512 tokens unless `max_len` says otherwise (a tool list in the prompt takes several hundred of the small
    vocabulary's tokens)."""
    from paraseek.models import ModelArgs, build_model, preset_config, save_pretrained

    cfg = preset_config("tiny-dense")
    cfg["vocab_size"] = 2112
    if max_len is not None:
        cfg["max_position_embeddings"] = max_len
    torch.manual_seed(0)
    model = root / "tiny-r1"
    save_pretrained(build_model(ModelArgs.from_hf_config(cfg), "cpu", torch.float32), model)
    add_tokenizer(model, root)
    return model


def add_tokenizer(model: Path, root: Path) -> None:
    """DeepSeek-R1-Distill-Qwen's tokenizer files (2,112 ids with the added tokens) into a model folder, made under
    `root`. config.json stays the model's; the tokenizer folder's is only a model_type hint for transformers."""
    tok = _tokenizer_helpers().make_folder(root / "tokenizer", "deepseek_r1_distill_qwen")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tok / f, model / f)


# ---- servers ---------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LIVE: list[Server] = []  # every server started in this session, for the failure report


class Server:
    """One `paraseek serve FOLDER` subprocess on a free port; stderr goes to a file the report can show."""

    def __init__(self, folder: Path, *flags: str, ready_timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "paraseek", "serve", str(folder), "--port", str(self.port),
                     "--served-model-name", NAME, *flags]
        self._log = tempfile.NamedTemporaryFile("w+", prefix="paraseek-serve-", suffix=".log", delete=False)
        # One intra-op thread: the tiny model gains nothing from more, and the test process and other servers
        # share the (two) cores. The checkout's src first, then any PYTHONPATH already set (on the GPU machine the
        # [serve] packages travel as wheels on it).
        path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, cwd=ROOT)
        self.started_by = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        _LIVE.append(self)
        self.wait_ready(ready_timeout)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"paraseek serve exited with {self.proc.returncode} before it was ready:\n"
                                   f"{self.stderr()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"paraseek serve was not healthy within {timeout:.0f} s:\n{self.stderr()}")

    def stderr(self) -> str:
        if self._log.closed:
            return self._final_log
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")

    def client(self, **kw):
        import openai

        kw.setdefault("api_key", "unused")
        # no retries: a test that expects a 429 or 503 must see it, not a retry of it
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=120, **kw)

    def async_client(self, **kw):
        import openai

        kw.setdefault("api_key", "unused")
        return openai.AsyncOpenAI(base_url=self.url + "/v1", max_retries=0, timeout=120, **kw)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as name{labels} -> value (labels sorted, as 'name{k="v"}')."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for fam in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=10).text):
            for s in fam.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_metric(self, name: str, want: float, timeout: float = 10.0) -> float:
        """Poll /metrics until `name` equals `want`; returns the last value seen (the caller asserts)."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.metrics()[name]
            if value == want or time.monotonic() > deadline:
                return value
            time.sleep(0.05)

    def rss_kib(self) -> int:
        """The server process's resident set (VmRSS in /proc/PID/status)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS line")

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        if not self._log.closed:  # keep the text for a failure report, drop the file
            self._final_log = self.stderr()
            self._log.close()
            os.unlink(self._log.name)


# ---- the reference: `paraseek generate` ---------------------------------------------------------------------------
def generate(folder: Path, prompts: list[str], max_new_tokens: int, *flags: str) -> list[dict]:
    """`paraseek generate FOLDER --prompt ... --json --temperature 0` in this process; one dict per prompt."""
    from paraseek.cli import main

    argv = ["generate", str(folder), "--json", "--quiet", "--temperature", "0", "--max-new-tokens",
            str(max_new_tokens), *flags]
    for p in prompts:
        argv += ["--prompt", p]
    buf = io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the servers run (OMP_NUM_THREADS=1), so the float reductions are the same
    try:
        with redirect_stdout(buf):
            rc = main(argv)
    finally:
        torch.set_num_threads(threads)
    assert rc == 0, f"paraseek generate failed ({rc})"
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def token_strings(tokenizer, ids: list[int]) -> list[str]:
    """How the server names tokens in logprobs (each decoded alone, special tokens kept)."""
    return [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
