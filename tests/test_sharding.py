"""One logical queue over N shards (`batchery queue config Q --shards N`): real workers,
real clients, on a single Redis and on a local Redis Cluster (each shard on its own node)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from queue import Empty
from typing import Iterator

import pytest
import redis

from batchery import AsyncClient, Client
from batchery.batching.async_sharded import open_async_queue
from batchery.batching.request import Request
from batchery.batching.keys import Keys, shard_of, shard_tags, tag_slot
from batchery.batching.scripts import source
from batchery.batching.shard_claim import SHARD_SLACK_MS
from batchery.batching.sharded import open_queue
from batchery.connection import RedisSettings
from batchery.errors import InvalidRequest, QueueFull, RequestTooLarge
from batchery.workers.claiming import Claimer
from batchery.workers.execution import Batch, BatchCap
from batchery.workers.leases import Leases
from batchery.workers.options import WorkerOptions
from batchery.workers.runners.custom import CallableRunner
from tests.conftest import RedisServer, run_cli, start_worker, stop_process, wait_for
from tests.jobs_helpers import read_jsonl, requests, start_jobs_worker, submit, write_lines
from tests.proxy import FaultyProxy
from tests.test_cluster import local_cluster, node_of_slot

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[RedisServer]]:
    with local_cluster(3, 0) as nodes:
        yield nodes


@dataclass
class Target:
    """Where a test runs: a single Redis, or a 3-node Cluster (``--cluster`` everywhere)."""

    url: str
    cluster: bool

    @property
    def flags(self) -> tuple[str, ...]:
        return ("--cluster",) if self.cluster else ()


@pytest.fixture(params=["redis", "cluster"])
def target(request: pytest.FixtureRequest, redis_url: str) -> Target:
    if request.param == "redis":
        return Target(redis_url, False)
    nodes = request.getfixturevalue("cluster")
    return Target(f"redis://127.0.0.1:{nodes[0].port}/0", True)


def configure(url: str, queue: str, *args: str) -> dict:
    done = run_cli("queue", "config", queue, "--json", *args, redis_url=url)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def ids_on_every_shard(prefix: str, shards: int, per_shard: int) -> list[str]:
    """Request ids, ``per_shard`` routed to each shard."""
    found: dict[int, list[str]] = {i: [] for i in range(shards)}
    n = 0
    while any(len(v) < per_shard for v in found.values()):
        request_id = f"{prefix}{n}"
        n += 1
        if len(found[shard_of(request_id, shards)]) < per_shard:
            found[shard_of(request_id, shards)].append(request_id)
    return [i for group in found.values() for i in group]


def test_layout_is_stable_and_spread() -> None:
    assert shard_tags("embed", 1) == ("embed",)  # one shard: today's {queue}
    for n in (2, 3, 6, 16):
        tags = shard_tags("embed", n)
        assert tags[0] == "embed" and len(set(tags)) == n
        assert all("~" in t for t in tags[1:])
        home = tag_slot("embed") * n // 16384
        # cut the slots in n equal ranges from slot 0: shard i in range (home + i) mod n,
        # in its middle half (i >= 1)
        assert [tag_slot(t) * n // 16384 for t in tags] == [(home + i) % n for i in range(n)]
        assert all(0.25 <= tag_slot(t) * n % 16384 / 16384 < 0.75 for t in tags[1:])
    assert shard_of("r-1", 3) == shard_of("r-1", 3) and shard_of("r-1", 1) == 0
    assert {shard_of(f"r{i}", 3) for i in range(30)} == {0, 1, 2}


def test_sharded_queue_serves_as_one(redis_url: str, queue_name: str, tmp_path: Path) -> None:
    settings = configure(redis_url, queue_name, "--shards", "3", "--max-attempts", "1")
    assert settings["shards"] == 3
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:fails_on_bad",
                          log=tmp_path / "worker.log")
    try:
        with Client(redis_url, queue_name) as client:
            assert client.queue.n == 3
            results = client.map([f"v{i}" for i in range(60)], timeout=60)
            assert [r.output for r in results] == [f"ok:v{i}" for i in range(60)]
            # idempotent by id: the same id again is known, not run twice
            once = [Request.validated(id="same-id", input="once")]
            assert client.queue.enqueue(once) == [True]
            assert client.queue.enqueue(once) == [False]
            wait_for(lambda: client.get("same-id"), 30, 0.05, "the result of same-id")
            bad = [client.enqueue("bad", id=i) for i in ids_on_every_shard("bad-", 3, 2)]
            assert {h.result(30).status for h in bad} == {"dead"}

        async def served_async() -> list:
            async with AsyncClient(redis_url, queue_name) as ac:
                return await ac.map([f"a{i}" for i in range(30)], timeout=60)
        assert [r.output for r in asyncio.run(served_async())] == [f"ok:a{i}" for i in range(30)]

        queue = open_queue(redis.Redis.from_url(redis_url, decode_responses=True), queue_name)
        per_shard = [q.stats(workers=False)["totals"].get("enqueued", 0) for q in queue.shards]
        assert all(n > 0 for n in per_shard) and sum(per_shard) == 60 + 1 + 6 + 30, per_shard
        stats = json.loads(run_cli("queue", "stats", "--queue", queue_name, "--json",
                                   redis_url=redis_url).stdout)["queues"][queue_name]
        assert stats["shards"] == 3 and stats["dead"] == 6 and stats["workers"] == 1
        assert stats["totals"]["enqueued"] == sum(per_shard)
        dead = run_cli("queue", "dead", "list", "--queue", queue_name, "--json", redis_url=redis_url)
        assert sorted(json.loads(line)["id"] for line in dead.stdout.splitlines()) == \
            sorted(ids_on_every_shard("bad-", 3, 2))
        purged = run_cli("queue", "dead", "purge", "--all", "--queue", queue_name,
                         "--json", redis_url=redis_url)
        assert json.loads(purged.stdout)["purged"] == 6

        # cancel and `request get` find a request on any shard
        assert run_cli("queue", "pause", queue_name, redis_url=redis_url).returncode == 0
        with Client(redis_url, queue_name) as client:
            held = [client.enqueue("wait", id=i) for i in ids_on_every_shard("held-", 3, 1)]
            cancelled = run_cli("request", "cancel", *(h.id for h in held), "--queue",
                                queue_name, redis_url=redis_url)
            assert cancelled.returncode == 0, cancelled.stderr
            for h in held:
                got = run_cli("request", "get", h.id, "--queue", queue_name, redis_url=redis_url)
                assert json.loads(got.stdout)["status"] == "cancelled"
        assert run_cli("queue", "resume", queue_name, redis_url=redis_url).returncode == 0
    finally:
        stop_process(worker)
    assert "Traceback" not in (tmp_path / "worker.log").read_text()


def test_offline_job_on_a_sharded_queue(redis_url: str, queue_name: str, tmp_path: Path) -> None:
    configure(redis_url, queue_name, "--shards", "3")
    source = write_lines(tmp_path / "in.jsonl", requests(40))
    output = tmp_path / "out.jsonl"
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:echo")
    jobs_worker = start_jobs_worker(redis_url, f"jobs-{queue_name}")
    try:
        job = submit(redis_url, f"jobs-{queue_name}", queue_name, source, output)
        watched = run_cli("job", "status", job, "--watch", redis_url=redis_url)
        assert f"job {job}: finished" in watched.stdout, watched.stderr
    finally:
        stop_process(jobs_worker)
        stop_process(worker)
    assert sorted(r["custom_id"] for r in read_jsonl(output) if r["status"] == "ok") == \
        sorted(f"r{i}" for i in range(40))


def test_shard_count_changes_only_on_an_empty_queue(redis_url: str, queue_name: str) -> None:
    with Client(redis_url, queue_name) as client:
        kept = ids_on_every_shard("k", 3, 1)[1]  # on shard 1 of 3, on shard 0 of 1
        handle = client.enqueue("x", id=kept)
        refused = run_cli("queue", "config", queue_name, "--shards", "3", redis_url=redis_url)
        assert refused.returncode != 0 and "Traceback" not in refused.stderr
        assert "cannot go from 1 to 3 shard(s) while it holds requests (1 pending)" in refused.stderr
        assert configure(redis_url, queue_name)["shards"] == 1
        assert handle.cancel()
        assert configure(redis_url, queue_name, "--shards", "3")["shards"] == 3
        # the result written under one shard stays readable under three
        got = run_cli("request", "get", kept, "--queue", queue_name, redis_url=redis_url)
        assert json.loads(got.stdout)["status"] == "cancelled"
        bad = run_cli("queue", "config", queue_name, "--shards", "0", redis_url=redis_url)
        assert bad.returncode != 0 and "shards must be a number from 1 to 256" in bad.stderr


def test_max_pending_holds_per_shard(rconn: redis.Redis, queue_name: str) -> None:
    queue = open_queue(rconn, queue_name)
    queue.update_settings(shards=3, max_pending=3)
    ids = ids_on_every_shard("m", 3, 2)  # two per shard, shard by shard
    assert queue.enqueue([Request.validated(id=i, input="x") for i in ids[0::2]]) == [True] * 3
    with pytest.raises(QueueFull, match=r"one of its 3 shards holds its share of max_pending 3 "
                                        r"\(ceil\(3 / 3\) requests\)"):
        queue.enqueue([Request.validated(id=ids[1], input="x")])
    assert queue.stats()["pending"] == 3


def test_enqueue_sends_its_shards_at_once(target: Target, queue_name: str) -> None:
    """An enqueue over several shards sends their calls at once (one pipeline on a single
    Redis, threads on a Cluster; the asyncio client: concurrent tasks), and keeps what one
    call after another gave: a flushed script cache is cured, each shard is all or
    nothing, the refusal is raised with its message, a stale shard count is routed again."""
    configure(target.url, queue_name, "--shards", "3", "--max-pending", "9", *target.flags)
    conn = RedisSettings.from_url(target.url, cluster=target.cluster).client()
    queue = open_queue(conn, queue_name)
    ids = ids_on_every_shard("m", 3, 4)  # shard 0's 4, shard 1's 4, shard 2's 4
    conn.script_flush()  # on a Cluster: every master's
    assert queue.enqueue([Request(id=i, input="x") for i in ids[0::4]]) == [True] * 3
    with pytest.raises(InvalidRequest, match=f"request {ids[5]!r}: unknown priority class 'nope'"):
        queue.enqueue([Request(id=ids[1], input="x"), Request(id=ids[5], input="x", priority="nope"),
                       Request(id=ids[9], input="x")])
    assert queue.stats()["pending"] == 5  # shards 0 and 2 took theirs

    async def enqueue_async() -> None:
        aconn = RedisSettings.from_url(target.url, cluster=target.cluster).async_client()
        aqueue = await open_async_queue(aconn, queue_name)
        with pytest.raises(InvalidRequest, match=f"request {ids[10]!r}: unknown priority class"):
            await aqueue.enqueue([Request(id=ids[10], input="x", priority="nope"),
                                  Request(id=ids[6], input="x")])
        await aconn.aclose()
    asyncio.run(enqueue_async())
    assert queue.stats()["pending"] == 6  # shard 1 took its one
    with pytest.raises(QueueFull, match=r"one of its 3 shards holds its share of max_pending 9"):
        queue.enqueue([Request(id=i, input="x") for i in (ids[2], ids[3], ids[7])])
    assert queue.is_known(ids[7]) and not queue.is_known(ids[2])  # shard 0 would hold 4 of 3
    held = [ids[0], ids[1], ids[4], ids[6], ids[7], ids[8], ids[9]]
    assert queue.stats()["pending"] == 7 and queue.cancel(held) == [1] * 7
    configure(target.url, queue_name, "--shards", "2", *target.flags)
    fresh = ids_on_every_shard("n", 3, 2)
    assert queue.n == 3 and queue.enqueue([Request(id=i, input="x") for i in fresh]) == [True] * 6
    assert queue.n == 2 and queue.stats()["pending"] == 6
    conn.close()


def test_a_group_sent_again_caller_by_caller_is_checked_and_queued_once(
        target: Target, queue_name: str) -> None:
    """A client's own new ids skip the enqueue's duplicate check on their first send only.
    Enqueues made together go as one call over the shards; one shard refuses its part (a
    request too large), another takes its own; the group is sent again caller by caller,
    and the requests that shard took are checked then (known: not queued again), the
    others queued: each request is pending once, and the counts agree."""
    configure(target.url, queue_name, "--shards", "2", "--max-request-bytes", "200",
              *target.flags)
    conn = RedisSettings.from_url(target.url, cluster=target.cluster).client()

    async def together() -> list:
        async with AsyncClient(target.url, queue_name, cluster=target.cluster) as client:
            return await asyncio.gather(*(client.enqueue(f"ok {i}") for i in range(24)),
                                        client.enqueue("x" * 500), return_exceptions=True)
    outcomes = asyncio.run(together())
    assert isinstance(outcomes[-1], RequestTooLarge), outcomes[-1]
    handles = outcomes[:-1]
    assert all(hasattr(h, "id") for h in handles), handles
    queue = open_queue(conn, queue_name)
    shards = queue.shards
    on = [sum(shard_of(h.id, 2) == i for h in handles) for i in range(2)]
    assert all(on), on  # (24 random ids on 2 shards: both hold some)
    assert queue.stats()["pending"] == 24
    for shard in shards:
        keys = shard.keys
        queued = conn.zcard(keys.pending)
        assert shard.stats(workers=False)["totals"].get("enqueued", 0) == queued
        assert int(conn.hget(keys.depth, "normal") or 0) == queued
    assert sorted(i for s in shards for i in conn.zrange(s.keys.pending, 0, -1)) == \
        sorted(h.id for h in handles)
    conn.close()


def test_a_retried_enqueue_pipeline_reports_its_ids_as_accepted(redis_server: RedisServer,
                                                                 queue_name: str) -> None:
    """The reply to a 3-shard enqueue's pipeline is lost: the connection sends the pipeline
    again and each shard's script answers as its first run did (its call key)."""
    configure(redis_server.url, queue_name, "--shards", "3")
    proxy = FaultyProxy(redis_server.port)
    conn = RedisSettings.from_url(proxy.url).client()
    queue = open_queue(conn, queue_name)
    conn.script_load(source("enqueue"))  # so the lost reply is the script's, not NOSCRIPT
    proxy.drop_reply_to(queue.scripts.enqueue.sha.encode())
    ids = ids_on_every_shard("p", 3, 2)
    assert queue.enqueue([Request(id=i, input="x") for i in ids]) == [True] * 6
    assert proxy.faults["replies dropped on purpose"] == 1
    assert [q.stats(workers=False)["totals"]["enqueued"] for q in queue.shards] == [2, 2, 2]
    conn.close()
    proxy.close()


