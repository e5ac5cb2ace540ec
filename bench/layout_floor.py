"""The floor of a lean key layout, in redis-server instructions per request: what a
redesign of the layout could reach, counted the way ``bench.redis_instructions`` counts
today's scripts.

The layout: one hash field per request (its body with its schedule entry), one pending
sorted set, one lease record per batch (a key holding the batch's ids, and the token in
a sorted set of leases), a result key with its TTL and a reply list per client. Its
scripts keep only what every request must have: the enqueue checks that no id is held
or has a result (idempotency) and wakes a worker; the claim takes the 64 most urgent,
reads their bodies, and leases them as one batch; the commit checks the batch's lease,
stores each result with its TTL, pushes them to the client's reply list, and forgets the
bodies and the lease; delivery pops the reply list and deletes the results read. Left
out on purpose: the batching rule (lengths, budgets, deadlines, class delays), fair
share, pricing, the per-request lease and attempt counts, stats and queue depths, the
memory and size checks, and a remembered reply for a retried call. What today's scripts
spend above this floor is those.

The calls come in the shapes ``bench.redis_instructions`` drives (enqueues of 500, claims
of 64 with two batches held, commits of 64, the Client's delivery), against a backlog of
1,000. Two counts: instructions by part under valgrind's callgrind (it must be
installed), with the unit, by ``bench.redis_instructions.count``; and time, the issue's
measure: redis-server's CPU (/proc) per request with no profiler, today's scripts
(``bench.redis_instructions``' drive) and the lean ones in turn on one server, the best of
R rounds each, against ``bench.redis_time``'s unit timed on the same server.

``python -m bench.layout_floor [-n N] [--repeat R] [--backlog B]``: B requests standing in
the queue (default 1,000; 40,000, as deep as ``bench.redis_time --producer-first`` goes,
shows what a deep backlog adds to each layout: every hash and sorted set as deep).
"""

from __future__ import annotations

import json
from typing import Callable

import redis

from batchery.workers.options import WorkerOptions
from bench import common
from bench import redis_instructions
from bench.redis_instructions import ENQUEUE_BATCH, HELD
from bench.redis_time import zadd_us

BATCH = WorkerOptions().max_batch_size
BACKLOG = 1000  # requests standing in the queue, as in bench.redis_instructions
ENQUEUE = """-- KEYS: pending, requests, wake, result keys; ARGV: rank, then id, body pairs
local ids, n = {}, 0
for i = 2, #ARGV, 2 do n = n + 1; ids[n] = ARGV[i] end
for i, body in ipairs(redis.call('HMGET', KEYS[2], unpack(ids))) do
  if body then return {'held', ids[i]} end
end
if redis.call('EXISTS', unpack(KEYS, 4)) > 0 then return {'done'} end
local zargs, hargs = {}, {}
for i = 2, #ARGV, 2 do
  zargs[i - 1], zargs[i] = ARGV[1], ARGV[i]
  hargs[i - 1], hargs[i] = ARGV[i], ARGV[i + 1]
end
redis.call('ZADD', KEYS[1], unpack(zargs))
redis.call('HSET', KEYS[2], unpack(hargs))
redis.call('RPUSH', KEYS[3], 1)
return n
"""
CLAIM = """-- KEYS: pending, requests, this token's lease record, leases; ARGV: token, size, expiry
local ids = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[2]) - 1)
if #ids == 0 then return {} end
local bodies = redis.call('HMGET', KEYS[2], unpack(ids))
redis.call('ZREM', KEYS[1], unpack(ids))
redis.call('SET', KEYS[3], table.concat(ids, '\\n'), 'PX', 60000)
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1])
local reply, n = {}, #ids
for i = 1, n do reply[i], reply[n + i] = ids[i], bodies[i] end
return reply
"""
COMMIT = """-- KEYS: requests, the lease record, leases, reply list, result keys;
-- ARGV: token, ttl, then id, result pairs
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
local ids, results, n = {}, {}, 0
for i = 3, #ARGV, 2 do n = n + 1; ids[n], results[n] = ARGV[i], ARGV[i + 1] end
for i = 1, n do redis.call('SET', KEYS[4 + i], results[i], 'EX', ARGV[2]) end
redis.call('RPUSH', KEYS[4], unpack(results))
redis.call('HDEL', KEYS[1], unpack(ids))
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
return n
"""
RANK = 1_764_180_005_000  # a rank in ms, as the scripts store one
SCHED = "|~3:0:1764180000000:1764180005000:normal:c1:"  # the schedule entry a body carries


