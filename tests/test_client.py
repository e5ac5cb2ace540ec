"""The Python client, sync and asyncio, against a real Redis and an in-process worker."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from batchery import AsyncClient, Client, InvalidRequest, QueueFull, RequestTooLarge, ResultTimeout
from batchery.batching.request import RequestIds, first_send, map_requests
from batchery.connection import RedisSettings
from batchery.producer import client as client_module
from batchery.workers.loop import Worker
from batchery.workers.options import WorkerOptions
from batchery.workers.runners.custom import CallableRunner
from tests import runners
from tests.conftest import RedisServer, wait_for


class BackgroundWorker:
    """An in-process worker on its own thread, serving until stopped."""

    def __init__(self, redis_url: str, queue: str, factory=runners.echo, **options) -> None:
        self.worker = Worker(RedisSettings.from_url(redis_url), CallableRunner(factory()),
                             WorkerOptions(queue=queue, **options))
        self.thread = threading.Thread(target=self.worker.run, kwargs={"handle_signals": False})

    def __enter__(self) -> Worker:
        self.thread.start()
        return self.worker

    def __exit__(self, *exc: object) -> None:
        self.worker.stop.set()
        self.thread.join(30)


@pytest.mark.parametrize("fields, message", [
    ({"input": "x", "priority": "URGENT!"}, "priority must be"),
    ({"input": "x", "priority": True}, "got a boolean"),
    ({"input": "x", "deadline": -1}, "deadline must be more than 0"),
    ({"input": "x", "deadline": "soon"}, "deadline must be a number"),
    ({"input": "x", "tokens": 0}, "tokens must be an integer"),
    ({"input": "x", "meta": [1]}, "meta must be a JSON object"),
    ({"input": "x", "id": ""}, "request id must be 1-512"),
    ({"input": "x", "id": ["a"]}, "request id must be a string"),
    ({"input": float("nan")}, "must be JSON"),
    ({"input": {1, 2}}, "must be JSON"),
    ({"input": "\ud800"}, "not valid Unicode"),
    ({"text": "x"}, "unknown request field"),
    ({"priority": "batch"}, "has no 'input'"),
])
def test_invalid_requests_raise_value_errors_with_the_reason(redis_url: str, queue_name: str,
                                                             fields: dict, message: str) -> None:
    with Client(redis_url, queue_name) as client:
        with pytest.raises(ValueError, match=message):
            client.enqueue_many([fields])
        assert client.queue.stats()["pending"] == 0


def test_queue_full_refuses_and_keeps_what_was_accepted(redis_url: str, queue_name: str) -> None:
    with Client(redis_url, queue_name) as client:
        client.queue.update_settings(max_pending=3)
        client.enqueue_many([{"input": i} for i in range(2)])
        with pytest.raises(QueueFull):
            client.enqueue_many([{"input": i} for i in range(2)])
        assert client.queue.stats()["pending"] == 2


def test_result_and_map_preserve_order(redis_url: str, queue_name: str) -> None:
    with Client(redis_url, queue_name) as client, BackgroundWorker(redis_url, queue_name):
        assert client.enqueue("hello", priority="realtime").result(timeout=30).output["echo"] == "hello"
        results = client.map([f"item {i}" for i in range(300)], priority="batch", max_in_flight=50)
    assert [r.output["echo"] for r in results] == [f"item {i}" for i in range(300)]
    assert {r.status for r in results} == {"ok"}


def drawn_while_no_worker_runs(redis_url: str, client: Client, call, inputs: list,
                               limit: int) -> list:
    """Run ``call(inputs)`` (a stream or map with ``max_in_flight=limit``) with no worker:
    once ``limit`` requests are queued it must draw no more of ``inputs`` and queue no more
    until results come. Then a worker serves them all; returns the results."""
    drawn = []

    def source():
        for value in inputs:
            drawn.append(value)
            yield value
    results: list = []
    caller = threading.Thread(target=lambda: results.extend(call(source())))
    caller.start()
    try:
        # with no worker nothing completes: what is queued now is all it keeps in flight
        wait_for(lambda: client.queue.stats()["pending"] >= limit, 30,
                 message=f"{limit} requests queued")
        queued = client.queue.stats()["pending"]
        assert queued == limit, f"{queued} requests queued at once, max_in_flight={limit}"
        assert len(drawn) == limit  # nor drawn from the input ahead of room
    finally:
        with BackgroundWorker(redis_url, client.queue.name, max_batch_size=8):
            caller.join(60)
    assert not caller.is_alive()
    return results


def test_stream_keeps_a_bounded_number_in_flight(redis_url: str, queue_name: str) -> None:
    with Client(redis_url, queue_name) as client:
        results = drawn_while_no_worker_runs(
            redis_url, client, lambda source: client.stream(({"input": i} for i in source), max_in_flight=25),
            list(range(200)), 25)
    assert sorted(r.output["echo"] for r in results) == list(range(200))


def test_map_keeps_a_bounded_number_in_flight(redis_url: str, queue_name: str) -> None:
    with Client(redis_url, queue_name) as client:
        results = drawn_while_no_worker_runs(
            redis_url, client, lambda source: client.map(source, max_in_flight=30), list(range(120)), 30)
    assert [r.output["echo"] for r in results] == list(range(120))


def test_idempotent_enqueue_returns_the_existing_result(redis_url: str, queue_name: str) -> None:
    with Client(redis_url, queue_name) as first, Client(redis_url, queue_name) as second:
        first.queue.update_settings(delete_delivered=False)  # kept once delivered
        first.enqueue("original", id="same-id")
        with BackgroundWorker(redis_url, queue_name):
            assert first.handle("same-id").result(timeout=30).output["echo"] == "original"
        again = second.enqueue("different input", id="same-id")
        assert again.result(timeout=30).output["echo"] == "original"


def test_result_timeout_and_cancel(redis_url: str, queue_name: str) -> None:
    with Client(redis_url, queue_name) as client:
        handle = client.enqueue("never run")
        started = time.monotonic()
        with pytest.raises(ResultTimeout, match="stays queued"):
            handle.result(timeout=0.3)
        assert 0.3 <= time.monotonic() - started < 10  # its timeout, not the default 60 s wait
        assert handle.cancel() is True
        assert handle.result(timeout=30).status == "cancelled"
        assert handle.cancel() is True  # it is cancelled: asked again, it says so


def test_one_blocking_reply_read_per_client(queue_name: str) -> None:
    server = RedisServer()  # its own: no other test's idle worker blocks on it
    redis_url, rconn = server.url, RedisSettings.from_url(server.url).client()
    try:
        _count_blocking_reads(redis_url, queue_name, rconn)
    finally:
        rconn.close()
        server.close()


def _count_blocking_reads(redis_url: str, queue_name: str, rconn) -> None:
    with Client(redis_url, queue_name) as client:
        handles = [client.enqueue(i) for i in range(100)]
        failures: list[BaseException] = []

        def wait(handle) -> None:
            try:
                handle.result(timeout=30)
            except BaseException as exc:  # reported by the assert below, not by a thread hook
                failures.append(exc)
        waiters = [threading.Thread(target=wait, args=(h,)) for h in handles]
        for w in waiters:
            w.start()
        reply_key = client.queue.keys.reply(client.client_id)

        def blocked_now() -> int:  # flag "b": waiting in a blocking command right now
            return sum(1 for c in rconn.client_list() if "b" in c["flags"])
        wait_for(lambda: blocked_now() >= 1, 30, message="the waiters to block on their reply list")
        samples = []
        for _ in range(20):
            samples.append(blocked_now())
            time.sleep(0.05)
        assert max(samples) == 1, samples
        with BackgroundWorker(redis_url, queue_name):
            for w in waiters:
                w.join(15)
        assert failures == []
        assert all(h.done() for h in handles)
        assert rconn.llen(reply_key) == 0


def test_async_client_submit_map_and_cancel(redis_url: str, queue_name: str) -> None:
    async def scenario() -> None:
        async with AsyncClient(redis_url, queue_name) as client:
            queued = await client.enqueue("to cancel", priority="batch")
            assert await queued.cancel()
            assert (await queued.result(timeout=30)).status == "cancelled"
            with pytest.raises(InvalidRequest):
                await client.enqueue("x", priority="nope!")
            with BackgroundWorker(redis_url, queue_name):
                result = await client.submit({"text": "hi"}, priority="realtime", timeout=30)
                assert result.ok and result.output["echo"] == {"text": "hi"}
                results = await client.map(range(120), timeout=60)
            assert [r.output["echo"] for r in results] == list(range(120))
    asyncio.run(scenario())


def test_async_enqueues_started_together_go_as_one_call(private_redis: RedisServer,
                                                       queue_name: str) -> None:
    """Concurrent one-request enqueues (a service awaiting submit per caller) share one
    enqueue call; a refused one is sent again caller by caller, so each caller gets its
    own answer: the others' requests are queued, the refused one says why. (A server of
    its own: the calls counted are this test's alone.)"""
    redis_url = private_redis.url
    rconn = RedisSettings.from_url(redis_url).client()
    def enqueue_calls() -> int:
        return int(rconn.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))

    async def scenario(settings: Client) -> None:
        async with AsyncClient(redis_url, queue_name) as client:
            await client.enqueue("warm")  # scripts loaded, settings read
            before = enqueue_calls()
            handles = await asyncio.gather(*(client.enqueue(f"r{i}") for i in range(50)))
            assert enqueue_calls() - before == 1
            assert await client.lookup([h.id for h in handles]) == [True] * 50

            settings.queue.update_settings(max_request_bytes=200)
            outcomes = await asyncio.gather(client.enqueue("ok 1"), client.enqueue("x" * 500),
                                            client.enqueue("ok 2"), return_exceptions=True)
            assert isinstance(outcomes[1], RequestTooLarge)
            ok = [outcomes[0], outcomes[2]]
            assert await client.lookup([h.id for h in ok]) == [True, True]

            settings.queue.update_settings(max_request_bytes=10_000, max_pending=55)  # 2 more
            outcomes = await asyncio.gather(*(client.enqueue(f"f{i}") for i in range(4)),
                                            return_exceptions=True)
            assert [type(o).__name__ for o in outcomes] == ["AsyncHandle"] * 2 + ["QueueFull"] * 2
    with Client(redis_url, queue_name) as settings:
        asyncio.run(scenario(settings))
    rconn.close()


