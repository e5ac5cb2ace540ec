"""Redis memory: a high-water mark refuses enqueues so workers can always commit, an
out-of-memory Redis never wedges a worker, delivered results are deleted."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import redis

from batchery import AsyncClient, Client, QueueFull
from batchery.batching.calls import Failed
from batchery.batching.queue import RequestQueue
from batchery.batching.request import Request
from batchery.batching.messages import Result
from tests.conftest import RedisServer, free_port, run_cli, start_worker, stop_process, wait_for
from tests.test_client import BackgroundWorker

# Room between the default high-water mark (0.9) and maxmemory for what a worker that starts
# there needs: its scripts (each with the helpers of _common.lua it names), its connections'
# buffers and its first results, about 0.65 MiB in all; at 8 MiB the test's 0.93 left 0.55.
MAXMEMORY = 16 << 20


@pytest.fixture
def small_redis() -> Iterator[RedisServer]:
    """A Redis of its own with a small maxmemory and no eviction (what docs/concepts/memory.md recommends)."""
    server = RedisServer("--maxmemory", str(MAXMEMORY), "--maxmemory-policy", "noeviction")
    yield server
    server.close()


def used_fraction(client: redis.Redis) -> float:
    info = client.info("memory")
    return info["used_memory"] / info["maxmemory"]


def fill(client: redis.Redis, fraction: float) -> None:
    """Add ballast keys (not batchery's) until Redis uses ``fraction`` of its maxmemory."""
    for i in range(100_000):
        if used_fraction(client) >= fraction:
            return
        client.set(f"ballast:{i}", b"x" * (64 << 10))
    raise AssertionError("could not fill Redis")


def out_of_memory(client: redis.Redis) -> None:
    """Leave Redis out of memory, for good: maxmemory well under what it uses."""
    fill(client, 0.5)
    client.config_set("maxmemory", client.info("memory")["used_memory"] - (1 << 20))
    with pytest.raises(redis.OutOfMemoryError):
        client.set("probe", 1)


def test_enqueue_over_the_high_water_mark_is_refused_while_workers_still_commit(
        small_redis: RedisServer, queue_name: str) -> None:
    raw = redis.Redis(port=small_redis.port)
    with Client(small_redis.url, queue_name) as client:
        handles = [client.enqueue(i) for i in range(50)]
        fill(raw, 0.93)  # over the default mark of 0.9, under maxmemory
        with pytest.raises(QueueFull, match="short of memory") as refused:
            client.enqueue("one too many")
        assert refused.value.reason == "memory"
        assert "over the queue's memory_high_water" in str(refused.value)
        done = run_cli("enqueue", "-q", queue_name, "--text", "x", redis_url=small_redis.url)
        assert done.returncode == 3 and "short of memory" in done.stderr, done.stderr

        async def refused_async() -> QueueFull:
            async with AsyncClient(small_redis.url, queue_name) as ac:
                with pytest.raises(QueueFull) as caught:
                    await ac.enqueue("async one too many")
                return caught.value
        assert asyncio.run(refused_async()).reason == "memory"
        with BackgroundWorker(small_redis.url, queue_name):  # the headroom is theirs
            results = [h.result(timeout=30) for h in handles]
        assert [r.output["echo"] for r in results] == list(range(50))
        client.queue.update_settings(memory_high_water=0.99)  # the mark is per queue
        assert client.enqueue("fits under 0.99").id
    raw.close()


def test_an_out_of_memory_redis_refuses_enqueue_with_queue_full(small_redis: RedisServer,
                                                                queue_name: str) -> None:
    raw = redis.Redis(port=small_redis.port)
    with Client(small_redis.url, queue_name) as client:
        client.queue.update_settings(memory_high_water=0)  # no mark: Redis' own limit
        client.enqueue("before")
        out_of_memory(raw)
        with pytest.raises(QueueFull, match="out of memory") as refused:
            client.enqueue("after")
        assert refused.value.reason == "memory"
    raw.close()


def test_a_worker_whose_commit_redis_refuses_fails_the_batch_and_lets_go(
        small_redis: RedisServer, queue_name: str, tmp_path: Path) -> None:
    """Out of memory at commit (a permanent error): the worker does not retry forever
    while renewing the leases; the requests end dead with the reason, the error is in
    the log and in batchery_redis_errors_total."""
    raw = redis.Redis(port=small_redis.port, decode_responses=True)
    port = free_port()
    queue = RequestQueue(raw, queue_name)
    queue.update_settings(max_attempts=1, memory_high_water=0)
    worker = start_worker(small_redis.url, queue_name, "--runner", "tests.runners:slow",
                          "--max-batch-size", "8", "--metrics-port", str(port),
                          log=tmp_path / "worker.log", BATCHERY_TEST_SLEEP="1.5")
    try:
        with Client(small_redis.url, queue_name) as client:
            wait_for(lambda: queue.stats()["workers"] == 1, 60, message="the worker is up")
            # one call, so one batch: eight enqueues one at a time can be claimed as two
            # (the running batch and the one claimed ahead), two commits refused
            handles = client.enqueue_many([{"input": i} for i in range(8)])
            wait_for(lambda: queue.held()["inflight"] == 8, 30, message="the batch is leased")
            out_of_memory(raw)  # the batch runs for 1.5 s; its commit meets a full Redis
            results = [h.result(timeout=20) for h in handles]
        assert {r.status for r in results} == {"dead"}
        assert {r.error["type"] for r in results} == {"RedisError"}
        assert "OutOfMemoryError" in results[0].error["message"]
        assert raw.zcard(queue.keys.lease_expiry) == 0 and raw.hlen(queue.keys.lease_ids) == 0
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        assert f'batchery_redis_errors_total{{operation="commit",queue="{queue_name}"}} 1.0' in metrics, [l for l in metrics.splitlines() if "redis_errors" in l]
        assert worker.poll() is None
    finally:
        stop_process(worker)
        raw.close()
    log = (tmp_path / "worker.log").read_text()
    assert "Redis refused the results of 8 request(s): OutOfMemoryError" in log


def test_an_out_of_memory_redis_still_takes_requests_back(small_redis: RedisServer,
                                                          queue_name: str) -> None:
    """Out of memory, a worker can still give requests back (release), fail them to a
    retry, and the reaper take back a lapsed claim: each lets go of a lease first, a
    write that frees memory (Redis refuses a script whose first write may grow it)."""
    raw = redis.Redis(port=small_redis.port, decode_responses=True)
    queue = RequestQueue(raw, queue_name)
    queue.update_settings(max_attempts=3, memory_high_water=0)
    queue.enqueue([Request.validated(id=f"r{i}", input=i) for i in range(5)], "c")
    first = queue.claim("w#1", 3, 10_000, 0, 10).batch
    second = queue.claim("w#2", 2, 10_000, 0, 10).batch
    raw.zadd(queue.keys.lease_expiry, {"w#1": 0, "w#2": 0})  # both lapse (not reaped yet)
    out_of_memory(raw)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        raw.set("one-more", "x")
    assert queue.release([(first[0].id, "w#1")]) == 1
    dead_json = Result(first[1].id, "dead", error={"type": "E", "message": "m"}).to_json()
    assert queue.fail([(first[1].id, "w#1", dead_json)]) == [Failed.RETRIED]
    assert sorted(queue.reap().requeued) == sorted([first[2].id, *(r.id for r in second)])
    assert queue.leases() == {} and queue.held()["pending"] == 4


def test_delivered_results_are_deleted_unless_the_queue_keeps_them(redis_url: str,
                                                                   queue_name: str) -> None:
    with Client(redis_url, queue_name) as client, BackgroundWorker(redis_url, queue_name):
        handle = client.enqueue("once")
        unwatched = client.enqueue_many([{"input": "nobody waits"}], reply=False)[0]
        assert handle.result(timeout=30).output["echo"] == "once"
        wait_for(lambda: client.queue.lookup([handle.id]) == [False], 30,
                 message="the delivered result is deleted")
        assert handle.result(timeout=1).output["echo"] == "once"  # the handle keeps it
        streamed = list(client.stream([{"id": f"{queue_name}-s{i}", "input": i} for i in range(2)],
                                      timeout=30))
        assert len(streamed) == 2
        wait_for(lambda: client.queue.lookup([r.id for r in streamed]) == [False, False], 30,
                 message="results delivered to a stream are deleted")
        kept = wait_for(lambda: client.get(unwatched.id), 30, message="the unwatched result")
        assert kept.output["echo"] == "nobody waits"  # not delivered to anyone: kept

        async def via_async() -> str:
            async with AsyncClient(redis_url, queue_name) as ac:
                return (await (await ac.enqueue("async once")).result(timeout=30)).id
        async_id = asyncio.run(via_async())
        wait_for(lambda: client.queue.lookup([async_id]) == [False], 30,
                 message="the result delivered to the async client is deleted")

        client.queue.update_settings(delete_delivered=False)
    with Client(redis_url, queue_name) as client, BackgroundWorker(redis_url, queue_name):
        handle = client.enqueue("kept")
        assert handle.result(timeout=30).ok
        assert client.get(handle.id).output["echo"] == "kept"


def test_an_offline_jobs_results_leave_redis_once_written(redis_url: str, queue_name: str,
                                                          tmp_path: Path) -> None:
    from tests.jobs_helpers import read_jsonl, requests, submit, write_lines
    source = write_lines(tmp_path / "in.jsonl", requests(30))
    output = tmp_path / "out.jsonl"
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:echo",
                          log=tmp_path / "worker.log")
    try:
        job = submit(redis_url, f"jobs-{queue_name}", queue_name, source, output)
        done = run_cli("job", "worker", "--jobs-queue", f"jobs-{queue_name}", "--burst",
                       redis_url=redis_url)
        assert done.returncode == 0, done.stderr
    finally:
        stop_process(worker)
    assert len(read_jsonl(output)) == 30
    with Client(redis_url, queue_name) as client:
        assert client.queue.lookup([f"{job}:r{i}" for i in range(30)]) == [False] * 30
