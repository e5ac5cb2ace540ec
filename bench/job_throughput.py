"""Offline job throughput and the jobs worker's memory, on the queue path alone.

    python -m bench.job_throughput [--lines 20000 100000] [--workers 2] [--max-in-flight 2000]

For each size: a private redis-server, WORKERS workers with a no-op model (so the
numbers are batchery's: file, Redis, RQ, not a model), one `batchery job worker`, and
a JSONL file of short texts submitted with `batchery job submit`. Prints lines/s (RQ's
started -> ended time of the job) and the jobs worker's peak RSS (VmHWM), before and
after the job: flat memory means the peak does not grow with the file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common

ROOT = Path(__file__).resolve().parent.parent
JOB_TIMEOUT_S = 600


def peak_rss_mib(pid: int) -> float:
    """The process's high-water resident set size (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def batchery(*args: str, **popen: Any) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "batchery", *args], cwd=ROOT, **popen)


def run_one(url: str, workdir: Path, lines: int, workers: int, max_in_flight: int) -> dict[str, Any]:
    from batchery.connection import RedisSettings
    from batchery.producer.jobs import bookkeeping as jobs
    queue = f"bench-{lines}"
    source = workdir / f"in-{lines}.jsonl"
    with open(source, "w") as f:
        for i in range(lines):
            f.write(json.dumps({"custom_id": f"r{i}", "input": f"short text number {i}"}) + "\n")
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs = [batchery("worker", "--queue", queue, "--runner", "bench.runners:noop",
                      "--max-batch-size", "256", "--max-wait-ms", "2", **quiet)
             for _ in range(workers)]
    jobs_worker = batchery("job", "worker", "--jobs-queue", queue, **quiet)
    procs.append(jobs_worker)
    try:
        time.sleep(2.0)  # all started and idle
        idle_rss = peak_rss_mib(jobs_worker.pid)
        submitted = subprocess.run(
            [sys.executable, "-m", "batchery", "job", "submit", str(source), "-o", str(workdir / f"out-{lines}.jsonl"),
             "--queue", queue, "--jobs-queue", queue, "--max-in-flight", str(max_in_flight)],
            cwd=ROOT, capture_output=True, text=True, check=True)
        conn = RedisSettings.from_url(url).binary_client()
        job = jobs.fetch(conn, submitted.stdout.strip())
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while job.get_status() not in ("finished", "failed"):
            if time.monotonic() > deadline:
                raise SystemExit(f"job {job.id} did not finish in {JOB_TIMEOUT_S} s: "
                                 f"{jobs.describe(job)}")
            time.sleep(0.1)
        job.refresh()
        peak = peak_rss_mib(jobs_worker.pid)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(30)
    seconds = (job.ended_at - job.started_at).total_seconds()
    meta = job.get_meta()
    return {"lines": lines, "ok": meta["ok"], "seconds": seconds, "rate": lines / seconds,
            "idle_rss": idle_rss, "peak_rss": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, nargs="+", default=[20_000, 100_000])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-in-flight", type=int, default=2000)
    args = parser.parse_args()
    with common.private_redis() as url:
        os.environ["BATCHERY_REDIS_URL"] = url
        workdir = Path(tempfile.mkdtemp(prefix="batchery-bench-"))
        try:
            rows = [run_one(url, workdir, n, args.workers, args.max_in_flight) for n in args.lines]
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"offline job, no-op model, {args.workers} workers, max in flight {args.max_in_flight}")
    print(f"{'lines':>9} {'ok':>9} {'seconds':>9} {'lines/s':>9} {'jobs worker RSS idle':>21} "
          f"{'peak (MiB)':>11}")
    for r in rows:
        print(f"{r['lines']:>9} {r['ok']:>9} {r['seconds']:>9.2f} {r['rate']:>9.0f} "
              f"{r['idle_rss']:>21.1f} {r['peak_rss']:>11.1f}")


if __name__ == "__main__":
    main()
