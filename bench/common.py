"""What every benchmark shares: a private redis-server, worker processes, tables, outputs.

Benchmarks never touch a shared Redis: each starts its own ``redis-server`` on a free
port (no persistence) and stops it at the end. Results go to ``bench/out/`` (ignored by
git): one JSON file per benchmark, plus plots.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import redis

from batchery.embedded import find_redis_server

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
CORES = os.cpu_count() or 1


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # so that `finally` stops the servers and workers we started


def parser(description: str) -> argparse.ArgumentParser:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="fewer requests: a smoke run in about a minute")
    p.add_argument("--repeat", type=int, default=1, help="run each contender this many times; keep the best")
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def private_redis(*extra: str) -> Iterator[str]:
    """A throwaway redis-server on a free port (no AOF, no RDB; ``extra``: more options);
    yields its URL."""
    port, folder = free_port(), tempfile.mkdtemp(prefix="batchery-bench-")
    proc = subprocess.Popen([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", folder, "--save", "", "--appendonly", "no", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    try:
        wait_until(lambda: pings(client), 15, "redis-server to start")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        proc.kill()
        proc.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


def redis_pid(url: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return int(client.info("server")["process_id"])
    finally:
        client.close()


def pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def wait_until(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
    return value


def env(**extra: str) -> dict[str, str]:
    """Environment for child processes: offline models, quiet logs. Not this process's
    TOKENIZERS_PARALLELISM (a benchmark tokenizes on one thread, as a worker on a CPU):
    a worker chooses its tokenizer's threads itself (on a GPU, the host's: workers/cli.py),
    and that choice is what is measured."""
    out = dict(os.environ, HF_HUB_OFFLINE="1", BATCHERY_LOG_LEVEL="WARNING",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out.pop("TOKENIZERS_PARALLELISM", None)
    out.update(extra)
    return out


def start(argv: Sequence[str], threads: int | None = None, **extra: str) -> subprocess.Popen:
    """A child process in the repository root; ``threads`` caps torch/OpenMP threads."""
    if threads:
        extra.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return subprocess.Popen(list(argv), cwd=ROOT, env=env(**extra), stdout=subprocess.DEVNULL,
                            stderr=None)


# A producer on the base install: a child process that cannot import transformers.
NO_TRANSFORMERS = "import sys; sys.modules['transformers'] = None\n"


def without_transformers(code: str) -> subprocess.Popen:
    """``python -c code`` in the repository root, unable to import transformers (so a
    Client there prices requests by estimate, as on the base install); its stdin and
    stdout are text pipes to this process."""
    return subprocess.Popen([sys.executable, "-c", NO_TRANSFORMERS + code], cwd=ROOT, env=env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def batchery_worker(url: str, queue: str, *args: str, threads: int | None = None,
                    **extra: str) -> subprocess.Popen:
    """A real ``batchery worker`` process (warnings go to the benchmark's stderr)."""
    argv = [sys.executable, "-m", "batchery", "worker", "--redis-url", url, "--queue", queue, *args]
    if threads:
        argv += ["--threads", str(threads)]
    return start(argv, threads, **extra)


def metrics(port: int) -> dict[str, float]:
    """A worker's /metrics on ``port``: each series name (labels dropped) -> its value,
    summed over its labels (one worker serves one queue)."""
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in page.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name = series.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def stop(procs: Sequence[subprocess.Popen], timeout: float = 30) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def rq_done(queue: Any, finished: Any, n: int) -> bool:
    """All n RQ jobs finished; raises if any failed (a broken baseline is no baseline)."""
    from rq.registry import FailedJobRegistry
    failed = FailedJobRegistry(queue=queue).count
    if failed:
        raise SystemExit(f"{failed} RQ job(s) failed: see the worker's log above")
    return finished.count >= n


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system) of a process so far; None: this one. Linux only (NaN elsewhere)."""
    if pid is None:
        return time.process_time()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of a process and of its live descendants (a server's worker processes)."""
    total, pids = 0.0, [pid]
    while pids:
        p = pids.pop()
        spent = cpu_seconds(p)
        total += spent if spent == spent else 0.0  # NaN: it exited as it was read
        try:
            pids += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            pass
    return total


def freeze() -> None:
    """Keep the garbage collector's full passes off what is loaded by now (models,
    tokenizers, libraries), as a long-running service would: with transformers loaded
    each pass takes 30-200 ms, a stall that would otherwise land in the latencies."""
    gc.collect()
    gc.freeze()


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """Rows as a Markdown table; columns are (key, header, format spec)."""
    def cell(row: dict[str, Any], key: str, spec: str) -> str:
        value = row.get(key)
        if value is None:
            return "-"
        return format(value, spec) if spec else str(value)
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
             "|" + "|".join("---" if not s else "---:" for _, _, s in columns) + "|"]
    lines += ["| " + " | ".join(cell(r, k, s) for k, _, s in columns) + " |" for r in rows]
    return "\n".join(lines)


def save(name: str, data: Any) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str))
    return path


def machine() -> str:
    import platform
    return f"{CORES}-core {platform.machine()} {platform.system()}, Python {platform.python_version()}"


def bootstrap_interval(statistic: Callable[..., float], *samples: Sequence[float],
                       seed: int = 5, resamples: int = 2000) -> tuple[float, float]:
    """The 90% bootstrap interval of ``statistic(*samples)``: each sample resampled with
    replacement ``resamples`` times (a seeded generator: the same data, the same interval)."""
    rng = random.Random(seed)
    values = sorted(statistic(*(rng.choices(sample, k=len(sample)) for sample in samples))
                    for _ in range(resamples))
    return values[int(0.05 * resamples)], values[int(0.95 * resamples)]


def accelerator(device: Any) -> str:
    """What a torch device is, for a table's title: the GPU's name, or CPU."""
    if getattr(device, "type", str(device)) != "cuda":
        return "CPU"
    import torch
    return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class ReplyReader:
    """A client's reader as producer/replies.py reads (reply_lists.ReadState): marked,
    reading its reply list alone once a read went through, the results kept under their
    keys deleted by the next read."""

    def __init__(self, conn: redis.Redis, keys: Any, client: str) -> None:
        from batchery.batching.reply_lists import ReadState
        self.conn, self.keys, self.client = conn, keys, client
        self.state = ReadState(alone=True)
        self.read()
        self.read()  # marked reading alone from here on, as a Client's reader is

    def read(self, block_s: float = 0.001) -> int:
        """One read; the results it got."""
        from batchery.batching.reply_lists import parse_reply_read, reply_read
        read = self.state.next_read(time.monotonic())
        pipe = self.conn.pipeline(transaction=False)
        deletes = reply_read(pipe, [self.keys], self.client, read.parity, read.alone, block_s,
                             [self.keys.result(i) for i in read.forget], mark=read.mark)
        popped = parse_reply_read(pipe.execute(raise_on_error=False), deletes, 1, read.mark)
        self.state.done(read, popped, popped.results, lambda: True)
        return len(popped.results)
