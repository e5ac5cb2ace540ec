"""Worker features: warm-up, exact token recount and budget splits, producer token counts,
--concurrency supervision."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from batchery import Client
from batchery.connection import RedisSettings
from batchery.batching import pricing
from batchery.batching.messages import Result
from batchery.batching.queue import RequestQueue
from batchery.batching.request import Request
from batchery.workers.leases import Leases
from batchery.workers.loop import Worker
from batchery.workers.options import WorkerOptions
from batchery.workers.runners.base import Prepared, Runner
from batchery.workers.runners.hf import resolve_model
from tests.conftest import (ROOT, RedisServer, child_pids, cli_env, free_port, run_cli, start_worker,
                            stop_process, wait_for)


class Recording(Runner):
    """Counts words as tokens and records what it is asked to do, in order."""

    warmup_inputs = ["warm up"]

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def prepare(self, inputs: list[Any]) -> Prepared:
        lengths = [len(str(v).split()) for v in inputs]
        self.calls.append(("prepare", list(inputs)))
        return Prepared(list(inputs), lengths, max(lengths) * len(lengths))

    def run(self, data: Any) -> list[Any]:
        self.calls.append(("run", list(data)))
        return [len(str(v).split()) for v in data]

    def count_tokens(self, inputs: list[Any]) -> list[int | None]:
        return [len(str(v).split()) for v in inputs]



class Counting(Recording):
    """Recording, and every input it was asked to count, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.counted: list[Any] = []

    def count_tokens(self, inputs: list[Any]) -> list[int | None]:
        self.counted.extend(inputs)
        return super().count_tokens(inputs)


@given(st.lists(st.tuples(st.sampled_from([1, 2, 5, 16]), st.sampled_from([False, False, True])),
                min_size=1, max_size=30),
       st.integers(1, 4), st.sampled_from([10_000, 24]), st.integers(1, 12))
@settings(max_examples=30, deadline=None)
def test_a_counting_worker_counts_each_estimated_request_once_and_keeps_the_budget(
        redis_server: RedisServer, words: list[tuple[int, bool]], max_size: int,
        max_tokens: int, lookahead: int) -> None:
    """Whatever mix of estimated and exact requests (exact: the producer's count is the
    worker's), batch sizes, budgets and lookaheads: every request runs once, each
    estimated one is counted at most once (pricing rounds and the lists priced ahead
    together), and every batch of two or more keeps the budget on exact counts."""
    texts = [" ".join([f"w{i}"] + ["x"] * (n - 1)) for i, (n, _) in enumerate(words)]
    estimated = {t for t, (_, exact) in zip(texts, words) if not exact}
    name, runner = f"t-{uuid.uuid4().hex[:10]}", Counting()
    with Client(redis_server.url, name) as client:
        handles = client.enqueue_many([{"input": t, **({} if t in estimated else {"tokens": n})}
                                       for t, (n, _) in zip(texts, words)])
        Worker(RedisSettings.from_url(redis_server.url), runner,
               WorkerOptions(queue=name, max_wait_ms=0, max_batch_size=max_size,
                             max_batch_tokens=max_tokens, lookahead=lookahead)
               ).run(burst=True, handle_signals=False)
        assert {h.result(timeout=30).status for h in handles} == {"ok"}
    batches = [inputs for kind, inputs in runner.calls if kind == "prepare"][1:]  # after warm-up
    assert sorted(t for batch in batches for t in batch) == sorted(texts)
    counted = [t for t in runner.counted if t in estimated]
    assert len(counted) == len(set(counted)), "an estimated request was counted twice"
    for batch in batches:
        if len(batch) > 1:
            assert max(len(t.split()) for t in batch) * len(batch) <= max_tokens, batch

def test_warm_up_runs_before_the_first_claim(redis_url: str, queue_name: str) -> None:
    runner = Recording()
    with Client(redis_url, queue_name) as client:
        client.enqueue("real work")
        Worker(RedisSettings.from_url(redis_url), runner,
               WorkerOptions(queue=queue_name, max_wait_ms=0)).run(burst=True, handle_signals=False)
    assert runner.calls[:2] == [("prepare", ["warm up"]), ("run", ["warm up"])]
    assert ("run", ["real work"]) in runner.calls


