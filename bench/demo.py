"""`make demo`: the packaged MiniLM model over a few thousand real paragraphs, as an offline job.

Starts the embedded Redis, a MiniLM worker with no tuning flags (on a CPU it runs one
batch per core) and a jobs worker; writes the paragraphs
to a JSONL file (all three priority classes), submits it with `batchery job submit`, follows
it with `batchery job status JOB --watch`, and ends with a table: throughput, batch size,
padding, waits per class.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("BATCHERY_HOME", str(ROOT / ".batchery"))  # the demo's own Redis

from batchery.batching.sharded import ShardedQueue, open_queue  # noqa: E402  (after BATCHERY_HOME is set)
from batchery.connection import RedisSettings  # noqa: E402
from batchery.producer.jobs import bookkeeping as jobs  # noqa: E402
from bench.corpus import paragraphs  # noqa: E402

QUEUE = "demo"
N_REQUESTS = 3000
WORKERS = 1
MIX = (("realtime", 0.1), ("normal", 0.3), ("batch", 0.6))
OUT = ROOT / "bench" / "out"
ENV = dict(os.environ, HF_HUB_OFFLINE="1", BATCHERY_LOG_LEVEL="WARNING")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def batchery(*args: str) -> list[str]:
    return [sys.executable, "-m", "batchery", *args]


def start_workers() -> list[subprocess.Popen]:
    cmd = batchery("worker", "--queue", QUEUE, "--task", "embed", "--model", "minilm")
    return [subprocess.Popen(cmd, env=ENV) for _ in range(WORKERS)] + [
        subprocess.Popen(batchery("job", "worker"), env=ENV)]


def reset(queue: ShardedQueue) -> None:
    for key in queue.client.scan_iter(f"*{{{QUEUE}}}*"):
        queue.client.delete(key)


def write_requests(path: Path) -> dict[str, str]:
    """The paragraphs as JSONL lines, classes interleaved; returns custom_id -> class."""
    texts = paragraphs(N_REQUESTS)
    classes = [c for c, share in MIX for _ in range(int(share * N_REQUESTS))]
    classes += ["batch"] * (len(texts) - len(classes))
    order = {f"p{i}": classes[(i * 7919) % len(classes)] for i in range(len(texts))}
    with open(path, "w", encoding="utf-8") as f:
        for (custom_id, priority), text in zip(order.items(), texts):
            f.write(json.dumps({"custom_id": custom_id, "input": text, "priority": priority}) + "\n")
    return order


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    source, output = OUT / "demo-requests.jsonl", OUT / "demo-results.jsonl"
    order = write_requests(source)
    settings = RedisSettings.from_url(None)
    queue = open_queue(settings.client(), QUEUE)
    reset(queue)
    print(f"redis: embedded ({os.environ['BATCHERY_HOME']}); {len(order)} paragraphs in "
          f"{source.relative_to(ROOT)}; starting a worker with the packaged all-MiniLM-L6-v2 "
          "(no tuning flags) and a jobs worker ...", file=sys.stderr)
    procs = start_workers()
    try:
        wait_live(queue)
        submit = batchery("job", "submit", str(source), "-o", str(output), "--queue", QUEUE,
                          "--max-in-flight", str(N_REQUESTS), "--overwrite")
        print("$ batchery " + " ".join(submit[3:]), file=sys.stderr)
        job_id = subprocess.run(submit, env=ENV, check=True, capture_output=True,
                                text=True).stdout.strip()
        print(f"$ batchery job status {job_id} --watch", file=sys.stderr)
        watched = subprocess.run(batchery("job", "status", job_id, "--watch"), env=ENV,
                                 stdout=subprocess.PIPE, text=True)
        if watched.returncode != 0:
            raise SystemExit(f"the job did not finish:\n{watched.stdout}")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(60)
    job = jobs.fetch(settings.binary_client(), job_id)
    seconds = (job.ended_at - job.started_at).total_seconds()
    report(queue.stats()["totals"], output, order, seconds)


def wait_live(queue: ShardedQueue) -> None:
    deadline = time.monotonic() + 120
    while queue.stats()["workers"] < WORKERS:
        if time.monotonic() > deadline:
            raise SystemExit("workers did not start within 120 s")
        time.sleep(0.2)


def report(totals: dict[str, int], output: Path, order: dict[str, str], seconds: float) -> None:
    waits: dict[str, list[float]] = defaultdict(list)
    ok = 0
    with open(output, encoding="utf-8") as f:
        for line in map(json.loads, f):
            waits[order[line["custom_id"]]].append(line["queued_ms"])
            ok += line["status"] == "ok"
    n = sum(len(w) for w in waits.values())
    print()
    print(f"{n} requests ({ok} ok) through {WORKERS} worker(s) in {seconds:.1f} s "
          f"(results: {output.relative_to(ROOT)})")
    print(f"{'requests/s':<28}{n / seconds:>10.1f}")
    print(f"{'mean batch size':<28}{totals['ok'] / max(1, totals['batches']):>10.1f}")
    print(f"{'padding efficiency':<28}{totals['tokens'] / max(1, totals['padded_tokens']):>10.1%}")
    for priority, _ in MIX:
        w = waits[priority]
        print(f"{'wait p50 / p99 ' + priority + ' (ms)':<28}{percentile(w, 0.5):>10.0f} / "
              f"{percentile(w, 0.99):.0f}")


if __name__ == "__main__":
    main()
