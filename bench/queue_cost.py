"""Queue cost: a no-op model, so all that is measured is getting requests through.

batchery: real ``batchery worker --runner bench.runners:noop`` processes (one, then two)
and the real ``Client.map`` (results delivered to the caller), 100,000 requests end to
end. The two-worker run also splits redis-server's time per request into enqueue, claim,
complete and result delivery (bench/redis_time.py; its slow log adds a few us to that
run's redis-server column).
RQ: its fastest worker (``SimpleWorker``: no fork per job, JSON serializer), one job per
request, enqueued in pipelined chunks; timed until its finished-job registry holds every
job (the caller does not even fetch the results: lenient to RQ). RQ runs fewer requests
(its rate is what is compared); both in the same run, on the same private Redis server.

``python -m bench.queue_cost [--quick] [-n N] [--rq-n N] [--runner bench.runners:NAME]``
(``--runner bench.runners:noop_uncounted``: a worker that cannot count tokens, so no
pricing round)
"""

from __future__ import annotations

import sys
import time
from typing import Any

import redis

from batchery import Client
from bench import common
from bench.redis_time import RedisTime

RQ_CHUNK = 1000


def run_batchery(url: str, n: int, max_batch_size: int, workers: int = 1,
                 queue: str = "noop", runner: str = "bench.runners:noop") -> dict[str, Any]:
    procs = [common.batchery_worker(url, queue, "--runner", runner,
                                    "--max-batch-size", str(max_batch_size), "--max-wait-ms", "0")
             for _ in range(workers)]
    try:
        with Client(url, queue) as client:
            common.wait_until(lambda: client.queue.stats()["workers"] >= workers, 60, "the workers")
            pids = {"client": [None], "worker": [p.pid for p in procs], "redis": [common.redis_pid(url)]}
            cpu = {name: sum(map(common.cpu_seconds, ps)) for name, ps in pids.items()}
            # the slow log that splits Redis time by part costs Redis time itself: only
            # the two-worker run pays it
            with RedisTime(url, queue, enabled=workers > 1) as redis_time:
                started = time.perf_counter()
                results = client.map(range(n), max_in_flight=IN_FLIGHT)
                seconds = time.perf_counter() - started
            cpu = {name: sum(map(common.cpu_seconds, ps)) - cpu[name] for name, ps in pids.items()}
            totals = client.queue.stats()["totals"]
    finally:
        common.stop(procs)
    ok = sum(1 for r in results if r.ok)
    assert ok == n, f"batchery: {ok} of {n} ok"
    return {"system": f"batchery, {workers} worker{'s' if workers > 1 else ''}", "requests": n,
            "seconds": seconds, "rps": n / seconds,
            "batch": totals.get("ok", n) / max(1, totals.get("batches", 1)),
            **{f"us_{name}": 1e6 * c / n for name, c in cpu.items()},
            "redis_time": redis_time.report(n) if workers > 1 else None}


def run_rq(url: str, n: int, workers: int, queue: str = "rq-noop") -> dict[str, Any]:
    from rq import Queue
    from rq.registry import FinishedJobRegistry
    from rq.serializers import JSONSerializer
    conn = redis.Redis.from_url(url)
    procs = [common.start([sys.executable, "-m", "bench.rq_jobs", url, queue, "noop"])
             for _ in range(workers)]
    try:
        common.wait_until(lambda: conn.llen(f"bench:rq-ready:{queue}") >= workers, 60, "RQ workers")
        q = Queue(queue, connection=conn, serializer=JSONSerializer)
        finished = FinishedJobRegistry(queue=q)
        started = time.perf_counter()
        for lo in range(0, n, RQ_CHUNK):
            with conn.pipeline() as pipe:
                q.enqueue_many([Queue.prepare_data("bench.rq_jobs.noop", (i,))
                                for i in range(lo, min(n, lo + RQ_CHUNK))], pipeline=pipe)
                pipe.execute()
        common.wait_until(lambda: common.rq_done(q, finished, n), 600, "RQ jobs", interval=0.01)
        seconds = time.perf_counter() - started
    finally:
        common.stop(procs)
        conn.close()
    return {"system": f"RQ, {workers} SimpleWorker{'s' if workers > 1 else ''}", "requests": n,
            "seconds": seconds, "rps": n / seconds, "batch": 1.0}


