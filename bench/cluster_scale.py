"""Cluster scale: one logical queue over 1, 3 and 6 shards on a local Redis Cluster.

A local cluster of three masters (no replicas, no persistence); for each shard count a
fresh queue set up with the real CLI (``batchery queue config Q --shards N``), real
``batchery worker --runner bench.runners:noop`` processes started first, and the real
``Client.map`` (results delivered to the caller) in this process. It prints aggregate
requests/s, the CPU each redis-server node spent per request, the client's and the
workers' CPU per request, and the projected ceiling per node and for 10 and 100 nodes from
the measured Redis CPU per request.

``python -m bench.cluster_scale [--quick] [-n N] [--shards 1,3,6] [--workers W]
[--max-batch-size B]``
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import redis

from batchery import Client
from batchery.embedded import find_redis_server
from bench import common
from bench.queue_cost import IN_FLIGHT

MASTERS = 3
COLUMNS = [("shards", "shards", "d"), ("requests", "requests", ",d"), ("seconds", "s", ".1f"),
           ("rps", "requests/s", ",.0f"), ("batch", "mean batch", ".0f"),
           ("us_redis", "Redis us/req (all nodes)", ".1f"), ("per_node", "per node us/req", ""),
           ("us_client", "client us/req", ".1f"), ("us_worker", "workers us/req", ".1f")]


@contextlib.contextmanager
def private_cluster(masters: int = MASTERS) -> Iterator[list[int]]:
    """A throwaway Redis Cluster of ``masters`` nodes (no replicas, no persistence) on free
    ports; yields their ports once every slot is served."""
    binary = find_redis_server()
    folder = tempfile.mkdtemp(prefix="batchery-cluster-")
    ports = [common.free_port() for _ in range(masters)]
    while max(ports) >= 55_000:  # each node's bus port is its port + 10,000
        ports = [common.free_port() for _ in range(masters)]
    procs = [subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", folder,
                               "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                               "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for port in ports]
    try:
        for port in ports:
            with redis.Redis(port=port) as node:
                common.wait_until(lambda: common.pings(node), 15, "redis-server")
        cli = str(Path(binary).with_name("redis-cli"))
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        probe = redis.Redis(port=ports[0], decode_responses=True)
        common.wait_until(lambda: probe.cluster("info")["cluster_state"] == "ok", 30, "the cluster")
        probe.close()
        yield ports
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


def configure(url: str, queue: str, shards: int) -> None:
    """Spread ``queue`` over ``shards`` hash tags with the real CLI."""
    subprocess.run([sys.executable, "-m", "batchery", "queue", "config", queue, "--redis-url", url,
                    "--cluster", "--shards", str(shards)], check=True, env=common.env(),
                   cwd=common.ROOT, stdout=subprocess.DEVNULL, timeout=60)


def run(ports: list[int], shards: int, n: int, workers: int, max_batch_size: int) -> dict[str, Any]:
    url, queue = f"redis://127.0.0.1:{ports[0]}/0", f"scale{shards}"
    configure(url, queue, shards)
    flags = ["--runner", "bench.runners:noop", "--cluster"]
    if max_batch_size:
        flags += ["--max-batch-size", str(max_batch_size), "--max-wait-ms", "0"]
    procs = [common.batchery_worker(url, queue, *flags) for _ in range(workers)]
    nodes = {port: common.redis_pid(f"redis://127.0.0.1:{port}/0") for port in ports}
    try:
        with Client(url, queue, cluster=True) as client:
            common.wait_until(lambda: client.queue.stats()["workers"] >= workers, 60, "the workers")
            before = {"client": common.cpu_seconds(), "worker": sum(common.cpu_seconds(p.pid) for p in procs),
                      **{port: common.cpu_seconds(pid) for port, pid in nodes.items()}}
            started = time.perf_counter()
            results = client.map(range(n), max_in_flight=IN_FLIGHT)
            seconds = time.perf_counter() - started
            after = {"client": common.cpu_seconds(), "worker": sum(common.cpu_seconds(p.pid) for p in procs),
                     **{port: common.cpu_seconds(pid) for port, pid in nodes.items()}}
            totals = client.queue.stats()["totals"]
    finally:
        common.stop(procs)
    ok = sum(1 for r in results if r.ok)
    assert ok == n, f"{ok} of {n} ok"
    us = {name: 1e6 * (after[name] - before[name]) / n for name in before}
    per_node = [us[port] for port in ports]
    return {"shards": shards, "requests": n, "seconds": seconds, "rps": n / seconds,
            "batch": totals.get("ok", n) / max(1, totals.get("batches", 1)),
            "us_redis": sum(per_node), "per_node": " / ".join(f"{u:.1f}" for u in per_node),
            "us_client": us["client"], "us_worker": us["worker"], "nodes": per_node}


def projection(rows: list[dict[str, Any]]) -> str:
    """Ceilings from the measured Redis CPU per request of the run with the most shards:
    N nodes each carrying 1/N of the requests, a node's one core at 100%."""
    most = max(rows, key=lambda r: (r["shards"], -r["us_redis"]))
    per_node = 1e6 / most["us_redis"]
    python = most["us_client"] + most["us_worker"]
    return "\n".join([
        f"Redis CPU per request, {most['shards']} shards: {most['us_redis']:.1f} us over all nodes",
        f"projected ceiling per node (one core at 100%): {per_node:,.0f} requests/s",
        f"projected ceiling, 10 nodes (>= 10 shards): {10 * per_node:,.0f} requests/s",
        f"projected ceiling, 100 nodes (>= 100 shards): {100 * per_node:,.0f} requests/s",
        f"client + worker CPU per request: {python:.1f} us, so at 10 nodes' ceiling "
        f"{10 * per_node * python / 1e6:,.0f} cores of producers and workers"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("-n", type=int, help="requests per shard count (default 100,000)")
    p.add_argument("--shards", default="1,3,6", help="shard counts to run (comma-separated)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-batch-size", type=int, default=0,
                   help="worker flag (with --max-wait-ms 0); default: the worker's own defaults")
    args = p.parse_args(argv)
    n = args.n or (20_000 if args.quick else 100_000)
    counts = [int(s) for s in args.shards.split(",")]
    rows: list[dict[str, Any]] = []
    with private_cluster() as ports:
        for _ in range(args.repeat):
            for shards in counts:
                common.log(f"cluster scale: {shards} shard(s), {n:,} no-op requests ...")
                rows.append(run(ports, shards, n, args.workers, args.max_batch_size))
    text = common.table(rows, COLUMNS) + "\n\n" + projection(rows)
    targets = [f"{r['shards']} shards: busiest node / quietest {max(r['nodes']) / min(r['nodes']):.2f} "
               "(an even spread: 1.0)" for r in rows if r["shards"] >= MASTERS]
    print(f"\n## Cluster scale: no-op runner, {MASTERS} masters, {args.workers} workers "
          f"({common.machine()})\n\n{text}\n\n" + "\n".join(targets) + "\n")
    common.save("cluster_scale", {"machine": common.machine(), "rows": rows, "targets": targets})
    return {"rows": rows, "table": text, "targets": targets}


if __name__ == "__main__":
    main()
