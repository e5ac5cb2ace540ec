"""The floor under Redis time per request: the commands a request's life takes with
today's data layout, alone, without the scripts' logic; beside the scripts themselves.

Each command the scripts run for a request (enqueue: look for its result, check it is not
held, add it to pending, store its body and its schedule entry; claim: read the head and
its schedule entries, take it from pending, lease its claim of 64 (the ids and one
expiry), read its body and attempts; complete: check its claim still holds it (the
lease's ids, one read per claim), store the result with its TTL, push it to the client's
reply list, forget body, schedule entry, attempts and history, end its claim's lease;
delivery: pop the reply, delete the result) runs from Lua, variadic over 1,000 requests
as the scripts call it (the result's SET once per request), one command per call, with
redis-server's CPU time (INFO cpu) read around it; a call that only builds the ids is
subtracted. Every structure holds a standing backlog of 10,000 other requests, as a loaded
queue does. The scripts' own figures are bench.redis_time's parts (the same requests,
a worker that counts tokens: its pricing round included).

What the scripts spend above the floor is their logic; the floor itself only moves with
the layout: fewer structures written per request.

``python -m bench.redis_floor [-n N] [--repeat R]``: the best of 3 runs (or of R).
"""

from __future__ import annotations

from typing import Any

import redis

from batchery.batching.keys import Keys
from batchery.batching.request import Request
from bench import common
from bench.redis_time import phases

BATCH = 1000
BACKLOG = 10_000
IDS = ("local base, n = tonumber(ARGV[1]), tonumber(ARGV[2])\n"
       "local ids = {}\nfor i = 1, n do ids[i] = 'r' .. (base + i) end\n")
PAIRS = ("local function pairs_of(value)\n  local out = {}\n"
         "  for i = 1, #ids do out[#out + 1] = value(i); out[#out + 1] = ids[i] end\n"
         "  return out\nend\n")
# (part, command, what it does for a request, Lua run after IDS and PAIRS); K is the
# queue's Keys, ARGV[3] a request body, ARGV[4] its schedule entry, ARGV[5] a result
K = Keys("floor")
RESULTS = (f"local keys = {{}}\nfor i = 1, n do keys[i] = '{K.result_prefix}' .. ids[i] end\n")
CLAIM = 64  # requests a claim leases with the defaults (WorkerOptions.max_batch_size)
# each claim of CLAIM ids in turn, its lease token `token` (the loop's end is the step's)
CLAIMS = (f"local CLAIM = {CLAIM}\nfor c = 1, n, CLAIM do\n"
          "local token = 'worker-1#' .. (base + c)\n")


def _hset(key: str, value: str) -> str:
    return (f"local args = {{}}\nfor i = 1, n do args[#args + 1] = ids[i]; "
            f"args[#args + 1] = {value} end\nredis.call('HSET', '{key}', unpack(args))")


STEPS: list[tuple[str, str, str, str]] = [
    ("enqueue", "EXISTS", "no result under its id yet", RESULTS + "redis.call('EXISTS', unpack(keys))"),
    ("enqueue", "HMGET", "not held in requests", f"redis.call('HMGET', '{K.requests}', unpack(ids))"),
    ("enqueue", "ZADD", "pending: its rank", f"redis.call('ZADD', '{K.pending}', unpack(pairs_of(function(i) return base + i end)))"),
    ("enqueue", "HSET", "requests: its body", _hset(K.requests, "ARGV[3]")),
    ("enqueue", "HSET", "sched: its schedule entry", _hset(K.sched, "ARGV[4]")),
    ("claim", "ZRANGE", "pending: the head", f"redis.call('ZRANGE', '{K.pending}', 0, n - 1)"),
    ("claim", "HMGET", "sched: the candidates' entries", f"redis.call('HMGET', '{K.sched}', unpack(ids))"),
    ("claim", "ZREM", "pending: taken", f"redis.call('ZREM', '{K.pending}', unpack(ids))"),
    ("claim", "HSET, ZADD", "its claim's lease (one per 64)", CLAIMS + (
        f"redis.call('HSET', '{K.lease_ids}', token, table.concat(ids, '\\n', c, math.min(n, c + CLAIM - 1)))\n"
        f"redis.call('ZADD', '{K.lease_expiry}', base, token) end")),
    ("claim", "HMGET", "requests: its body", f"return redis.call('HMGET', '{K.requests}', unpack(ids))"),
    ("claim", "HMGET", "attempts", f"return redis.call('HMGET', '{K.attempts}', unpack(ids))"),
    ("complete", "SET EX", "its result, with the result TTL", RESULTS + "for i = 1, n do redis.call('SET', keys[i], ARGV[5], 'EX', 86400) end"),
    ("complete", "RPUSH", "the client's reply list", f"local r = {{}}\nfor i = 1, n do r[i] = ARGV[5] end\nredis.call('RPUSH', '{K.reply('c')}', unpack(r))"),
    ("complete", "HDEL", "requests", f"redis.call('HDEL', '{K.requests}', unpack(ids))"),
    ("complete", "HDEL", "sched", f"redis.call('HDEL', '{K.sched}', unpack(ids))"),
    ("complete", "HDEL", "attempts, history", "\n".join(
        f"redis.call('HDEL', '{key}', unpack(ids))" for key in (K.attempts, K.history))),
    ("complete", "HGET, HDEL, ZREM", "its claim's lease read and ended (one per 64)", CLAIMS + (
        f"redis.call('HGET', '{K.lease_ids}', token)\nredis.call('HDEL', '{K.lease_ids}', token)\n"
        f"redis.call('ZREM', '{K.lease_expiry}', token) end")),
    ("delivery", "LPOP", "the client's reply list", f"return redis.call('LPOP', '{K.reply('c')}', n)"),
    ("delivery", "DEL", "its result, delivered", RESULTS + "redis.call('DEL', unpack(keys))"),
]
COLUMNS = [("part", "part", ""), ("command", "command", ""), ("what", "per request", ""),
           ("us", "us per request", ".2f")]
