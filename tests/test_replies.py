"""A client's read of its reply lists (batching/reply_lists.py reply_read): one round trip that
deletes what the last read delivered, marks the reader, waits on its bells, and moves
each list to an inbox it reads; nothing leaves Redis before the next read, so a reply
lost on the way loses nothing, and each list's results come in the order pushed, each
once."""

from __future__ import annotations

import uuid

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchery import Result
from batchery.batching.reply_lists import READER_LIVE_MS, parse_reply_read, reply_read
from batchery.batching.keys import Keys
from tests.conftest import examples

SHARDS = 3
CLIENT = "c1"


def shard_keys() -> list[Keys]:
    tag = uuid.uuid4().hex[:10]
    return [Keys(f"{tag}-{i}") for i in range(SHARDS)]


def read(conn: redis.Redis, shards: list[Keys], parity: int, forget: tuple[str, ...] = (),
         lose_reply: bool = False) -> list[Result] | None:
    """One read; ``lose_reply``: Redis runs it, and its reply is thrown away (None)."""
    pipe = conn.pipeline(transaction=False)
    deletes = reply_read(pipe, shards, CLIENT, parity, True, 0.01, forget)
    replies = pipe.execute(raise_on_error=False)
    return None if lose_reply else parse_reply_read(replies, deletes, len(shards)).results


# pushes: the shard each next result goes to; then, per read, whether its reply is lost
@settings(max_examples=examples(60), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.lists(st.integers(0, SHARDS - 1), max_size=12), st.booleans()),
                min_size=1, max_size=8))
def test_reads_give_each_result_once_in_order_and_a_lost_reply_loses_nothing(
        rconn: redis.Redis, rounds: list[tuple[list[int], bool]]) -> None:
    shards = shard_keys()
    pushed: list[list[str]] = [[] for _ in shards]
    got: list[str] = []
    parity, n = 0, 0
    for pushes, lost in rounds:
        for shard in pushes:
            rid = f"r{n}"
            n += 1
            pushed[shard].append(rid)
            rconn.rpush(shards[shard].reply(CLIENT), Result(rid, "ok", n).to_json())
        results = read(rconn, shards, parity, lose_reply=lost)
        if results is None:
            continue  # the same read again (its parity): what it moved is still there
        got += [r.id for r in results]
        parity = 1 - parity
    for _ in range(3):  # the reads after: what a retried read left comes, then nothing
        results = read(rconn, shards, parity) or []
        got += [r.id for r in results]
        parity = 1 - parity
        if not results:
            break
    assert sorted(got) == sorted(i for p in pushed for i in p)  # nothing lost, nothing twice
    for ids in pushed:
        assert [g for g in got if g in ids] == ids  # each list's in the order pushed
    # the last read (which read nothing) deleted what the one before moved: all empty
    for k in shards:
        assert rconn.exists(k.reply(CLIENT), k.inbox(CLIENT, 0), k.inbox(CLIENT, 1)) == 0
        assert rconn.sismember(k.readers, CLIENT)
        assert 0 < rconn.pttl(k.reader(CLIENT)) <= READER_LIVE_MS


def test_a_bell_wakes_a_read_and_a_failed_read_keeps_what_the_others_took(
        rconn: redis.Redis, redis_url: str) -> None:
    shards = shard_keys()
    broken, good = shards[0], shards[1]
    rconn.set(broken.reply(CLIENT), "not a list")  # its move succeeds, its read fails
    rconn.rpush(good.reply(CLIENT), *(Result(f"g{i}", "ok", i).to_json() for i in range(3)))
    rconn.rpush(good.bell(CLIENT), 1, 1)  # rung by two pushes
    assert [r.id for r in read(rconn, shards, 0) or []] == ["g0", "g1", "g2"]
    assert rconn.exists(good.bell(CLIENT)) == 0  # both rings gone: the read took both pushes
    # a result kept under its key too is deleted by the read after its delivery
    rconn.set(good.result("g0"), "delivered")
    read(rconn, shards, 1, (good.result("g0"),))
    assert rconn.exists(good.result("g0")) == 0
    rconn.set(broken.reply(CLIENT), "not a list")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        read(rconn, shards, 1)  # nothing taken: the failure is the caller's to back off from
    assert read(rconn, shards, 0) == []  # the next read lets go of what it could not read
    assert rconn.exists(broken.inbox(CLIENT, 1)) == 0

    # a reader whose DEL of delivered results is refused (an ACL without it) still reads
    tag = uuid.uuid4().hex[:10]
    user = f"nodel-{tag}"
    rconn.acl_setuser(user, enabled=True, passwords=["+pw"], commands=["+@all", "-del"],
                      keys=["*"], channels=["*"])
    try:
        limited = redis.Redis.from_url(redis_url.replace("redis://", f"redis://{user}:pw@"),
                                       decode_responses=True)
        rconn.rpush(good.reply(CLIENT), Result("g3", "ok", 3).to_json())
        rconn.set(f"result:{tag}", "delivered")
        with pytest.raises(redis.exceptions.NoPermissionError):
            read(limited, shards, 0, (f"result:{tag}",))  # nor its inboxes: none read
        assert rconn.exists(f"result:{tag}") == 1  # kept: it expires after its result_ttl
        limited.close()
    finally:
        rconn.acl_deluser(user)
