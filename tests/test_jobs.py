"""Offline jobs through the real CLI, with real workers and jobs workers on a real Redis."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, RedisServer, cli_env, run_cli, start_worker, stop_process, wait_for
from tests.jobs_helpers import (read_jsonl, requests, start_jobs_worker, status, submit,
                                wait_done_at_least, wait_state, write_lines)

pytestmark = pytest.mark.slow


@pytest.fixture
def jobs_queue(queue_name: str) -> str:
    return f"jobs-{queue_name}"


def test_job_writes_one_line_per_valid_line_and_errors_file(
        redis_url: str, queue_name: str, jobs_queue: str, tmp_path: Path) -> None:
    assert run_cli("queue", "config", queue_name, "--max-request-bytes", "200",
                   redis_url=redis_url).returncode == 0
    lines = [*requests(150),
             "this is not json",                                   # line 151
             "[1, 2, 3]",                                          # 152
             {"custom_id": "r3", "input": "a second r3"},          # 153
             {"custom_id": "no-input"},                            # 154
             {"custom_id": "big", "input": "x" * 500},             # 155
             {"custom_id": "odd", "input": "a", "colour": "red"},  # 156
             {"custom_id": "slow", "input": "a", "priority": "someday"},  # 157
             "",                                                   # 158: blank, skipped
             {"id": 7, "input": "given as id"},                    # 159
             {"input": "no id at all", "priority": "realtime"}]    # 160
    source = write_lines(tmp_path / "requests.jsonl", lines)
    output = tmp_path / "results.jsonl"
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:echo")
    jobs_worker = start_jobs_worker(redis_url, jobs_queue)
    try:
        job = submit(redis_url, jobs_queue, queue_name, source, output, "--max-in-flight", "40")
        watched = run_cli("job", "status", job, "--watch", redis_url=redis_url)
        assert watched.returncode == 0, watched.stderr
        assert f"job {job}: finished" in watched.stdout
        assert "100%" in watched.stderr  # the progress bar
    finally:
        stop_process(jobs_worker)
        stop_process(worker)

    results = read_jsonl(output)
    by_line = {r["line"]: r for r in results}
    assert len(results) == len(by_line) == 152
    assert sorted(by_line) == [*range(1, 151), 159, 160]
    assert all(by_line[i + 1]["custom_id"] == f"r{i}" and by_line[i + 1]["status"] == "ok"
               and by_line[i + 1]["output"]["echo"] == f"text {i}" for i in range(150))
    assert by_line[159]["id"] == 7 and by_line[159]["output"]["echo"] == "given as id"
    assert by_line[160]["custom_id"] is None and by_line[160]["status"] == "ok"

    errors = {e["line"]: e for e in read_jsonl(tmp_path / "results.errors.jsonl")}
    assert {n: e["error"] for n, e in errors.items()} == {
        151: "not_json", 152: "not_object", 153: "duplicate_id", 154: "no_input",
        155: "too_large", 156: "invalid", 157: "invalid"}
    assert "not JSON" in errors[151]["reason"]
    assert "max_request_bytes of 200" in errors[155]["reason"]
    assert "colour" in errors[156]["reason"] and "someday" in errors[157]["reason"]
    assert errors[153]["custom_id"] == "r3"

    view = status(redis_url, job)
    assert (view["state"], view["total"], view["ok"], view["error"], view["invalid"],
            view["pending"]) == ("finished", 159, 152, 7, 7, 0)
    shown = run_cli("job", "results", job, redis_url=redis_url)
    assert [json.loads(x) for x in shown.stdout.splitlines()] == results
    assert run_cli("job", "results", job, "--path", redis_url=redis_url).stdout.strip() == str(output)
    assert len(run_cli("job", "results", job, "--errors", redis_url=redis_url).stdout.splitlines()) == 7
    where = run_cli("job", "results", job, "--path", "--json", redis_url=redis_url).stdout
    assert json.loads(where) == {"path": str(output), "state": "finished"}
    listed = run_cli("job", "list", "--jobs-queue", jobs_queue, redis_url=redis_url).stdout
    assert job in listed and "finished" in listed
    [row] = json.loads(run_cli("job", "list", "--jobs-queue", jobs_queue, "--json",
                               redis_url=redis_url).stdout)["jobs"]
    assert (row["id"], row["state"], row["ok"], row["error"]) == (job, "finished", 152, 7)
    assert run_cli("job", "status", "--jobs-queue", jobs_queue, redis_url=redis_url).stdout == \
        run_cli("job", "list", "--jobs-queue", jobs_queue, redis_url=redis_url).stdout


def test_job_waits_out_a_full_queue(redis_url: str, queue_name: str, jobs_queue: str,
                                    tmp_path: Path) -> None:
    """Backpressure: a queue with room for 25 still takes a job of 300 in chunks of 500."""
    assert run_cli("queue", "config", queue_name, "--max-pending", "25",
                   redis_url=redis_url).returncode == 0
    source = write_lines(tmp_path / "in.jsonl", requests(300))
    output = tmp_path / "out.jsonl"
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:echo")
    jobs_worker = start_jobs_worker(redis_url, jobs_queue)
    try:
        job = submit(redis_url, jobs_queue, queue_name, source, output, "--max-in-flight", "1000")
        view = wait_state(redis_url, job, "finished", "failed")
    finally:
        stop_process(jobs_worker)
        stop_process(worker)
    assert (view["state"], view["ok"]) == ("finished", 300)
    assert len(read_jsonl(output)) == 300


def test_job_is_a_plain_rq_job(redis_url: str, queue_name: str, jobs_queue: str,
                               tmp_path: Path) -> None:
    """`rq info` sees the job queue and its jobs; RQ's retries and failure registry apply."""
    source = write_lines(tmp_path / "in.jsonl", requests(20))
    gone = tmp_path / "gone"
    gone.mkdir()
    output = gone / "out.jsonl"
    job = submit(redis_url, jobs_queue, queue_name, source, output, "--retries", "1")
    info = _rq_info(redis_url, jobs_queue)
    assert f"{jobs_queue} " in info and "1 jobs total" in info  # queued, as RQ sees it

    for path in gone.iterdir():  # the job cannot open its output: it fails, RQ retries it once
        path.unlink()
    gone.rmdir()
    run = run_cli("job", "worker", "--jobs-queue", jobs_queue, "--burst", redis_url=redis_url)
    assert run.returncode == 0, run.stderr
    view = status(redis_url, job)
    assert view["state"] == "failed" and view["retries_left"] == 0
    assert "out.jsonl" in view["failure"]
    assert "1 failed" in _rq_info(redis_url, jobs_queue)

    gone.mkdir()  # fixed: RQ's own requeue runs it again
    requeued = subprocess_rq("requeue", "--queue", jobs_queue, job, redis_url=redis_url)
    assert requeued.returncode == 0, requeued.stderr
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:echo")
    try:
        assert run_cli("job", "worker", "--jobs-queue", jobs_queue, "--burst",
                       redis_url=redis_url).returncode == 0
    finally:
        stop_process(worker)
    assert status(redis_url, job)["state"] == "finished"
    assert len(read_jsonl(output)) == 20
    assert "1 finished, 0 failed" in _rq_info(redis_url, jobs_queue)


