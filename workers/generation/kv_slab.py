"""The running rows' KV cache, written in place: one preallocated buffer per layer.

Each layer's keys and values live in ``[row capacity, heads, column capacity, head dim]``
buffers; the batch is rows ``[0, n)`` and the live window of columns ``[start, end)``,
left-padded (each row's real tokens end at ``end``; a mask buffer of the same shape marks
them). A decode step writes one column (``end``) for every row, in place; a newcomer is
copied into the next free row (only its own cache is copied, not the others'); a row that
leaves is replaced by the last row (one row copied); columns no row needs any more are let
go by moving ``start``. The buffers grow (doubling) only when a join or a step finds no
room, so copying the whole cache is the rare case, not every step as with a cache grown by
``torch.cat`` (transformers' DynamicCache).

The model sees an ordinary transformers ``DynamicCache`` whose layers (``SlabLayer``) write
into the buffers and hand back views of the window: any model that takes a DynamicCache
takes this one. ``span`` picks the rows a forward pass reads and writes, so that a step can
run over part of the batch (the bisection that finds a row that makes a step raise).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class SlabLayer(DynamicLayer):
    """One layer's view of the slab, as transformers' attention calls it."""

    def __init__(self, slab: Slab, index: int) -> None:
        super().__init__()
        self.slab, self.index, self.is_initialized = slab, index, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.slab
        (a, b), q = s.span, key_states.shape[-2]
        keys, values = s.keys[self.index], s.values[self.index]
        keys[a:b, :, s.end:s.end + q] = key_states
        values[a:b, :, s.end:s.end + q] = value_states
        self.keys, self.values = keys[a:b, :, s.start:s.end + q], values[a:b, :, s.start:s.end + q]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.slab.end - self.slab.start


class Slab:
    """Preallocated KV buffers for the running rows (see the module's docstring)."""

    def __init__(self, config: Any, device: torch.device) -> None:
        self.config, self.device = config, device
        self.keys: list[torch.Tensor] = []    # per layer [row_cap, heads, col_cap, dim]
        self.values: list[torch.Tensor] = []
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)  # [row_cap, col_cap]
        self.n = self.start = self.end = 0
        self.span = (0, 0)                    # rows the next forward pass reads and writes
        self.cache = DynamicCache(config=config)
        self.copies = 0                       # whole-buffer copies (growth), for tests and logs

    @property
    def width(self) -> int:
        return self.end - self.start

    def window(self, a: int, b: int, extra: int = 0) -> torch.Tensor:
        """Rows [a, b)'s mask over the window (and ``extra`` columns past it)."""
        return self.mask[a:b, self.start:self.end + extra]

    def open_column(self) -> None:
        """Make room for one more column and mark it on every row: the step's new token."""
        self._reserve(self.n, 0, 1)
        self.mask[:self.n, self.end] = 1

    def close_column(self) -> None:
        self.end += 1

    def use(self, a: int, b: int) -> DynamicCache:
        """The cache for a forward pass over rows [a, b)."""
        self.span = (a, b)
        return self.cache

    def add(self, layers: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> None:
        """Copy newcomers (their prefill's keys and values per layer, [m, heads, w, dim], and
        mask [m, w]) into the next free rows, right-aligned with the running ones."""
        m, w = mask.shape
        if not self.keys:
            self._allocate(layers, m, w)
        if self.n == 0 and w < self.mask.shape[1]:  # an empty batch: start anywhere
            self.start = self.end = w
        grow = max(0, w - self.width)
        self._reserve(self.n + m, grow, 1)
        if grow:  # the running rows' new columns on the left are padding
            self.start -= grow
            self._clear(0, self.n, self.start, self.start + grow)
        rows = slice(self.n, self.n + m)
        self._clear(rows.start, rows.stop, self.start, self.end - w)
        for (k, v), keys, values in zip(layers, self.keys, self.values):
            keys[rows, :, self.end - w:self.end] = k
            values[rows, :, self.end - w:self.end] = v
        self.mask[rows, self.end - w:self.end] = mask
        self.n += m

    def remove(self, gone: set[int]) -> list[int]:
        """Take rows out, each replaced by the last row still in: the new order (row j is the
        old row ``order[j]``). Columns no row needs any more are let go."""
        order = list(range(self.n))
        for i in sorted(gone, reverse=True):
            order[i] = order[-1]
            order.pop()
        moved = [j for j, i in enumerate(order) if i != j]
        if moved:
            to = torch.tensor(moved, device=self.device)
            src = torch.tensor([order[j] for j in moved], device=self.device)
            for buffer in (*self.keys, *self.values):
                buffer[to, :, self.start:self.end] = buffer[src, :, self.start:self.end]
            self.mask[to, self.start:self.end] = self.mask[src, self.start:self.end]
        self.n = len(order)
        if self.n:
            self.start += int(self.window(0, self.n).any(dim=0).int().argmax())
        else:
            self.start = self.end
        return order

    def _allocate(self, layers: list[tuple[torch.Tensor, torch.Tensor]], rows: int, width: int) -> None:
        _, heads, _, dim = layers[0][0].shape
        cols = 2 * max(width, 64)
        self.keys = [torch.zeros(rows, heads, cols, dim, dtype=k.dtype, device=self.device)
                     for k, _ in layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.mask = torch.zeros(rows, cols, dtype=torch.long, device=self.device)
        self.start = self.end = width
        self.cache.layers = [SlabLayer(self, i) for i in range(len(layers))]

    def _reserve(self, rows: int, left: int, right: int) -> None:
        """Room for ``rows`` rows, ``left`` columns before the window and ``right`` after
        it: new buffers (twice the need) when there is not, the window copied over."""
        row_cap, col_cap = self.mask.shape
        if rows <= row_cap and left <= self.start and self.end + right <= col_cap:
            return
        need = self.width + left + right
        row_cap, col_cap = max(row_cap, 2 * rows if rows > row_cap else row_cap), max(col_cap, 2 * need)
        start = left + (col_cap - need) // 4  # most of the spare room ahead, where steps write
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = old.new_zeros(row_cap, old.shape[1], col_cap, old.shape[3])
                new[:self.n, :, start:start + self.width] = old[:self.n, :, self.start:self.end]
                buffers[i] = new
        mask = self.mask.new_zeros(row_cap, col_cap)
        mask[:self.n, start:start + self.width] = self.mask[:self.n, self.start:self.end]
        self.mask, self.start, self.end = mask, start, start + self.width
        self.copies += 1

    def _clear(self, a: int, b: int, left: int, right: int) -> None:
        """Zero rows [a, b) between columns [left, right): padding, whatever was there."""
        if a < b and left < right:
            for buffer in (*self.keys, *self.values):
                buffer[a:b, :, left:right] = 0
            self.mask[a:b, left:right] = 0
