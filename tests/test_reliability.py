"""Faults, injected for real: killed and hung workers, bad inputs, OOM, deadlines,
cancellation, signals, a Redis restart. Every accepted request ends with one result."""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
from prometheus_client import REGISTRY

from batchery import Client, Result
from batchery.batching.request import Request
from batchery.batching.queue import RequestQueue
from batchery.batching.reply_lists import results_in
from tests import runners
from tests.conftest import RedisServer, run_cli, start_worker, stop_process, wait_for
from tests.test_client import BackgroundWorker
from tests.test_end_to_end import run_burst

pytestmark = pytest.mark.slow
OBSERVER = "observer"  # a reply list that sees every result pushed for these requests


def enqueue_observed(queue: RequestQueue, inputs: list, **fields) -> list[str]:
    batch = [Request.validated(id=f"q{i}", input=v, **fields) for i, v in enumerate(inputs)]
    queue.enqueue(batch, OBSERVER)
    return [r.id for r in batch]


def pushed_results(queue: RequestQueue) -> list[Result]:
    return [Result.from_json(raw)
            for raw in results_in(queue.client.lrange(queue.keys.reply(OBSERVER), 0, -1))]


def all_done(queue: RequestQueue, ids: list[str]) -> bool:
    return all(r is not None for r in queue.results(ids))


def held_by(queue: RequestQueue, pid: int) -> list[str]:
    return [i for token, ids in queue.leases().items() if f":{pid}:" in token for i in ids]


def freeze_holding(queue: RequestQueue, proc, timeout: float = 30) -> list[str]:
    """SIGSTOP ``proc`` at a moment it holds leases; return what it holds, read while stopped
    (a stopped worker neither commits nor claims, so this is what a kill now loses)."""
    deadline = time.monotonic() + timeout
    while True:
        wait_for(lambda: held_by(queue, proc.pid), max(0.1, deadline - time.monotonic()),
                 message=f"worker {proc.pid} to hold leases")
        proc.send_signal(signal.SIGSTOP)
        held = held_by(queue, proc.pid)
        if held:
            return held
        proc.send_signal(signal.SIGCONT)  # it committed in between: catch the next batch


def test_a_killed_worker_loses_nothing(rconn, redis_url: str, queue_name: str, tmp_path: Path) -> None:
    queue = RequestQueue(rconn, queue_name)
    queue.update_settings(lease_seconds=1)
    slow = {"BATCHERY_TEST_SLEEP": "0.3"}
    victim = start_worker(redis_url, queue_name, "--runner", "tests.runners:slow",
                          "--max-batch-size", "4", log=tmp_path / "victim.log", **slow)
    wait_for(lambda: queue.stats()["workers"] == 1, 60)
    ids = enqueue_observed(queue, list(range(40)))
    lost = freeze_holding(queue, victim)  # what it held at the kill: it cannot commit now
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    survivor = start_worker(redis_url, queue_name, "--runner", "tests.runners:slow",
                            "--max-batch-size", "4", log=tmp_path / "survivor.log", **slow)
    try:
        wait_for(lambda: all_done(queue, ids), 90, message="every request to finish")
    finally:
        stop_process(survivor)
    results = queue.results(ids)
    assert {r.status for r in results} == {"ok"}
    assert [r.output for r in results] == [f"done:{i}" for i in range(40)]
    assert lost and all(queue.result(i).attempts == 2 for i in lost)  # reaped: the lost run counted
    assert not any(f":{victim.pid}:" in queue.result(i).worker for i in lost)
    pushed = pushed_results(queue)
    assert sorted(r.id for r in pushed) == sorted(ids)  # exactly one committed result each


def test_a_hung_workers_late_results_are_discarded(rconn, redis_url: str, queue_name: str,
                                                    tmp_path: Path) -> None:
    queue = RequestQueue(rconn, queue_name)
    queue.update_settings(lease_seconds=1)
    hung = start_worker(redis_url, queue_name, "--runner", "tests.runners:slow", "--max-batch-size",
                        "4", log=tmp_path / "hung.log", BATCHERY_TEST_SLEEP="1.5")
    wait_for(lambda: queue.stats()["workers"] == 1, 60)
    ids = enqueue_observed(queue, list(range(8)))
    taken = freeze_holding(queue, hung)  # hangs mid-batch: no heartbeat, no commits
    helper = start_worker(redis_url, queue_name, "--runner", "tests.runners:echo",
                          log=tmp_path / "helper.log")
    try:
        wait_for(lambda: all_done(queue, ids), 60)
        hung.send_signal(signal.SIGCONT)  # it wakes up and tries to commit its old batch
        wait_for(lambda: "discarded" in (tmp_path / "hung.log").read_text(), 30,
                 message="the late results to be discarded")
    finally:
        hung.send_signal(signal.SIGCONT)
        stop_process(hung)
        stop_process(helper)
    for request_id in taken:
        result = queue.result(request_id)
        assert result.output["echo"] == int(request_id[1:]) and f":{hung.pid}:" not in result.worker
    assert sorted(r.id for r in pushed_results(queue)) == sorted(ids)