def test_stale_producer_reroutes(target: Target, queue_name: str, tmp_path: Path) -> None:
    """A client that enqueued under 1 shard, the queue reconfigured to 3 while empty: the
    same client's next requests are refused under 1, routed again, and served."""
    worker = start_worker(target.url, queue_name, *target.flags, "--runner", "tests.runners:echo",
                          log=tmp_path / "worker.log")
    try:
        with Client(target.url, queue_name, cluster=target.cluster) as client:
            assert client.queue.n == 1
            assert client.enqueue("before").result(30).output["echo"] == "before"
            configure(target.url, queue_name, "--shards", "3", *target.flags)
            assert client.queue.n == 1  # it has not looked since
            handles = client.enqueue_many({"input": f"after {i}"} for i in range(30))
            assert client.queue.n == 3  # refused under 1 shard, routed again under 3
            assert [h.result(30).output["echo"] for h in handles] == [f"after {i}" for i in range(30)]
            totals = [q.stats(workers=False)["totals"].get("enqueued", 0) for q in client.queue.shards]
        assert all(n > 0 for n in totals) and sum(totals) == 31, totals
    finally:
        stop_process(worker)
    assert "Traceback" not in (tmp_path / "worker.log").read_text()


def test_no_request_overtaken_across_shards(target: Target, queue_name: str, tmp_path: Path) -> None:
    """Waves ranked a second apart (integer priorities), each spread over 3 shards: one
    worker, batches of 8, runs every wave before the next, although a batch of one shard
    would take the next wave's requests of that shard without the rank ceiling."""
    configure(target.url, queue_name, "--shards", "3", *target.flags)
    waves = 4
    with Client(target.url, queue_name, cluster=target.cluster) as client:
        handles = client.enqueue_many({"input": f"w{wave}-{i}", "priority": wave + 1}
                                      for wave in range(waves) for i in range(12))
        worker = start_worker(target.url, queue_name, *target.flags, "--runner", "tests.runners:timed",
                              "--max-batch-size", "8", "--max-wait-ms", "0",
                              log=tmp_path / "worker.log", BATCHERY_TEST_SLEEP="0.02")
        try:
            results = [h.result(60) for h in handles]
        finally:
            stop_process(worker)
    started: dict[int, list[float]] = {}
    for r in results:
        started.setdefault(int(r.output["input"][1:].split("-")[0]), []).append(r.output["start"])
    assert max(r.batch_size for r in results) > 1
    for wave in range(waves - 1):  # 1000 ms of rank apart, far above SHARD_SLACK_MS
        assert max(started[wave]) <= min(started[wave + 1]), wave
    assert SHARD_SLACK_MS < 1000


