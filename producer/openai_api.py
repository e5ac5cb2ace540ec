"""The OpenAI API's request and response bodies, mapped onto batchery's requests.

One owner for the mapping that ``batchery serve`` (online endpoints) and offline jobs
(OpenAI batch lines) share: a body of ``/v1/embeddings``, ``/v1/completions`` or
``/v1/chat/completions`` becomes the inputs of batchery requests (one per embedding, one
per choice), and results become the response bodies and stream chunks the ``openai``
SDK parses. Chat messages go to the worker as they are: its tokenizer's chat template
renders them (workers/generation/runner.py), so nothing here needs the model.
"""

from __future__ import annotations

import base64
import secrets
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from batchery.batching.pricing import estimate_tokens
from batchery.errors import InvalidRequest

EMBEDDINGS, COMPLETIONS, CHAT = "/v1/embeddings", "/v1/completions", "/v1/chat/completions"
# The queue task each endpoint needs (a worker's --task)
TASKS = {EMBEDDINGS: "embed", COMPLETIONS: "generate", CHAT: "generate"}
# service_tier -> batchery priority class
TIERS = {"priority": "realtime", "default": "normal", "auto": "normal", "flex": "batch"}
COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions (chat: the worker's default)
MAX_CHOICES = 16             # n: each choice is one request
ROLES = ("system", "developer", "user", "assistant", "tool")
# Fields that would change the answer and that batchery cannot honour: refused, not ignored
UNSUPPORTED = {"tools": None, "functions": None, "tool_choice": None, "logit_bias": {},
               "echo": False, "suffix": None, "logprobs": False, "top_logprobs": None,
               "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0,
               "prediction": None, "audio": None, "dimensions": None}


class BodyError(InvalidRequest):
    """A body field the endpoint refuses; ``param`` names it (OpenAI's error shape)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Call:
    """One OpenAI request body, as batchery requests."""

    endpoint: str
    model: str
    inputs: list[Any]             # one request input per embedding or choice, in order
    stream: bool = False
    include_usage: bool = False   # stream_options.include_usage
    encoding: str = "float"       # embeddings: float or base64
    tier: str | None = None       # service_tier as given
    n: int = 1                    # choices per prompt
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def priority(self) -> str:
        return TIERS.get(self.tier or "auto", "normal")


def parse_body(endpoint: str, body: Any) -> Call:
    """The Call a body asks for; raises BodyError naming the field."""
    if not isinstance(body, dict):
        raise BodyError("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BodyError("model is required: the name of a queue (GET /v1/models lists them)", "model")
    for name, neutral in UNSUPPORTED.items():
        if body.get(name, neutral) not in (neutral, None):
            raise BodyError(f"{name} is not supported by batchery; leave it out", name)
    tier = body.get("service_tier")
    if tier is not None and tier not in TIERS:
        raise BodyError(f"service_tier must be one of {', '.join(TIERS)}, got {tier!r}",
                        "service_tier")
    if endpoint == EMBEDDINGS:
        call = _embeddings(body, model)
    elif endpoint in (COMPLETIONS, CHAT):
        call = _generation(endpoint, body, model)
    else:
        raise BodyError(f"batchery serves {', '.join(TASKS)}; not {endpoint!r}", "url")
    call.tier = tier
    return call


def _embeddings(body: dict[str, Any], model: str) -> Call:
    given = body.get("input")
    texts = [given] if isinstance(given, str) else given
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise BodyError("input must be a string or a non-empty list of strings (token ids "
                        "are not supported: send the text)", "input")
    if any(not t for t in texts):
        raise BodyError("input must not hold an empty string", "input")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise BodyError(f"encoding_format must be float or base64, got {encoding!r}",
                        "encoding_format")
    return Call(EMBEDDINGS, model, list(texts), encoding=encoding)


def _generation(endpoint: str, body: dict[str, Any], model: str) -> Call:
    params = _sampling(body, endpoint)
    n = _integer(body, "n", 1, 1, MAX_CHOICES)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise BodyError(f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise BodyError('stream_options must be {"include_usage": true|false}', "stream_options")
    if endpoint == CHAT:
        fmt = body.get("response_format")
        if fmt not in (None, {"type": "text"}):
            raise BodyError('response_format other than {"type": "text"} is not supported',
                            "response_format")
        prompts: list[dict[str, Any]] = [{"messages": _messages(body.get("messages"))}]
    else:
        prompts = [{"prompt": p} for p in _prompts(body.get("prompt"))]
    inputs = []
    for prompt in prompts:
        for i in range(n):
            one = {**prompt, **params, "stream": stream}
            if "seed" in params and i:  # each choice its own draw, reproducibly
                one["seed"] = (params["seed"] + i) % 2**63
            inputs.append(one)
    return Call(endpoint, model, inputs, stream=stream, n=n,
                include_usage=bool(options.get("include_usage")))


def _sampling(body: dict[str, Any], endpoint: str) -> dict[str, Any]:
    params: dict[str, Any] = {}
    names = ("max_completion_tokens", "max_tokens") if endpoint == CHAT else ("max_tokens",)
    for name in names:
        if body.get(name) is not None:
            params["max_new_tokens"] = _integer(body, name, None, 1, 1 << 20)
            break
    else:
        if endpoint == COMPLETIONS:
            params["max_new_tokens"] = COMPLETION_MAX_TOKENS
    for name, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise BodyError(f"{name} must be a number {low}..{high}, got {value!r}", name)
        if name == "top_p" and value == 0:
            raise BodyError("top_p must be more than 0", name)
        params[name] = float(value)
    if body.get("seed") is not None:
        params["seed"] = _integer(body, "seed", None, -(2**63), 2**63 - 1) % 2**63
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise BodyError("stop must be a string or a list of non-empty strings", "stop")
        if stops:
            params["stop"] = stops
    return params


def _integer(body: dict[str, Any], name: str, default: Any, low: int, high: int) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BodyError(f"{name} must be an integer {low}..{high}, got {value!r}", name)
    return value


def _prompts(prompt: Any) -> list[str]:
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise BodyError("prompt must be a string or a non-empty list of strings (token ids "
                        "are not supported: send the text)", "prompt")
    return prompts


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise BodyError("messages must be a non-empty list of {role, content} objects", "messages")
    plain = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BodyError(f"{where} must be an object with a role among {', '.join(ROLES)}", where)
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BodyError(f"{where}.content: only text parts are supported", f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BodyError(f"{where}.content must be a string or a list of text parts",
                            f"{where}.content")
        plain.append({"role": m["role"], "content": content})
    return plain


# -- responses ----------------------------------------------------------------------------
def usage(prompt: int, completion: int | None = None) -> dict[str, int]:
    if completion is None:
        return {"prompt_tokens": prompt, "total_tokens": prompt}
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def embedding_item(index: int, vector: list[float], encoding: str) -> dict[str, Any]:
    value: Any = vector
    if encoding == "base64":  # little-endian float32, as OpenAI sends it
        value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return {"object": "embedding", "index": index, "embedding": value}


def embeddings_body(call: Call, vectors: list[list[float]], prompt_tokens: int) -> dict[str, Any]:
    return {"object": "list", "model": call.model,
            "data": [embedding_item(i, v, call.encoding) for i, v in enumerate(vectors)],
            "usage": usage(prompt_tokens)}


def finish_reason(output: Any) -> str:
    """OpenAI's finish_reason for a generation output: stop or length."""
    reason = output.get("finish_reason") if isinstance(output, dict) else None
    return "length" if reason == "length" else "stop"


def generation_usage(outputs: list[Any]) -> dict[str, int]:
    """Exact counts from the worker: each prompt once (its n choices share it)."""
    prompts: dict[int, int] = {}
    completion = 0
    for i, out in enumerate(outputs):
        out = out if isinstance(out, dict) else {}
        prompts.setdefault(out.get("prompt_index", i), int(out.get("prompt_tokens") or 0))
        completion += int(out.get("tokens") or 0)
    return usage(sum(prompts.values()), completion)


def generation_body(call: Call, request_id: str, created: int,
                    outputs: list[Any]) -> dict[str, Any]:
    """The completion or chat completion of ``outputs`` (one per choice)."""
    choices = []
    for i, out in enumerate(outputs):
        text = out.get("text", "") if isinstance(out, dict) else str(out)
        if call.endpoint == CHAT:
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "logprobs": None, "finish_reason": finish_reason(out)})
        else:
            choices.append({"index": i, "text": text, "logprobs": None,
                            "finish_reason": finish_reason(out)})
    shared = [{**o, "prompt_index": i // call.n} if isinstance(o, dict) else o
              for i, o in enumerate(outputs)]
    return {"id": request_id, "object": "chat.completion" if call.endpoint == CHAT
            else "text_completion", "created": created, "model": call.model,
            "choices": choices, "usage": generation_usage(shared),
            "service_tier": call.tier or "default", "system_fingerprint": None}


def chunk(call: Call, request_id: str, created: int, index: int, text: str | None,
          reason: str | None = None, first: bool = False) -> dict[str, Any]:
    """One server-sent event's body of a streamed completion or chat completion."""
    if call.endpoint == CHAT:
        delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else \
            ({} if text is None else {"content": text})
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None,
                                  "finish_reason": reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
        kind = "text_completion"
    body = {"id": request_id, "object": kind, "created": created, "model": call.model,
            "choices": [choice], "service_tier": call.tier or "default",
            "system_fingerprint": None}
    if call.include_usage:
        body["usage"] = None
    return body


def usage_chunk(call: Call, request_id: str, created: int, counts: dict[str, int]) -> dict[str, Any]:
    """The last event when stream_options.include_usage: no choices, the usage."""
    kind = "chat.completion.chunk" if call.endpoint == CHAT else "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": call.model,
            "choices": [], "usage": counts}


