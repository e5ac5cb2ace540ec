"""Helpers for the gateway tests: a real `batchery serve` process, real workers (MiniLM
for embeddings, a tiny random GPT-2 for generation) and the unmodified openai SDK."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import openai

from tests.conftest import ROOT, cli_env, free_port, stop_process, wait_for


@dataclass
class Served:
    url: str            # http://127.0.0.1:PORT
    proc: subprocess.Popen
    log: Path
    clients: list[openai.OpenAI] = field(default_factory=list)  # closed with the server

    def client(self, api_key: str = "unused", **kw: Any) -> openai.OpenAI:
        made = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **kw)
        self.clients.append(made)
        return made

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
        request = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()


@contextmanager
def serve(redis_url: str, tmp_path: Path, *args: str, launcher: tuple[str, ...] = (),
          **env: str) -> Iterator[Served]:
    """`batchery serve` on a free loopback port; stopped at the end. ``launcher``: the
    command line before ``serve`` (default: ``python -m batchery``)."""
    port = free_port()
    log = tmp_path / f"serve-{port}.log"
    command = [*(launcher or (sys.executable, "-m", "batchery")), "serve", "--port", str(port),
               *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=cli_env(redis_url, **env), stdout=out,
                                stderr=subprocess.STDOUT)
    served = Served(f"http://127.0.0.1:{port}", proc, log)
    try:
        wait_for(lambda: _answers(served), 60, 0.1, message=f"batchery serve on port {port}")
        yield served
    finally:
        for client in served.clients:
            client.close()
        stop_process(proc)


def _answers(served: Served) -> bool:
    if served.proc.poll() is not None:
        raise AssertionError(f"batchery serve exited {served.proc.returncode}: "
                             f"{served.log.read_text()}")
    try:
        return served.get("/ready")[0] == 200
    except OSError:
        return False


def tiny_gpt2(path: Path) -> Path:
    """The tiny random GPT-2 of the generation tests (torch imported only here)."""
    from tests.generation_helpers import build_gpt2
    return build_gpt2(path)


def jobs_worker(redis_url: str, jobs_queue: str, log: Path) -> subprocess.Popen:
    """`batchery job worker` on its own RQ queue (the test's batches only)."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "batchery", "job", "worker", "--jobs-queue",
                                 jobs_queue], cwd=ROOT, env=cli_env(redis_url), stdout=out,
                                stderr=subprocess.STDOUT)
