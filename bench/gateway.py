"""Gateway cost: the OpenAI API through `batchery serve` against the Python client straight
to the same worker.

One MiniLM embed worker and one generate worker (bench/generate.py's random GPT-2, ~10M
parameters), all on default flags, one private redis-server, one `batchery serve`. Each
row of the embeddings table sends single-input requests, N at a time, as fast as they come
back: through the gateway (POST /v1/embeddings over keep-alive HTTP/1.1 connections, one
per concurrent caller, from a minimal asyncio client so that the load generator costs
little) or with AsyncClient.submit in this process. Then time to first token, one request
at a time: /v1/completions with stream: true (the first data event with text) against
AsyncHandle.stream() (the first text event).

The rows at 64: closed (each caller sends again as soon as its answer is back: the model
saturated, so a caller's latency is 64 / throughput) and paced (Poisson arrivals at
PACED_LOAD of the direct path's throughput, on the first of 64 callers free: the latency
of a pool with room). Each row runs in ROUNDS rounds alternating the two paths; "median
added" is the median over the rounds of each round's gateway median less its direct one,
with a bootstrap interval over the rounds (the machine's drift moves whole rounds).

By default the workers run on cores of their own (the upper half of this process's CPUs)
and the gateway, Redis and the load generator on the rest: as deployed, the model runs on
its accelerator and `batchery serve` is a Deployment of its own, so the gateway's CPU is
not taken from the model. ``--shared-cores`` runs everything on every core, as the first
measurements did (on a CPU-only machine of two cores the gateway then competes with the
model it feeds).

`batchery serve` runs with its default processes (half the cores it may use, 1 to 4);
``--gateway-processes N`` runs `batchery serve --processes N`. Its CPU per request is that
of all its processes.

``python -m bench.gateway [--quick] [-n N] [--shared-cores] [--gateway-processes N]``
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from batchery import AsyncClient, Client
from batchery.config import usable_cpus
from batchery.gateway.cli import default_processes
from bench import common
from bench.generate import build_model, worker_args

CONCURRENCY = (64, 1)
# the paced row's arrival rate: this share of the direct path's throughput at 64, so that
# neither path is saturated and the latency added is the gateway's, not the model's backlog
PACED_LOAD = 0.5
PACED_SEED = 7  # one Poisson schedule of arrivals, the same for both paths
ROUNDS = 8        # each row's requests in this many turns, alternating the two paths
TEXT = "The quick brown fox jumps over the lazy dog near the river bank."
COLUMNS = [("path", "path", ""), ("concurrency", "at once", "d"),
           ("offered", "arrivals/s (paced)", ".0f"), ("requests", "requests", ",d"),
           ("rps", "requests/s", ",.0f"), ("p50_ms", "p50 ms", ".2f"), ("p99_ms", "p99 ms", ".2f"),
           ("added_ms", "median added ms (rounds)", "+.2f"), ("added_interval", "90% interval", ""),
           ("batch", "mean batch", ".1f"), ("gateway_us", "gateway CPU us/request", ".0f")]
TTFT_COLUMNS = [("path", "path", ""), ("requests", "requests", "d"), ("p50_ms", "p50 ms", ".2f"),
                ("p90_ms", "p90 ms", ".2f")]


class Connection:
    """One keep-alive HTTP/1.1 connection: a request out, the status and body back."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> "Connection":
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                          f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = next(int(x.split(":", 1)[1]) for x in lines if x.lower().startswith("content-length:"))
        return int(lines[0].split()[1]), await self.reader.readexactly(length)

    async def first_event(self, path: str, body: bytes) -> float:
        """Send a streaming request; seconds to the first data event with text, then
        read the rest of the stream (chunked) to its end."""
        started = time.perf_counter()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                          f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        await self.reader.readuntil(b"\r\n\r\n")
        first = None
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
            data = await self.reader.readexactly(size + 2)
            if size == 0:
                return first if first is not None else float("nan")
            if first is None and b'"text":"' in data and b'"text":""' not in data:
                first = time.perf_counter() - started

    def close(self) -> None:
        self.writer.close()


