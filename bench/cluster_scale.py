"""Cluster scale: one logical queue over local Redis Clusters of 1, 2 and 3 masters.

For each master count a local cluster (no replicas, no persistence) and, for each shard
count (default: one per master), a fresh queue set up with the real CLI
(``batchery queue config Q --shards N``), real
``batchery worker --runner bench.runners:noop --cluster`` processes (no other flag unless
--max-batch-size) and a producer in a child process that cannot import transformers (as
on the base install: requests priced by estimate), in both start orders:

(a) workers first: the workers registered, then the producer's ``Client.map``; timed
    from its first enqueue to its last result
(b) producer first: every request enqueued (``Client.enqueue_many``, handles kept), then
    the workers started; timed from the first worker's registration to the last result
    read from the producer's handles

It prints aggregate requests/s, the CPU each redis-server node spent per request (from
the producer's first enqueue), the producer's CPU per request (its own reading, enqueue
and collection) and the workers' (from each one's registration: start-up left out), and
the projected ceiling per node and for 10 and 100 nodes from the measured Redis CPU per
request of the costlier start order. The check: Redis CPU per request over all nodes
flat (within 10%) from 1 master to the most, so that N nodes carry N times one node's
load, and the busiest node within 10% of the quietest.

``--instructions`` runs every node under valgrind's callgrind (it must be installed) and
counts, instead of CPU time, the instructions each node executed per request: a count
that the machine's load does not move. Here three redis-servers, the workers and the
producer share 2 cores, so each command runs slower on 3 masters than on 1 (more
switches, colder caches), which CPU time counts and the instructions do not. Valgrind
slows Redis about 30 times: use a small -n (6,000 takes a few minutes).

``python -m bench.cluster_scale [--quick] [-n N] [--masters 1,2,3] [--shards N,...]
[--workers W] [--max-batch-size B] [--instructions]``
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

import redis

from batchery import Client
from batchery.embedded import find_redis_server
from bench import common
from bench.queue_cost import IN_FLIGHT
from bench.redis_instructions import callgrind_command, callgrind_dump, dumped_counts

MASTERS = 3  # private_cluster's default size
ORDERS = ("workers first", "producer first")
CHUNK = 500  # requests per enqueue_many in (b): as many as Client.map sends per call
COLUMNS = [("masters", "masters", "d"), ("shards", "shards", "d"), ("order", "start order", ""), ("requests", "requests", ",d"),
           ("seconds", "s", ".1f"), ("startup", "workers' start-up s", ".1f"), ("rps", "requests/s", ",.0f"),
           ("batch", "mean batch", ".0f"),
           ("us_redis", "Redis us/req (all nodes)", ".1f"), ("per_node", "per node us/req", ""),
           ("us_client", "client us/req", ".1f"), ("us_worker", "workers us/req", ".1f")]
INSTRUCTION_COLUMNS = [*COLUMNS[:3], ("requests", "requests", ",d"), ("batch", "mean batch", ".0f"),
                       ("us_redis", "Redis k instructions/req (all nodes)", ".1f"),
                       ("per_node", "per node k instructions/req", "")]


class NodeCpu:
    """What each node of a cluster spends over a run, per request: CPU microseconds
    (/proc: commands, protocol, event loop and cluster bus together)."""

    def __init__(self, ports: list[int]) -> None:
        self.pids = {port: common.redis_pid(f"redis://127.0.0.1:{port}/0") for port in ports}
        self.before: dict[int, float] = {}

    def start(self) -> None:
        self.before = {port: common.cpu_seconds(pid) for port, pid in self.pids.items()}

    def per_request(self, n: int) -> list[float]:
        return [1e6 * (common.cpu_seconds(pid) - self.before[port]) / n
                for port, pid in self.pids.items()]


class NodeInstructions(NodeCpu):
    """The same in thousands of instructions, from callgrind (nodes started by
    private_cluster(..., callgrind=folder)): each node dumps its count at the start and
    at the end of the run, and the second dump is the run's."""

    def __init__(self, ports: list[int], folder: str) -> None:
        super().__init__(ports)
        self.folder = folder

    def start(self) -> None:
        for pid in self.pids.values():
            callgrind_dump(pid, "before")

    def per_request(self, n: int) -> list[float]:
        for pid in self.pids.values():
            callgrind_dump(pid, "run")
        return [dumped_counts(os.path.join(self.folder, f"callgrind.{pid}.*")).get("run", 0)
                / n / 1000 for pid in self.pids.values()]


