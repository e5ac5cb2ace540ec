"""`batchery serve` with the unmodified openai SDK: a real server process, real Redis, a
MiniLM embed worker and a tiny random GPT-2 generate worker, each a real process."""

from __future__ import annotations

import base64
import http.client
import json
import multiprocessing
import os
import signal
import struct
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from batchery import Client
from tests.conftest import ROOT, free_port, run_cli, wait_for
from tests.gateway_helpers import serve

pytestmark = pytest.mark.slow


# queues, gpt2, gateway and sdk: tests/gateway_fixtures.py (one set a session)


def test_models_lists_the_queues_with_their_task_and_model(sdk, queues, gateway) -> None:
    models = {m.id: m for m in sdk.models.list()}
    assert models[queues["embed"]].task == "embed"
    assert models[queues["embed"]].root == "minilm"
    assert models[queues["generate"]].task == "generate"
    assert models[queues["idle"]].task is None  # no worker reported yet
    assert sdk.models.retrieve(queues["embed"]).id == queues["embed"]
    assert gateway.get("/health")[0] == 200


def test_embeddings_of_a_string_and_a_list_in_float_and_base64(sdk, queues, redis_server) -> None:
    one = sdk.embeddings.create(model=queues["embed"], input="hello world")
    assert len(one.data) == 1 and len(one.data[0].embedding) == 384
    assert abs(np.linalg.norm(one.data[0].embedding) - 1) < 1e-5
    with Client(redis_server.url, queues["embed"]) as direct:
        expected = direct.enqueue("hello world").result(timeout=60).output
    assert np.allclose(one.data[0].embedding, expected, atol=1e-6)
    many = sdk.embeddings.create(model=queues["embed"], input=["a cat", "hello world", "a dog"])
    assert [d.index for d in many.data] == [0, 1, 2]
    assert np.allclose(many.data[1].embedding, expected, atol=1e-6)
    tokenizer = AutoTokenizer.from_pretrained(str(Path(_minilm())))
    counts = [len(tokenizer(t)["input_ids"]) for t in ("a cat", "hello world", "a dog")]
    assert many.usage.prompt_tokens == many.usage.total_tokens == sum(counts)
    # base64 as OpenAI sends it: little-endian float32 (the SDK's default ask, decoded by it)
    raw = sdk.embeddings.with_raw_response.create(model=queues["embed"], input="hello world",
                                                  encoding_format="base64").http_response.json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert np.allclose(struct.unpack(f"<{len(packed) // 4}f", packed), expected, atol=1e-6)


def _minilm() -> str:
    from batchery.workers.runners.hf import resolve_model
    return resolve_model("minilm")


def test_completions_count_tokens_exactly_and_match_the_python_client(sdk, queues, gpt2,
                                                                      redis_server) -> None:
    prompt = "the quick brown fox"
    done = sdk.completions.create(model=queues["generate"], prompt=prompt, max_tokens=7)
    choice = done.choices[0]
    assert done.object == "text_completion" and choice.finish_reason == "length"
    prompt_tokens = len(AutoTokenizer.from_pretrained(str(gpt2))(prompt)["input_ids"])
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (prompt_tokens, 7)
    with Client(redis_server.url, queues["generate"]) as direct:
        expected = direct.enqueue({"prompt": prompt, "max_new_tokens": 7}).result(timeout=60)
    assert choice.text == expected.output["text"]
    default = sdk.completions.create(model=queues["generate"], prompt=prompt)
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens
    stopped = sdk.completions.create(model=queues["generate"], prompt=prompt, max_tokens=7,
                                     stop=[choice.text[3:6]])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == choice.text[:choice.text.find(choice.text[3:6])]


