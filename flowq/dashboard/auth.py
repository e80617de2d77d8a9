"""Who may see the dashboard and who may change things: a token or basic auth, and CSRF.

- **Authentication** (`Guard.authenticated`) is required on every request once a token or
  basic auth is configured (with `allow_actions` one of them must be). A token is accepted
  as `Authorization: Bearer <token>`, or once through the login form (or `?token=` on any
  page, as the URL `flowq dashboard` prints), after which an HttpOnly, SameSite=Strict
  session cookie carries its time of issue and an HMAC of both (a key drawn per process: a
  restart logs everyone out); it expires after `SESSION_MAX_AGE`, and `POST /logout` ends it. Basic auth is the browser's own prompt. Comparisons are constant-time.
- **CSRF** (`Guard.csrf_ok`): a double-submit token. Every page sets a random `flowq_csrf`
  cookie (SameSite=Strict) and puts the same value in each form; a POST must carry both,
  equal, and an `Origin` header, when the browser sends one, naming this host. A page on
  another site can neither read the cookie nor set the field.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

from starlette.requests import Request

from flowq.errors import ConfigurationError

__all__ = ["CSRF_COOKIE", "SESSION_COOKIE", "Guard", "parse_basic_auth"]

SESSION_COOKIE: Final = "flowq_session"
# How long a token login lasts (seconds).
SESSION_MAX_AGE: Final = 12 * 3600
CSRF_COOKIE: Final = "flowq_csrf"


def parse_basic_auth(text: str) -> tuple[str, str]:
    """`USER:PASSWORD` (the password may hold colons) for basic auth."""
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise ConfigurationError("basic auth is USER:PASSWORD, both non-empty")
    return user, password


def _equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


@dataclass(frozen=True)
class Guard:
    """The dashboard's credentials; `required` when any is set."""

    token: str | None = None
    basic_auth: tuple[str, str] | None = None
    _key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

    def __post_init__(self) -> None:
        if self.token is not None and (not isinstance(self.token, str) or len(self.token) < 8):
            raise ConfigurationError("a dashboard token must be at least 8 characters long")
        if self.basic_auth is not None:
            user, password = self.basic_auth
            if not (isinstance(user, str) and isinstance(password, str) and user and password
                    and ":" not in user):
                raise ConfigurationError("basic auth needs a user name (without ':') and a "
                                         "password, both non-empty")

    @property
    def required(self) -> bool:
        return self.token is not None or self.basic_auth is not None

    def session_value(self, issued: int | None = None) -> str:
        """What the session cookie holds after a token login: `issued.HMAC(token, issued)`."""
        assert self.token is not None
        issued = int(time.time()) if issued is None else issued
        mac = hmac.new(self._key, f"{self.token}\n{issued}".encode(), hashlib.sha256)
        return f"{issued}.{mac.hexdigest()}"

    def session_ok(self, cookie: str) -> bool:
        """A session cookie this process issued, for the current token, not yet expired."""
        issued_text, _, _ = cookie.partition(".")
        if self.token is None or not (issued_text.isascii() and issued_text.isdigit()):
            return False
        issued = int(issued_text[:12])
        if not 0 <= time.time() - issued < SESSION_MAX_AGE:
            return False
        return _equal(cookie, self.session_value(issued))

    def token_ok(self, candidate: str) -> bool:
        return self.token is not None and _equal(candidate, self.token)

    def authenticated(self, request: Request) -> bool:
        if not self.required:
            return True
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "bearer" and self.token_ok(value.strip()):
            return True
        if scheme.lower() == "basic" and self.basic_auth is not None:
            try:
                decoded = base64.b64decode(value.strip(), validate=True).decode()
            except (binascii.Error, UnicodeDecodeError):
                return False
            user, _, password = decoded.partition(":")
            # Both compared, always: the time does not tell which one was wrong.
            return _equal(user, self.basic_auth[0]) & _equal(password, self.basic_auth[1])
        cookie = request.cookies.get(SESSION_COOKIE)
        return cookie is not None and self.session_ok(cookie)

    @staticmethod
    def csrf_ok(request: Request, submitted: str | None) -> bool:
        cookie = request.cookies.get(CSRF_COOKIE)
        if not cookie or not submitted or not _equal(cookie, submitted):
            return False
        origin = request.headers.get("origin")
        if origin is None or origin == "null":
            return origin is None
        host = request.headers.get("host", "")
        return urlsplit(origin).netloc == host
