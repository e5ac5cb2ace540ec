"""Model runners: built-in tasks over Hugging Face models, or a user's factory."""

from __future__ import annotations

from batchery.errors import ConfigError
from batchery.workers.runners.base import InputError, Prepared, Runner

TASKS = ("embed", "classify", "generate")

__all__ = ["InputError", "Prepared", "Runner", "TASKS", "load_runner"]


def load_runner(task: str | None, model: str | None, runner: str | None, device: str = "auto",
                allow_download: bool = False, dtype: str = "auto") -> Runner:
    """The runner a worker was asked for; raises ConfigError with what to change."""
    if runner:
        from batchery.workers.runners.custom import load_factory
        return load_factory(runner)
    if task not in TASKS:
        raise ConfigError(f"--task must be one of {', '.join(TASKS)} (or pass --runner "
                          f"module:factory), got {task!r}")
    if not model:
        raise ConfigError(f"--task {task} needs --model (a directory, a cached hub id, or minilm)")
    try:
        from batchery.workers.runners.hf import pick_device, pick_dtype, resolve_model
    except ImportError:
        raise ConfigError("the worker needs torch and transformers: "
                          "pip install 'batchery[worker]'") from None
    model_dir, torch_device = resolve_model(model, allow_download), pick_device(device)
    torch_dtype = pick_dtype(dtype, torch_device)
    if task == "embed":
        from batchery.workers.runners.embed import EmbedRunner
        return EmbedRunner(model_dir, torch_device, torch_dtype)
    if task == "classify":
        from batchery.workers.runners.classify import ClassifyRunner
        return ClassifyRunner(model_dir, torch_device, torch_dtype)
    from batchery.workers.generation.runner import GenerateRunner
    return GenerateRunner(model_dir, torch_device, torch_dtype)
