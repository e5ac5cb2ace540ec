"""What the dashboard shows, read from Redis: queues, workers, dead letters, offline jobs.

No web framework here: :class:`Board` returns plain JSON-ready dicts (``/api/state``
serves them as they are, the page renders them), so it is tested against Redis alone.
Every read goes through :class:`ShardedQueue` and the jobs module, the owners of the keys.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import redis

from batchery.batching.inspection import OLDEST_LOOKAHEAD
from batchery.batching.sharded import ShardedQueue, open_queue
from batchery.batching.settings import DEFAULT_CLASS_DELAYS
from batchery.config import JOBS_QUEUE
from batchery.connection import RedisSettings
from batchery.errors import BatcheryError
from batchery.producer.jobs import bookkeeping as jobs

HISTORY_S = 15 * 60      # the depth chart's window: long enough to see a trend at night
SAMPLE_S = 2.0           # one depth sample per queue this often
RATE_WINDOW_S = 60.0     # requests/s over the last minute
DONE = ("ok", "error", "expired", "dead")  # running totals of requests that ended
FAILED = ("error", "dead")
RECENT_FAILURE_S = 3600  # a job that failed within the hour is an alert; older, a table row


@dataclass(frozen=True)
class Options:
    """What the dashboard reads and shows."""

    jobs_queue: str = JOBS_QUEUE
    show_payloads: bool = False   # request inputs are users' data: hidden unless asked for
    dead_limit: int = 50          # newest dead letters shown per queue
    jobs_limit: int = jobs.JOBS_SHOWN  # newest offline jobs shown


class History:
    """Recent samples per queue (time, pending, in flight, requests ended, failed), kept in
    this process only: the chart covers the dashboard's own lifetime, up to HISTORY_S."""

    def __init__(self) -> None:
        self._samples: dict[str, deque[tuple[float, int, int, int, int]]] = {}
        self._lock = threading.Lock()

    def add(self, queue: str, stats: dict[str, Any], at: float | None = None) -> None:
        totals = stats.get("totals", {})
        sample = (time.time() if at is None else at, stats["pending"], stats["inflight"],
                  sum(totals.get(k, 0) for k in DONE), sum(totals.get(k, 0) for k in FAILED))
        with self._lock:
            samples = self._samples.setdefault(queue, deque(maxlen=int(HISTORY_S / SAMPLE_S) + 1))
            samples.append(sample)

    def of(self, queue: str) -> list[tuple[float, int, int, int, int]]:
        with self._lock:
            return list(self._samples.get(queue, ()))

    def rates(self, queue: str) -> tuple[float | None, float | None]:
        """(requests ended per second, failed per minute) over the last RATE_WINDOW_S."""
        samples = self.of(queue)
        if len(samples) < 2:
            return None, None
        last = samples[-1]
        first = next((s for s in samples if last[0] - s[0] <= RATE_WINDOW_S), samples[0])
        span = last[0] - first[0]
        if span <= 0:
            return None, None
        return (round(max(0, last[3] - first[3]) / span, 1),
                round(max(0, last[4] - first[4]) * 60 / span, 1))


