"""batchery: run PyTorch models over prioritized requests in batches, backed by Redis."""

from __future__ import annotations

from batchery.batching.messages import Result
from batchery.errors import (BatcheryError, ConfigError, InvalidRequest, JobNotFound,
                             QueueFull, RequestLost, RequestTooLarge, ResultTimeout)
from batchery.producer.aio import AsyncClient, AsyncHandle
from batchery.producer.client import Client, Handle

__version__ = "0.1.0"  # the one place: setup.cfg reads it
__all__ = ["AsyncClient", "AsyncHandle", "BatcheryError", "Client", "ConfigError", "Handle",
           "InvalidRequest", "JobNotFound", "QueueFull", "RequestLost", "RequestTooLarge", "Result",
           "ResultTimeout", "__version__"]
