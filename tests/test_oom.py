"""Out of memory as torch raises it (no GPU needed: the real exception classes, raised by
the runner), told apart from other errors, and the batch cap it sets expiring."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import pytest
import torch
from prometheus_client import REGISTRY

from batchery import Client
from batchery.connection import RedisSettings
from batchery.workers.loop import Worker
from batchery.workers.options import WorkerOptions
from batchery.workers.runners.custom import CallableRunner
from tests.conftest import wait_for
from tests.test_end_to_end import run_burst


def failing_over(size: int, error: Callable[[int], BaseException]) -> Callable[[], Any]:
    def factory() -> Any:
        def run(inputs: list[Any]) -> list[Any]:
            if len(inputs) > size:
                raise error(len(inputs))
            return [len(inputs)] * len(inputs)
        return run
    return factory


def backoffs(queue: str) -> float:
    return REGISTRY.get_sample_value("batchery_oom_backoffs_total", {"queue": queue}) or 0.0


@pytest.mark.parametrize("error", [
    lambda n: torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} GiB"),
    lambda n: torch.cuda.OutOfMemoryError("allocation failed"),  # by its class alone
    lambda n: RuntimeError(f"CUDA error: out of memory (batch of {n})"),  # by its message
    lambda n: MemoryError(),
], ids=["cuda-oom", "cuda-oom-class-only", "runtime-error-message", "memory-error"])
def test_out_of_memory_is_recognised_and_halves_the_batch(redis_url: str, queue_name: str,
                                                          error: Callable) -> None:
    before = backoffs(queue_name)
    with Client(redis_url, queue_name) as client:
        handles = client.enqueue_many([{"input": i} for i in range(16)])
        run_burst(redis_url, queue_name, failing_over(4, error), max_batch_size=16)
        results = [h.result(timeout=30) for h in handles]
    assert {r.status for r in results} == {"ok"} and {r.attempts for r in results} == {1}
    assert {r.batch_size for r in results} == {4}  # 16 -> 8 -> 4: halved, not run alone
    assert backoffs(queue_name) - before == 2  # the 16, then the first 8 (the cap splits the other)


def test_another_runtime_error_is_not_taken_for_out_of_memory(redis_url: str,
                                                             queue_name: str) -> None:
    before = backoffs(queue_name)
    with Client(redis_url, queue_name) as client:
        handles = client.enqueue_many([{"input": i} for i in range(8)])
        run_burst(redis_url, queue_name,
                  failing_over(4, lambda n: RuntimeError("shape mismatch in batch")),
                  max_batch_size=8)
        results = [h.result(timeout=30) for h in handles]
    # bisected (8 -> 4 + 4, which pass), but not counted nor capped as out of memory
    assert {r.batch_size for r in results} == {4} and all(r.ok for r in results)
    assert backoffs(queue_name) == before


def after_an_oom(redis_url: str, queue_name: str, hold_s: float, then: Callable[[Client], None]
                 ) -> None:
    """A worker whose model runs out of memory on batches over 4 until the first 16
    requests ran (halved, 4 at a time); then the memory is back and ``then(client)`` runs
    against the worker with its cap of 4 held for ``hold_s`` from the last OOM."""
    oom = threading.Event()
    oom.set()

    def run(inputs: list[Any]) -> list[Any]:
        if oom.is_set() and len(inputs) > 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return inputs

    worker = Worker(RedisSettings.from_url(redis_url), CallableRunner(run),
                    WorkerOptions(queue=queue_name, max_batch_size=16, max_wait_ms=0,
                                  oom_hold_s=hold_s))
    thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
    thread.start()
    try:
        with Client(redis_url, queue_name) as client:
            first = client.enqueue_many([{"input": i} for i in range(16)])
            assert {h.result(timeout=30).batch_size for h in first} == {4}
            oom.clear()  # the memory is back; the cap still holds for hold_s
            then(client)
    finally:
        worker.stop.set()
        thread.join(30)


def test_the_batch_cap_lasts_its_hold(redis_url: str, queue_name: str) -> None:
    """Within the hold (an hour: it cannot lapse during the test) batches stay capped."""
    def capped(client: Client) -> None:
        second = client.enqueue_many([{"input": i} for i in range(16)])
        assert {h.result(timeout=30).batch_size for h in second} == {4}
    after_an_oom(redis_url, queue_name, 3600, capped)


def test_the_batch_cap_lifts_after_its_hold(redis_url: str, queue_name: str) -> None:
    """Once the hold has passed, whole batches run again."""
    def lifted(client: Client) -> None:
        passed = time.monotonic() + 0.5  # the hold, counted from after the last OOM
        wait_for(lambda: time.monotonic() > passed, 30, message="the hold to pass")
        third = client.enqueue_many([{"input": i} for i in range(16)])
        assert {h.result(timeout=30).batch_size for h in third} == {16}
    after_an_oom(redis_url, queue_name, 0.5, lifted)
