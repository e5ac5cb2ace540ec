"""Fair share between tenants: a small job beside a big one, and weighted shares.

1. Jobs: job A (20,000 lines, batch class) is submitted first, job B (200 lines, same
   class) 2 s later; one worker with the default flags (bench.runners:padded_cost: its
   time grows with padded tokens, as a transformer's), one jobs worker (its default
   --jobs runs both jobs side by side).
   Each job is its own tenant (the default). With fair share (the default) and without
   (`queue config --no-fair-share`: the class served by age), side by side in one run;
   B alone first. B's completion (submitted to finished) against alone, A's lines/s (its
   RQ run) and the padding efficiency (tokens / padded tokens over the run).
2. Shares: three tenants of weights 1, 1 and 2, each kept backlogged (topped up to
   BACKLOG queued), one worker; the tokens served to each per 30 s window, summed over
   the queue's shards (``--shards N``: the queue spread over N). Beside them a fourth
   tenant sends a realtime request every PROBE_EVERY_S and waits for it: its latency's
   p50 and p99, fair share against by age.
3. Realtime: the same flood and probes on one queue and one worker, the queue's fair
   share switched on and off at run time every SEGMENT_S (by age, fair, fair, by age,
   ...), each way's probes pooled: the p99 of each, their ratio and its bootstrap 90%
   interval. Two runs one after the other (2.) leave the p99, the 4th-slowest of ~450,
   to the machine's drift between them; here both ways share every minute of it.

``python -m bench.fair_share [--quick] [--shards N] [--shares-only | --realtime-only]
[--segments K]``
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from rq import Worker

from batchery import Client
from batchery.connection import RedisSettings
from batchery.producer.jobs import bookkeeping as jobs
from batchery.batching.inspection import merge_loads
from batchery.producer.jobs.cli import DEFAULT_JOBS
from bench import common

RUNNER = ("--runner", "bench.runners:padded_cost")  # and the worker's default flags
LENGTHS = (8, 128)       # tokens per request, uniform
B_DELAY_S = 2.0
WEIGHTS = {"t1": 1.0, "t2": 1.0, "t3": 2.0}
BACKLOG = 1000           # requests each tenant keeps queued per shard in the shares run
WINDOW_S = 30.0
PROBE_EVERY_S = 0.2      # realtime requests sent beside the shares' flood: 5 a second
SEGMENT_S = 30.0         # the realtime run: fair share and by age switched this often
SETTLE_S = 5.0           # ... and each segment's probes counted from this long after a switch


def write_job(path: Path, lines: int, seed: int) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(lines):
            f.write(json.dumps({"custom_id": f"r{i}", "input": {"n": rng.randint(*LENGTHS)}}) + "\n")
    return path


def finished(conn: Any, job_id: str, timeout: float = 900) -> Any:
    job = jobs.fetch(conn, job_id)
    common.wait_until(lambda: job.get_status(refresh=True) in ("finished", "failed"), timeout,
                      f"job {job_id}", interval=0.05)
    job.refresh()
    if job.get_status() != "finished":
        raise SystemExit(f"job {job_id} failed: {jobs.describe(job)}")
    return job


def jobs_run(url: str, folder: Path, label: str, big: int, small: int, fair: bool | None) -> dict[str, Any]:
    """Job A of ``big`` lines, then (B_DELAY_S later) job B of ``small``; fair None: B alone."""
    queue = f"fair-{label}-{time.monotonic_ns()}"
    conn = RedisSettings.from_url(url).binary_client()
    procs = [common.batchery_worker(url, queue, *RUNNER)]
    procs.append(common.start([sys.executable, "-m", "batchery", "job", "worker", "--redis-url",
                               url, "--jobs-queue", queue]))
    try:
        with Client(url, queue) as client:
            client.queue.update_settings(fair_share=bool(fair))
            common.wait_until(lambda: client.queue.stats()["workers"] >= 1, 60, "the worker")
            rq = jobs.rq_queue(conn, queue)  # every jobs worker ready: B's time is the queue's
            common.wait_until(lambda: len(Worker.all(queue=rq)) >= DEFAULT_JOBS, 60, "jobs workers")
            a = None
            if fair is not None:
                a = jobs.submit(conn, str(write_job(folder / f"a-{label}.jsonl", big, 1)),
                                str(folder / f"a-{label}.out"), queue=queue, jobs_queue=queue,
                                overwrite=True)
                time.sleep(B_DELAY_S)
            b = jobs.submit(conn, str(write_job(folder / f"b-{label}.jsonl", small, 2)),
                            str(folder / f"b-{label}.out"), queue=queue, jobs_queue=queue,
                            overwrite=True)
            b = finished(conn, b.id)
            a = finished(conn, a.id) if a is not None else None
            totals = client.queue.stats()["totals"]
    finally:
        common.stop(procs)
    row: dict[str, Any] = {"scenario": {None: "B alone", True: "fair share", False: "by age"}[fair],
                           "b_s": (b.ended_at - b.enqueued_at).total_seconds(),
                           "padding": totals.get("tokens", 0) / max(1, totals.get("padded_tokens", 1))}
    if a is not None:
        row["a_rate"] = big / (a.ended_at - a.started_at).total_seconds()
    return row


@contextmanager
def flooded(url: str, prefix: str, fair: bool, shards: int, latencies: list[float],
            sent: list[tuple[float, float]] | None = None) -> Iterator[Client]:
    """A new queue (fair share on or off) with one worker, the three weighted tenants kept
    backlogged and the realtime probe beside them (its latencies, and in ``sent`` with
    their send times) until the block ends: its Client."""
    queue = f"{prefix}-{time.monotonic_ns()}"
    stop = threading.Event()
    worker, threads = None, []
    try:
        with Client(url, queue) as client:
            client.queue.update_settings(fair_share=fair, tenant_weights=WEIGHTS, shards=shards)
            worker = common.batchery_worker(url, queue, *RUNNER)
            common.wait_until(lambda: client.queue.stats()["workers"] >= 1, 60, "the worker")
            threads = [threading.Thread(target=feed, args=(client, stop, BACKLOG * shards)),
                       threading.Thread(target=probe, args=(url, queue, stop, latencies, sent))]
            for thread in threads:
                thread.start()
            yield client
            stop.set()
            for thread in threads:
                thread.join()
    finally:
        stop.set()
        common.stop([worker] if worker else [])


def shares_run(url: str, seconds: float, fair: bool, shards: int = 1) -> dict[str, Any]:
    """Three weighted tenants kept backlogged for ``seconds``: tokens served per window;
    realtime requests beside them: their latency."""
    windows: list[dict[str, float]] = []
    latencies: list[float] = []
    with flooded(url, "shares", fair, shards, latencies) as client:
        last = served(client)
        for _ in range(int(seconds // WINDOW_S)):
            time.sleep(WINDOW_S)
            now = served(client)
            windows.append({t: now[t] - last[t] for t in WEIGHTS})
            last = now
    shares = [{t: 100 * w[t] / max(1, sum(w.values())) for t in WEIGHTS} for w in windows]
    want = {t: 100 * w / sum(WEIGHTS.values()) for t, w in WEIGHTS.items()}
    worst = max(abs(s[t] - want[t]) for s in shares for t in WEIGHTS) if shares else float("nan")
    return {"scenario": "fair share" if fair else "by age", "shards": shards,
            "windows": len(shares),
            **{f"share_{t}": " / ".join(f"{s[t]:.1f}" for s in shares) for t in WEIGHTS},
            "worst": worst, "rt_n": len(latencies),
            "rt_p50": 1000 * common.percentile(latencies, 0.5) if latencies else float("nan"),
            "rt_p99": 1000 * common.percentile(latencies, 0.99) if latencies else float("nan")}


def realtime_run(url: str, segments: int, shards: int = 1) -> list[dict[str, Any]]:
    """The realtime latency beside the shares' flood, fair share against by age on one
    queue and one worker: the setting switched at run time every SEGMENT_S, in the order
    by age, fair, fair, by age, by age, ... (ABBA: a drift of the machine's load falls on
    both alike); the probes of each segment's first SETTLE_S, and any that straddle a
    switch, left out. One row per scenario: the probes pooled, and the p99 ratio's
    bootstrap interval."""
    probes: list[tuple[float, float]] = []  # (sent at, latency), monotonic seconds
    spans: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    with flooded(url, "realtime", False, shards, [], probes) as client:
        for k in range(segments):
            fair = k % 4 in (1, 2)
            client.queue.update_settings(fair_share=fair)
            started = time.monotonic()
            time.sleep(SEGMENT_S)
            spans[fair].append((started + SETTLE_S, time.monotonic()))
    pooled = {fair: [lat for sent, lat in probes
                     if any(a <= sent and sent + lat <= b for a, b in spans[fair])]
              for fair in spans}
    low, high = common.bootstrap_interval(
        lambda fair, age: common.percentile(fair, 0.99) / common.percentile(age, 0.99),
        pooled[True], pooled[False])
    return [{"scenario": "fair share" if fair else "by age", "shards": shards,
             "segments": len(spans[fair]), "rt_n": len(pooled[fair]),
             "rt_p50": 1000 * common.percentile(pooled[fair], 0.5),
             "rt_p99": 1000 * common.percentile(pooled[fair], 0.99),
             "ratio": (common.percentile(pooled[True], 0.99) / common.percentile(pooled[False], 0.99)
                       if fair else None),
             "low": low if fair else None, "high": high if fair else None,
             "interval": f"{low:.2f}-{high:.2f}" if fair else None}
            for fair in (False, True)]


def loads(client: Client) -> dict[str, dict[str, int]]:
    """Each tenant's load summed over the queue's shards."""
    return merge_loads(*(q.tenant_loads() for q in client.queue.shards))


def served(client: Client) -> dict[str, int]:
    now = loads(client)
    return {t: now.get(t, {}).get("served_tokens", 0) for t in WEIGHTS}


def probe(url: str, queue: str, stop: threading.Event, latencies: list[float],
          sent: list[tuple[float, float]] | None = None) -> None:
    """A realtime request every PROBE_EVERY_S, each waited for: its latency in seconds
    (and in ``sent``, when given, with the monotonic time it was sent)."""
    rng = random.Random(4)
    with Client(url, queue, tenant="realtime-app") as client:
        while not stop.is_set():
            started = time.monotonic()
            client.enqueue({"n": rng.randint(*LENGTHS)}, priority="realtime").result(timeout=60)
            latencies.append(time.monotonic() - started)
            if sent is not None:
                sent.append((started, latencies[-1]))
            stop.wait(max(0.0, PROBE_EVERY_S - (time.monotonic() - started)))


def feed(client: Client, stop: threading.Event, backlog: int) -> None:
    """Keep each tenant ``backlog`` requests queued (so every shard holds some of each:
    unbounded backlogs); tenant t3 first, so that by age it leads."""
    rng = random.Random(3)
    while not stop.is_set():
        loads_now = loads(client)
        for tenant in sorted(WEIGHTS, reverse=True):
            missing = backlog - loads_now.get(tenant, {}).get("pending", 0)
            if missing > backlog // 4:
                client.enqueue_many(({"input": {"n": rng.randint(*LENGTHS)}, "priority": "batch",
                                      "tenant": tenant} for _ in range(missing)), reply=False)
        stop.wait(0.2)


JOB_COLUMNS = [("scenario", "scenario", ""), ("b_s", "B done in s", ".2f"),
               ("b_x", "B vs alone", ".2f"), ("a_rate", "A lines/s", ".0f"),
               ("padding", "padding efficiency", ".3f")]
SHARE_COLUMNS = [("scenario", "scenario", ""), ("shards", "shards", "d"),
                 ("windows", "30 s windows", "d"),
                 *((f"share_{t}", f"{t} (w={w:g}) %", "") for t, w in WEIGHTS.items()),
                 ("worst", "worst gap, points", ".1f"), ("rt_n", "realtime sent", "d"),
                 ("rt_p50", "realtime p50 ms", ".1f"), ("rt_p99", "realtime p99 ms", ".1f")]

REALTIME_COLUMNS = [("scenario", "scenario", ""), ("segments", f"{SEGMENT_S:.0f} s segments", "d"),
                    ("rt_n", "realtime counted", "d"), ("rt_p50", "realtime p50 ms", ".1f"),
                    ("rt_p99", "realtime p99 ms", ".1f"), ("ratio", "p99 vs by age", ".2f"),
                    ("interval", "90% interval", "")]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=1, help="also run the shares on a queue of "
                   "this many shards, and the realtime run on it")
    p.add_argument("--shares-only", action="store_true", help="the shares runs alone")
    p.add_argument("--realtime-only", action="store_true", help="the realtime run alone")
    p.add_argument("--segments", type=int, help="the realtime run's segments of "
                   f"{SEGMENT_S:.0f} s, half of them each way (default 16, --quick 4)")
    args = p.parse_args(argv)
    segments = args.segments or (4 if args.quick else 16)
    big, small = (4000, 200) if args.quick else (20_000, 200)
    seconds = 60.0 if args.quick else 90.0
    with common.private_redis() as url, tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        runs: dict[Any, list[dict[str, Any]]] = {None: [], False: [], True: []}
        for n in range(0 if args.shares_only or args.realtime_only else args.repeat):  # interleaved; best kept
            for fair in runs:
                what = {None: "job B alone", False: "A then B by age", True: "A then B, fair share"}
                common.log(f"fair share: {what[fair]} ({n + 1}/{args.repeat}) ...")
                runs[fair].append(jobs_run(url, folder, f"{fair}-{n}", big, small, fair))
        rows = [] if args.shares_only or args.realtime_only else [
            min(runs[None], key=lambda r: r["b_s"]),
            *(max(runs[fair], key=lambda r: r["a_rate"]) for fair in (False, True))]
        for row in rows:
            row["b_x"] = row["b_s"] / rows[0]["b_s"]
        shares, realtime = [], []
        for shards in [] if args.realtime_only else sorted({1, args.shards}):
            for fair in (False, True):
                common.log(f"fair share: three tenants 1/1/2 and realtime beside, {shards} "
                           f"shard(s), {'fair share' if fair else 'by age'} ...")
                shares.append(shares_run(url, seconds, fair, shards))
        if not args.shares_only:
            common.log(f"fair share: realtime beside the flood, {args.shards} shard(s), {segments} segments of "
                       f"{SEGMENT_S:.0f} s switching by age / fair share ...")
            realtime = realtime_run(url, segments, args.shards)
    text = "\n\n".join(common.table(t, c) for t, c in ((shares, SHARE_COLUMNS),
                                                        (realtime, REALTIME_COLUMNS)) if t)
    checks = []
    if rows:
        fair_row, age_row = rows[2], rows[1]
        text = common.table(rows, JOB_COLUMNS) + "\n\n" + text
        checks += [
            f"B with fair share done in {fair_row['b_x']:.2f}x its time alone (by age "
            f"{age_row['b_x']:.2f}x; target < 3x): {'met' if fair_row['b_x'] < 3 else 'MISSED'}",
            f"A's lines/s with fair share {100 * (fair_row['a_rate'] / age_row['a_rate'] - 1):+.1f}% "
            f"of by age, padding efficiency "
            f"{100 * (fair_row['padding'] / age_row['padding'] - 1):+.1f}% (target within 5%)"]
    for age, fair in zip(shares[0::2], shares[1::2]):
        checks += [
            f"{fair['shards']} shard(s): weighted shares 25/25/50, worst window "
            f"{fair['worst']:.1f} points off (target within 3): "
            f"{'met' if fair['worst'] <= 3 else 'MISSED'}"]
    if realtime:
        age, fair = realtime
        verdict = ("met" if fair["high"] <= 1.1 else "MISSED" if fair["low"] > 1.1
                   else "not settled: the interval straddles 1.10")
        checks += [f"realtime p99 with fair share {fair['rt_p99']:.1f} ms, by age "
                   f"{age['rt_p99']:.1f} ms: {fair['ratio']:.2f}x, 90% interval "
                   f"{fair['interval']} (target within 10%): {verdict}"]
    print(f"\n## Fair share ({common.machine()})\n\n{text}\n\n" + "\n".join(checks) + "\n")
    common.save("fair_share", {"machine": common.machine(), "jobs": rows,
                               "runs": {str(k): v for k, v in runs.items()}, "shares": shares,
                               "realtime": realtime,
                               "targets": checks})
    return {"table": text, "targets": checks}


if __name__ == "__main__":
    main()