async def load(call: Callable[[int], Awaitable[None]], n: int, concurrency: int
               ) -> tuple[float, list[float]]:
    """``n`` calls, ``concurrency`` callers each making its share one after another:
    (seconds, each call's latency)."""
    latencies: list[float] = []

    async def caller(k: int) -> None:
        for _ in range(k, n, concurrency):
            started = time.perf_counter()
            await call(k)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(concurrency)))
    return time.perf_counter() - started, latencies


async def paced(call: Callable[[int], Awaitable[None]], n: int, concurrency: int, rate: float
                ) -> tuple[float, list[float]]:
    """``n`` calls arriving at ``rate`` a second (Poisson, the same seeded schedule for every
    path), on the first of ``concurrency`` callers free: (seconds, each call's latency
    from its scheduled arrival, so that a call kept waiting for a free caller counts it)."""
    gaps = random.Random(PACED_SEED)
    free: asyncio.Queue[int] = asyncio.Queue()
    for k in range(concurrency):
        free.put_nowait(k)
    latencies: list[float] = []

    async def one(due: float) -> None:
        k = await free.get()
        try:
            await call(k)
        finally:
            free.put_nowait(k)
        latencies.append(time.perf_counter() - due)

    started = due = time.perf_counter()
    tasks = []
    for _ in range(n):
        due += gaps.expovariate(rate)
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        tasks.append(asyncio.create_task(one(due)))
    await asyncio.gather(*tasks)
    return time.perf_counter() - started, latencies


def row(path: str, concurrency: int, seconds: float, latencies: list[float]) -> dict[str, Any]:
    return {"path": path, "concurrency": concurrency, "requests": len(latencies),
            "rps": len(latencies) / seconds, "p50_ms": 1000 * common.percentile(latencies, 0.5),
            "p99_ms": 1000 * common.percentile(latencies, 0.99)}


