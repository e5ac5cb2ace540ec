"""Submit cost: interactive traffic, one request per call, against AsyncClient.map.

A service answering its own callers awaits ``AsyncClient.submit`` once per request, many
at a time (enqueues started together go as one call: producer/coalesce.py); a threaded
service calls the sync ``Client.enqueue(...).result()`` from each of its threads, which
coalesce the same way. One real ``batchery worker --runner bench.runners:noop
--max-batch-size 1024 --max-wait-ms 0`` (started first) and, in this process, N
coroutines (or N threads of one sync Client) each submitting requests one by one, then
one ``AsyncClient.map`` of as many, for comparison. CPU microseconds per request of this
process, the worker and redis-server (/proc, Linux).

``python -m bench.submit_cost [--quick] [-n N] [--only async|threads]``
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from batchery import AsyncClient, Client
from bench import common

COLUMNS = [("how", "how", ""), ("requests", "requests", ",d"), ("rps", "requests/s", ",.0f"),
           ("us_client", "client us/request", ".1f"), ("us_worker", "worker", ".1f"),
           ("us_redis", "redis-server", ".1f")]
CONCURRENCY = (20, 200, 1000)
THREADS = (20, 200)  # a thread pool's sizes (threads cost more than coroutines)


async def measure(url: str, worker_pid: int, n: int, concurrent: int | None) -> dict[str, Any]:
    pids = {"client": [None], "worker": [worker_pid], "redis": [common.redis_pid(url)]}
    async with AsyncClient(url, "submit-cost") as client:
        await client.map(range(100))  # warm: scripts loaded, listener up
        cpu = {name: sum(map(common.cpu_seconds, p)) for name, p in pids.items()}
        started = time.perf_counter()
        if concurrent is None:
            results = await client.map(range(n))
        else:
            gate = asyncio.Semaphore(concurrent)

            async def one(i: int) -> Any:
                async with gate:
                    return await client.submit(i, timeout=120)
            results = await asyncio.gather(*(one(i) for i in range(n)))
        seconds = time.perf_counter() - started
        spent = {name: sum(map(common.cpu_seconds, p)) - cpu[name] for name, p in pids.items()}
    assert all(r.ok for r in results), "a no-op request failed"
    how = "AsyncClient.map" if concurrent is None else f"submit, {concurrent} at a time"
    return {"how": how, "requests": n, "rps": n / seconds,
            **{f"us_{name}": 1e6 * c / n for name, c in spent.items()}}


def measure_threads(url: str, worker_pid: int, n: int, threads: int) -> dict[str, Any]:
    """``threads`` threads of one sync Client, each enqueueing one request and awaiting its
    result, over and over."""
    pids = {"client": [None], "worker": [worker_pid], "redis": [common.redis_pid(url)]}
    with Client(url, "submit-cost") as client, ThreadPoolExecutor(threads) as pool:
        client.map(range(100))  # warm: scripts loaded, listener up
        list(pool.map(lambda i: i, range(threads)))  # the threads started
        cpu = {name: sum(map(common.cpu_seconds, p)) for name, p in pids.items()}
        started = time.perf_counter()
        results = list(pool.map(lambda i: client.enqueue(i).result(timeout=120), range(n)))
        seconds = time.perf_counter() - started
        spent = {name: sum(map(common.cpu_seconds, p)) - cpu[name] for name, p in pids.items()}
    assert all(r.ok for r in results), "a no-op request failed"
    return {"how": f"Client.enqueue, {threads} threads", "requests": n, "rps": n / seconds,
            **{f"us_{name}": 1e6 * c / n for name, c in spent.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = common.parser(__doc__.splitlines()[0])
    args.add_argument("-n", type=int, help="requests per row (default 20,000)")
    args.add_argument("--only", choices=("async", "threads"), help="only these rows")
    args = args.parse_args(argv)
    n = args.n or (4_000 if args.quick else 20_000)
    rows = []
    with common.private_redis() as url:
        worker = common.batchery_worker(url, "submit-cost", "--runner", "bench.runners:noop",
                                        "--max-batch-size", "1024", "--max-wait-ms", "0")
        try:
            with Client(url, "submit-cost") as client:
                common.wait_until(lambda: client.queue.stats()["workers"] >= 1, 60, "the worker")
            for concurrent in (*CONCURRENCY, None) if args.only != "threads" else ():
                common.log(f"submit cost: {n:,} requests, {concurrent or 'map'} ...")
                rows.append(asyncio.run(measure(url, worker.pid, n, concurrent)))
            for threads in THREADS if args.only != "async" else ():
                common.log(f"submit cost: {n:,} requests, {threads} threads ...")
                rows.append(measure_threads(url, worker.pid, n, threads))
        finally:
            common.stop([worker])
    text = common.table(rows, COLUMNS)
    print(f"\n## Submit cost: one request per call, no-op runner ({common.machine()})\n\n{text}\n")
    common.save("submit_cost", {"machine": common.machine(), "rows": rows})
    return {"rows": rows, "table": text}


if __name__ == "__main__":
    main()
