"""What a queue's switch to sub-queues costs: listing a sole tenant's backlog, a step per call.

A queue whose pending work is one tenant's keeps no fair-share sub-queues
(docs/fair-share.md, "Sub-queues only once shared"); the first call that puts another
tenant's work beside it starts listing the backlog, 10,000 requests a call (that call and
each enqueue and claim after it) until all is listed. ``python -m bench.fair_switch
[--backlogs 10000,100000,999000]`` enqueues each backlog as one tenant (500 a call, as
``Client.map`` sends them; 999,000: the default max_pending, less room for the second
tenant) on a private redis-server, then enqueues one request of a second tenant per call
until the queue is listed, and prints a table: the calls it took, the longest of them
(Redis busy with nothing else that long), and redis-server's CPU for the whole listing.
"""

from __future__ import annotations

import time

import redis

from batchery.batching.keys import FAIR_MODE_FIELD
from batchery.batching.queue import RequestQueue
from batchery.batching.request import Request
from bench import common

CALL = 500  # requests per enqueue call, as Client.map sends them


def switch(url: str, backlog: int) -> dict[str, float]:
    """The backlog enqueued as tenant a, then one request of b a call until all is listed:
    the calls, the longest one's wall ms, redis-server's CPU ms over them all."""
    conn = redis.Redis.from_url(url, decode_responses=True)
    queue, pid = RequestQueue(conn, f"switch-{backlog}"), common.redis_pid(url)
    for lo in range(0, backlog, CALL):
        queue.enqueue([Request(id=f"a{i}", input=i, tenant="a")
                       for i in range(lo, min(backlog, lo + CALL))])
    assert conn.zcard(queue.keys.fair) == 0, "a sole tenant's backlog was listed"
    calls, longest, cpu = 0, 0.0, common.cpu_seconds(pid)
    while conn.hget(queue.keys.vtc, FAIR_MODE_FIELD) != "listed":
        start = time.perf_counter()
        queue.enqueue([Request(id=f"b{calls}", input=calls, tenant="b")])
        longest, calls = max(longest, time.perf_counter() - start), calls + 1
    cpu = common.cpu_seconds(pid) - cpu
    assert conn.zcard(queue.keys.fair) == backlog + calls, "not all listed"
    conn.flushdb()  # a private server: the next backlog starts from nothing
    conn.close()
    return {"backlog": backlog, "calls": calls, "longest_ms": longest * 1e3,
            "cpu_ms": cpu * 1e3, "per_1000": cpu * 1e6 / backlog}


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--backlogs", default="10000,100000,999000",
                   help="the sole tenant's backlogs to switch, comma-separated")
    args = p.parse_args(argv)
    with common.private_redis() as url:
        rows = [switch(url, int(n)) for n in args.backlogs.split(",")]
    print(f"\nThe switch to sub-queues: the sole tenant's backlog listed a step per call "
          f"({common.machine()}):\n")
    print(common.table(rows, [("backlog", "backlog", ",d"), ("calls", "calls until listed", "d"),
                              ("longest_ms", "the longest call, ms", ".1f"),
                              ("cpu_ms", "redis-server CPU, all the listing, ms", ".0f"),
                              ("per_1000", "ms per 1,000 pending", ".2f")]))
    common.save("fair_switch", rows)
    return rows


if __name__ == "__main__":
    main()