async def embeddings(url: str, port: int, queue: str, n: int, gateway_pid: int) -> list[dict[str, Any]]:
    """The rows: 64 callers as fast as they come back, 64 callers paced at PACED_LOAD of
    the direct path's throughput there, one caller."""
    body = json.dumps({"model": queue, "input": TEXT}).encode()
    rows: list[dict[str, Any]] = []
    stats = Client(url, queue)  # the worker's totals: requests and batches it ran
    async with AsyncClient(url, queue) as client:
        await client.map([TEXT] * 200)  # warm: scripts loaded, the model's first batches run
        for concurrency, pace in ((CONCURRENCY[0], None), (CONCURRENCY[0], PACED_LOAD),
                                  (CONCURRENCY[1], None)):
            count = n if concurrency > 1 else max(200, n // 20)
            rate = pace and pace * rows[1]["rps"]  # rows[1]: the direct path at 64
            connections = [await Connection.open(port) for _ in range(concurrency)]

            async def through_gateway(k: int) -> None:
                status, _ = await connections[k].post("/v1/embeddings", body)
                assert status == 200, status

            async def direct(_k: int) -> None:
                assert (await client.submit(TEXT, timeout=120)).ok

            async def run(call: Callable[[int], Awaitable[None]], count: int
                          ) -> tuple[float, list[float]]:
                if rate:
                    return await paced(call, count, concurrency, rate)
                return await load(call, count, concurrency)

            await load(through_gateway, min(count, 500), concurrency)  # warm the HTTP path
            paths = (("gateway /v1/embeddings", through_gateway), ("AsyncClient.submit", direct))
            # seconds, latencies, gateway CPU, requests and batches the worker ran
            # per path: seconds, latencies, gateway CPU, the requests and batches the worker ran
            spent = {p: {"seconds": 0.0, "latencies": [], "cpu": 0.0, "ran": 0, "batches": 0}
                     for p, _ in paths}
            added = []  # each round's median through the gateway less the direct one's
            for _ in range(ROUNDS):  # alternated, so that the machine's load drifts on both
                for c in connections:
                    c.close()
                connections[:] = [await Connection.open(port) for _ in range(concurrency)]
                medians = []  # this round's, in the order of paths
                for path, call in paths:
                    common.log(f"embeddings: {path}, {count // ROUNDS:,} requests, "
                               f"{concurrency} at a time" + (f", {rate:.0f}/s" if rate else "")
                               + " ...")
                    cpu, before = common.tree_cpu_seconds(gateway_pid), stats.queue.stats()["totals"]
                    seconds, latencies = await run(call, count // ROUNDS)
                    after, total = stats.queue.stats()["totals"], spent[path]
                    total["seconds"] += seconds
                    total["latencies"] += latencies
                    total["cpu"] += common.tree_cpu_seconds(gateway_pid) - cpu
                    total["ran"] += after.get("ok", 0) - before.get("ok", 0)
                    total["batches"] += after.get("batches", 0) - before.get("batches", 0)
                    medians.append(common.percentile(latencies, 0.5))
                added.append(medians[0] - medians[1])
            for path, call in paths:
                total = spent[path]
                rows.append({**row(path, concurrency, total["seconds"], total["latencies"]),
                             "offered": rate, "batch": total["ran"] / max(1, total["batches"])})
                if call is through_gateway:  # the gateway process's CPU per request
                    rows[-1]["gateway_us"] = 1e6 * total["cpu"] / len(total["latencies"])
                    rows[-1]["added_ms"] = 1000 * common.percentile(added, 0.5)
                    # the rounds, not the requests, are the independent samples
                    low, high = common.bootstrap_interval(lambda r: common.percentile(r, 0.5),
                                                          added, seed=PACED_SEED)
                    rows[-1]["added_interval"] = f"{1000 * low:+.1f} to {1000 * high:+.1f}"
            for c in connections:
                c.close()
    stats.close()
    return rows


async def first_tokens(url: str, port: int, queue: str, n: int) -> list[dict[str, Any]]:
    ask = {"prompt": TEXT, "max_new_tokens": 16, "stream": True}
    body = json.dumps({"model": queue, "prompt": TEXT, "max_tokens": 16, "stream": True}).encode()
    gateway_s, direct_s = [], []
    async with AsyncClient(url, queue) as client:
        connection = await Connection.open(port)
        for i in range(n + 5):  # the first 5 of each warm up
            gateway_s.append(await connection.first_event("/v1/completions", body))
            started = time.perf_counter()
            handle = await client.enqueue(ask)
            first = None
            async for event in handle.stream(timeout=60):
                if first is None and event.kind == "text" and event.text:
                    first = time.perf_counter() - started
            direct_s.append(first if first is not None else float("nan"))
        connection.close()
    return [{"path": path, "requests": n, "p50_ms": 1000 * common.percentile(s[5:], 0.5),
             "p90_ms": 1000 * common.percentile(s[5:], 0.9)}
            for path, s in (("gateway stream: true", gateway_s), ("AsyncHandle.stream()", direct_s))]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = common.parser(__doc__.splitlines()[0])
    args.add_argument("-n", type=int, help="requests per embeddings row at concurrency 64 "
                      "(default 6,000)")
    args.add_argument("--shared-cores", action="store_true", help="workers, gateway, Redis "
                      "and load generator all on every core (default: the workers on cores "
                      "of their own)")
    args.add_argument("--gateway-processes", type=int, help="batchery serve --processes "
                      "(default: none given, so serve's own default on the cores it runs on)")
    args = args.parse_args(argv)
    n = args.n or (1_500 if args.quick else 6_000)
    port = common.free_port()
    procs: list[subprocess.Popen] = []
    cores = sorted(os.sched_getaffinity(0))
    model_cores = set() if args.shared_cores or len(cores) < 2 else set(cores[len(cores) // 2:])
    placement = (f"workers on cores {sorted(model_cores)}, the rest on "
                 f"{sorted(set(cores) - model_cores)}" if model_cores else "all on every core")
    if model_cores:  # Redis, the gateway and this process: the other cores
        os.sched_setaffinity(0, set(cores) - model_cores)
    threads = len(model_cores) or None
    # `batchery serve` runs on this process's cores, so its default counts these
    gateway_processes = args.gateway_processes or default_processes(usable_cpus())

    def worker(queue: str, *flags: str) -> subprocess.Popen:
        proc = common.batchery_worker(url, queue, *flags, threads=threads)
        if model_cores:  # before it loads torch: its threads are made on these cores
            os.sched_setaffinity(proc.pid, model_cores)
        return proc

    with common.private_redis() as url, tempfile.TemporaryDirectory() as folder:
        try:
            model_dir = build_model(Path(folder))
            procs.append(worker("embed", "--task", "embed", "--model", "minilm"))
            # on the worker's default device, as the embed worker (a GPU where there is one)
            procs.append(worker("generate", *worker_args(model_dir, common.free_port(), "auto")))
            with Client(url, "embed") as embed, Client(url, "generate") as generate:
                common.wait_until(lambda: embed.queue.stats()["workers"] >= 1
                                  and generate.queue.stats()["workers"] >= 1, 180, "the workers")
            given = ["--processes", str(args.gateway_processes)] if args.gateway_processes else []
            procs.append(common.start([sys.executable, "-m", "batchery", "serve", "--redis-url",
                                       url, "--port", str(port), *given]))
            common.wait_until(lambda: _ready(port), 60, "batchery serve")
            common.freeze()
            rows = asyncio.run(embeddings(url, port, "embed", n, procs[-1].pid))
            ttft = asyncio.run(first_tokens(url, port, "generate", 20 if args.quick else 60))
        finally:
            common.stop(procs)
    summary = _summary(rows, ttft)
    text = common.table(rows, COLUMNS)
    ttft_text = common.table(ttft, TTFT_COLUMNS)
    print(f"\n## Gateway cost: single-input /v1/embeddings vs AsyncClient.submit, MiniLM, "
          f"default flags ({common.machine()}; {placement}; {gateway_processes} gateway "
          f"process(es){'' if args.gateway_processes else ', its default'})\n\n{text}\n\n"
          f"## Time to first token, one at a time (random GPT-2 ~10M parameters)\n\n"
          f"{ttft_text}\n\n{summary['text']}\n")
    common.save("gateway", {"machine": common.machine(), "placement": placement,
                            "gateway_processes": gateway_processes, "rows": rows, "ttft": ttft, **summary})
    return {"rows": rows, "ttft": ttft, "table": text, **summary}


def _summary(rows: list[dict[str, Any]], ttft: list[dict[str, Any]]) -> dict[str, Any]:
    g64, d64, gp, dp, g1, d1 = rows  # embeddings' order: at 64, paced at 64, one at a time
    out = {"throughput_ratio_64": g64["rps"] / d64["rps"],
           "added_p50_ms_64": g64["p50_ms"] - d64["p50_ms"],
           "added_p50_ms_paced": gp["p50_ms"] - dp["p50_ms"],
           "paced_rate": gp["offered"],
           "added_p50_ms_1": g1["p50_ms"] - d1["p50_ms"],
           "ttft_added_p50_ms": ttft[0]["p50_ms"] - ttft[1]["p50_ms"]}
    out["gateway_us_64"] = g64["gateway_us"]
    out["added_64_rounds"], out["added_paced_rounds"] = g64["added_ms"], gp["added_ms"]
    out["text"] = (f"At 64: gateway/direct throughput {out['throughput_ratio_64']:.2f}x, median "
                   f"added {out['added_p50_ms_64']:+.2f} ms (the rounds' median "
                   f"{g64['added_ms']:+.2f} ms, 90% interval {g64['added_interval']}), gateway "
                   f"CPU {out['gateway_us_64']:.0f} us/request; 64 callers paced at "
                   f"{out['paced_rate']:.0f} arrivals/s ({PACED_LOAD:.0%} of the direct "
                   f"path's throughput): median added {out['added_p50_ms_paced']:+.2f} ms (the "
                   f"rounds' median {gp['added_ms']:+.2f} ms, 90% interval "
                   f"{gp['added_interval']}); one at a time: median added "
                   f"{out['added_p50_ms_1']:+.2f} ms; time to first token added "
                   f"{out['ttft_added_p50_ms']:+.2f} ms (medians).")
    return out


def _ready(port: int) -> bool:
    import urllib.request
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2).status == 200
    except OSError:
        return False


if __name__ == "__main__":
    main()
