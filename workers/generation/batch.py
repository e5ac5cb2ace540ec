"""Iteration-level batching: sequences join and leave between decode steps.

The running sequences share one left-padded KV cache, written in place (generation/kv_slab.py:
a step writes one column per row, a newcomer's prefill cache is copied into a free row, a
row that leaves is replaced by the last one), with an attention mask marking each row's
real tokens; each row keeps its own position counter, so padding never shifts a position.
Newcomers are prefilled together in a cache of their own (a chunk of columns at a time if
the worker asks: a long prompt then does not stall the running rows for its whole
prefill). Compute and memory follow the rows times the longest row, not a paged cache:
what a CPU or one GPU running a small model needs.

Why not transformers' ``ContinuousBatchingManager`` (5.x): it runs on the CPU with a small
GPT-2 here, but one ``GenerationConfig`` serves all its requests (no per-request
temperature, top_p, top_k or seed), it has no stop strings, and it schedules in a
background thread of its own, so nothing could claim from Redis between two of its steps,
stop a sequence whose lease was lost, or count steps. The scheduling is the product here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from batchery.workers.generation.kv_slab import Slab
from batchery.workers.generation.sampling import GenParams, Rows, choose, new_generator


@dataclass(eq=False)
class Sequence:
    """One request in flight: its tokens so far and how it may end."""

    key: Any                         # the caller's handle on it (the claimed request)
    params: GenParams
    prompt_ids: list[int]
    generated: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None  # a seeded row's own, on the model's device
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | cancelled | deadline, once it ended
    text: str = ""                   # the decoded text, cut before a stop string
    sent: str = ""                   # the text already written to its stream
    decoded_from: int = 0            # incremental decoding: the window's first token,
    decoded_to: int = 0              # and the end of what ``text`` holds of it

    @property
    def reserved(self) -> int:
        """Tokens of KV cache it may come to hold: what the worker's budget counts."""
        return len(self.prompt_ids) + self.params.max_new_tokens

    @property
    def context(self) -> list[int]:
        """What a prefill feeds: the prompt, and what it generated before it was preempted
        (its next token comes out of that prefill, as out of a decode step)."""
        return self.prompt_ids + self.generated


@dataclass(eq=False)
class Prefill:
    """Newcomers being prefilled together, a chunk of columns at a time, in a cache of
    their own until they join the running rows."""

    seqs: list[Sequence]
    ids: torch.Tensor        # [rows, width]: the contexts, left-padded
    mask: torch.Tensor       # [rows, width]: 1 on real tokens
    cache: DynamicCache
    done: int = 0            # columns prefilled so far
    chunks: int = 0          # forward passes it took, for logs and tests

    @property
    def left(self) -> int:
        """Tokens still to prefill (columns x rows)."""
        return (self.ids.shape[1] - self.done) * len(self.seqs)


