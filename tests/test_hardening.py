"""Issue 10's protocol findings, each against a real Redis through RequestQueue, Client or CLI."""

from __future__ import annotations

import asyncio
import inspect
import re
from importlib import resources
from typing import Iterator

import pytest
import redis
import redis.asyncio

from batchery import Client, InvalidRequest, Result
from batchery.batching.request import DEFAULT_PRIORITY, Request, RequestIds, map_requests
from batchery.batching.calls import Call, Reaped, complete_call, enqueue_call
from batchery.batching.claim_call import claim_call, packed_array
from batchery.batching.async_queue import AsyncRequestQueue
from batchery.batching.queue import RequestQueue
from batchery.batching.reply_lists import READER_LIVE_MS, results_in
from batchery.batching.scripts import FIXED_KEYS, NAMES, NOSCRIPT_TRIES, Scripts, helpers_for, source
from batchery.batching.settings import QueueSettings
from batchery.connection import RedisSettings
from batchery.errors import ConfigError
from tests.conftest import RedisServer, run_cli, wait_for
from tests.proxy import FaultyProxy


@pytest.fixture
def queue(rconn: redis.Redis, queue_name: str) -> RequestQueue:
    return RequestQueue(rconn, queue_name)


def fail_all(queue: RequestQueue, claimed: list) -> list[int]:
    return queue.fail([(r.id, r.lease_token, Result(r.id, "dead", error={
        "type": "RuntimeError", "message": "boom"}).to_json()) for r in claimed])


@pytest.mark.parametrize("name", ["inf", "Infinity", "NAN", "nan", "infinity", "-inf", "normal\n",
                                  "inf\n"])
def test_number_words_are_no_priority_class(name: str, redis_url: str, queue_name: str) -> None:
    with Client(redis_url, queue=queue_name) as c:
        with pytest.raises(ValueError, match="priority"):
            c.enqueue("x", priority=name)
    with pytest.raises(ConfigError, match="priority class"):
        QueueSettings().updated(class_delays={name: 1.0})


def test_enqueue_writes_nothing_when_entry_551_of_600_is_bad(queue: RequestQueue) -> None:
    # built without validation: what reaches the script when a caller skips the checks
    batch = [Request(id=f"r{i}", input=i) for i in range(600)]
    batch[550] = Request(id="r550", input=550, priority="nan")
    with pytest.raises(InvalidRequest, match="unknown priority class 'nan'"):
        queue.enqueue(batch, "c")
    k = queue.keys
    assert [queue.client.exists(key) for key in (k.pending, k.requests, k.sched, k.depth)] == [0] * 4
    with pytest.raises(InvalidRequest, match="unknown priority class 'inf'"):
        queue.enqueue([Request(id="r1", input=1, priority="inf")], "c")
    assert queue.enqueue(batch[:3], "c") == [True] * 3


def test_a_client_refuses_600_requests_whose_551st_is_bad(redis_url: str, queue: RequestQueue) -> None:
    entries = [{"id": f"r{i}", "input": i} for i in range(600)]
    entries[550]["priority"] = "infinity"
    with Client(redis_url, queue=queue.name) as c:
        with pytest.raises(ValueError, match="'infinity'"):
            c.enqueue_many(entries)
    assert queue.stats()["pending"] == 0 and not queue.client.exists(queue.keys.requests)


def test_a_duplicate_id_in_one_call_counts_once_and_the_first_payload_wins(queue: RequestQueue) -> None:
    first, second = Request(id="dup", input="first"), Request(id="dup", input="second")
    assert queue.enqueue([first, Request(id="other", input=0), second], "c") == [True, True, False]
    assert queue.stats()["pending_by_priority"] == {"normal": 2}
    assert queue.stats()["totals"]["enqueued"] == 2
    claimed = queue.claim("w#1", 10, 10_000, 0, 10).batch
    assert sorted((r.id, r.input) for r in claimed) == [("dup", "first"), ("other", 0)]
    assert queue.stats()["pending_by_priority"] == {}


def test_a_deadline_under_a_millisecond_is_a_deadline(queue: RequestQueue) -> None:
    queue.enqueue([Request.validated(id="soon", input=1, deadline=0.0004)], "c")
    assert queue.client.hget(queue.keys.sched, "soon").split(":")[1] != "0"