def test_a_bad_input_fails_alone_retries_with_backoff_then_dead(redis_url: str, queue_name: str) -> None:
    with Client(redis_url, queue_name) as client:
        handles = client.enqueue_many([{"input": v} for v in ["a", "b", "bad", "c", "d"]])
        started = time.monotonic()
        run_burst(redis_url, queue_name, runners.fails_on_bad)
        elapsed = time.monotonic() - started
        results = [h.result(timeout=30) for h in handles]
    assert [r.status for r in results] == ["ok", "ok", "dead", "ok", "ok"]
    assert [r.output for r in results if r.ok] == ["ok:a", "ok:b", "ok:c", "ok:d"]
    dead = results[2]
    assert dead.attempts == 3 and dead.error == {"type": "RuntimeError", "message": (
        "cannot process 'bad' (attempt 1: RuntimeError: cannot process 'bad'; attempt 2: "
        "RuntimeError: cannot process 'bad'; attempt 3: RuntimeError: cannot process 'bad')")}
    assert elapsed >= 1.5  # backoff: 0.5 s then 1 s between the three attempts
    with Client(redis_url, queue_name) as client:
        assert client.queue.stats()["dead"] == 1


def test_a_dead_letter_keeps_the_runner_error_and_says_how_each_attempt_ended(
        rconn, redis_url: str, queue_name: str, tmp_path: Path) -> None:
    """Two runs raise, the worker running the third is SIGKILLed: the reaper dead-letters
    the request with the runner's error, not only the lost lease."""
    queue = RequestQueue(rconn, queue_name)
    configured = run_cli("queue", "config", queue_name, "--lease-seconds", "1",
                         "--max-attempts", "3", redis_url=redis_url)
    assert configured.returncode == 0, configured.stderr
    victim = start_worker(redis_url, queue_name, "--runner", "tests.runners:fails_twice_then_hangs",
                          log=tmp_path / "victim.log")
    survivor = None
    try:
        with Client(redis_url, queue_name) as client:
            handle = client.enqueue("flaky")
            wait_for(lambda: queue.client.hget(queue.keys.attempts, handle.id) == "2"
                     and held_by(queue, victim.pid), 60, message="the third run to start")
            victim.send_signal(signal.SIGKILL)  # mid-batch: the runner sleeps in it
            victim.wait(10)
            survivor = start_worker(redis_url, queue_name, "--runner", "tests.runners:echo",
                                    log=tmp_path / "survivor.log")  # its reaper takes it back
            result = handle.result(timeout=60)
    finally:
        stop_process(victim)
        if survivor is not None:
            stop_process(survivor)
    assert result.status == "dead" and result.attempts == 3
    assert result.error == {"type": "RuntimeError", "message": (
        "flaky failed on run 2 (attempt 1: RuntimeError: flaky failed on run 1; attempt 2: "
        "RuntimeError: flaky failed on run 2; attempt 3: lease expired, the worker died or hung)")}
    listed = run_cli("queue", "dead", "list", "-q", queue_name, redis_url=redis_url).stdout
    assert listed == f"{handle.id}\tattempts=3\tRuntimeError: {result.error['message']}\n"


def test_an_input_error_fails_at_once_without_retries(redis_url: str, queue_name: str) -> None:
    from batchery.workers.runners.custom import CallableRunner  # noqa: F401 (runner below)
    with Client(redis_url, queue_name) as client:
        handles = client.enqueue_many([{"input": v} for v in ["fine", 12, {"text": "also fine"}]])
        from batchery.connection import RedisSettings
        from batchery.workers.loop import Worker
        from batchery.workers.options import WorkerOptions
        from batchery.workers.runners.base import Prepared, Runner, text_of

        class TextOnly(Runner):
            def prepare(self, inputs):
                texts = [text_of(v) for v in inputs]
                return Prepared(texts, [len(t) for t in texts], len(texts) * max(map(len, texts)))

            def run(self, data):
                return [t.upper() for t in data]
        Worker(RedisSettings.from_url(redis_url), TextOnly(),
               WorkerOptions(queue=queue_name, max_wait_ms=0)).run(burst=True, handle_signals=False)
        results = [h.result(timeout=30) for h in handles]
    assert [r.status for r in results] == ["ok", "error", "ok"]
    assert results[1].attempts == 1 and results[1].error["type"] == "InputError"
    assert "must be a string" in results[1].error["message"]


