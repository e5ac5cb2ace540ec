"""API keys: who may call the gateway, as which tenant, on which queues (models).

Keys come from a file (``--keys-file``) and from the environment (BATCHERY_API_KEYS),
one entry per line (``;`` also separates entries in the variable)::

    # KEY                TENANT   QUEUES (comma-separated, * or nothing for all)
    sk-team-a-0123456789 team-a   embed,chat
    sk-ops-9876543210    ops      *

A request sends its key as ``Authorization: Bearer KEY`` (what the openai SDK does with
``api_key``). Without keys the gateway serves anyone who reaches it, so it listens on
loopback only (batchery/gateway/cli.py) and answers only to loopback host names, so a
web page cannot reach it through DNS rebinding.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from batchery.listening import is_loopback
from batchery.errors import ConfigError
from batchery.gateway.errors import ApiError

MIN_KEY_CHARS = 16   # a key guards queues and files: not a short password


@dataclass(frozen=True)
class Principal:
    """Who is calling: their tenant (None without keys) and the queues they may use."""

    tenant: str | None
    queues: frozenset[str] | None   # None: every queue

    def may_use(self, queue: str) -> bool:
        return self.queues is None or queue in self.queues

    def check(self, queue: str) -> None:
        if not self.may_use(queue):
            raise ApiError(403, f"this API key may not use the model {queue!r}; its tenant "
                           f"{self.tenant!r} may use: {', '.join(sorted(self.queues or ()))}",
                           "permission_error", "model", "model_not_allowed")


ANYONE = Principal(None, None)


class Keys:
    """The configured keys, held by their SHA-256 (a lookup leaks no key's prefix)."""

    def __init__(self, entries: dict[str, Principal]) -> None:
        self._by_digest = {_digest(k): p for k, p in entries.items()}

    @classmethod
    def load(cls, path: str | None, text: str | None) -> "Keys":
        """Keys from the file at ``path`` and the variable's ``text``; raises ConfigError."""
        entries: dict[str, Principal] = {}
        sources = []
        if path:
            try:
                sources.append((path, Path(path).read_text()))
            except OSError as exc:
                raise ConfigError(f"cannot read the keys file {path}: {exc.strerror or exc}") from None
        if text:
            sources.append(("BATCHERY_API_KEYS", text.replace(";", "\n")))
        for where, content in sources:
            for number, line in enumerate(content.splitlines(), 1):
                line = line.split("#", 1)[0].strip()
                if line:
                    key, principal = _entry(line, f"{where}, line {number}")
                    entries[key] = principal
        return cls(entries)

    @property
    def configured(self) -> bool:
        return bool(self._by_digest)

    def __len__(self) -> int:
        return len(self._by_digest)

    def authorize(self, authorization: str | None, host: str | None) -> Principal:
        """The caller of a request with these headers; raises ApiError 401 (or 403 for a
        non-loopback Host while no keys are configured)."""
        if not self._by_digest:
            name = (host or "").rsplit(":", 1)[0] if not (host or "").endswith("]") else host
            if not is_loopback(name or ""):
                raise ApiError(403, "this gateway has no API keys, so it answers to loopback "
                               "host names only (127.0.0.1, localhost)", "permission_error")
            return ANYONE
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, "no API key: send the header Authorization: Bearer KEY (the "
                           "openai SDK's api_key)", code="invalid_api_key")
        found = self._by_digest.get(_digest(key.strip()))
        if found is None:
            raise ApiError(401, "incorrect API key provided", code="invalid_api_key")
        return found


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _entry(line: str, where: str) -> tuple[str, Principal]:
    parts = line.split()
    if len(parts) not in (2, 3):
        raise ConfigError(f"{where}: expected `KEY TENANT [QUEUE,QUEUE|*]`, got {len(parts)} "
                          "field(s)")
    key, tenant = parts[0], parts[1]
    if len(key) < MIN_KEY_CHARS:
        raise ConfigError(f"{where}: a key must be at least {MIN_KEY_CHARS} characters (got "
                          f"{len(key)}); e.g. python -c 'import secrets; print(\"sk-\" + "
                          "secrets.token_urlsafe())'")
    listed = parts[2] if len(parts) == 3 else "*"
    queues = None if listed == "*" else frozenset(q for q in listed.split(",") if q)
    return key, Principal(tenant, queues)