def test_dead_purge_and_retry_of_id_star_touch_that_id_only(queue: RequestQueue, redis_url: str) -> None:
    queue.update_settings(max_attempts=1)
    queue.enqueue([Request(id=i, input=i) for i in ("*", "a", "b")], "c")
    assert fail_all(queue, queue.claim("w#1", 10, 10_000, 0, 10).batch) == [2, 2, 2]
    name = queue.name
    assert "1 request(s) back" in run_cli("queue", "dead", "retry", "*", "--queue", name,
                                          redis_url=redis_url).stdout
    assert queue.client.zrange(queue.keys.dead, 0, -1) == ["a", "b"]
    assert fail_all(queue, queue.claim("w#2", 10, 10_000, 0, 10).batch) == [2]
    assert "1 dead request(s) purged" in run_cli("queue", "dead", "purge", "*", "--queue", name,
                                                 redis_url=redis_url).stdout
    assert queue.client.zrange(queue.keys.dead, 0, -1) == ["a", "b"]
    assert queue.revive(["a"]) == 1 and queue.purge(["b"]) == 1
    assert queue.client.zcard(queue.keys.dead) == 0


def test_a_dead_result_lives_as_long_as_its_dead_letter(queue: RequestQueue) -> None:
    queue.update_settings(max_attempts=1, result_ttl=1, dead_ttl=100)
    queue.enqueue([Request(id="a", input=1)], "c")
    assert fail_all(queue, queue.claim("w#1", 10, 10_000, 0, 10).batch) == [2]
    assert 60 < queue.client.ttl(queue.keys.result("a")) <= 100
    assert "boom" in queue.dead()[0].error["message"]
    queue.forget_results(["a"])  # what an offline job does once the line is in its output
    assert "dead result (with the error) was deleted" in queue.dead()[0].error["message"]


def test_an_expired_dead_letter_never_blocks_its_id(queue: RequestQueue) -> None:
    queue.update_settings(max_attempts=1, result_ttl=1, dead_ttl=1)
    queue.enqueue([Request(id="x", input="old"), Request(id="y", input="old")], "c")
    assert fail_all(queue, queue.claim("w#1", 10, 10_000, 0, 10).batch) == [2, 2]
    wait_for(lambda: queue.result("x") is None, timeout=30)
    # before any reaper ran: the id whose dead result is gone is new again
    assert queue.enqueue([Request(id="x", input="new")], "c") == [True]
    again = queue.claim("w#2", 10, 10_000, 0, 10).batch
    assert [(r.id, r.input, r.attempt) for r in again] == [("x", "new", 1)]
    assert queue.client.zrange(queue.keys.dead, 0, -1) == ["y"]
    # the reaper forgets a dead letter older than dead_ttl
    wait_for(lambda: queue.reap() and queue.client.zcard(queue.keys.dead) == 0, timeout=30)
    k = queue.keys
    assert [queue.client.hexists(h, "y") for h in (k.requests, k.sched, k.attempts, k.history)] == [False] * 4
    assert queue.enqueue([Request(id="y", input="new")], "c") == [True]


@pytest.fixture
def flaky(redis_server: RedisServer, queue_name: str) -> Iterator[tuple[FaultyProxy, RequestQueue]]:
    """The queue through a proxy that can lose a reply, with batchery's retrying client."""
    proxy = FaultyProxy(redis_server.port)
    client = RedisSettings.from_url(proxy.url).client()
    yield proxy, RequestQueue(client, queue_name)
    client.close()
    proxy.close()


def lose_next_reply(proxy: FaultyProxy, queue: RequestQueue, script: str) -> None:
    queue.client.script_load(source(script))  # so the lost reply is the script's, not NOSCRIPT
    proxy.drop_reply_to(getattr(queue.scripts, script).sha.encode())


