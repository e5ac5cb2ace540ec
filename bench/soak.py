"""Soak: a million requests through a sharded queue on a Redis Cluster, workers SIGKILLed
along the way; nothing lost or doubled, memory flat.

A local Cluster of three masters (bench/cluster_scale.py's: no replicas, no persistence),
one queue over three shards (``batchery queue config soak --shards 3``, one on each
master), real ``batchery worker --runner bench.runners:noop --cluster`` processes with the
worker's defaults, and in this process one ``Client`` streaming N requests with ids of its
own (``Client.stream``: at most 2,000 in flight). Every --kill-every seconds a worker other
than the first is SIGKILLed and a new one started: its leased requests come back when
their leases expire (the queue's default lease_seconds, 30 s) and run again.

Checked at the end, each a line that says met or MISSED (exit status 1 if any missed):
every id came back exactly once, ok; the queue counts N committed results and nothing
pending, in flight or dead; past a warm-up of 90 s (claims are remembered for their
lease, enqueue calls for 60 s; allocators and hashes grow to their working size), the
Cluster's key count, Redis memory (used_memory, every node) and the first worker's RSS
flat: their median over the last quarter within --flat (default 10%) of that over the
first.

``python -m bench.soak [--requests N] [--workers W] [--kill-every S]`` (``make soak``;
not run by CI). A million requests take about two minutes on 2 cores, so memory is
judged over the last 20 s only: ``--requests 5000000`` judges it over minutes.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import redis

from batchery import Client
from bench import common
from bench.cluster_scale import configure, private_cluster

QUEUE = "soak"
SHARDS = 3
IN_FLIGHT = 2000  # Client.stream's default max_in_flight
# Memory and keys are judged past this: a claim is remembered for its lease (30 s), an
# enqueue call's reply for 60 s, and the allocators and hashes grow to their working size
WARMUP_S = 90.0
SAMPLE_COLUMNS = [("t", "s", ".0f"), ("done", "results", ",d"), ("rps", "requests/s", ",.0f"),
                  ("kills", "workers killed", "d"), ("redis_mb", "Redis used_memory MB, per node", ""),
                  ("keys", "keys, all nodes", ",d"), ("worker_mb", "first worker RSS MB", ".1f"),
                  ("client_mb", "producer RSS MB", ".1f")]


def rss_mb(pid: int | None = None) -> float:
    """Resident set size of a process (None: this one), from /proc (Linux)."""
    try:
        text = Path(f"/proc/{pid or os.getpid()}/status").read_text()
    except OSError:
        return float("nan")
    return int(next(l for l in text.splitlines() if l.startswith("VmRSS:")).split()[1]) / 1024


class Fleet:
    """The workers: the first lives through the run, the others are killed and replaced."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.kills = url, 0
        self.procs = [self._start() for _ in range(size)]

    def _start(self) -> subprocess.Popen:
        return common.batchery_worker(self.url, QUEUE, "--runner", "bench.runners:noop", "--cluster")

    def kill_one(self, rng: random.Random) -> None:
        victim = rng.randrange(1, len(self.procs))
        self.procs[victim].send_signal(signal.SIGKILL)
        self.procs[victim].wait(30)
        self.procs[victim] = self._start()
        self.kills += 1

    def stop(self) -> None:
        common.stop(self.procs)


class Sampler(threading.Thread):
    """Every ``every`` seconds: results so far, Redis memory and keys per node, RSS."""

    def __init__(self, ports: list[int], fleet: Fleet, every: float) -> None:
        super().__init__(daemon=True)
        self.nodes = [redis.Redis(port=p) for p in ports]
        self.fleet, self.every = fleet, every
        self.done, self.samples = 0, []  # done: written by the producer loop
        self.halt = threading.Event()
        self.started = time.monotonic()

    def sample(self) -> dict[str, Any]:
        memory = [n.info("memory")["used_memory"] / 2**20 for n in self.nodes]
        t = time.monotonic() - self.started
        last = self.samples[-1] if self.samples else {"t": 0.0, "done": 0}
        return {"t": t, "done": self.done,
                "rps": (self.done - last["done"]) / max(1e-9, t - last["t"]),
                "kills": self.fleet.kills, "memory": memory,
                "redis_mb": " / ".join(f"{m:.1f}" for m in memory),
                "keys": sum(n.dbsize() for n in self.nodes),
                "worker_mb": rss_mb(self.fleet.procs[0].pid), "client_mb": rss_mb()}

    def run(self) -> None:
        while not self.halt.wait(self.every):
            self.samples.append(self.sample())

    def close(self) -> None:
        self.halt.set()
        self.join(10)
        for node in self.nodes:
            node.close()


def flat(samples: list[dict[str, Any]], key: Any, within: float) -> tuple[float | None, bool]:
    """Growth of the median over the last quarter of the samples past WARMUP_S against
    that over their first quarter; None (and not flat) when fewer than 8 samples are past it."""
    values = [key(s) for s in samples if s["t"] >= WARMUP_S]
    if len(values) < 8:
        return None, False
    q = len(values) // 4
    early, late = statistics.median(values[:q]), statistics.median(values[-q:])
    growth = late / early - 1 if early else 0.0
    return growth, growth <= within


