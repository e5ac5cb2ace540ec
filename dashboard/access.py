"""Who may read the dashboard and who may press its buttons.

Reads need the token unless the dashboard listens on loopback only; then the Host header
must be a loopback name too, so a web page cannot reach it through DNS rebinding. Every
button (a POST) needs the token in a header, which a page of another origin cannot send:
the cookie a browser keeps after ``?token=`` lets it read, never act.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from typing import Any

from batchery.config import ENV_DASHBOARD_TOKEN
from batchery.errors import ConfigError
from batchery.listening import is_loopback

ENV_TOKEN = ENV_DASHBOARD_TOKEN
MIN_TOKEN_CHARS = 16         # a token guards retry, purge and cancel: not a short password
COOKIE = "batchery_dashboard_token"
HEADER = "x-batchery-token"
NO_TOKEN_HINT = ("open the dashboard with the URL `batchery dashboard` printed (it ends in "
                 "?token=...) to use the buttons")


@dataclass(frozen=True)
class Access:
    """Who may read and who may act."""

    token: str
    loopback: bool   # listening on loopback only: reads need no token

    def matches(self, presented: str | None) -> bool:
        return presented is not None and presented != "" and hmac.compare_digest(
            presented.encode(), self.token.encode())

    def may_act(self, request: Any) -> bool:
        """A header only: a cookie rides along with requests other sites make."""
        bearer = request.headers.get("authorization", "")
        return self.matches(request.headers.get(HEADER)) or (
            bearer.lower().startswith("bearer ") and self.matches(bearer[7:].strip()))

    def may_read(self, request: Any) -> bool:
        return (self.loopback or self.may_act(request) or self.matches(request.cookies.get(COOKIE))
                or self.matches(request.query_params.get("token")))

    def host_allowed(self, request: Any) -> bool:
        if not self.loopback:
            return True
        host = request.headers.get("host", "")
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        return is_loopback(name)


def check_token(host: str, token: str | None) -> tuple[str, bool]:
    """The token to require, and whether it was made up here (no --token on loopback)."""
    if token is None or token == "":
        if not is_loopback(host):
            raise ConfigError(
                f"refusing to serve on {host} without a token: anyone who reaches it could "
                "read the queues, retry, purge and cancel. Pass --token TOKEN (or set "
                f"{ENV_TOKEN}), e.g. {ENV_TOKEN}=$(python -c 'import secrets; "
                "print(secrets.token_urlsafe())'), or keep the default --host 127.0.0.1")
        return secrets.token_urlsafe(18), True
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ConfigError(f"--token must be at least {MIN_TOKEN_CHARS} characters without "
                          f"spaces (got {len(token)}); e.g. python -c 'import secrets; "
                          "print(secrets.token_urlsafe())'")
    return token, False