COLUMNS = [("system", "system", ""), ("requests", "requests", ",d"), ("seconds", "seconds", ".1f"),
           ("rps", "requests/s", ",.0f"), ("batch", "mean batch", ".0f"), ("ratio", "x RQ best", ".1f")]
# Where the time goes: CPU microseconds per request in each process (2 cores = 2 s per s).
CPU_COLUMNS = [("system", "system", ""), ("us_client", "client (Client.map)", ".1f"),
               ("us_worker", "worker process", ".1f"), ("us_redis", "redis-server", ".1f"),
               ("us_total", "total", ".1f"), ("ceiling", "2 cores / total, requests/s", ",.0f")]
IN_FLIGHT = 8192  # requests Client.map keeps queued: enough for eight claims of 1024


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("-n", type=int, help="requests through batchery (default 100,000)")
    p.add_argument("--rq-n", type=int, help="jobs through RQ (default 10,000)")
    p.add_argument("--max-batch-size", type=int, default=1024)
    p.add_argument("--runner", default="bench.runners:noop", help="the no-op runner to use")
    args = p.parse_args(argv)
    n = args.n or (20_000 if args.quick else 100_000)
    rq_n = args.rq_n or (2_000 if args.quick else 10_000)
    rows: list[dict[str, Any]] = []
    with common.private_redis() as url:
        for _ in range(args.repeat):
            common.log(f"queue cost: RQ, {rq_n:,} no-op jobs ...")
            rows.append(run_rq(url, rq_n, 1))
            rows.append(run_rq(url, rq_n, 2, queue="rq-noop-2"))
            common.log(f"queue cost: batchery, {n:,} no-op requests ...")
            rows.append(run_batchery(url, n, args.max_batch_size, runner=args.runner))
            redis.Redis.from_url(url).flushall()
            common.log(f"queue cost: batchery, {n:,} no-op requests, 2 workers ...")
            rows.append(run_batchery(url, n, args.max_batch_size, workers=2, runner=args.runner))
            redis.Redis.from_url(url).flushall()
    rq_best = max(r["rps"] for r in rows if r["system"].startswith("RQ"))
    mine = [r for r in rows if not r["system"].startswith("RQ")]
    ours = max(mine, key=lambda r: r["rps"])
    for r in rows:
        r["ratio"] = r["rps"] / rq_best
    for r in mine:
        r["us_total"] = r["us_client"] + r["us_worker"] + r["us_redis"]
        r["ceiling"] = common.CORES * 1e6 / r["us_total"]
    # the split of redis-server's time: the fastest two-worker run
    profiled = max((r for r in mine if "2 workers" in r["system"]), key=lambda r: r["rps"])
    text = (common.table(rows, COLUMNS) + "\n\n" + common.table(mine, CPU_COLUMNS)
            + f"\n\nRedis time per request ({profiled['system']}, {n:,} requests):\n\n"
            + profiled["redis_time"]["table"])
    checks = [f"no-op requests/s: {ours['rps']:,.0f} (target >= 100,000): "
              f"{'met' if ours['rps'] >= 100_000 else 'MISSED'}",
              f"no-op x RQ: {ours['ratio']:.0f} (target >= 200): "
              f"{'met' if ours['ratio'] >= 200 else 'MISSED'}"]
    print(f"\n## Queue cost: no-op runner ({common.machine()})\n\n{text}\n\n" + "\n".join(checks) + "\n")
    common.save("queue_cost", {"machine": common.machine(), "rows": rows, "targets": checks})
    return {"rows": rows, "table": text, "targets": checks}


if __name__ == "__main__":
    main()
