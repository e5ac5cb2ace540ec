"""The generate worker: continuous batching (iteration-level scheduling, as in Orca)
fed from the prioritized queue.

The model thread keeps a token budget of sequences in flight (``--max-batch-tokens``:
each sequence reserves its prompt plus its ``max_new_tokens`` of KV cache, and at most
``--max-batch-size`` run at once). After every decode step it claims from Redis into the
room that is free, by the same claim script (priority with aging) as batch workers, so
a realtime arrival is prefilled and joins at the next step. A sequence that finishes
(EOS, a stop string, max_new_tokens), is cancelled or passes its deadline leaves at
once; its result is committed by the ResultWriter while the batch decodes on.

The decoding is batchery's own loop on transformers' DynamicCache, not transformers'
ContinuousBatchingManager: runners/decoding.py says why.

Leases: the heartbeat renews them while sequences run; between steps (every 50 ms,
workers/decode_loop.py) the worker checks it still holds them, so a cancelled request
stops within a step or two and frees its room. A claimed request with no room yet (the
claim always takes the head, whatever its size) waits in ``waiting`` under its lease.

SIGTERM: stop claiming, hand waiting requests back to the queue, finish every running
sequence (a sequence has at most 1024 new tokens left: seconds), commit, exit 0. A
second signal exits at once; the leases lapse and the reaper queues those sequences
again (rerun from the start; their streams say "restarted").
"""

from __future__ import annotations

import logging

from batchery.batching.queue import RequestQueue
from batchery.batching.streams import StreamWriter
from batchery.workers.claiming import Claimer
from batchery.workers.decode_loop import DecodeLoop
from batchery.workers.execution import BatchCap, Outcome
from batchery.workers.leases import Heartbeat, Leases
from batchery.workers.loop import Worker, _retrying
from batchery.workers.results import ResultWriter

log = logging.getLogger(__name__)


class GenerateWorker(Worker):
    """``--task generate``: the Worker's signals, announce and shutdown, with the model
    thread running a decode loop instead of whole batches."""

    def _serve(self, queue_: RequestQueue, burst: bool) -> None:
        leases = Leases()
        ends = StreamWriter(queue_.client, queue_.keys)  # the writer thread's own
        writer = ResultWriter(queue_, self.id, leases, lambda done: _end_streams(ends, done))
        heartbeat = Heartbeat(queue_, self.id, leases, self.stop)
        claimer = Claimer(queue_, self.runner, self.options, leases,
                          BatchCap(self.options.oom_hold_s), writer.submit, self.stop, burst)
        _retrying(heartbeat.beat)
        writer.start()
        heartbeat.start()
        log.info("worker %s generating from queue %r: up to %d sequences, %d tokens of cache",
                 self.id, queue_.name, self.options.max_batch_size, self.options.max_batch_tokens)
        self.loop = loop = DecodeLoop(queue_, self.runner, claimer, leases, writer, self.options)
        loop.run(self.stop, burst)
        writer.close()
        self.stop.set()
        heartbeat.join()
        _retrying(lambda: queue_.leave(self.id))
        self.batches_run = loop.batch.steps
        log.info("worker %s stopped after %d decode steps", self.id, loop.batch.steps)


def _end_streams(ends: StreamWriter, committed: list[Outcome]) -> None:
    """End the streams of committed results: their readers read the result next."""
    for o in committed:
        if isinstance(o.request.input, dict) and o.request.input.get("stream") is True:
            reason = o.output.get("finish_reason", "") if isinstance(o.output, dict) else "error"
            ends.end(o.request.id, reason)
    ends.flush()


