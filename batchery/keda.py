"""KEDA autoscaling that counts every shard: the objects ``batchery queue keda`` prints.

KEDA's redis scaler reads one key per trigger (TYPE, then ZCARD for a sorted set, since
KEDA 2.0). A queue keeps its queued requests in two sorted sets per shard (pending, and
delayed for retries waiting out their backoff: ``keys.queued_keys``), so there is one named
trigger per key and ``advanced.scalingModifiers`` adds them into the one metric the HPA
scales on: replicas = ceil(sum / threshold). Without the formula KEDA takes the largest
trigger's wish, which reads a 1/N share of an N-shard queue (why shard 0's keys alone
scaled a 3-shard queue on a third of its backlog).

Why these triggers and not the alternatives: they read Redis itself, so the count is right
with no worker running and minReplicaCount 0 works (a Prometheus query over the workers'
gauge has nobody to export it at zero); the shards' keys sit in different hash slots, so no
script could keep one total key without a cross-slot write on a Cluster; and the
``redis-cluster`` trigger type routes each ZCARD to the master that holds its key. The
shard tags depend on the queue name and shard count (``keys.shard_tags``), hence a command
that prints them rather than keys written by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchery.batching.keys import queued_keys

API = "keda.sh/v1alpha1"
SECRET = "batchery-redis-keda"  # the Secret the TriggerAuthentication reads (created by hand)


@dataclass(frozen=True)
class Autoscale:
    """What the ScaledObject scales and how far."""

    queue: str
    shards: int = 1
    cluster: bool = False  # the redis-cluster trigger type, Secret key `addresses`
    # queued requests per worker: replicas = ceil(queued / threshold). A worker's
    # throughput x the wait you accept; 100 is a few batches of the default size
    threshold: int = 100
    deployment: str = "batchery-worker"
    namespace: str = "batchery"
    min_replicas: int = 0  # the triggers read Redis: one queued request wakes the first pod
    max_replicas: int = 20
    tls: bool = False  # rediss://

    @property
    def trigger_type(self) -> str:
        return "redis-cluster" if self.cluster else "redis"

    @property
    def address_key(self) -> str:
        """The Secret key (and KEDA parameter) naming the server(s)."""
        return "addresses" if self.cluster else "address"


def trigger_names(shards: int) -> list[str]:
    """One name per key of ``queued_keys``, in its order (pending0, delayed0, pending1...)."""
    return [f"{kind}{i}" for i in range(shards) for kind in ("pending", "delayed")]


def objects(spec: Autoscale) -> list[dict[str, Any]]:
    """The TriggerAuthentication and the ScaledObject, as Kubernetes objects."""
    auth = {"apiVersion": API, "kind": "TriggerAuthentication",
            "metadata": {"name": "batchery-redis", "namespace": spec.namespace},
            "spec": {"secretTargetRef": [
                {"parameter": p, "name": SECRET, "key": p} for p in (spec.address_key, "password")]}}
    names = trigger_names(spec.shards)
    triggers = [{"type": spec.trigger_type, "name": name,
                 "metadata": {"listName": key, "listLength": str(spec.threshold),
                              "activationListLength": "0", "enableTLS": str(spec.tls).lower(),
                              **({} if spec.cluster else {"databaseIndex": "0"})},
                 "authenticationRef": {"name": "batchery-redis"}}
                for name, key in zip(names, queued_keys(spec.queue, spec.shards))]
    scaled = {"apiVersion": API, "kind": "ScaledObject",
              "metadata": {"name": spec.deployment, "namespace": spec.namespace},
              "spec": {"scaleTargetRef": {"name": spec.deployment},
                       "minReplicaCount": spec.min_replicas, "maxReplicaCount": spec.max_replicas,
                       "pollingInterval": 15,
                       # after the queue empties, this long before the last worker goes
                       "cooldownPeriod": 300,
                       "advanced": {
                           "scalingModifiers": {"formula": " + ".join(names),
                                                "target": str(spec.threshold),
                                                "activationTarget": "0",
                                                "metricType": "AverageValue"},
                           "horizontalPodAutoscalerConfig": {"behavior": {"scaleDown": {
                               # a new worker costs a model load: no giving back on a lull
                               "stabilizationWindowSeconds": 300,
                               "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}]}}}},
                       "triggers": triggers}}
    return [auth, scaled]
