"""Process configuration: environment variable names, the Redis URL and where local
state lives. Queue-wide settings (stored in Redis) are batching/settings.py's.

Configuration flows environment -> click option -> the dataclasses. Every option of
every command also reads ``BATCHERY_<OPTION>`` (``--max-batch-size``:
``BATCHERY_MAX_BATCH_SIZE``); the names below are the ones that differ from that rule or
that code reads directly.
"""

from __future__ import annotations

import os
from pathlib import Path

from batchery.errors import ConfigError

ENV_PREFIX = "BATCHERY"  # BATCHERY_<OPTION> for every option (batchery/cli_shared.py)
ENV_REDIS_URL = "BATCHERY_REDIS_URL"
ENV_REDIS_URL_FALLBACK = "REDIS_URL"  # what Heroku-style Redis add-ons set
ENV_NO_EMBEDDED = "BATCHERY_NO_EMBEDDED"  # 1: a missing Redis URL is an error
ENV_HOME = "BATCHERY_HOME"
ENV_QUEUE = "BATCHERY_QUEUE"
ENV_LOG_LEVEL = "BATCHERY_LOG_LEVEL"
ENV_TORCH_THREADS = "BATCHERY_TORCH_THREADS"  # worker --threads
ENV_DASHBOARD_HOST = "BATCHERY_DASHBOARD_HOST"  # dashboard --host, --port, --token
ENV_DASHBOARD_PORT = "BATCHERY_DASHBOARD_PORT"
ENV_DASHBOARD_TOKEN = "BATCHERY_DASHBOARD_TOKEN"
ENV_API_KEYS = "BATCHERY_API_KEYS"  # serve: the gateway's keys, read here (never on a command line)

CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "QUOTA PERIOD", or "max PERIOD"
CGROUP_V1_CPU = "/sys/fs/cgroup/cpu"  # cgroup v1: cpu.cfs_quota_us (-1: none), cpu.cfs_period_us

DEFAULT_QUEUE = "default"
JOBS_QUEUE = "batchery"  # the RQ queue offline jobs wait in; `rq info` lists it
EMBEDDED = "embedded"  # the redis URL meaning "start or reuse batchery's private server"


def state_dir() -> Path:
    """Where the embedded Redis keeps its socket, AOF and log."""
    if os.environ.get(ENV_HOME):
        return Path(os.environ[ENV_HOME]).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "batchery"


def redis_url_from_env(url: str | None) -> str:
    """The URL given, else BATCHERY_REDIS_URL, else REDIS_URL, else the embedded server,
    except where deployed: a pod that quietly started a private Redis would serve a
    queue nobody else sees, so there a missing URL is an error."""
    chosen = url or os.environ.get(ENV_REDIS_URL) or os.environ.get(ENV_REDIS_URL_FALLBACK)
    if chosen:
        return chosen
    if deployed():
        raise ConfigError(f"no Redis URL: set {ENV_REDIS_URL} (or {ENV_REDIS_URL_FALLBACK}) to "
                          "the fleet's Redis, e.g. redis://redis:6379/0; in a Kubernetes pod "
                          "or batchery's image the private embedded server starts only when "
                          f"asked for, with --redis-url {EMBEDDED}")
    return EMBEDDED


def deployed() -> bool:
    """In a Kubernetes pod, or in batchery's image (it sets BATCHERY_NO_EMBEDDED=1): no
    laptop defaults there. (Docker's own marker file is not used: dev containers have it.)"""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) or os.environ.get(
        ENV_NO_EMBEDDED, "") not in ("", "0")


def usable_cpus() -> int:
    """CPUs this process may use: its affinity, capped by its cgroup's CPU limit (in a
    container with a 2-CPU limit on a 64-core node, 2, not 64)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit = _cgroup_cpu_limit()
    return min(n, max(1, int(limit))) if limit else n


def _cgroup_cpu_limit() -> float | None:
    """CPUs this process's cgroup (v2, else v1) may use, or None where none is set."""
    try:
        quota, period = Path(CGROUP_CPU_MAX).read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):  # no cgroup v2 limit file here: try v1
        pass
    try:
        quota = int(Path(CGROUP_V1_CPU, "cpu.cfs_quota_us").read_text())
        period = int(Path(CGROUP_V1_CPU, "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None
