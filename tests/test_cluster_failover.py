"""Redis Cluster with replicas: a master dies mid-run, its replica is promoted, and
workers and clients carry on. Replication is asynchronous, so the last writes the dead
master acknowledged may be missing on its replica: each such request is either run
again (its lease or claim was lost: at-least-once) or reported lost to its waiter with
RequestLost, never waited on forever."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
import redis

from batchery import Client
from batchery.batching.keys import Keys, shard_tags, tag_slot
from batchery.errors import RequestLost
from tests.conftest import RedisServer, run_cli, start_worker, stop_process, wait_for
from tests.test_cluster import local_cluster, node_of_slot

pytestmark = pytest.mark.slow
NODE_TIMEOUT_MS = 1000  # a master unreachable this long is failed over by its replica


@pytest.fixture
def cluster() -> Iterator[list[RedisServer]]:
    """3 masters, 3 replicas (one each), failover after NODE_TIMEOUT_MS."""
    with local_cluster(3, 1, "--cluster-node-timeout", str(NODE_TIMEOUT_MS)) as nodes:
        yield nodes


def replica_of(probe: redis.Redis, slot: int) -> int:
    for first, last, _master, *replicas in probe.execute_command("CLUSTER", "SLOTS"):
        if first <= slot <= last:
            return int(replicas[0][1])
    raise AssertionError(f"slot {slot} has no replica")


def cut_replication(master_port: int, replica_port: int) -> None:
    """Replicate all written so far, then cut the link: the replica cannot log back in (a
    wrong masterauth), so the master's next writes exist only on the master."""
    with redis.Redis(port=master_port) as master, redis.Redis(port=replica_port,
                                                              decode_responses=True) as replica:
        assert master.execute_command("WAIT", 1, 5000) == 1
        replica.config_set("masterauth", "not-the-password")
        master.execute_command("CLIENT", "KILL", "TYPE", "replica")
        wait_for(lambda: replica.info("replication")["master_link_status"] == "down", 30,
                 message="the replication link down")


def slow_worker(url: str, queue: str, tmp_path: Path) -> subprocess.Popen:
    """A worker at 50 ms a batch of up to 8: a run of 300 requests lasts a few seconds."""
    return start_worker(url, queue, "--cluster", "--runner", "tests.runners:slow",
                        "--max-batch-size", "8", "--max-wait-ms", "0",
                        log=tmp_path / "worker.log", BATCHERY_TEST_SLEEP="0.05")


def enqueue_and_start(client: Client) -> list:
    """300 requests enqueued; returns their handles once 40 have results."""
    handles = client.enqueue_many({"input": i} for i in range(300))
    wait_for(lambda: client.queue.stats()["totals"].get("ok", 0) >= 40, 60,
             message="40 results before the failover")
    return handles


def promoted(survivor: RedisServer, slot: int, replica_port: int) -> bool:
    """The cluster is whole again, ``slot`` served by the former replica."""
    with redis.Redis(port=survivor.port, decode_responses=True) as node:
        return node.cluster("info")["cluster_state"] == "ok" and node_of_slot(node, slot) == replica_port