def drive(url: str, n: int, backlog: int, dump: Callable[[str], None]) -> None:
    """n requests through the lean scripts, ``dump(part)`` after each call."""
    conn = redis.Redis.from_url(url)
    enqueue, claim, commit = (conn.register_script(s) for s in (ENQUEUE, CLAIM, COMMIT))

    def put(ids: list[str]) -> None:
        args: list[object] = [RANK]
        for i in ids:
            args += [i, json.dumps({"input": i, "meta": None}) + SCHED]
        enqueue(keys=["q:pending", "q:requests", "q:wake", *(f"q:result:{i}" for i in ids)], args=args)

    for lo in range(0, backlog, ENQUEUE_BATCH):
        put([f"b{i}" for i in range(lo, min(backlog, lo + ENQUEUE_BATCH))])
    dump("")
    claims = 0
    for lo in range(0, n, ENQUEUE_BATCH):
        size = min(ENQUEUE_BATCH, n - lo)
        put([f"r{i}" for i in range(lo, lo + size)])
        dump("enqueue")
        got, held = 0, []
        while got < size or held:
            if got < size:
                claims += 1
                token = f"w#{claims}"
                reply = claim(keys=["q:pending", "q:requests", f"q:lease:{token}", "q:leases"],
                              args=[token, BATCH, RANK + 60_000])
                dump("claim")
                ids = [i.decode() for i in reply[:len(reply) // 2]]
                got += len(ids)
                held.append((token, ids))
            if len(held) == HELD or got >= size:
                token, ids = held.pop(0)
                args: list[object] = [token, 3600]
                for i in ids:
                    args += [i, json.dumps({"id": i, "status": "ok", "output": None, "attempts": 1})]
                commit(keys=["q:requests", f"q:lease:{token}", "q:leases", "q:reply:c1",
                             *(f"q:result:{i}" for i in ids)], args=args)
                dump("commit")
                results = conn.lpop("q:reply:c1", 1000) or []
                if results:
                    conn.delete(*(f"q:result:{json.loads(r)['id']}" for r in results))
                dump("delivery")
    conn.close()


def timed(n: int, repeat: int, backlog: int = BACKLOG) -> dict[str, float]:
    """redis-server CPU us per request of today's scripts and the lean ones in the same
    shapes (the best of ``repeat`` rounds, the two in turn), and of the unit."""
    layouts = {"today": redis_instructions.drive, "lean": drive}
    best = {name: float("inf") for name in layouts}
    with common.private_redis() as url:
        unit = min(zadd_us(url) for _ in range(3))
        pid, conn = common.redis_pid(url), redis.Redis.from_url(url)
        for _ in range(repeat):
            for name, run in layouts.items():
                conn.flushdb()
                start: list[float] = []

                def mark(part: str) -> None:  # the first dump: the backlog is in
                    if not start:
                        start.append(common.cpu_seconds(pid))
                run(url, n, backlog, mark)
                best[name] = min(best[name], 1e6 * (common.cpu_seconds(pid) - start[0]) / n)
        conn.close()
    return {**best, "zadd": unit}


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=2000, help="requests counted (default 2,000)")
    p.add_argument("--backlog", type=int, default=BACKLOG, help="requests standing in the queue "
                   f"(default {BACKLOG:,})")
    args = p.parse_args(argv)
    repeat = args.repeat if args.repeat > 1 else 3  # --repeat defaults to 1
    used = redis_instructions.count(drive, args.n, args.backlog)
    print(f"\nThe lean layout's floor, redis-server instructions per request ({args.n:,} requests, "
          f"a standing backlog of {args.backlog:,}; {common.machine()}):\n")
    print(redis_instructions.parts_table(used))
    times = timed(10 * args.n, repeat, args.backlog)
    time_rows = [{"layout": name, "us": times[name], "zadds": times[name] / times["zadd"]}
                 for name in ("today", "lean")]
    print(f"\nredis-server CPU per request, the same shapes, no profiler ({10 * args.n:,} requests, "
          f"a backlog of {args.backlog:,}, the best of {repeat} rounds; one pipelined ZADD = "
          f"{times['zadd']:.2f} us):\n")
    print(common.table(time_rows, [("layout", "layout", ""), ("us", "us per request", ".2f"),
                                   ("zadds", "pipelined ZADDs per request", ".1f")]))
    common.save("layout_floor", {"requests": args.n, "backlog": args.backlog, **used, "time": times})
    return used


if __name__ == "__main__":
    main()
