"""``batchery worker``: serve a queue with a model (several processes with --concurrency)."""

from __future__ import annotations

import gc
import logging
import os
import sys
from dataclasses import replace

import click

from batchery.cli_shared import default_of, queue_option, redis_options
from batchery.config import ENV_TORCH_THREADS, usable_cpus
from batchery.connection import RedisSettings
from batchery.errors import ConfigError
from batchery.workers.options import (ACCELERATOR_SEQUENCES, CPU_SEQUENCES, DEFAULT_LOOKAHEAD,
                                      UNTIMED_BATCH_SIZE, WorkerOptions)
from batchery.workers.runners import TASKS

DTYPES = ("auto", "float32", "float16", "bfloat16")
ENGINES = ("batchery", "vllm")

log = logging.getLogger(__name__)


@click.command("worker")
@click.option("--task", type=click.Choice(TASKS),
              help="Built-in task over a Hugging Face model.")
@click.option("--model", help="Model directory, a hub id in the local cache, or minilm.")
@click.option("--runner", metavar="MODULE:FACTORY", help="Your own model: factory() returns "
              "a callable over a list of inputs.")
@click.option("--device", default="auto", show_default=True,
              help="auto (CUDA when present), cpu, cuda, cuda:1, mps.")
@click.option("--max-batch-size", type=int, help="Largest batch claimed (default: timed at "
              "start, the smallest size within 5% of the model's best throughput; "
              f"{UNTIMED_BATCH_SIZE} for --runner). --task generate: sequences in flight "
              f"(default {CPU_SEQUENCES} on a CPU, {ACCELERATOR_SEQUENCES} on a GPU).")
@click.option("--max-batch-tokens", type=int,
              help="Padded tokens per batch (longest x size; default "
              f"{default_of(WorkerOptions, 'max_batch_tokens')}). --task generate: the KV cache "
              "budget, prompt plus max_new_tokens summed over the sequences in flight (default: "
              "the sequences x the model's context, within half the free memory).")
@click.option("--max-wait-ms", type=int,
              help="How long a partial batch waits for more requests (default "
              f"{default_of(WorkerOptions, 'max_wait_ms')}; --task generate: 0).")
@click.option("--prefill-chunk-tokens", type=int,
              help="--task generate: prompt tokens prefilled per step while other sequences "
              f"decode (default {default_of(WorkerOptions, 'prefill_chunk_tokens')}; 0: a whole "
              "prompt at once).")
@click.option("--prefix-cache-tokens", type=int,
              help="--task generate: tokens of prompt-prefix KV kept for requests that share "
              "a prefix (a system prompt) to reuse (default: a quarter of --max-batch-tokens; "
              "0: off).")
@click.option("--lookahead", default=default_of(WorkerOptions, "lookahead"), type=int,
              help="Candidates a claim picks similar lengths from (default "
              f"{DEFAULT_LOOKAHEAD}, or 4 x max "
              "batch size if more).")
@click.option("--metrics-port", type=int,
              help="Serve Prometheus metrics here (with --concurrency: every process's, added up).")
@click.option("--concurrency", default=1, show_default=True, type=int,
              help="Worker processes, each with its own model.")
@click.option("--parallel-batches", type=int,
              help="Batches run at once in each process, one thread each, sharing one copy "
              "of the model (default: one per core on a CPU, 1 on a GPU or with --runner).")
@click.option("--threads", type=int, envvar=ENV_TORCH_THREADS,
              help="torch CPU threads per batch (default: cores / parallel batches).")
@click.option("--dtype", type=click.Choice(DTYPES), default="auto", show_default=True,
              help="Model weights: auto is float16 on CUDA, "
              "float32 elsewhere.")
@click.option("--engine", type=click.Choice(ENGINES), default="batchery", show_default=True,
              help="--task generate: batchery's own decode loop, or vLLM's engine under the "
              "same queue contract (pip install vllm; a GPU it supports).")
