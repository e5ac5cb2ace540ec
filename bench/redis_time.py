"""Where redis-server's time goes during a run, per request: enqueue, claim, complete,
result delivery, the rest.

Two sources, read around the run: the server's CPU time (``/proc``: commands, protocol,
network and event loop together) and its command timings. ``INFO commandstats`` sums the
time of each command (EVALSHA as one, every command a script calls counted again under
its own name), so it cannot say which script spent it; the slow log at a threshold of 0
records every call with its duration and arguments (the script's SHA among them), which
splits EVALSHA by script (the commands a script calls are logged too, under no client
address: left out, their time is their EVALSHA's). Both time a command by the wall clock,
without the reading and writing of its bytes, but with the slow log's own bookkeeping and
any time the server was not scheduled (2 cores, shared with the client and workers): so
each part's share of the command time is what is measured, and its CPU is that share of
redis-server's CPU time.

``python -m bench.redis_time [-n N] [--repeat R]``: N requests (default 40,000) end to
end with defaults: one ``batchery worker --runner bench.runners:noop`` (no other flag) and
``Client.map`` (no argument but the inputs). redis-server's CPU per request read from
/proc in runs without the slow log (the best of 3, or of R), split by script (enqueue,
claim, renew, commit, result delivery, reap, the rest) in one run with it, each part also
in pipelined-ZADD equivalents: the CPU of one ``ZADD key score member`` sent 1,000 to a
pipeline on the same server, the unit of the issue's floor (one hash write, one sorted-set
add, one claim, one result write, one delivery: a few ZADDs). The unit is timed right
before and right after each run, and each run counted in the mean of the two (the VM's
speed drifts between runs, and within one, by more than most changes move a run): the
ZADDs are the runs' median, the microseconds the best run's.

``--producer-first``: each run enqueues its N requests first (500 a call, as ``Client.map``),
then starts the worker and waits for the results. ``--exact``: the producer sends each
request's count, as one with the queue's tokenizer does (by default it estimates, as one
without transformers: the no-op queue names no tokenizer). ``--text``: the inputs are
standard-library paragraphs of varied length (bench.corpus) and the worker counts their
words (``bench.runners:noop_words``), so claims group varied lengths as with a real
tokenizer; by default they are integers of one token each.

``python -m bench.redis_time --phases [-n N] [--repeat R]`` measures the parts one at a time
instead, without the slow log: N requests enqueued (500 per call), claimed (batches of
1024, lookahead 4096, as a worker that counts tokens: the estimated candidates handed to
it first), completed and delivered, redis-server's CPU read around each
part; the best of 3 runs (or of R).
"""

from __future__ import annotations

import hashlib
import statistics
from typing import Any

import redis

from batchery import Client
from batchery.batching import scripts
from batchery.batching.keys import Keys
from batchery.batching.messages import Result
from batchery.batching.request import DEFAULT_PRIORITY, map_requests
from batchery.batching.queue import RequestQueue
from batchery.producer.client import ENQUEUE_CHUNK
from bench import common, corpus
from bench.runners import words

# entries kept: a 100,000-request run logs about 800,000 (its ~1,500 top-level calls and
# every command the scripts call), some 200 MB of redis-server memory until read
SLOWLOG_MAX = 2_000_000
PARTS = ("enqueue", "claim", "renew", "commit", "result delivery", "reap", "other commands")
COLUMNS = [("part", "part", ""), ("calls", "calls", ",d"), ("share", "share of command time", ".0%"),
           ("us", "redis-server CPU, us per request", ".2f")]
TOP_COLUMNS = [("command", "command (INFO commandstats)", ""), ("calls", "calls", ",d"),
               ("us", "command time, us per request", ".2f")]
SCRIPT_CLIENT = b"?:0"  # the slow log's client address for commands a script calls
SCRIPT_PARTS = {"enqueue": "enqueue", "claim": "claim", "renew": "renew",
                "complete": "commit", "reap": "reap"}


