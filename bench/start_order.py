"""Defaults and start order: one worker with no tuning flags, against the limit.

The texts are passages of the Python language reference (bench/corpus.py ``passages``:
mixed lengths, some past the 256 tokens MiniLM keeps), not the stdlib docstrings.

(a) the limit: in-process, batches cut from the whole set sorted by exact length, the
    best batch size of a sweep, torch on every core; and (a) again at the batch size
    the worker chose, for its padding efficiency
(i) warm: ``batchery worker --task embed --model minilm`` (no other flag) serving, then
    ``Client.map`` from a producer that has the tokenizer (counts exactly)
(i') warm, the producer without transformers (every request priced by estimate)
(ii) cold: every request enqueued first by a producer without transformers, then the
    same worker started; timed from its registration (model loaded) to the last result

On a machine with a GPU, ``--device auto`` (the default) runs (a) there, in the worker's
default dtype (float16), and the worker, started with no flags, picks it too; its sweep
then goes up to batches of 512. ``--device cpu`` keeps both on the CPU.

``python -m bench.start_order [--quick] [-n N] [--repeat R] [--device D]``: a table with
each row's ratio to (a) and the targets; bench/out/start_order.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # before transformers is imported

from batchery import Client  # noqa: E402
from bench import common  # noqa: E402
from bench.corpus import passages  # noqa: E402
from bench.model import COLUMNS, best, check, load_model, measure, sorted_loop, sweep  # noqa: E402

SWEEP = (8, 16, 32, 64)
GPU_SWEEP = (32, 64, 128, 256, 512)
WORKER = ("--task", "embed", "--model", "minilm")  # and nothing else: the defaults


def producer(url: str, queue: str, n: int, mode: str) -> subprocess.Popen:
    """``produce`` in a child without transformers; prints JSON."""
    return common.without_transformers("from bench.start_order import produce; "
                                       f"produce({url!r}, {queue!r}, {n}, {mode!r})")


def produce(url: str, queue: str, n: int, mode: str) -> None:
    """map: Client.map and print its seconds; enqueue: queue everything, no waiting."""
    assert "transformers" not in sys.modules or sys.modules["transformers"] is None
    texts = passages(n)
    with Client(url, queue) as client:
        assert client.count_tokens(texts[0]) is None, "this producer must not count exactly"
        started = time.perf_counter()
        if mode == "map":
            assert all(r.ok for r in client.map(texts, max_in_flight=len(texts)))
        else:
            for i in range(0, n, 500):
                client.enqueue_many([{"input": t} for t in texts[i:i + 500]], reply=False)
    print(json.dumps({"seconds": time.perf_counter() - started}))


class Worker:
    """One ``batchery worker`` with no tuning flags, its metrics on a free port."""

    def __init__(self, url: str, queue: str, device: str) -> None:
        self.port = common.free_port()
        pinned = () if device == "auto" else ("--device", device)
        self.proc = common.batchery_worker(url, queue, *WORKER, *pinned,
                                           "--metrics-port", str(self.port))

    def batch_size(self) -> int:
        return int(common.metrics(self.port)["batchery_max_batch_size"])

    def stop(self) -> None:
        common.stop([self.proc])


def totals(client: Client) -> dict[str, int]:
    return client.queue.stats()["totals"]


def row(label: str, n: int, seconds: float, t: dict[str, int], size: int) -> dict[str, Any]:
    return {"system": label, "requests": n, "seconds": seconds, "rps": n / seconds,
            "padding": t["tokens"] / t["padded_tokens"], "batch": n / t["batches"], "size": size}


def warm(url: str, texts: list[str], exact: bool, device: str) -> dict[str, Any]:
    queue = f"warm-{int(exact)}-{time.monotonic_ns()}"
    worker = Worker(url, queue, device)
    try:
        with Client(url, queue) as client:
            common.wait_until(lambda: client.queue.stats()["workers"] >= 1, 300, "the worker")
            client.map(texts[: len(texts) // 5])  # untimed: warms each batch shape, like (a)
            client.queue.client.delete(client.queue.keys.stats)
            if exact:
                started = time.perf_counter()
                assert all(r.ok for r in client.map(texts, max_in_flight=len(texts)))
                seconds = time.perf_counter() - started
            else:
                child = producer(url, queue, len(texts), "map")
                seconds = json.loads(child.communicate()[0])["seconds"]
            label = ("(i) warm, producer counts exactly" if exact
                     else "(i') warm, producer without transformers")
            return row(label, len(texts), seconds, totals(client), worker.batch_size())
    finally:
        worker.stop()


def cold(url: str, texts: list[str], device: str) -> dict[str, Any]:
    queue = f"cold-{time.monotonic_ns()}"
    with Client(url, queue) as client:
        child = producer(url, queue, len(texts), "enqueue")
        child.communicate()
        assert client.queue.stats()["pending"] == len(texts), "not everything was enqueued"
        worker = Worker(url, queue, device)
        try:
            common.wait_until(lambda: client.queue.stats()["workers"] >= 1, 300, "the worker")
            started = time.perf_counter()
            common.wait_until(lambda: totals(client).get("ok", 0) >= len(texts), 3600,
                              "every result", interval=0.02)
            seconds = time.perf_counter() - started
            return row("(ii) cold: all queued by a producer without transformers, then the "
                       "worker", len(texts), seconds, totals(client), worker.batch_size())
        finally:
            worker.stop()


def key_of(found: dict[str, Any]) -> str:
    return found["system"].split(" ")[0]


def points(name: str, diff: float, most: float = 3.0) -> str:
    return (f"{name}: {diff:+.1f} points (target >= -{most:g}): "
            f"{'met' if diff >= -most else 'MISSED'}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("-n", type=int, help="passages (default 2000; --quick 400)")
    p.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda")
    args = p.parse_args(argv)
    n = args.n or (400 if args.quick else 2000)
    texts = passages(n)
    common.log(f"start order: MiniLM, {n} passages; loading the in-process model ...")
    runner = load_model(common.CORES, args.device)
    on_gpu = runner.device.type == "cuda"
    if on_gpu:  # as a worker on a GPU tokenizes (workers/cli.py): the limit does no less
        os.environ["TOKENIZERS_PARALLELISM"] = "true"
    common.freeze()
    common.log(f"(a) sweeping batch sizes over length-sorted batches on {runner.device} ...")
    # on a GPU each batch shape is slow the first time it runs (kernel choice): the best of
    # two passes at least (an H100's first pass at batch 128: 630/s; timed again: 1,415/s)
    limit = best(sweep("(a) in-process, sorted, batch {size}", list(GPU_SWEEP if on_gpu else SWEEP),
                       max(args.repeat, 2) if on_gpu else args.repeat,
                       lambda s: sorted_loop(runner, texts, s)))
    rows: dict[str, list[dict[str, Any]]] = {}
    with common.private_redis() as url:
        for _ in range(args.repeat):
            for key, run in (("i", lambda: warm(url, texts, True, args.device)),
                             ("i'", lambda: warm(url, texts, False, args.device)),
                             ("ii", lambda: cold(url, texts, args.device))):
                common.log(f"({key}) ...")
                found = run()
                rows.setdefault(key, []).append(found)
                common.log(f"  {found['system']}: {found['rps']:.1f} requests/s")
    final = {key: best(found) for key, found in rows.items()}
    same = {size: dict(measure(f"(a) in-process, sorted, batch {size} (a worker's)",
                               lambda: sorted_loop(runner, texts, size)), size=size)
            for size in sorted({r["size"] for r in final.values()})}
    table_rows = [limit, *(r for s, r in same.items() if s != limit["size"]), *final.values()]
    for r in table_rows:
        r["ratio"] = r["rps"] / limit["rps"]
    text = common.table(table_rows, COLUMNS)
    checks = [check(f"{key_of(r)} / (a)", r["ratio"], 0.95) for r in final.values()]
    checks += [points(f"{key_of(r)} padding efficiency against (a) at batch {r['size']}",
                      100 * (r["padding"] - same[r["size"]]["padding"])) for r in final.values()]
    where = common.accelerator(runner.device)
    print(f"\n## Defaults and start order: MiniLM, {n} passages ({common.machine()}, {where})\n\n"
          f"{text}\n\n" + "\n".join(checks) + "\n")
    common.save("start_order", {"machine": common.machine(), "device": where, "requests": n, "limit": limit,
                                "same_size": list(same.values()), "rows": final, "all": rows, "targets": checks})
    return {"rows": final, "table": text, "targets": checks}


if __name__ == "__main__":
    main()