@click.option("--burst", is_flag=True, help="Drain the queue, then exit.")
@click.option("--allow-download", is_flag=True, help="Let --model fetch from the hub.")
@queue_option
@redis_options
def worker(task: str | None, model: str | None, runner: str | None, device: str,
           max_batch_size: int | None, max_batch_tokens: int | None, max_wait_ms: int | None,
           prefill_chunk_tokens: int | None, prefix_cache_tokens: int | None, lookahead: int,
           metrics_port: int | None, concurrency: int, parallel_batches: int | None,
           threads: int | None, dtype: str, engine: str, burst: bool,
           allow_download: bool, queue: str, redis_url: str, cluster: bool) -> None:
    """Claim batches from QUEUE, run them through a model, write results back."""
    settings = RedisSettings.from_url(redis_url, cluster=cluster)
    if concurrency < 1:
        raise ConfigError(f"--concurrency must be at least 1, got {concurrency}")
    if concurrency > 1:
        from batchery.workers.supervisor import supervise
        raise SystemExit(supervise(concurrency, metrics_port, device))
    # checked before the model loads: a wrong flag fails in a second, not after a minute;
    # the sizes left to the defaults are filled in below, once the model is known
    given = {k: v for k, v in (("max_batch_size", max_batch_size),
                               ("parallel_batches", parallel_batches),
                               ("max_batch_tokens", max_batch_tokens),
                               ("max_wait_ms", max_wait_ms),
                               ("prefill_chunk_tokens", prefill_chunk_tokens),
                               ("prefix_cache_tokens", prefix_cache_tokens)) if v is not None}
    options = WorkerOptions(queue=queue, lookahead=lookahead, model=runner or f"{task} {model}",
                            **given)
    if engine == "vllm":
        if task != "generate" or runner or not model:
            raise ConfigError("--engine vllm runs --task generate over a --model (no --runner)")
        from batchery.workers.generation.engine import load_vllm
        model_runner = load_vllm(model, dtype, max_batch_size)
    else:
        from batchery.workers.runners import load_runner
        model_runner = load_runner(task, model, runner, device, allow_download, dtype)
    placed = str(getattr(model_runner, "device", ""))  # "" for a --runner: its own choice
    # The tokenizer's threads. On a CPU the model needs every core: one thread tokenizes
    # beside it. On a GPU the cores are idle and one thread cannot keep up (MiniLM on an
    # H100: 256 passages tokenized in 103 ms on one thread, 13 ms on the host's 16 cores;
    # the model runs them in 13 ms). Read at each call, so set before the first batch.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false" if placed in ("cpu", "") else "true")
    generating = task == "generate" and not runner or _is_engine(model_runner)
    if generating:  # one decode loop; sequences join and leave it
        from batchery.workers.generation.worker import generate_defaults
        options, threads = generate_defaults(model_runner, options, set(given), threads,
                                             usable_cpus())
        parallel_batches, max_batch_size = 1, options.max_batch_size
    elif task == "generate":
        parallel_batches = 1
    if parallel_batches is None:  # one batch per core on a CPU; built-in runners are thread-safe
        parallel_batches = usable_cpus() if placed == "cpu" else 1
    if threads is None and placed in ("cpu", "") and parallel_batches > 1:
        threads = max(1, usable_cpus() // parallel_batches)  # N teams of cores/N, not N of cores
    _set_threads(threads)
    from batchery.workers import metrics
    metrics.bind(queue)
    if max_batch_size is None:
        from batchery.workers.calibrate import pick_batch_size
        max_batch_size, rates = pick_batch_size(model_runner, options.max_batch_tokens)
        if rates:
            log.info("batch size %d: requests/s by batch size at a typical length: %s",
                     max_batch_size, ", ".join(f"{s}: {r:.0f}" for s, r in rates.items()))
    metrics.MAX_BATCH_SIZE.set(max_batch_size)
    options = replace(options, max_batch_size=max_batch_size, parallel_batches=parallel_batches)
    log.info("%d batch(es) at a time of up to %d requests, %s torch thread(s) each",
             parallel_batches, max_batch_size, threads or "default")
    metrics.serve(metrics_port or 0)
    if generating:  # a decode loop instead of whole batches
        from batchery.workers.generation.worker import GenerateWorker as Worker
    else:
        from batchery.workers.loop import Worker  # type: ignore[assignment]
    log.info("redis %s, queue %r, %s", settings.describe(), queue, options.model)
    # The model and its libraries live as long as the process: keep the garbage collector's
    # full passes off their ~400k objects (with transformers loaded each took 200+ ms,
    # stalling the batch that happened to trigger it).
    gc.freeze()
    raise SystemExit(Worker(settings, model_runner, options).run(burst=burst))


def _is_engine(runner: object) -> bool:
    """A generation engine's runner (``--engine vllm``, or a --runner factory that returns
    one): the generate worker runs it. Its module is loaded if it is one."""
    engine = sys.modules.get("batchery.workers.generation.engine")
    return engine is not None and isinstance(runner, engine.EngineRunner)


def _set_threads(threads: int | None) -> None:
    """torch's intra-op threads; each thread that runs a batch gets a team this size."""
    if threads:
        import torch
        torch.set_num_threads(threads)

