"""Redis Cluster: the `{queue}` hash tag keeps each queue's Lua calls on one slot."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import redis

from batchery import Client
from batchery.batching.keys import Keys
from tests.conftest import (RedisServer, free_port, newest_redis_server, run_cli, start_worker,
                            stop_process, wait_for)

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def local_cluster(masters: int, replicas: int, *extra: str) -> Iterator[list[RedisServer]]:
    """A Redis Cluster of ``masters`` nodes with ``replicas`` each, on free ports below
    55,000 (each node's bus port is its port + 10,000), ready when its state is ok and
    every master has its replicas."""
    binary = newest_redis_server()
    cli = str(Path(binary).with_name("redis-cli"))
    nodes = [RedisServer("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", *extra,
                         port=free_port(below=55_000), binary=binary)
             for _ in range(masters * (1 + replicas))]
    try:
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
                        "--cluster-replicas", str(replicas), "--cluster-yes"], check=True,
                       capture_output=True, timeout=60)

        def ready() -> bool:
            with redis.Redis(port=nodes[0].port, decode_responses=True) as probe:
                slots = probe.execute_command("CLUSTER", "SLOTS")
                return (probe.cluster("info")["cluster_state"] == "ok" and len(slots) == masters
                        and all(len(entry) >= 3 + replicas for entry in slots))

        wait_for(ready, 30, 0.2, f"{masters} masters with {replicas} replica(s) each")
        yield nodes
    finally:
        for node in nodes:
            node.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[RedisServer]]:
    with local_cluster(3, 0) as nodes:
        yield nodes


def node_of_slot(probe: redis.Redis, slot: int) -> int:
    """The port of the node that serves ``slot``, from the cluster's slot map."""
    for first, last, (_, port, *_rest), *_replicas in probe.execute_command("CLUSTER", "SLOTS"):
        if first <= slot <= last:
            return int(port)
    raise AssertionError(f"slot {slot} is served by no node")


def one_queue_per_node(nodes: list[RedisServer]) -> dict[str, int]:
    """Queue names whose keys (hash tag {queue}) land one on each node: name -> port."""
    probe = redis.Redis(port=nodes[0].port, decode_responses=True)
    placed: dict[int, str] = {}
    for i in range(1000):
        name = f"q{i}"
        slot = probe.cluster("keyslot", Keys(name).pending)
        assert slot == probe.cluster("keyslot", Keys(name).requests)  # one slot per queue
        placed.setdefault(node_of_slot(probe, slot), name)
        if len(placed) == len(nodes):
            break
    probe.close()
    assert sorted(placed) == sorted(n.port for n in nodes)
    return {name: port for port, name in placed.items()}


def test_queues_work_across_a_cluster(cluster: list[RedisServer], tmp_path: Path) -> None:
    cluster_url = f"redis://127.0.0.1:{cluster[0].port}/0"
    placement = one_queue_per_node(cluster)
    queues = list(placement)
    workers = [start_worker(cluster_url, q, "--cluster", "--runner", "tests.runners:echo",
                            log=tmp_path / f"{q}.log") for q in queues]
    try:
        for queue in queues:
            with Client(cluster_url, queue, cluster=True) as client:
                results = client.map([f"{queue} {i}" for i in range(50)], timeout=60)
                assert [r.output["echo"] for r in results] == [f"{queue} {i}" for i in range(50)]
        stats = run_cli("queue", "stats", "--cluster", "--json", redis_url=cluster_url)
        assert stats.returncode == 0, stats.stderr
        assert set(queues) <= set(json.loads(stats.stdout)["queues"])
    finally:
        for worker in workers:
            stop_process(worker)
    for queue, port in placement.items():  # each node holds its queue's keys, and only there
        assert "Traceback" not in (tmp_path / f"{queue}.log").read_text()
        for node in cluster:
            local = redis.Redis(port=node.port, decode_responses=True)
            keys = local.execute_command("CLUSTER", "COUNTKEYSINSLOT",
                                         local.cluster("keyslot", Keys(queue).settings))
            assert (keys > 0) == (node.port == port), (queue, node.port, keys)
            local.close()