class RedisTime:
    """Measure one run: ``with RedisTime(url, queue) as rt: ...`` then ``rt.report(n)``."""

    def __init__(self, url: str, queue: str, enabled: bool = True) -> None:
        self.enabled = enabled
        self.conn = redis.Redis.from_url(url, decode_responses=True)
        self.url = url
        self.pid = common.redis_pid(url)
        keys = Keys(queue)
        # the keys of a client's reads (producer/replies.py): its lists, inboxes, bells and
        # marks, and the results it deletes
        self.delivery = (keys.reply_prefix, keys.result_prefix, keys.reader_prefix,
                         keys.bell(""), keys.inbox("", 0), keys.inbox("", 1), keys.readers)
        self.requests = Keys(queue).requests  # a claim's payloads, read after its script
        self.by_sha = {hashlib.sha1(scripts.source(name).encode()).hexdigest(): name
                       for name in scripts.NAMES}

    def __enter__(self) -> "RedisTime":
        if not self.enabled:
            return self
        self.saved = self.conn.config_get("slowlog-*")
        self.conn.config_set("slowlog-max-len", SLOWLOG_MAX)
        self.conn.config_set("slowlog-log-slower-than", 0)
        self.conn.slowlog_reset()
        self.conn.config_resetstat()
        self.cpu = common.cpu_seconds(self.pid)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            self.conn.close()
            return
        self.cpu = common.cpu_seconds(self.pid) - self.cpu
        self.commandstats = self.conn.info("commandstats")
        # read as bytes: a claim's counts are binary (MessagePack), decoded by report()
        with redis.Redis.from_url(self.url) as raw:
            self.entries = raw.execute_command("SLOWLOG", "GET", SLOWLOG_MAX)
        for name, value in self.saved.items():
            self.conn.config_set(name, value)
        self.conn.slowlog_reset()
        self.conn.close()

    def part(self, args: list[str]) -> str | None:
        """Which part of a request's life a top-level command served (None: the bench's
        own reads)."""
        command = args[0].lower()
        if command in ("slowlog", "config", "info"):
            return None
        if command == "evalsha":
            return SCRIPT_PARTS.get(self.by_sha.get(args[1], ""), "other commands")
        keys = args[1:]
        if command == "hmget" and keys[:1] == [self.requests]:
            return "claim"  # the payloads a claim leased and handed ahead (RequestQueue.claim)
        if any(k.startswith(self.delivery) for k in keys):
            return "result delivery"  # the client's reply-list reads and result reads
        return "other commands"

    def report(self, n: int) -> dict[str, Any]:
        """Microseconds of redis-server per request, by part, and the costliest commands."""
        usec = dict.fromkeys(PARTS, 0.0)
        calls = dict.fromkeys(PARTS, 0)
        logged = 0.0
        for entry in self.entries:
            if entry[4] in (SCRIPT_CLIENT, SCRIPT_CLIENT.decode()):
                continue  # a command a script called: inside its EVALSHA's time already
            args = [a.decode(errors="replace") if isinstance(a, bytes) else str(a) for a in entry[3]]
            part = self.part(args)
            if part:
                usec[part] += int(entry[2])
                calls[part] += 1
                logged += int(entry[2])
        cpu_us = self.cpu * 1e6 / n
        rows = [{"part": p, "calls": calls[p], "share": usec[p] / max(1.0, logged),
                 "us": cpu_us * usec[p] / max(1.0, logged)} for p in PARTS]
        rows.append({"part": "all (/proc)", "calls": sum(calls.values()), "share": 1.0, "us": cpu_us})
        stats = sorted(((name.removeprefix("cmdstat_"), s) for name, s in self.commandstats.items()
                        if not name.startswith(("cmdstat_slowlog", "cmdstat_config", "cmdstat_info"))),
                       key=lambda item: -item[1]["usec"])
        top = [{"command": name, "calls": int(s["calls"]), "us": s["usec"] / n} for name, s in stats[:10]]
        lost = len(self.entries) >= SLOWLOG_MAX
        text = common.table(rows, COLUMNS) + "\n\n" + common.table(top, TOP_COLUMNS)
        if lost:
            text += "\n\n(the slow log filled up: the oldest calls are missing from the split)"
        return {"rows": rows, "commandstats": top, "us_redis": cpu_us, "table": text}


