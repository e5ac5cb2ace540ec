"""What generation tests share: a tiny random GPT-2 and a generate worker on a thread."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from batchery import Client
from batchery.connection import RedisSettings
from batchery.workers.generation.worker import GenerateWorker
from batchery.workers.options import WorkerOptions
from batchery.workers.runners.hf import resolve_model
from tests.conftest import wait_for


def build_gpt2(path: Path) -> Path:
    """GPT-2 with random weights and MiniLM's tokenizer; no EOS, so lengths are exact."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("minilm"))
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=tokenizer.vocab_size, n_embd=64, n_layer=2, n_head=2,
                               n_positions=512, bos_token_id=None,
                               eos_token_id=None)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@contextmanager
def generate_worker(redis_url: str, queue_name: str, runner: Any,
                    **options: Any) -> Iterator[GenerateWorker]:
    """A generate worker on a thread of this process (its model is the given runner)."""
    settings = {"max_wait_ms": 0, "max_batch_tokens": 4096, **options}
    w = GenerateWorker(RedisSettings.from_url(redis_url), runner,
                       WorkerOptions(queue=queue_name, **settings))
    thread = threading.Thread(target=w.run, kwargs={"handle_signals": False}, daemon=True)
    thread.start()
    # registered, so an enqueue wakes it (one before that waits for its idle poll: a 0.3 s
    # deadline would pass)
    with Client(redis_url, queue_name) as c:
        wait_for(lambda: c.queue.stats()["workers"] == 1, 30, message="the worker registered")
    # and its decode loop made (a test reads worker.loop: on a loaded machine the worker
    # registers before it makes the loop)
    wait_for(lambda: getattr(w, "loop", None) is not None, 30, message="the decode loop made")
    yield w
    w.stop.set()
    thread.join(30)
    assert not thread.is_alive()
