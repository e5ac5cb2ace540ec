"""Running a batch: a failed batch is halved until the failing requests stand alone (and
batches are capped a while after out of memory)."""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from batchery.batching.messages import Claimed
from batchery.workers import metrics, tracing
from batchery.workers.runners import InputError, Prepared, Runner

log = logging.getLogger(__name__)
MAX_ERROR_CHARS = 2000  # an error's message as stored: the cause, not a 1 MB traceback per request


@dataclass
class Batch:
    """Claimed requests, prepared for the model (or the error preparing them raised)."""

    requests: list[Claimed]
    claimed_ms: int                    # Redis clock at claim, for queued_ms
    prepared: Prepared | None = None
    error: BaseException | None = None


@dataclass
class Outcome:
    """What became of one request in a run."""

    request: Claimed
    output: Any = None
    error: dict[str, str] | None = None  # {"type", "message"}
    retry: bool = False                 # another attempt may succeed (not an input error)
    expired: bool = False
    batch_size: int = 0
    run_ms: float = 0.0


class ModelRun(NamedTuple):
    """One call of the model: a batch, or a request alone after its batch failed."""

    size: int      # requests
    tokens: int    # real tokens
    padded: int    # tokens with padding (longest x size)


@dataclass
class Executed:
    claimed_ms: int
    outcomes: list[Outcome]
    runs: list[ModelRun] = field(default_factory=list)


class BatchCap:
    """Adaptive back-off after out of memory: batches stay halved for a while."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self._limit: int | None = None
        self._until = 0.0
        self._lock = threading.Lock()

    def shrink(self, failed_size: int) -> None:
        with self._lock:
            half = max(1, failed_size // 2)
            self._limit = half if self._limit is None else min(self._limit, half)
            self._until = time.monotonic() + self.hold_s

    def apply(self, size: int) -> int:
        with self._lock:
            if self._limit is None:
                return size
            if time.monotonic() >= self._until:
                self._limit = None
                return size
            return min(size, self._limit)


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA OOM (torch.cuda.OutOfMemoryError, or its RuntimeError message) or MemoryError."""
    return (isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
            or (isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()))


class Executor:
    def __init__(self, runner: Runner, cap: BatchCap) -> None:
        self.runner = runner
        self.cap = cap

    def run(self, batch: Batch) -> Executed:
        executed = Executed(batch.claimed_ms, [])
        executed.outcomes = self._attempt(batch.requests, executed, batch.prepared, batch.error)
        return executed

    def _attempt(self, requests: list[Claimed], executed: Executed,
                 prepared: Prepared | None = None, error: BaseException | None = None) -> list[Outcome]:
        limit = self.cap.apply(len(requests))
        if limit < len(requests):  # claimed before an out of memory: run it in capped pieces
            return [o for i in range(0, len(requests), limit)
                    for o in self._attempt(requests[i:i + limit], executed)]
        if error is None:
            try:
                if prepared is None:
                    with tracing.tokenize(requests):
                        prepared = self.runner.prepare([r.input for r in requests])
                return self._run(requests, prepared, executed)
            except Exception as exc:  # the runner is user code: anything can come out
                error = exc
        if len(requests) == 1:
            return [failure(requests[0], error)]
        # A shared step failed: the requests that cause it are found by bisection, each
        # half run on its own, so one bad request in 64 costs 2 x 6 runs, not 64, and
        # its batch-mates finish in the halves that pass.
        if is_out_of_memory(error):
            log.warning("out of memory on a batch of %d: halving it, and capping batches for "
                        "%.0fs", len(requests), self.cap.hold_s)
            metrics.OOM_BACKOFFS.inc()
            self.cap.shrink(len(requests))
            _free_memory()
        else:
            log.info("batch of %d failed (%s: %s); running each half on its own",
                     len(requests), type(error).__name__, _message(error)[:200])
        half = len(requests) // 2
        return self._attempt(requests[:half], executed) + self._attempt(requests[half:], executed)

    def _run(self, requests: list[Claimed], prepared: Prepared, executed: Executed) -> list[Outcome]:
        started = time.perf_counter()
        with tracing.model_run(requests, prepared, self.runner):
            outputs = self.runner.run(prepared.data)
            if len(outputs) != len(requests):
                raise RuntimeError(f"the runner returned {len(outputs)} outputs for {len(requests)} inputs")
        seconds = time.perf_counter() - started
        size, tokens = len(requests), sum(prepared.lengths)
        executed.runs.append(ModelRun(size, tokens, prepared.padded))
        metrics.BATCH_SIZE.observe(size)
        metrics.BATCH_TOKENS.observe(prepared.padded)
        metrics.PADDING.observe(prepared.efficiency)
        metrics.INFERENCE.observe(seconds)
        run_ms = round(seconds * 1000, 3)
        return [Outcome(r, output=o, batch_size=size, run_ms=run_ms) for r, o in zip(requests, outputs)]


def failure(request: Claimed, exc: BaseException) -> Outcome:
    error = {"type": type(exc).__name__, "message": _message(exc)[:MAX_ERROR_CHARS]}
    return Outcome(request, error=error, retry=not isinstance(exc, InputError), batch_size=1)


def _message(exc: BaseException) -> str:
    return str(exc) or repr(exc)


def _free_memory() -> None:
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