def test_streamed_completion_and_chat_match_the_whole_answer(sdk, queues) -> None:
    model, messages = queues["generate"], [{"role": "user", "content": "say something"}]
    whole = sdk.chat.completions.create(model=model, messages=messages, max_tokens=12)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    chunks = list(sdk.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    streamed = list(sdk.completions.create(model=model, prompt="once upon", max_tokens=9,
                                           stream=True))
    plain = sdk.completions.create(model=model, prompt="once upon", max_tokens=9)
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_n_choices_with_a_seed_are_reproducible(sdk, queues) -> None:
    ask: dict[str, Any] = dict(model=queues["generate"], messages=[{"role": "user", "content": "hi"}],
                               max_completion_tokens=6, n=3, temperature=1.5, seed=7)
    first, again = sdk.chat.completions.create(**ask), sdk.chat.completions.create(**ask)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1  # each choice its own draw
    assert first.usage.completion_tokens == 18
    assert first.usage.prompt_tokens == sdk.chat.completions.create(
        **{**ask, "n": 1}).usage.prompt_tokens  # the prompt counted once
    streamed = ["", "", ""]
    for c in sdk.chat.completions.create(**ask, stream=True):
        streamed[c.choices[0].index] += c.choices[0].delta.content or ""
    assert streamed == texts


def test_errors_have_openai_s_shape_and_status(sdk, queues) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.embeddings.create(model="no-such-queue", input="x")
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model=queues["generate"], prompt="x", temperature=9)
    assert bad.value.body["param"] == "temperature" and "0.0..2.0" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as wrong_task:
        sdk.embeddings.create(model=queues["generate"], input="x")
    assert "generate queue" in wrong_task.value.body["message"]
    with pytest.raises(openai.BadRequestError) as tools:
        sdk.chat.completions.create(model=queues["generate"], messages=[{"role": "user", "content": "x"}],
                                    tools=[{"type": "function", "function": {"name": "f"}}])
    assert tools.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as too_long:  # the worker's refusal, as a 400
        sdk.completions.create(model=queues["generate"], prompt="x", max_tokens=5000)
    assert "max_tokens" in too_long.value.body["message"]


def test_a_full_queue_answers_429_with_retry_after(sdk, queues, redis_server) -> None:
    full = queues["idle"] + "-full"
    assert run_cli("queue", "config", full, "--max-pending", "1",
                   redis_url=redis_server.url).returncode == 0
    with Client(redis_server.url, full) as direct:
        waiting = direct.enqueue("fills the queue")
        try:
            with pytest.raises(openai.RateLimitError) as refused:
                sdk.embeddings.create(model=full, input="x")
            assert refused.value.response.headers["retry-after"] == "1"
            assert refused.value.body["code"] == "queue_full"
        finally:
            waiting.cancel()


def test_a_deadline_passed_answers_504(sdk, queues) -> None:
    with pytest.raises(openai.InternalServerError) as late:
        sdk.embeddings.create(model=queues["idle"], input="x",
                              extra_headers={"X-Batchery-Deadline": "0.5"})
    assert late.value.status_code == 504 and late.value.body["code"] == "deadline_exceeded"


def test_tiers_and_the_header_set_the_class_and_a_disconnect_cancels(gateway, queues,
                                                                     redis_server) -> None:
    logged_before = len(gateway.log.read_text())  # the gateway is the session's (other tests')
    with Client(redis_server.url, queues["idle"]) as direct:
        for ask, expected in (({"service_tier": "flex"}, "batch"),
                              ({"service_tier": "priority"}, "realtime"),
                              ({"extra_headers": {"X-Batchery-Priority": "realtime"},
                                "service_tier": "flex"}, "realtime"), ({}, "normal")):
            impatient = gateway.client(timeout=3)
            call = threading.Thread(target=_swallow, args=(lambda: impatient.chat.completions.create(
                model=queues["idle"], messages=[{"role": "user", "content": "waits"}], **ask),))
            call.start()
            wait_for(lambda: direct.queue.stats()["pending_by_priority"] == {expected: 1}, 30,
                     message=f"one {expected} request pending")
            call.join(30)  # the SDK gave up: the gateway cancels its request
            wait_for(lambda: direct.queue.stats()["pending"] == 0, 30,
                     message="the disconnected caller's request cancelled")
    # the waits a disconnect ends are read, not logged as an exception never retrieved
    assert "Traceback" not in gateway.log.read_text()[logged_before:]


