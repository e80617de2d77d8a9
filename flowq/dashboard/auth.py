"""Who may see the dashboard and who may change things: a token or basic auth, and CSRF.

- **Authentication** (`Guard.authenticated`) is required on every request once a token or
  basic auth is configured (with `allow_actions` one of them must be). A token is accepted
  as `Authorization: Bearer <token>`, or once through the login form (or `?token=` on any
  page, as the URL `flowq dashboard` prints), after which an HttpOnly, SameSite=Strict
  session cookie carries its time of issue, a random session id and an HMAC of them and the
  token (a key drawn per process). The session lives on the server, in this process
  (`Sessions`: at most `MAX_SESSIONS`, the oldest dropped first, expired ones pruned): it
  ends after `SESSION_MAX_AGE`, at `POST /logout` (a copy of the cookie is then refused
  too), and for everyone when the dashboard restarts or its token changes (which takes a
  restart). Basic auth is the browser's own prompt. Comparisons are constant-time.
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
import threading
import time
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

from starlette.requests import Request

from flowq.errors import ConfigurationError

__all__ = ["CSRF_COOKIE", "MAX_SESSIONS", "SESSION_COOKIE", "Guard", "Sessions",
           "parse_basic_auth"]

SESSION_COOKIE: Final = "flowq_session"
# How long a token login lasts (seconds).
SESSION_MAX_AGE: Final = 12 * 3600
CSRF_COOKIE: Final = "flowq_csrf"
# How many token logins one dashboard process keeps at once: past it, a new login ends the
# oldest session (only a holder of the token can log in, so this bounds memory, not access).
MAX_SESSIONS: Final = 1000


def parse_basic_auth(text: str) -> tuple[str, str]:
    """`USER:PASSWORD` (the password may hold colons) for basic auth."""
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise ConfigurationError("basic auth is USER:PASSWORD, both non-empty")
    return user, password


def _equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


class Sessions:
    """The live token logins of this process: session id -> expiry (`time.time()`), at most
    `limit`, the oldest dropped first. Kept in memory: a dashboard restart ends them all."""

    def __init__(self, limit: int = MAX_SESSIONS) -> None:
        self.limit = limit
        self._expiry: dict[str, float] = {}  # in order of issue
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._expiry)

    def start(self, expires: float) -> str:
        """A new session id, live until `expires`."""
        sid = secrets.token_urlsafe(24)
        with self._lock:
            self._prune(time.time())
            while len(self._expiry) >= self.limit:
                del self._expiry[next(iter(self._expiry))]
            self._expiry[sid] = expires
        return sid

    def live(self, sid: str) -> bool:
        with self._lock:
            expires = self._expiry.get(sid)
            return expires is not None and time.time() < expires

    def end(self, sid: str) -> None:
        with self._lock:
            self._expiry.pop(sid, None)

    def _prune(self, now: float) -> None:
        # Issued in order with one lifetime, so expired ones lead; stop at the first live one.
        while self._expiry:
            sid = next(iter(self._expiry))
            if self._expiry[sid] > now:
                return
            del self._expiry[sid]


@dataclass(frozen=True)
class Guard:
    """The dashboard's credentials; `required` when any is set."""

    token: str | None = None
    basic_auth: tuple[str, str] | None = None
    _key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    _sessions: Sessions = field(default_factory=Sessions, repr=False, compare=False)

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
    def live_sessions(self) -> int:
        """How many token logins this process holds (at most `MAX_SESSIONS`)."""
        return len(self._sessions)

    @property
    def required(self) -> bool:
        return self.token is not None or self.basic_auth is not None

    def _mac(self, issued: int, sid: str) -> str:
        assert self.token is not None
        return hmac.new(self._key, f"{self.token}\n{issued}\n{sid}".encode(),
                        hashlib.sha256).hexdigest()

    def session_value(self) -> str:
        """A new token login: the session cookie's value, `issued.SID.HMAC(token, issued,
        SID)`, its session id live on the server until it expires or is ended."""
        issued = int(time.time())
        sid = self._sessions.start(issued + SESSION_MAX_AGE)
        return f"{issued}.{sid}.{self._mac(issued, sid)}"

    def _session_id(self, cookie: str) -> str | None:
        """The session id of a cookie this process issued, for the current token, not yet
        expired (whether or not the session is still live)."""
        issued_text, _, rest = cookie.partition(".")
        sid, _, mac = rest.partition(".")
        if self.token is None or not (issued_text.isascii() and issued_text.isdigit()):
            return None
        issued = int(issued_text[:12])
        if not 0 <= time.time() - issued < SESSION_MAX_AGE:
            return None
        return sid if _equal(mac, self._mac(issued, sid)) else None

    def session_ok(self, cookie: str) -> bool:
        """A session cookie this process issued, for the current token, whose session is
        live (not expired, not logged out)."""
        sid = self._session_id(cookie)
        return sid is not None and self._sessions.live(sid)

    def end_session(self, cookie: str | None) -> None:
        """Log out: the session of `cookie` ends on the server (any copy is refused)."""
        sid = None if cookie is None else self._session_id(cookie)
        if sid is not None:
            self._sessions.end(sid)

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