def test_a_retried_claim_returns_the_batch_its_lost_reply_held(
        queue: RequestQueue, flaky: tuple[FaultyProxy, RequestQueue]) -> None:
    proxy, through_proxy = flaky
    queue.enqueue([Request(id=f"r{i}", input=i) for i in range(3)], "c")
    lose_next_reply(proxy, through_proxy, "claim")
    reply = through_proxy.claim("w#1", 10, 10_000, 0, 10)
    assert proxy.faults["replies dropped on purpose"] == 1
    assert [(r.id, r.input, r.attempt) for r in reply.batch] == [("r0", 0, 1), ("r1", 1, 1), ("r2", 2, 1)]
    assert queue.leases() == {"w#1": ["r0", "r1", "r2"]}
    # the batch commits; the same token later leases nothing it no longer holds
    assert queue.complete([(r.id, r.lease_token, Result(r.id, "ok", 1).to_json()) for r in reply.batch],
                          {}) == [True] * 3
    assert through_proxy.claim("w#1", 10, 10_000, 0, 10).batch == []


def test_a_claim_asked_again_keeps_its_expired_requests_apart_and_drops_what_it_lost(
        queue: RequestQueue) -> None:
    """The remembered claim (its ids, how many of them expired first, its wait and head
    rank) gives the same split again, less a request cancelled since."""
    queue.enqueue([Request.validated(id="late", input=0, deadline=0.001)], "c")
    queue.enqueue([Request(id=f"r{i}", input=i) for i in range(3)], "c")
    expire_ms = int(queue.client.hget(queue.keys.sched, "late").split(":")[1])

    def redis_ms() -> int:
        seconds, micros = queue.client.time()
        return seconds * 1000 + micros // 1000
    wait_for(lambda: redis_ms() > expire_ms, 5, message="the deadline to pass on Redis' clock")
    first = queue.claim("w#1", 10, 10_000, 0, 10)
    assert [r.id for r in first.expired] == ["late"]
    assert [r.id for r in first.batch] == ["r0", "r1", "r2"]
    again = queue.claim("w#1", 10, 10_000, 0, 10)
    assert ([r.id for r in again.expired], [r.id for r in again.batch]) == (["late"], ["r0", "r1", "r2"])
    assert (again.wait_ms, again.batch[0].chosen_against) == (first.wait_ms, first.batch[0].chosen_against)
    queue.cancel(["r1"])
    once_more = queue.claim("w#1", 10, 10_000, 0, 10)
    assert ([r.id for r in once_more.expired], [r.id for r in once_more.batch]) == (["late"], ["r0", "r2"])


def test_a_claim_asked_again_hands_over_an_unreadable_request_without_its_entry_again(
        queue: RequestQueue) -> None:
    queue.enqueue([Request(id=f"r{i}", input=i) for i in range(2)], "c")
    queue.client.hset(queue.keys.sched, "r0", "999999999:0:0:0:normal:c")  # 9 digits: past 1e7
    for _ in range(2):  # the claim, then the same token again (a retried call)
        reply = queue.claim("w#1", 10, 10_000, 0, 10)
        assert [(r.id, bool(r.invalid)) for r in reply.batch] == [("r0", True), ("r1", False)]


def test_the_largest_count_a_request_may_have_is_claimed_as_it_is(queue: RequestQueue) -> None:
    """10,000,000 tokens (Request's most, 8 digits) given by the producer or counted by a
    worker is a count, not an unreadable entry."""
    queue.enqueue([Request.validated(id="given", input="x", tokens=10_000_000),
                   Request.validated(id="counted", input="y")], "c")
    priced = queue.claim("w#1", 1, 10_000, 0, 10, price_estimates=True)
    assert [i for i, _ in priced.to_price] == ["counted"]
    first = queue.claim("w#1", 1, 10_000, 0, 10, price_estimates=True,
                        counts=[("counted", 10_000_000)])
    second = queue.claim("w#2", 1, 10_000, 0, 10, price_estimates=True)
    assert [(r.id, r.tokens, r.invalid) for r in first.batch + second.batch] == \
        [("counted", 10_000_000, None), ("given", 10_000_000, None)]  # (one rank: by id)