def test_an_underestimated_batch_is_split_to_fit_the_exact_token_budget(redis_url: str,
                                                                        queue_name: str) -> None:
    runner = Recording()
    long_text = " ".join(["word"] * 30)
    with Client(redis_url, queue_name) as client:
        # the producer claims 1 token each; the runner counts 30 and 1 words
        handles = client.enqueue_many([{"input": t, "tokens": 1} for t in
                                       [long_text, long_text, "x", "y", "z", "w"]])
        Worker(RedisSettings.from_url(redis_url), runner,
               WorkerOptions(queue=queue_name, max_wait_ms=0, max_batch_tokens=60)
               ).run(burst=True, handle_signals=False)
        results = [h.result(timeout=30) for h in handles]
    assert {r.status for r in results} == {"ok"}
    runs = [data for kind, data in runner.calls[2:] if kind == "run"]
    assert all(max(len(str(v).split()) for v in batch) * len(batch) <= 60 for batch in runs)
    assert len(runs) == 2  # one claim of 6, run as [x y z w] and [long long]


def test_producers_count_with_the_queue_tokenizer_once_it_appears(redis_url: str, queue_name: str,
                                                                 monkeypatch: Any) -> None:
    monkeypatch.setattr(pricing, "REFRESH_S", 0.2)
    text = "Return the absolute value of the argument."
    with Client(redis_url, queue_name) as client:
        client.enqueue(text, id="before")  # no tokenizer known yet: priced by estimate
        run_cli("queue", "config", queue_name, "--tokenizer", resolve_model("minilm"),
                "--max-input-tokens", "256", redis_url=redis_url)
        # the same client asks again while it has no tokenizer
        wait_for(lambda: client.count_tokens(text) is not None, 5, "the client to load the tokenizer")
        client.enqueue(text, id="after")
        client.enqueue(" ".join(["word"] * 600), id="long")
        sched = client.queue.client.hmget(client.queue.keys.sched, ["before", "after", "long"])
    counts = [s.split(":")[0] for s in sched]
    assert counts[0] == f"~{2 + len(text) // 4}"  # marked: a worker counts it before claiming
    assert counts[1] == "10"  # [CLS] + 8 word pieces + [SEP]
    assert counts[2] == "256"  # capped at what the workers truncate to


def test_a_worker_prices_estimated_requests_exactly_before_choosing_a_batch(
        redis_url: str, queue_name: str) -> None:
    short_words = " ".join("abcdefghijklmnop")    # 16 words, estimated at 9 tokens
    long_words = " ".join(["internationalization"] * 16)  # 16 words, estimated at 85
    two_words = " ".join(["internationalization"] * 2)    # 2 words, estimated at 12
    runner = Recording()
    with Client(redis_url, queue_name) as client:
        handles = client.enqueue_many([{"input": t} for t in (short_words, two_words, long_words)])
        Worker(RedisSettings.from_url(redis_url), runner,
               WorkerOptions(queue=queue_name, max_wait_ms=0, max_batch_size=2)
               ).run(burst=True, handle_signals=False)
        assert {h.result(timeout=30).status for h in handles} == {"ok"}
    # each of the three was counted once, by the first claim (its own queue's label)
    assert REGISTRY.get_sample_value("batchery_repriced_total", {"queue": queue_name}) == 3
    claims = [inputs for kind, inputs in runner.calls[2:] if kind == "prepare"]
    # on the estimates the head (9) would pair with the two long words (12); on the
    # worker's exact counts it pairs with its equal (16 and 16)
    assert claims == [[short_words, long_words], [two_words]]


def test_an_operator_set_tokenizer_is_not_overwritten_by_a_worker(redis_url: str,
                                                                   queue_name: str) -> None:
    run_cli("queue", "config", queue_name, "--tokenizer", "org/their-tokenizer",
            redis_url=redis_url)
    runner = Recording()
    runner.tokenizer, runner.max_input_tokens = "org/model-dir", 128
    Worker(RedisSettings.from_url(redis_url), runner,
           WorkerOptions(queue=queue_name)).run(burst=True, handle_signals=False)
    settings = json.loads(run_cli("queue", "config", queue_name, "--json",
                                  redis_url=redis_url).stdout)
    assert (settings["tokenizer"], settings["max_input_tokens"]) == ("org/their-tokenizer", 128)