def test_a_stream_whose_client_goes_away_is_cancelled(gateway, queues, redis_server) -> None:
    body = json.dumps({"model": queues["idle"], "prompt": "waits", "stream": True})
    with Client(redis_server.url, queues["idle"]) as direct:
        connection = http.client.HTTPConnection(gateway.url.removeprefix("http://"), timeout=30)
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        assert connection.getresponse().status == 200  # the stream began: headers sent
        wait_for(lambda: direct.queue.stats()["pending"] == 1, 30, message="the request queued")
        connection.close()
        wait_for(lambda: direct.queue.stats()["pending"] == 0, 30,
                 message="the streamed request cancelled once its client left")


def _swallow(action: Any) -> None:
    try:
        action()
    except openai.APITimeoutError:
        pass


def test_no_keys_means_loopback_only(redis_server) -> None:
    refused = run_cli("serve", "--host", "0.0.0.0", "--port", "1", redis_url=redis_server.url)
    assert refused.returncode == 2
    assert "without API keys" in refused.stderr and "Traceback" not in refused.stderr


def _served_by(parent: int) -> set[int]:
    """The processes `serve --processes N` started (not multiprocessing's helpers)."""
    listed = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    pids = set()
    for pid in map(int, listed):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.add(pid)
        except OSError:  # gone meanwhile
            pass
    return pids


def test_several_processes_serve_one_port_and_a_dead_one_is_replaced(gateway, queues,
                                                                      redis_server,
                                                                      tmp_path) -> None:
    with Client(redis_server.url, queues["embed"]) as direct:
        expected = direct.enqueue("hello world").result(timeout=60).output
    with serve(redis_server.url, tmp_path, "--processes", "2") as served:
        sdk = served.client()
        wait_for(lambda: len(_served_by(served.proc.pid)) == 2, 30, 0.1,
                 message="two processes serving")
        first = _served_by(served.proc.pid)
        one = sdk.embeddings.create(model=queues["embed"], input="hello world")
        assert np.allclose(one.data[0].embedding, expected, atol=1e-6)
        for n, killed in enumerate(sorted(first), 1):  # one, then the other: all replaced
            os.kill(killed, signal.SIGKILL)
            wait_for(lambda: len(_served_by(served.proc.pid) - first) == n
                     and len(_served_by(served.proc.pid)) == 2, 60, 0.1,
                     message="the dead process replaced")
        for _ in range(8):  # only replacements serve now: new connections, each answered
            with served.client() as fresh:
                again = fresh.embeddings.create(model=queues["embed"], input="hello world")
            assert np.allclose(again.data[0].embedding, expected, atol=1e-6)
        now = _served_by(served.proc.pid)
    for pid in now:  # stopping the command stops its processes
        wait_for(lambda: not Path(f"/proc/{pid}").exists()
                 or b"zombie" in Path(f"/proc/{pid}/status").read_bytes().lower(), 30, 0.1,
                 message=f"serving process {pid} stopped with the command")
    assert "Traceback" not in served.log.read_text()


def _connections_held(pids: set[int], port: int) -> dict[int, int]:
    """Established TCP connections to ``port`` each process holds (from /proc)."""
    on_port = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                on_port.add(fields[9])  # the socket's inode
    held = {}
    for pid in pids:
        links = []
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                links.append(os.readlink(fd))
            except OSError:  # closed meanwhile
                pass
        held[pid] = sum(link[len("socket:["):-1] in on_port for link in links
                        if link.startswith("socket:["))
    return held


def test_several_processes_share_the_connections_of_clients_that_connect_at_once(
        redis_server, tmp_path) -> None:
    """uvicorn's workers shared one socket: 64 connections opened at once landed 30, 21, 11
    and 2 on four processes. Each process's own socket on the port spreads them, from the
    moment the first one serves (connections opened before the others had bound their
    sockets all went to the first)."""
    with serve(redis_server.url, tmp_path, "--processes", "4") as served:
        port = int(served.url.rsplit(":", 1)[1])
        connections = [http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                       for _ in range(64)]
        try:
            for connection in connections:
                connection.connect()
            for connection in connections:  # a request on each: each is accepted and held
                connection.request("GET", "/health")
                assert connection.getresponse().read() is not None
            held = _connections_held(_served_by(served.proc.pid), port)
        finally:
            for connection in connections:
                connection.close()
    assert sum(held.values()) == 64, held
    # a hash over four: each holds 16 on average; under 2 or over 32 is a chance of about 1e-6
    assert all(2 <= n <= 32 for n in held.values()), held