class Board:
    """Reads the whole picture; one per dashboard process (its Redis clients are shared)."""

    def __init__(self, settings: RedisSettings, options: Options = Options()) -> None:
        self.settings, self.options = settings, options
        self.client = settings.client()
        self.history = History()
        self._rq: redis.Redis | None = None
        self._rq_error = ""
        try:
            self._rq = settings.binary_client()  # RQ's jobs need bytes replies
        except BatcheryError as exc:  # a Cluster: no RQ jobs there
            self._rq_error = str(exc)

    def close(self) -> None:
        self.client.close()
        if self._rq is not None:
            self._rq.close()

    def queue(self, name: str) -> ShardedQueue:
        return open_queue(self.client, name)

    def queue_names(self) -> list[str]:
        return ShardedQueue.known_queues(self.client)

    def sample(self) -> dict[str, dict[str, Any]]:
        """Every queue's `batchery queue stats` numbers, recorded in the history."""
        stats = {name: self.queue(name).stats() for name in self.queue_names()}
        for name, s in stats.items():
            self.history.add(name, s)
        return stats

    def state(self) -> dict[str, Any]:
        """Everything the page shows; ``queues`` holds `batchery queue stats --json`'s numbers."""
        stats = {name: self.queue(name).stats() for name in self.queue_names()}
        queues = {name: self._queue_view(name, s) for name, s in stats.items()}
        workers = [w for view in queues.values() for w in view.pop("worker_list")]
        dead = {name: view.pop("dead_letters") for name, view in queues.items()}
        found_jobs, jobs_error = self._jobs()
        return {"at": time.time(), "redis": self.settings.describe(), "queues": queues,
                "workers": workers, "dead_letters": dead, "jobs": found_jobs,
                "jobs_error": jobs_error, "show_payloads": self.options.show_payloads,
                "alerts": alerts(queues, workers, found_jobs)}

    def _queue_view(self, name: str, stats: dict[str, Any]) -> dict[str, Any]:
        q = self.queue(name)
        settings = q.settings()
        now_ms, looked_at, oldest = q.oldest(list(stats["pending_by_priority"]))
        rate, failed_per_min = self.history.rates(name)
        _, workers = q.worker_reports()
        return {**stats, "rate": rate, "failed_per_min": failed_per_min,
                "oldest_s": {c: round((now_ms - ms) / 1000, 1) for c, ms in oldest.items()},
                "oldest_looked_at": looked_at,
                "oldest_complete": looked_at < OLDEST_LOOKAHEAD,
                "class_delays": {c: settings.class_delays.get(c, DEFAULT_CLASS_DELAYS.get(c))
                                 for c in stats["pending_by_priority"]},
                "history": [[round(t, 1), p, i] for t, p, i, _, _ in self.history.of(name)],
                "worker_list": [worker_view(name, w, now_ms) for w in workers],
                "dead_letters": self._dead(q)}

    def _dead(self, q: ShardedQueue) -> list[dict[str, Any]]:
        results = q.dead(self.options.dead_limit)
        inputs = q.inputs([r.id for r in results]) if self.options.show_payloads else []
        rows = [{"id": r.id, "attempts": r.attempts, "error_type": (r.error or {}).get("type", ""),
                 "error": (r.error or {}).get("message", "")} for r in results]
        for row, value in zip(rows, inputs):
            row["input"] = value
        return rows

    def _jobs(self) -> tuple[list[dict[str, Any]], str]:
        if self._rq is None:
            return [], self._rq_error
        found = []
        for job in jobs.recent(self._rq, self.options.jobs_queue, self.options.jobs_limit):
            view = jobs.describe(job)
            total, done = view["total"], view["ok"] + view["error"]
            view["progress"] = round(done / total, 4) if total else (1.0 if view["state"] ==
                                                                     jobs.FINISHED else None)
            found.append(view)
        return found, ""

    def rq(self) -> redis.Redis:
        if self._rq is None:
            raise BatcheryError(self._rq_error)
        return self._rq


def worker_view(queue: str, info: dict[str, Any], now_ms: int) -> dict[str, Any]:
    """A worker's row: its report, with means and ages worked out."""
    runs, requests = int(info.get("runs", 0)), int(info.get("requests", 0))
    tokens, padded = int(info.get("tokens", 0)), int(info.get("padded", 0))
    last_claim = int(info.get("last_claim_ms", 0))
    return {"id": info["id"], "queue": queue, "live": info["live"],
            "model": info.get("model", ""), "device": info.get("device", ""),
            "batches": runs, "requests": requests,
            "mean_batch": round(requests / runs, 1) if runs else None,
            "padding_efficiency": round(tokens / padded, 3) if padded else None,
            "inflight": int(info.get("inflight", 0)),
            "last_claim_s": round((now_ms - last_claim) / 1000, 1) if last_claim else None,
            "seen_s": round((now_ms - info["seen_ms"]) / 1000, 1)}


def alerts(queues: dict[str, Any], workers: list[dict[str, Any]],
           found_jobs: list[dict[str, Any]]) -> list[str]:
    """What needs a person, worst first."""
    out = []
    for name, q in queues.items():
        if q["pending"] and not q["workers"]:
            out.append(f"queue {name}: {q['pending']} pending and no live worker")
        if q["paused"]:
            out.append(f"queue {name} is paused (`batchery queue resume {name}`)")
    out += [f"worker {w['id']} ({w['queue']}) stopped renewing {w['seen_s']:.0f}s ago"
            for w in workers if not w["live"]]
    out += [f"queue {name}: {q['dead']} dead letter(s)" for name, q in queues.items() if q["dead"]]
    for job in found_jobs:
        if job["state"] == jobs.FAILED and _within(job.get("ended_at"), RECENT_FAILURE_S):
            out.append(f"job {job['id']} failed: {job.get('failure') or 'see rq info'}")
        elif job.get("stale_s"):
            out.append(f"job {job['id']} silent for {job['stale_s']}s: its jobs worker may be gone")
    return out


def _within(iso: str | None, seconds: float) -> bool:
    try:
        return bool(iso) and time.time() - datetime.fromisoformat(str(iso)).timestamp() < seconds
    except ValueError:
        return False
