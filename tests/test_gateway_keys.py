"""API keys of `batchery serve`: bearer keys from a file and the environment, each a
tenant with the queues it may use; 401 and 403 in OpenAI's error shape."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import openai
import pytest

from batchery import Client
from batchery.errors import ConfigError
from batchery.gateway.auth import Keys
from tests.conftest import RedisServer
from tests.gateway_helpers import serve

ALICE, BOB = "sk-alice-0123456789abcdef", "sk-bob-0123456789abcdef"


def test_keys_come_from_a_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# team keys\n{ALICE} alice embed,chat\n\n")
    keys = Keys.load(str(path), f"{BOB} bob *;")
    alice = keys.authorize(f"Bearer {ALICE}", "gateway.example")
    assert alice.tenant == "alice" and alice.may_use("chat") and not alice.may_use("other")
    assert keys.authorize(f"bearer {BOB}", None).queues is None
    with pytest.raises(ConfigError, match="at least 16 characters"):
        Keys.load(None, "short alice")
    with pytest.raises(ConfigError, match="line 2"):
        Keys.load(None, f"{ALICE} alice\n{BOB} bob a b c")
    with pytest.raises(ConfigError, match="cannot read the keys file"):
        Keys.load(str(tmp_path / "missing"), None)


def test_no_keys_answers_loopback_host_names_only() -> None:
    keys = Keys({})
    assert keys.authorize(None, "127.0.0.1:8000").tenant is None
    with pytest.raises(Exception, match="loopback host names only"):
        keys.authorize(None, "evil.example:8000")


def test_401_and_403_in_openai_s_shape(redis_server: RedisServer, tmp_path: Path) -> None:
    mine, theirs = (f"k-{uuid.uuid4().hex[:8]}" for _ in range(2))
    for name in (mine, theirs):
        with Client(redis_server.url, name) as c:
            c.queue.register()
    keys = tmp_path / "keys"
    keys.write_text(f"{ALICE} alice {mine}\n")
    with serve(redis_server.url, tmp_path, "--host", "127.0.0.1", "--keys-file", str(keys),
               BATCHERY_API_KEYS=f"{BOB} bob *") as served:
        status, body = served.get("/v1/models")  # no Authorization header at all
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError) as wrong:
            served.client(api_key="sk-wrong-0123456789abcdef").models.list()
        assert wrong.value.body["message"] == "incorrect API key provided"
        alice = served.client(api_key=ALICE)
        assert [m.id for m in alice.models.list()] == [mine]
        with pytest.raises(openai.PermissionDeniedError) as denied:
            alice.embeddings.create(model=theirs, input="x")
        assert denied.value.body["param"] == "model"
        assert denied.value.body["code"] == "model_not_allowed"
        assert {mine, theirs} <= {m.id for m in served.client(api_key=BOB).models.list()}
        assert served.get("/health")[0] == 200  # probes need no key
        assert "2 API key(s)" in served.log.read_text()


def test_an_api_keys_tenant_is_the_requests_tenant(redis_server: RedisServer,
                                                   tmp_path: Path) -> None:
    """What a key's caller enqueues is served as the key's tenant: its fair share."""
    from tests.conftest import start_worker, stop_process, wait_for
    queue = f"k-{uuid.uuid4().hex[:8]}"
    keys = tmp_path / "keys"
    keys.write_text(f"{ALICE} alice {queue}\n")
    worker = start_worker(redis_server.url, queue, "--runner", "bench.runners:vector384")
    try:
        with Client(redis_server.url, queue) as c:
            wait_for(lambda: c.queue.stats()["workers"] == 1, 60, message="the worker")
            with serve(redis_server.url, tmp_path, "--host", "127.0.0.1", "--keys-file",
                       str(keys)) as served:
                out = served.client(api_key=ALICE).embeddings.create(model=queue, input="hello")
                assert len(out.data[0].embedding) == 384
            tenants = c.queue.stats()["tenants"]
    finally:
        stop_process(worker)
    assert set(tenants) == {"alice"} and tenants["alice"]["served_tokens"] > 0
