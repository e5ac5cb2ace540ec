"""``--task classify``: sequence classification, the top label and every label's score."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForSequenceClassification

from batchery.workers.runners.hf import HFRunner, to_device


class ClassifyRunner(HFRunner):
    model_class = AutoModelForSequenceClassification

    def __init__(self, model_dir: str, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(model_dir, device, dtype)
        config = self._model.config
        self._labels = [config.id2label[i] for i in range(config.num_labels)]
        self._multi_label = config.problem_type == "multi_label_classification"

    @torch.inference_mode()
    def run(self, data: Any) -> list[Any]:
        logits = self._model(**to_device(data, self.device)).logits.float()
        scores = torch.sigmoid(logits) if self._multi_label else torch.softmax(logits, dim=-1)
        outputs = []
        for row in scores.cpu().tolist():
            best = max(range(len(row)), key=row.__getitem__)
            outputs.append({"label": self._labels[best],
                            "scores": {label: round(s, 6) for label, s in zip(self._labels, row)}})
        return outputs
