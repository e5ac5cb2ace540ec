"""Generation: static batches, transformers' continuous batching, and batchery's.

A GPT-2 with random weights built from a config (no download) and MiniLM's tokenizer;
prompts are standard-library paragraphs (8 to 256 tokens), ``max_new_tokens`` long-tailed
between 4 and 256 (log-normal, median 24), EOS disabled so every length is exact. All
requests are there at the start (an offline job); latency is from then to each result.
Every system samples with the same parameters (temperature 0.8, top_p 0.95; ``--greedy``
for greedy decoding everywhere).

(a) static batching in-process: transformers' ``generate`` over batches of BATCH in
    arrival order, each running until its longest request is done.
(b) transformers' in-process continuous batching (ContinuousBatchingManager, paged
    cache, its default sizing; one max_new_tokens per request through add_request).
(c) batchery: one real ``batchery worker --task generate`` with its defaults (no tuning
    flag), fed by ``Client.stream`` with every request queued at once; its time per
    decode step split into model, sampling and host (the rest: scheduling, Redis, text).
(d) realtime time to first token in batchery while a batch-class flood decodes: a
    streamed realtime request every REALTIME_EVERY_S: from enqueue to its first token,
    and from its claim (the stream's start entry) to its first token's entry.

``python -m bench.generate [--quick] [--greedy]``
"""

from __future__ import annotations

import math
import os
import random
import tempfile
import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, GenerationConfig  # noqa: E402

from batchery import Client  # noqa: E402
from batchery.workers.runners import load_runner  # noqa: E402
from batchery.workers.runners.hf import pick_device, resolve_model  # noqa: E402
from bench import common  # noqa: E402
from bench.corpus import paragraphs  # noqa: E402

BATCH = 32                 # static batch size (batchery's default sequences in flight on a CPU)
REALTIME_EVERY_S = 0.25
SAMPLING = {"temperature": 0.8, "top_p": 0.95}  # every system's, unless --greedy
MODEL = dict(n_embd=256, n_layer=4, n_head=4, n_positions=512)  # ~10M parameters besides embeddings
# where every contender runs: "cpu" (the figures in the docs), or from --device (main)
DEVICE = "cpu"