def test_a_clients_own_new_ids_skip_the_duplicate_check_on_their_first_send(
        private_redis: RedisServer, queue_name: str) -> None:
    """Ids the client made for requests it has not sent before (enqueue, map) cannot be
    known to the queue: their enqueue reads no result key and no request (the duplicate
    check, a sixth of an enqueue's cost); once sent, a request is checked if sent again.
    Ids the caller gives are checked: one given twice is queued once. (A server of its
    own: the reads counted are this test's alone.)"""
    rconn = RedisSettings.from_url(private_redis.url).client()

    def checks() -> int:
        stats = rconn.info("commandstats")
        return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("exists", "hmget"))
    with Client(private_redis.url, queue_name) as client:
        client.enqueue("warm")
        before = checks()
        handles = client.enqueue_many({"input": i} for i in range(50))
        assert checks() == before
        assert client.queue.lookup([h.id for h in handles]) == [True] * 50
        client.enqueue_many([{"input": 1, "id": "given-1"}, {"input": 2}])
        assert checks() > before
        assert client.enqueue_many([{"input": 1, "id": "given-1"}])[0].id == "given-1"
        stats = client.queue.stats()
        assert stats["pending"] == stats["totals"]["enqueued"] == 53  # given-1 once
        assert int(rconn.hget(client.queue.first.keys.depth, "normal")) == 53
    rconn.close()
    made = list(map_requests(range(3), "normal", None, RequestIds(), lambda value: None))
    assert first_send(made) and not first_send(made)  # map's own ids; sent, then checked


