"""A worker's own settings (queue-wide ones live in Redis: batchery.batching.settings.QueueSettings)."""

from __future__ import annotations

import os
import socket
import secrets
from dataclasses import dataclass, field

from batchery.config import DEFAULT_QUEUE
from batchery.errors import ConfigError


DEFAULT_LOOKAHEAD = 1024  # candidates a claim chooses from: see WorkerOptions.lookahead
# The largest batch where no --max-batch-size says, decided here only. A built-in embed or
# classify model is timed at start instead (workers/calibrate.py); a --runner offers
# nothing to time and gets 64: past it, CPU and small-GPU throughput of encoder models
# stops growing.
UNTIMED_BATCH_SIZE = 64
# --task generate: sequences in flight. On a CPU a small model's decode step costs about
# the same from 16 to 32 rows and more past that (bench/generate.py: 32 rows of its GPT-2
# take ~45 ms a step on one thread); an accelerator's step is flat much longer.
CPU_SEQUENCES, ACCELERATOR_SEQUENCES = 32, 256


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(2)}"


@dataclass(frozen=True)
class WorkerOptions:
    queue: str = DEFAULT_QUEUE
    max_batch_size: int = UNTIMED_BATCH_SIZE
    # Padded tokens per batch (longest x size): bounds activation memory, whatever the lengths.
    max_batch_tokens: int = 8192
    # Triton's max_queue_delay: a partial batch waits this long for company, no longer.
    max_wait_ms: int = 10
    # Candidates a claim chooses from (0: 1024, or 4 x max_batch_size if more): room to group
    # similar lengths. 1024 gives batches of 16 real paragraphs 94% padding efficiency (64
    # candidates: 68%) for about 1.5 ms of Redis time per claim (bench/model.py). Read
    # lazily: when the first max_batch_size settle the batch (equal lengths), no more (two
    # batches' worth for a deep queue's claim, which leases the next batch too).
    lookahead: int = 0
    # Claims made and tokenized ahead while the model runs (a deep queue's claim holds two
    # batches, one lease each): 1 keeps the model busy.
    prefetch: int = 1
    # Batches run at once, each on its own thread through the one loaded model (shared
    # weights). On a CPU, one per core with one torch thread each beats one batch using
    # every core: no thread of a batch waits for a descheduled sibling (bench/model.py).
    parallel_batches: int = 1
    # After out of memory, the batch size stays halved this long.
    oom_hold_s: float = 60.0
    # An idle worker wakes at least this often, also when no enqueue signals it.
    idle_poll_s: float = 1.0
    # --task generate: prompt tokens prefilled per decode step; a longer prompt is prefilled
    # in chunks between the running sequences' steps (0: at once). 256 tokens of a small
    # model cost about one 32-row decode step on a CPU (bench/generate.py), so a long
    # prompt at most doubles the running sequences' time per token while it is prefilled.
    prefill_chunk_tokens: int = 256
    # --task generate: tokens of prompt-prefix KV kept for reuse (generation/prefix_cache.py;
    # None: a quarter of max_batch_tokens; 0: no prefix caching).
    prefix_cache_tokens: int | None = None
    worker_id: str = field(default_factory=new_worker_id)
    # What it runs, as `batchery dashboard` shows it ("embed minilm", "mymodels:build").
    model: str = ""

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch_size <= 4096:
            raise ConfigError(f"--max-batch-size must be 1..4096, got {self.max_batch_size}")
        if self.max_batch_tokens < 1:
            raise ConfigError(f"--max-batch-tokens must be positive, got {self.max_batch_tokens}")
        if self.max_wait_ms < 0:
            raise ConfigError(f"--max-wait-ms must be 0 or more, got {self.max_wait_ms}")
        if not 1 <= self.parallel_batches <= 64:
            raise ConfigError(f"--parallel-batches must be 1..64, got {self.parallel_batches}")
        if self.prefill_chunk_tokens < 0:
            raise ConfigError(f"--prefill-chunk-tokens must be 0 or more, got {self.prefill_chunk_tokens}")
        if self.prefix_cache_tokens is not None and self.prefix_cache_tokens < 0:
            raise ConfigError(f"--prefix-cache-tokens must be 0 or more, got {self.prefix_cache_tokens}")
        if self.prefetch < 1:
            raise ConfigError(f"prefetch must be at least 1, got {self.prefetch}")

    @property
    def claim_lookahead(self) -> int:
        return max(self.lookahead or max(DEFAULT_LOOKAHEAD, 4 * self.max_batch_size),
                   self.max_batch_size)