def test_a_retried_cancel_reports_the_cancel(queue: RequestQueue,
                                             flaky: tuple[FaultyProxy, RequestQueue]) -> None:
    proxy, through_proxy = flaky
    queue.enqueue([Request(id="q", input=1), Request(id="done", input=2)], "c")
    lose_next_reply(proxy, through_proxy, "cancel")
    assert through_proxy.cancel(["q"]) == [3]
    assert proxy.faults["replies dropped on purpose"] == 1
    assert queue.result("q").status == "cancelled" and queue.stats()["pending"] == 1
    claimed = queue.claim("w#1", 10, 10_000, 0, 10).batch
    queue.complete([(r.id, r.lease_token, Result(r.id, "ok", 1).to_json()) for r in claimed], {})
    assert queue.cancel(["done", "never-enqueued"]) == [0, 0]


# Prepended to each script: every keyed command must name a key the caller declared in
# KEYS, as Redis Cluster demands (a standalone Redis does not check).
STRICT = """
local unchecked = {call = redis.call, pcall = redis.pcall}
local declared_keys = {}
for _, key in ipairs(KEYS) do declared_keys[key] = true end
local function checked(how)
  return function(command, ...)
    local key = ...
    if command ~= 'TIME' and command ~= 'INFO' and not declared_keys[key] then
      error('undeclared key ' .. tostring(key) .. ' in ' .. command)
    end
    return unchecked[how](command, ...)
  end
end
local redis = {call = checked('call'), pcall = checked('pcall')}
"""


class StrictScripts(Scripts):
    def __init__(self, client: redis.Redis) -> None:
        for name in NAMES:
            setattr(self, name, client.register_script(STRICT + source(name)))


def test_scripts_touch_only_the_keys_they_declare(queue: RequestQueue) -> None:
    queue.scripts = StrictScripts(queue.client)
    queue.update_settings(max_attempts=1, lease_seconds=1)
    assert queue.enqueue([Request(id=i, input=i) for i in ("a", "b", "c", "d", "e")], "c1") == [True] * 5
    assert queue.enqueue([Request(id="a", input=0)], "c1") == [False]
    assert queue.cancel(["e"]) == [1] and queue.cancel(["e"]) == [3]
    a, b, c, d = queue.claim("w#1", 10, 10_000, 0, 10).batch
    assert queue.complete([(a.id, a.lease_token, Result(a.id, "ok", 1).to_json())], {"requests": 1},
                          [a.client]) == [True]
    assert fail_all(queue, [b]) == [2]
    assert queue.release([(c.id, c.lease_token)]) == 1
    assert queue.renew("w", [(d.id, d.lease_token)]) == []
    assert queue.lookup(["a", "b", "c"]) == [queue.result("a"), queue.result("b"), True]
    assert queue.revive(everything=True) == 1 and queue.purge(["x"], everything=True) == 0
    wait_for(lambda: queue.reap() == Reaped(dead=["d"]), timeout=30)  # d's lease lapsed: dead
    assert queue.renew("w", []) == []
    assert queue.stats()["dead"] == 1 and queue.forget_workers(3600) == 1
    # ids the client made (no result key declared) and a commit of a reader reading alone
    # (keyless)
    queue.client.set(queue.keys.reader("c2"), "1", px=READER_LIVE_MS)
    made = list(map_requests(["x", "y"], DEFAULT_PRIORITY, None, RequestIds(), lambda v: None))
    assert queue.enqueue(made, "c2") == [True, True]
    batch = [r for r in queue.claim("w#2", 10, 10_000, 0, 10).batch if r.client == "c2"]
    assert queue.complete([(r.id, r.lease_token, Result(r.id, "ok", 1).to_json()) for r in batch],
                          {"requests": 2}, [r.client for r in batch]) == [True, True]
    assert len(results_in(queue.client.lrange(queue.keys.reply("c2"), 0, -1))) == 2
    assert "c2" not in queue.keyed_clients