def test_out_of_memory_halves_batches_and_caps_them(redis_url: str, queue_name: str) -> None:
    labels = {"queue": queue_name}
    before = REGISTRY.get_sample_value("batchery_oom_backoffs_total", labels) or 0
    with Client(redis_url, queue_name) as client:
        handles = client.enqueue_many([{"input": i} for i in range(64)])
        run_burst(redis_url, queue_name, runners.oom_over_4, max_batch_size=16)
        results = [h.result(timeout=30) for h in handles]
    assert {r.status for r in results} == {"ok"} and {r.attempts for r in results} == {1}
    assert max(r.batch_size for r in results) == 4
    backoffs = REGISTRY.get_sample_value("batchery_oom_backoffs_total", labels) - before
    assert 1 <= backoffs <= 3  # 16 -> 8 -> 4, then the cap keeps later batches at 4


def test_a_batch_longer_than_its_lease_runs_once(redis_url: str, queue_name: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The heartbeat renews the leases of a batch that runs past lease_seconds: the reaper
    (this worker's own) leaves it alone, and it commits on its first attempt."""
    monkeypatch.setenv("BATCHERY_TEST_SLEEP", "3.5")  # 3.5 leases of 1 s
    with Client(redis_url, queue_name) as client:
        client.queue.update_settings(lease_seconds=1, max_attempts=3)
        handle = client.enqueue("long one")
        with BackgroundWorker(redis_url, queue_name, runners.slow):
            result = handle.result(timeout=60)
        assert result.status == "ok" and result.attempts == 1, result


def test_a_request_past_its_deadline_is_never_run(redis_url: str, queue_name: str) -> None:
    with Client(redis_url, queue_name) as client:
        late = client.enqueue("too late", deadline=0.2)
        fine = client.enqueue("in time", deadline=60)
        time.sleep(0.4)
        run_burst(redis_url, queue_name)
        expired, ok = late.result(timeout=30), fine.result(timeout=30)
    assert expired.status == "expired" and expired.output is None
    assert expired.error["type"] == "DeadlineExceeded"
    assert ok.status == "ok"


def test_cancelling_a_running_request_discards_its_output(redis_url: str, queue_name: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="batchery.workers.results")
    os.environ["BATCHERY_TEST_SLEEP"] = "0.8"
    try:
        with Client(redis_url, queue_name) as client, BackgroundWorker(redis_url, queue_name,
                                                                        runners.slow):
            client.queue.update_settings(delete_delivered=False)  # read it again below
            handle = client.enqueue("slow one")
            wait_for(lambda: client.queue.stats()["inflight"] == 1, 30)
            assert handle.cancel() is True
            assert handle.result(timeout=30).status == "cancelled"
            # the batch finishes and tries to commit: wait for that commit, then look again
            wait_for(lambda: "discarded 1 result" in caplog.text, 30,
                     message="the running batch's commit to be discarded")
            assert client.get(handle.id).status == "cancelled"
    finally:
        del os.environ["BATCHERY_TEST_SLEEP"]


def test_sigterm_finishes_the_batch_and_returns_prefetched_claims(rconn, redis_url: str,
                                                                   queue_name: str, tmp_path: Path) -> None:
    queue = RequestQueue(rconn, queue_name)
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:slow", "--max-batch-size",
                          "2", log=tmp_path / "w.log", BATCHERY_TEST_SLEEP="1.0")
    wait_for(lambda: queue.stats()["workers"] == 1, 60)
    ids = enqueue_observed(queue, list(range(10)))
    # stopped while it holds a running and a prefetched batch; SIGTERM lands as it resumes
    held = freeze_holding_exactly(queue, worker, 4)
    before = {r.id for r in queue.results(ids) if r is not None}
    worker.send_signal(signal.SIGTERM)
    worker.send_signal(signal.SIGCONT)
    assert worker.wait(60) == 0  # a second SIGTERM would mean "stop at once": none here
    finished = {r.id: r for r in queue.results(ids) if r is not None}
    assert {r.status for r in finished.values()} == {"ok"}
    assert len(set(held) & set(finished)) >= 2  # the batch in hand was finished and committed
    assert 2 <= len(set(finished) - before) <= 4  # then it stopped: no batch claimed after
    stats = queue.stats()
    assert stats["pending"] == 10 - len(finished) > 0  # the prefetched claim went back
    assert stats["inflight"] == 0 and stats["workers"] == 0
    assert queue.client.hlen(queue.keys.attempts) == 0  # returned, not counted as failures


def freeze_holding_exactly(queue: RequestQueue, proc, count: int, timeout: float = 30) -> list[str]:
    """SIGSTOP ``proc`` at a moment it holds exactly ``count`` leases; return them."""
    return freeze_holding_such(queue, proc, lambda held: len(held) == count,
                               f"{count} leases", timeout)


def freeze_holding_such(queue: RequestQueue, proc, wanted: Callable[[list[str]], bool],
                        what: str, timeout: float = 30) -> list[str]:
    """SIGSTOP ``proc`` at a moment the leases it holds are ``wanted``; return them."""
    deadline = time.monotonic() + timeout
    while True:
        held = freeze_holding(queue, proc, max(0.1, deadline - time.monotonic()))
        if wanted(held):
            return held
        assert time.monotonic() < deadline, f"worker {proc.pid} never held {what}: {held}"
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.01)


