"""A client's read of its reply lists (batching/calls.py reply_read): one round trip that
deletes the results the last read delivered, waits for a result on any list, and takes
what else is there, each list's in the order it was pushed, nothing lost or twice."""

from __future__ import annotations

import uuid

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchery import Result
from batchery.batching.calls import parse_reply_read, reply_read
from tests.conftest import examples

LISTS = 3


@settings(max_examples=examples(60), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, LISTS - 1), max_size=40), st.integers(1, 40), st.integers(0, 6))
def test_a_read_takes_each_list_in_order_and_deletes_what_it_was_given(
        rconn: redis.Redis, pushes: list[int], most: int, delivered: int) -> None:
    tag = uuid.uuid4().hex[:10]
    lists = [f"replies:{tag}:{i}" for i in range(LISTS)]
    pushed: list[list[str]] = [[] for _ in lists]
    for n, i in enumerate(pushes):
        pushed[i].append(f"r{n}")
        rconn.rpush(lists[i], Result(f"r{n}", "ok", n).to_json())
    forget = [f"result:{tag}:{k}" for k in range(delivered)]
    for key in forget:
        rconn.set(key, "delivered")

    pipe = rconn.pipeline(transaction=False)
    deletes = reply_read(pipe, lists, 0.01, most, forget)
    got = [r.id for r in parse_reply_read(pipe.execute(), deletes)]

    assert rconn.exists(*forget) == 0 if forget else True
    left = [[Result.from_json(raw).id for raw in rconn.lrange(key, 0, -1)] for key in lists]
    # the blocking pop takes the head of the first list holding one, then each list gives
    # up to its share of `most`, in push order
    taken = [p[:len(p) - len(lst)] for p, lst in zip(pushed, left)]
    assert sorted(got) == sorted(i for t in taken for i in t)  # nothing twice, nothing lost
    assert all(left[i] == pushed[i][len(taken[i]):] for i in range(LISTS))
    share = max(1, (most - 1) // LISTS)
    first = next((i for i, p in enumerate(pushed) if p), None)
    for i, t in enumerate(taken):
        assert len(t) == min(len(pushed[i]), share + (i == first))
        assert [g for g in got if g in t] == t  # each list's in the order pushed
    for key in lists:
        rconn.delete(key)


def test_a_failed_pop_keeps_what_the_others_took_and_a_failed_delete_loses_nothing(
        rconn: redis.Redis, redis_url: str) -> None:
    tag = uuid.uuid4().hex[:10]
    broken, good = f"replies:{tag}:broken", f"replies:{tag}:good"
    rconn.set(broken, "not a list")  # every pop of it fails (WRONGTYPE)
    rconn.rpush(good, *(Result(f"g{i}", "ok", i).to_json() for i in range(3)))

    def read(conn: redis.Redis, forget: tuple[str, ...] = ()) -> list[str]:
        pipe = conn.pipeline(transaction=False)
        deletes = reply_read(pipe, [broken, good], 0.01, 100, forget)
        return [r.id for r in parse_reply_read(pipe.execute(raise_on_error=False), deletes)]

    assert read(rconn) == ["g0", "g1", "g2"]  # the good list's, though the BLPOP failed
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        read(rconn)  # nothing taken: the failure is the caller's to back off from

    # a reader whose DEL is refused (an ACL without it) still gets its results
    user = f"nodel-{tag}"
    rconn.acl_setuser(user, enabled=True, passwords=["+pw"], commands=["+@all", "-del"],
                      keys=["*"], channels=["*"])
    try:
        limited = redis.Redis.from_url(redis_url.replace("redis://", f"redis://{user}:pw@"),
                                       decode_responses=True)
        rconn.rpush(good, Result("g3", "ok", 3).to_json())
        rconn.set(f"result:{tag}", "delivered")
        assert read(limited, (f"result:{tag}",)) == ["g3"]
        assert rconn.exists(f"result:{tag}") == 1  # kept: it expires after its result_ttl
        limited.close()
    finally:
        rconn.acl_deluser(user)
        rconn.delete(broken, good)
