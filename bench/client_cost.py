"""Client cost: the producer's CPU per request alone, split by its two threads.

bench.queue_cost's client column, narrowed: one real ``batchery worker --runner
bench.runners:noop`` (started first), and ``Client.map`` over no-op inputs in this
process, results delivered back to it. Each thread's CPU time is read around the map
(/proc, Linux only): the caller's thread (building requests, the enqueue calls) and the
reply listener's (its bulk reads, decoding, delivery, the deletion of delivered results);
garbage collection is charged to the thread whose allocation set it off. Then the same
through ``AsyncClient.map`` (one event loop thread: no split). A warm-up map comes
first, so imports and script loading are not counted. Both use the default max_in_flight.
Then each API one request at a time (``Client.enqueue(...).result()``,
``AsyncClient.submit``; N / 100 of them): what one interactive call costs its producer,
where nothing is shared among requests (an enqueue and a reply read each).

``python -m bench.client_cost [--quick] [-n N] [--repeat R]``: every run is two rows.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from batchery import AsyncClient, Client
from bench import common

COLUMNS = [("run", "run", "d"), ("api", "API", ""), ("requests", "requests", ",d"), ("rps", "requests/s", ",.0f"),
           ("us_client", "client us/request", ".1f"), ("us_caller", "caller thread", ".1f"),
           ("us_replies", "reply listener", ".1f")]


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process, by thread name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        name = names.get(int(task.name), "other")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def run(url: str, n: int, queue: str = "client-cost") -> list[dict[str, Any]]:
    single = max(100, n // 100)  # requests sent one at a time
    worker = common.batchery_worker(url, queue, "--runner", "bench.runners:noop",
                                    "--max-batch-size", "1024", "--max-wait-ms", "0")
    try:
        with Client(url, queue) as client:
            common.wait_until(lambda: client.queue.stats()["workers"] >= 1, 60, "the worker")
            client.map(range(2000))  # warm: scripts loaded, listener up
            rows = [by_thread("Client.map", n, lambda: all(r.ok for r in client.map(range(n)))),
                    by_thread("Client, one at a time", single, lambda: all(
                        client.enqueue(i).result(timeout=60).ok for i in range(single)))]
        rows += asyncio.run(run_async(url, n, single, queue))
    finally:
        common.stop([worker])
    return rows


async def run_async(url: str, n: int, single: int, queue: str) -> list[dict[str, Any]]:
    """AsyncClient's rows: n requests by map, ``single`` by submit one at a time (one
    event loop thread: no split by thread)."""
    async def timed(api: str, count: int, requests: Callable[[], Awaitable[bool]]
                    ) -> dict[str, Any]:
        cpu, started = common.cpu_seconds(), time.perf_counter()
        assert await requests(), "a no-op request failed"
        seconds, cpu = time.perf_counter() - started, common.cpu_seconds() - cpu
        return {"api": api, "requests": count, "rps": count / seconds,
                "us_client": 1e6 * cpu / count}

    async def bulk() -> bool:
        return all(r.ok for r in await client.map(range(n)))

    async def one_at_a_time() -> bool:
        return all([(await client.submit(i, timeout=60)).ok for i in range(single)])

    async with AsyncClient(url, queue) as client:
        await client.map(range(2000))
        return [await timed("AsyncClient.map", n, bulk),
                await timed("AsyncClient.submit, one at a time", single, one_at_a_time)]


def by_thread(api: str, n: int, requests: Callable[[], bool]) -> dict[str, Any]:
    """A row of ``requests()`` (its n requests; True: all ok): the process's CPU per
    request, and the caller's and the reply listener's threads' shares."""
    threads, cpu, started = thread_cpu(), common.cpu_seconds(), time.perf_counter()
    assert requests(), "a no-op request failed"
    seconds, cpu, after = time.perf_counter() - started, common.cpu_seconds() - cpu, thread_cpu()
    spent = {name: after[name] - threads.get(name, 0.0) for name in after}
    return {"api": api, "requests": n, "rps": n / seconds, "us_client": 1e6 * cpu / n,
            "us_caller": 1e6 * spent.get(threading.main_thread().name, 0.0) / n,
            "us_replies": 1e6 * spent.get("batchery-replies", 0.0) / n}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("-n", type=int, help="requests per run (default 100,000)")
    args = p.parse_args(argv)
    n = args.n or (20_000 if args.quick else 100_000)
    rows = []
    with common.private_redis() as url:
        for i in range(args.repeat):
            common.log(f"client cost: {n:,} no-op requests, run {i + 1} ...")
            rows += [{"run": i + 1, **row} for row in run(url, n, queue=f"client-cost-{i}")]
    text = common.table(rows, COLUMNS)
    print(f"\n## Client cost: Client and AsyncClient, in bulk (map) and one at a time, no-op runner ({common.machine()})\n\n{text}\n")
    common.save("client_cost", {"machine": common.machine(), "rows": rows})
    return {"rows": rows, "table": text}


if __name__ == "__main__":
    main()