def test_batch_claimed_within_the_slack_is_not_given_back(redis_url: str, queue_name: str) -> None:
    """Two workers read the heads at once and both target shard A; the first leases A's
    head, the second A's next request, ranked past shard B's head but within its ceiling.
    head_rank, which a worker gives a claimed batch back by, must not call that batch
    overtaken (it did: batches went back and forth between the workers, 3 shards cost
    twice the Redis time of 1 in bench/cluster_scale.py)."""
    configure(redis_url, queue_name, "--shards", "2", "--class-delay", "late=1",
              "--class-delay", "later=1.02")
    conn = redis.Redis.from_url(redis_url, decode_responses=True)
    queue = open_queue(conn, queue_name)
    ids = ids_on_every_shard("g", 2, 2)
    on_a, on_b = ids[:2], ids[2:]
    queue.enqueue([Request(id=on_a[0], input=0, priority="realtime"),
                   Request(id=on_b[0], input=1, priority="late"),
                   Request(id=on_a[1], input=2, priority="later")])
    first = queue.claim("x#1", 1, 10_000, 0, 16)
    assert [r.id for r in first.batch] == [on_a[0]]
    b_head = queue.shards[1].head_rank()
    second = queue.shards[0].claim("y#1", 1, 10_000, 0, 16, ceiling=b_head + SHARD_SLACK_MS)
    assert [r.id for r in second.batch] == [on_a[1]] and second.batch[0].rank > b_head
    assert queue.head_rank() >= second.batch[0].rank
    conn.close()