def subprocess_rq(*args: str, redis_url: str) -> subprocess.CompletedProcess:
    """The real `rq` command line (python -m rq.cli), JSON serializer."""
    return subprocess.run([sys.executable, "-m", "rq.cli", *args, "--url", redis_url,
                           "--serializer", "json"], capture_output=True, text=True, timeout=60)


def _rq_info(redis_url: str, jobs_queue: str) -> str:
    done = subprocess_rq("info", "--only-queues", jobs_queue, redis_url=redis_url)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_killed_jobs_worker_resumes_without_duplicates(
        redis_url: str, queue_name: str, jobs_queue: str, tmp_path: Path) -> None:
    n = 1200
    lines = requests(n)
    lines[5] = "{broken"            # invalid lines before and after the kill
    lines[n - 3] = {"custom_id": "r1", "input": "again"}
    source = write_lines(tmp_path / "in.jsonl", lines)
    output = tmp_path / "out.jsonl"
    gate = tmp_path / "gate"  # the model pauses after 350 requests: the kill lands mid-job
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:pauses_after",
                          "--max-batch-size", "16", BATCHERY_TEST_PAUSE_AFTER="350",
                          BATCHERY_TEST_GATE=str(gate))
    first = start_jobs_worker(redis_url, jobs_queue)
    second = None
    try:
        job = submit(redis_url, jobs_queue, queue_name, source, output, "--max-in-flight", "64")
        wait_for(gate.exists, 60, message="the model to pause")
        wait_done_at_least(redis_url, job, 300)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        gate.unlink()
        with open(output, "a") as f:
            f.write('{"custom_id": "r9')  # a line torn by the kill
        killed_at = len(output.read_text().splitlines()) - 1
        assert 290 <= killed_at < 350  # the model paused before its 350th request
        second = start_jobs_worker(redis_url, jobs_queue)
        view = wait_state(redis_url, job, "finished", "failed", timeout=90)
    finally:
        for proc in (second, first, worker):
            if proc is not None:
                stop_process(proc)
    assert view["state"] == "finished", view
    assert view["retries_left"] == 2  # RQ re-ran the abandoned job: one retry used
    results = read_jsonl(output)
    ids = [r["custom_id"] for r in results]
    assert len(ids) == len(set(ids)) == n - 2
    assert set(ids) == {f"r{i}" for i in range(n) if i not in (5, n - 3)}
    assert all(r["status"] == "ok" and r["output"] == f"done:text {r['custom_id'][1:]}"
               for r in results)
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    assert [(e["line"], e["error"]) for e in errors] == [(6, "not_json"), (n - 2, "duplicate_id")]
    assert (view["ok"], view["error"], view["pending"]) == (n - 2, 2, 0)