PART_COLUMNS = [("part", "part", ""), ("scripts", "scripts, us/req", ".1f"),
                ("floor", "commands alone, us/req", ".1f"), ("logic", "scripts' logic, us/req", ".1f")]


def cpu_us(conn: redis.Redis) -> float:
    info = conn.info("cpu")
    return 1e6 * (info["used_cpu_user"] + info["used_cpu_sys"])


def floor(url: str, n: int) -> list[float]:
    """redis-server CPU us per request of each of STEPS, over n requests."""
    conn = redis.Redis.from_url(url)
    conn.flushdb()
    body = Request(id="r0", input="a paragraph of an English text " * 3).payload()
    args = [body, "~20:0:1763900000000:1763900005000:normal:client", '{"id":"r0","status":"ok"}']
    # a standing backlog, as in a queue under load: no structure empties between rounds
    # (an emptied hash starts again small, a cost a loaded queue does not pay)
    backlog = {f"backlog-{i}": 1e12 + i for i in range(BACKLOG)}
    for key in (K.requests, K.sched, K.attempts, K.history):
        conn.hset(key, mapping=dict.fromkeys(backlog, "1"))
    conn.zadd(K.pending, backlog)
    conn.zadd(K.lease_expiry, {f"backlog#{i}": 1e12 + i for i in range(0, BACKLOG, CLAIM)})
    base_sha = conn.script_load(IDS + PAIRS + "return 1")
    shas = [conn.script_load(IDS + PAIRS + lua) for _, _, _, lua in STEPS]
    spent = [0.0] * len(STEPS)
    for first in range(0, n, BATCH):
        for i, sha in enumerate(shas):
            before = cpu_us(conn)
            conn.evalsha(base_sha, 0, first, BATCH)
            middle = cpu_us(conn)
            conn.evalsha(sha, 0, first, BATCH, *args)
            spent[i] += (cpu_us(conn) - middle) - (middle - before)
    conn.close()
    return [us / n for us in spent]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("-n", type=int, help="requests (default 50,000; --quick: 10,000)")
    args = p.parse_args(argv)
    args.n = args.n or (10_000 if args.quick else 50_000)
    steps: list[float] = [float("inf")] * len(STEPS)
    scripts: dict[str, float] = {}
    with common.private_redis() as url:
        for _ in range(args.repeat if args.repeat > 1 else 3):
            steps = [min(a, b) for a, b in zip(steps, floor(url, args.n))]
            for part, us in phases(url, args.n).items():
                scripts[part] = min(scripts.get(part, float("inf")), us)
    rows = [{"part": part, "command": cmd, "what": what, "us": us}
            for (part, cmd, what, _), us in zip(STEPS, steps)]
    parts = []
    for part in ("enqueue", "claim", "complete", "delivery"):
        low = sum(r["us"] for r in rows if r["part"] == part)
        high = scripts["result delivery" if part == "delivery" else part]
        parts.append({"part": part, "scripts": high, "floor": low, "logic": high - low})
    parts.append({"part": "all", **{k: sum(p[k] for p in parts) for k in ("scripts", "floor", "logic")}})
    text = common.table(rows, COLUMNS) + "\n\n" + common.table(parts, PART_COLUMNS)
    total = parts[-1]
    targets = [f"Redis us per request, scripts: {total['scripts']:.1f} (target <= 10): "
               f"{'met' if total['scripts'] <= 10 else 'MISSED'}; "
               f"the layout's commands alone: {total['floor']:.1f}"]
    print(f"\nredis-server CPU per request, today's layout ({args.n:,} requests, best run; "
          f"{common.machine()}):\n\n{text}\n\n" + "\n".join(targets) + "\n")
    common.save("redis_floor", {"machine": common.machine(), "steps": rows, "parts": parts,
                                "targets": targets})
    return {"steps": rows, "parts": parts, "table": text, "targets": targets}


if __name__ == "__main__":
    main()
