"""A lost reply costs seconds, not a lease: a real worker talks to Redis through a proxy
that throws away every reply to one script for longer than the connection retries it, and
each request still ends once, on its first attempt, well before its lease would lapse."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest

from batchery import Client
from batchery.batching.scripts import source
from batchery.connection import RETRIES
from batchery.batching.settings import DEFAULTS
from tests.conftest import RedisServer, start_worker, stop_process, wait_for
from tests.proxy import FaultyProxy

pytestmark = pytest.mark.slow


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[FaultyProxy]:
    proxy = FaultyProxy(redis_server.port)
    yield proxy
    proxy.close()


@pytest.mark.parametrize("script, runner", [
    ("claim", "tests.runners:echo"),        # leases: the batch the lost reply held
    ("complete", "tests.runners:echo"),     # commits
    ("fail", "tests.runners:fails_on_bad"),  # commits a failure (a retry, or a dead letter)
])
def test_a_reply_lost_past_the_retries_costs_seconds_not_a_lease(
        redis_url: str, queue_name: str, proxy: FaultyProxy, tmp_path: Path,
        script: str, runner: str) -> None:
    log = tmp_path / "worker.log"
    with Client(redis_url, queue_name) as client:
        client.queue.update_settings(max_attempts=1)
        client.queue.client.script_load(source(script))  # the reply lost is the script's
        sha = getattr(client.queue.first.scripts, script).sha.encode()
        worker = start_worker(proxy.url, queue_name, "--runner", runner, "--max-wait-ms", "0",
                              log=log)
        try:
            wait_for(lambda: client.queue.stats()["workers"] == 1, 60, message="the worker")
            # the call and every one of the connection's retries lose their reply
            proxy.drop_reply_to(sha, times=RETRIES + 1)
            started = time.monotonic()
            handles = client.enqueue_many([{"input": v} for v in ("a", "b", "bad", "c")])
            results = [h.result(timeout=DEFAULTS.lease_seconds) for h in handles]
            took = time.monotonic() - started
        finally:
            stop_process(worker)
    text = log.read_text()
    assert proxy.faults["replies dropped on purpose"] == RETRIES + 1, text
    assert f"{script} failed" in text or "writing results failed" in text, text
    # recovered by its own replay, never by the reaper: one attempt each, under the lease
    assert [r.attempts for r in results] == [1, 1, 1, 1], results
    assert took < DEFAULTS.lease_seconds * 2 / 3, took
    bad_ok = runner.endswith("echo")
    assert [r.status for r in results] == ["ok", "ok", "ok" if bad_ok else "dead", "ok"]
    assert "Traceback" not in text