class DecodeBatch:
    """The sequences in flight and their shared cache; one forward pass per step."""

    def __init__(self, model: Any, device: torch.device, pad_id: int) -> None:
        self.model, self.device, self.pad_id = model, device, pad_id
        self.rows: list[Sequence] = []
        self.steps = 0          # decode steps run, for logs and tests
        self.seconds = {"model": 0.0, "sampling": 0.0}  # spent in forward passes, in choosing tokens
        self.slab = Slab(model.config, device)  # the running rows' KV cache, written in place
        self._pos = torch.zeros(0, dtype=torch.long, device=device)  # next position per row
        self._last = torch.zeros(0, dtype=torch.long, device=device)  # last token per row
        self._params: Rows | None = None    # the rows' parameters as tensors, for these rows:
        self._params_of: list[Sequence] = []  # rebuilt when they change
        self.errors: list[Exception] = []  # what the last step's forward passes raised (bisected)

    def __len__(self) -> int:
        return len(self.rows)

    @torch.inference_mode()
    def add(self, seqs: list[Sequence]) -> list[Any]:
        """Prefill newcomers at once and stack them under the running rows; their first tokens."""
        prefill = self.start(seqs)
        tokens = self.advance(prefill, 0)
        assert tokens is not None
        self.join(prefill, tokens)
        return tokens

    def start(self, seqs: list[Sequence]) -> Prefill:
        """Newcomers to prefill (their contexts left-padded to the longest)."""
        contexts = [s.context for s in seqs]
        width = max(len(c) for c in contexts)
        ids = torch.tensor([[self.pad_id] * (width - len(c)) + c for c in contexts], device=self.device)
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts],
                            device=self.device)
        return Prefill(seqs, ids, mask, DynamicCache(config=self.model.config))

    @torch.inference_mode()
    def advance(self, p: Prefill, max_tokens: int) -> list[Any] | None:
        """Prefill the next chunk of ``p``: as many columns as keep it within ``max_tokens``
        tokens (at least one; 0: all the rest). The newcomers' first tokens once their
        contexts are all in (or a row's own error), else None."""
        rows, width = p.ids.shape
        columns = width - p.done if max_tokens <= 0 else max(1, max_tokens // rows)
        end = min(width, p.done + columns)
        positions = (p.mask[:, :end].cumsum(dim=-1) - 1).clamp(min=0)[:, p.done:end]
        started = time.perf_counter()
        out = self.model(input_ids=p.ids[:, p.done:end], attention_mask=p.mask[:, :end],
                         position_ids=positions, past_key_values=p.cache, use_cache=True,
                         logits_to_keep=1)
        self.seconds["model"] += time.perf_counter() - started
        p.cache, p.done, p.chunks = out.past_key_values, end, p.chunks + 1
        if end < width:
            return None
        for s in p.seqs:
            s.generator = s.generator or new_generator(s.params, self.device)
        return self._choose(out.logits[:, -1, :], p.seqs, self._rows_of(p.seqs))

    @torch.inference_mode()
    def join(self, p: Prefill, tokens: list[Any]) -> None:
        """Copy a finished prefill's cache into the running rows' free rows, each row with
        ``tokens``, its next token, to feed."""
        pos, last = torch.cat([self._pos, p.mask.sum(dim=-1)]), torch.cat([self._last, self._feed(tokens)])
        self.slab.add([(layer.keys, layer.values) for layer in p.cache.layers], p.mask)
        self.rows, self._pos, self._last = self.rows + p.seqs, pos, last

    @torch.inference_mode()
    def step(self) -> list[Any]:
        """One decode step of every row: each row's next token, or its own error. A step
        that raises is bisected: each half of the rows steps apart, down to the row that
        raises alone, which gets the error; the others have their token as usual."""
        self.slab.open_column()
        self.errors = []
        if self._params is None or self._params_of != self.rows:  # (by identity: eq=False)
            self._params, self._params_of = self._rows_of(self.rows), list(self.rows)
        tokens = self._step(0, len(self.rows))
        self.slab.close_column()
        self._pos = self._pos + 1
        self._last = self._feed(tokens)
        self.steps += 1
        return tokens

    def _step(self, a: int, b: int) -> list[Any]:
        """Rows [a, b) through the model and the sampler; halves apart if that raises."""
        try:
            started = time.perf_counter()
            out = self.model(input_ids=self._last[a:b, None],
                             attention_mask=self.slab.window(a, b, extra=1),
                             position_ids=self._pos[a:b, None],
                             past_key_values=self.slab.use(a, b), use_cache=True)
            self.seconds["model"] += time.perf_counter() - started
            rows = self._params if (a, b) == (0, len(self.rows)) else self._rows_of(self.rows[a:b])
            return self._choose(out.logits[:, -1, :], self.rows[a:b], rows)
        except Exception as exc:  # the model raised for some row(s): its columns are rewritten
            self.errors.append(exc)
            if b - a == 1:
                return [exc]
            middle = (a + b) // 2
            return self._step(a, middle) + self._step(middle, b)

    def _rows_of(self, seqs: list[Sequence]) -> Rows:
        return Rows.of([s.params for s in seqs], [s.generator for s in seqs],
                       self.model.config.vocab_size, self.device)

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence], rows: Rows) -> list[Any]:
        """Every row's next token (or its own error) in one call on the device; the
        log-probabilities asked for go to their sequences."""
        started = time.perf_counter()
        penalized = rows.any_penalized
        chosen = choose(logits, rows, [s.context for s in seqs] if penalized else None,
                        [s.generated for s in seqs] if penalized else None)
        for i, (mine, top) in chosen.logprobs.items():
            if isinstance(chosen.tokens[i], int):
                seqs[i].logprobs.append((chosen.tokens[i], mine, top))
        self.seconds["sampling"] += time.perf_counter() - started
        return chosen.tokens

    def _feed(self, tokens: list[Any]) -> torch.Tensor:
        """The tokens to feed next (padding for a row that failed: it leaves the batch)."""
        return torch.tensor([t if isinstance(t, int) else self.pad_id for t in tokens],
                            dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def drop(self, leaving: list[Sequence]) -> None:
        """Take rows out of the batch (the last rows move into their places)."""
        ids = {id(s) for s in leaving}
        gone = {i for i, s in enumerate(self.rows) if id(s) in ids}
        if not gone:
            return
        order = self.slab.remove(gone)
        index = torch.tensor(order, dtype=torch.long, device=self.device)
        self.rows = [self.rows[i] for i in order]
        self._pos, self._last = self._pos[index], self._last[index]

    @torch.inference_mode()
    def shrink(self, p: Prefill, leaving: list[Sequence]) -> None:
        """Cut rows out of a prefill under way."""
        gone = {id(s) for s in leaving}
        keep = [i for i, s in enumerate(p.seqs) if id(s) not in gone]
        if len(keep) == len(p.seqs):
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        p.seqs, p.ids, p.mask = [p.seqs[i] for i in keep], p.ids[index], p.mask[index]
        for layer in self._layers(p.cache):
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys, layer.values = layer.keys[index], layer.values[index]

    @staticmethod
    def _layers(cache: DynamicCache | None) -> list[Any]:
        return list(cache.layers) if cache is not None else []
