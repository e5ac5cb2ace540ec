"""Helpers for the dashboard tests: a real `batchery dashboard` process, plain HTTP, and
headless Chromium (Debian's chromium and chromium-driver: `make browser` installs them)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator
from contextlib import contextmanager

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from tests.conftest import ROOT, cli_env, free_port, stop_process, wait_for

TOKEN = "test-token-0123456789abcdef"


@dataclass
class Answer:
    status: int
    body: str
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body)


def http(url: str, method: str = "GET", body: Any = None,
         headers: dict[str, str] | None = None) -> Answer:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return Answer(r.status, r.read().decode(), dict(r.headers))
    except urllib.error.HTTPError as e:
        return Answer(e.code, e.read().decode(), dict(e.headers))


@dataclass
class Dashboard:
    url: str               # ends in /
    proc: subprocess.Popen
    log: Path

    def get(self, path: str, **kw: Any) -> Answer:
        return http(self.url + path, **kw)

    def post(self, path: str, body: Any = None, token: str | None = TOKEN,
             headers: dict[str, str] | None = None) -> Answer:
        sent = dict(headers or {})
        if token:
            sent["X-Batchery-Token"] = token
        return http(self.url + path, "POST", {} if body is None else body, sent)

    def state(self) -> dict[str, Any]:
        answer = self.get("api/state")
        assert answer.status == 200, answer.body
        return answer.json()


@contextmanager
def dashboard(redis_url: str, tmp_path: Path, *args: str, **env: str) -> Iterator[Dashboard]:
    """`batchery dashboard` on a free loopback port (0.5 s samples), with TOKEN unless
    ``args`` give one."""
    port = free_port()
    log = tmp_path / f"dashboard-{port}.log"
    token = () if "--token" in args else ("--token", TOKEN)
    command = [sys.executable, "-m", "batchery", "dashboard", "--port", str(port),
               "--interval", "0.5", *token, *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=cli_env(redis_url, **env), stdout=out,
                                stderr=subprocess.STDOUT)
    board = Dashboard(f"http://127.0.0.1:{port}/", proc, log)
    try:
        wait_for(lambda: _answers(board), 30, 0.1, message=f"the dashboard on port {port} "
                 f"(log: {log.read_text() if log.exists() else ''})")
        yield board
    finally:
        stop_process(proc)


def _answers(board: Dashboard) -> bool:
    if board.proc.poll() is not None:
        raise AssertionError(f"the dashboard exited {board.proc.returncode}: {board.log.read_text()}")
    try:
        return board.get("api/state").status == 200
    except OSError:
        return False


def find(*names: str) -> str:
    found = next((p for p in map(shutil.which, names) if p), None)
    if not found:
        raise AssertionError(f"none of {', '.join(names)} is installed: apt-get install chromium "
                             "chromium-driver (`make browser` does it)")
    return found


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = find("chromium", "chromium-browser", "google-chrome")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(find("chromedriver")))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
