"""Redis memory: what a queued request and a stored result cost, and a soak that shows
used_memory stays under the queue's high-water mark.

``python -m bench.memory arithmetic [-n N]``: enqueues N requests (a 100-character
text each) and measures Redis' used_memory per queued request; then a worker returns a
384-float vector for each (a MiniLM embedding) and the same per stored result.

``python -m bench.memory soak [-n N] [--maxmemory MB] [--mark F] [--in-flight K]``: N
no-op requests through two real workers, a producer keeping up to K requests in flight
(more than fit under the mark, so the mark is what stops it), every result delivered to
it and so deleted. A sampler reads used_memory every 50 ms; prints the peak against
the mark and maxmemory and plots it (bench/out/memory_soak.png, needs the bench extra).
"""

from __future__ import annotations

import argparse
import threading
import time
from queue import Empty, SimpleQueue
from typing import Any

import redis

from batchery import Client, QueueFull, Result
from batchery.batching.request import Request
from bench import common

MiB = 1 << 20
TEXT = "The quick brown fox jumps over the lazy dog. " * 2 + "0123456789"  # 100 characters
CHUNK = 1000


def used_memory(raw: redis.Redis) -> int:
    return int(raw.info("memory")["used_memory"])


def arithmetic(n: int) -> dict[str, Any]:
    with common.private_redis() as url, Client(url, "mem") as client:
        raw = redis.Redis.from_url(url)
        client.enqueue_many([{"input": "warm-up", "id": "warm-up"}], reply=False)
        base = used_memory(raw)
        for start in range(0, n, CHUNK):
            client.enqueue_many([{"input": {"text": TEXT}} for _ in range(min(CHUNK, n - start))],
                                reply=False)
        queued = used_memory(raw)
        worker = common.batchery_worker(url, "mem", "--runner", "bench.runners:vector384",
                                        "--max-wait-ms", "0")
        try:
            common.wait_until(lambda: (s := client.queue.stats())["pending"] == 0
                              and s["inflight"] == 0, 600, "the worker to finish")
        finally:
            common.stop([worker])
        stored = used_memory(raw)
        sample = next(k for k in raw.scan_iter(match=client.queue.keys.result("*"), count=1000)
                      if not k.endswith(b"warm-up"))
        out = {"n": n, "input": {"text": TEXT}, "per_request_bytes": (queued - base) / n,
               "per_result_bytes": (stored - base) / n,
               "result_json_bytes": raw.strlen(sample),
               "result_key_memory_usage": raw.memory_usage(sample)}
        raw.close()
    return out