@pytest.mark.parametrize("end", ["first", "last"])
def test_an_id_is_sent_once_in_its_result_key_and_a_key_not_one_is_refused(
        queue: RequestQueue, end: str) -> None:
    """The complete script takes each request's id from its result key (an id is sent
    once: each value handed to a script is made a Lua string); an enqueue sends its ids as
    values, and declares their result keys only when its duplicate check reads them (ids
    the client made and never sent declare none: a key fewer a request). A call whose first
    or last declared key is not a result key of the queue (a caller's bug) is refused, with
    what is wrong, and writes nothing; the same call with its keys whole goes through."""
    def tampered(call: Call, script: str) -> Call:
        keys = list(call.keys)
        at = len(FIXED_KEYS[script]) if end == "first" else len(FIXED_KEYS[script]) + 2
        keys[at] = "elsewhere:" + keys[at]
        return Call(keys, call.args)
    requests = [Request(id=i, input=f"input of {i}") for i in ("a", "b", "c")]
    call = enqueue_call(queue.keys, requests, "c1")  # ids given: checked
    assert [v for v in call.args if v in {"a", "b", "c"}] == ["a", "b", "c"]  # each once
    assert call.keys[len(FIXED_KEYS["enqueue"]):] == [queue.keys.result(i) for i in "abc"]
    unsent = list(map_requests(["x", "y"], DEFAULT_PRIORITY, None, RequestIds(), lambda v: None))
    assert len(enqueue_call(queue.keys, unsent, "c1").keys) == len(FIXED_KEYS["enqueue"])
    with pytest.raises(redis.ResponseError, match="enqueue needs the result key of each id"):
        queue._run("enqueue", tampered(call, "enqueue"))
    assert queue.client.zcard(queue.keys.pending) == 0 and not queue.client.exists(queue.keys.requests)
    assert queue._run("enqueue", call)[2] == "111"
    batch = queue.claim("w#1", 10, 10_000, 0, 10).batch
    assert [(r.id, r.input) for r in batch] == [(i, f"input of {i}") for i in ("a", "b", "c")]
    items = [(r.id, r.lease_token, Result(r.id, "ok", r.id.upper()).to_json()) for r in batch]
    done = complete_call(queue.keys, items, {"requests": 3}, [r.client for r in batch])
    assert not {"a", "b", "c"} & set(done.args)
    with pytest.raises(redis.ResponseError, match="complete needs the result key of each id"):
        queue._run("complete", tampered(done, "complete"))
    assert queue.results(["a", "b", "c"]) == [None, None, None]
    assert queue._run("complete", done) == "111"
    assert [r.output for r in queue.results(["a", "b", "c"])] == ["A", "B", "C"]


@pytest.mark.parametrize("change", [-1, 1])
def test_a_call_whose_result_keys_and_ids_differ_in_number_is_refused(
        queue: RequestQueue, change: int) -> None:
    """An enqueue declares exactly one result key an id, a commit one an id and then its
    reply lists: a call with a key fewer, or an enqueue with one more (a caller's bug), is
    refused with what is wrong and writes nothing."""
    requests = [Request(id=i, input=i) for i in ("a", "b")]
    call = enqueue_call(queue.keys, requests, "")
    short = call.keys[:-1] if change < 0 else [*call.keys, queue.keys.result("c")]
    with pytest.raises(redis.ResponseError, match="enqueue needs the result key of each id"):
        queue._run("enqueue", Call(short, call.args))
    assert not queue.client.exists(queue.keys.pending, queue.keys.requests)
    queue.enqueue(requests)
    batch = queue.claim("w#1", 10, 10_000, 0, 10).batch
    items = [(r.id, r.lease_token, Result(r.id, "ok", r.id).to_json()) for r in batch]
    done = complete_call(queue.keys, items, {"requests": 2}, ["", ""])
    if change < 0:
        with pytest.raises(redis.ResponseError, match="complete needs the result key of each id"):
            queue._run("complete", Call(done.keys[:-1], done.args))
    assert queue.results(["a", "b"]) == [None, None]
    assert queue.complete(items, {"requests": 2}) == [True, True]


