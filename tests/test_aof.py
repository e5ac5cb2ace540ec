"""The embedded server's persistence, AOF with appendfsync everysec, through crashes.

A killed redis-server loses nothing it acknowledged: each write reaches the AOF file (the
kernel's page cache) before the reply. A host crash loses what was not fsync'd yet, at
most about the last second: simulated by restoring the AOF files as they stood before
the last writes. A client waiting for a lost request then ends with a clear error."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from batchery import Client
from batchery.embedded import ensure_server, stop
from tests.conftest import ROOT, cli_env, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def embedded(home: Path) -> Iterator[Path]:
    ensure_server()
    yield home
    stop()


def aof_files(home: Path) -> list[Path]:
    return sorted(p for p in home.iterdir() if p.name.startswith("appendonly"))


def kill_server(home: Path) -> None:
    pid = int((home / "redis.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{pid}").exists() or
             Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z", 30,
             message="the server to die")


def test_the_embedded_server_uses_aof_everysec(embedded: Path) -> None:
    with Client(None, "aof") as client:
        config = client.queue.client.config_get("append*")
    assert config["appendonly"] == "yes" and config["appendfsync"] == "everysec"


def test_a_killed_server_loses_nothing_it_acknowledged(embedded: Path, queue_name: str) -> None:
    with Client(None, queue_name) as client:
        handles = client.enqueue_many([{"input": i} for i in range(200)])
    kill_server(embedded)  # at once: no fsync has to have happened
    ensure_server()  # started again from the AOF
    with Client(None, queue_name) as client:
        assert client.queue.lookup([h.id for h in handles]) == [True] * 200
        assert client.queue.stats()["pending"] == 200


def test_a_host_crash_loses_the_last_writes_and_their_waiter_hears_it(
        embedded: Path, queue_name: str, tmp_path: Path) -> None:
    with Client(None, queue_name) as client:
        kept = client.enqueue_many([{"input": i} for i in range(5)])
    synced = tmp_path / "disk"  # the files as an fsync left them
    synced.mkdir()
    for path in aof_files(embedded):
        (shutil.copytree if path.is_dir() else shutil.copy2)(path, synced / path.name)
    # the last second's request, and a client waiting for it
    waiter = subprocess.Popen([sys.executable, "-m", "batchery", "enqueue", "-q", queue_name,
                               "--text", "written after the last fsync", "--id", "unsynced",
                               "--wait", "--timeout", "120"], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=cli_env(BATCHERY_HOME=str(embedded)))
    with Client(None, queue_name) as client:
        wait_for(lambda: client.queue.is_known("unsynced"), 30, message="the waiter to enqueue")
    kill_server(embedded)  # the host goes down: the page cache with it
    for path in aof_files(embedded):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    for path in synced.iterdir():
        (shutil.copytree if path.is_dir() else shutil.copy2)(path, embedded / path.name)
    ensure_server()
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 6, err  # RequestLost
    assert "'unsynced' is not in Redis any more" in err and "Enqueue it again" in err
    assert "Traceback" not in err and out == ""
    with Client(None, queue_name) as client:  # what was synced is all there
        assert client.queue.lookup([h.id for h in kept]) == [True] * 5
        assert not client.queue.is_known("unsynced")