@contextlib.contextmanager
def private_cluster(masters: int = MASTERS, callgrind: str | None = None) -> Iterator[list[int]]:
    """A throwaway Redis Cluster of ``masters`` nodes (no replicas, no persistence) on free
    ports; yields their ports once every slot is served. ``callgrind``: a folder; each
    node runs under valgrind's callgrind and writes its counts there (NodeInstructions)."""
    binary = find_redis_server()
    under = callgrind_command(os.path.join(callgrind, "callgrind.%p")) if callgrind else []
    folder = tempfile.mkdtemp(prefix="batchery-cluster-")
    ports = [common.free_port() for _ in range(masters)]
    while max(ports) >= 55_000:  # each node's bus port is its port + 10,000
        ports = [common.free_port() for _ in range(masters)]
    procs = [subprocess.Popen([*under, binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", folder,
                               "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                               "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for port in ports]
    try:
        for port in ports:
            with redis.Redis(port=port) as node:
                common.wait_until(lambda: common.pings(node), 60, "redis-server")
        form_cluster(ports)
        yield ports
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


def form_cluster(ports: list[int]) -> None:
    """Masters on ``ports`` owning equal contiguous slot ranges from slot 0 (the layout of
    `redis-cli --cluster create`, which refuses fewer than 3 masters), met and agreed."""
    nodes = [redis.Redis(port=port, decode_responses=True) for port in ports]
    try:
        for i, node in enumerate(nodes):
            first, last = i * 16384 // len(nodes), (i + 1) * 16384 // len(nodes) - 1
            node.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        for port in ports[1:]:
            nodes[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)
        common.wait_until(lambda: all(n.cluster("info")["cluster_state"] == "ok"
                                      and int(n.cluster("info")["cluster_known_nodes"]) == len(ports)
                                      for n in nodes), 30, "the cluster")
    finally:
        for node in nodes:
            node.close()


def configure(url: str, queue: str, shards: int) -> None:
    """Spread ``queue`` over ``shards`` hash tags with the real CLI."""
    subprocess.run([sys.executable, "-m", "batchery", "queue", "config", queue, "--redis-url", url,
                    "--cluster", "--shards", str(shards)], check=True, env=common.env(),
                   cwd=common.ROOT, stdout=subprocess.DEVNULL, timeout=60)


def produce(url: str, queue: str, n: int, order: str) -> None:
    """The producer, in a child without transformers: says "ready", waits for "go" on
    stdin, then runs ``order``; prints its CPU seconds from "go" to its last result."""
    assert "transformers" not in sys.modules or sys.modules["transformers"] is None
    with Client(url, queue, cluster=True) as client:
        assert client.count_tokens("x") is None, "this producer must not count exactly"
        print("ready", flush=True)
        sys.stdin.readline()
        cpu = common.cpu_seconds()
        if order == ORDERS[0]:
            results = client.map(range(n), max_in_flight=IN_FLIGHT)
        else:
            handles = [h for i in range(0, n, CHUNK)
                       for h in client.enqueue_many({"input": j} for j in range(i, min(n, i + CHUNK)))]
            print("enqueued", flush=True)
            results = [h.result() for h in handles]
        ok = sum(1 for r in results if r.ok)
        print(json.dumps({"cpu": common.cpu_seconds() - cpu, "ok": ok}), flush=True)


def expect(child: subprocess.Popen, line: str) -> None:
    said = child.stdout.readline().strip()
    assert said == line, f"the producer said {said!r}, not {line!r}"


def registered(client: Client, procs: list[subprocess.Popen]) -> tuple[float, dict[int, float]]:
    """Wait for every worker to register: (when the first did, each worker's CPU seconds
    as it did, so that its start-up is left out of its CPU per request)."""
    first, cpu = [], {}

    def all_in() -> bool:
        pids = {int(w["id"].rsplit(":", 2)[1]) for w in client.queue.worker_reports()[1]}  # host:pid:hex
        for p in procs:
            if p.pid in pids and p.pid not in cpu:
                cpu[p.pid] = common.cpu_seconds(p.pid)
                first.append(time.perf_counter())
        return len(cpu) == len(procs)
    common.wait_until(all_in, 60, "the workers", interval=0.01)
    return min(first), cpu


def run(ports: list[int], shards: int, n: int, workers: int, max_batch_size: int,
        order: str, meter: NodeCpu | None = None) -> dict[str, Any]:
    url, queue = f"redis://127.0.0.1:{ports[0]}/0", f"scale{shards}-{time.monotonic_ns()}"
    configure(url, queue, shards)
    flags = ["--runner", "bench.runners:noop", "--cluster"]
    if max_batch_size:
        flags += ["--max-batch-size", str(max_batch_size), "--max-wait-ms", "0"]
    meter = meter or NodeCpu(ports)
    child = common.without_transformers("from bench.cluster_scale import produce; "
                                        f"produce({url!r}, {queue!r}, {n}, {order!r})")
    procs: list[subprocess.Popen] = []
    try:
        with Client(url, queue, cluster=True) as client:
            expect(child, "ready")
            if order == ORDERS[0]:
                launched = time.perf_counter()
                procs = [common.batchery_worker(url, queue, *flags) for _ in range(workers)]
                first, _ = registered(client, procs)
            meter.start()
            worker_cpu = {p.pid: common.cpu_seconds(p.pid) for p in procs}
            child.stdin.write("go\n")
            child.stdin.flush()
            started = time.perf_counter()
            if order == ORDERS[1]:
                expect(child, "enqueued")
                launched = time.perf_counter()
                procs = [common.batchery_worker(url, queue, *flags) for _ in range(workers)]
                first, worker_cpu = registered(client, procs)
                started = first
            report = json.loads(child.stdout.readline())
            seconds = time.perf_counter() - started
            redis_us = meter.per_request(n)
            worker_us = 1e6 * sum(common.cpu_seconds(p.pid) - worker_cpu[p.pid] for p in procs) / n
            totals = client.queue.stats()["totals"]
    finally:
        common.stop(procs)
        child.kill()
        child.wait(10)
    assert report["ok"] == n, f"{report['ok']} of {n} ok"
    return {"masters": len(ports), "shards": shards, "order": order, "requests": n, "seconds": seconds,
            "startup": first - launched, "rps": n / seconds,
            "batch": totals.get("ok", n) / max(1, totals.get("batches", 1)),
            "us_redis": sum(redis_us), "per_node": " / ".join(f"{u:.1f}" for u in redis_us),
            "us_client": 1e6 * report["cpu"] / n, "us_worker": worker_us, "nodes": redis_us}


def projection(rows: list[dict[str, Any]]) -> str:
    """Ceilings from the measured Redis CPU per request of the runs with the most shards,
    the costlier of them (a figure must hold in either start order): N nodes each carrying
    1/N of the requests, a node's one core at 100%."""
    most = [r for r in rows if r["shards"] == max(r["shards"] for r in rows)]
    costliest = max(most, key=lambda r: r["us_redis"])
    per_node = 1e6 / costliest["us_redis"]
    python = max(r["us_client"] + r["us_worker"] for r in most)
    return "\n".join([
        f"Redis CPU per request, {costliest['shards']} shards, {costliest['order']} (the costlier): "
        f"{costliest['us_redis']:.1f} us over all nodes",
        f"projected ceiling per node (one core at 100%): {per_node:,.0f} requests/s",
        f"projected ceiling, 10 nodes (>= 10 shards): {10 * per_node:,.0f} requests/s",
        f"projected ceiling, 100 nodes (>= 100 shards): {100 * per_node:,.0f} requests/s",
        f"client + worker CPU per request (the costlier): {python:.1f} us, so at 10 nodes' "
        f"ceiling {10 * per_node * python / 1e6:,.0f} cores of producers and workers"])


def flatness(rows: list[dict[str, Any]]) -> list[str]:
    """The checks: Redis CPU per request over all nodes against one master's (the costlier
    start order of each master count), and each run's busiest node against its quietest."""
    costlier: dict[int, float] = {}
    for r in rows:
        if r["shards"] == r["masters"]:
            costlier[r["masters"]] = max(costlier.get(r["masters"], 0.0), r["us_redis"])
    lines = []
    if 1 in costlier:
        for masters, us in sorted(costlier.items()):
            ratio = us / costlier[1]
            lines.append(f"{masters} master(s), one shard each: Redis {us:.1f} us/request over "
                         f"all nodes, {ratio:.2f} x one master's "
                         f"({'flat' if abs(ratio - 1) <= 0.10 else 'NOT flat'}: target within 10%)")
    lines += [f"{r['masters']} masters, {r['shards']} shards, {r['order']}: busiest node / "
              f"quietest {max(r['nodes']) / min(r['nodes']):.2f} (an even spread: 1.0)"
              for r in rows if r["masters"] > 1 and r["shards"] >= r["masters"]]
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("-n", type=int, help="requests per run (default 100,000)")
    p.add_argument("--masters", default="1,2,3", help="cluster sizes to run (comma-separated)")
    p.add_argument("--shards", help="shard counts to run on each (default: one per master)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-batch-size", type=int, default=0,
                   help="worker flag (with --max-wait-ms 0); default: the worker's own defaults")
    p.add_argument("--instructions", action="store_true",
                   help="count each node's instructions (callgrind) instead of its CPU time")
    args = p.parse_args(argv)
    n = args.n or (20_000 if args.quick else 100_000)
    rows: list[dict[str, Any]] = []
    for masters in (int(m) for m in args.masters.split(",")):
        counts = [int(s) for s in args.shards.split(",")] if args.shards else [masters]
        with contextlib.ExitStack() as stack:
            folder = (stack.enter_context(tempfile.TemporaryDirectory(prefix="batchery-callgrind-"))
                      if args.instructions else None)
            ports = stack.enter_context(private_cluster(masters, folder))
            for _ in range(args.repeat):
                for shards in counts:
                    for order in ORDERS:
                        common.log(f"cluster scale: {masters} master(s), {shards} shard(s), "
                                   f"{order}, {n:,} no-op requests ...")
                        meter = NodeInstructions(ports, folder) if folder else NodeCpu(ports)
                        rows.append(run(ports, shards, n, args.workers, args.max_batch_size,
                                        order, meter))
    if args.instructions:
        text = common.table(rows, INSTRUCTION_COLUMNS)
        targets = [line.replace("us/request", "k instructions/request")
                   for line in flatness(rows)]
    else:
        text = common.table(rows, COLUMNS) + "\n\n" + projection(rows)
        targets = flatness(rows)
    print(f"\n## Cluster scale: no-op runner, {args.workers} workers, a producer without "
          f"transformers (requests priced by estimate) ({common.machine()})"
          f"\n\n{text}\n\n" + "\n".join(targets) + "\n")
    common.save("cluster_scale", {"machine": common.machine(), "rows": rows, "targets": targets})
    return {"rows": rows, "table": text, "targets": targets}


if __name__ == "__main__":
    main()