def test_concurrency_runs_and_supervises_several_processes(redis_url: str, queue_name: str,
                                                           tmp_path: Path) -> None:
    run_cli("queue", "config", queue_name, "--lease-seconds", "1", redis_url=redis_url)
    port = free_port()
    parent = start_worker(redis_url, queue_name, "--runner", "tests.runners:echo", "--concurrency",
                          "2", "--metrics-port", str(port), log=tmp_path / "pool.log")

    def scraped(name: str) -> float:
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        return sum(float(line.split()[-1]) for line in page.splitlines()
                   if line.startswith(name) and not line.startswith("#"))

    def live_workers() -> int:
        stats = json.loads(run_cli("queue", "stats", "--json", "-q", queue_name, redis_url=redis_url).stdout)
        return stats["queues"][queue_name]["workers"]
    try:
        wait_for(lambda: live_workers() == 2, 60, interval=0.3, message="two worker processes")
        done = run_cli("enqueue", "-q", queue_name, "--text", "a", "--text", "b", "--wait",
                       redis_url=redis_url)
        assert done.returncode == 0 and done.stdout.count('"ok"') == 2
        # one port for the whole pool: the parent adds up its children's metrics
        wait_for(lambda: scraped("batchery_requests_total{") == 2, 30, interval=0.2,
                 message="both requests counted on the pool's one metrics port")
        first = child_pids(parent.pid)
        os.kill(min(first), signal.SIGKILL)  # a crashed child is replaced
        wait_for(lambda: len(now := child_pids(parent.pid)) == 2 and now != first, 30, interval=0.2,
                 message="the crashed process to be restarted")
        os.kill(min(child_pids(parent.pid)), signal.SIGKILL)  # a stop in its restart pause
        wait_for(lambda: (tmp_path / "pool.log").read_text().count("restarting in") == 2, 30,
                 message="the parent to see the second crash")
    finally:
        assert stop_process(parent, signal.SIGTERM) == 0  # the crashed one not started again
    wait_for(lambda: live_workers() == 0, 30, interval=0.3, message="no live workers")


def test_concurrency_spreads_its_processes_over_the_gpus(redis_url: str, queue_name: str,
                                                         tmp_path: Path) -> None:
    parent = start_worker(redis_url, queue_name, "--runner", "tests.runners:which_gpu",
                          "--concurrency", "3", log=tmp_path / "pool.log",
                          CUDA_VISIBLE_DEVICES="3,5", PIN_DIR=str(tmp_path))
    try:
        def pins() -> list[str]:
            return sorted(p.read_text() for p in tmp_path.iterdir() if p.name.isdigit())
        wait_for(lambda: len(pins()) == 3, 60, interval=0.2, message="three worker processes")
        assert pins() == ["3", "3", "5"]  # child i on GPU i mod 2 of those it may use
    finally:
        assert stop_process(parent, signal.SIGTERM) == 0


