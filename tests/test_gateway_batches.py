"""The Batch API of `batchery serve` with the openai SDK: files, batches end to end (create,
poll, download, cancel), the shape check, a gateway restart; and `batchery job submit`
running OpenAI batch lines as they are. Shares test_gateway's server and workers (tests/gateway_fixtures.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import run_cli, wait_for
from tests.gateway_helpers import serve

pytestmark = pytest.mark.slow


def upload(sdk: openai.OpenAI, lines: list[Any]) -> Any:
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    return sdk.files.create(file=("input.jsonl", io.BytesIO(text.encode())), purpose="batch")


def ask(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def finished(sdk: openai.OpenAI, batch_id: str, timeout: float = 180) -> Any:
    return wait_for(lambda: (b := sdk.batches.retrieve(batch_id)).status in
                    ("completed", "failed", "cancelled", "expired") and b, timeout, 0.3,
                    message=f"batch {batch_id} to end")


def jsonl(sdk: openai.OpenAI, file_id: str) -> dict[str, Any]:
    return {r["custom_id"]: r for r in map(json.loads, sdk.files.content(file_id).text.splitlines())}


def test_an_embeddings_batch_runs_end_to_end(sdk, queues) -> None:
    model = queues["embed"]
    source = upload(sdk, [ask(f"e{i}", "/v1/embeddings", {"model": model, "input": f"text {i}"})
                          for i in range(3)] +
                    [ask("bad", "/v1/embeddings", {"model": model, "input": [1, 2]})])
    assert source.purpose == "batch" and source.bytes > 0
    assert sdk.files.retrieve(source.id).filename == "input.jsonl"
    batch = sdk.batches.create(input_file_id=source.id, endpoint="/v1/embeddings",
                               completion_window="24h", metadata={"team": "search"})
    assert batch.status == "in_progress" and batch.metadata == {"team": "search"}
    done = finished(sdk, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (4, 3, 1)
    out = jsonl(sdk, done.output_file_id)
    assert sorted(out) == ["e0", "e1", "e2"]
    assert out["e1"]["response"]["status_code"] == 200
    assert len(out["e1"]["response"]["body"]["data"][0]["embedding"]) == 384
    error = jsonl(sdk, done.error_file_id)["bad"]
    assert error["response"]["status_code"] == 400
    assert "input must be a string" in error["response"]["body"]["error"]["message"]
    assert batch.id in [b.id for b in sdk.batches.list(limit=100)]
    assert sdk.files.delete(source.id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(source.id)


def test_a_chat_batch_on_the_generate_queue(sdk, queues) -> None:
    lines = [ask(f"c{i}", "/v1/chat/completions",
                 {"model": queues["generate"], "max_tokens": 4,
                  "messages": [{"role": "user", "content": f"hello {i}"}]}) for i in range(2)]
    batch = sdk.batches.create(input_file_id=upload(sdk, lines).id,
                               endpoint="/v1/chat/completions", completion_window="24h")
    done = finished(sdk, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 2
    assert done.error_file_id is None
    body = jsonl(sdk, done.output_file_id)["c1"]["response"]["body"]
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 4
    assert body["choices"][0]["message"]["role"] == "assistant"


def test_a_malformed_file_fails_whole_before_anything_runs(sdk, queues) -> None:
    model = queues["embed"]
    lines = [ask("a", "/v1/embeddings", {"model": model, "input": "x"}),
             ask("a", "/v1/embeddings", {"model": model, "input": "y"}),
             ask("b", "/v1/completions", {"model": model, "prompt": "y"}), "not json"]
    batch = sdk.batches.create(input_file_id=upload(sdk, lines).id, endpoint="/v1/embeddings",
                               completion_window="24h")
    assert batch.status == "failed" and batch.request_counts.total == 0
    assert [(e.code, e.line) for e in batch.errors.data] == [
        ("duplicate_custom_id", 2), ("mismatched_endpoint", 3), ("invalid_json_line", 4)]
    with pytest.raises(openai.BadRequestError) as window:
        sdk.batches.create(input_file_id=upload(sdk, lines[:1]).id, endpoint="/v1/embeddings",
                           completion_window="forever")  # type: ignore[arg-type]
    assert window.value.body["param"] == "completion_window"


def test_a_batch_survives_a_gateway_restart_and_cancels(gateway, queues, redis_server,
                                                        tmp_path) -> None:
    files = Path(str(gateway.log.parent / "files"))
    args = ("--files-dir", str(files), "--jobs-queue", queues["jobs"])
    lines = [ask(f"w{i}", "/v1/chat/completions", {"model": queues["idle"], "messages": [
        {"role": "user", "content": "waits"}]}) for i in range(3)]
    with serve(redis_server.url, tmp_path, *args) as first:
        sdk = first.client()
        batch = sdk.batches.create(input_file_id=upload(sdk, lines).id,
                                   endpoint="/v1/chat/completions", completion_window="1h")
    with serve(redis_server.url, tmp_path, *args) as second:  # another replica, later
        sdk = second.client()
        running = wait_for(lambda: (b := sdk.batches.retrieve(batch.id)).request_counts.total == 3
                           and b, 60, 0.3, message="the job counted its lines")
        assert running.status == "in_progress" and running.expires_at - running.created_at == 3600
        assert sdk.batches.cancel(batch.id).status in ("cancelling", "cancelled")
        done = finished(sdk, batch.id, 60)
        assert done.status == "cancelled" and done.cancelled_at
        with pytest.raises(openai.ConflictError):
            sdk.batches.cancel(batch.id)


def test_job_submit_takes_openai_lines_and_writes_openai_output(queues, redis_server,
                                                                tmp_path) -> None:
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(ask(f"q{i}", "/v1/embeddings", {
        "model": "any", "input": f"line {i}"})) + "\n" for i in range(2)))
    submitted = run_cli("job", "submit", str(source), "-o", str(out), "--queue", queues["embed"],
                        "--output-format", "openai", "--jobs-queue", queues["jobs"],
                        redis_url=redis_server.url)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip()
    wait_for(lambda: json.loads(run_cli("job", "status", job, "--json", redis_url=redis_server.url)
                                .stdout)["state"] == "finished", 120, 0.5, message="the job")
    written = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(w["custom_id"] for w in written) == ["q0", "q1"]
    assert all(w["response"]["body"]["object"] == "list" and w["error"] is None for w in written)
