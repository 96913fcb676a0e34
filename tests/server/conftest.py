"""End-to-end tests of `voom serve` through the official Python SDKs.

One `voom serve` runs for the whole session on the committed chat fixture
(tests/fixtures/tiny_chat, served as model id "tiny-chat"): a tiny random-weights
Llama with a real BPE tokenizer and a ChatML template with tools. Its output is
gibberish but deterministic under greedy decoding, which is what the tests check.

The server is started when this conftest is configured, before any test module is
imported, and these environment variables are set for the test modules:

- VOOM_TEST_BASE_URL: the server's root, without "/v1" (e.g. "http://127.0.0.1:4321").
  Anthropic's SDK takes it as is; OpenAI's SDK takes VOOM_TEST_BASE_URL + "/v1"
  (the server also answers every route without "/v1").
- VOOM_TEST_MODEL: the model id ("tiny-chat").

Fixtures: `base_url` (the root, as above), `openai_base_url` (root + "/v1"), `model`,
`server_log` (a function returning the server's stderr so far), `harmony_base_url`
(a second server on tests/fixtures/tiny_harmony, a random gpt-oss with the harmony
chat format, model id "tiny-harmony").

The binary: $VOOM_BIN, else ${CARGO_TARGET_DIR:-target}/debug/voom under the repo
root (what `cargo build --profile test -p voom-server --bin voom` writes; scripts/test
builds it first). To test a server that is already running instead, set
VOOM_TEST_BASE_URL (and VOOM_TEST_MODEL) yourself: no server is started then.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "tiny_chat"
MODEL_ID = "tiny-chat"
START_TIMEOUT_S = 60


def voom_bin() -> Path:
    if os.environ.get("VOOM_BIN"):
        return Path(os.environ["VOOM_BIN"])
    target = Path(os.environ.get("CARGO_TARGET_DIR", "target"))
    if not target.is_absolute():
        target = REPO / target
    return target / "debug" / "voom"


class _Server:
    """A `voom serve` child process on a temporary models dir."""

    def __init__(
        self, extra_args: list[str] | None = None, fixture: Path = FIXTURE, model_id: str = MODEL_ID
    ) -> None:
        binary = voom_bin()
        if not binary.is_file():
            raise pytest.UsageError(
                f"{binary} does not exist: build it with "
                "`cargo build --profile test -p voom-server --bin voom` or set VOOM_BIN"
            )
        self.tmp = tempfile.mkdtemp(prefix="voom-serve-test-")
        shutil.copytree(fixture, Path(self.tmp) / model_id)
        env = {k: v for k, v in os.environ.items() if not k.startswith("VOOM_")}
        env["VOOM_LOG"] = "info"
        if "VOOM_HOME" in os.environ:
            env["VOOM_HOME"] = os.environ["VOOM_HOME"]
        self.proc = subprocess.Popen(
            [str(binary), "serve", "--port", "0", "--models-dir", self.tmp, *(extra_args or [])],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
            errors="replace",
        )
        self._lines: list[str] = []
        self._addr: str | None = None
        self._ready = threading.Event()
        # Drains stderr for the server's whole life (a full pipe would block it).
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._ready.wait(START_TIMEOUT_S) or self._addr is None:
            self.stop()
            raise RuntimeError(f"voom serve did not start; stderr:\n{self.log()}")
        self.base_url = f"http://{self._addr}"

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._lines.append(line)
            if self._addr is None and "listening on http://" in line:
                self._addr = line.split("listening on http://", 1)[1].split()[0]
                self._ready.set()
        self._ready.set()

    def log(self) -> str:
        return "".join(self._lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


_server: _Server | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _server
    if os.environ.get("VOOM_TEST_BASE_URL"):
        os.environ.setdefault("VOOM_TEST_MODEL", MODEL_ID)
        return
    _server = _Server()
    os.environ["VOOM_TEST_BASE_URL"] = _server.base_url
    os.environ["VOOM_TEST_MODEL"] = MODEL_ID


def pytest_unconfigure(config: pytest.Config) -> None:
    global _server
    if _server is not None:
        _server.stop()
        _server = None
        os.environ.pop("VOOM_TEST_BASE_URL", None)
        os.environ.pop("VOOM_TEST_MODEL", None)


def pytest_report_header(config: pytest.Config) -> str:
    return f"voom serve at {os.environ.get('VOOM_TEST_BASE_URL')} ({voom_bin()})"


@pytest.fixture(scope="session")
def base_url() -> str:
    """The server's root URL, without "/v1"."""
    return os.environ["VOOM_TEST_BASE_URL"].rstrip("/")


@pytest.fixture(scope="session")
def openai_base_url(base_url: str) -> str:
    return base_url + "/v1"


@pytest.fixture(scope="session")
def model() -> str:
    return os.environ["VOOM_TEST_MODEL"]


@pytest.fixture(scope="session")
def server_log():
    """The server's stderr so far (empty for an external server)."""
    return lambda: _server.log() if _server is not None else ""


@pytest.fixture(scope="session")
def client(openai_base_url: str):
    import openai

    return openai.OpenAI(base_url=openai_base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def start_server():
    """Starts another `voom serve` on the same fixture with extra arguments; returns
    its root URL. Each is stopped at the end of the session."""
    started: list[_Server] = []

    def start(extra_args: list[str]) -> str:
        s = _Server(extra_args)
        started.append(s)
        return s.base_url

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def harmony_base_url():
    """The root URL of a second `voom serve` on tests/fixtures/tiny_harmony (model id
    "tiny-harmony": a random gpt-oss with the harmony chat format), started on first
    use and stopped at the end of the session."""
    s = _Server(fixture=REPO / "tests" / "fixtures" / "tiny_harmony", model_id="tiny-harmony")
    yield s.base_url
    if s.proc.poll() is not None:
        pytest.fail(f"the harmony voom serve exited with {s.proc.returncode}; stderr:\n{s.log()}")
    s.stop()


@pytest.fixture(autouse=True)
def _server_alive():
    """Fails the test that made the server exit, with its log."""
    yield
    if _server is not None and _server.proc.poll() is not None:
        pytest.fail(f"voom serve exited with {_server.proc.returncode}; stderr:\n{_server.log()}")
