"""The real `batchery` command, with real worker processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import (ROOT, cli_env, free_port, run_cli, scrape, start_worker,
                            stop_process, wait_for)


def lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_enqueue_wait_with_a_worker_and_metrics(redis_url: str, queue_name: str, tmp_path: Path) -> None:
    port = free_port()
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:echo",
                          "--metrics-port", str(port), log=tmp_path / "worker.log")
    try:
        done = run_cli("enqueue", "-q", queue_name, "--text", "hello", "--input", '{"text": "hi"}',
                       "--priority", "realtime", "--wait", redis_url=redis_url)
        assert done.returncode == 0, done.stderr
        results = lines(done.stdout)
        assert [r["output"]["echo"] for r in results] == ["hello", {"text": "hi"}]
        assert {r["status"] for r in results} == {"ok"}
        assert set(results[0]) == {"id", "status", "output", "error", "attempts", "worker",
                                   "batch_size", "queued_ms", "run_ms"}
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        for name in ("batchery_requests_total", "batchery_batch_size", "batchery_batch_tokens",
                     "batchery_padding_efficiency", "batchery_queue_wait_seconds",
                     "batchery_inference_seconds", "batchery_queue_depth", "batchery_inflight",
                     "batchery_retries_total", "batchery_dead_letters_total",
                     "batchery_oom_backoffs_total"):
            assert name in metrics
        # the counter is raised just after the commit the client saw: wait for it
        wait_for(lambda: scrape(port).get(("batchery_requests_total", (
            ("priority", "realtime"), ("queue", queue_name), ("status", "ok")))) == 2, 20,
            message="batchery_requests_total to count both")
        stats = json.loads(run_cli("queue", "stats", "--json", redis_url=redis_url).stdout)
        mine = stats["queues"][queue_name]
        assert mine["workers"] == 1 and mine["pending"] == 0 and mine["inflight"] == 0
        assert set(mine) >= {"pending", "pending_by_priority", "inflight", "dead", "workers"}
    finally:
        assert stop_process(worker) == 0


def test_a_result_timeout_exits_5_and_says_the_request_stays_queued(redis_url: str,
                                                                     queue_name: str) -> None:
    done = run_cli("enqueue", "-q", queue_name, "--text", "nobody serves this", "--id", "waits",
                   "--wait", "--timeout", "0.5", redis_url=redis_url)
    assert done.returncode == 5, done.stderr
    assert "no result for request 'waits' within 0.5s; it stays queued" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    stats = json.loads(run_cli("queue", "stats", "--json", redis_url=redis_url).stdout)
    assert stats["queues"][queue_name]["pending"] == 1


def test_enqueue_without_wait_prints_ids_and_stats_counts_by_class(redis_url: str, queue_name: str) -> None:
    done = run_cli("enqueue", "-q", queue_name, "--text", "a", "--text", "b", "-p", "batch",
                   redis_url=redis_url)
    assert done.returncode == 0 and len(done.stdout.split()) == 2
    again = run_cli("enqueue", "-q", queue_name, "--text", "c", "--id", "mine", redis_url=redis_url)
    assert again.stdout.strip() == "mine"
    table = run_cli("queue", "stats", redis_url=redis_url).stdout
    assert queue_name in table and "batch=2 normal=1" in table


@pytest.mark.parametrize("args, code, message", [
    (["enqueue", "--input", "{not json"], 2, "--input number 1 is not JSON"),
    (["enqueue", "--text", "x", "--priority", "soonish!"], 2, "priority must be"),
    (["enqueue", "--text", "x", "--deadline", "-3"], 2, "deadline must be more than 0"),
    (["enqueue"], 2, "give at least one --text or --input"),
    (["queue", "config", "Q", "--class-delay", "batch"], 2, "expected CLASS=SECONDS"),
    (["queue", "config", "Q", "--max-attempts", "0"], 2, "max_attempts must be a number from 1"),
    (["queue", "config", "bad name!"], 2, "queue name 'bad name!' is not valid"),
    (["queue", "dead", "retry"], 2, "name the request ids, or pass --all"),
    (["worker", "--task", "embed"], 2, "needs --model"),
    (["worker", "--runner", "tests.runners:nothing"], 2, "cannot load it"),
    (["worker", "--runner", "x:y", "--max-batch-size", "0"], 2, "--max-batch-size must be"),
])
def test_bad_input_gets_a_message_and_an_exit_code(redis_url: str, args: list[str], code: int,
                                                   message: str) -> None:
    done = run_cli(*args, redis_url=redis_url)
    assert done.returncode == code, (done.stdout, done.stderr)
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_queue_config_and_backpressure_exit_code(redis_url: str, queue_name: str) -> None:
    shown = run_cli("queue", "config", queue_name, "--max-pending", "2", "--class-delay",
                    "batch=120", "--class-delay", "bulk=600", "--json", redis_url=redis_url)
    settings = json.loads(shown.stdout)
    assert settings["max_pending"] == 2
    assert settings["class_delays"] == {"realtime": 0.0, "normal": 5.0, "batch": 120.0, "bulk": 600.0}
    assert "max_pending: 2" in run_cli("queue", "config", queue_name, redis_url=redis_url).stdout
    assert run_cli("enqueue", "-q", queue_name, "--text", "a", "-p", "bulk", redis_url=redis_url).returncode == 0
    assert run_cli("enqueue", "-q", queue_name, "--text", "b", redis_url=redis_url).returncode == 0
    full = run_cli("enqueue", "-q", queue_name, "--text", "c", redis_url=redis_url)
    assert full.returncode == 3 and "queue is full" in full.stderr


def test_dead_letters_list_retry_purge(redis_url: str, queue_name: str, tmp_path: Path) -> None:
    run_cli("queue", "config", queue_name, "--max-attempts", "1", redis_url=redis_url)
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:fails_on_bad",
                          log=tmp_path / "worker.log")
    try:
        done = run_cli("enqueue", "-q", queue_name, "--text", "bad", "--text", "good", "--wait",
                       redis_url=redis_url)
        bad, good = lines(done.stdout)
        assert done.returncode == 7 and "1 of 2 request(s) did not succeed" in done.stderr
        assert bad["status"] == "dead" and bad["error"]["message"] == (
            "cannot process 'bad' (attempt 1: RuntimeError: cannot process 'bad')")
        assert good["status"] == "ok"
        listed = run_cli("queue", "dead", "list", "-q", queue_name, redis_url=redis_url).stdout
        assert bad["id"] in listed and "RuntimeError: cannot process 'bad'" in listed
        retried = run_cli("queue", "dead", "retry", "-q", queue_name, bad["id"], redis_url=redis_url)
        assert "1 request(s) back" in retried.stdout
        wait_for(lambda: "attempts=1" in run_cli("queue", "dead", "list", "-q", queue_name,
                                                   redis_url=redis_url).stdout, 30)
    finally:
        stop_process(worker)
    purged = run_cli("queue", "dead", "purge", "-q", queue_name, "--all", redis_url=redis_url)
    assert "1 dead request(s) purged" in purged.stdout
    assert json.loads(run_cli("queue", "stats", "--json", "-q", queue_name, redis_url=redis_url).stdout
                      )["queues"][queue_name]["dead"] == 0


def test_one_request_by_id_and_pausing_a_queue(redis_url: str, queue_name: str,
                                               tmp_path: Path) -> None:
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:echo",
                          log=tmp_path / "worker.log")
    try:
        paused = run_cli("queue", "pause", queue_name, redis_url=redis_url)
        assert paused.returncode == 0, paused.stderr
        stats = run_cli("queue", "stats", "-q", queue_name, redis_url=redis_url).stdout
        assert "(paused)" in stats
        request_id = run_cli("enqueue", "-q", queue_name, "--text", "hi", "--id", "r1",
                             redis_url=redis_url).stdout.strip()
        # paused: the worker claims nothing, the request waits
        waited = run_cli("enqueue", "-q", queue_name, "--text", "later", "--wait",
                         "--timeout", "2", redis_url=redis_url)
        assert waited.returncode == 5, waited.stderr
        pending = run_cli("request", "get", request_id, "-q", queue_name, redis_url=redis_url)
        assert json.loads(pending.stdout) == {"id": "r1", "status": "pending"}
        assert run_cli("queue", "resume", queue_name, redis_url=redis_url).returncode == 0
        wait_for(lambda: json.loads(run_cli("request", "get", "r1", "-q", queue_name,
                                            redis_url=redis_url).stdout)["status"] == "ok",
                 30, message="the request to run once resumed")
    finally:
        stop_process(worker)
    missing = run_cli("request", "get", "nope", "-q", queue_name, redis_url=redis_url)
    assert missing.returncode == 4 and "holds no request 'nope'" in missing.stderr
    queued = run_cli("enqueue", "-q", queue_name, "--text", "x", "--id", "r2", redis_url=redis_url)
    assert queued.returncode == 0
    cancelled = run_cli("request", "cancel", "r2", "nope", "-q", queue_name, redis_url=redis_url)
    assert "r2: cancelled while queued" in cancelled.stdout
    assert "nope: not cancelled" in cancelled.stdout and cancelled.returncode == 7


def test_stats_watch_prints_until_interrupted(redis_url: str, queue_name: str) -> None:
    run_cli("enqueue", "-q", queue_name, "--text", "x", redis_url=redis_url)
    with subprocess.Popen([sys.executable, "-m", "batchery", "queue", "stats", "-q", queue_name,
                           "--watch", "0.2"], cwd=ROOT, env=cli_env(redis_url),
                          stdout=subprocess.PIPE, text=True) as proc:
        try:
            # header, row, (blank, its tenants' header, one tenant), blank, header again
            seen = [proc.stdout.readline() for _ in range(7)]
            assert seen[0].startswith("queue") and queue_name in seen[1]
            assert seen[3].startswith("tenant of") and seen[4].startswith("default ")
            assert seen[6].startswith("queue")
        finally:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(10) == 0


def test_redis_url_from_redis_url_and_none_in_a_pod(redis_url: str, queue_name: str) -> None:
    heroku = run_cli("queue", "stats", "-q", queue_name, REDIS_URL=redis_url)  # no BATCHERY_REDIS_URL
    assert heroku.returncode == 0 and queue_name in heroku.stdout
    pod = run_cli("queue", "stats", KUBERNETES_SERVICE_HOST="10.0.0.1")
    assert pod.returncode == 2 and "no Redis URL: set BATCHERY_REDIS_URL" in pod.stderr
    image = run_cli("queue", "stats", BATCHERY_NO_EMBEDDED="1", BATCHERY_REDIS_URL="")
    assert image.returncode == 2 and "--redis-url embedded" in image.stderr


@pytest.mark.slow
def test_minilm_worker_matches_sentence_transformers(redis_url: str, queue_name: str, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    from batchery.workers.runners.hf import resolve_model
    worker = start_worker(redis_url, queue_name, "--task", "embed", "--model", "minilm",
                          "--device", "auto", log=tmp_path / "worker.log")
    texts = ["Return the absolute value of the argument.", "Batching amortises the model."]
    try:
        done = run_cli("enqueue", "-q", queue_name, "--text", texts[0], "--text", texts[1],
                       "--wait", "--timeout", "120", redis_url=redis_url, timeout=180)
        assert done.returncode == 0, done.stderr + (tmp_path / "worker.log").read_text()
    finally:
        stop_process(worker)
    ours = np.array([r["output"] for r in lines(done.stdout)])
    reference = SentenceTransformer(resolve_model("minilm"), device="cpu").encode(
        texts, normalize_embeddings=True)
    assert ours.shape == (2, 384) and np.abs(ours - reference).max() < 1e-5
