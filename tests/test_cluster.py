"""Redis Cluster: the `{queue}` hash tag keeps each queue's Lua calls on one slot."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import redis

from batchery import Client
from tests.conftest import (RedisServer, free_port, newest_redis_server, run_cli, start_worker,
                            stop_process, wait_for)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster_url() -> Iterator[str]:
    binary = newest_redis_server()
    cli = str(Path(binary).with_name("redis-cli"))
    nodes = [RedisServer("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                         port=free_port(below=55_000), binary=binary)  # bus port: +10000
             for _ in range(3)]
    try:
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
                        "--cluster-replicas", "0", "--cluster-yes"], check=True,
                       capture_output=True, timeout=60)
        probe = redis.Redis(port=nodes[0].port, decode_responses=True)
        wait_for(lambda: probe.cluster("info")["cluster_state"] == "ok", 30, message="cluster ok")
        probe.close()
        yield f"redis://127.0.0.1:{nodes[0].port}/0"
    finally:
        for node in nodes:
            node.close()


def test_queues_work_across_a_cluster(cluster_url: str, tmp_path: Path) -> None:
    queues = ["embed", "classify", "other-queue"]  # hash tags that land on different nodes
    workers = [start_worker(cluster_url, q, "--cluster", "--runner", "tests.runners:echo",
                            log=tmp_path / f"{q}.log") for q in queues]
    try:
        for queue in queues:
            with Client(cluster_url, queue, cluster=True) as client:
                results = client.map([f"{queue} {i}" for i in range(50)], timeout=60)
                assert [r.output["echo"] for r in results] == [f"{queue} {i}" for i in range(50)]
        stats = run_cli("stats", "--cluster", "--json", redis_url=cluster_url)
        assert stats.returncode == 0, stats.stderr
        assert set(queues) <= set(json.loads(stats.stdout)["queues"])
    finally:
        for worker in workers:
            stop_process(worker)
    for queue in queues:
        assert "Traceback" not in (tmp_path / f"{queue}.log").read_text()
