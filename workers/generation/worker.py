"""The generate worker: continuous batching (iteration-level scheduling, as in Orca)
fed from the prioritized queue.

The model thread keeps a token budget of sequences in flight (``--max-batch-tokens``:
each sequence reserves its prompt plus its ``max_new_tokens`` of KV cache, and at most
``--max-batch-size`` run at once). After every decode step it claims from Redis into the
room that is free, by the same claim script (priority with aging) as batch workers, so
a realtime arrival is prefilled and joins at the next step. A long prompt is prefilled a
chunk at a time (``prefill_chunk_tokens`` per step), between the running sequences'
decode steps, unless it is more urgent than every decoding row: then it is prefilled
whole (a decode step between its chunks would delay its first token by a step each).
Requests sharing a prompt prefix reuse its KV from the prefix cache (generation/prefix_cache.py;
``--prefix-cache-tokens``), and newcomers claimed together prefill a shared prefix once.
When the worker is full and the queue's head is more urgent than a running
sequence, the least urgent running ones are preempted: their cache is freed (after the
newcomer's first token: the cut copies the cache) and they wait, still leased to this worker, to be prefilled again from their prompt and the
tokens they had generated (recompute, as vLLM does), so their streams go on where they
were and nothing they generated is lost. A sequence that finishes (EOS, a stop string,
max_new_tokens), is cancelled or passes its deadline leaves at once; its result is
committed by the ResultWriter while the batch decodes on.

The decoding is batchery's own loop on transformers' DynamicCache, not transformers'
ContinuousBatchingManager: generation/batch.py says why.

Leases: the heartbeat renews them while sequences run; a thread of the loop's own
(workers/generation/lookout.py) reads every 50 ms who holds them, and the queue's head every 20 ms,
off the step's path; between steps the loop stops what it no longer holds, so a
cancelled request stops within a step or two and frees its room. A claimed request with no room yet (the
claim always takes the head, whatever its size) waits in ``waiting`` under its lease.

SIGTERM: stop claiming, hand requests claimed but never started back to the queue,
finish every started sequence (preempted ones included; a sequence has at most 1024 new
tokens left: seconds), commit, exit 0. A second signal exits at once; the leases lapse
and the reaper queues those sequences again (rerun from the start; their streams say
"restarted").
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any, Callable

import torch

from batchery.batching.sharded import ShardedQueue
from batchery.batching.streams import StreamWriter
from batchery.workers.claiming import Claimer
from batchery.workers.generation import prefix_cache
from batchery.workers.generation.engine import EngineRunner
from batchery.workers.generation.engine_loop import EngineLoop
from batchery.workers.generation.loop import DecodeLoop
from batchery.workers.execution import BatchCap, Outcome
from batchery.workers.loop import Worker
from batchery.workers.options import ACCELERATOR_SEQUENCES, CPU_SEQUENCES, WorkerOptions
from batchery.workers.results import ResultWriter

log = logging.getLogger(__name__)
# Share of the memory free after loading the model that the KV cache may take: room
# for activations, the prefill's own cache and the copies made when rows join.
CACHE_MEMORY_SHARE = 0.5


class GenerateWorker(Worker):
    """``--task generate``: the Worker's threads, signals and shutdown, with the model
    thread running a decode loop instead of whole batches."""

    claims_ahead = False  # the decode loop claims between its steps
    loop: DecodeLoop | EngineLoop

    def info(self) -> dict[str, Any]:
        """The batch worker's report, the sequences preempted so far, and the prefix
        cache's hit rate (prompt tokens reused / prompt tokens prefilled)."""
        loop = getattr(self, "loop", None)
        prefixes = loop.batch.prefixes if loop else None
        return {**super().info(), "preempted": loop.preempted if loop else 0,
                "prefix_hit_rate": round(prefixes.hit_rate, 4) if prefixes else 0,
                "prefix_reused_tokens": prefixes.reused_tokens if prefixes else 0}

    def _on_committed(self, queue_: ShardedQueue) -> Callable[[list[Outcome]], None]:
        ends = StreamWriter(queue_.client, queue_.keys_for)  # the writer thread's own
        return lambda done: _end_streams(ends, done)

    def _work(self, queue_: ShardedQueue, claimer: Claimer, writer: ResultWriter,
              cap: BatchCap, burst: bool) -> None:
        o = self.options
        log.info("worker %s generating from queue %r: up to %d sequences, %d tokens of cache, "
                 "prefill chunks of %s tokens", self.id, queue_.name, o.max_batch_size,
                 o.max_batch_tokens, o.prefill_chunk_tokens or "all the")
        if isinstance(self.runner, EngineRunner):  # --engine vllm: the engine steps
            self.loop = EngineLoop(queue_, self.runner, claimer, claimer.leases, writer, o, self.count)
            self.loop.run(self.stop, burst)
            self.batches_run = self.loop.steps
            return
        self.loop = DecodeLoop(queue_, self.runner, claimer, claimer.leases, writer, o, self.count, cap)
        self.loop.run(self.stop, burst)
        self.batches_run = self.loop.batch.steps


