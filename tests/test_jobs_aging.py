"""Interactive requests overtake a running offline job, and the job still progresses.

The worker is saturated by realtime requests the whole time (always more queued than a
batch holds), so strict priority would starve the job. With aging, a `batch` line is
overtaken only by realtime requests that arrive within its class delay (1 s here).
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from batchery import Client
from tests.conftest import run_cli, start_worker, stop_process, wait_for
from tests.jobs_helpers import read_jsonl, start_jobs_worker, submit, wait_state, write_lines

pytestmark = pytest.mark.slow
BATCH_DELAY_S = 1.0
REALTIME_IN_FLIGHT = 12   # three batches' worth: the worker never runs out of realtime work


class Flood(threading.Thread):
    """Keeps REALTIME_IN_FLIGHT realtime requests queued until stopped."""

    def __init__(self, redis_url: str, queue: str) -> None:
        super().__init__(daemon=True)
        self.redis_url, self.queue = redis_url, queue
        self.stop = threading.Event()
        self.done: list[tuple[float, Any]] = []  # (arrival time, Result)

    def run(self) -> None:
        with Client(self.redis_url, self.queue) as client:
            for result in client.stream(self._requests(), max_in_flight=REALTIME_IN_FLIGHT,
                                        timeout=30):
                self.done.append((time.monotonic(), result))

    def _requests(self) -> Iterator[dict[str, Any]]:
        i = 0
        while not self.stop.is_set():
            yield {"input": f"rt {i}", "priority": "realtime"}
            i += 1


def test_realtime_overtakes_running_job_which_still_finishes(
        redis_url: str, queue_name: str, tmp_path: Path) -> None:
    assert run_cli("queue", "config", queue_name, "--class-delay", f"batch={BATCH_DELAY_S}",
                   redis_url=redis_url).returncode == 0
    source = write_lines(tmp_path / "in.jsonl",
                         [{"custom_id": f"j{i}", "input": f"job {i}"} for i in range(40)])
    output = tmp_path / "out.jsonl"
    jobs_queue = f"jobs-{queue_name}"
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:slow",
                          "--max-batch-size", "4", "--max-wait-ms", "0",
                          BATCHERY_TEST_SLEEP="0.05")
    jobs_worker = start_jobs_worker(redis_url, jobs_queue)
    flood = Flood(redis_url, queue_name)
    try:
        flood.start()
        wait_for(lambda: len(flood.done) >= 3 * REALTIME_IN_FLIGHT, 60,
                 message="the worker to be busy with realtime requests")
        started = time.monotonic()
        job = submit(redis_url, jobs_queue, queue_name, source, output, "--priority", "batch")
        view = wait_state(redis_url, job, "finished", "failed", timeout=60)
        finished = time.monotonic()
        flood.stop.set()
        flood.join(30)
    finally:
        flood.stop.set()
        stop_process(jobs_worker)
        stop_process(worker)

    assert view["state"] == "finished" and view["ok"] == 40  # progressed under full load
    job_waits = [line["queued_ms"] for line in read_jsonl(output)]
    during = [r for t, r in flood.done if started <= t <= finished]
    realtime_waits = [r.queued_ms for r in during]
    assert len(during) >= 40  # realtime work kept flowing while the job ran
    # realtime overtakes: its waits are shorter; a job line waits about its class delay
    assert statistics.median(realtime_waits) < statistics.median(job_waits)
    assert statistics.median(job_waits) >= 500 * BATCH_DELAY_S
    # ... and no longer than its delay plus the work ranked ahead of it (at most the whole
    # job and a realtime window), at the rate this machine ran requests meanwhile
    seconds_per_request = (finished - started) / (len(during) + 40)
    ahead = 40 + REALTIME_IN_FLIGHT
    assert max(job_waits) < 1000 * (BATCH_DELAY_S + 2 * ahead * seconds_per_request) + 500
