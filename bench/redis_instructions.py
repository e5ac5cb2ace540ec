"""redis-server's instructions per request, by part: a count that a shared machine's noise
does not move, for comparing two versions of the scripts.

``python -m bench.redis_instructions [-n N] [--backlog B] [--enqueue E] [--batch C] [--exact] [--text]``
starts a private redis-server under valgrind's callgrind (it must be installed) and
drives the scripts in the shapes the defaults give them, one call at a time: enqueues of
500 (or E), claims of 64 (or C) by a worker that
counts tokens (each claim sending the counts of the requests the last one priced ahead),
commits of as many with the worker holding two batches, result delivery as the Client does
it (its reader's read: marked, reading its reply list alone), B requests (default 1,000) standing
in the queue throughout, as in ``bench.redis_time``'s run; ``--exact``: the producer
counts tokens, as one with transformers does (else it estimates); ``--text``: the inputs
are standard-library paragraphs of varied length, counted by their words, not integers
of one token each. After each call it has
callgrind write out and zero its counts, and it sums them by part: instructions per
request of enqueue, claim, commit and delivery, and of its unit, a pipelined ZADD (a
new member each, 1,000 to a pipeline, into a key of 100,000 members: what
``bench.redis_time``'s unit averages over), in whose worth it gives them too. Run it in two
worktrees to compare: the counts repeat to within a percent or two, where CPU time on a busy machine moves
by tens. (Instructions are not time: a listpack's scan runs more of them per
nanosecond than Lua does. ``bench.redis_time`` gives the time.)
"""

from __future__ import annotations

import functools
import glob
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

import redis

from batchery.batching.claim_call import by_lease
from batchery.batching.messages import Result
from batchery.batching.queue import RequestQueue
from batchery.batching.request import DEFAULT_PRIORITY, Request, map_requests
from batchery.embedded import find_redis_server
from batchery.workers.claiming import CLAIM_BATCHES
from batchery.workers.options import WorkerOptions
from bench import common, corpus
from bench.runners import words

DEFAULTS = WorkerOptions()  # the worker's defaults: the claims' shape
ENQUEUE_BATCH = 500  # Client.map's requests per enqueue call
HELD = 2  # batches a worker holds at once (one running, one claimed ahead)
PARTS = ("enqueue", "claim", "commit", "delivery")
ZADDS = 1000  # the unit's pipeline, as bench.redis_time times it
# bench.redis_time times its unit over 200,000 ZADDs into one key: the key's size halfway
UNIT_KEY_SIZE = 100_000