def growth_text(growth: float | None) -> str:
    return (f"{growth:+.1%} from the first quarter past {WARMUP_S:.0f} s to the last"
            if growth is not None else f"not judged: the run must last well past {WARMUP_S:.0f} s")


def soak(n: int, workers: int, kill_every: float, sample_s: float, within: float,
         seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    seen = bytearray(n)  # results per request: 1 each, or something was lost or doubled
    bad: list[str] = []
    with private_cluster(SHARDS) as ports:
        url = f"redis://127.0.0.1:{ports[0]}/0"
        configure(url, QUEUE, SHARDS)
        fleet = Fleet(url, workers)
        sampler = Sampler(ports, fleet, sample_s)
        try:
            with Client(url, QUEUE, cluster=True) as client:
                common.wait_until(lambda: client.queue.stats()["workers"] >= workers, 120, "the workers")
                sampler.start()
                next_kill = time.monotonic() + kill_every
                requests = ({"id": f"s{i}", "input": i} for i in range(n))
                for result in client.stream(requests, max_in_flight=IN_FLIGHT, timeout=300):
                    i = int(result.id[1:])
                    seen[i] = min(255, seen[i] + 1)
                    if not result.ok and len(bad) < 10:
                        bad.append(f"{result.id}: {result.status} {result.error}")
                    sampler.done += 1
                    if time.monotonic() >= next_kill:
                        fleet.kill_one(rng)
                        next_kill = time.monotonic() + kill_every
                seconds = time.monotonic() - sampler.started
                sampler.samples.append(sampler.sample())
                stats = client.queue.stats()
        finally:
            sampler.close()
            fleet.stop()
    return {"n": n, "seconds": seconds, "seen": seen, "bad": bad, "stats": stats,
            "samples": sampler.samples, "kills": fleet.kills, "within": within}


def checks(out: dict[str, Any]) -> list[tuple[str, bool]]:
    n, seen, stats, samples = out["n"], out["seen"], out["stats"], out["samples"]
    lost, doubled = seen.count(0), sum(1 for c in seen if c > 1)
    totals = stats["totals"]
    found = [(f"every request came back once: {lost} lost, {doubled} doubled, "
              f"{len(out['bad'])} not ok {out['bad'][:3]}", lost == doubled == 0 and not out["bad"]),
             (f"the queue: ok {totals.get('ok', 0):,} of {n:,}, pending {stats['pending']}, "
              f"in flight {stats['inflight']}, dead {stats['dead']}, reaped "
              f"{totals.get('reaped', 0):,} (run again after {out['kills']} kills)",
              totals.get("ok", 0) == n and stats["pending"] == stats["inflight"] == stats["dead"] == 0)]
    growth, ok = flat(samples, lambda s: float(s["keys"]), out["within"])
    found.append((f"keys on the Cluster: {samples[-1]['keys']:,} at the end, "
                  f"{growth_text(growth)} (no key left per finished request)", ok))
    for node in range(len(samples[-1]["memory"])):
        growth, ok = flat(samples, lambda s: s["memory"][node], out["within"])
        found.append((f"Redis node {node + 1} used_memory: {growth_text(growth)}", ok))
    growth, ok = flat(samples, lambda s: s["worker_mb"], out["within"])
    found.append((f"first worker RSS: {growth_text(growth)}", ok))
    return found


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1_000_000, help="requests (default 1,000,000)")
    p.add_argument("--workers", type=int, default=3, help="workers at any time (default 3)")
    p.add_argument("--kill-every", type=float, default=30.0,
                   help="seconds between SIGKILLs of a worker (default 30)")
    p.add_argument("--sample-every", type=float, default=2.0, help="seconds between samples")
    p.add_argument("--flat", type=float, default=0.10, help="growth allowed (default 0.10)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.requests < 1 or args.workers < 2:
        p.error("--requests must be 1 or more and --workers 2 or more (one lives, one is killed)")
    n = 20_000 if args.quick else args.requests
    common.log(f"soak: {n:,} requests, {args.workers} workers, a SIGKILL every {args.kill_every:g} s ...")
    out = soak(n, args.workers, args.kill_every, args.sample_every, args.flat, args.seed)
    found = checks(out)
    rows = out["samples"][::max(1, len(out["samples"]) // 12)] + out["samples"][-1:]
    text = common.table(rows, SAMPLE_COLUMNS)
    lines = [f"{'met' if ok else 'MISSED'}: {what}" for what, ok in found]
    print(f"\n## Soak: {n:,} no-op requests, {SHARDS} shards on {SHARDS} masters, "
          f"{args.workers} workers, {out['kills']} SIGKILLs, {out['seconds']:.0f} s "
          f"({n / out['seconds']:,.0f} requests/s; {common.machine()})\n\n{text}\n\n"
          + "\n".join(lines) + "\n")
    common.save("soak", {"machine": common.machine(), "requests": n, "seconds": out["seconds"],
                         "kills": out["kills"], "checks": lines,
                         "samples": [{k: v for k, v in s.items()} for s in out["samples"]]})
    if not all(ok for _, ok in found):
        raise SystemExit(1)
    return {"checks": lines, "table": text}


if __name__ == "__main__":
    main()