def test_an_enqueue_sent_again_to_a_server_that_lost_its_scripts_is_answered_from_its_first_run(
        queue: RequestQueue) -> None:
    """A pipelined enqueue (a sharded queue's) ran, its reply was lost, and the server
    lost its scripts before the connection sent it again (a restart, a failover, SCRIPT
    FLUSH): the retry's NOSCRIPT has the same call loaded and run under its own call key,
    which answers from its first run: accepted, queued and counted once. (The client's own
    new ids skip the duplicate check: that memory is what keeps them from a second run.)"""
    ids = iter("abc")  # ids the client made: no duplicate check on their first send
    made = list(map_requests("abc", "normal", None, ids.__next__, lambda value: None))
    queue.client.script_load(source("enqueue"))
    pipe = queue.client.pipeline(transaction=False)
    read = queue.enqueue_in(pipe, made, "c1", 1)
    assert pipe.execute(raise_on_error=False)[0][2] == "111"  # it ran; its reply is lost
    queue.client.script_flush()
    assert read(redis.exceptions.NoScriptError("NOSCRIPT No matching script")) == [True] * 3
    stats = queue.stats()
    assert stats["pending"] == stats["totals"]["enqueued"] == 3
    assert int(queue.client.hget(queue.keys.depth, "normal")) == 3


def _losing_scripts_after_loads(client: object, lost: int) -> list[str]:
    """Have ``client``'s server lose its scripts right after each of the first ``lost`` loads
    (a restart between a script's load and its call): the loads so far."""
    real, loads = client.script_load, []  # type: ignore[attr-defined]

    def load_then_lose(script: str) -> object:
        sha = real(script)
        if inspect.isawaitable(sha):
            async def later() -> object:
                done = await sha
                if len(loads) < lost:
                    loads.append(done)
                    await client.script_flush()  # type: ignore[attr-defined]
                return done
            return later()
        if len(loads) < lost:
            loads.append(sha)
            client.script_flush()  # type: ignore[attr-defined]
        return sha
    client.script_load = load_then_lose  # type: ignore[attr-defined]
    return loads


@pytest.mark.parametrize("lost", [1, NOSCRIPT_TRIES - 1, NOSCRIPT_TRIES])
def test_a_script_lost_again_between_its_load_and_its_call_is_loaded_and_called_again(
        queue: RequestQueue, lost: int) -> None:
    """A server that restarts between a script's load and its call answers NOSCRIPT to the
    call that was to run it (a worker whose first heartbeat met a Redis restart so died
    with a traceback): the call, which did not run, is made again from the start, and runs
    once; a server that loses it at every try, NOSCRIPT_TRIES in all, gets NOSCRIPT."""
    queue.client.script_flush()
    loads = _losing_scripts_after_loads(queue.client, lost)
    ids = iter("ab")
    made = list(map_requests("ab", "normal", None, ids.__next__, lambda value: None))
    if lost == NOSCRIPT_TRIES:
        with pytest.raises(redis.exceptions.NoScriptError):
            queue.enqueue(made, "c1")
        assert queue.stats()["pending"] == 0
        return
    assert queue.enqueue(made, "c1") == [True, True]
    assert len(loads) == lost
    stats = queue.stats()
    assert stats["pending"] == stats["totals"]["enqueued"] == 2


def test_an_asyncio_script_lost_again_between_its_load_and_its_call_is_called_again(
        redis_url: str, queue_name: str) -> None:
    async def run() -> list[bool]:
        client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
        try:
            queue = AsyncRequestQueue(client, queue_name)
            await client.script_flush()
            loads = _losing_scripts_after_loads(client, NOSCRIPT_TRIES - 1)
            ids = iter("ab")
            made = list(map_requests("ab", "normal", None, ids.__next__, lambda value: None))
            done = await queue.enqueue(made, "c1")
            assert len(loads) == NOSCRIPT_TRIES - 1
            return done
        finally:
            await client.aclose()
    assert asyncio.run(run()) == [True, True]
    with Client(redis_url, queue_name) as client:
        assert client.queue.stats()["pending"] == 2


@pytest.mark.parametrize("arg, value", [
    (9, packed_array([1])), (9, packed_array([1, 1, 1])), (9, b"1"), (9, b""), (9, b"\xc1"),
    (9, packed_array([1, 1])[:-1]), (8, b"\xa2ab"), (8, b""), (8, b"\x92\xa1a")],
    ids=["fewer counts", "more counts", "counts not an array", "no counts",
         "counts not MessagePack", "counts cut short", "ids a text", "no ids", "ids cut short"])
