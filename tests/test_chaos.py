"""Chaos: 5,000 requests through two real workers while a proxy drops replies, cuts
commands and delays everything, one worker is SIGKILLed and restarted, and Redis (AOF
always) is killed and restarted. Every id ends with exactly one committed result."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Iterator

import pytest
import redis

from batchery import Client
from batchery.batching.messages import Result
from batchery.batching.request import Request
from batchery.batching.queue import RequestQueue
from batchery.batching.reply_lists import results_in
from batchery.connection import RedisSettings
from tests.conftest import RedisServer, start_worker, stop_process, wait_for
from tests.proxy import FaultyProxy
from tests.test_reliability import freeze_holding_such

pytestmark = pytest.mark.slow
N = 5000
MAPPED = 500  # more, through Client.map: its results come back through its reply list
CHUNK = 100
OBSERVER = "observer"  # the reply list every commit pushes to: one entry per commit


def paced(n: int) -> Iterator[int]:
    """0..n-1 over about n / 100 seconds: a client that keeps sending through the faults."""
    for i in range(n):
        time.sleep(0.01)
        yield i


def worker(url: str, queue: str, log: Path) -> subprocess.Popen:
    """A lookahead of two batches: a backlog past 256 (while Redis is away) is deep, so
    claims lease the next batch too, under its own lease (lua/claim.lua)."""
    return start_worker(url, queue, "--runner", "tests.runners:echo", "--max-batch-size", "64",
                        "--max-wait-ms", "5", "--lookahead", "128", log=log)


def test_chaos_every_request_ends_with_exactly_one_result(queue_name: str, tmp_path: Path) -> None:
    server = RedisServer("--appendonly", "yes", "--appendfsync", "always")
    proxy = FaultyProxy(server.port, drop_reply=0.03, cut_command=0.03, delay_s=0.002)
    raw = redis.Redis(port=server.port, decode_responses=True)  # the referee: no faults
    RequestQueue(raw, queue_name).update_settings(lease_seconds=2)
    logs = [tmp_path / f"worker{i}.log" for i in range(3)]
    workers = [worker(proxy.url, queue_name, logs[0]), worker(proxy.url, queue_name, logs[1])]
    producer = RequestQueue(RedisSettings.from_url(proxy.url).client(), queue_name)
    referee = RequestQueue(raw, queue_name)
    ids = [f"c{i}" for i in range(N)]
    enqueue_retries, events = 0, []
    held_at_kill: list[str] = []
    started = time.monotonic()
    try:
        def produce() -> None:
            nonlocal enqueue_retries
            for start in range(0, N, CHUNK):
                batch = [Request.validated(id=i, input=i) for i in ids[start:start + CHUNK]]
                for _ in range(20):  # the same ids again after an error: enqueue is idempotent
                    try:
                        producer.enqueue(batch, OBSERVER)
                        break
                    except redis.RedisError:
                        enqueue_retries += 1
                else:
                    failures.append(f"enqueue of {batch[0].id}.. kept failing")
                    return
                time.sleep(0.05)  # spread over the run, so the faults below meet enqueues
        failures: list[str] = []
        mapped: list[Result] = []

        def wait_through_a_client() -> None:  # the Client's own waiting, under the same faults
            try:
                with Client(proxy.url, queue_name) as client:
                    mapped.extend(client.map(paced(MAPPED), max_in_flight=25, timeout=50))
            except Exception as exc:
                failures.append(f"Client.map: {exc!r}")
        producing = threading.Thread(target=produce)
        mapping = threading.Thread(target=wait_through_a_client)
        producing.start()
        mapping.start()

        def done() -> int:
            return sum(r is not None for r in referee.results(ids))
        wait_for(lambda: done() >= 1500, 50, interval=0.05, message="1500 results")
        # stopped at a moment it holds leases, an observed request's among them (a batch of
        # the map's requests alone leaves nothing observed to check), read from Redis while
        # it cannot commit: what the kill loses and the others must finish
        held_at_kill = freeze_holding_such(referee, workers[0], lambda held: bool(set(ids) & set(held)),
                                           "an observed request")
        workers[0].send_signal(signal.SIGKILL)
        workers[0].wait(10)
        workers.append(worker(proxy.url, queue_name, logs[2]))
        events.append(f"worker SIGKILLed at {done()} done, holding {len(held_at_kill)} leases")
        wait_for(lambda: done() >= 3000, 50, interval=0.05, message="3000 results")
        server.stop(signal.SIGKILL)
        server.start()
        events.append(f"Redis SIGKILLed and restarted at {done()} done")
        producing.join(60)
        mapping.join(60)
        assert not failures, failures

        def finished() -> bool:
            return all(r is not None for r in referee.results(ids))
        wait_for(finished, 50, interval=0.2, message="every request's result")
        seconds = time.monotonic() - started
        results = referee.results(ids)
        commits = Counter(Result.from_json(j).id
                          for j in results_in(raw.lrange(referee.keys.reply(OBSERVER), 0, -1)))
        stats = referee.stats()
    finally:
        for w in workers:
            stop_process(w)
        proxy.close()
        raw.close()
        server.close()
    lost = [i for i, r in zip(ids, results) if r is None]
    wrong = [r for i, r in zip(ids, results)
             if r is not None and (r.status != "ok" or r.output["echo"] != i)]
    duplicated = [i for i, n in commits.items() if n > 1]
    uncommitted = [i for i in ids if commits[i] == 0]
    print(f"\nchaos: {N} requests (and {len(mapped)} through Client.map) in {seconds:.1f}s: "
          f"{N - len(lost)} results, {len(lost)} lost, {len(wrong)} wrong, {len(duplicated)} "
          f"committed twice, {len(uncommitted)} without a commit, pending {stats['pending']}, "
          f"in flight {stats['inflight']}, dead {stats['dead']}, run more than once (a lease "
          f"lost) {sum(r.attempts > 1 for r in results if r)}; faults: {dict(proxy.faults)}, "
          f"enqueue calls retried {enqueue_retries}; {'; '.join(events)}")
    assert len(events) == 2, events
    # the kill lost leases; each of the observed ones was committed once (a Client.map
    # request held at the kill commits to the map's own reply list: checked through mapped)
    observed = set(ids)
    held = [i for i in held_at_kill if i in observed]
    assert held and all(commits[i] == 1 for i in held)
    assert not lost and not wrong and not duplicated and not uncommitted
    assert [r.output["echo"] for r in mapped] == list(range(MAPPED))
    assert stats["pending"] == 0 and stats["inflight"] == 0 and stats["dead"] == 0
    assert sum(proxy.faults.values()) >= 10  # the faults did happen
