"""Fixtures of the server tests: the model folder, its tokenizer, and the servers several modules share (session
scope: each starts once). A failing test gets the stderr of every server it used appended to its report."""

from __future__ import annotations

import pytest
from serve_helpers import _LIVE, KEY, LIMIT, ROOT, Server, make_model_folder


@pytest.fixture(scope="session")
def folder(tmp_path_factory):
    return make_model_folder(tmp_path_factory.mktemp("serve-model"))


@pytest.fixture(scope="session")
def tokenizer(folder):
    from paraseek.models.tokenizer import load_text_tokenizer

    return load_text_tokenizer(folder)


@pytest.fixture(scope="session")
def server(folder):
    """The default server: every test that does not need special flags shares it."""
    s = Server(folder)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def strict(folder):
    """A server that wants an API key and takes small bodies only."""
    s = Server(folder, "--api-key", KEY, "--max-body-bytes", str(LIMIT))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def narrow(folder):
    """One sequence at a time and two waiting at most: a few concurrent requests fill the queue (429s)."""
    s = Server(folder, "--max-queue", "2", "--max-num-seqs", "1")
    yield s
    s.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed:
        for s in _LIVE:
            if s.started_by == item.nodeid or any(v is s for v in item.funcargs.values()):
                rep.sections.append((f"paraseek serve :{s.port} ({s.proc.poll()=})", s.stderr()[-6000:]))


TEMPLATES = ROOT / "tests/fixtures/chat_templates"


@pytest.fixture(scope="session")
def long_folder(tmp_path_factory):
    """The same model and tokenizer with a 2,048-token context: tool lists and forced outputs fit."""
    return make_model_folder(tmp_path_factory.mktemp("serve-model-long"), max_len=2048)


@pytest.fixture(scope="session")
def tool_server(long_folder):
    """The R1-Distill template (the model folder's own) with room for tools."""
    s = Server(long_folder)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def v3_server(long_folder):
    """The same model with DeepSeek-V3's hub template (no reasoning block): forced tool calls and structured
    outputs start at the first token, so a random model completes them."""
    s = Server(long_folder, "--chat-template", str(TEMPLATES / "deepseek_v3.jinja"))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def v31_server(long_folder):
    """DeepSeek-V3.1's template: its tool-call syntax (bare name, bare JSON)."""
    s = Server(long_folder, "--chat-template", str(TEMPLATES / "deepseek_v3_1.jinja"))
    yield s
    s.stop()
