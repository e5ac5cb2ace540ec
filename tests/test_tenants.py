"""A tenant on every request (client, asyncio client, CLI, job lines) and per-tenant
quotas in the queue settings, against a real Redis."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis

from batchery import AsyncClient, Client, InvalidRequest, QueueFull
from batchery.batching.messages import Result
from batchery.batching.request import Request
from batchery.batching.queue import RequestQueue
from batchery.batching.inspection import SERVED_KEPT
from batchery.batching.settings import QueueSettings
from batchery.batching.request import RequestIds, map_requests
from batchery.producer.jobs.files import LineParser
from tests.conftest import run_cli, stop_process, wait_for
from tests.jobs_helpers import start_jobs_worker, submit, write_lines


@pytest.fixture
def queue(rconn: redis.Redis, queue_name: str) -> RequestQueue:
    return RequestQueue(rconn, queue_name)


def claimed_tenants(queue: RequestQueue) -> dict[str, str]:
    """Claim everything queued: request id -> the tenant its claim carries."""
    reply = queue.claim("w#tenants", 4096, 10**9, 0, 4096)
    return {r.id: r.tenant for r in reply.batch}


def test_the_tenant_travels_from_each_client_call_to_the_claim(
        redis_url: str, queue_name: str, queue: RequestQueue) -> None:
    with Client(redis_url, queue_name, tenant="team-a") as client:
        client.enqueue("x", id="own")
        client.enqueue("x", id="given", tenant="team-b")
        client.enqueue_many([{"input": "x", "id": "many", "tenant": "team-c"}])
    with Client(redis_url, queue_name) as plain:
        plain.enqueue("x", id="plain")

    async def run_async() -> None:
        async with AsyncClient(redis_url, queue_name, tenant="async-t") as ac:
            await ac.enqueue("x", id="async-own")
            await ac.enqueue("x", id="async-given", tenant="async-u")
    asyncio.run(run_async())
    assert claimed_tenants(queue) == {"own": "team-a", "given": "team-b", "many": "team-c",
                                      "plain": "default", "async-own": "async-t",
                                      "async-given": "async-u"}


def test_map_requests_all_carry_the_tenant() -> None:
    made = list(map_requests(["a", "b", "c"], "batch", None, RequestIds(), lambda _: 2, "t1"))
    assert [r.tenant for r in made] == ["t1"] * 3


def test_a_tenant_is_checked_by_the_name_rule(redis_url: str, queue_name: str) -> None:
    for bad, words in ((["a"], "string"), ("", "1-128"), ("a\tb", "control"), ("x" * 129, "1-128")):
        with pytest.raises(InvalidRequest, match=words):
            Request.validated(id="r", input=1, tenant=bad)
    with pytest.raises(InvalidRequest, match="tenant"):
        Client(redis_url, queue_name, tenant="a\nb")
    done = run_cli("enqueue", "--text", "x", "--queue", queue_name, "--tenant", "bad\x01",
                   redis_url=redis_url)
    assert done.returncode != 0 and "tenant" in done.stderr and "Traceback" not in done.stderr


def test_cli_enqueue_and_job_lines_carry_their_tenant(
        redis_url: str, queue_name: str, queue: RequestQueue, tmp_path: Path) -> None:
    done = run_cli("enqueue", "--text", "x", "--id", "cli", "--queue", queue_name,
                   "--tenant", "ops", redis_url=redis_url)
    assert done.returncode == 0, done.stderr
    source = write_lines(tmp_path / "in.jsonl", [{"custom_id": "a", "input": "x"},
                                                 {"custom_id": "b", "input": "x", "tenant": "own"}])
    jobs_queue = f"jobs-{queue_name}"
    worker = start_jobs_worker(redis_url, jobs_queue)
    try:  # (a jobs worker runs one job at a time: one job here)
        job = submit(redis_url, jobs_queue, queue_name, source, tmp_path / "out.jsonl",
                     "--tenant", "nightly")
        wait_for(lambda: queue.held()["pending"] == 3, 60, message="the job to enqueue")
    finally:
        stop_process(worker)
    assert claimed_tenants(queue) == {"cli": "ops", f"{job}:a": "nightly", f"{job}:b": "own"}
    # without --tenant, a job's lines are served as the job's own tenant
    parser = LineParser("job1", "batch", QueueSettings(), lambda _: None)
    lines = [parser.parse(n, json.dumps(obj).encode()) for n, obj in
             enumerate([{"input": "x"}, {"input": "x", "tenant": "own"}], 1)]
    assert [line.request.tenant for line in lines] == ["job1", "own"]


def test_a_tenant_over_its_max_pending_is_refused_and_others_are_not(
        redis_url: str, queue_name: str, queue: RequestQueue) -> None:
    done = run_cli("queue", "config", queue_name, "--tenant-max-pending", "small=2",
                   "--tenant-weight", "big=3", "--json", redis_url=redis_url)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["tenant_max_pending"] == {"small": 2} and shown["tenant_weights"] == {"big": 3.0}
    with Client(redis_url, queue_name, tenant="small") as client:
        client.enqueue("x", id="s1")
        with pytest.raises(QueueFull, match="tenant 'small'.*tenant_max_pending of 2") as refused:
            client.enqueue_many([{"input": "x", "id": "s2"}, {"input": "x", "id": "s3"}])
        assert refused.value.reason == "tenant"
        assert queue.lookup(["s2"]) == [False]  # all or nothing
        client.enqueue_many([{"input": "x", "id": f"o{i}", "tenant": "other"} for i in range(5)])
        client.enqueue("x", id="s2")  # room for one more
        queue.claim("w#1", 10, 10**9, 0, 10)  # claimed: no longer pending for its tenant
        client.enqueue_many([{"input": "x", "id": "s4"}, {"input": "x", "id": "s5"}])
    # changed at run time: the next enqueue reads it
    assert run_cli("queue", "config", queue_name, "--tenant-max-pending", "small=0",
                   redis_url=redis_url).returncode == 0
    with Client(redis_url, queue_name, tenant="small") as client:
        client.enqueue_many([{"input": "x", "id": f"more{i}"} for i in range(10)])
    cli = run_cli("enqueue", "--text", "x", "--queue", queue_name, "--tenant", "tiny",
                  redis_url=redis_url)
    assert cli.returncode == 0
    run_cli("queue", "config", queue_name, "--tenant-max-pending", "tiny=1", redis_url=redis_url)
    cli = run_cli("enqueue", "--text", "x", "--queue", queue_name, "--tenant", "tiny",
                  redis_url=redis_url)
    assert cli.returncode == 3 and "tenant 'tiny'" in cli.stderr, cli.stderr


def test_bad_tenant_settings_are_refused_with_the_reason(redis_url: str, queue_name: str) -> None:
    for args, words in ((("--tenant-weight", "a"), "TENANT=VALUE"),
                        (("--tenant-weight", "a=0"), "0.01"),
                        (("--tenant-max-pending", "a=-1"), "0 (no limit)"),
                        (("--tenant-max-pending", "=3"), "TENANT=VALUE"),
                        (("--tenant-token-rate", "a=-5"), "0 (no limit)"),
                        (("--tenant-token-rate", "a=fast"), "TENANT=VALUE")):
        done = run_cli("queue", "config", queue_name, *args, redis_url=redis_url)
        assert done.returncode != 0 and words in done.stderr and "Traceback" not in done.stderr, \
            (args, done.stderr)
    done = run_cli("queue", "config", queue_name, "--tenant-token-rate", "a=250", "--json",
                   redis_url=redis_url)
    assert done.returncode == 0 and json.loads(done.stdout)["tenant_token_rates"] == {"a": 250.0}


@pytest.mark.parametrize("shards", [1, 3])
def test_queue_stats_shows_the_most_loaded_tenants_and_sums_the_rest(
        redis_url: str, queue_name: str, shards: int) -> None:
    if shards > 1:
        assert run_cli("queue", "config", queue_name, "--shards", str(shards),
                       redis_url=redis_url).returncode == 0
    with Client(redis_url, queue_name) as client:
        for t in range(13):  # tenant t holds t + 1 requests of 5 tokens
            client.enqueue_many([{"input": "x", "tokens": 5, "tenant": f"team-{t:02d}"}
                                 for _ in range(t + 1)], reply=False)
        claimed = client.queue.claim("w#stats", 20, 10**9, 0, 4096)
    served, inflight = {}, {}
    for r in claimed.batch:
        served[r.tenant] = served.get(r.tenant, 0) + r.tokens
        inflight[r.tenant] = inflight.get(r.tenant, 0) + 1
    done = run_cli("queue", "stats", "--queue", queue_name, "--json", redis_url=redis_url)
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)["queues"][queue_name]
    pending = {f"team-{t:02d}": t + 1 for t in range(13)}
    for r in claimed.batch:
        pending[r.tenant] -= 1
    shown = stats["tenants"]
    assert len(shown) == 10 and stats["tenants_other"]["tenants"] == 3
    assert list(shown) == sorted(pending, key=lambda t: (-pending[t], -served.get(t, 0), t))[:10]
    assert {t: v["pending"] for t, v in shown.items()} == {t: pending[t] for t in shown}
    assert sum(v["served_tokens"] for v in shown.values()) + \
        stats["tenants_other"]["served_tokens"] == sum(served.values()) > 0
    assert sum(v["pending"] for v in shown.values()) + stats["tenants_other"]["pending"] == \
        stats["pending"]
    assert {t: v["inflight"] for t, v in shown.items()} == {t: inflight.get(t, 0) for t in shown}
    assert sum(v["inflight"] for v in shown.values()) + stats["tenants_other"]["inflight"] == \
        stats["inflight"] == len(claimed.batch)
    text = run_cli("queue", "stats", "--queue", queue_name, redis_url=redis_url).stdout
    assert "team-12" in text and "(3 other tenants)" in text and "inflight" in text.split("tenant of")[1]


def claim_and_finish(queue: RequestQueue, token: str, size: int) -> int:
    """Claim a batch and commit its results at once (its tenants leave the queue)."""
    batch = queue.claim(token, size, 10**9, 0, 4096).batch
    queue.complete([(r.id, r.lease_token, Result(r.id, "ok", output=1).to_json()) for r in batch],
                   {})
    return len(batch)


def test_the_served_totals_stay_bounded_however_many_tenants_come_and_go(
        queue: RequestQueue) -> None:
    """A job id per tenant: past SERVED_KEPT tenants served, the reaper folds the idle ones
    served least into one sum (stats count and add them in "other"); the most served and
    those with work queued stay by name; counters at their class's floor are dropped."""
    n = SERVED_KEPT + 300
    queue.enqueue([Request.validated(id=f"job-{i}", input="x", tokens=1 + i % 7,
                                     tenant=f"job-{i}") for i in range(n)])
    queue.enqueue([Request.validated(id=f"big-{i}", input="x", tokens=50, tenant="big")
                   for i in range(40)])
    while claim_and_finish(queue, f"w#fold-{queue.client.zcard(queue.keys.pending)}", 256):
        pass
    # one more tenant served alone a while: the class's floor passes the job ids' counters
    queue.enqueue([Request.validated(id=f"later-{i}", input="x", tokens=50, tenant="later")
                   for i in range(20)])
    while claim_and_finish(queue, f"w#later-{queue.client.zcard(queue.keys.pending)}", 1):
        pass
    waiting_tenant = "job-0"  # served least, but with work queued again
    queue.enqueue([Request.validated(id="job-0-again", input="x", tokens=1, tenant=waiting_tenant)])
    before = {t: int(v) for t, v in queue.client.hgetall(queue.keys.served).items()}
    counters = queue.client.hlen(queue.keys.vtc)
    queue.reap()  # the reaper's turn folds
    after = queue.client.hgetall(queue.keys.served)
    named = {t for t in after if not t.startswith("\t")}
    assert len(named) <= SERVED_KEPT // 2 + 1
    assert {"big", waiting_tenant} <= named  # the most served, the one with work queued
    assert int(after["\tfolded_tenants"]) == len(before) - len(named)
    assert sum(int(v) for t, v in after.items() if t in named) + int(after["\tfolded_tokens"]) \
        == sum(before.values())
    while queue.fold_tenants() or queue.counters_cursor != "0":  # the rest of the walk
        pass
    assert queue.client.hlen(queue.keys.vtc) < counters / 2
    stats = queue.stats(workers=False)
    assert stats["tenants_other"]["tenants"] + len(stats["tenants"]) == len(before)
    assert stats["tenants_other"]["served_tokens"] + sum(
        v["served_tokens"] for v in stats["tenants"].values()) == sum(before.values())
    assert queue.fold_tenants() == 0  # nothing more to fold until more tenants come