def drive(url: str, n: int, backlog: int, dump: Callable[[str], None], exact: bool = False,
          text: bool = False, enqueue_batch: int = ENQUEUE_BATCH,
          claim_size: int = DEFAULTS.max_batch_size) -> None:
    """n requests through the scripts; ``dump(part)`` after each call. ``exact``: the
    producer counts tokens (as one with transformers does), else it estimates. ``text``:
    each input a standard-library paragraph (bench.corpus), counted by its words
    (bench.runners.words); else the integer i, one token each."""
    texts = corpus.paragraphs(n + backlog) if text else None
    conn = redis.Redis.from_url(url, decode_responses=True)
    queue = RequestQueue(conn, "instructions")

    def requests(prefix: str, lo: int, hi: int, first: int) -> list[Request]:
        """As Client.map builds them: ids the client made (no duplicate check to pass), of
        RequestIds' length (16 hex digits, a dash, a counter: a script's cost of an id
        grows with its length)."""
        values = [texts[first + i] if texts else i for i in range(lo, hi)]
        ids = (f"{prefix}0123456789abcdef-{i}" for i in range(lo, hi))
        return list(map_requests(values, DEFAULT_PRIORITY, None, ids.__next__,
                                 words if exact else lambda value: None))
    for lo in range(0, backlog, enqueue_batch):
        queue.enqueue(requests("b", lo, min(backlog, lo + enqueue_batch), n), "bench")
    dump("")  # the backlog's enqueues are not counted
    ahead: list[Any] = []
    claims = 0

    reader = common.ReplyReader(conn, queue.keys, "bench")  # marked as the Client's is
    dump("")

    def claim(token: str, counts: list[tuple[str, int]]) -> Any:
        """As the worker claims with its defaults, the head not held (max_wait_ms 0): a
        deep queue's next batch comes too (CLAIM_BATCHES), under a lease of its own."""
        return queue.claim(token, claim_size, DEFAULTS.max_batch_tokens, 0,
                           DEFAULTS.claim_lookahead, True, counts, batches=CLAIM_BATCHES)
    for lo in range(0, n, enqueue_batch):
        size = min(enqueue_batch, n - lo)
        queue.enqueue(requests("r", lo, lo + size, 0), "bench")
        dump("enqueue")
        got, held = 0, []
        while got < size or held:
            if got < size and len(held) < HELD:
                claims += 1
                token = f"w#{claims}"
                reply = claim(token, [(i, words(v)) for i, v in ahead])
                if reply.to_price:  # the first claim: a pricing round
                    reply = claim(token, [(i, words(v)) for i, v in reply.to_price])
                dump("claim")
                ahead = reply.price_ahead
                if not reply.batch:
                    raise SystemExit(f"a claim leased nothing: {reply}")
                got += len(reply.batch)
                held += by_lease(reply.batch)  # each lease committed as its own batch
            if len(held) >= HELD or got >= size:
                batch = held.pop(0)
                items = [(c.id, c.lease_token, Result(id=c.id, status="ok", attempts=1).to_json())
                         for c in batch]
                queue.complete(items, {"requests": len(items), "batches": 1}, [c.client for c in batch])
                dump("commit")
                reader.read()
                dump("delivery")
    conn.close()


def count_unit(conn: redis.Redis, dump: Callable[[str], None]) -> None:
    """The unit, dumped as "zadd": ZADDS pipelined ZADDs of a new member each into a key
    holding UNIT_KEY_SIZE members (filled first, not counted), as ``bench.redis_time``'s
    unit averages over a key growing to 200,000 (a ZADD into a small key costs a third
    more: its pipeline's fixed costs and a short skip list)."""
    for lo in range(0, UNIT_KEY_SIZE, 10_000):
        conn.zadd("unit", {f"f{i}": i for i in range(lo, lo + 10_000)})
    dump("")
    zadds = conn.pipeline(transaction=False)
    for i in range(ZADDS):
        zadds.zadd("unit", {f"m{i}": i})
    zadds.execute()
    dump("zadd")
    conn.delete("unit")
    dump("")


def callgrind_command(out: str) -> list[str]:
    """The command prefix that runs a program under valgrind's callgrind, its counts
    written to ``out``.N, one file per dump (callgrind_dump)."""
    valgrind = shutil.which("valgrind")
    if not valgrind or not shutil.which("callgrind_control"):
        raise SystemExit("needs valgrind (with callgrind_control) on the PATH")
    return [valgrind, "--tool=callgrind", f"--callgrind-out-file={out}"]


def callgrind_dump(pid: int, part: str) -> None:
    """Have the program under callgrind write out its counts since the last dump, and zero
    them; ``part`` names the dump (dumped_counts sums by it)."""
    subprocess.run(["callgrind_control", f"--dump={part}", str(pid)], check=True,
                   capture_output=True)


def dumped_counts(pattern: str) -> dict[str, int]:
    """Instructions counted in the dump files matching ``pattern``, summed by their part;
    the files are removed (a later call counts only later dumps)."""
    totals: dict[str, int] = {}
    for path in glob.glob(pattern):
        text = Path(path).read_text(errors="replace")
        part = re.search(r"^desc: Trigger: .*dump (\w+)", text, re.M)
        total = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
        if part and total:
            totals[part.group(1)] = totals.get(part.group(1), 0) + int(total.group(1))
        os.remove(path)
    return totals


