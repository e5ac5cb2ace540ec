"""`batchery dashboard` against a real Redis, real queues and a real worker: the JSON and
HTML it serves, its buttons, and who may read and act."""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis
from starlette.requests import Request

from batchery import Client
from batchery.batching.queue import RequestQueue
from batchery.dashboard.access import Access
from batchery.connection import RedisSettings
from batchery.dashboard.render import ago, chart, environment
from batchery.dashboard.state import Board, History
from tests.conftest import run_cli, start_worker, stop_process, wait_for
from tests.dashboard_helpers import TOKEN, dashboard
from tests.jobs_helpers import requests as job_lines, submit, write_lines

STATS_FIELDS = ("pending", "pending_by_priority", "inflight", "dead", "workers", "tenants",
                "tenants_other")


@pytest.fixture
def scene(redis_url: str, rconn: redis.Redis, queue_name: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Queue A served by a worker (2 s leases: it reports every 0.7 s) with one request done
    and one dead letter; queue B with requests of three classes and no worker."""
    served, idle = f"{queue_name}-a", f"{queue_name}-b"
    RequestQueue(rconn, served).update_settings(lease_seconds=2)
    worker = start_worker(redis_url, served, "--runner", "tests.runners:fails_on_bad",
                          log=tmp_path / "worker.log")
    try:
        with Client(redis_url, served) as client:
            ok, bad = client.enqueue_many([{"input": "fine"}, {"input": "bad"}])
            assert ok.result(timeout=30).status == "ok"
            assert bad.result(timeout=30).status == "dead"
        with Client(redis_url, idle) as client:
            client.enqueue_many([{"input": f"x{i}", "priority": p}
                                 for i, p in enumerate(["realtime", "normal", "normal", "batch"])])
        queue = RequestQueue(rconn, served)
        wait_for(lambda: next((w for w in queue.worker_reports()[1] if int(w.get("runs", 0))), None),
                 30, 0.1, message="the worker's report after its batch")
        yield {"served": served, "idle": idle, "worker": worker, "dead_id": bad.id}
    finally:
        stop_process(worker)


def stats_json(redis_url: str) -> dict[str, Any]:
    done = run_cli("queue", "stats", "--json", redis_url=redis_url)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["queues"]


def test_state_holds_the_stats_workers_dead_letters_and_aging(redis_url: str, scene: dict[str, Any],
                                                            tmp_path: Path) -> None:
    with dashboard(redis_url, tmp_path) as board:
        state = board.state()
        stats = stats_json(redis_url)
        for name in (scene["served"], scene["idle"]):
            assert {f: state["queues"][name][f] for f in STATS_FIELDS} == \
                {f: stats[name][f] for f in STATS_FIELDS}
        idle = state["queues"][scene["idle"]]
        assert idle["pending_by_priority"] == {"batch": 1, "normal": 2, "realtime": 1}
        assert set(idle["oldest_s"]) == {"batch", "normal", "realtime"}
        assert all(0 <= age < 60 for age in idle["oldest_s"].values())
        assert idle["class_delays"] == {"batch": 60.0, "normal": 5.0, "realtime": 0.0}
        assert f"queue {scene['idle']}: 4 pending and no live worker" in state["alerts"]

        [worker] = [w for w in state["workers"] if w["queue"] == scene["served"]]
        assert worker["live"] and worker["model"] == "tests.runners:fails_on_bad"
        assert worker["batches"] >= 1 and worker["mean_batch"] >= 1
        assert 0 < worker["padding_efficiency"] <= 1 and worker["last_claim_s"] >= 0

        [dead] = state["dead_letters"][scene["served"]]
        assert dead["id"] == scene["dead_id"] and dead["attempts"] == 3
        assert dead["error_type"] == "RuntimeError" and "cannot process 'bad'" in dead["error"]
        assert "input" not in dead  # payloads stay hidden unless asked for

        wait_for(lambda: len(board.state()["queues"][scene["idle"]]["history"]) >= 2, 30, 0.2,
                 message="two depth samples")
        html = board.get("").body
        assert f'data-queue="{scene["idle"]}"' in html and "<svg" in html
        assert idle["tenants"] == {"default": {"pending": 4, "inflight": 0, "served_tokens": 0}}
        assert 'data-tenant="default"' in html
        assert scene["dead_id"] in html and "RuntimeError" in html
        assert '"bad"' not in html


def test_show_payloads_shows_dead_letters_inputs(redis_url: str, scene: dict[str, Any],
                                                 tmp_path: Path) -> None:
    with dashboard(redis_url, tmp_path, "--show-payloads") as board:
        [dead] = board.state()["dead_letters"][scene["served"]]
        assert dead["input"] == "bad"
        assert "&#34;bad&#34;" in board.get("fragment").body or '"bad"' in board.get("fragment").body


def test_buttons_need_the_token_in_a_header(redis_url: str, rconn: redis.Redis,
                                            scene: dict[str, Any], tmp_path: Path) -> None:
    assert stop_process(scene["worker"]) == 0  # a retried letter stays pending
    served, dead_id = scene["served"], scene["dead_id"]
    retry = f"api/queues/{served}/dead/retry"
    with dashboard(redis_url, tmp_path) as board:
        assert board.post(retry, {"ids": [dead_id]}, token=None).status == 403
        assert board.post(retry, {"ids": [dead_id]}, token="wrong-token-0123456789").status == 403
        cookie_only = board.post(retry, {"ids": [dead_id]}, token=None,
                                 headers={"Cookie": f"batchery_dashboard_token={TOKEN}"})
        assert cookie_only.status == 403 and "token" in cookie_only.json()["error"]
        assert RequestQueue(rconn, served).stats()["dead"] == 1

        bad_body = board.post(retry, {"ids": "nope"})
        assert bad_body.status == 400 and "name the dead letters" in bad_body.json()["error"]
        assert board.post("api/queues/no%20such/dead/retry", {"all": True}).status == 400

        done = board.post(retry, {"ids": [dead_id]})
        assert done.status == 200 and done.json()["count"] == 1, done.body
        state = board.state()["queues"][served]
        assert state["dead"] == 0 and state["pending"] == 1
        bearer = board.post(f"api/queues/{served}/dead/purge", {"all": True}, token=None,
                            headers={"Authorization": f"Bearer {TOKEN}"})
        assert bearer.status == 200 and bearer.json()["count"] == 0  # nothing dead now

        missing = board.post("api/jobs/0123456789ab/cancel")
        assert missing.status == 404 and "no offline job" in missing.json()["error"]


def test_reads_on_loopback_need_no_token_but_a_loopback_host(redis_url: str, tmp_path: Path,
                                                            queue_name: str, rconn: redis.Redis) -> None:
    RequestQueue(rconn, queue_name).register()
    with dashboard(redis_url, tmp_path) as board:
        page = board.get("")
        assert page.status == 200 and 'name="batchery-token" content=""' in page.body
        assert "read-only: no token" in page.body
        with_token = board.get(f"?token={TOKEN}")
        assert f'name="batchery-token" content="{TOKEN}"' in with_token.body
        assert "batchery_dashboard_token=" in with_token.headers.get("set-cookie", "")
        rebound = board.get("api/state", headers={"Host": "attacker.example:8480"})
        assert rebound.status == 403 and "loopback host name" in rebound.json()["error"]
        assert board.get("api/state", headers={"Host": "localhost"}).status == 200


def test_a_worker_that_stops_renewing_shows_as_stale(redis_url: str, scene: dict[str, Any],
                                                     tmp_path: Path) -> None:
    with dashboard(redis_url, tmp_path) as board:
        scene["worker"].send_signal(signal.SIGKILL)
        scene["worker"].wait(10)

        def stale() -> dict[str, Any] | None:
            return next((w for w in board.state()["workers"]
                         if w["queue"] == scene["served"] and not w["live"]), None)
        worker = wait_for(stale, 30, 0.2, message="the killed worker shown as stale")
        assert worker["seen_s"] >= 2
        alerts = board.state()["alerts"]
        assert any(a.startswith(f"worker {worker['id']}") and "stopped renewing" in a for a in alerts)
        assert "stale" in board.get("fragment").body


def test_jobs_show_state_progress_and_cancel(redis_url: str, queue_name: str, tmp_path: Path) -> None:
    jobs_queue = f"jobs-{queue_name}"
    source = write_lines(tmp_path / "in.jsonl", job_lines(5))
    job_id = submit(redis_url, jobs_queue, queue_name, source, tmp_path / "out.jsonl")
    with dashboard(redis_url, tmp_path, "--jobs-queue", jobs_queue) as board:
        [job] = board.state()["jobs"]
        assert job["id"] == job_id and job["state"] == "queued"
        assert job["output"] == str(tmp_path / "out.jsonl")
        assert job["errors"] == str(tmp_path / "out.errors.jsonl")
        html = board.get("fragment").body
        assert f'data-post="api/jobs/{job_id}/cancel"' in html and str(tmp_path / "out.jsonl") in html
        done = board.post(f"api/jobs/{job_id}/cancel")
        assert done.status == 200 and done.json()["state"] == "cancelled", done.body
        assert board.state()["jobs"][0]["state"] == "cancelled"
        again = board.post(f"api/jobs/{job_id}/cancel")
        assert again.status == 200 and again.json()["ok"] is False


def test_a_finished_job_shows_its_counts_and_a_full_bar(redis_url: str, queue_name: str,
                                                        tmp_path: Path) -> None:
    jobs_queue = f"jobs-{queue_name}"
    source = write_lines(tmp_path / "in.jsonl", [*job_lines(20), "not json"])
    job_id = submit(redis_url, jobs_queue, queue_name, source, tmp_path / "out.jsonl")
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:echo")
    try:
        ran = run_cli("job", "worker", "--burst", "--jobs-queue", jobs_queue, redis_url=redis_url)
        assert ran.returncode == 0, ran.stderr
    finally:
        stop_process(worker)
    with dashboard(redis_url, tmp_path, "--jobs-queue", jobs_queue) as board:
        [job] = board.state()["jobs"]
        assert (job["state"], job["ok"], job["error"], job["invalid"]) == ("finished", 20, 1, 1)
        assert job["progress"] == 1.0 and job["eta_s"] is None
        row = board.get("fragment").body.split(f'data-job="{job_id}"')[1].split("</tr>")[0]
        assert 'style="width: 100.0%"' in row and "21 / 21" in row and "cancel" not in row


def test_alerts_say_paused_queues_and_failed_jobs(redis_url: str, queue_name: str,
                                                  tmp_path: Path) -> None:
    """A paused queue and a job that failed within the hour are alerts, saying what to do."""
    jobs_queue = f"jobs-{queue_name}"
    source = write_lines(tmp_path / "in.jsonl", job_lines(3))
    job_id = submit(redis_url, jobs_queue, queue_name, source, tmp_path / "out.jsonl")
    with open(source, "a") as f:  # changed after submission: the run refuses it and fails
        f.write('{"input": "one more"}\n')
    ran = run_cli("job", "worker", "--burst", "--jobs-queue", jobs_queue, redis_url=redis_url)
    assert ran.returncode == 0, ran.stderr
    with Client(redis_url, queue_name) as client:  # known to the dashboard: it holds a request
        client.enqueue("waits")
    assert run_cli("queue", "pause", queue_name, redis_url=redis_url).returncode == 0
    with dashboard(redis_url, tmp_path, "--jobs-queue", jobs_queue) as board:
        state = board.state()
    assert state["jobs"][0]["state"] == "failed"
    failed = [a for a in state["alerts"] if a.startswith(f"job {job_id} failed: ")]
    assert len(failed) == 1 and "changed since it was submitted" in failed[0], state["alerts"]
    assert f"queue {queue_name} is paused (`batchery queue resume {queue_name}`)" in state["alerts"]


def test_binding_elsewhere_without_a_token_is_refused(redis_url: str) -> None:
    for host in ("0.0.0.0", "192.0.2.1"):
        done = run_cli("dashboard", "--host", host, redis_url=redis_url, timeout=30,
                       BATCHERY_DASHBOARD_TOKEN="")
        assert done.returncode == 2, done.stderr
        assert f"refusing to serve on {host} without a token" in done.stderr
        assert "Traceback" not in done.stderr
    short = run_cli("dashboard", "--token", "abc", redis_url=redis_url, timeout=30)
    assert short.returncode == 2 and "at least 16 characters" in short.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = run_cli("dashboard", "--port", str(taken.getsockname()[1]), redis_url=redis_url,
                       timeout=30)
    assert busy.returncode == 2 and "cannot listen on 127.0.0.1" in busy.stderr


def test_the_token_rules_when_bound_elsewhere() -> None:
    access = Access(token=TOKEN, loopback=False)

    def request(path: str = "/", headers: dict[str, str] | None = None) -> Request:
        path, _, query = path.partition("?")
        return Request({"type": "http", "method": "GET", "path": path, "query_string": query.encode(),
                        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]})
    assert not access.may_read(request())
    assert access.may_read(request(f"/?token={TOKEN}"))
    assert access.may_read(request(headers={"Cookie": f"batchery_dashboard_token={TOKEN}"}))
    assert not access.may_act(request(headers={"Cookie": f"batchery_dashboard_token={TOKEN}"}))
    assert not access.may_act(request(f"/?token={TOKEN}"))
    assert access.may_act(request(headers={"X-Batchery-Token": TOKEN}))
    assert access.may_act(request(headers={"Authorization": f"Bearer {TOKEN}"}))
    assert not access.may_act(request(headers={"X-Batchery-Token": TOKEN[:-1]}))
    assert access.host_allowed(request(headers={"Host": "batchery.example:8480"}))
    local = Access(token=TOKEN, loopback=True)
    assert local.may_read(request()) and not local.may_act(request())
    for host in ("127.0.0.1:8480", "localhost", "[::1]:8480", "127.0.0.2"):
        assert local.host_allowed(request(headers={"Host": host})), host
    assert not local.host_allowed(request(headers={"Host": "127.0.0.1.attacker.example"}))


def test_oldest_finds_each_class_oldest_request_within_its_bound(redis_url: str, rconn: redis.Redis,
                                                                queue_name: str) -> None:
    queue = RequestQueue(rconn, queue_name)
    with Client(redis_url, queue_name) as client:
        first = client.enqueue_many([{"input": "b0", "priority": "batch"},
                                     {"input": "n0", "priority": "normal"}])
        enqueued = redis_ms(rconn)
        wait_for(lambda: redis_ms(rconn) > enqueued, 5, 0.001, message="the next millisecond")
        client.enqueue_many([{"input": f"r{i}", "priority": "realtime"} for i in range(30)]
                            + [{"input": "n1", "priority": "normal"}])
    scheds = {r.id: int(rconn.hget(queue.keys.sched, r.id).split(":")[2]) for r in first}
    now, looked_at, oldest = queue.oldest(["batch", "normal", "realtime"])
    assert oldest["batch"] == scheds[first[0].id] and oldest["normal"] == scheds[first[1].id]
    assert oldest["realtime"] <= now and looked_at == 33  # the batch request ranks last
    now, looked_at, oldest = queue.oldest(["batch", "normal"], limit=5)
    assert looked_at == 5 and oldest == {}  # 30 realtime requests rank first
    _, looked_at, oldest = queue.oldest(["realtime"])
    assert looked_at <= 200 and set(oldest) == {"realtime"}  # stops once it has them all


def test_a_class_with_only_retries_waiting_says_so(redis_url: str, rconn: redis.Redis,
                                                   queue_name: str) -> None:
    queue = RequestQueue(rconn, queue_name)
    queue.register()
    with Client(redis_url, queue_name) as client:
        client.enqueue("fails once", priority="batch")
    [claimed] = queue.claim("w#1", 1, 100, 0, 10).batch
    assert queue.fail([(claimed.id, "w#1", "{}")]) == [1]  # retried after a backoff
    board = Board(RedisSettings.from_url(redis_url))
    try:
        state = board.state()
    finally:
        board.close()
    view = state["queues"][queue_name]
    assert view["delayed"] == 1 and view["pending_by_priority"] == {"batch": 1}
    assert view["oldest_s"] == {} and view["oldest_complete"]
    html = environment().get_template("state.html").render(s=state, act="")
    row = html.split(f'data-queue="{queue_name}"')[1].split("</tr>")[0]
    assert "all waiting to retry" in row


def test_worker_reports_expire_and_old_silent_workers_are_left_out(rconn: redis.Redis,
                                                                    queue_name: str) -> None:
    queue = RequestQueue(rconn, queue_name)
    queue.update_settings(lease_seconds=2)
    queue.renew("live-one", [])  # a heartbeat: registered now
    queue.publish_worker("live-one", {"model": "m", "runs": 3}, lease_seconds=2)
    assert 15 < rconn.ttl(queue.keys.worker("live-one")) <= 20  # ten leases
    long_ago = redis_ms(rconn) - 60_000
    rconn.zadd(queue.keys.workers, {"silent-reported": long_ago, "silent-forgotten": long_ago})
    queue.publish_worker("silent-reported", {"model": "m"}, lease_seconds=2)
    _, found = queue.worker_reports()
    assert {w["id"]: w["live"] for w in found} == {"live-one": True, "silent-reported": False}
    assert next(w for w in found if w["id"] == "live-one")["runs"] == "3"


def redis_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


def test_history_gives_rates_and_the_chart_its_points() -> None:
    history = History()
    t0 = time.time() - 120
    for i in range(61):
        history.add("q", {"pending": 100 - i, "inflight": 4,
                          "totals": {"ok": 10 * i, "error": i // 10, "dead": 0}}, at=t0 + 2 * i)
    rate, failed = history.rates("q")
    assert rate == pytest.approx(5.0, abs=0.3) and failed == pytest.approx(3.0, abs=0.6)
    assert History().rates("q") == (None, None)
    rows = [[t, p, i] for t, p, i, _, _ in history.of("q")]
    drawn = chart(rows, now=t0 + 120)
    points = [tuple(map(float, p.split(","))) for p in drawn["pending"].split()]
    assert drawn["top"] == 100 and len(points) == 61
    assert points[-1][0] == pytest.approx(240) and points[0][1] == pytest.approx(2.0)
    assert all(0 <= x <= 240 and 0 <= y <= 44 for x, y in points)


def test_ages_read_short() -> None:
    assert [ago(s) for s in (None, -3, 4.9, 60, 65, 3600, 3660, 90_000)] == [
        "–", "0s", "4s", "1m", "1m 05s", "1h", "1h 01m", "1d 1h"]
