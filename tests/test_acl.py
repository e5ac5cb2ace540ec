"""Least privilege: the producer-only and worker-only Redis ACL users of the docs
(docs/guides/least-privilege.md) work, and what each may not do, against a real Redis 7
with real users."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import pytest
import redis

from batchery import Client
from batchery.batching.keys import FAIR_MODE_FIELD
from batchery.batching.queue import RequestQueue
from tests.conftest import (ROOT, RedisServer, newest_redis_server, run_cli, start_worker,
                            stop_process, wait_for)


def documented_acl(user: str) -> str:
    """The rules docs/guides/least-privilege.md gives the user, its PASSWORD made real: the
    page and this test cannot disagree."""
    page = (ROOT / "docs" / "guides" / "least-privilege.md").read_text()
    for block in re.findall(r"```text\n(.*?)```", page, re.S):
        words = block.split()
        if words[:3] == ["ACL", "SETUSER", user]:
            return " ".join(words[3:]).replace(">PASSWORD", f">{user}-secret")
    raise AssertionError(f"docs/guides/least-privilege.md has no ACL SETUSER {user} block")


PRODUCER_ACL = documented_acl("producer")
WORKER_ACL = documented_acl("worker")


@pytest.fixture(scope="module")
def acl_redis() -> Iterator[RedisServer]:
    binary = newest_redis_server()
    server = RedisServer(binary=binary)
    try:
        with redis.Redis(port=server.port) as admin:
            admin.execute_command("ACL", "SETUSER", "producer", *PRODUCER_ACL.split())
            admin.execute_command("ACL", "SETUSER", "worker", *WORKER_ACL.split())
        yield server
    finally:
        server.close()


def url(server: RedisServer, user: str) -> str:
    return f"redis://{user}:{user}-secret@127.0.0.1:{server.port}/0"


def test_a_producer_and_a_worker_user_run_a_queue(acl_redis: RedisServer, queue_name: str,
                                                  tmp_path: Path) -> None:
    worker = start_worker(url(acl_redis, "worker"), queue_name, "--runner", "tests.runners:echo",
                          log=tmp_path / "worker.log")
    try:
        with Client(url(acl_redis, "producer"), queue_name) as client:
            results = [h.result(timeout=30) for h in client.enqueue_many(
                [{"input": i} for i in range(20)])]
            assert [r.output["echo"] for r in results] == list(range(20))
            wait_for(lambda: client.queue.lookup([results[0].id]) == [False], 30,
                     message="the delivered result deleted by the producer")
            assert list(client.map(["a", "b"], timeout=30))
        with Client(url(acl_redis, "producer"), f"{queue_name}-idle") as client:
            handle = client.enqueue("cancel me")
            assert handle.cancel() and handle.result(timeout=30).status == "cancelled"
            # a second tenant's work beside the first's: the producer lists the backlog
            handles = [*client.enqueue_many([{"input": i, "tenant": "a"} for i in range(5)]),
                       *client.enqueue_many([{"input": 9, "tenant": "b"}])]
            assert client.queue.client.hget(client.queue.keys.vtc, FAIR_MODE_FIELD) == "listed"
            assert all(h.cancel() for h in handles)
    finally:
        assert stop_process(worker) == 0
    log = (tmp_path / "worker.log").read_text()
    assert "NOPERM" not in log and "Traceback" not in log


def test_what_each_user_may_not_do(acl_redis: RedisServer, queue_name: str) -> None:
    producer = redis.Redis.from_url(url(acl_redis, "producer"), decode_responses=True)
    worker = redis.Redis.from_url(url(acl_redis, "worker"), decode_responses=True)
    k = RequestQueue(producer, queue_name).keys
    refused = [
        (producer, ("FLUSHALL",)), (producer, ("CONFIG", "GET", "maxmemory")),
        (producer, ("KEYS", "*")),
        (producer, ("ZADD", k.workers, "1", "fake-worker")),  # cannot pose as a live worker
        (producer, ("GET", "rq:job:x")),
        (worker, ("FLUSHALL",)), (worker, ("CONFIG", "SET", "maxmemory", "1")),
        (worker, ("KEYS", "*")), (worker, ("GET", "rq:job:x")), (worker, ("GET", "other:key")),
    ]
    for client, command in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*command)
    # reaping is the workers' job (refused: reap declares the per-request lease key of
    # versions before per-claim leases, which the producer does not hold)
    with pytest.raises(redis.exceptions.NoPermissionError):
        RequestQueue(producer, queue_name).reap()
    with pytest.raises(redis.exceptions.NoPermissionError):  # so is the heartbeat
        RequestQueue(producer, queue_name).renew("fake-worker", [])
    producer.close()
    worker.close()


def test_a_worker_without_the_rights_stops_with_a_clear_error(acl_redis: RedisServer,
                                                              queue_name: str) -> None:
    """Run as the producer user, a worker meets NOPERM at its first heartbeat: a permanent
    error, so it stops at once with the reason instead of retrying for minutes."""
    done = run_cli("worker", "--queue", queue_name, "--runner", "tests.runners:echo", "--burst",
                   redis_url=url(acl_redis, "producer"), timeout=60)
    assert done.returncode == 1, done.stderr
    assert "Redis refused a command to this user" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_worker_user_may_claim_a_shard_whose_requests_are_past_the_ceiling(
        acl_redis: RedisServer, queue_name: str) -> None:
    """A sharded queue's claim passes a rank ceiling; with every request of the shard past
    it, the script looks whether any is pending at all, with a command the worker holds."""
    with Client(url(acl_redis, "producer"), queue_name) as client:
        client.enqueue("later")
    worker = RequestQueue(redis.Redis(port=acl_redis.port, username="worker",
                                      password="worker-secret", decode_responses=True), queue_name)
    reply = worker.claim("w#1", 8, 10_000, 0, 16, ceiling=0)
    assert not reply.batch and reply.wait_ms == 1  # asked to claim again, nothing leased