def test_sigterm_hands_a_running_job_back(redis_url: str, queue_name: str, jobs_queue: str,
                                          tmp_path: Path) -> None:
    source = write_lines(tmp_path / "in.jsonl", requests(800))
    output = tmp_path / "out.jsonl"
    gate = tmp_path / "gate"  # the model pauses after 200 requests: SIGTERM lands mid-job
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:pauses_after",
                          "--max-batch-size", "16", BATCHERY_TEST_PAUSE_AFTER="200",
                          BATCHERY_TEST_GATE=str(gate))
    log = tmp_path / "jobs.log"
    first = start_jobs_worker(redis_url, jobs_queue, log=log)
    try:
        job = submit(redis_url, jobs_queue, queue_name, source, output, "--max-in-flight", "64")
        wait_for(gate.exists, 60, message="the model to pause")
        wait_done_at_least(redis_url, job, 100)
        # the model stays paused, so the job cannot end by itself: the stop hands it back
        # (1-3 s on 2 loaded cores; 10 s was once too short in a full suite run)
        assert stop_process(first, signal.SIGTERM) == 0, log.read_text()[-8000:]
        gate.unlink()
        view = status(redis_url, job)
        assert view["state"] == "queued" and view["pending"] > 0 and view["retries_left"] == 3
        assert run_cli("job", "worker", "--jobs-queue", jobs_queue, "--burst",
                       redis_url=redis_url).returncode == 0
    finally:
        stop_process(first)
        stop_process(worker)
    assert status(redis_url, job)["state"] == "finished"
    ids = [r["custom_id"] for r in read_jsonl(output)]
    assert len(ids) == len(set(ids)) == 800


def test_cancel_running_job_removes_its_queued_requests(
        redis_url: str, queue_name: str, jobs_queue: str, tmp_path: Path) -> None:
    source = write_lines(tmp_path / "in.jsonl", requests(3000))
    output = tmp_path / "out.jsonl"
    gate = tmp_path / "gate"  # the model pauses after 100 requests: the cancel lands mid-job
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:pauses_after",
                          "--max-batch-size", "8", BATCHERY_TEST_PAUSE_AFTER="100",
                          BATCHERY_TEST_GATE=str(gate))
    jobs_worker = start_jobs_worker(redis_url, jobs_queue)
    try:
        job = submit(redis_url, jobs_queue, queue_name, source, output, "--max-in-flight", "300")
        wait_for(gate.exists, 60, message="the model to pause")
        wait_done_at_least(redis_url, job, 40)
        done = run_cli("job", "cancel", job, redis_url=redis_url)
        gate.unlink()
        assert done.returncode == 0, done.stderr
        assert f"job {job} cancelled (was running)" in done.stdout
        removed = int(done.stdout.split("; ")[1].split()[0])
        assert removed > 100
        view = wait_state(redis_url, job, "cancelled")
        stats = wait_for(lambda: (s := _stats(redis_url, queue_name))["inflight"] == 0 and s)
        assert stats["pending"] == 0
    finally:
        stop_process(jobs_worker)
        stop_process(worker)
    written = read_jsonl(output)
    assert all(r["status"] == "ok" for r in written)  # withdrawn lines are not results
    assert 40 <= len(written) < 3000 - removed
    assert status(redis_url, job)["state"] == "cancelled"
    again = run_cli("job", "cancel", job, redis_url=redis_url)
    assert again.returncode == 0 and "cancelled already" in again.stdout
    assert view["pending"] > 0


