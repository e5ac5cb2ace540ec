"""Real model: the packaged MiniLM over stdlib paragraphs, against the limit and the alternatives.

(a) in-process loop over length-sorted batches, best batch size of a sweep: the limit
(b) the dynamic batcher of the literature: an in-process asyncio queue, FIFO, max batch
    size + timeout, every client submitting at once (at batchery's settings, and at its
    own best batch size from a sweep on a subset)
(c) RQ, one job per request: SimpleWorker processes with the model loaded once each
(d) batchery: real ``batchery worker`` processes and the real ``Client.map`` (all requests
    queued at once, claims looking at all of them: --lookahead 4096); one worker running
    one batch per core (--parallel-batches, 1 torch thread each), one worker running one
    batch at a time on every core, and one worker process per core; timed after one
    untimed pass, as (a) is timed after its sweep

``python -m bench.model [--quick] [-n N] [--repeat R]``: a table with each row's ratio to
(a), bench/out/model.json and bench/out/model.png.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # before transformers is imported

import redis  # noqa: E402

from batchery import Client  # noqa: E402
from bench import common  # noqa: E402
from bench.corpus import paragraphs  # noqa: E402

THREADS = common.CORES          # torch threads of one in-process model: one per core
SWEEP = (8, 16, 32, 64)         # batch sizes (a) tries; batchery and (b) run at its best
FIFO_SWEEP = (1, 4, 8, 16)      # batch sizes (b) tries, on a subset
MAX_WAIT_MS = 10                # batchery's default; (b)'s timeout is the same
RQ_WORKERS = 2                  # one job at a time each: two 1-thread processes use both cores
LOOKAHEAD = 4096                # (d) claims see the whole queue, as (a)'s sort does (default 1024)


def load_model(threads: int, device: str = "cpu") -> Any:
    import torch
    from batchery.workers.runners import load_runner
    torch.set_num_threads(threads)
    runner = load_runner("embed", "minilm", None, device)
    runner.warmup()
    return runner


def measure(label: str, run: Callable[[], tuple[int, int, int, int]]) -> dict[str, Any]:
    """Time ``run()`` -> (requests, batches, real tokens, padded tokens) into a row."""
    started = time.perf_counter()
    n, batches, tokens, padded = run()
    seconds = time.perf_counter() - started
    common.log(f"  {label}: {n / seconds:,.0f} requests/s")
    return {"system": label, "requests": n, "seconds": seconds, "rps": n / seconds,
            "padding": tokens / padded if padded else 1.0, "batch": n / max(1, batches)}


# -- (a) -------------------------------------------------------------------------------
def sorted_loop(runner: Any, texts: list[str], size: int) -> tuple[int, int, int, int]:
    lengths = runner._tokenizer(texts, truncation=True, max_length=runner.max_input_tokens,
                                return_length=True)["length"]
    ordered = [t for _, t in sorted(zip(lengths, texts), key=lambda p: p[0])]
    batches = tokens = padded = 0
    for i in range(0, len(ordered), size):
        prepared = runner.prepare(ordered[i:i + size])
        runner.run(prepared.data)
        batches, tokens, padded = batches + 1, tokens + sum(prepared.lengths), padded + prepared.padded
    return len(texts), batches, tokens, padded


# -- (b) -------------------------------------------------------------------------------
class DynamicBatcher:
    """The asyncio batcher of the literature: take the oldest request, wait up to
    ``timeout_s`` for more (up to ``max_batch_size``), run them in a thread, resolve."""

    def __init__(self, runner: Any, max_batch_size: int, timeout_s: float) -> None:
        self.runner, self.max_batch_size, self.timeout_s = runner, max_batch_size, timeout_s
        self.queue: asyncio.Queue[tuple[str, asyncio.Future]] = asyncio.Queue()
        self.batches = self.tokens = self.padded = 0

    async def submit(self, text: str) -> Any:
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((text, future))
        return await future

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as model_thread:
            while True:
                batch = [await self.queue.get()]
                deadline = loop.time() + self.timeout_s
                while len(batch) < self.max_batch_size and (left := deadline - loop.time()) > 0:
                    try:
                        batch.append(await asyncio.wait_for(self.queue.get(), left))
                    except asyncio.TimeoutError:
                        break
                outputs, lengths, padded = await loop.run_in_executor(
                    model_thread, self._run, [text for text, _ in batch])
                self.batches, self.tokens, self.padded = (self.batches + 1, self.tokens + lengths,
                                                          self.padded + padded)
                for (_, future), output in zip(batch, outputs):
                    future.set_result(output)

    def _run(self, texts: list[str]) -> tuple[list[Any], int, int]:
        prepared = self.runner.prepare(texts)
        return self.runner.run(prepared.data), sum(prepared.lengths), prepared.padded


def fifo_batcher(runner: Any, texts: list[str], size: int) -> tuple[int, int, int, int]:
    async def main() -> DynamicBatcher:
        batcher = DynamicBatcher(runner, size, MAX_WAIT_MS / 1000)
        server = asyncio.create_task(batcher.serve())
        outputs = await asyncio.gather(*(batcher.submit(t) for t in texts))
        assert len(outputs) == len(texts)
        server.cancel()
        return batcher
    b = asyncio.run(main())
    return len(texts), b.batches, b.tokens, b.padded


# -- (c) -------------------------------------------------------------------------------
def rq_jobs(url: str, texts: list[str], workers: int) -> dict[str, Any]:
    from rq import Queue
    from rq.registry import FinishedJobRegistry
    from rq.serializers import JSONSerializer
    name = f"rq-embed-{time.monotonic_ns()}"
    conn = redis.Redis.from_url(url)
    procs = [common.start([sys.executable, "-m", "bench.rq_jobs", url, name, "embed"], threads=1)
             for _ in range(workers)]
    try:
        common.wait_until(lambda: conn.llen(f"bench:rq-ready:{name}") >= workers, 180, "RQ workers")
        q = Queue(name, connection=conn, serializer=JSONSerializer)
        finished = FinishedJobRegistry(queue=q)

        def run() -> tuple[int, int, int, int]:
            with conn.pipeline() as pipe:
                q.enqueue_many([Queue.prepare_data("bench.rq_jobs.embed", (t,)) for t in texts],
                               pipeline=pipe)
                pipe.execute()
            common.wait_until(lambda: common.rq_done(q, finished, len(texts)), 3600, "RQ jobs",
                              interval=0.02)
            return len(texts), len(texts), 1, 1
        row = measure(f"(c) RQ, {workers} SimpleWorkers x 1 thread, a job per request", run)
    finally:
        common.stop(procs)
        conn.close()
    return row


# -- (d) -------------------------------------------------------------------------------
# (d) configurations on 2 cores: key -> (worker processes, parallel batches, torch threads)
D_CONFIGS = {"d1": (1, common.CORES, 1), "d1t": (1, 1, common.CORES), "d2": (common.CORES, 1, 1)}


def batchery_workers(url: str, texts: list[str], config: tuple[int, int, int], size: int
                     ) -> dict[str, Any]:
    workers, parallel, threads = config
    queue = f"embed-{workers}w{parallel}p-{time.monotonic_ns()}"
    procs = [common.batchery_worker(url, queue, "--task", "embed", "--model", "minilm",
                                    "--device", "cpu", "--max-batch-size", str(size),
                                    "--max-wait-ms", str(MAX_WAIT_MS), "--lookahead", str(LOOKAHEAD),
                                    "--parallel-batches", str(parallel), threads=threads)
             for _ in range(workers)]
    try:
        with Client(url, queue) as client:
            common.wait_until(lambda: client.queue.stats()["workers"] >= workers, 180,
                              "batchery workers")
            # one untimed pass, as (a)'s sweep warmed its model on every batch shape first
            client.map(texts, max_in_flight=len(texts))
            client.queue.client.delete(client.queue.keys.stats)

            def run() -> tuple[int, int, int, int]:
                results = client.map(texts, max_in_flight=len(texts))
                assert all(r.ok for r in results), "a request failed"
                t = client.queue.stats()["totals"]
                return len(texts), t["batches"], t["tokens"], t["padded_tokens"]
            label = (f"(d) batchery, {workers} worker{'s' if workers > 1 else ''}"
                     + (f", {parallel} parallel batches" if parallel > 1 else "")
                     + f" x {threads} thread{'s' if threads > 1 else ''}")
            return measure(label, run)
    finally:
        common.stop(procs)


COLUMNS = [("system", "system", ""), ("size", "max batch", ""), ("rps", "requests/s", ".1f"),
           ("padding", "padding eff.", ".1%"), ("batch", "mean batch", ".1f"),
           ("ratio", "x (a)", ".2f")]


def best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return max(rows, key=lambda r: r["rps"])


def sweep(label: str, sizes: list[int], repeat: int, run: Callable[[int], tuple[int, int, int, int]]
          ) -> list[dict[str, Any]]:
    """Each batch size ``repeat`` times (interleaved); the best run of each size."""
    runs = [dict(measure(label.format(size=s), lambda s=s: run(s)), size=s)
            for _ in range(repeat) for s in sizes]
    return [best([r for r in runs if r["size"] == s]) for s in sizes]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("-n", type=int, help="paragraphs (default 3000; --quick 600)")
    args = p.parse_args(argv)
    n = args.n or (600 if args.quick else 3000)
    texts = paragraphs(n)
    subset = texts[::3][:600]  # the (b) sweep: every third paragraph, at most 600
    common.log(f"model: MiniLM, {n} paragraphs; loading the in-process model ({THREADS} threads) ...")
    runner = load_model(THREADS)
    common.freeze()

    common.log("(a) sweeping batch sizes over length-sorted batches ...")
    sorted_sweep = sweep("(a) in-process, sorted, batch {size}", list(SWEEP), args.repeat,
                         lambda s: sorted_loop(runner, texts, s))
    size = best(sorted_sweep)["size"]
    common.log(f"(b) sweeping FIFO batch sizes on {len(subset)} paragraphs ...")
    fifo_sweep = sweep("(b) FIFO, batch {size}", sorted(set(FIFO_SWEEP) | {size}), args.repeat,
                       lambda s: fifo_batcher(runner, subset, s))
    fifo_size = best(fifo_sweep)["size"]

    rows: dict[str, list[dict[str, Any]]] = {"a": [best(sorted_sweep)]}

    def add(key: str, row: dict[str, Any]) -> None:
        rows.setdefault(key, []).append(row)
        common.log(f"  {row['system']}: {row['rps']:.1f} requests/s")

    with common.private_redis() as url:
        for rep in range(args.repeat):
            if rep:
                add("a", dict(measure(f"(a) in-process, sorted, batch {size}",
                                      lambda: sorted_loop(runner, texts, size)), size=size))
            common.log("(b) asyncio dynamic batcher ...")
            add("b", dict(measure(f"(b) asyncio batcher, FIFO, {MAX_WAIT_MS} ms timeout",
                                  lambda: fifo_batcher(runner, texts, size)), size=size))
            if fifo_size != size:
                add("b*", dict(measure("(b) asyncio batcher, FIFO, its best batch size",
                                       lambda: fifo_batcher(runner, texts, fifo_size)), size=fifo_size))
            common.log("(c) RQ ...")
            add("c", dict(rq_jobs(url, texts, RQ_WORKERS), size=1))
            for key, config in D_CONFIGS.items():
                common.log(f"(d) batchery, {config[0]} worker(s) x {config[1]} parallel batches ...")
                add(key, dict(batchery_workers(url, texts, config, size), size=size))
    final = {key: best(found) for key, found in rows.items()}
    limit = final["a"]["rps"]
    for row in final.values():
        row["ratio"] = row["rps"] / limit
    text = common.table(list(final.values()), COLUMNS)
    text += ("\n\n(a) sweep: " + ", ".join(f"batch {r['size']}: {r['rps']:.1f}/s" for r in sorted_sweep)
             + f"\n(b) sweep on {len(subset)} paragraphs: "
             + ", ".join(f"batch {r['size']}: {r['rps']:.1f}/s" for r in fifo_sweep))
    checks = targets(final)
    print(f"\n## Real model: MiniLM, {n} stdlib paragraphs ({common.machine()}, CPU)\n\n{text}\n")
    print("\n".join(checks) + "\n")
    common.save("model", {"machine": common.machine(), "requests": n, "rows": final, "all": rows,
                          "sweep": sorted_sweep, "fifo_sweep": fifo_sweep, "targets": checks})
    plot(final, n)
    return {"rows": final, "table": text, "targets": checks}


def targets(rows: dict[str, dict[str, Any]]) -> list[str]:
    d1, a, b = rows["d1"]["rps"], rows["a"]["rps"], rows["b"]["rps"]
    out = [check("(d) 1 worker / (a)", d1 / a, 0.95),
           check("(d) 1 worker / (b) at the same batch size", d1 / b, 4.0)]
    if "b*" in rows:
        out.append(check("(d) 1 worker / (b) at its best batch size", d1 / rows["b*"]["rps"], 4.0))
    out.append(f"ceiling: (a) / (b) at the same batch size = {a / b:.2f}, what perfect length "
               "grouping gains over FIFO with this model on this machine")
    return out


def check(name: str, value: float, target: float) -> str:
    return f"{name}: {value:.2f} (target >= {target:g}): {'met' if value >= target else 'MISSED'}"


SHORT = {"a": "(a) in-process\nsorted, batch {size}", "b": "(b) asyncio FIFO\nbatch {size}",
         "b*": "(b) asyncio FIFO\nbatch {size} (its best)", "c": "(c) RQ\njob per request",
         "d1": "(d) batchery\n1 worker", "d1t": "(d) batchery\n1 worker, 1 batch\nat a time",
         "d2": "(d) batchery\n2 workers"}


def plot(rows: dict[str, dict[str, Any]], n: int) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        common.log("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return
    labels = [SHORT[key].format(**row) for key, row in rows.items()]
    rows = list(rows.values())
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    bars = left.bar(labels, [r["rps"] for r in rows], color="#4c72b0")
    left.bar_label(bars, labels=[f"{r['ratio']:.2f}x" for r in rows])
    left.set_ylabel("requests/s (higher is better)")
    left.set_title(f"MiniLM over {n} paragraphs, {common.CORES}-core CPU")
    right.bar(labels, [100 * r["padding"] for r in rows], color="#55a868")
    right.set_ylabel("padding efficiency, % (real / padded tokens)")
    right.set_ylim(0, 105)
    for axis in (left, right):
        axis.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(common.OUT / "model.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