# -- results that did not end ok ---------------------------------------------------------
def result_error(result: Any) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI's error object) of a result whose status is not ok."""
    error = result.error or {}
    message = error.get("message") or f"the request ended {result.status}"
    if result.status == "expired":
        return 504, {"message": f"the request's deadline passed before it finished ({message})",
                     "type": "timeout_error", "param": None, "code": "deadline_exceeded"}
    if error.get("type") == "InputError":  # the worker refused the input: the caller's to fix
        return 400, {"message": message.replace("max_new_tokens", "max_tokens"),
                     "type": "invalid_request_error", "param": None, "code": None}
    if result.status == "cancelled":
        return 499, {"message": "the request was cancelled", "type": "invalid_request_error",
                     "param": None, "code": "cancelled"}
    return 500, {"message": f"the model failed on this request ({error.get('type', result.status)}"
                 f": {message})", "type": "server_error", "param": None, "code": result.status}


# -- batch lines (the Batch API, `batchery job submit`) -------------------------------------
BATCH_FIELDS = ("custom_id", "method", "url", "body")


def is_batch_line(obj: dict[str, Any]) -> bool:
    """An OpenAI batch input line ({custom_id, method, url, body}) rather than batchery's."""
    return "body" in obj or "url" in obj or "method" in obj


