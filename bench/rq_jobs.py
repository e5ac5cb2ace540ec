"""RQ's side of the comparisons: job functions, and a worker with the model loaded once.

``python -m bench.rq_jobs URL QUEUE [noop|embed]`` runs an RQ ``SimpleWorker`` (no fork
per job: RQ's fastest) with the JSON serializer; with ``embed`` it loads MiniLM and runs
a warm-up before taking jobs, so no job pays for loading.
"""

from __future__ import annotations

import importlib
import os
import sys
from functools import lru_cache
from typing import Any


def noop(value: Any) -> None:
    return None


@lru_cache(maxsize=None)
def model() -> Any:
    """MiniLM, loaded once per worker process (torch threads from OMP_NUM_THREADS)."""
    import torch
    from batchery.workers.runners import load_runner
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    runner = load_runner("embed", "minilm", None, "cpu")
    runner.warmup()
    return runner


def embed(text: str) -> list[float]:
    """One request, one job: the way RQ runs a model (no batching across jobs)."""
    runner = model()
    return runner.run(runner.prepare([text]).data)[0]


def main(url: str, queue: str, task: str = "noop") -> None:
    import redis
    from rq import Queue, SimpleWorker
    from rq.serializers import JSONSerializer
    if task == "embed":  # load into the module RQ imports the job from, not into __main__
        importlib.import_module("bench.rq_jobs").model()
    conn = redis.Redis.from_url(url)
    conn.rpush(f"bench:rq-ready:{queue}", 1)
    worker = SimpleWorker([Queue(queue, connection=conn, serializer=JSONSerializer)],
                          connection=conn, serializer=JSONSerializer)
    worker.work(burst=False, logging_level="WARNING", with_scheduler=False)


if __name__ == "__main__":
    main(*sys.argv[1:])
