"""OpenAI batch lines in offline jobs, without Redis: input lines taken as they are
(custom_id, method, url, body), OpenAI's output and error lines written, and resumed."""

from __future__ import annotations

import json
import time
from pathlib import Path

from batchery.batching.messages import Result
from batchery.batching.settings import QueueSettings
from batchery.producer.jobs.files import Invalid, JobFiles, Line, LineParser, recover

SETTINGS = QueueSettings(max_request_bytes=10_000)


def line(obj: dict, number: int = 1, expires_at: float | None = None) -> Line | Invalid:
    parser = LineParser("job1", "batch", SETTINGS, count=lambda value: 3, expires_at=expires_at)
    return parser.parse(number, json.dumps(obj).encode())


def test_openai_lines_are_taken_as_they_are() -> None:
    chat = line({"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "gen", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 5, "temperature": 0.5}})
    assert isinstance(chat, Line) and chat.custom_id == "c1" and chat.request.id == "job1:c1"
    assert chat.request.input == {"messages": [{"role": "user", "content": "hi"}],
                                  "max_new_tokens": 5, "temperature": 0.5, "stream": False}
    embed = line({"custom_id": "e1", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": "embed", "input": "hello"}}, expires_at=time.time() + 60)
    assert embed.request.input == "hello" and 55 < embed.request.deadline <= 60


def test_a_body_the_endpoint_refuses_is_that_line_s_error() -> None:
    cases = [("GET", "/v1/embeddings", {"model": "m", "input": "x"}, "method must be POST"),
             ("POST", "/v1/images", {"model": "m"}, "url must be one of"),
             ("POST", "/v1/embeddings", {"model": "m", "input": ["a", "b"]}, "one input"),
             ("POST", "/v1/completions", {"model": "m", "prompt": "x", "stream": True}, "stream"),
             ("POST", "/v1/completions", {"model": "m", "prompt": 5}, "prompt must be")]
    for method, url, body, words in cases:
        found = line({"custom_id": "x", "method": method, "url": url, "body": body})
        assert isinstance(found, Invalid) and words in found.reason, (url, found)


def test_openai_output_and_error_lines_and_resume(tmp_path: Path) -> None:
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    ok = line({"custom_id": "a", "url": "/v1/embeddings", "method": "POST",
               "body": {"model": "embed", "input": "x"}}, number=1)
    failed = line({"custom_id": "b", "url": "/v1/completions", "method": "POST",
                   "body": {"model": "gen", "prompt": "x"}}, number=2)
    refused = line({"custom_id": "c", "url": "/v1/completions", "method": "POST",
                    "body": {"model": "gen", "prompt": 1}}, number=3)
    with JobFiles(out, err, "openai") as files:
        files.result(ok, Result("job1:a", "ok", output=[0.6, 0.8]))
        files.result(failed, Result("job1:b", "error", error={"type": "RuntimeError",
                                                              "message": "boom"}))
        files.invalid(refused)
    [written] = [json.loads(x) for x in out.read_text().splitlines()]
    assert written["custom_id"] == "a" and written["error"] is None
    assert written["response"]["status_code"] == 200
    assert written["response"]["body"]["data"][0]["embedding"] == [0.6, 0.8]
    assert written["response"]["body"]["usage"]["prompt_tokens"] == 3
    errors = {e["custom_id"]: e for e in map(json.loads, err.read_text().splitlines())}
    assert errors["b"]["response"]["status_code"] == 500
    assert "boom" in errors["b"]["response"]["body"]["error"]["message"]
    assert errors["c"]["response"]["status_code"] == 400
    done = recover(out, err)
    assert [n in done.lines for n in (1, 2, 3, 4)] == [True, True, True, False]
    assert (done.ok, done.failed + done.invalid) == (1, 2)
