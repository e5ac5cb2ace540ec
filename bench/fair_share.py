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
   BACKLOG queued), one worker; the tokens served to each per 30 s window.

``python -m bench.fair_share [--quick]``
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rq import Worker

from batchery import Client
from batchery.connection import RedisSettings
from batchery.producer.jobs import bookkeeping as jobs
from batchery.producer.jobs.cli import DEFAULT_JOBS
from bench import common

RUNNER = ("--runner", "bench.runners:padded_cost")  # and the worker's default flags
LENGTHS = (8, 128)       # tokens per request, uniform
B_DELAY_S = 2.0
WEIGHTS = {"t1": 1.0, "t2": 1.0, "t3": 2.0}
BACKLOG = 1000           # requests each tenant keeps queued in the shares run
WINDOW_S = 30.0


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


def shares_run(url: str, seconds: float, fair: bool) -> dict[str, Any]:
    """Three weighted tenants kept backlogged for ``seconds``: tokens served per window."""
    queue = f"shares-{time.monotonic_ns()}"
    worker = common.batchery_worker(url, queue, *RUNNER)
    stop = threading.Event()
    windows: list[dict[str, float]] = []
    try:
        with Client(url, queue) as client:
            client.queue.update_settings(fair_share=fair, tenant_weights=WEIGHTS)
            common.wait_until(lambda: client.queue.stats()["workers"] >= 1, 60, "the worker")
            feeder = threading.Thread(target=feed, args=(client, stop))
            feeder.start()
            last = served(client)
            for _ in range(int(seconds // WINDOW_S)):
                time.sleep(WINDOW_S)
                now = served(client)
                windows.append({t: now[t] - last[t] for t in WEIGHTS})
                last = now
            stop.set()
            feeder.join()
    finally:
        stop.set()
        common.stop([worker])
    shares = [{t: 100 * w[t] / max(1, sum(w.values())) for t in WEIGHTS} for w in windows]
    want = {t: 100 * w / sum(WEIGHTS.values()) for t, w in WEIGHTS.items()}
    worst = max(abs(s[t] - want[t]) for s in shares for t in WEIGHTS) if shares else float("nan")
    return {"scenario": "fair share" if fair else "by age", "windows": len(shares),
            **{f"share_{t}": " / ".join(f"{s[t]:.1f}" for s in shares) for t in WEIGHTS},
            "worst": worst}


def served(client: Client) -> dict[str, int]:
    loads = client.queue.first.tenant_loads()
    return {t: loads.get(t, {}).get("served_tokens", 0) for t in WEIGHTS}


def feed(client: Client, stop: threading.Event) -> None:
    """Keep each tenant BACKLOG requests queued; tenant t3 first, so that by age it leads."""
    rng = random.Random(3)
    while not stop.is_set():
        loads = client.queue.first.tenant_loads()
        for tenant in sorted(WEIGHTS, reverse=True):
            missing = BACKLOG - loads.get(tenant, {}).get("pending", 0)
            if missing > BACKLOG // 4:
                client.enqueue_many(({"input": {"n": rng.randint(*LENGTHS)}, "priority": "batch",
                                      "tenant": tenant} for _ in range(missing)), reply=False)
        stop.wait(0.2)


JOB_COLUMNS = [("scenario", "scenario", ""), ("b_s", "B done in s", ".2f"),
               ("b_x", "B vs alone", ".2f"), ("a_rate", "A lines/s", ".0f"),
               ("padding", "padding efficiency", ".3f")]
SHARE_COLUMNS = [("scenario", "scenario", ""), ("windows", "30 s windows", "d"),
                 *((f"share_{t}", f"{t} (w={w:g}) %", "") for t, w in WEIGHTS.items()),
                 ("worst", "worst gap, points", ".1f")]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
    big, small = (4000, 200) if args.quick else (20_000, 200)
    seconds = 60.0 if args.quick else 90.0
    with common.private_redis() as url, tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        runs: dict[Any, list[dict[str, Any]]] = {None: [], False: [], True: []}
        for n in range(args.repeat):  # interleaved; each scenario's best run is kept
            for fair in runs:
                what = {None: "job B alone", False: "A then B by age", True: "A then B, fair share"}
                common.log(f"fair share: {what[fair]} ({n + 1}/{args.repeat}) ...")
                runs[fair].append(jobs_run(url, folder, f"{fair}-{n}", big, small, fair))
        rows = [min(runs[None], key=lambda r: r["b_s"]),
                *(max(runs[fair], key=lambda r: r["a_rate"]) for fair in (False, True))]
        alone = rows[0]
        for row in rows:
            row["b_x"] = row["b_s"] / alone["b_s"]
        shares = []
        for fair in (False, True):
            common.log(f"fair share: three tenants 1/1/2, {'fair share' if fair else 'by age'} ...")
            shares.append(shares_run(url, seconds, fair))
    fair_row, age_row = rows[2], rows[1]
    text = common.table(rows, JOB_COLUMNS) + "\n\n" + common.table(shares, SHARE_COLUMNS)
    checks = [
        f"B with fair share done in {fair_row['b_x']:.2f}x its time alone (by age "
        f"{age_row['b_x']:.2f}x; target < 3x): {'met' if fair_row['b_x'] < 3 else 'MISSED'}",
        f"A's lines/s with fair share {100 * (fair_row['a_rate'] / age_row['a_rate'] - 1):+.1f}% of "
        f"by age, padding efficiency {100 * (fair_row['padding'] / age_row['padding'] - 1):+.1f}% "
        "(target within 5%)",
        f"weighted shares 25/25/50: worst window {shares[1]['worst']:.1f} points off "
        f"(target within 3): {'met' if shares[1]['worst'] <= 3 else 'MISSED'}"]
    print(f"\n## Fair share ({common.machine()})\n\n{text}\n\n" + "\n".join(checks) + "\n")
    common.save("fair_share", {"machine": common.machine(), "jobs": rows,
                               "runs": {str(k): v for k, v in runs.items()}, "shares": shares,
                               "targets": checks})
    return {"table": text, "targets": checks}


if __name__ == "__main__":
    main()
