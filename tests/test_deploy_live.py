"""The deploy files run for real: the Procfile under honcho, and KEDA's query evaluated on
the metrics of live workers."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from batchery import Client
from batchery.batching.keys import tag_slot
from batchery.batching.request import Request
from batchery.batching.sharded import open_queue
from batchery.connection import RedisSettings
from tests.test_cluster import local_cluster, node_of_slot
from tests.test_keda import keda_printed, keda_reading
from tests.conftest import (ROOT, RedisServer, cli_env, free_port, pings, scrape, start_worker,
                            stop_process, wait_for)

pytestmark = pytest.mark.slow


def test_the_procfile_starts_redis_a_worker_and_a_jobs_worker(tmp_path: Path) -> None:
    """`honcho start` on the Procfile, Redis moved from 6379 to a free port so that it runs
    beside anything else on this machine; the worker's metrics go to the $PORT honcho
    gives it (base + 100: the Procfile's second process)."""
    if not shutil.which("redis-server"):
        pytest.skip("the Procfile's redis process runs redis-server from PATH: none here "
                    "(install redis-server 6.2+ to run this test)")
    redis_port, metrics_port = free_port(), free_port()
    procfile = (ROOT / "Procfile").read_text()
    commands = [line for line in procfile.splitlines() if line and not line.startswith("#")]
    assert all("6379" in line for line in commands) and sum("9100" in c for c in commands) == 1
    (tmp_path / "Procfile").write_text(procfile.replace("6379", str(redis_port)))
    env = cli_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    log = open(tmp_path / "honcho.log", "w")
    honcho = subprocess.Popen([sys.executable, "-m", "honcho", "start", "-p",
                               str(metrics_port - 100)], cwd=tmp_path, env=env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"redis://127.0.0.1:{redis_port}/0"
    try:
        wait_for(lambda: honcho.poll() is None and _answers(url), 60, message="the redis process")
        with Client(url, "embed") as client:
            wait_for(lambda: client.queue.stats()["workers"] == 1, 180, message="the worker")
            result = client.enqueue("the Procfile runs").result(timeout=60)
            assert result.ok and len(result.output) == 384
            rq_workers = redis.Redis.from_url(url).smembers("rq:workers")
            assert rq_workers, "the jobs process runs an RQ worker"
        assert (tmp_path / ".batchery" / "redis").is_dir()  # Redis keeps its AOF there
        assert scrape(metrics_port)  # the worker serves /metrics where the Procfile says
    finally:
        if honcho.poll() is None:
            honcho.send_signal(signal.SIGINT)  # Ctrl-C: honcho stops every process
        try:
            honcho.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(honcho.pid, signal.SIGKILL)
            honcho.wait(10)
        log.close()
    text = (tmp_path / "honcho.log").read_text()
    assert "Traceback" not in text, text[-3000:]
    assert not _answers(url), "redis still runs after honcho stopped"


def _answers(url: str) -> bool:
    with redis.Redis.from_url(url, socket_connect_timeout=1, retry=None) as client:
        return pings(client)


KEDA_QUERY = re.compile(r"^sum\(max by \((\w+)\) \((\w+)\{(\w+)=\"([^\"]+)\"\}\)\)$")


def keda_query(samples_per_worker: list[dict]) -> float:
    """deploy/keda's query over what Prometheus would scrape from these workers. Only the
    shape sum(max by (L) (metric{label="v"})) is understood: a new shape fails here."""
    (so,) = yaml.safe_load_all((ROOT / "deploy/keda/scaledobject-prometheus.yaml").read_text())
    query = so["spec"]["triggers"][0]["metadata"]["query"]
    match = KEDA_QUERY.match(query.strip())
    assert match, f"teach keda_query() the shape of {query!r}"
    by, metric, label, wanted = match.groups()
    groups: dict[str, float] = defaultdict(lambda: float("-inf"))
    for samples in samples_per_worker:
        for (name, labels), v in samples.items():
            labels = dict(labels)
            if name == metric and labels.get(label) == wanted:
                groups[labels[by]] = max(groups[labels[by]], v)
    return sum(groups.values())


def held_still(client: Client) -> Any:
    """A condition: the requests in flight, the same (and some) at two readings 1.5 s
    apart (every claim a worker makes with its batch held is done by then)."""
    seen: list[tuple[float, int]] = []

    def check() -> bool:
        now, held = time.monotonic(), client.queue.stats()["inflight"]
        seen.append((now, held))
        return held > 0 and any(n == held and now - at >= 1.5 for at, n in seen) \
            and all(n == held for at, n in seen if now - at <= 1.5)
    return check


@pytest.mark.parametrize("shards", [1, 3])
def test_the_keda_query_reads_the_queue_depth_once_across_workers(tmp_path: Path,
                                                                  shards: int) -> None:
    """Two workers on the queue `embed` (over 1 or 3 shards) exporting its depth: the query
    reads the whole queue's queued requests, every shard, counted once."""
    server = RedisServer()  # its own server: the query names the queue "embed"
    gate = tmp_path / "gate"
    gate.touch()  # the workers hold their batches: the rest stays queued
    ports = [free_port(), free_port()]
    workers = []
    try:
        with Client(server.url, "embed") as client:
            client.queue.update_settings(lease_seconds=3,  # depth refreshed every second
                                         shards=shards)
            workers = [start_worker(server.url, "embed", "--runner", "tests.runners:gated",
                                    "--max-batch-size", "4", "--max-wait-ms", "0",
                                    "--metrics-port", str(port), log=tmp_path / f"w{port}.log",
                                    BATCHERY_TEST_GATE=str(gate)) for port in ports]
            wait_for(lambda: client.queue.stats()["workers"] == 2, 60, message="two workers")
            client.enqueue_many([{"input": i, "priority": p} for i, p in
                                 enumerate(["realtime"] * 10 + ["normal"] * 20 + ["batch"] * 30)])
            if shards == 1:
                wait_for(lambda: client.queue.stats()["inflight"] == 16, 30,
                         message="each worker to hold a running and a prefetched batch")
            else:  # batches cut where another shard's head ranks first: held, not 16
                wait_for(held_still(client), 30, interval=0.5,
                         message="each worker to hold a running and a prefetched batch")
            stats = client.queue.stats()
            depth = stats["pending"]
            assert depth == 60 - stats["inflight"] and depth > 30
            wait_for(lambda: keda_query([scrape(p) for p in ports]) == depth, 20,
                     message=f"the KEDA query to read the depth {depth}")
            def naive() -> float:  # each worker refreshes its gauge at its own heartbeat
                return sum(v for p in ports for (n, _), v in scrape(p).items()
                           if n == "batchery_queue_depth")
            wait_for(lambda: naive() == 2 * depth, 20, message="both workers to report it")
            assert naive() == 2 * depth  # why the query takes max across workers, not sum
            gate.unlink()
            wait_for(lambda: client.queue.stats()["pending"] == 0, 60, message="drained")
            wait_for(lambda: keda_query([scrape(p) for p in ports]) == 0, 20,
                     message="the KEDA query to read 0")
    finally:
        if gate.exists():
            gate.unlink()
        for worker in workers:
            stop_process(worker)
        server.close()


def test_keda_counts_every_shard_on_a_cluster_from_zero() -> None:
    """`batchery queue keda embed --cluster` on a 3-master Cluster with the queue over 3
    shards: its redis-cluster triggers name keys on all three masters, and what KEDA reads
    (each key's TYPE and ZCARD from the master holding it, added by the formula) is the
    queue's whole queued count, with no worker running."""
    with local_cluster(3, 0) as nodes:
        url = nodes[0].url
        conn = RedisSettings.from_url(url, cluster=True).client()
        queue = open_queue(conn, "embed")
        queue.update_settings(shards=3)
        ids = [f"c{i}" for i in range(90)]
        queue.enqueue([Request.validated(id=i, input="x") for i in ids])
        _, so = keda_printed("embed", "--cluster", "--redis-url", url)
        triggers, modifiers = so["spec"]["triggers"], so["spec"]["advanced"]["scalingModifiers"]
        assert {t["type"] for t in triggers} == {"redis-cluster"} and len(triggers) == 6
        with redis.Redis(port=nodes[0].port) as probe:
            homes = {node_of_slot(probe, tag_slot(t["metadata"]["listName"].split("{")[1].split("}")[0]))
                     for t in triggers}
        assert len(homes) == 3, "the shards' keys sit on every master"
        stats = queue.stats()
        assert stats["workers"] == 0
        assert keda_reading(triggers, modifiers["formula"], conn) == stats["pending"] == 90
        queue.cancel(ids)
        assert keda_reading(triggers, modifiers["formula"], conn) == 0
        conn.close()
