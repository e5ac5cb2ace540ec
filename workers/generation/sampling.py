"""Per-request generation parameters, and choosing the next token of every row at once.

An input is a prompt string, or an object with ``prompt`` (or ``text``, or chat
``messages``: a list of ``{"role", "content"}`` that the runner renders with its
tokenizer's chat template) and any of ``max_new_tokens``, ``stop``, ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``presence_penalty``,
``frequency_penalty``, ``seed``, ``logprobs`` and ``stream``. Greedy unless
``temperature`` > 0.

Choosing (``choose``) is one set of tensor operations over the whole batch, on the
model's device: each parameter is a per-row tensor, as in vLLM's sampler. Sampling
inverts each row's cumulative distribution at one uniform draw: a seeded row's draw comes
from its own generator, so a seed gives the same text whatever its batch-mates; unseeded
rows share one call. Top-p finds each row's cut from a few candidates instead of sorting
the vocabulary (``nucleus_floor``). The host reads the tokens once per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from batchery.workers.runners.base import InputError

DEFAULT_NEW_TOKENS = 32  # a short answer unless the request asks for more
MAX_NEW_TOKENS = 1024    # bounds one sequence's KV cache and its stream
MAX_STOPS, MAX_STOP_CHARS = 16, 200
# The lowest temperature that float32 logits of ordinary range survive (their spread / 1e-4
# stays far below float32's 3e38); a lower one may fail its request (SamplingError).
MIN_TEMPERATURE = 1e-4
# Candidates that settle top-p without sorting the vocabulary: the likeliest HEAD hold top_p
# in a peaked distribution, the least likely TAIL hold the 1 - top_p dropped in a flat one.
HEAD, TAIL = 256, 4096
MAX_LOGPROBS = 20        # alternatives per token a request may ask for (OpenAI's bound)
FIELDS = ("prompt", "text", "messages", "max_new_tokens", "stop", "temperature", "top_p", "top_k",
          "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "logprobs",
          "stream")


@dataclass(frozen=True)
class GenParams:
    prompt: str
    max_new_tokens: int = DEFAULT_NEW_TOKENS
    stop: tuple[str, ...] = ()      # generation ends before the first of these in the text
    temperature: float = 0.0        # 0: greedy
    top_p: float = 1.0              # nucleus: smallest set of tokens with this much probability
    top_k: int = 0                  # 0: no limit
    min_p: float = 0.0              # drop tokens less likely than min_p x the likeliest
    repetition_penalty: float = 1.0  # > 1: tokens of the prompt and output less likely (CTRL's)
    presence_penalty: float = 0.0   # subtracted from the logit of each token the output holds
    frequency_penalty: float = 0.0  # subtracted once per time the output holds the token
    seed: int | None = None         # None: drawn from the shared generator
    logprobs: int | None = None     # None: none; N: each token's log-probability and N more
    stream: bool = False            # write each token to the request's Redis stream
    messages: tuple[tuple[str, str], ...] = ()  # chat (role, content) pairs; prompt is then ""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def holdback(self) -> int:
        """Characters a stream keeps back: they may be the start of a stop string."""
        return max((len(s) for s in self.stop), default=1) - 1


def parse_params(value: Any) -> GenParams:
    """The request's parameters; raises InputError naming the field and what it accepts."""
    if isinstance(value, str):
        return GenParams(prompt=value)
    if not isinstance(value, dict):
        raise InputError(f"input must be a prompt string or an object with a string 'prompt', "
                         f"got {type(value).__name__}")
    unknown = sorted(set(map(str, value)) - set(FIELDS))
    if unknown:
        raise InputError(f"unknown generation field(s) {unknown}; allowed: {', '.join(FIELDS)}")
    messages = _messages(value["messages"]) if "messages" in value else ()
    prompt = "" if messages else value.get("prompt", value.get("text"))
    if not isinstance(prompt, str):
        raise InputError("input must have a string 'prompt' (or 'text', or chat 'messages')")
    return GenParams(prompt=prompt, messages=messages,
                     max_new_tokens=_int(value, "max_new_tokens", DEFAULT_NEW_TOKENS, 1, MAX_NEW_TOKENS),
                     stop=_stops(value.get("stop")),
                     temperature=_number(value, "temperature", 0.0, 0.0, 100.0),
                     top_p=_number(value, "top_p", 1.0, 0.0, 1.0, open_low=True),
                     top_k=_int(value, "top_k", 0, 0, 1_000_000),
                     min_p=_number(value, "min_p", 0.0, 0.0, 1.0),
                     repetition_penalty=_number(value, "repetition_penalty", 1.0, 0.0, 10.0,
                                                open_low=True),
                     presence_penalty=_number(value, "presence_penalty", 0.0, -2.0, 2.0),
                     frequency_penalty=_number(value, "frequency_penalty", 0.0, -2.0, 2.0),
                     seed=_int(value, "seed", None, 0, 2**63 - 1),
                     logprobs=_logprobs(value.get("logprobs")),
                     stream=_bool(value, "stream"))


