"""Results pushed onto a reply list alone (lua/complete.lua, producer/replies.py): while a
client's reader reads its list and the queue deletes delivered results, a commit writes
no result key, only the list; every other result is kept under its key too. What a
reader that stopped leaves behind, the reaper keeps under the keys (lua/drain.lua); a
result that reaches nobody, the reader keeps there; a result on its way is never taken
for a lost request."""

from __future__ import annotations

import gc
import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from batchery import Client, Result
from batchery.batching.calls import complete_call, drain_call
from batchery.batching.keys import Keys
from batchery.batching.queue import RequestQueue
from batchery.batching.reply_lists import (READER_LIVE_MS, Popped, ReadState, UnreadableRead,
                                           parse_reply_read, reply_read, results_in,
                                           to_delete, unreached)
from batchery.batching.request import Request
from batchery.batching.settings import DEFAULTS
from tests.conftest import examples, start_worker, stop_process, wait_for


def enqueued(queue: RequestQueue, n: int, client: str) -> list:
    """n requests of ``client``, claimed: what a worker holds to commit."""
    tag = uuid.uuid4().hex[:6]
    assert all(queue.enqueue([Request.validated(id=f"{tag}-{i}", input=i)
                              for i in range(n)], client))
    return queue.claim("w#" + tag, n, 10 ** 6, 0, n).batch


def committed(queue: RequestQueue, claimed: list) -> list[bool]:
    return queue.complete([(r.id, r.lease_token, Result(r.id, "ok", r.input).to_json())
                           for r in claimed], {"requests": len(claimed)},
                          [r.client for r in claimed])


def read(queue: RequestQueue, client: str, parity: int, alone: bool = True) -> list[Result]:
    """A read as the client's reader makes it (it marks the reader)."""
    pipe = queue.client.pipeline(transaction=False)
    deletes = reply_read(pipe, [queue.keys], client, parity, alone, 0.01)
    return parse_reply_read(pipe.execute(raise_on_error=False), deletes, 1).results


@settings(max_examples=examples(25), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mark=st.sampled_from([None, "0", "1"]), delete_delivered=st.booleans(),
       client=st.sampled_from(["c1", ""]), n=st.integers(1, 5))
# a reader reading alone on a queue that keeps delivered results: its results are kept
# under their keys too (one draw in twelve: not left to the draws)
@example(mark="1", delete_delivered=False, client="c1", n=2)
def test_a_commit_skips_the_result_key_only_for_a_reader_reading_alone(
        rconn: redis.Redis, mark: str | None, delete_delivered: bool, client: str,
        n: int) -> None:
    queue = RequestQueue(rconn, f"t-{uuid.uuid4().hex[:10]}")
    queue.update_settings(delete_delivered=delete_delivered)
    k = queue.keys
    if mark is not None:
        rconn.set(k.reader("c1"), mark, px=READER_LIVE_MS)
    claimed = enqueued(queue, n, client)
    assert committed(queue, claimed) == [True] * n
    alone = client == "c1" and mark == "1" and delete_delivered
    assert rconn.exists(*(k.result(r.id) for r in claimed)) == (0 if alone else n)
    raw = rconn.lrange(k.reply("c1"), 0, -1)
    entries = results_in(raw)
    if client:
        assert len(raw) == (1 if alone else n)  # pushed alone: one entry, a line each
        assert [Result.from_json(e).id for e in entries] == [r.id for r in claimed]
        assert all(e.startswith(" ") != alone for e in entries)  # KEPT: under its key too
        assert rconn.llen(k.bell("c1")) == (1 if mark is not None else 0)  # rung while marked
    else:
        assert entries == []
    assert rconn.exists(k.requests, k.sched) == 0  # forgotten either way