def build_model(folder: Path) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("minilm"))
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=tokenizer.vocab_size, bos_token_id=None,
                               eos_token_id=None, **MODEL)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def workload(n: int, seed: int = 0, sampling: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    news = [min(256, max(4, int(rng.lognormvariate(math.log(24), 1.0)))) for _ in range(n)]
    return [{"prompt": p, "max_new_tokens": m, **(sampling or {})}
            for p, m in zip(paragraphs(n), news)]


def summary(name: str, latencies: list[float], tokens: int, seconds: float) -> dict[str, Any]:
    return {"system": name, "requests": len(latencies), "tokens": tokens,
            "seconds": round(seconds, 2), "tokens_s": tokens / seconds,
            "load": os.getloadavg()[0],  # the machine's, at the end: others' work slows all
            "p50_s": common.percentile(latencies, 0.5), "p99_s": common.percentile(latencies, 0.99)}


def static(model_dir: Path, requests: list[dict[str, Any]]) -> dict[str, Any]:
    runner = load_runner("generate", str(model_dir), None, DEVICE)
    run_static(runner, requests[:BATCH])  # warm-up
    latencies, tokens, started = [], 0, time.perf_counter()
    for i in range(0, len(requests), BATCH):
        tokens += run_static(runner, requests[i:i + BATCH])
        latencies += [time.perf_counter() - started] * len(requests[i:i + BATCH])
    return summary(f"(a) static batches of {BATCH}, in-process", latencies, tokens,
                   time.perf_counter() - started)


def run_static(runner: Any, batch: list[dict[str, Any]]) -> int:
    """One static batch through ``generate`` with the requests' sampling: tokens generated."""
    if "temperature" not in batch[0]:  # greedy: the runner's own static batch
        return sum(o["tokens"] for o in runner.run(runner.prepare(batch).data))
    encoded, new_tokens = runner.prepare(batch).data
    with torch.inference_mode():
        runner._model.generate(**encoded, max_new_tokens=max(new_tokens), do_sample=True,
                               temperature=batch[0]["temperature"], top_p=batch[0]["top_p"],
                               pad_token_id=runner._tokenizer.pad_token_id)
    return sum(new_tokens)  # (EOS off: each row runs its whole length, and longer)


def transformers_cb(model_dir: Path, requests: list[dict[str, Any]]) -> dict[str, Any]:
    runner = load_runner("generate", str(model_dir), None, DEVICE)
    model, tokenizer = runner._model, runner._tokenizer
    ids = [runner.sequence(None, r).prompt_ids for r in requests]
    sampling = {"do_sample": True, "temperature": requests[0]["temperature"],
                "top_p": requests[0]["top_p"]} if "temperature" in requests[0] else {"do_sample": False}
    config = GenerationConfig(eos_token_id=-1, pad_token_id=tokenizer.pad_token_id,
                              max_new_tokens=256, **sampling)
    with model.continuous_batching_context_manager(generation_config=config) as manager:
        started = time.perf_counter()
        for i, (prompt, r) in enumerate(zip(ids, requests)):
            manager.add_request(prompt, request_id=str(i), max_new_tokens=r["max_new_tokens"],
                                eos_token_id=-1)
        latencies, tokens = [], 0
        while len(latencies) < len(requests):
            out = manager.get_result(timeout=5)
            if out is None:
                if not manager.is_running():
                    raise SystemExit("transformers' continuous batching stopped early")
                continue
            if out.is_finished():
                latencies.append(time.perf_counter() - started)
                tokens += len(out.generated_tokens)
        seconds = time.perf_counter() - started
    return summary("(b) transformers ContinuousBatchingManager, in-process", latencies, tokens,
                   seconds)


def worker_args(model_dir: Path, port: int, device: str | None = None) -> tuple[str, ...]:
    """No tuning flags: the worker's own defaults for --task generate, on ``device``
    (default: the bench's DEVICE)."""
    return ("--task", "generate", "--model", str(model_dir), "--device", device or DEVICE,
            "--metrics-port", str(port))


@contextmanager
def serving_worker(url: str, model_dir: Path, name: str, *flags: str) -> Iterator[tuple[Client, int]]:
    """A generate worker on a fresh queue (its defaults, and ``flags``), warmed up, and a
    client of it: (client, the worker's metrics port). The worker stops on exit."""
    queue = f"{name}-{time.monotonic_ns()}"
    port = common.free_port()
    worker = common.batchery_worker(url, queue, *worker_args(model_dir, port), *flags)
    try:
        with Client(url, queue) as client:
            common.wait_until(lambda: client.queue.stats()["workers"] >= 1, 180, "the worker")
            list(client.stream([{"input": {"prompt": "warm up", "max_new_tokens": 8}}]))
            common.freeze()
            yield client, port
    finally:
        common.stop([worker])


def batchery(url: str, model_dir: Path, requests: list[dict[str, Any]]) -> dict[str, Any]:
    with serving_worker(url, model_dir, "gen") as (client, port):
        latencies, tokens, seconds = drain(client, requests)
        step_ms = mean_step_ms(port)
        phases = step_phases(port)
    row = summary("(c) batchery, 1 worker, its defaults", latencies, tokens, seconds)
    row["step_ms"], row["phases_ms"] = step_ms, phases
    return row


def drain(client: Client, requests: list[dict[str, Any]]) -> tuple[list[float], int, float]:
    """Every request through the worker at once, batch class: each result's latency from
    the start, the tokens generated, and the seconds it all took."""
    started, latencies, tokens = time.perf_counter(), [], 0
    for result in client.stream({"input": r, "priority": "batch"} for r in requests):
        if not result.ok:
            raise SystemExit(f"batchery failed a request: {result.error}")
        latencies.append(time.perf_counter() - started)
        tokens += result.output["tokens"]
    return latencies, tokens, time.perf_counter() - started


def mean_step_ms(port: int) -> float:
    """batchery_inference_seconds per decode step, from the worker's metrics."""
    values = common.metrics(port)
    return 1000 * values["batchery_inference_seconds_sum"] / max(1, values["batchery_inference_seconds_count"])


def step_phases(port: int) -> dict[str, float]:
    """The worker's time per decode step by phase (model, sampling, host), in ms: its
    batchery_generate_seconds_total{phase} over the steps it ran."""
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    seconds = {m.group(1): float(m.group(2)) for m in
               re.finditer(r'^batchery_generate_seconds_total{.*phase="(\w+)".*} (\S+)$', page, re.M)}
    steps = common.metrics(port)["batchery_inference_seconds_count"]
    return {phase: round(1000 * s / max(1, steps), 2) for phase, s in seconds.items()}


def prefill_ms(model_dir: Path, prompts: list[str]) -> float:
    """Median time of one realtime prompt's prefill, alone, in-process."""
    runner = load_runner("generate", str(model_dir), None, DEVICE)
    times = []
    for prompt in prompts:
        seq = runner.sequence(None, {"prompt": prompt, "max_new_tokens": 8})
        started = time.perf_counter()
        runner.new_batch().add([seq])
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return 1000 * common.percentile(times, 0.5)


def realtime_ttft(url: str, model_dir: Path, requests: list[dict[str, Any]],
                  seconds: float) -> dict[str, Any]:
    """A flood of batch-class requests decoding; realtime streamed requests meanwhile."""
    with serving_worker(url, model_dir, "ttft") as (client, port):
        client.enqueue_many(({"input": r, "priority": "batch"} for r in requests), reply=False)
        firsts: list[float] = []
        after_claim: list[float] = []
        lock = threading.Lock()

        def one(prompt: str) -> None:
            sent = time.perf_counter()
            handle = client.enqueue({"prompt": prompt, "max_new_tokens": 8, "stream": True},
                                    priority="realtime")
            first = None
            for event in handle.stream(timeout=60):
                if event.kind == "text" and first is None:
                    first = time.perf_counter() - sent
            with lock:
                firsts.append(first if first is not None else float("nan"))
                after_claim.append(claim_to_first_token(client, handle.id))
        prompts = paragraphs(len(requests) + 200)[len(requests):]
        with ThreadPoolExecutor(8) as pool:
            end, i = time.perf_counter() + seconds, 0
            while time.perf_counter() < end:
                pool.submit(one, prompts[i % len(prompts)])
                i += 1
                time.sleep(REALTIME_EVERY_S)
        step_ms = mean_step_ms(port)
        flood_left = client.queue.stats()["pending"]
    return {"scenario": f"realtime every {REALTIME_EVERY_S * 1000:.0f} ms during a flood of "
                        f"{len(requests)} batch requests", "realtime": len(firsts),
            "ttft_p50_ms": 1000 * common.percentile(firsts, 0.5),
            "ttft_p99_ms": 1000 * common.percentile(firsts, 0.99),
            "after_claim_p50_ms": 1000 * common.percentile(after_claim, 0.5),
            "after_claim_p99_ms": 1000 * common.percentile(after_claim, 0.99),
            "step_ms": step_ms, "flood_left": flood_left, "load": os.getloadavg()[0],
            "prefill_ms": prefill_ms(model_dir, prompts[:50]),
            "after_claim_ms": sorted(round(1000 * x, 1) for x in after_claim)}


def claim_to_first_token(client: Client, request_id: str) -> float:
    """On the Redis clock: from the stream's start entry (written when the worker claims
    the request) to its first text entry (written with its first token, even when that
    token's text is empty)."""
    entries = client.queue.client.xrange(client.queue.keys.stream(request_id))
    start = next(i for i, f in entries if f["e"] == "start")
    text = next(i for i, f in entries if f["e"] == "text")
    return (int(text.split("-")[0]) - int(start.split("-")[0])) / 1000


COLUMNS = (("system", "system", ""), ("requests", "requests", "d"), ("tokens", "tokens", "d"),
           ("tokens_s", "tokens/s", ".0f"), ("p50_s", "latency p50 s", ".1f"),
           ("p99_s", "latency p99 s", ".1f"), ("x_a", "x (a)", ".2f"),
           ("load", "load avg after", ".1f"))
TTFT_COLUMNS = (("scenario", "scenario", ""), ("realtime", "realtime requests", "d"),
                ("ttft_p50_ms", "TTFT p50 ms", ".0f"), ("ttft_p99_ms", "TTFT p99 ms", ".0f"),
                ("after_claim_p50_ms", "claim to first token p50 ms", ".0f"),
                ("after_claim_p99_ms", "claim to first token p99 ms", ".0f"),
                ("prefill_ms", "one prefill ms", ".1f"), ("step_ms", "decode step ms", ".1f"),
                ("load", "load avg after", ".1f"))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--greedy", action="store_true", help="greedy decoding for every system "
                   "(default: sampling, temperature 0.8 and top_p 0.95)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every contender "
                   "(default 1: on a shared VM, each operation on 2 threads waits for a "
                   "descheduled sibling; see bench.contention)")
    p.add_argument("--device", default="cpu", help="where every contender runs: cpu (default), "
                   "cuda, auto (a GPU when there is one)")
    args = p.parse_args(argv)
    global DEVICE
    DEVICE = str(pick_device(args.device))
    torch.set_num_threads(args.threads)
    n = 100 if args.quick else 500
    sampling = None if args.greedy else SAMPLING
    requests = workload(n, sampling=sampling)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="batchery-gpt2-") as folder, common.private_redis() as url:
        model_dir = build_model(Path(folder))
        for _ in range(args.repeat):
            common.log(f"generate: {n} requests, (a) static ...")
            rows.append(static(model_dir, requests))
            common.log("generate: (b) transformers' continuous batching ...")
            rows.append(transformers_cb(model_dir, requests))
            common.log("generate: (c) batchery ...")
            rows.append(batchery(url, model_dir, requests))
        common.log("generate: (d) realtime time to first token during a flood ...")
        ttft = realtime_ttft(url, model_dir, workload(n, seed=1, sampling=sampling), 8.0 if args.quick else 20.0)
    best = [max((r for r in rows if r["system"] == s), key=lambda r: r["tokens_s"])
            for s in dict.fromkeys(r["system"] for r in rows)]
    for r in best:
        r["x_a"] = r["tokens_s"] / best[0]["tokens_s"]
    a, b, c = best
    text = common.table(best, COLUMNS) + "\n\n" + common.table([ttft], TTFT_COLUMNS)
    bound = ttft["prefill_ms"] + 2 * ttft["step_ms"]
    checks = [f"(c) / (a) tokens/s: {c['tokens_s'] / a['tokens_s']:.2f} (target >= 3): "
              f"{'met' if c['tokens_s'] >= 3 * a['tokens_s'] else 'MISSED'}",
              f"(c) / (b) tokens/s: {c['tokens_s'] / b['tokens_s']:.2f} (target >= 1.3): "
              f"{'met' if c['tokens_s'] >= 1.3 * b['tokens_s'] else 'MISSED'}",
              "(c) decode step: " + ", ".join(f"{k} {v:.2f} ms" for k, v in c["phases_ms"].items())
              + f" (of {c['step_ms']:.2f} ms of inference)",
              f"realtime first token p99 {ttft['after_claim_p99_ms']:.0f} ms after its claim, "
              f"against a prefill + 2 decode steps ~ {bound:.0f} ms: "
              f"{'met' if ttft['after_claim_p99_ms'] <= bound else 'MISSED'}"]
    mode = "greedy" if args.greedy else f"sampling {SAMPLING}"
    where = f"{common.machine()}, {common.accelerator(torch.device(DEVICE))}"
    print(f"\n## Generation, {mode} ({where})\n\n{text}\n\n" + "\n".join(checks) + "\n")
    common.save("generate", {"machine": common.machine(), "runs": rows, "ttft": ttft,
                             "targets": checks})
    return {"table": text, "targets": checks}


if __name__ == "__main__":
    main()
