"""The worker: the model loop, and the threads that feed it and write behind it.

Threads: the claimer claims and tokenizes the next batch; the main thread runs the
model; the writer commits results; the heartbeat renews leases and reaps. SIGTERM (or
a first SIGINT) finishes the running batch, returns prefetched claims, and exits 0; a
second one stops at once (leases cover what was in hand).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from typing import Any, Callable


from batchery.batching.sharded import ShardedQueue, open_queue
from batchery.connection import RedisSettings, retrying
from batchery.workers import metrics, tracing
from batchery.workers.claiming import DRAINED, Claimer
from batchery.workers.execution import BatchCap, Executed, Executor, Outcome
from batchery.workers.leases import Heartbeat, Leases
from batchery.workers.options import WorkerOptions
from batchery.workers.results import ResultWriter
from batchery.workers.runners import Runner

log = logging.getLogger(__name__)
EXIT_NOW = 130  # a second Ctrl-C: the shell's code for a process stopped by SIGINT


class Worker:
    def __init__(self, redis_settings: RedisSettings, runner: Runner,
                 options: WorkerOptions | None = None) -> None:
        self.redis_settings = redis_settings
        self.runner = runner
        self.options = options or WorkerOptions()
        self.id = self.options.worker_id
        self.stop = threading.Event()
        self.batches_run = 0  # batches (generate: decode steps) the model ran
        # model runs, requests, real and padded tokens, last claim (Redis ms): the dashboard's
        self.ran = {"runs": 0, "requests": 0, "tokens": 0, "padded": 0, "last_claim_ms": 0}
        self._count_lock = threading.Lock()
        self._started = time.time()

    def run(self, burst: bool = False, handle_signals: bool = True) -> int:
        """Serve the queue until stopped (or, with ``burst``, until it is drained)."""
        client = self.redis_settings.client()
        metrics.bind(self.options.queue)
        queue_ = None
        try:
            queue_ = open_queue(client, self.options.queue)
            self._announce(queue_)
            self.runner.warmup()
            restore = self._install_signals() if handle_signals else None
            try:
                self._serve(queue_, burst)
            finally:
                if restore:
                    restore()
        finally:
            if queue_ is not None:
                queue_.stop_waking()
            client.close()
        return 0

    # the claimer claims ahead on its own thread; the generate worker claims between steps
    claims_ahead = True

    def _serve(self, queue_: ShardedQueue, burst: bool) -> None:
        """The threads every worker runs (leases, writer, heartbeat, claimer) around its
        model loop (``_work``), and their orderly end: prefetched claims go back, results
        are written, the worker leaves the registry."""
        leases, cap = Leases(), BatchCap(self.options.oom_hold_s)
        writer = ResultWriter(queue_, self.id, leases, self._on_committed(queue_))
        heartbeat = Heartbeat(queue_, self.id, leases, self.stop, self.info)
        claimer = Claimer(queue_, self.runner, self.options, leases, cap, writer.submit,
                          self.stop, burst)
        retrying(heartbeat.beat)  # registers the worker before its first claim
        threads = (writer, heartbeat, claimer) if self.claims_ahead else (writer, heartbeat)
        for thread in threads:
            thread.start()
        try:
            self._work(queue_, claimer, writer, cap, burst)
        finally:
            self.stop.set()
            if self.claims_ahead:
                claimer.join()
            leftovers = [r for b in claimer.leftovers() for r in b.requests]
            if leftovers:
                retrying(lambda: queue_.release([(r.id, r.lease_token) for r in leftovers]))
                leases.drop(r.id for r in leftovers)
                tracing.released(leftovers, "the worker stopped before running it")
                log.info("returned %d prefetched request(s) to the queue", len(leftovers))
            writer.close()
            heartbeat.join()
            retrying(lambda: queue_.leave(self.id))
        log.info("worker %s stopped after %d batches", self.id, self.batches_run)

    def _on_committed(self, queue_: ShardedQueue) -> Callable[[list[Outcome]], None] | None:
        """What the writer does after committing results (nothing, for whole batches)."""
        return None

    def _work(self, queue_: ShardedQueue, claimer: Claimer, writer: ResultWriter,
              cap: BatchCap, burst: bool) -> None:
        """Run the batches the claimer prepares until stopped (or the burst is drained)."""
        executor = Executor(self.runner, cap)
        log.info("worker %s serving queue %r", self.id, queue_.name)
        extra = [threading.Thread(target=self._run_batches, args=(claimer, executor, writer),
                                  name=f"batchery-model-{i}", daemon=True)
                 for i in range(1, self.options.parallel_batches)]
        for thread in extra:
            thread.start()
        self._run_batches(claimer, executor, writer)
        self.stop.set()
        for thread in extra:
            thread.join()

    def _run_batches(self, claimer: Claimer, executor: Executor, writer: ResultWriter) -> None:
        """Take prepared batches and run them until stopped (one such loop per parallel batch)."""
        try:
            while not self.stop.is_set():
                try:
                    batch = claimer.take(timeout=0.2)
                except queue.Empty:
                    continue
                if batch is DRAINED:
                    return
                executed = executor.run(batch)
                writer.submit(executed)
                with self._count_lock:
                    self.batches_run += 1
                self._tally(executed)
        except BaseException:
            self.stop.set()  # a bug, not a failed batch (the executor catches those): stop all
            raise

    def _tally(self, executed: Executed) -> None:
        for run in executed.runs:
            self.count(runs=1, requests=run.size, tokens=run.tokens, padded=run.padded)
        self.count(claimed_ms=executed.claimed_ms)

    def count(self, runs: int = 0, requests: int = 0, tokens: int = 0, padded: int = 0,
              claimed_ms: int = 0) -> None:
        """Add to what the heartbeat reports: model runs, requests finished, real and
        padded tokens through the model, the last claim (Redis ms)."""
        with self._count_lock:
            ran = self.ran
            ran["runs"] += runs
            ran["requests"] += requests
            ran["tokens"] += tokens
            ran["padded"] += padded
            ran["last_claim_ms"] = max(ran["last_claim_ms"], claimed_ms)

    def info(self) -> dict[str, Any]:
        """What the heartbeat reports for `batchery dashboard`."""
        with self._count_lock:
            ran = dict(self.ran)
        return {"model": self.options.model, "device": str(getattr(self.runner, "device", "")),
                "max_batch_size": self.options.max_batch_size,
                "parallel_batches": self.options.parallel_batches,
                "started": round(self._started), **ran}

    def _announce(self, queue_: ShardedQueue) -> None:
        """Register the queue and tell producers how this model counts tokens."""
        def announce() -> None:
            queue_.register()
            tokenizer = getattr(self.runner, "tokenizer", "")
            if not tokenizer:
                return
            settings = queue_.announce_tokenizer(tokenizer, self.runner.max_input_tokens)
            if (settings.tokenizer, settings.max_input_tokens) != (tokenizer, self.runner.max_input_tokens):
                log.warning("queue %r counts tokens with %r (max %d), set before this worker; "
                            "this worker's model uses %r (max %d) and prices estimated requests "
                            "with it. Change it with `batchery queue config %s --tokenizer "
                            "... --max-input-tokens N` if it is wrong", queue_.name,
                            settings.tokenizer, settings.max_input_tokens, tokenizer,
                            self.runner.max_input_tokens, queue_.name)
        retrying(announce)

    def _install_signals(self) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return None

        def on_signal(signum: int, _frame: Any) -> None:
            if self.stop.is_set():
                os.write(2, f"second {signal.Signals(signum).name}: stopping at once\n".encode())
                os._exit(EXIT_NOW)
            self.stop.set()
            log.info("%s: finishing the current batch, then exiting", signal.Signals(signum).name)

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        return lambda: [signal.signal(s, h) for s, h in previous.items()]