def test_without_processes_serve_takes_half_the_usable_cpus_from_two_to_four() -> None:
    from batchery.gateway.cli import default_processes
    assert [default_processes(cpus) for cpus in (1, 2, 3, 4, 5, 6, 7, 8, 16, 64)] == \
        [1, 1, 1, 2, 2, 3, 3, 4, 4, 4]


@pytest.mark.parametrize("cpus,spawned", [(2, 0), (8, 4)])
def test_serve_without_processes_starts_as_many_as_its_cpus_call_for(redis_server, tmp_path,
                                                                      cpus, spawned) -> None:
    """The command as a user runs it, on a host of ``cpus`` usable CPUs (2: one process,
    no others spawned)."""
    code = (f"import batchery.config as c; c.usable_cpus = lambda: {cpus}\n"
            "from batchery.cli import main; main()")
    with serve(redis_server.url, tmp_path, "--files-dir", str(tmp_path / "files"),
               launcher=(sys.executable, "-c", code)) as served:
        wait_for(lambda: len(_served_by(served.proc.pid)) == spawned, 60, 0.1,
                 message=f"{spawned} processes spawned")
    assert "Traceback" not in served.log.read_text()


def test_a_serving_process_that_cannot_start_stops_them_all_with_a_clear_error(
        tmp_path, monkeypatch) -> None:
    """One process fails at startup, the other would serve: the command stops both."""
    from batchery.errors import ConfigError
    from batchery.gateway.processes import serve as serve_processes
    from tests.serve_apps import ENV_MARKER
    monkeypatch.setenv(ENV_MARKER, str(tmp_path / "first"))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    with pytest.raises(ConfigError, match="could not start on port"):
        serve_processes(2, app="tests.serve_apps:first_fails", factory=True,
                        host="127.0.0.1", port=free_port(), log_level="critical")
    assert not multiprocessing.active_children()


def test_a_serving_process_that_stops_answering_is_replaced(redis_server, tmp_path) -> None:
    """SIGSTOP one of two: its heartbeat falls silent, the command kills it and starts
    another on its socket, and the connections dealt to that socket are answered again."""
    with serve(redis_server.url, tmp_path, "--processes", "2") as served:
        wait_for(lambda: len(_served_by(served.proc.pid)) == 2, 60, 0.1,
                 message="two processes spawned")
        for _ in range(16):  # over both sockets (all on one: 1 in 30,000): both serve now
            assert served.get("/health")[0] == 200
        frozen = min(_served_by(served.proc.pid))
        os.kill(frozen, signal.SIGSTOP)
        try:
            wait_for(lambda: frozen not in _served_by(served.proc.pid)
                     and len(_served_by(served.proc.pid)) == 2, 60, 0.2,
                     message="the silent process replaced")
        finally:
            try:
                os.kill(frozen, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for _ in range(16):  # new connections, dealt over both sockets: each answered
            assert served.get("/health")[0] == 200
    assert "silent for" in served.log.read_text()


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL])
def test_the_serving_processes_end_with_the_command(redis_server, tmp_path, sig) -> None:
    """SIGHUP stops the command and its processes; after SIGKILL, which the command cannot
    pass on, its processes notice it is gone and stop."""
    with serve(redis_server.url, tmp_path, "--processes", "2") as served:
        wait_for(lambda: len(_served_by(served.proc.pid)) == 2, 60, 0.1,
                 message="two processes serving")
        children = _served_by(served.proc.pid)
        os.kill(served.proc.pid, sig)
        served.proc.wait(30)
        for pid in children:
            wait_for(lambda: not Path(f"/proc/{pid}").exists()
                     or b"zombie" in Path(f"/proc/{pid}/status").read_bytes().lower(), 30, 0.1,
                     message=f"serving process {pid} stopped")


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_files_dir_that_cannot_be_made_is_a_clear_error(redis_server, tmp_path,
                                                          processes) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    refused = run_cli("serve", "--port", "1", "--processes", processes, "--files-dir",
                      str(blocker / "files"), redis_url=redis_server.url)
    assert refused.returncode == 2, refused.stderr
    assert "--files-dir" in refused.stderr and "cannot create it" in refused.stderr
    assert "Traceback" not in refused.stderr