def test_a_claim_whose_counts_and_ids_differ_in_number_is_refused_before_it_writes(
        queue: RequestQueue, arg: int, value: bytes) -> None:
    """The claim takes a worker's counts as two MessagePack arrays, the ids and their counts:
    a call whose arrays differ in length, or that are not arrays (a caller's bug), is refused
    with what is wrong, before anything is written, and leases nothing."""
    queue.enqueue([Request(id=i, input=i) for i in ("a", "b")])
    call = claim_call(queue.keys, "w#1", 10, 10_000, 0, 10, True, [("a", 1), ("b", 1)], None)
    call.args[arg] = value
    before = queue.client.dump(queue.keys.pending)
    with pytest.raises(redis.ResponseError, match="claim needs the ids counted and one count"):
        queue._run("claim", call)
    assert queue.client.dump(queue.keys.pending) == before
    assert not queue.client.exists(queue.keys.lease_ids)
    assert [r.id for r in queue.claim("w#2", 10, 10_000, 0, 10).batch] == ["a", "b"]


COMMON = '''-- header
local rcall = redis.call

-- one
local function one() return rcall('TIME') end
local A, B = 1, 2
-- two uses one (not unused)
local function two() return one() + A end
local function unused() return B end
'''


def test_a_script_is_sent_with_the_helpers_it_names_and_those_they_name() -> None:
    assert helpers_for("return two()", COMMON) == COMMON.replace(
        "local function unused() return B end\n", "")
    assert helpers_for("return 1", COMMON) == ""
    assert helpers_for("return A", COMMON) == "local A, B = 1, 2\n"
    assert helpers_for("return one()", COMMON) == COMMON.split("local A")[0]
    for line in ("x = 1", "local a = 1; local b = 2", "local s = [[x]]", "--[[ old ]]"):
        with pytest.raises(ValueError, match="cannot cut"):
            helpers_for("return 1", COMMON + line + "\n")


def test_every_script_compiles_with_each_helper_it_names(rconn: redis.Redis) -> None:
    """Whatever helper a script names outside a comment (itself or through another), it is
    sent with it: a name left out would be a global, an error only when that line runs."""
    common = (resources.files("batchery.batching") / "lua" / "_common.lua").read_text()
    defined = {n.strip() for m in re.finditer(r"^local (?:function (\w+)|([\w, ]+?) *=)", common, re.M)
               for n in (m.group(1) or m.group(2)).split(",")}
    for name in NAMES:
        text = source(name)
        rconn.script_load(text)
        sent = {n.strip() for m in re.finditer(r"^local (?:function (\w+)|([\w, ]+?) *=)", text, re.M)
                for n in (m.group(1) or m.group(2)).split(",")}
        named = set(re.findall(r"[A-Za-z_]\w*", re.sub(r"--[^\n]*", "", text))) & defined
        assert named <= sent, (name, named - sent)
    assert "local function fair_list(" not in source("complete")  # not all of them


def test_stats_and_forget_workers_read_the_queues_own_clock(private_redis: RedisServer,
                                                           queue_name: str) -> None:
    """The clock comes from TIME inside a script, on the node that holds the queue, never
    from the client's TIME (in a Cluster that may ask another node). (A server of its own:
    the commands watched are this test's alone.)"""
    rconn = RedisSettings.from_url(private_redis.url).client()
    queue = RequestQueue(rconn, queue_name)
    queue.renew("w", [])
    marker = f"done-{queue.name}"
    with rconn.monitor() as monitor:
        queue.forget_workers(3600)
        assert queue.stats()["workers"] == 1
        queue.client.echo(marker)
        seen = []
        for command in monitor.listen():
            if marker in command["command"]:
                break
            seen.append((command["client_type"], command["command"].split()[0].upper()))
    assert ("lua", "TIME") in seen
    assert [c for c in seen if c[1] == "TIME" and c[0] != "lua"] == []


def test_a_retried_complete_reports_the_commit_once(queue: RequestQueue,
                                                    flaky: tuple[FaultyProxy, RequestQueue]) -> None:
    proxy, through_proxy = flaky
    queue.enqueue([Request(id="a", input=1)], "c")
    (a,) = queue.claim("w#1", 10, 10_000, 0, 10).batch
    lose_next_reply(proxy, through_proxy, "complete")
    assert through_proxy.complete([(a.id, a.lease_token, Result(a.id, "ok", 1).to_json())],
                                  {"requests": 1}) == [True]
    assert proxy.faults["replies dropped on purpose"] == 1
    assert queue.stats()["totals"]["requests"] == 1