def test_request_ids_made_in_a_forked_child_are_its_own() -> None:
    """A client made before a fork (a server's preloaded workers, a pool of forked
    processes) is in each child: the ids each one makes differ (an id the client made
    skips the enqueue's duplicate check)."""
    ids = RequestIds()
    before = ids()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, then gone
        os.write(write, ids().encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = os.read(read, 200).decode()
    os.close(read)
    after = ids()
    assert child.rsplit("-", 1)[0] != before.rsplit("-", 1)[0] == after.rsplit("-", 1)[0]


def test_a_client_made_before_a_fork_reads_its_own_replies_in_each_child(
        redis_url: str, queue_name: str) -> None:
    """A client made before a fork (a server's preloaded workers) is in each child: each
    child draws its own client id, so its results come through its own reply list, read by
    its own reader (the parent's did not cross the fork), and the parent's reader does not
    take them. The child's poll of its result keys is told they are still queued: only its
    reply list can deliver (a client sharing its parent's list got each result from that
    poll, a second late)."""
    with Client(redis_url, queue_name) as client, BackgroundWorker(redis_url, queue_name):
        assert client.enqueue("before").result(timeout=30).ok  # the parent's reader runs
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its own requests, then gone
            try:  # its result keys' poll answers "still queued": only replies deliver
                client_module.POLL_S = 3600
                client.queue.lookup = lambda ids: [True] * len(ids)
                handles = [client.enqueue(f"child {i}") for i in range(20)]
                deadline = time.monotonic() + 15
                echoed = [h.result(timeout=max(0.01, deadline - time.monotonic())).output["echo"]
                          for h in handles]
                os.write(write, f"{client.client_id} {echoed == [f'child {i}' for i in range(20)]}"
                         .encode())
            finally:
                os._exit(0)
        os.close(write)
        parent = client.map([f"parent {i}" for i in range(20)])
        os.waitpid(pid, 0)
        child = os.read(read, 200).decode().split()
        os.close(read)
    assert child[1:] == ["True"] and child[0] != client.client_id
    assert [r.output["echo"] for r in parent] == [f"parent {i}" for i in range(20)]


def test_an_async_client_made_before_a_fork_names_its_own_reply_list_in_each_child(
        redis_url: str, queue_name: str) -> None:
    """An AsyncClient made before a fork and connected in each process (a server's
    preloaded app) draws its client id as it connects: each process names a reply list of
    its own (one list shared, each reader takes the others' results and drops them)."""
    made = AsyncClient(redis_url, queue_name)

    async def one(name: str) -> str:
        async with made as client:
            result = await client.submit(name, timeout=30)
            return f"{client.client_id} {result.output['echo'] == name}"

    with BackgroundWorker(redis_url, queue_name):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            try:
                os.write(write, asyncio.run(one("child")).encode())
            finally:
                os._exit(0)
        os.close(write)
        parent = asyncio.run(one("parent")).split()
        os.waitpid(pid, 0)
        child = os.read(read, 200).decode().split()
        os.close(read)
    assert parent[1:] == child[1:] == ["True"] and parent[0] != child[0]


def test_sync_enqueues_from_many_threads_go_as_few_calls(private_redis: RedisServer,
                                                         queue_name: str) -> None:
    """The sync Client shared by a thread pool: one-request enqueues made at once share
    calls (a group commit), and a refused call is sent again caller by caller, so each
    thread gets its own answer, as the AsyncClient's callers do. (A server of its own:
    the calls counted are this test's alone.)"""
    redis_url = private_redis.url
    rconn = RedisSettings.from_url(redis_url).client()

    def enqueue_calls() -> int:
        return int(rconn.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))

    def at_once(client: Client, inputs: list[str]) -> list[object]:
        """Each input enqueued by its own thread, all released together: handle or error."""
        start = threading.Barrier(len(inputs))
        outcomes: list[object] = [None] * len(inputs)

        def one(i: int) -> None:
            start.wait()
            try:
                outcomes[i] = client.enqueue(inputs[i])
            except Exception as exc:
                outcomes[i] = exc
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(inputs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return outcomes

    with Client(redis_url, queue_name) as client:
        client.enqueue("warm")  # scripts loaded, queue registered
        before = enqueue_calls()
        handles = at_once(client, [f"r{i}" for i in range(100)])
        calls = enqueue_calls() - before
        assert all(hasattr(h, "id") for h in handles), handles
        assert calls <= 10, f"100 threads made {calls} enqueue calls"
        assert client.queue.lookup([h.id for h in handles]) == [True] * 100

        client.queue.update_settings(max_request_bytes=200)
        outcomes = at_once(client, ["ok 1", "x" * 500, "ok 2", "ok 3"])
        assert isinstance(outcomes[1], RequestTooLarge)
        ok = [o for i, o in enumerate(outcomes) if i != 1]
        assert client.queue.lookup([h.id for h in ok]) == [True] * 3

        client.queue.update_settings(max_request_bytes=10_000, max_pending=106)  # 2 more
        outcomes = at_once(client, [f"f{i}" for i in range(6)])
        kinds = sorted(type(o).__name__ for o in outcomes)
        assert kinds == ["Handle"] * 2 + ["QueueFull"] * 4, outcomes
        assert client.queue.stats()["pending"] == 106
    rconn.close()