@settings(max_examples=examples(25), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(marks=st.lists(st.sampled_from([None, "0", "1"]), min_size=1, max_size=3),
       unclaimed=st.booleans(), n=st.integers(1, 3))
def test_a_commit_of_several_clients_sends_no_result_key_unless_one_needs_its_keys(
        rconn: redis.Redis, marks: list[str | None], unclaimed: bool, n: int) -> None:
    """A commit goes keyless first (no result key declared, a key fewer a request): all
    or nothing, refused whole, writing nothing, when any of its clients' results must be
    stored under their keys (its reader not reading alone, or no client); then sent keyed,
    and those clients remembered, so that their next commits go keyed at once, until
    KEYED_FOR_S has passed: then keyless is tried again (a reader reads alone once its
    first read went through)."""
    queue = RequestQueue(rconn, f"t-{uuid.uuid4().hex[:10]}")
    k = queue.keys
    clients = [f"c{j}" for j in range(len(marks))] + ([""] if unclaimed else [])
    for client, mark in zip(clients, marks):
        if mark is not None:
            rconn.set(k.reader(client), mark, px=READER_LIVE_MS)
    for client in clients:
        assert all(queue.enqueue([Request.validated(id=f"{client or 'none'}-{i}", input=i)
                                  for i in range(n)], client))
    claimed = queue.claim("w#1", 100, 10 ** 6, 0, 100).batch
    assert len(claimed) == n * len(clients)
    keyed = {c for c, mark in zip(clients, marks + [None]) if mark != "1" and c}

    calls: list[bool] = []  # each complete call: keyed or not
    run = queue._run
    queue._run = lambda script, call: (  # type: ignore[method-assign]
        calls.append(call.args[5] == 1) if script == "complete" else None) or run(script, call)
    assert committed(queue, claimed) == [True] * len(claimed)
    # keyless first, while every request has a client; refused, then keyed
    assert calls == ([True] if unclaimed else [False, True] if keyed else [False])
    assert set(queue.keyed_clients) == (set() if unclaimed else keyed)
    for r in claimed:
        alone = r.client and r.client not in keyed
        assert rconn.exists(k.result(r.id)) == (0 if alone else 1)
    assert queue.stats()["totals"]["requests"] == len(claimed)  # counted once
    for client in clients[:len(marks)]:
        raw = rconn.lrange(k.reply(client), 0, -1)
        entries = results_in(raw)
        assert len(entries) == n and all(e.startswith(" ") == (client in keyed) for e in entries)
        # a keyless commit pushes a client's results as one entry, a line each; keyed, one each
        assert len(raw) == (1 if calls == [False] else n)
    if keyed and not unclaimed:  # learned: the next commit of a keyed client goes keyed
        again = enqueued(queue, 1, sorted(keyed)[0])
        calls.clear()
        assert committed(queue, again) == [True]
        assert calls == [True] and rconn.exists(k.result(again[0].id)) == 1
        for client in keyed:  # a while later, its reader reads alone: keyless again
            rconn.set(k.reader(client), "1", px=READER_LIVE_MS)
            queue.keyed_clients[client] = time.monotonic()  # (its KEYED_FOR_S over)
        later = enqueued(queue, 1, sorted(keyed)[0])
        calls.clear()
        assert committed(queue, later) == [True]
        assert calls == [False] and rconn.exists(k.result(later[0].id)) == 0


SPACINGS = {  # one result JSON as a caller may send it: the same JSON, spaced otherwise
    "compact": lambda r: r.to_json(),
    "newlines": lambda r: r.to_json().replace('","', '",\n "'),
    "indented": lambda r: json.dumps(r.to_dict(), indent=2),
    "led": lambda r: "\n  " + r.to_json() + " \n",
}


@settings(max_examples=examples(25), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(runs=st.lists(st.tuples(st.sampled_from(["c0", "c1", "c2"]), st.integers(1, 4)),
                     min_size=1, max_size=4),
       marks=st.one_of(st.just(["1", "1", "1"]),  # (keyless: half the cases)
                       st.lists(st.sampled_from([None, "0", "1"]), min_size=3, max_size=3)),
       lost=st.sets(st.integers(0, 15)), outputs=st.lists(st.text(), min_size=16, max_size=16),
       spacing=st.sampled_from(sorted(SPACINGS)))
def test_what_a_commit_pushes_reaches_each_reader_once_in_order(
        rconn: redis.Redis, runs: list[tuple[str, int]], marks: list[str | None], lost: set[int],
        outputs: list[str], spacing: str) -> None:
    """A keyless commit (every reader reads alone) pushes each run (a lease and a client)
    held whole as one entry, a result a line, and a run held in part (some of its
    requests cancelled since the claim) as the results still held; a keyed one, a result
    an entry. Whatever the runs, the readers, the outputs (newlines and all) and the JSON's
    spacing, each reader reads exactly its committed results, in the order committed,
    nothing of a request whose lease was lost, and a result stored under its key exactly
    when its reader does not read alone."""
    queue = RequestQueue(rconn, f"t-{uuid.uuid4().hex[:10]}")
    for client, mark in zip(("c0", "c1", "c2"), marks):
        if mark is not None:
            rconn.set(queue.keys.reader(client), mark, px=READER_LIVE_MS)
    claimed = [r for client, n in runs for r in enqueued(queue, n, client)]
    gone = [r.id for i, r in enumerate(claimed) if i in lost]
    queue.cancel(gone)
    results = [Result(r.id, "ok", outputs[i % 16]) for i, r in enumerate(claimed)]
    flags = queue.complete([(r.id, r.lease_token, SPACINGS[spacing](x))
                            for r, x in zip(claimed, results)],
                           {"requests": len(claimed)}, [r.client for r in claimed])
    assert flags == [r.id not in gone for r in claimed]
    for client in ("c0", "c1", "c2"):
        got = Result.from_json_many(results_in(rconn.lrange(queue.keys.reply(client), 0, -1)))
        mine = [r.id for r in claimed if r.client == client]
        # the cancel pushed its own results first; then the commit, in order
        assert [x.id for x in got if x.status == "cancelled"] == [i for i in mine if i in gone]
        assert [x for x in got if x.status != "cancelled"] == [
            x for r, x in zip(claimed, results) if r.client == client and r.id not in gone]
    alone = {c for c, mark in zip(("c0", "c1", "c2"), marks) if mark == "1"}
    for r, x in zip(claimed, results):
        if r.id not in gone:
            stored = rconn.get(queue.keys.result(r.id))
            assert (stored is None) == (r.client in alone)
            assert stored is None or Result.from_json(stored) == x


@pytest.mark.parametrize("keyed", [True, False])
def test_a_replayed_commit_gets_its_first_reply_and_adds_nothing(
        rconn: redis.Redis, queue_name: str, keyed: bool) -> None:
    queue = RequestQueue(rconn, queue_name)
    rconn.set(queue.keys.reader("c1"), "1", px=READER_LIVE_MS)
    claimed = enqueued(queue, 3, "c1")
    call = complete_call(queue.keys, [(r.id, r.lease_token, Result(r.id, "ok", 1).to_json())
                                      for r in claimed], {"requests": 3}, ["c1"] * 3, keyed)
    assert queue.scripts.complete(call.keys, call.args) == "111"
    # the connection retries after the reply was lost: no key to find the results by
    assert queue.scripts.complete(call.keys, call.args) == "111"
    assert queue.stats()["totals"]["requests"] == 3
    assert len(results_in(rconn.lrange(queue.keys.reply("c1"), 0, -1))) == 3


def test_the_reaper_keeps_under_their_keys_what_a_stopped_reader_left(
        rconn: redis.Redis, queue_name: str) -> None:
    queue = RequestQueue(rconn, queue_name)
    k = queue.keys
    assert read(queue, "c1", 0) == []  # marks the reader
    first = enqueued(queue, 3, "c1")
    committed(queue, first)
    # a read whose results never reached their waiters (the process died): they stay in
    # its inbox, since only the next read deletes it
    assert [r.id for r in read(queue, "c1", 1)] == [r.id for r in first]
    second = enqueued(queue, 2, "c1")
    committed(queue, second)  # on the list, not read
    assert rconn.exists(*(k.result(r.id) for r in first + second)) == 0
    assert queue.drain_readers() == 0  # the reader's mark is live: nothing is touched
    # nor by the script, the reader back between the reaper's look and its call
    assert queue.scripts.drain(*drain_args(queue, [r.id for r in first + second])) == 0
    assert [len(results_in(rconn.lrange(key, 0, -1))) for key in (k.reply("c1"), k.inbox("c1", 1))
            ] == [2, 3]

    rconn.delete(k.reader("c1"))  # its mark lapses
    third = enqueued(queue, 2, "c1")
    committed(queue, third)  # pushed KEPT: under its key too
    assert queue.drain_readers() == 5
    for r in first + second + third:
        assert queue.result(r.id).output == r.input
        assert DEFAULTS.result_ttl - 5 <= rconn.ttl(k.result(r.id)) <= DEFAULTS.result_ttl
    assert rconn.exists(k.reply("c1"), k.inbox("c1", 0), k.inbox("c1", 1), k.bell("c1")) == 0
    assert not rconn.sismember(k.readers, "c1")


def test_only_results_kept_under_their_keys_are_deleted_once_delivered(rconn: redis.Redis) -> None:
    k = Keys(f"t-{uuid.uuid4().hex[:10]}")
    entries = [Result("alone", "ok").to_json(), " " + Result("kept", "ok").to_json(),
               " " + Result("dead", "dead").to_json()]
    rconn.rpush(k.reply("c1"), *entries)
    popped = parse_reply_read(_read(rconn, k), 0, 1)
    assert [r.id for r in popped.results] == ["alone", "kept", "dead"]
    assert popped.kept == {"kept", "dead"}
    # of those delivered: the kept one is deleted, not the one pushed alone (it has no
    # key), nor a dead letter (it stays for `queue dead list`)
    assert to_delete(popped.results, lambda: True, popped.kept) == ["kept"]
    assert to_delete(popped.results, lambda: False, popped.kept) == []
    assert unreached(popped, popped.results[2:]) == popped.results[:1]


def test_a_reader_keeps_what_reached_nobody_before_letting_go_and_reads_alone_once_it_read(
        ) -> None:
    state = ReadState(alone=True)
    first = state.next_read(0.0)
    assert (first.parity, first.alone, first.mark) == (0, False, True)  # not until a read
    nobody, waited, kept = Result("a", "ok"), Result("b", "ok"), Result("c", "ok")
    popped = Popped([nobody, waited, kept], frozenset({"c"}))
    state.done(first, popped, [waited, kept], lambda: True)
    assert (state.keep, state.forget, state.parity) == ([nobody], ["c"], 1)
    state.failed(redis.ConnectionError("lost"))  # storing them failed: kept for next time
    assert (state.keep, state.parity) == ([nobody], 1)
    retry = state.next_read(0.5)
    assert (retry.parity, retry.alone, retry.mark) == (1, False, True)
    state.keep = []
    state.done(retry, Popped([waited], frozenset()), [waited], lambda: True)
    alone = state.next_read(0.7)  # a read went through: marked reading alone at once
    assert (alone.parity, alone.alone, alone.mark) == (0, True, True)
    state.done(alone, Popped([], frozenset()), [], lambda: True)
    assert not state.next_read(1.2).mark  # renewed once a second, not at each read
    state.done(state.next_read(1.3), Popped([waited], frozenset()), [waited], lambda: True)
    # a stall past the mark's life: the reaper may have kept the last read's results
    stalled = state.next_read(9.0)
    assert "b" in stalled.forget
    state.failed(UnreadableRead("WRONGTYPE"))  # read, and nothing readable: let go of it
    assert state.parity == 1 - stalled.parity


def _read(conn: redis.Redis, k: Keys) -> list:
    pipe = conn.pipeline(transaction=False)
    reply_read(pipe, [k], "c1", 0, True, 0.01)
    return pipe.execute(raise_on_error=False)


def drain_args(queue: RequestQueue, ids: list[str]) -> tuple[list[str], list]:
    call = drain_call(queue.keys, "c1", ids)
    return call.keys, call.args


def test_a_result_that_reaches_nobody_is_kept_under_its_key(
        redis_url: str, queue_name: str, tmp_path: Path) -> None:
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:echo",
                          "--max-wait-ms", "0", log=tmp_path / "worker.log")
    try:
        with Client(redis_url, queue_name) as client:
            kept = client.enqueue("dropped").id  # its handle is dropped at once
            gc.collect()
            assert client.enqueue("waited").result(timeout=30).output["echo"] == "waited"
            found = wait_for(lambda: client.queue.result(kept), 30, message="the kept result")
            assert found.output["echo"] == "dropped"
            assert client.queue.result(kept) is not None  # stays: nobody delivered it
    finally:
        stop_process(worker)


def test_a_result_on_its_way_is_not_taken_for_a_lost_request(
        redis_url: str, queue_name: str) -> None:
    with Client(redis_url, queue_name) as client:
        client.enqueue("x")
        client.replies.close()  # its reader stops: nothing moves what is pushed now
        assert client.replies.confirm_gone(["gone"]) == ["gone"]
        k = client.queue.first.keys
        client.queue.client.rpush(k.reply(client.client_id), Result("y", "ok").to_json())
        assert client.replies.confirm_gone(["y", "gone"]) == []  # either may be there
        client.queue.client.rename(k.reply(client.client_id), k.inbox(client.client_id, 1))
        assert client.replies.confirm_gone(["y"]) == []  # read, not yet delivered
        client.queue.client.delete(k.inbox(client.client_id, 1))
        assert client.replies.confirm_gone(["y"]) == ["y"]
        # another client's reader stopped, what it left not yet kept by the reaper: a
        # request of its (a handle made by id) may have its result there
        client.queue.client.sadd(k.readers, "stopped")
        assert client.replies.confirm_gone(["y"], others=True) == []
        assert client.replies.confirm_gone(["y"]) == ["y"]  # its own: on its lists, or gone
        client.queue.client.set(k.reader("stopped"), "1")  # it reads: what it has is its own
        assert client.replies.confirm_gone(["y"], others=True) == ["y"]
    with Client(redis_url, queue_name) as fresh:  # it never enqueued: a handle made by id
        fresh.queue.client.delete(k.reader("stopped"))
        assert fresh.replies.confirm_gone(["y"], others=True) == []


CHILD = """
import sys, time
from batchery import Client
client = Client(sys.argv[1], sys.argv[2])
handles = client.enqueue_many([{"input": i} for i in range(40)])
print(client.client_id, " ".join(h.id for h in handles), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_client_killed_while_its_requests_run_has_every_result_kept_by_id(
        redis_url: str, queue_name: str, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.touch()
    with Client(redis_url, queue_name) as reader:
        reader.queue.update_settings(lease_seconds=3)  # the reaper's turn each second
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:gated",
                          "--max-wait-ms", "0", log=tmp_path / "worker.log",
                          BATCHERY_TEST_GATE=str(gate))
    child = subprocess.Popen([sys.executable, "-c", CHILD, redis_url, queue_name],
                             stdout=subprocess.PIPE, text=True)
    try:
        dead, *ids = (child.stdout.readline() if child.stdout else "").split()
        assert len(ids) == 40
        k = Keys(queue_name)
        with redis.Redis.from_url(redis_url, decode_responses=True) as conn:
            wait_for(lambda: conn.get(k.reader(dead)) == "1", 30, message="its reader marked")
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        gate.unlink()  # the batches run while the dead client's mark still lasts
        with Client(redis_url, queue_name) as other:
            wait_for(lambda: all(isinstance(f, Result) for f in other.queue.lookup(ids)), 60,
                     message="every result under its key")
            assert [r.output for r in other.queue.lookup(ids)] == [f"ok:{i}" for i in range(40)]
            assert dead not in other.queue.client.smembers(k.readers)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(30)
        if child.stdout:
            child.stdout.close()
        stop_process(worker)
