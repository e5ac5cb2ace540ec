"""A request Redis lost ends its waiters with RequestLost; absurd settings are refused."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path

import pytest

from batchery import AsyncClient, Client, Result, ResultTimeout
from batchery.batching.queue import RequestQueue
from batchery.connection import RedisSettings
from batchery.errors import RequestLost
from tests.conftest import RedisServer, run_cli, start_worker, stop_process, wait_for


@pytest.mark.parametrize("args, message", [
    (["--lease-seconds", "nan"], "'nan' is not a finite number"),
    (["--lease-seconds", "inf"], "'inf' is not a finite number"),
    (["--lease-seconds", "1e9"], "lease_seconds must be a number from 1 to 86400"),
    (["--result-ttl", "10000000000000000"], "result_ttl must be a number from 1 to 3.16224e+07"),
    (["--max-pending", "0"], "max_pending must be a number from 1"),
    (["--memory-high-water", "1.5"], "memory_high_water must be a number from 0 to 1"),
    (["--memory-high-water", "nan"], "'nan' is not a finite number"),
    (["--class-delay", "batch=inf"], "expected CLASS=SECONDS"),
])
def test_absurd_queue_settings_are_refused(redis_url: str, queue_name: str, args: list[str],
                                           message: str) -> None:
    done = run_cli("queue", "config", queue_name, *args, redis_url=redis_url)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    shown = json.loads(run_cli("queue", "config", queue_name, "--json", redis_url=redis_url).stdout)
    assert shown["lease_seconds"] == 30.0 and shown["result_ttl"] == 86400  # unchanged


@pytest.mark.parametrize("option", ["--timeout", "--deadline"])
def test_non_finite_client_numbers_are_refused(redis_url: str, queue_name: str, option: str) -> None:
    done = run_cli("enqueue", "-q", queue_name, "--text", "x", "--wait", option, "nan",
                   redis_url=redis_url)
    assert done.returncode == 2 and "not a finite number" in done.stderr, done.stderr
    with Client(redis_url, queue_name) as client:
        with pytest.raises(ValueError, match="timeout must be None"):
            client.enqueue("x").result(timeout=float("nan"))


def test_a_request_redis_lost_ends_its_waiters_with_a_clear_error(queue_name: str) -> None:
    """Redis restarts without the writes of the last moment (no persistence here: the
    whole queue is gone, as the last second is under appendfsync everysec after a host
    crash). A handle, a stream and an async handle stop waiting and say so."""
    server = RedisServer()  # --appendonly no --save '': a restart keeps nothing
    try:
        with Client(server.url, queue_name) as client:
            handle = client.enqueue("never to run")
            ids = [f"{queue_name}-{i}" for i in range(3)]
            stream_error: list[BaseException] = []

            def consume() -> None:
                try:
                    list(client.stream([{"id": i, "input": i} for i in ids]))
                except BaseException as exc:
                    stream_error.append(exc)
            consumer = threading.Thread(target=consume)
            consumer.start()
            wait_for(lambda: client.queue.lookup(ids) == [True] * 3, 30, message="streamed")

            async def wait_async() -> BaseException:
                async with AsyncClient(server.url, queue_name) as ac:
                    h = await ac.enqueue("async never to run")
                    server.stop(signal.SIGKILL)
                    server.start()
                    try:
                        await h.result(timeout=30)
                    except Exception as exc:
                        return exc
                    raise AssertionError("the async handle waited in vain")
            started = time.monotonic()
            async_error = asyncio.run(wait_async())
            assert isinstance(async_error, RequestLost), async_error
            with pytest.raises(RequestLost, match="not in Redis any more"):
                handle.result(timeout=30)
            consumer.join(30)
            assert [type(e) for e in stream_error] == [RequestLost]
            assert "Enqueue it again" in str(stream_error[0])
            assert time.monotonic() - started < 15  # noticed within a few polls, not 30 s
    finally:
        server.close()


def test_a_deleted_request_state_is_noticed_by_a_waiting_handle(redis_url: str,
                                                               queue_name: str) -> None:
    with Client(redis_url, queue_name) as client:
        handle = client.enqueue("about to vanish")
        assert client.queue.lookup([handle.id]) == [True]
        k = client.queue.keys
        client.queue.client.hdel(k.requests, handle.id)  # as an AOF missing its write would
        client.queue.client.zrem(k.pending, handle.id)
        with pytest.raises(RequestLost):
            handle.result(timeout=30)


def test_an_offline_job_enqueues_again_what_redis_lost(redis_url: str, queue_name: str,
                                                       tmp_path: Path) -> None:
    from tests.jobs_helpers import (read_jsonl, requests, start_jobs_worker, status, submit,
                                    wait_state, write_lines)
    source = write_lines(tmp_path / "in.jsonl", requests(50))
    output = tmp_path / "out.jsonl"
    jobs_queue = f"jobs-{queue_name}"
    jobs_worker = start_jobs_worker(redis_url, jobs_queue, log=tmp_path / "jobs.log")
    worker = None
    try:
        job = submit(redis_url, jobs_queue, queue_name, source, output)
        wait_for(lambda: status(redis_url, job)["pending"] == 50, 60, message="50 queued")
        with Client(redis_url, queue_name) as client:  # Redis loses 10 of them
            k, raw = client.queue.keys, client.queue.client
            lost = [f"{job}:r{i}" for i in range(10)]
            raw.hdel(k.requests, *lost)
            raw.hdel(k.sched, *lost)
            raw.zrem(k.pending, *lost)
            raw.hincrby(k.depth, "batch", -10)
        worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:echo",
                              log=tmp_path / "worker.log")
        wait_state(redis_url, job, "finished", timeout=60)
    finally:
        stop_process(jobs_worker)
        if worker is not None:
            stop_process(worker)
    written = read_jsonl(output)
    assert sorted(r["custom_id"] for r in written) == sorted(f"r{i}" for i in range(50))
    assert {r["status"] for r in written} == {"ok"}
    assert "Redis lost 10 queued request(s); enqueueing them again" in (tmp_path / "jobs.log").read_text()


def test_async_map_reads_results_whose_replies_were_lost(redis_url: str, queue_name: str,
                                                        rconn) -> None:
    """A result committed without its push to the client's reply list (a failover lost
    the push) is read from its key within a poll: AsyncClient.map still returns it."""
    queue = RequestQueue(rconn, queue_name)

    async def scenario() -> list[Result]:
        async with AsyncClient(redis_url, queue_name) as ac:
            mapping = asyncio.create_task(ac.map([f"m{i}" for i in range(5)], timeout=30))
            while queue.stats()["pending"] < 5:
                await asyncio.sleep(0.02)
            claimed = queue.claim("w#1", 10, 10_000, 0, 10).batch
            assert queue.complete([(r.id, r.lease_token, Result(r.id, "ok", r.input).to_json())
                                   for r in claimed], {}, clients=[""] * len(claimed))
            return await asyncio.wait_for(mapping, 10)
    results = asyncio.run(scenario())
    assert [r.output for r in results] == [f"m{i}" for i in range(5)]


def test_async_map_ends_with_a_clear_error_when_redis_lost_its_requests(queue_name: str) -> None:
    server = RedisServer()  # no persistence: a restart keeps nothing
    queue = RequestQueue(RedisSettings.from_url(server.url).client(), queue_name)
    try:
        async def scenario() -> BaseException:
            async with AsyncClient(server.url, queue_name) as ac:
                mapping = asyncio.create_task(ac.map(range(50), timeout=60))
                while queue.stats()["pending"] < 50:
                    await asyncio.sleep(0.02)
                server.stop(signal.SIGKILL)
                server.start()
                try:
                    await asyncio.wait_for(mapping, 20)
                except Exception as exc:
                    return exc
                raise AssertionError("the map waited in vain")
        started = time.monotonic()
        error = asyncio.run(scenario())
        assert isinstance(error, RequestLost), error
        assert "Enqueue it again" in str(error)
        assert time.monotonic() - started < 15
    finally:
        queue.client.close()
        server.close()


def test_async_map_times_out_without_progress_and_stops_collecting(redis_url: str,
                                                                  queue_name: str) -> None:
    async def scenario() -> None:
        async with AsyncClient(redis_url, queue_name) as ac:
            with pytest.raises(ResultTimeout, match="no result for any of 3 requests within 1"):
                await ac.map(["a", "b", "c"], timeout=1)
            assert ac.replies._sinks == {}  # nothing left waiting on the listener
    asyncio.run(scenario())