def _end_streams(ends: StreamWriter, committed: list[Outcome]) -> None:
    """End the streams of committed results: their readers read the result next."""
    for o in committed:
        if isinstance(o.request.input, dict) and o.request.input.get("stream") is True:
            reason = o.output.get("finish_reason", "") if isinstance(o.output, dict) else "error"
            ends.end(o.request.id, reason)
    ends.flush()


def generate_defaults(runner: Any, options: WorkerOptions, given: set[str], threads: int | None,
                      cores: int) -> tuple[WorkerOptions, int | None]:
    """The options ``--task generate`` fills in where no flag set them, and its torch
    threads: sequences in flight by device, the KV cache budget from the model's context
    and the memory free for its cache, no dynamic wait (a claim between decode steps
    takes what is there: waiting would stall the running sequences), a short lookahead,
    and on a CPU one
    core left to the threads that claim, stream and commit around the model."""
    changes: dict[str, Any] = {}
    if isinstance(runner, EngineRunner):  # its memory is the engine's: the budget only
        sequences = options.max_batch_size if "max_batch_size" in given else ACCELERATOR_SEQUENCES
        changes.update(max_batch_size=sequences,  # bounds what is claimed into it
                       max_batch_tokens=options.max_batch_tokens if "max_batch_tokens" in given
                       else sequences * runner.max_input_tokens)
        changes.update(max_wait_ms=options.max_wait_ms if "max_wait_ms" in given else 0,
                       lookahead=options.lookahead or 4 * sequences)
        return replace(options, **changes), threads
    device = torch.device(getattr(runner, "device", "cpu"))
    on_cpu = device.type == "cpu"
    if "max_batch_size" not in given:
        changes["max_batch_size"] = CPU_SEQUENCES if on_cpu else ACCELERATOR_SEQUENCES
    sequences = changes.get("max_batch_size", options.max_batch_size)
    if "max_batch_tokens" not in given:
        kv = CACHE_MEMORY_SHARE * free_memory(device) / max(1, cache_bytes_per_token(runner))
        prefix = options.prefix_cache_tokens  # the prefix cache's KV comes on top of the budget
        fits = int(kv / (1 + prefix_cache.CACHE_SHARE) if prefix is None else kv - prefix)
        changes["max_batch_tokens"] = max(runner.max_input_tokens, min(sequences * runner.max_input_tokens, fits))
    if "max_wait_ms" not in given:
        changes["max_wait_ms"] = 0
    if not options.lookahead:  # a claim between steps fills a few freed rows: 4 per row in
        changes["lookahead"] = 4 * sequences  # flight is choice enough, and costs Redis less
    if threads is None and on_cpu:
        threads = max(1, cores - 1)
    return replace(options, **changes), threads


def cache_bytes_per_token(runner: Any) -> int:
    """KV cache bytes one token takes: keys and values of every layer."""
    config = runner._model.config
    config = getattr(config, "text_config", None) or config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    element = torch.finfo(runner._model.dtype).bits // 8
    return 2 * config.num_hidden_layers * kv_heads * head_dim * element


def free_memory(device: torch.device) -> int:
    """Bytes free for the cache: the accelerator's free memory, or the host's free pages
    (not counting what the page cache could give back: the lower bound)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not on this OS: assume 1 GiB
        return 1 << 30
