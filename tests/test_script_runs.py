"""One call, many kinds of request: enqueue sends a priority, deadline and tenant once per
run of requests sharing them, complete a lease token and client once per run
(batching/calls.py). Whatever the mix and order, each request keeps its own."""

from __future__ import annotations

import uuid

import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchery import Result
from batchery.batching.queue import RequestQueue
from batchery.batching.request import Request
from tests.conftest import examples

# a priority and the class a claim reports; an integer (a delay in seconds) is reported
# under the slowest class it is as urgent as (normal's delay is 5 s, batch's 60 s)
PRIORITIES = {"realtime": "realtime", "normal": "normal", "batch": "batch",
              0: "realtime", 7: "normal", 120: "batch"}
kinds = st.tuples(st.sampled_from(list(PRIORITIES)), st.sampled_from(["a", "b", "default"]),
                  st.sampled_from([None, 30.0, 3600.5]), st.sampled_from(["c1", "c2", ""]))


@settings(max_examples=examples(40), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(kinds, min_size=1, max_size=40), st.integers(1, 7))
def test_every_request_keeps_its_fields_through_enqueue_claim_and_commit(
        rconn: redis.Redis, mix: list[tuple], batch: int) -> None:
    queue = RequestQueue(rconn, f"runs-{uuid.uuid4().hex[:10]}")
    asked = {}
    for client in ("c1", "c2", ""):  # one enqueue call per client, its fields mixed
        mine = [Request.validated(id=f"r{i}", input=i, priority=p, tenant=t, deadline=d)
                for i, (p, t, d, c) in enumerate(mix) if c == client]
        if mine:
            assert queue.enqueue(mine, client) == [True] * len(mine)
        asked.update({r.id: (r, client) for r in mine})

    claimed, claims = [], 0
    while len(claimed) < len(mix):  # batches of `batch`: several lease tokens in the commit
        claims += 1
        assert claims <= 2 * len(mix), "a claim leased nothing while requests were pending"
        claimed += queue.claim(f"w#{claims}", batch, 10 ** 6, 0, 100).batch
    assert sorted(r.id for r in claimed) == sorted(asked)
    for r in claimed:
        request, client = asked[r.id]
        given = mix[int(r.id[1:])][0]  # the priority as asked (Request keeps it as text)
        assert (r.priority, r.tenant, r.client, r.input) == (
            PRIORITIES[given], request.tenant, client, request.input)
        assert (r.expire_ms > 0) == (request.deadline is not None)

    committed = queue.complete([(r.id, r.lease_token, Result(r.id, "ok", r.input).to_json())
                                for r in claimed], {"requests": len(claimed)},
                               [r.client for r in claimed])
    assert committed == [True] * len(claimed)
    for client in ("c1", "c2"):
        delivered = queue.pop_replies(client, 1000)
        assert sorted(r.id for r in delivered) == sorted(i for i, (_, c) in asked.items() if c == client)
        assert all(r.output == asked[r.id][0].input for r in delivered)
    assert [r.output for r in queue.results([r.id for r in claimed])] == [r.input for r in claimed]