Drive = Callable[[str, int, int, Callable[[str], None]], None]  # (url, n, backlog, dump)


def count(run: Drive, n: int, backlog: int) -> dict[str, float]:
    """Instructions per request of each part ``run`` dumps (PARTS), from callgrind's dumps,
    and of the unit (count_unit)."""
    folder, port = tempfile.mkdtemp(prefix="batchery-instructions-"), common.free_port()
    out = os.path.join(folder, "callgrind.out")
    proc = subprocess.Popen([*callgrind_command(out), find_redis_server(), "--port", str(port),
                             "--bind", "127.0.0.1", "--dir", folder, "--save", "",
                             "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        common.wait_until(lambda: common.pings(redis.Redis(port=port)), 60, "redis-server")
        run(url, 1000, 0, lambda part: None)  # warm: scripts loaded
        conn = redis.Redis(port=port)
        conn.flushdb()

        def dump(part: str) -> None:
            callgrind_dump(proc.pid, part or "skip")
        dump("")
        count_unit(conn, dump)
        run(url, n, backlog, dump)
    finally:
        proc.kill()
        proc.wait(30)
    totals = dumped_counts(out + ".*")
    shutil.rmtree(folder, ignore_errors=True)
    used = {part: totals.get(part, 0) / n for part in PARTS}
    used["all"] = sum(used.values())
    used["zadd"] = totals.get("zadd", 0) / ZADDS
    return used


def parts_table(used: dict[str, float]) -> str:
    """count's figures: each part's instructions per request, also in the unit's, and the unit."""
    zadd = used["zadd"]
    rows = [{"part": part, "ir": used[part], "zadds": used[part] / zadd} for part in (*PARTS, "all")]
    return (common.table(rows, [("part", "part", ""), ("ir", "instructions per request", ",.0f"),
                                ("zadds", "the unit's instructions (not its time)", ".1f")])
            + f"\n\n(the unit, {ZADDS:,} pipelined ZADDs of a new member into a key of "
              f"{UNIT_KEY_SIZE:,}: {zadd:,.0f} instructions each)")


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=2000, help="requests counted (default 2,000)")
    p.add_argument("--backlog", type=int, default=1000, help="requests standing in the queue")
    p.add_argument("--enqueue", type=int, default=ENQUEUE_BATCH, help="requests per enqueue call "
                   f"(default {ENQUEUE_BATCH}; fewer than a batch with --backlog 0: a worker that "
                   "keeps up, each claim taking all that is pending)")
    p.add_argument("--batch", type=int, default=DEFAULTS.max_batch_size, help="requests a claim "
                   f"takes at most (default the worker's {DEFAULTS.max_batch_size}; 1: what a call "
                   "costs whatever it carries)")
    p.add_argument("--text", action="store_true", help="inputs of varied length, counted by their "
                   "words: standard-library paragraphs (default: integers, one token each)")
    p.add_argument("--exact", action="store_true",
                   help="the producer counts tokens (default: it estimates, as one without transformers)")
    args = p.parse_args(argv)
    if args.batch < 1:
        p.error("--batch must be at least 1")
    used = count(functools.partial(drive, exact=args.exact, text=args.text,
                                   enqueue_batch=args.enqueue, claim_size=args.batch), args.n, args.backlog)
    print(f"\nredis-server instructions per request ({args.n:,} requests, a standing backlog of "
          f"{args.backlog:,}, enqueues of {args.enqueue:,}, claims of {args.batch:,}; "
          f"{'paragraphs' if args.text else 'integers'}; "
          f"the producer {'counts tokens' if args.exact else 'estimates'}; "
          f"{common.machine()}):\n")
    print(parts_table(used))
    common.save("redis_instructions", {"requests": args.n, "backlog": args.backlog,
                                       "enqueue": args.enqueue, "batch": args.batch,
                                       "exact": args.exact,
                                       "text": args.text,
                                       **used})
    return used


if __name__ == "__main__":
    main()
