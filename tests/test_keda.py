"""KEDA autoscaling counts every shard: the committed ScaledObjects are what `batchery queue
keda` prints, and what their triggers read (as KEDA reads them, on a live sharded queue
with no worker running) is the queue's whole queued count. The Cluster case, and the
Prometheus alternative over live workers, are in tests/test_deploy_live.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from batchery.batching.keys import Keys
from batchery.batching.request import Request
from batchery.cli import cli
from tests.test_deploy import DEPLOY, ROOT, SCALEDOBJECT, check, scaled_queue, yaml_docs

__all__ = ["check"]  # the fixture, used by name below
SCALEDOBJECT_CLUSTER = DEPLOY / "keda" / "scaledobject-cluster.yaml"


# Each committed KEDA file and the `batchery queue keda` arguments that print it.
KEDA_FILES = {SCALEDOBJECT: ["--shards", "1"],
              SCALEDOBJECT_CLUSTER: ["--shards", "3", "--cluster"]}


def keda_printed(queue: str, *args: str) -> list[dict[str, Any]]:
    """What `batchery queue keda QUEUE ARGS` prints, parsed (a YAML stream of JSON objects)."""
    from click.testing import CliRunner
    done = CliRunner().invoke(cli, ["queue", "keda", queue, *args], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    return [d for d in yaml.safe_load_all(done.output) if d is not None]


def keda_reading(triggers: list[dict[str, Any]], formula: str, client: Any) -> int:
    """What KEDA computes from a live Redis: per trigger TYPE, then ZCARD for a sorted set
    (its redis scaler since 2.0), then the scalingModifiers formula over the trigger names.
    Only a sum of names is understood: a new shape fails here."""
    read = {}
    for t in triggers:
        key = t["metadata"]["listName"]
        assert client.type(key) in ("zset", "none"), f"{key}: KEDA would not ZCARD a {client.type(key)}"
        read[t["name"]] = client.zcard(key)
    names = [n.strip() for n in formula.split("+")]
    assert sorted(names) == sorted(read), f"the formula {formula!r} must add every trigger once"
    return sum(read[n] for n in names)


@pytest.mark.parametrize("path", KEDA_FILES, ids=lambda p: p.name)
def test_keda_files_are_what_batchery_queue_keda_prints(path: Path, check: Any) -> None:
    auth, so = yaml_docs(path)
    assert (auth["kind"], so["kind"]) == ("TriggerAuthentication", "ScaledObject")
    queue = scaled_queue(so, check)
    assert [auth, so] == keda_printed(queue, *KEDA_FILES[path]), \
        f"{path.relative_to(ROOT)} drifted: print it again with `batchery queue keda {queue} " \
        f"{' '.join(KEDA_FILES[path])}`"
    assert so["spec"]["minReplicaCount"] == 0  # the triggers read Redis: no worker needed
    assert all(t["authenticationRef"]["name"] == auth["metadata"]["name"]
               for t in so["spec"]["triggers"])
    howto = path.read_text()
    for ref in auth["spec"]["secretTargetRef"]:
        assert f"create secret generic {ref['name']}" in howto
        assert f"--from-literal={ref['key']}=" in howto


def test_keda_counts_every_shard_of_a_live_queue_from_zero(rconn: Any, redis_url: str,
                                                           queue_name: str) -> None:
    """A 3-shard queue with requests pending on every shard and retries waiting out their
    backoff, no worker registered: the printed triggers and formula read the queue's whole
    queued count, where shard 0's keys alone read about a third."""
    from batchery.batching.sharded import open_queue
    queue = open_queue(rconn, queue_name)
    queue.update_settings(shards=3)
    ids = [f"r{i}" for i in range(60)]
    queue.enqueue([Request.validated(id=i, input="x") for i in ids])
    claimed = queue.claim("gone#1", 5, 10_000, 0, 16).batch  # then failed: into `delayed`
    assert queue.fail([(c.id, c.lease_token, "{}") for c in claimed]) == [1] * len(claimed)
    stats = queue.stats()
    assert (stats["pending"], stats["delayed"], stats["workers"]) == (60, len(claimed), 0)

    _, so = keda_printed(queue_name, "--redis-url", redis_url)  # shard count read from Redis
    triggers, modifiers = so["spec"]["triggers"], so["spec"]["advanced"]["scalingModifiers"]
    assert len(triggers) == 6 and {t["type"] for t in triggers} == {"redis"}
    total = keda_reading(triggers, modifiers["formula"], rconn)
    assert total == stats["pending"] == 60
    assert total > float(modifiers["activationTarget"])  # active: scales up from zero
    assert rconn.zcard(Keys(queue_name).pending) < 40  # what shard 0 alone would have said
    queue.cancel(ids)
    assert keda_reading(triggers, modifiers["formula"], rconn) == 0