def test_a_cancel_after_the_last_line_was_queued_ends_cancelled_not_finished(
        redis_url: str, queue_name: str, jobs_queue: str, tmp_path: Path) -> None:
    """Every line queued and none run (no model worker): the cancel withdraws them all, and
    the job ends cancelled, though nothing is left for it to wait on."""
    source = write_lines(tmp_path / "in.jsonl", requests(10))
    output = tmp_path / "out.jsonl"
    jobs_worker = start_jobs_worker(redis_url, jobs_queue)
    try:
        job = submit(redis_url, jobs_queue, queue_name, source, output)
        wait_for(lambda: _stats(redis_url, queue_name)["pending"] == 10, 60,
                 message="every line queued")
        done = run_cli("job", "cancel", job, redis_url=redis_url)
        assert done.returncode == 0, done.stderr
        wait_state(redis_url, job, "cancelled", "finished")
        assert status(redis_url, job)["state"] == "cancelled"
    finally:
        stop_process(jobs_worker)
    assert not output.exists() or read_jsonl(output) == []


def test_cancel_queued_job_never_runs(redis_url: str, queue_name: str, jobs_queue: str,
                                      tmp_path: Path) -> None:
    source = write_lines(tmp_path / "in.jsonl", requests(10))
    output = tmp_path / "out.jsonl"
    job = submit(redis_url, jobs_queue, queue_name, source, output)
    done = run_cli("job", "cancel", job, redis_url=redis_url)
    assert done.returncode == 0 and "was queued" in done.stdout
    assert run_cli("job", "worker", "--jobs-queue", jobs_queue, "--burst",
                   redis_url=redis_url).returncode == 0
    assert status(redis_url, job)["state"] == "cancelled"
    assert output.read_text() == ""
    assert _stats(redis_url, queue_name)["pending"] == 0
    again = run_cli("job", "cancel", job, "--json", redis_url=redis_url)
    assert json.loads(again.stdout) == {"id": job, "was": "cancelled", "removed": 0,
                                        "cancelled": False}


