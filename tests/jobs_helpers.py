"""Helpers for the offline job tests: files, the real CLI, real jobs-worker processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

from tests.conftest import ROOT, cli_env, run_cli, wait_for


def write_lines(path: Path, lines: Iterable[Any]) -> Path:
    """One line per item: dicts as JSON, strings as they are."""
    with open(path, "w", encoding="utf-8") as f:
        for item in lines:
            f.write((item if isinstance(item, str) else json.dumps(item)) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def requests(n: int, prefix: str = "r") -> list[dict[str, Any]]:
    return [{"custom_id": f"{prefix}{i}", "input": f"text {i}"} for i in range(n)]


def start_jobs_worker(redis_url: str | None, jobs_queue: str, *args: str,
                      log: Path | None = None) -> subprocess.Popen:
    """A real `batchery job worker` process (1 s heartbeats: a killed one is noticed in 3 s)."""
    command = [sys.executable, "-m", "batchery", "job", "worker", "--jobs-queue", jobs_queue,
               "--heartbeat", "1", *args]
    if log is None:
        return subprocess.Popen(command, cwd=ROOT, env=cli_env(redis_url),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(log, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(command, cwd=ROOT, env=cli_env(redis_url), stdout=out,
                                stderr=subprocess.STDOUT)


def submit(redis_url: str | None, jobs_queue: str, queue: str, input: Path, output: Path,
           *args: str) -> str:
    done = run_cli("job", "submit", str(input), "-o", str(output), "--queue", queue, "--jobs-queue",
                   jobs_queue, *args, redis_url=redis_url)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    assert len(job_id) == 12 and job_id.isalnum(), done.stdout
    return job_id


def status(redis_url: str | None, job_id: str) -> dict[str, Any]:
    done = run_cli("job", "status", job_id, "--json", redis_url=redis_url)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def wait_state(redis_url: str | None, job_id: str, *states: str, timeout: float = 60) -> dict[str, Any]:
    return wait_for(lambda: (s := status(redis_url, job_id))["state"] in states and s,
                    timeout=timeout, interval=0.2, message=f"job {job_id} to be {states}")


def wait_done_at_least(redis_url: str, job_id: str, n: int, timeout: float = 60) -> dict[str, Any]:
    return wait_for(lambda: (s := status(redis_url, job_id))["ok"] + s["error"] >= n and s,
                    timeout=timeout, interval=0.1, message=f"job {job_id} to do {n} lines")