def phases(url: str, n: int) -> dict[str, float]:
    """redis-server CPU us per request of each part, run one after the other."""
    conn = redis.Redis.from_url(url, decode_responses=True)
    pid, queue = common.redis_pid(url), RequestQueue(conn, "phases")
    conn.flushdb()  # a private server: each run starts empty
    ids = (f"r{i}" for i in range(n))  # as Client.map builds them: ids the client made
    requests = list(map_requests(range(n), DEFAULT_PRIORITY, None, ids.__next__, lambda value: None))
    used: dict[str, float] = {}

    def timed(part: str, run: Any) -> Any:
        before = common.cpu_seconds(pid)
        out = run()
        used[part] = 1e6 * (common.cpu_seconds(pid) - before) / n
        return out

    def claim_all() -> list[Any]:
        """As a worker that counts tokens: handed the estimated candidates, it counts
        them (1 token each, as bench.runners:noop) and claims with its counts."""
        claimed: list[Any] = []
        while len(claimed) < n:
            token = f"w#{len(claimed)}"
            reply = queue.claim(token, 1024, 10**9, 0, 4096, price_estimates=True)
            counts = [(i, 1) for i, _ in reply.to_price]
            claimed += queue.claim(token, 1024, 10**9, 0, 4096, counts=counts).batch
        return claimed

    def complete_all(claimed: list[Any]) -> None:
        for lo in range(0, n, 1024):
            part = claimed[lo:lo + 1024]
            queue.complete([(c.id, c.lease_token, Result(id=c.id, status="ok", attempts=1).to_json())
                            for c in part], {"requests": len(part)}, [c.client for c in part])

    def deliver() -> None:
        """As the client's reader (common.ReplyReader), marked before the commits."""
        got = 0
        while got < n:
            got += reader.read(5)
        reader.read()  # deletes what the last read moved

    reader = common.ReplyReader(conn, queue.keys, "bench")
    timed("enqueue", lambda: [queue.enqueue(requests[lo:lo + 500], "bench") for lo in range(0, n, 500)])
    claimed = timed("claim", claim_all)
    reader.read()  # marked as the commits come (a mark lasts READER_LIVE_MS)
    timed("complete", lambda: complete_all(claimed))
    timed("result delivery", deliver)
    conn.close()
    return used


ZADD_PIPELINE = 1000  # commands per pipeline: a client that batches its writes
E2E_QUEUE = "redis-time"
E2E_COLUMNS = [("part", "part", ""), ("share", "share", ".0%"), ("us", "us per request", ".2f"),
               ("zadds", "pipelined ZADDs per request", ".1f")]


def zadd_us(url: str, n: int = 200_000) -> float:
    """redis-server CPU us of one ZADD (a new member each) sent ZADD_PIPELINE to a pipeline."""
    conn = redis.Redis.from_url(url)
    pid, key = common.redis_pid(url), "bench:zadd-unit"
    conn.delete(key)
    before = common.cpu_seconds(pid)
    for lo in range(0, n, ZADD_PIPELINE):
        pipe = conn.pipeline(transaction=False)
        for i in range(lo, lo + ZADD_PIPELINE):
            pipe.zadd(key, {f"m{i}": i})
        pipe.execute()
    used = 1e6 * (common.cpu_seconds(pid) - before) / n
    conn.delete(key)
    conn.close()
    return used


def end_to_end(url: str, client: Client, n: int, split: bool, exact: bool = False,
               producer_first: bool = False, text: bool = False) -> dict[str, Any]:
    """n no-op requests through a worker: redis-server CPU us per request (/proc), and with
    ``split`` the slow log's split by part. ``Client.map`` to a worker already serving;
    ``producer_first``: every request enqueued (``enqueue_many``), then the worker started,
    the results awaited; ``exact``: each request with its count, as a producer with the
    queue's tokenizer sends it (else priced by estimate); ``text``: the inputs are
    standard-library paragraphs, their worker counting their words (else integers)."""
    pid = common.redis_pid(url)
    before = common.cpu_seconds(pid)
    workers: list[Any] = []
    inputs = corpus.paragraphs(n) if text else list(range(n))
    try:
        with RedisTime(url, E2E_QUEUE, enabled=split) as timing:
            if producer_first:
                handles = [h for lo in range(0, n, ENQUEUE_CHUNK)  # Client.map's calls
                           for h in client.enqueue_many(request(v, exact)
                                                        for v in inputs[lo:lo + ENQUEUE_CHUNK])]
                workers.append(noop_worker(url, text))
                results = [h.result(timeout=600) for h in handles]
            elif exact:
                results = list(client.stream(request(v, exact) for v in inputs))
            else:
                results = client.map(inputs)
        used = 1e6 * (common.cpu_seconds(pid) - before) / n
    finally:
        common.stop(workers)
    assert len(results) == n and all(r.ok for r in results), "a no-op request failed"
    return {"us": used, "split": timing.report(n) if split else None}


def request(value: Any, exact: bool) -> dict[str, Any]:
    """A request of ``value``; ``exact``: with the count its worker will make (words)."""
    return {"input": value, "tokens": words(value)} if exact else {"input": value}