def test_job_status_watch_exits_7_when_the_job_is_cancelled(redis_url: str, queue_name: str,
                                                            jobs_queue: str, tmp_path: Path) -> None:
    """`job status --watch` follows a running job until it ends: 0 once finished (checked
    where jobs finish), 7 when it failed or was cancelled."""
    source = write_lines(tmp_path / "in.jsonl", requests(10))
    jobs_worker = start_jobs_worker(redis_url, jobs_queue)  # no model worker: it runs on
    try:
        job = submit(redis_url, jobs_queue, queue_name, source, tmp_path / "out.jsonl")
        wait_for(lambda: status(redis_url, job)["state"] == "running", 60, 0.1, "the job to run")
        watch = subprocess.Popen([sys.executable, "-m", "batchery", "job", "status", job,
                                  "--watch"], cwd=ROOT, env=cli_env(redis_url),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert run_cli("job", "cancel", job, redis_url=redis_url).returncode == 0
            out, err = watch.communicate(timeout=60)
        finally:
            stop_process(watch)
        assert watch.returncode == 7, (out, err)
        assert "cancelled" in out
    finally:
        stop_process(jobs_worker)


def _stats(redis_url: str, queue: str) -> dict:
    done = run_cli("queue", "stats", "--queue", queue, "--json", redis_url=redis_url)
    return json.loads(done.stdout)["queues"][queue]


def test_submit_refuses_unusable_files_with_exit_2(redis_url: str, queue_name: str,
                                                    jobs_queue: str, tmp_path: Path) -> None:
    good = write_lines(tmp_path / "in.jsonl", requests(3))
    a_file = write_lines(tmp_path / "plain.txt", ["x"])
    (tmp_path / "taken.jsonl").write_text("old results\n")
    cases = [((str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o1.jsonl")),
              "cannot read the input"),
             ((str(tmp_path), "-o", str(tmp_path / "o2.jsonl")), "is a directory"),
             ((str(good), "-o", str(a_file / "out.jsonl")), "cannot write"),
             ((str(good), "-o", str(tmp_path / "nodir" / "out.jsonl")), "cannot write"),
             ((str(good), "-o", str(tmp_path / "taken.jsonl")), "--overwrite"),
             ((str(good), "-o", str(tmp_path / "o3.jsonl"), "--priority", "someday"),
              "unknown priority class 'someday'")]
    for args, message in cases:
        done = run_cli("job", "submit", *args, "--queue", queue_name, "--jobs-queue", jobs_queue,
                       redis_url=redis_url)
        assert done.returncode == 2, (args, done.stderr)
        assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert done.stdout == ""
    assert (tmp_path / "taken.jsonl").read_text() == "old results\n"
    assert not (tmp_path / "o3.jsonl").exists()
    listed = run_cli("job", "list", "--jobs-queue", jobs_queue, "--json", redis_url=redis_url)
    assert json.loads(listed.stdout) == {"jobs": []}
    unknown = run_cli("job", "status", "0123456789ab", redis_url=redis_url)
    assert unknown.returncode == 4 and "no offline job" in unknown.stderr


def test_jobs_worker_on_embedded_redis(home: Path, queue_name: str, tmp_path: Path) -> None:
    source = write_lines(tmp_path / "in.jsonl", requests(30))
    output = tmp_path / "out.jsonl"
    worker = start_worker(None, queue_name, "--runner", "tests.runners:echo")
    jobs_worker = start_jobs_worker(None, "batchery")
    try:
        job = submit(None, "batchery", queue_name, source, output)
        view = wait_state(None, job, "finished", "failed")
    finally:
        stop_process(jobs_worker)
        stop_process(worker)
        run_cli("redis", "stop")
    assert view["state"] == "finished" and view["ok"] == 30
    assert len(read_jsonl(output)) == 30


def test_jobs_worker_waits_for_redis_to_come_up(queue_name: str, tmp_path: Path) -> None:
    server = RedisServer()
    server.stop()  # nothing listens on its port yet
    jobs_worker = start_jobs_worker(server.url, "batchery", "--burst", log=tmp_path / "jobs.log")
    try:
        # it found no Redis (and said so) and waits for it: twice, so it did not exit after one
        log = tmp_path / "jobs.log"
        wait_for(lambda: log.read_text().count("Redis unavailable") >= 2, 60, 0.1,
                 "the jobs worker to retry twice")
        assert jobs_worker.poll() is None, "the jobs worker must wait, not exit"
        server.start()
        assert jobs_worker.wait(60) == 0  # connected, found no job, and finished its burst
    finally:
        stop_process(jobs_worker)
        server.close()
    assert "Traceback" not in (tmp_path / "jobs.log").read_text()


def test_two_jobs_submitted_together_both_feed_the_queue(
        redis_url: str, queue_name: str, jobs_queue: str, tmp_path: Path) -> None:
    """One `batchery job worker` with its defaults runs jobs side by side (--jobs 4): the
    second job does not wait for the first; SIGTERM hands both back and exits 0."""
    log = tmp_path / "jobs.log"
    jobs_worker = start_jobs_worker(redis_url, jobs_queue, log=log)
    try:
        first = submit(redis_url, jobs_queue, queue_name, write_lines(tmp_path / "a.jsonl",
                       requests(30, "a")), tmp_path / "a.out")
        second = submit(redis_url, jobs_queue, queue_name, write_lines(tmp_path / "b.jsonl",
                        requests(20, "b")), tmp_path / "b.out")
        wait_for(lambda: _stats(redis_url, queue_name)["pending"] == 50, 60,
                 message="both jobs' lines queued")  # no model worker: nothing runs them
        assert {status(redis_url, j)["state"] for j in (first, second)} == {"running"}
        tenants = _stats(redis_url, queue_name)["tenants"]
        assert {t: v["pending"] for t, v in tenants.items()} == {first: 30, second: 20}
    finally:
        assert stop_process(jobs_worker) == 0, log.read_text()[-8000:]
    for job in (first, second):  # handed back to the jobs queue: the next worker resumes it
        assert status(redis_url, job)["state"] == "queued"
