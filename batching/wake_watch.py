"""Idle wake-ups from every shard of a queue on a Redis Cluster.

An enqueue pushes a token onto its shard's wake list (lua/enqueue.lua). On one Redis a
worker waits on every shard's list with one BLPOP; a Cluster refuses a BLPOP across
slots, so there a worker runs one daemon thread per shard, each blocked on its shard's
list while the worker waits for work: the first token from any shard wakes it at once
(no polling, no rotation). A token a thread pops just after its worker went back to work
is pushed back, for another idle worker.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import redis
from redis.exceptions import RedisClusterException

from batchery.batching.queue import RequestQueue

WATCH_BLOCK_S = 1.0  # one blocking read of a watcher: how late it notices a layout change


class WakeWatch:
    """The wake-up watchers of one worker's queue."""

    def __init__(self) -> None:
        self.idle = threading.Event()    # set while the worker waits for work
        self.woken = threading.Event()   # a token arrived while it waited
        self._watched: frozenset[str] = frozenset()
        self._threads: dict[str, threading.Thread] = {}

    def wait(self, shards: Sequence[RequestQueue], timeout_s: float) -> None:
        """Block up to ``timeout_s`` for a wake-up token from any of ``shards``."""
        self._watched = frozenset(q.keys.wake for q in shards)  # watchers of others leave
        for shard in shards:
            thread = self._threads.get(shard.keys.wake)
            if thread is None or not thread.is_alive():
                thread = threading.Thread(target=self._watch, args=(shard,), daemon=True,
                                          name=f"batchery-wake-{shard.keys.tag}")
                self._threads[shard.keys.wake] = thread
                thread.start()
        self.idle.set()
        try:
            self.woken.wait(timeout_s)
        finally:
            self.idle.clear()
            self.woken.clear()

    def close(self) -> None:
        """Stop watching: the threads leave within WATCH_BLOCK_S, quietly even if the
        client they read with is closed meanwhile."""
        self._watched = frozenset()

    def _watch(self, shard: RequestQueue) -> None:
        while shard.keys.wake in self._watched:
            if not self.idle.wait(WATCH_BLOCK_S):
                continue
            try:
                if not shard.wait_for_work(WATCH_BLOCK_S):
                    continue
                if self.idle.is_set():
                    self.woken.set()
                else:  # its worker is busy again: the token is another idle worker's
                    shard.wake_again()
            except Exception as exc:
                if shard.keys.wake not in self._watched:
                    return  # closed while it read: its client may be closed under it
                if not isinstance(exc, (redis.RedisError, RedisClusterException)):
                    raise
                # a node down or failing over (or every node): the claim reports it
                time.sleep(WATCH_BLOCK_S)
