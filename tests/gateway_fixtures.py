"""The gateway tests' shared processes: one `batchery serve` with its model workers (MiniLM
embeddings, a tiny random GPT-2) and a jobs worker, started once a session for
tests/test_gateway.py and tests/test_gateway_batches.py. A pytest plugin (tests/conftest.py
``pytest_plugins``), so each fixture is defined once: a fixture imported into a second
test module is defined again there, and a session-scoped one would start a second set of
the same processes. No test stops them; the tests that restart or kill a gateway start
their own. (The heavy imports happen inside the fixtures: every test process loads this.)"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest


@pytest.fixture(scope="session")
def queues() -> dict[str, str]:
    tag = uuid.uuid4().hex[:8]
    return {"embed": f"g-embed-{tag}", "generate": f"g-gen-{tag}", "idle": f"g-idle-{tag}",
            "jobs": f"g-jobs-{tag}"}


@pytest.fixture(scope="session")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.gateway_helpers import tiny_gpt2
    return tiny_gpt2(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="session")
def gateway(redis_server: Any, queues: dict[str, str], gpt2: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from batchery import Client
    from tests.conftest import start_worker, stop_process, wait_for
    from tests.gateway_helpers import jobs_worker, serve
    logs = tmp_path_factory.mktemp("gateway-logs")
    url = redis_server.url
    with Client(url, queues["idle"]) as idle:  # registered, with no worker: requests wait there
        idle.queue.register()
    embed = start_worker(url, queues["embed"], "--task", "embed", "--model", "minilm",
                         "--max-wait-ms", "2", log=logs / "embed.log")
    generate = start_worker(url, queues["generate"], "--task", "generate", "--model", str(gpt2),
                            log=logs / "generate.log")
    jobs = jobs_worker(url, queues["jobs"], logs / "jobs.log")
    try:
        with serve(url, logs, "--files-dir", str(logs / "files"), "--jobs-queue",
                   queues["jobs"]) as served:
            listed = lambda: {m.id: m for m in served.client().models.list()}  # noqa: E731
            wait_for(lambda: all(getattr(listed().get(queues[t]), "task", None) == t
                                 for t in ("embed", "generate")), 120, 0.5,
                     message="both workers reporting to the gateway")
            yield served
    finally:
        for proc in (embed, generate, jobs):
            stop_process(proc)


@pytest.fixture
def sdk(gateway: Any) -> Any:
    return gateway.client()