class Sampler(threading.Thread):
    def __init__(self, url: str, every_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.raw = redis.Redis.from_url(url)
        self.every_s, self.samples = every_s, []  # (seconds, used_memory)
        self.stop = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        while not self.stop.wait(self.every_s):
            self.samples.append((time.monotonic() - started, used_memory(self.raw)))


def soak(n: int, maxmemory: int, mark: float, in_flight: int) -> dict[str, Any]:
    with common.private_redis("--maxmemory", str(maxmemory), "--maxmemory-policy",
                              "noeviction") as url, Client(url, "soak") as client:
        client.queue.update_settings(memory_high_water=mark, max_pending=10 * n)
        workers = [common.batchery_worker(url, "soak", "--runner", "bench.runners:noop",
                                          "--max-batch-size", "256", "--max-wait-ms", "0")
                   for _ in range(2)]
        sampler = Sampler(url)
        try:
            common.wait_until(lambda: client.queue.stats()["workers"] >= 2, 120, "two workers")
            sampler.start()
            started = time.perf_counter()
            counts = produce(client, n, in_flight)
            seconds = time.perf_counter() - started
        finally:
            sampler.stop.set()
            common.stop(workers)
        sampler.join()
        stats = client.queue.stats()
    peak = max(used for _, used in sampler.samples)
    return {"n": n, "seconds": seconds, "rate": n / seconds, **counts,
            "maxmemory": maxmemory, "mark": mark, "mark_bytes": mark * maxmemory,
            "peak_used_memory": peak, "under_mark": peak <= mark * maxmemory,
            "under_maxmemory": peak <= maxmemory, "totals": stats["totals"],
            "samples": sampler.samples}


def produce(client: Client, n: int, in_flight: int) -> dict[str, int]:
    """Keep up to ``in_flight`` requests queued; back off while Redis is over the mark."""
    done: SimpleQueue[Result] = SimpleQueue()
    sent = received = refusals = 0
    held: list[Request] = []
    while received < n:
        room = min(CHUNK, in_flight - (sent - received))
        if not held and sent < n and room > 0:
            held = [client.request({"input": i, "id": f"s{i}"})
                    for i in range(sent, min(n, sent + room))]
            client.replies.collect([r.id for r in held], done.put)
        if held:
            try:
                client.queue.enqueue(held, client.client_id)
                sent, held = sent + len(held), []
            except QueueFull as exc:
                if exc.reason != "memory":
                    raise
                refusals += 1
        results: list[Result] = []
        try:
            blocked = bool(held) or sent >= n or in_flight - (sent - received) <= 0
            results.append(done.get(timeout=0.05) if blocked else done.get_nowait())
            while True:
                results.append(done.get_nowait())
        except Empty:
            pass
        bad = [r for r in results if not r.ok]
        if bad:
            raise SystemExit(f"{len(bad)} request(s) did not succeed, e.g. {bad[0]}")
        received += len(results)
    return {"sent": sent, "received": received, "refusals": refusals}


def plot(result: dict[str, Any]) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        common.log("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return None
    times = [t for t, _ in result["samples"]]
    used = [u / MiB for _, u in result["samples"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(times, used, label="used_memory")
    ax.axhline(result["mark_bytes"] / MiB, color="orange", linestyle="--",
               label=f"high-water mark ({result['mark']:.0%})")
    ax.axhline(result["maxmemory"] / MiB, color="red", linestyle=":", label="maxmemory")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    ax.set_title(f"{result['n']:,} no-op requests, 2 workers: Redis used_memory")
    ax.legend(loc="lower right")
    common.OUT.mkdir(parents=True, exist_ok=True)
    path = common.OUT / "memory_soak.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return str(path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("arithmetic")
    a.add_argument("-n", type=int, default=20_000)
    s = sub.add_parser("soak")
    s.add_argument("-n", type=int, default=1_000_000)
    s.add_argument("--maxmemory", type=int, default=16, help="MiB")
    s.add_argument("--mark", type=float, default=0.9)
    s.add_argument("--in-flight", type=int, default=400_000)
    args = p.parse_args(argv)
    if args.what == "arithmetic":
        out = arithmetic(args.n)
        print(f"per queued request: {out['per_request_bytes']:.0f} B (input {TEXT!r:.30}..., "
              f"100 characters); per stored result of 384 floats: "
              f"{out['per_result_bytes']:.0f} B (its JSON: {out['result_json_bytes']} B, "
              f"MEMORY USAGE of its key: {out['result_key_memory_usage']} B)")
        common.save("memory_arithmetic", out)
        return out
    out = soak(args.n, args.maxmemory * MiB, args.mark, args.in_flight)
    out["plot"] = plot(out)
    print(f"{out['n']:,} requests in {out['seconds']:.0f} s ({out['rate']:,.0f}/s); enqueue "
          f"refused {out['refusals']} time(s) at the mark; peak used_memory "
          f"{out['peak_used_memory'] / MiB:.1f} MiB, mark {out['mark_bytes'] / MiB:.1f} MiB, "
          f"maxmemory {out['maxmemory'] / MiB:.0f} MiB: "
          f"{'under the mark' if out['under_mark'] else 'OVER THE MARK'}"
          f"{'' if out['under_maxmemory'] else ', OVER MAXMEMORY'}; plot: {out['plot']}")
    common.save("memory_soak", {k: v for k, v in out.items() if k != "samples"})
    return out


if __name__ == "__main__":
    main()