def test_parallel_batches_share_one_model_and_stop_cleanly(redis_url: str, queue_name: str,
                                                           tmp_path: Path) -> None:
    marks, gate = tmp_path / "running", tmp_path / "gate"
    marks.mkdir()
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:timed",
                          "--parallel-batches", "2", "--max-batch-size", "2", "--max-wait-ms", "0",
                          log=tmp_path / "worker.log", BATCHERY_TEST_SLEEP="0.4",
                          BATCHERY_TEST_MARK=str(marks), BATCHERY_TEST_GATE=str(gate))
    try:
        with Client(redis_url, queue_name) as client:
            wait_for(lambda: client.queue.stats()["workers"] == 1, 60, message="the worker")
            results = client.map([f"text {i}" for i in range(12)], timeout=60)
            assert [r.output["input"] for r in results] == [f"text {i}" for i in range(12)]
            runs = sorted({(r.output["start"], r.output["end"], r.output["thread"]) for r in results})
            assert len(runs) == 6 and len({thread for _, _, thread in runs}) == 2
            at_once = [sum(1 for s, e, _ in runs if s <= start < e) for start, _, _ in runs]
            assert max(at_once) <= 2  # never more than two batches at a time
            assert {r.output["torch_threads"] for r in results} == {max(1, len(os.sched_getaffinity(0)) // 2)}
            # held at the gate: two batches run at once, the third waits; SIGTERM then: both
            # running batches commit, the prefetched one goes back
            gate.touch()
            handles = client.enqueue_many([{"input": f"last {i}"} for i in range(6)])
            wait_for(lambda: len(list(marks.iterdir())) == 2, 30, message="two batches running")
            # and the third claimed ahead (the claim follows the runs' start): 6 leases
            wait_for(lambda: client.queue.stats()["inflight"] == 6, 30,
                     message="a third batch claimed ahead")
            assert len(list(marks.iterdir())) == 2  # held at the gate: still two running
            worker.send_signal(signal.SIGTERM)
            wait_for(lambda: "SIGTERM: finishing" in (tmp_path / "worker.log").read_text(), 20)
            gate.unlink()
            assert worker.wait(30) == 0
            finished = [h for h in handles if h.done() or client.queue.result(h.id)]
            assert len(finished) == 4
            assert client.queue.stats()["pending"] == 2
    finally:
        stop_process(worker)
    assert "Traceback" not in (tmp_path / "worker.log").read_text()


def test_a_burst_worker_with_parallel_batches_drains_and_exits(redis_url: str, queue_name: str) -> None:
    with Client(redis_url, queue_name) as client:
        handles = client.enqueue_many([{"input": f"t{i}"} for i in range(30)])
        worker = Worker(RedisSettings.from_url(redis_url), Recording(),
                        WorkerOptions(queue=queue_name, max_batch_size=2, max_wait_ms=0,
                                      parallel_batches=3))
        assert worker.run(burst=True, handle_signals=False) == 0
        assert [h.result(timeout=30).output for h in handles] == [1] * 30
        assert worker.batches_run == 15


def test_sigterm_while_the_model_loads_stops_the_worker_at_once(redis_url: str, queue_name: str,
                                                               tmp_path: Path) -> None:
    worker = start_worker(redis_url, queue_name, "--task", "embed", "--model", "minilm",
                          log=tmp_path / "worker.log")
    wait_for(lambda: "torch" in Path(f"/proc/{worker.pid}/maps").read_text(), 60, interval=0.05,
             message="the worker to be loading its model")
    worker.send_signal(signal.SIGTERM)
    try:
        code = worker.wait(5)  # not after the load, the warm-up and the batch-size timing
    finally:
        stop_process(worker, signal.SIGKILL)
    assert code in (0, -signal.SIGTERM)
    with Client(redis_url, queue_name) as client:
        assert client.queue.stats()["workers"] == 0


def test_a_containers_cpu_limit_caps_the_cpus_a_process_sizes_itself_to(tmp_path: Path,
                                                                         monkeypatch: Any) -> None:
    """Workers (threads, parallel batches) and `batchery serve` (its processes) size
    themselves to usable_cpus."""
    from batchery import config
    limit, v1 = tmp_path / "cpu.max", tmp_path / "v1"
    monkeypatch.setattr(config, "CGROUP_CPU_MAX", str(limit))
    monkeypatch.setattr(config, "CGROUP_V1_CPU", str(v1))
    affinity = len(os.sched_getaffinity(0))
    assert config.usable_cpus() == affinity  # no cgroup file: the affinity
    limit.write_text("150000 100000\n")      # 1.5 CPUs
    assert config.usable_cpus() == 1
    limit.write_text("max 100000\n")
    assert config.usable_cpus() == affinity
    limit.unlink()  # cgroup v1: a quota and a period in two files, -1 for none
    v1.mkdir()
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    assert config.usable_cpus() == 1
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert config.usable_cpus() == affinity


def test_a_renew_racing_a_commit_is_no_lost_lease(rconn: Any, queue_name: str) -> None:
    """The heartbeat renews what it held when it looked; a commit meanwhile deletes those
    leases: while the writer is committing them they are not reported lost."""
    queue = RequestQueue(rconn, queue_name)
    queue.enqueue([Request(id="a", input=1), Request(id="b", input=2)])
    claimed = queue.claim("w#1", 8, 8192, 0, 64).batch
    leases = Leases()
    leases.add(claimed)
    snapshot = leases.snapshot()  # the heartbeat looks, then the writer commits
    leases.committing(["a"])
    done = [(r.id, r.lease_token, Result(id=r.id, status="ok", attempts=1).to_json()) for r in claimed]
    assert queue.complete(done, {}, ["", ""]) == [True, True]
    lost = queue.renew("w", snapshot)
    assert sorted(lost) == ["a", "b"]  # both gone from Redis
    assert leases.still_held(lost) == ["b"]  # a is being committed; b is truly lost to us
    leases.drop(["a", "b"])
    assert leases.still_held(lost) == [] and len(leases) == 0


@pytest.mark.parametrize("placed, expected", [("gpu", "true"), ("cpu", "false")])
def test_a_worker_on_a_gpu_lets_the_tokenizer_use_its_threads(redis_url: str, queue_name: str,
                                                              placed: str, expected: str) -> None:
    """On a CPU the model needs every core, so a worker tokenizes on one thread; on a GPU
    the cores are free and one tokenizing thread bounds the worker. A setting in the
    environment wins either way."""
    env = cli_env(redis_url)
    env.pop("TOKENIZERS_PARALLELISM", None)
    for preset, wanted in ((None, expected), ("false" if expected == "true" else "true", None)):
        if preset is not None:
            env["TOKENIZERS_PARALLELISM"] = preset
        with Client(redis_url, queue_name) as client:
            handle = client.enqueue("which?")  # first: a burst worker drains, then leaves
            worker = subprocess.Popen([sys.executable, "-m", "batchery", "worker", "--queue",
                                       queue_name, "--runner",
                                       f"tests.runners:tokenizer_threads_on_{placed}", "--burst"],
                                      cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
            try:
                result = handle.result(timeout=60)
            finally:
                stop_process(worker)
        assert result.ok and result.output == (wanted or preset)