def batch_call(obj: dict[str, Any]) -> Call:
    """The Call of one batch input line; raises BodyError. A line runs one request."""
    unknown = set(obj) - set(BATCH_FIELDS)
    if unknown:
        raise BodyError(f"unknown field(s) {sorted(unknown)}; a batch line has "
                        f"{', '.join(BATCH_FIELDS)}")
    if obj.get("method", "POST") != "POST":
        raise BodyError(f"method must be POST, got {obj.get('method')!r}", "method")
    url = obj.get("url")
    if url not in TASKS:
        raise BodyError(f"url must be one of {', '.join(TASKS)}, got {url!r}", "url")
    call = parse_body(url, obj.get("body"))
    if len(call.inputs) != 1:
        raise BodyError("a batch line runs one input: give one string (embeddings), one "
                        "prompt, and n 1; split longer lists over several lines", "body")
    if call.stream:
        raise BodyError("stream is not supported in a batch", "body.stream")
    return call


def batch_record_id(number: int) -> str:
    """An output line's id; it ends with the input line's number (a resumed job reads it)."""
    return f"batch_req_{secrets.token_hex(8)}_{number}"


def line_of_record(record: dict[str, Any]) -> int | None:
    """The input line number of a written batch output or error line."""
    record_id = record.get("id")
    tail = record_id.rsplit("_", 1)[-1] if isinstance(record_id, str) else ""
    return int(tail) if tail.isdigit() else None


def batch_ok(record: dict[str, Any]) -> bool:
    return (record.get("response") or {}).get("status_code") == 200


def batch_result_line(number: int, custom_id: Any, call: Call | None, result: Any,
                      tokens: int | None) -> tuple[bool, dict[str, Any]]:
    """(ok, the output or error file's line) of a request's result."""
    line: dict[str, Any] = {"id": batch_record_id(number), "custom_id": custom_id,
                            "response": None, "error": None}
    if result.status == "expired":
        line["error"] = {"code": "batch_expired", "message": "this request could not run "
                         "before the batch's completion window expired"}
        return False, line
    if result.status != "ok":
        status, error = result_error(result)
        line["response"] = {"status_code": status, "request_id": result.id, "body": {"error": error}}
        return False, line
    body: Any = result.output
    if call is not None and call.endpoint == EMBEDDINGS:
        body = embeddings_body(call, [result.output], tokens or estimate_tokens(call.inputs[0]))
    elif call is not None:
        body = generation_body(call, result.id, int(time.time()), [result.output])
    line["response"] = {"status_code": 200, "request_id": result.id, "body": body}
    return True, line


def batch_invalid_line(number: int, custom_id: Any, message: str) -> dict[str, Any]:
    """The error file's line of an input line the endpoint refuses."""
    return {"id": batch_record_id(number), "custom_id": custom_id,
            "response": {"status_code": 400, "request_id": None, "body": {"error": {
                "message": message, "type": "invalid_request_error", "param": None,
                "code": None}}}, "error": None}