def _messages(messages: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise InputError('messages must be a non-empty list of {"role": str, "content": str}')
    return tuple((m["role"], m["content"]) for m in messages)


def _int(value: dict[str, Any], name: str, default: Any, low: int, high: int) -> Any:
    n = value.get(name)
    if n is None:
        return default
    if isinstance(n, bool) or not isinstance(n, int) or not low <= n <= high:
        raise InputError(f"{name} must be an integer {low}..{high}, got {n!r}")
    return n


def _number(value: dict[str, Any], name: str, default: float, low: float, high: float,
            open_low: bool = False) -> float:
    x = value.get(name)
    if x is None:
        return default
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not low <= x <= high \
            or (open_low and x == low):
        bound = f"more than {low}" if open_low else f"at least {low}"
        raise InputError(f"{name} must be a number {bound} and at most {high}, got {x!r}")
    return float(x)


def _bool(value: dict[str, Any], name: str) -> bool:
    x = value.get(name, False)
    if not isinstance(x, bool):
        raise InputError(f"{name} must be true or false, got {x!r}")
    return x


def _logprobs(x: Any) -> int | None:
    """None or false: none; true: the chosen token's; N: and the N likeliest."""
    if x is None or x is False:
        return None
    if x is True:
        return 0
    if isinstance(x, int) and 0 <= x <= MAX_LOGPROBS:
        return x
    raise InputError(f"logprobs must be true, false or an integer 0..{MAX_LOGPROBS} (the "
                     f"alternatives to list per token), got {x!r}")


def _stops(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS
                                              for s in stops) or len(stops) > MAX_STOPS:
        raise InputError(f"stop must be a string or a list of at most {MAX_STOPS} non-empty "
                         f"strings of at most {MAX_STOP_CHARS} characters, got {stop!r}")
    return tuple(stops)


class SamplingError(InputError):
    """A row whose next-token logits or probabilities are not finite: its parameters (or
    the model, for its prompt) cannot give a token. Fails that request alone, not retried."""


@dataclass
class Rows:
    """The batch's parameters as per-row tensors on the device, built once per batch
    composition (rows join and leave between steps, not within)."""

    params: list[GenParams]
    temperature: torch.Tensor   # [rows, 1], 1 where greedy (never divides by 0)
    greedy: torch.Tensor        # [rows] bool
    top_k: torch.Tensor         # [rows, 1] long, the vocabulary where no limit
    top_p: torch.Tensor         # [rows, 1]
    min_p: torch.Tensor         # [rows, 1]
    repetition: torch.Tensor    # [rows, 1]
    presence: torch.Tensor      # [rows, 1]
    frequency: torch.Tensor     # [rows, 1]
    seeded: list[tuple[int, torch.Generator]]  # (row, its generator) for seeded rows
    any_sampled: bool
    any_truncated: bool         # some row has top_k or top_p
    top_k_max: int              # the largest top_k that limits a row (0: none does)
    any_top_p: bool
    any_min_p: bool
    any_penalized: bool
    logprobs: int | None        # most alternatives a row asks for; None: no row asks

    @classmethod
    def of(cls, params: list[GenParams], generators: list[torch.Generator | None], vocab: int,
           device: torch.device) -> Rows:
        def column(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)[:, None]
        sampled = [not p.greedy for p in params]
        asks = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            params=params,
            temperature=column([p.temperature if not p.greedy else 1.0 for p in params]),
            greedy=torch.tensor([p.greedy for p in params], device=device),
            top_k=column([min(p.top_k, vocab) or vocab for p in params], torch.long),
            top_p=column([p.top_p for p in params]), min_p=column([p.min_p for p in params]),
            repetition=column([p.repetition_penalty for p in params]),
            presence=column([p.presence_penalty for p in params]),
            frequency=column([p.frequency_penalty for p in params]),
            seeded=[(i, g) for i, g in enumerate(generators) if g is not None],
            any_sampled=any(sampled),
            any_truncated=any(s and (p.top_k or p.top_p < 1.0) for s, p in zip(sampled, params)),
            top_k_max=max((p.top_k for s, p in zip(sampled, params) if s and 0 < p.top_k < vocab),
                          default=0),
            any_top_p=any(s and p.top_p < 1.0 for s, p in zip(sampled, params)),
            any_min_p=any(s and p.min_p > 0 for s, p in zip(sampled, params)),
            any_penalized=any(p.penalized for p in params),
            logprobs=max(asks) if asks else None)