def test_a_retried_enqueue_reports_its_ids_as_accepted(queue: RequestQueue, redis_url: str,
                                                       flaky: tuple[FaultyProxy, RequestQueue]) -> None:
    proxy, through_proxy = flaky
    lose_next_reply(proxy, through_proxy, "enqueue")
    assert through_proxy.enqueue([Request(id="a", input=1), Request(id="b", input=2)], "c") == [True, True]
    assert proxy.faults["replies dropped on purpose"] == 1
    assert queue.stats()["totals"]["enqueued"] == 2
    assert through_proxy.enqueue([Request(id="a", input=1)], "c") == [False]  # a new call: known
    with Client(proxy.url, queue=queue.name) as client:
        lose_next_reply(proxy, through_proxy, "enqueue")
        handles = client.enqueue_many([{"input": i} for i in (3, 4)])
        assert proxy.faults["replies dropped on purpose"] == 2
        batch = queue.claim("w#1", 10, 10_000, 0, 10).batch
        assert sorted(r.id for r in batch) == sorted(["a", "b", *(h.id for h in handles)])
        queue.complete([(r.id, r.lease_token, Result(r.id, "ok", r.input).to_json()) for r in batch], {},
                       [r.client for r in batch])
        assert [h.result(timeout=30).output for h in handles] == [3, 4]


@pytest.mark.parametrize("max_attempts, flag, total", [(3, 1, "retries"), (1, 2, "dead")])
def test_a_retried_fail_reports_what_the_first_run_did(
        queue: RequestQueue, flaky: tuple[FaultyProxy, RequestQueue],
        max_attempts: int, flag: int, total: str) -> None:
    proxy, through_proxy = flaky
    queue.update_settings(max_attempts=max_attempts)
    queue.enqueue([Request(id="a", input=1)], "c")
    claimed = queue.claim("w#1", 10, 10_000, 0, 10).batch
    lose_next_reply(proxy, through_proxy, "fail")
    assert fail_all(through_proxy, claimed) == [flag]
    assert proxy.faults["replies dropped on purpose"] == 1
    assert queue.stats()["totals"][total] == 1
    assert fail_all(queue, claimed) == [0]  # a new call after the lease is gone: lost


def test_retried_renew_release_and_reap_change_nothing_twice(
        queue: RequestQueue, flaky: tuple[FaultyProxy, RequestQueue]) -> None:
    """The other scripts that hold, give back or take back leases, each run twice (its
    first reply lost): the second run finds the work done and does it not again."""
    proxy, through_proxy = flaky
    queue.update_settings(lease_seconds=1)
    queue.enqueue([Request(id=i, input=i) for i in ("a", "b", "c")], "c")
    a, b, c = queue.claim("w#1", 10, 10_000, 0, 10).batch
    lose_next_reply(proxy, through_proxy, "renew")
    assert through_proxy.renew("w", [(a.id, a.lease_token)]) == []  # still held
    lose_next_reply(proxy, through_proxy, "release")
    through_proxy.release([(b.id, b.lease_token)])
    assert queue.client.zrange(queue.keys.pending, 0, -1) == ["b"]
    assert queue.stats()["pending"] == 1 and queue.depth() == {"normal": 1}
    lose_next_reply(proxy, through_proxy, "reap")
    wait_for(lambda: (through_proxy.reap(), queue.stats()["pending"] == 3)[1], timeout=30,
             message="a and c's leases to lapse and be taken back")
    assert proxy.faults["replies dropped on purpose"] == 3
    assert sorted(queue.client.zrange(queue.keys.pending, 0, -1)) == ["a", "b", "c"]
    assert queue.stats()["pending"] == 3 and queue.depth() == {"normal": 3}
    again = queue.claim("w#2", 10, 10_000, 0, 10).batch
    assert {r.id: r.attempt for r in again} == {"a": 2, "b": 1, "c": 2}  # one lost lease each