def test_a_second_signal_stops_at_once_and_leases_cover_the_rest(rconn, redis_url: str,
                                                                 queue_name: str, tmp_path: Path) -> None:
    queue = RequestQueue(rconn, queue_name)
    queue.update_settings(lease_seconds=1)
    log = tmp_path / "w.log"
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:slow",
                          log=log, BATCHERY_TEST_SLEEP="5")
    wait_for(lambda: queue.stats()["workers"] == 1, 60)
    ids = enqueue_observed(queue, list(range(4)))
    wait_for(lambda: queue.stats()["inflight"] == 4, 20)
    worker.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM: finishing the current batch" in log.read_text(), 20,
             message="the first signal to be handled")
    assert stop_process(worker, signal.SIGINT) == 130
    assert queue.results(ids) == [None] * 4  # it did not wait for the 5 s batch to commit
    assert "second SIGINT: stopping at once" in log.read_text()
    reaped: list[int] = []  # the leases expire (1 s); a reaper takes the requests back
    wait_for(lambda: reaped.append(len(queue.reap().requeued)) or sum(reaped) == 4, 20,
             message="the leases to expire and be reaped")
    run_burst(redis_url, queue_name)
    assert [r.output["echo"] for r in queue.results(ids)] == [0, 1, 2, 3]


def test_a_redis_restart_mid_run_loses_nothing(tmp_path: Path, queue_name: str) -> None:
    server = RedisServer("--appendonly", "yes", "--appendfsync", "always")
    worker = start_worker(server.url, queue_name, "--runner", "tests.runners:slow",
                          "--max-batch-size", "8", log=tmp_path / "w.log",
                          BATCHERY_TEST_SLEEP="0.05")
    handles, errors = [], []
    try:
        with Client(server.url, queue_name) as client:
            def produce() -> None:
                try:
                    for i in range(150):
                        handles.append(client.enqueue(i))
                        time.sleep(0.01)
                except Exception as exc:  # the assertion below reports it
                    errors.append(exc)
            producer = threading.Thread(target=produce)
            producer.start()
            wait_for(lambda: len(handles) > 40, 30)
            server.stop(signal.SIGKILL)  # no shutdown save: only the AOF survives
            time.sleep(1.0)
            server.start()
            producer.join(60)
            results = [h.result(timeout=60) for h in handles]
        assert not errors and len(results) == 150
        assert [r.output for r in results] == [f"done:{i}" for i in range(150)]
        assert worker.poll() is None, "the worker must ride out the restart"
    finally:
        stop_process(worker)
        server.close()
    assert "Traceback" not in (tmp_path / "w.log").read_text()


def test_no_pickle_anywhere() -> None:
    root = Path(__file__).resolve().parent.parent
    sources = [p for folder in ("batchery", "producer", "batching", "workers")
               for p in (root / folder).rglob("*.py")]
    uses = re.compile(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle)\b|pickle\.(loads?|dumps?)\(",
                      re.MULTILINE)
    assert sources and not [p for p in sources if uses.search(p.read_text())]