def noop_worker(url: str, text: bool = False) -> Any:
    """``batchery worker --runner bench.runners:noop``, no other flag (``noop_words`` for
    text: the same, counting words)."""
    runner = "bench.runners:noop_words" if text else "bench.runners:noop"
    return common.batchery_worker(url, E2E_QUEUE, "--runner", runner)


def defaults_run(n: int, repeat: int, exact: bool = False, producer_first: bool = False,
                 text: bool = False) -> dict[str, Any]:
    """The per-script table, with defaults (see the module's docstring)."""
    with common.private_redis() as url:
        worker = noop_worker(url, text)
        try:
            with Client(url, E2E_QUEUE) as client:
                common.wait_until(lambda: client.queue.stats()["workers"] >= 1, 60, "the worker")
                client.map(range(1000))  # warm: scripts loaded, listener up
                if producer_first:  # each run starts its own worker after its enqueues
                    common.stop([worker])
                units, totals = [], []
                for _ in range(repeat):  # the unit timed on each side of each run: the VM drifts
                    before = zadd_us(url)
                    totals.append(end_to_end(url, client, n, False, exact, producer_first, text)["us"])
                    units.append((before + zadd_us(url)) / 2)
                split = end_to_end(url, client, n, True, exact, producer_first, text)["split"]
        finally:
            common.stop([worker])
    best = min(totals)
    zadds = statistics.median(t / u for t, u in zip(totals, units))  # each run in its own unit
    rows = [{"part": r["part"], "share": r["share"], "us": best * r["share"],
             "zadds": zadds * r["share"]} for r in split["rows"] if r["part"] in PARTS]
    rows.append({"part": "all (/proc, no slow log)", "share": 1.0, "us": best, "zadds": zadds})
    return {"zadd_us": units, "runs_us": totals, "zadds": zadds, "rows": rows,
            "commandstats": split["commandstats"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("-n", type=int, help="requests (default 40,000 end to end, 50,000 --phases)")
    p.add_argument("--phases", action="store_true", help="the parts one at a time (batches "
                   "of 1024), as before: no worker (--producer-first and --exact do not apply)")
    p.add_argument("--producer-first", action="store_true", help="each run enqueues every "
                   "request first, then starts the worker (default: the worker serves first)")
    p.add_argument("--exact", action="store_true", help="the producer counts tokens, as one "
                   "with the queue's tokenizer (default: it estimates, as one without transformers)")
    p.add_argument("--text", action="store_true", help="inputs of varied length: standard-"
                   "library paragraphs, the worker counting their words (default: integers)")
    args = p.parse_args(argv)
    repeat = args.repeat if args.repeat > 1 else 3  # --repeat defaults to 1
    if args.phases:
        return phases_main(args.n or 50_000, repeat)
    n = args.n or (10_000 if args.quick else 40_000)
    out = defaults_run(n, repeat, args.exact, args.producer_first, args.text)
    text = common.table(out["rows"], E2E_COLUMNS)
    order = "the producer first, then the worker" if args.producer_first else "the worker first"
    pricing = "counts tokens" if args.exact else "estimates"
    inputs = "paragraphs" if args.text else "integers"
    print(f"\nredis-server CPU per request, end to end with defaults ({n:,} requests; {inputs}; {order}; "
          f"the producer {pricing}; runs: "
          f"{', '.join(f'{t:.1f} us ({t / u:.1f} ZADDs of {u:.2f} us)' for t, u in zip(out['runs_us'], out['zadd_us']))}"
          f"; us: the best run, ZADDs: the runs' median; {common.machine()}):\n\n{text}\n\n"
          + common.table(out["commandstats"], TOP_COLUMNS) + "\n")
    common.save("redis_time", {"machine": common.machine(), "requests": n, "exact": args.exact, "text": args.text,
                               "producer_first": args.producer_first, **out})
    return out


def phases_main(n: int, repeat: int) -> dict[str, Any]:
    best: dict[str, float] = {}
    with common.private_redis() as url:
        for _ in range(repeat):
            for part, us in phases(url, n).items():
                best[part] = min(best.get(part, float("inf")), us)
    best["all"] = sum(best.values())
    print(f"\nredis-server CPU, us per request, one part at a time ({n:,} requests, "
          f"best run; {common.machine()}):\n")
    print(common.table([{"part": k, "us": v} for k, v in best.items()],
                       [("part", "part", ""), ("us", "us per request", ".1f")]))
    return best


if __name__ == "__main__":
    main()
