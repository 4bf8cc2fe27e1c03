"""The cluster page's logins and sessions: one-time login codes, session cookies, expiry, CSRF.

Pure bookkeeping, no I/O: the caller passes `now` (trio's clock) and does the HTTP.

How a browser gets in without ever holding the admin credential:

1. Whoever holds the credential (`llmgw ctl page`, or `llmgw up` in-process) mints a login
   code: random, remembered here by its hash, good for `LOGIN_CODE_TTL_S` and for one use.
2. The browser opens `/login?code=...`; the code is consumed and a session made: a random
   cookie value (remembered by its hash too, so neither a log nor a memory dump of this table
   gives one away), a public id for the audit log, a CSRF token, and an absolute expiry.
3. Each admin API call from the page carries the cookie (HttpOnly, SameSite=Strict); a call
   that changes something must also carry the session's CSRF token in a header — which only
   the page, reading it from the session endpoint over same-origin fetch, can know.

A session is read-only unless the code was minted with actions allowed. Sessions live in
memory: a restarted control plane has none, and the operator asks for a new URL. Both tables
are bounded; past the bound the oldest entry goes.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import attrs

LOGIN_CODE_TTL_S = 15 * 60.0  # long enough to copy a URL out of `up`'s output, short enough to not linger
SESSION_TTL_S = 12 * 3600.0  # a working day; then the operator asks for a new URL
MAX_CODES = 64
MAX_SESSIONS = 256
COOKIE = "llmgw_session"
CSRF_HEADER = "x-llmgw-csrf"


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


@attrs.frozen(kw_only=True)
class _Code:
    expires_at: float
    can_act: bool


@attrs.frozen(kw_only=True)
class PageSession:
    """One browser's login to the cluster page, opened by a login code; its cookie is the key."""

    id: str  # public: in the audit log and the page; never lets anyone in
    csrf: str
    can_act: bool
    created_at: float
    expires_at: float


@attrs.frozen(kw_only=True)
class Login:
    cookie: str  # the cookie value: the only copy outside this table's hashes
    session: PageSession


class LoginRefused(Exception):
    """A login code that is unknown, used already or expired; the message says what to do."""


class SessionBook:
    def __init__(self, *, code_ttl_s: float = LOGIN_CODE_TTL_S, session_ttl_s: float = SESSION_TTL_S) -> None:
        self.code_ttl_s = code_ttl_s
        self.session_ttl_s = session_ttl_s
        self._codes: dict[bytes, _Code] = {}  # by hash of the code
        self._sessions: dict[bytes, PageSession] = {}  # by hash of the cookie value

    def mint_code(self, now: float, *, can_act: bool = False) -> str:
        self._expire(now)
        while len(self._codes) >= MAX_CODES:
            del self._codes[next(iter(self._codes))]  # dicts keep insertion order: the oldest
        code = secrets.token_urlsafe(24)
        self._codes[_digest(code)] = _Code(expires_at=now + self.code_ttl_s, can_act=can_act)
        return code

    def redeem(self, code: str, now: float) -> Login:
        """Consume `code` (whatever happens next it cannot be used again) and open a session."""
        self._expire(now)
        found = self._codes.pop(_digest(code), None)
        if found is None:
            raise LoginRefused(
                "this login link is unknown, was used already, or expired (a link works once, for "
                f"{self.code_ttl_s / 60:g} minutes); run `llmgw ctl page` for a new one"
            )
        while len(self._sessions) >= MAX_SESSIONS:
            del self._sessions[next(iter(self._sessions))]
        cookie = secrets.token_urlsafe(32)
        session = PageSession(
            id="s-" + secrets.token_hex(4),
            csrf=secrets.token_urlsafe(24),
            can_act=found.can_act,
            created_at=now,
            expires_at=now + self.session_ttl_s,
        )
        self._sessions[_digest(cookie)] = session
        return Login(cookie=cookie, session=session)

    def lookup(self, cookie: str, now: float) -> PageSession | None:
        """The live session this cookie value opens, or None (unknown, or expired)."""
        session = self._sessions.get(_digest(cookie))
        if session is None:
            return None
        if now >= session.expires_at:
            del self._sessions[_digest(cookie)]
            return None
        return session

    def end(self, cookie: str) -> PageSession | None:
        return self._sessions.pop(_digest(cookie), None)

    def _expire(self, now: float) -> None:
        for key in [k for k, c in self._codes.items() if now >= c.expires_at]:
            del self._codes[key]
        for key in [k for k, s in self._sessions.items() if now >= s.expires_at]:
            del self._sessions[key]

    def __len__(self) -> int:
        return len(self._sessions)


def csrf_ok(session: PageSession, given: str) -> bool:
    return bool(given) and hmac.compare_digest(given.encode(), session.csrf.encode())


def cookie_value(header: str, name: str = COOKIE) -> str:
    """The value of cookie `name` in a Cookie header (RFC 6265 §5.4: `a=1; b=2`), or ""."""
    for part in header.split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key == name:
            return value.strip()
    return ""


def set_cookie(value: str, max_age_s: float) -> str:
    # HttpOnly: the page's scripts never see it. SameSite=Strict: no other site's page makes the
    # browser send it. Path=/: the page and the admin API. No Secure: the admin URL is plain HTTP
    # on a trusted network (docs/security.md); a TLS-terminating proxy in front may add it.
    return f"{COOKIE}={value}; HttpOnly; SameSite=Strict; Path=/; Max-Age={max(0, round(max_age_s))}"


def clear_cookie() -> str:
    return f"{COOKIE}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0"
