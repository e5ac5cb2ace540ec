"""Runners for tests (``--runner tests.runners:NAME``): small, real, deterministic."""

from __future__ import annotations

import os
import time
from typing import Any


def echo() -> Any:
    """Returns each input's length, or the input when it is not text."""
    def run(inputs: list[Any]) -> list[Any]:
        return [{"echo": v, "n": len(inputs)} for v in inputs]
    return run


def noop() -> Any:
    def run(inputs: list[Any]) -> list[Any]:
        return [None] * len(inputs)
    run.tokens = lambda value: 1  # type: ignore[attr-defined]
    return run


def fails_on_bad() -> Any:
    """Raises for any batch holding the input "bad" (so fallback must isolate it)."""
    def run(inputs: list[Any]) -> list[Any]:
        if "bad" in inputs:
            raise RuntimeError("cannot process 'bad'")
        return [f"ok:{v}" for v in inputs]
    return run


def fails_twice_then_hangs() -> Any:
    """On the input "flaky": raises RuntimeError on its first 2 runs in this process, then
    hangs (sleeps 60 s) on the third, a worker to kill mid-batch. Others pass through."""
    runs = [0]

    def run(inputs: list[Any]) -> list[Any]:
        if "flaky" in inputs:
            runs[0] += 1
            if runs[0] <= 2:
                raise RuntimeError(f"flaky failed on run {runs[0]}")
            time.sleep(60)
        return [f"ok:{v}" for v in inputs]
    return run


def slow() -> Any:
    """Sleeps BATCHERY_TEST_SLEEP seconds per batch (default 0.5)."""
    delay = float(os.environ.get("BATCHERY_TEST_SLEEP", "0.5"))

    def run(inputs: list[Any]) -> list[Any]:
        time.sleep(delay)
        return [f"done:{v}" for v in inputs]
    return run


def oom_over_4() -> Any:
    """Raises MemoryError for batches larger than 4, like a model out of memory."""
    def run(inputs: list[Any]) -> list[Any]:
        if len(inputs) > 4:
            raise MemoryError(f"cannot allocate a batch of {len(inputs)}")
        return [len(inputs) for _ in inputs]
    return run


def timed() -> Any:
    """Sleeps BATCHERY_TEST_SLEEP seconds per batch; reports when, on which thread, and with
    how many torch threads each batch ran. With BATCHERY_TEST_MARK, a file in that folder
    marks each batch while it runs; with BATCHERY_TEST_GATE, a batch then also waits while
    that file exists."""
    import threading
    import torch
    delay = float(os.environ.get("BATCHERY_TEST_SLEEP", "0.3"))
    marks, gate = os.environ.get("BATCHERY_TEST_MARK"), os.environ.get("BATCHERY_TEST_GATE")

    def run(inputs: list[Any]) -> list[Any]:
        started = time.time()
        mark = marks and os.path.join(marks, f"{os.getpid()}-{threading.get_ident()}")
        if mark:
            open(mark, "w").close()
        time.sleep(delay)
        while gate and os.path.exists(gate):
            time.sleep(0.01)
        if mark:
            os.unlink(mark)
        ran = {"start": started, "end": time.time(), "thread": threading.current_thread().name,
               "torch_threads": torch.get_num_threads()}
        return [dict(ran, input=v) for v in inputs]
    return run


def which_gpu() -> Any:
    """Notes the GPUs its process may see (a file per process under $PIN_DIR)."""
    pins = os.environ["PIN_DIR"]
    with open(os.path.join(pins, str(os.getpid())), "w") as out:
        out.write(os.environ.get("CUDA_VISIBLE_DEVICES", "all"))
    return echo()


def gated() -> Any:
    """Holds each batch while the file $BATCHERY_TEST_GATE exists; raises for a batch that
    holds the input "bad" (so the fallback runs each alone and "bad" fails). With
    BATCHERY_TEST_MARK, creates that file when a batch starts."""
    gate, started = os.environ["BATCHERY_TEST_GATE"], os.environ.get("BATCHERY_TEST_MARK")

    def run(inputs: list[Any]) -> list[Any]:
        if started:  # the test can see that a batch is running, not only claimed
            open(started, "w").close()
        while os.path.exists(gate):
            time.sleep(0.01)
        if "bad" in inputs:
            raise RuntimeError("cannot process 'bad'")
        return [f"ok:{v}" for v in inputs]
    return run


def pauses_after() -> Any:
    """Like slow(), but once this process has run BATCHERY_TEST_PAUSE_AFTER inputs it
    creates the file $BATCHERY_TEST_GATE and holds every batch while that file exists:
    a test sees the work stop at a known point, and removes the file to go on."""
    delay = float(os.environ.get("BATCHERY_TEST_SLEEP", "0"))
    after, gate = int(os.environ["BATCHERY_TEST_PAUSE_AFTER"]), os.environ["BATCHERY_TEST_GATE"]
    seen = [0]

    def run(inputs: list[Any]) -> list[Any]:
        if seen[0] < after <= seen[0] + len(inputs):
            open(gate, "w").close()
        seen[0] += len(inputs)
        time.sleep(delay)
        while os.path.exists(gate):
            time.sleep(0.01)
        return [f"done:{v}" for v in inputs]
    return run


def flaky() -> Any:
    """Raises for a batch holding "bad" (always) or "once" (on its first run in this
    process only); the rest pass: ``"ok:" + input``."""
    seen: set[str] = set()

    def run(inputs: list[Any]) -> list[Any]:
        if "bad" in inputs:
            raise RuntimeError("cannot process 'bad'")
        if "once" in inputs and "once" not in seen:
            seen.add("once")
            raise RuntimeError("'once' fails on its first run")
        return [f"ok:{v}" for v in inputs]
    return run


class _TokenizerThreads:
    """Answers each input with the TOKENIZERS_PARALLELISM its worker runs under; placed on
    ``device`` as a built-in runner reports it (no model: the worker's choice is tested)."""

    tokenizer, max_input_tokens, warmup_inputs = "", 0, None

    def __init__(self, device: str) -> None:
        self.device = device

    def prepare(self, inputs: list[Any]) -> Any:
        from batchery.workers.runners import Prepared
        return Prepared(list(inputs), [1] * len(inputs), len(inputs))

    def run(self, data: Any) -> list[Any]:
        return [os.environ.get("TOKENIZERS_PARALLELISM")] * len(data)

    def count_tokens(self, inputs: list[Any]) -> None:
        return None

    def warmup(self) -> None:
        pass


def tokenizer_threads_on_gpu() -> Any:
    return _TokenizerThreads("cuda:0")


def tokenizer_threads_on_cpu() -> Any:
    return _TokenizerThreads("cpu")
