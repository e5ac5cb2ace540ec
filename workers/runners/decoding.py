"""Iteration-level batching on transformers' DynamicCache: sequences join and leave
between decode steps.

The running sequences share one left-padded KV cache ``[rows, heads, length, dim]`` with
an attention mask marking each row's real tokens, and each row keeps its own position
counter, so padding never shifts a position. Newcomers are prefilled together (a chunk of
columns at a time if the worker asks: a long prompt then does not stall the running rows
for its whole prefill), their cache left-padded to the running one's length (or the other way round) and stacked
under it; finished rows are cut out, and the columns no row needs any more are trimmed
from the left. Compute and memory follow the rows times the longest row, not a paged
cache: what a CPU or one GPU running a small model needs, in about a hundred lines.

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
import torch.nn.functional as F
from transformers import DynamicCache

from batchery.workers.runners.sampling import GenParams, Rows, choose, new_generator


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
        self._params: Rows | None = None    # the rows' parameters as tensors, for these rows:
        self._params_of: list[Sequence] = []  # rebuilt when they change
        self._cache: DynamicCache | None = None
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=device)
        self._pos = torch.zeros(0, dtype=torch.long, device=device)  # next position per row
        self._last = torch.zeros(0, dtype=torch.long, device=device)  # last token per row

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
        """Stack a finished prefill under the running rows (copying the cache), each row
        with ``tokens``, its next token, to feed."""
        self._stack(p.cache, p.mask, p.seqs, p.mask.sum(dim=-1), self._feed(tokens))

    @torch.inference_mode()
    def step(self) -> list[Any]:
        """One decode step of every row: each row's next token, or its own error. A step
        that raises is bisected: each half of the rows steps apart, down to the row that
        raises alone, which gets the error; the others have their token as usual."""
        width = self._mask.shape[1]
        try:
            tokens = self._step()
        except Exception as exc:  # the model or the cache raised for some row(s)
            self._rollback(width)
            if len(self.rows) == 1:
                return [exc]
            tokens = self._bisect()
        self.steps += 1
        return tokens

    def _step(self) -> list[Any]:
        mask = torch.cat([self._mask, self._mask.new_ones(len(self.rows), 1)], dim=-1)
        started = time.perf_counter()
        out = self.model(input_ids=self._last[:, None], attention_mask=mask,
                         position_ids=self._pos[:, None], past_key_values=self._cache,
                         use_cache=True)
        self.seconds["model"] += time.perf_counter() - started
        if self._params is None or self._params_of != self.rows:  # (by identity: eq=False)
            self._params, self._params_of = self._rows_of(self.rows), list(self.rows)
        tokens = self._choose(out.logits[:, -1, :], self.rows, self._params)
        self._cache, self._mask = out.past_key_values, mask
        self._pos = self._pos + 1
        self._last = self._feed(tokens)
        return tokens

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

    def _rollback(self, width: int) -> None:
        """Undo a step that raised midway: the layers it wrote keep their ``width`` columns."""
        for layer in self._layers(self._cache):
            if layer.keys is not None and layer.keys.shape[-2] > width:
                layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]

    def _bisect(self) -> list[Any]:
        """Step each half of the rows apart (recursively, so a row that raises ends up
        alone), then put them back together in their order."""
        half = len(self.rows) // 2
        parts = [self._take(range(half)), self._take(range(half, len(self.rows)))]
        tokens = parts[0].step() + parts[1].step()
        self.rows, self._cache = [], None
        for part in parts:
            self._stack(part._cache, part._mask, part.rows, part._pos, part._last)
        return tokens

    def _take(self, rows: range) -> DecodeBatch:
        """Some rows as a batch of their own (their cache copied)."""
        part = DecodeBatch(self.model, self.device, self.pad_id)
        index = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        part.rows = [self.rows[i] for i in rows]
        part._mask, part._pos, part._last = self._mask[index], self._pos[index], self._last[index]
        part._cache = DynamicCache(config=self.model.config)
        for i, layer in enumerate(self._layers(self._cache)):
            part._cache.update(layer.keys[index], layer.values[index], i)
        return part

    def _feed(self, tokens: list[Any]) -> torch.Tensor:
        """The tokens to feed next (padding for a row that failed: it leaves the batch)."""
        return torch.tensor([t if isinstance(t, int) else self.pad_id for t in tokens],
                            dtype=torch.long, device=self.device)

    def drop(self, leaving: list[Sequence]) -> None:
        """Cut rows out of the batch, and the cache columns that only they needed."""
        gone = {id(s) for s in leaving}
        keep = [i for i, s in enumerate(self.rows) if id(s) not in gone]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self._cache, self._mask = None, self._mask[:0, :0]
            self._pos, self._last = self._pos[:0], self._last[:0]
            return
        index = torch.tensor(keep, device=self.device)
        self._mask, self._pos, self._last = self._mask[index], self._pos[index], self._last[index]
        first = int(self._mask.any(dim=0).int().argmax())  # columns left of it are all padding
        self._mask = self._mask[:, first:]
        for layer in self._layers(self._cache):
            layer.keys = layer.keys[index, :, first:]
            layer.values = layer.values[index, :, first:]

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

    def _stack(self, cache: DynamicCache, mask: torch.Tensor, rows: list[Sequence],
               pos: torch.Tensor, last: torch.Tensor) -> None:
        """Put rows (their cache, mask, next positions and tokens to feed) under the
        running ones. All is built before anything changes: a failure leaves the batch as
        it was."""
        if self._cache is None:
            self._cache, self._mask, self.rows, self._pos, self._last = cache, mask, list(rows), pos, last
            return
        width = max(self._mask.shape[1], mask.shape[1])
        stacked = [(torch.cat([_pad_left(old.keys, width, 2), _pad_left(new.keys, width, 2)]),
                    torch.cat([_pad_left(old.values, width, 2), _pad_left(new.values, width, 2)]))
                   for old, new in zip(self._layers(self._cache), self._layers(cache))]
        joined_mask = torch.cat([_pad_left(self._mask, width, 1), _pad_left(mask, width, 1)])
        joined_pos, joined_last = torch.cat([self._pos, pos]), torch.cat([self._last, last])
        for layer, (keys, values) in zip(self._layers(self._cache), stacked):
            layer.keys, layer.values = keys, values
        self._mask, self._pos, self._last = joined_mask, joined_pos, joined_last
        self.rows = self.rows + list(rows)

    @staticmethod
    def _layers(cache: DynamicCache | None) -> list[Any]:
        return list(cache.layers) if cache is not None else []


def _pad_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Zeros before ``tensor`` along ``dim`` up to ``width``."""
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    pad = [0, 0] * (tensor.dim() - 1 - dim) + [missing, 0]
    return F.pad(tensor, pad)
