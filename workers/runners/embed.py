"""``--task embed``: mean-pooled, L2-normalised sentence embeddings.

Matches sentence-transformers' ``encode(normalize_embeddings=True)`` for models such as
all-MiniLM-L6-v2: same truncation (``max_seq_length``), mean over real tokens, unit norm.
"""

from __future__ import annotations

from typing import Any

import torch

from batchery.workers.runners.hf import HFRunner, to_device

DECIMALS = 8  # rounding keeps results half as long in JSON; float32 noise is larger than 1e-8


class EmbedRunner(HFRunner):
    @torch.inference_mode()
    def run(self, data: Any) -> list[Any]:
        encoded = to_device(data, self.device)
        hidden = self._model(**encoded).last_hidden_state
        mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        unit = torch.nn.functional.normalize(pooled.float(), p=2, dim=1)
        return torch.round(unit.double(), decimals=DECIMALS).cpu().tolist()