def test_retry_on_another_shard_is_claimed_when_due(redis_url: str, queue_name: str) -> None:
    """Nothing pending anywhere, a retry in backoff on shard 1: the claim goes there (it
    reads the shards' retry times only when no shard has a pending head)."""
    configure(redis_url, queue_name, "--shards", "2")
    conn = redis.Redis.from_url(redis_url, decode_responses=True)
    queue = open_queue(conn, queue_name)
    request_id = ids_on_every_shard("r", 2, 1)[1]
    queue.enqueue([Request(id=request_id, input=0)])
    first = queue.claim("x#1", 1, 10_000, 0, 16)
    assert queue.fail([(request_id, first.batch[0].lease_token, "{}")]) == [1]  # retried later
    held = queue.claim("x#2", 1, 10_000, 0, 16)
    assert not held.batch and 0 < held.wait_ms <= 1000  # shard 1's retry, not shard 0's "none"
    time.sleep(held.wait_ms / 1000)
    again = queue.claim("x#3", 1, 10_000, 0, 16)
    assert [(r.id, r.attempt) for r in again.batch] == [(request_id, 2)]
    conn.close()


def test_batch_the_model_waited_for_is_not_read_again(private_redis: RedisServer,
                                                      queue_name: str) -> None:
    """Before it runs a batch claimed ahead the worker reads every shard's head again, to
    give the batch back for a more urgent request; a batch the model thread was already
    waiting for runs on its claim's own read, with no command sent. (A server of its
    own: the reads counted are this test's alone.)"""
    redis_url = private_redis.url
    configure(redis_url, queue_name, "--shards", "2")
    conn = redis.Redis.from_url(redis_url, decode_responses=True)
    queue = open_queue(conn, queue_name)
    claimer = Claimer(queue, CallableRunner(lambda inputs: inputs), WorkerOptions(queue=queue_name),
                      Leases(), BatchCap(1.0), lambda _: None, threading.Event())
    late, urgent = ids_on_every_shard("f", 2, 1)
    queue.enqueue([Request(id=late, input=0, priority="batch")])
    claimed = queue.claim("x#1", 1, 10_000, 0, 16)
    assert [r.id for r in claimed.batch] == [late]
    queue.enqueue([Request(id=urgent, input=1, priority="realtime")])  # 60 s more urgent
    batch = Batch(claimed.batch, claimed.now_ms)

    def reads() -> int:
        return conn.info("commandstats").get("cmdstat_zrange", {}).get("calls", 0)
    before = reads()
    arrives = threading.Timer(0.3, claimer.batches.put, [(batch, True)])
    arrives.start()  # while the model thread waits in take()
    assert claimer.take(10) is batch
    assert reads() == before and queue.stats()["inflight"] == 1
    claimer.batches.put((batch, True))  # now it waited in the queue: read, and given back
    with pytest.raises(Empty):
        claimer.take(0.5)
    assert reads() > before
    assert queue.stats()["inflight"] == 0 and queue.stats()["pending"] == 2
    conn.close()