@dataclass
class Chosen:
    """A step's choice: per row its token or its own error, and the log-probabilities
    asked for (row -> (its token's, [(token, logprob)] of the likeliest))."""

    tokens: list[Any]
    logprobs: dict[int, tuple[float, list[tuple[int, float]]]]


def new_generator(params: GenParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A seeded row's own generator on the device; None: the row draws from the shared one."""
    if params.greedy or params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def choose(logits: torch.Tensor, rows: Rows, history: list[list[int]] | None = None,
           outputs: list[list[int]] | None = None) -> Chosen:
    """The next token of every row of ``logits`` [rows, vocab] (on the model's device), or
    the row's own SamplingError. ``history``: each row's prompt and output tokens, and
    ``outputs`` its output tokens (read only when a row has a penalty)."""
    raw = logits.float()
    scores = _penalize(raw, rows, history or [], outputs or []) if rows.any_penalized else raw
    tokens = scores.argmax(dim=-1)
    bad = torch.isnan(scores.sum(dim=-1))  # (NaN anywhere in the row)
    if rows.any_sampled:
        probs = _probabilities(scores / rows.temperature, rows)
        cdf = probs.cumsum(dim=-1)
        total = cdf[:, -1:]
        drawn = torch.searchsorted(cdf, _uniform(rows, probs.device) * total)
        tokens = torch.where(rows.greedy, tokens, drawn[:, 0].clamp(max=probs.shape[1] - 1))
        bad |= ~(torch.isfinite(total[:, 0]) & (total[:, 0] > 0)) & ~rows.greedy
    picked, failed = tokens.tolist(), bad.tolist()  # the step's one read by the host
    chosen: list[Any] = [SamplingError(_explain(p)) if f else t
                         for t, f, p in zip(picked, failed, rows.params)]
    return Chosen(chosen, _logprobs_of(raw, tokens, rows) if rows.logprobs is not None else {})


def _explain(p: GenParams) -> str:
    return (f"this request's next-token probabilities are not finite (temperature "
            f"{p.temperature!r}, top_p {p.top_p!r}, top_k {p.top_k!r}, min_p {p.min_p!r}): a "
            f"temperature this close to 0 overflows the logits, or the model's are NaN; use "
            f"0 for greedy decoding or a temperature of at least {MIN_TEMPERATURE}")


def _penalize(scores: torch.Tensor, rows: Rows, history: list[list[int]],
              outputs: list[list[int]]) -> torch.Tensor:
    """Repetition penalty over prompt and output (logits divided if positive, multiplied
    if negative), presence and frequency penalties over the output (subtracted), as vLLM
    and OpenAI define them."""
    seen = _counts(history, scores) > 0
    counts = _counts(outputs, scores)
    penalty = torch.where(scores > 0, 1 / rows.repetition, rows.repetition)
    scores = torch.where(seen, scores * penalty, scores)
    return scores - rows.presence * (counts > 0) - rows.frequency * counts


def _counts(tokens: list[list[int]], like: torch.Tensor) -> torch.Tensor:
    """[rows, vocab]: how often each row's list holds each token."""
    width = max((len(t) for t in tokens), default=0)
    counts = torch.zeros(like.shape[0], like.shape[1] + 1, device=like.device)
    if width:  # padded with an extra column, cut off after counting
        ids = torch.tensor([t + [like.shape[1]] * (width - len(t)) for t in tokens],
                           dtype=torch.long, device=like.device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :-1]


def _probabilities(scores: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Unnormalized probabilities left by top-k, then top-p, then min-p (0 where dropped)."""
    probs = scores.softmax(dim=-1)
    if rows.any_truncated:
        if rows.top_k_max:  # each row's k-th likeliest token and those above it stay
            kth = probs.topk(rows.top_k_max, dim=-1).values
            kth = kth.gather(1, rows.top_k.clamp(max=rows.top_k_max) - 1)
            probs = probs.masked_fill((probs < kth) & (rows.top_k < probs.shape[1]), 0.0)
        if rows.any_top_p:
            probs = probs.masked_fill(probs < nucleus_floor(probs, rows.top_p), 0.0)
    if rows.any_min_p:
        probs = probs.masked_fill(probs < rows.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def nucleus_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: the probability of the token whose mass crosses ``top_p`` (tokens at least
    as likely stay), without sorting the vocabulary where candidates settle it: the
    likeliest HEAD tokens when they hold ``top_p`` (a real model's peaked distribution), or
    the TAIL least likely when they hold the ``1 - top_p`` dropped (a flat one). A row
    that neither settles is sorted whole."""
    vocab = probs.shape[1]
    total = probs.sum(dim=-1, keepdim=True)
    keep, drop = top_p * total, (1 - top_p) * total
    floor = torch.zeros_like(total)  # top_p 1: keep all
    head = probs.topk(min(HEAD, vocab), dim=-1).values
    mass = head.cumsum(dim=-1)
    crossing = (mass - head < keep).sum(dim=-1, keepdim=True).clamp(1, head.shape[1])
    settled = (mass[:, -1:] >= keep) | (top_p >= 1)
    floor = torch.where(settled & (top_p < 1), head.gather(1, crossing - 1), floor)
    if bool(settled.all()):
        return floor
    tail = probs.topk(min(TAIL, vocab), dim=-1, largest=False, sorted=False).values.sort(dim=-1).values
    mass = tail.cumsum(dim=-1)
    dropped = (mass <= drop).sum(dim=-1, keepdim=True).clamp(max=tail.shape[1] - 1)
    in_tail = ~settled & (mass[:, -1:] > drop)
    floor = torch.where(in_tail, tail.gather(1, dropped), floor)
    settled |= in_tail
    if bool(settled.all()):
        return floor
    ordered = probs.sort(dim=-1, descending=True).values
    mass = ordered.cumsum(dim=-1)
    crossing = (mass - ordered < keep).sum(dim=-1, keepdim=True).clamp(1, vocab)
    return torch.where(settled, floor, ordered.gather(1, crossing - 1))


def _uniform(rows: Rows, device: torch.device) -> torch.Tensor:
    """[rows, 1] uniform in (0, 1]: the shared generator's for every row, then each seeded
    row's own (so its draw does not depend on its batch-mates)."""
    u = 1 - torch.rand(len(rows.params), 1, device=device)
    for row, generator in rows.seeded:
        u[row] = 1 - torch.rand(1, generator=generator, device=device)
    return u


def _logprobs_of(raw: torch.Tensor, tokens: torch.Tensor,
                 rows: Rows) -> dict[int, tuple[float, list[tuple[int, float]]]]:
    """The model's log-probability of each chosen token, and of the likeliest, for the
    rows that ask (one read for the batch)."""
    logp = raw.log_softmax(dim=-1)
    mine = logp.gather(1, tokens[:, None])[:, 0].tolist()
    top = logp.topk(max(1, rows.logprobs or 0), dim=-1)
    values, ids = top.values.tolist(), top.indices.tolist()
    return {i: (mine[i], list(zip(ids[i], values[i]))[:p.logprobs])
            for i, p in enumerate(rows.params) if p.logprobs is not None}