def test_master_killed_mid_run_replica_takes_over(cluster: list[RedisServer], tmp_path: Path) -> None:
    """300 requests running when the queue's master dies: every one gets its result.
    5 more, acknowledged by the master while its replica was frozen (so never
    replicated), end with RequestLost for their waiters. Requests enqueued after the
    failover run."""
    queue = "failover"
    probe = redis.Redis(port=cluster[0].port, decode_responses=True)
    slot = probe.cluster("keyslot", Keys(queue).pending)
    master_port, replica_port = node_of_slot(probe, slot), replica_of(probe, slot)
    probe.close()
    master = next(n for n in cluster if n.port == master_port)
    survivor = next(n for n in cluster if n.port not in (master_port, replica_port))
    url = f"redis://127.0.0.1:{survivor.port}/0"  # the startup node outlives the failover
    lease = run_cli("queue", "config", queue, "--cluster", "--lease-seconds", "2", redis_url=url)
    assert lease.returncode == 0, lease.stderr
    worker = slow_worker(url, queue, tmp_path)
    try:
        with Client(url, queue, cluster=True) as client:
            before = enqueue_and_start(client)
            assert run_cli("queue", "pause", queue, "--cluster", redis_url=url).returncode == 0
            cut_replication(master_port, replica_port)  # what the master takes now stays there
            doomed = client.enqueue_many({"input": 500 + i} for i in range(5))
            master.stop(signal.SIGKILL)
            killed = time.monotonic()
            wait_for(lambda: promoted(survivor, slot, replica_port), 30, 0.1, "the replica promoted")
            failover_s = time.monotonic() - killed
            assert run_cli("queue", "resume", queue, "--cluster", redis_url=url).returncode == 0
            after = client.enqueue_many({"input": 1000 + i} for i in range(50))

            outcome: dict[str, str] = {}
            waited = time.monotonic()
            inputs = [*range(300), *range(500, 505), *range(1000, 1050)]
            for handle, value in zip(before + doomed + after, inputs, strict=True):
                try:
                    result = handle.result(timeout=60)
                    assert result.ok and result.output == f"done:{value}", (value, result)
                    outcome[handle.id] = "ok"
                except RequestLost as exc:  # the clear end of a wait for a lost request
                    assert "not in Redis any more" in str(exc)
                    outcome[handle.id] = "lost"
            assert time.monotonic() - waited < 90
        assert [outcome[h.id] for h in before] == ["ok"] * 300
        assert [outcome[h.id] for h in doomed] == ["lost"] * 5
        assert [outcome[h.id] for h in after] == ["ok"] * 50
        assert worker.poll() is None, "the worker died with the master"
        print(f"failover took {failover_s:.1f}s after the kill")
    finally:
        code = stop_process(worker)
    assert code == 0, (tmp_path / "worker.log").read_text()[-3000:]
    assert "Traceback" not in (tmp_path / "worker.log").read_text()


def test_sharded_queue_survives_a_master_failover(cluster: list[RedisServer], tmp_path: Path) -> None:
    """A queue of 3 shards, one on each master: the master of shard 0 (it also holds the
    worker registry and the reaper's lock) dies mid-run. Its replica takes over; the
    worker's head reads, wake-up watchers and the client's reply readers ride through
    the errors, and every request, on every shard, gets its result."""
    queue = "sharded-failover"
    probe = redis.Redis(port=cluster[0].port, decode_responses=True)
    slot = tag_slot(shard_tags(queue, 3)[0])
    master_port, replica_port = node_of_slot(probe, slot), replica_of(probe, slot)
    assert len({node_of_slot(probe, tag_slot(t)) for t in shard_tags(queue, 3)}) == 3
    probe.close()
    master = next(n for n in cluster if n.port == master_port)
    survivor = next(n for n in cluster if n.port not in (master_port, replica_port))
    url = f"redis://127.0.0.1:{survivor.port}/0"
    done = run_cli("queue", "config", queue, "--cluster", "--shards", "3", "--lease-seconds", "2",
                   redis_url=url)
    assert done.returncode == 0, done.stderr
    worker = slow_worker(url, queue, tmp_path)
    try:
        with Client(url, queue, cluster=True) as client:
            before = enqueue_and_start(client)
            master.stop(signal.SIGKILL)
            wait_for(lambda: promoted(survivor, slot, replica_port), 30, 0.1, "the replica promoted")
            after = client.enqueue_many({"input": 1000 + i} for i in range(60))
            results = [handle.result(timeout=90) for handle in before + after]
        assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
        assert worker.poll() is None, "the worker died with the master"
    finally:
        code = stop_process(worker)
    assert code == 0, (tmp_path / "worker.log").read_text()[-3000:]
    assert "Traceback" not in (tmp_path / "worker.log").read_text()