def test_shards_spread_evenly_over_the_masters(cluster: list[RedisServer]) -> None:
    """Any queue: 3 shards on 3 masters one each, 6 shards two each (the masters own
    equal slot ranges, as `redis-cli --cluster create` assigns them)."""
    with redis.Redis(port=cluster[0].port, decode_responses=True) as probe:
        for name in [f"q{i}" for i in range(40)] + ["embeddings", "a", "Z-9.x"]:
            for n in (3, 6):
                nodes = [node_of_slot(probe, tag_slot(t)) for t in shard_tags(name, n)]
                assert sorted(nodes.count(port) for port in set(nodes)) == [n // 3] * 3, (name, n)


def test_idle_worker_wakes_for_any_shard(cluster: list[RedisServer], queue_name: str) -> None:
    """On a Cluster an idle worker's wait ends as soon as any shard gets a request (one
    watcher per shard), not at its poll timeout; a token taken while it is busy is put
    back for another worker."""
    url = f"redis://127.0.0.1:{cluster[0].port}/0"
    configure(url, queue_name, "--shards", "3", "--cluster")
    conn = redis.RedisCluster(host="127.0.0.1", port=cluster[0].port, decode_responses=True)
    queue = open_queue(conn, queue_name)
    assert _timed(queue.wait_for_work, 1.0) >= 0.9  # nothing to wake for: no polling
    for i, request_id in enumerate(ids_on_every_shard("w", 3, 1)):
        woke: list[float] = []
        waiter = threading.Thread(target=lambda: woke.append(_timed(queue.wait_for_work, 30)))
        waiter.start()
        wait_for(lambda: queue._wake.idle.is_set(), 30, 0.01, "the worker to wait")
        queue.enqueue([Request(id=request_id, input=i)])
        waiter.join(30)
        assert woke and woke[0] < 10, (request_id, woke)  # far below the 30 s timeout
    shard = queue.shard("late")  # its worker is busy: the token goes back to the list
    queue.enqueue([Request(id="late", input=0)])
    wait_for(lambda: conn.llen(shard.keys.wake) >= 1, 30, 0.05, "the token put back")
    queue.stop_waking()
    conn.close()  # a watcher still reading with it leaves quietly (no thread exception)


def _timed(call: object, *args: object) -> float:
    started = time.monotonic()
    call(*args)  # type: ignore[operator]
    return time.monotonic() - started


def test_sharded_queue_on_a_cluster(cluster: list[RedisServer], tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{cluster[0].port}/0"
    queue = "spread"  # any name: its 3 shards land one on each master (checked below)
    done = run_cli("queue", "config", queue, "--shards", "3", "--cluster", "--json", redis_url=url)
    assert done.returncode == 0, done.stderr
    worker = start_worker(url, queue, "--cluster", "--runner", "tests.runners:echo",
                          log=tmp_path / "worker.log")
    try:
        with Client(url, queue, cluster=True) as client:
            results = client.map([f"c{i}" for i in range(60)], timeout=60)
            assert [r.output["echo"] for r in results] == [f"c{i}" for i in range(60)]

        async def served_async() -> list:
            async with AsyncClient(url, queue, cluster=True) as ac:
                return await ac.map([f"a{i}" for i in range(30)], timeout=60)
        assert [r.output["echo"] for r in asyncio.run(served_async())] == [f"a{i}" for i in range(30)]
        stats = run_cli("queue", "stats", "--queue", queue, "--cluster", "--json", redis_url=url)
        seen = json.loads(stats.stdout)["queues"][queue]
        assert seen["shards"] == 3 and seen["totals"]["enqueued"] == 90 and seen["workers"] == 1
    finally:
        stop_process(worker)
    assert "Traceback" not in (tmp_path / "worker.log").read_text()
    ports = set()
    for tag in shard_tags(queue, 3):  # each shard's keys on its own node, and used
        holders = []
        for node in cluster:
            with redis.Redis(port=node.port, decode_responses=True) as local:
                if local.execute_command("CLUSTER", "COUNTKEYSINSLOT", tag_slot(tag)):
                    holders.append(node.port)
                    assert local.hget(Keys(tag).settings, "shards") == "3"
                    assert int(local.hget(Keys(tag).stats, "enqueued") or 0) > 0
        assert len(holders) == 1, (tag, holders)
        ports.add(holders[0])
    assert len(ports) == 3
