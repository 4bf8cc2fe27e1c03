"""What a test arms on testlib.hubserver, and what the server records for its assertions.

A fault names a file by its path in the repo (any repo, or only `repo=`) or by its sha256, and
fires `times` times (None: every time), on the requests that send that file's bytes: the
resolve GET of a small file, the CDN GET of an LFS one. `fail` can also hit the resolve HEAD or
the redirect (`where`). Faults are taken under one lock, so two concurrent downloads never both
consume a fault armed once.

Every request is recorded as a `Served`, with the bytes of body it sent; `HubLog` counts them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Literal

import attrs

FaultKind = Literal["cut", "stall", "corrupt", "fail", "refuse_range"]
Where = Literal["any", "resolve", "cdn"]


@attrs.define(eq=False)
class Fault:
    kind: FaultKind
    target: str
    repo: str | None = None
    times: int | None = 1
    after: int = 0  # cut, stall: body bytes of the response; corrupt: the file's offset
    status: int = 503  # fail
    where: Where = "any"  # fail
    fired: int = 0
    reached: threading.Event = attrs.field(factory=threading.Event)  # set at each firing
    released: threading.Event = attrs.field(factory=threading.Event)  # stall: go on

    def matches(self, repo_id: str, path: str, sha256: str) -> bool:
        return (self.repo is None or self.repo == repo_id) and self.target in (path, sha256)

    def release(self) -> None:
        """A stalled body goes on (every stall of this fault, now and later)."""
        self.released.set()

    def wait_reached(self, timeout: float = 30.0) -> None:
        """Until the fault has fired (a stall: until the body has stopped at `after`)."""
        if not self.reached.wait(timeout):
            raise AssertionError(f"{self.kind} fault on {self.target!r} did not fire within {timeout:g} s")


class Faults:
    """The armed faults of one server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: list[Fault] = []
        self._every: list[Fault] = []  # armed ever, so closing releases a stall already used up

    def cut(self, target: str, *, after: int, times: int | None = 1, repo: str | None = None) -> Fault:
        """Close the connection after `after` bytes of the body (the client sees a short body)."""
        return self.arm(Fault("cut", target, repo, times, after=after))

    def stall(self, target: str, *, after: int, times: int | None = 1, repo: str | None = None) -> Fault:
        """Stop sending after `after` bytes of the body until `fault.release()` (or the server
        closes, which cuts the connection); `fault.reached` is set when it stops."""
        return self.arm(Fault("stall", target, repo, times, after=after))

    def corrupt(self, target: str, *, at: int, times: int | None = 1, repo: str | None = None) -> Fault:
        """Send the byte at file offset `at` changed, when the response covers it."""
        return self.arm(Fault("corrupt", target, repo, times, after=at))

    def fail(
        self, target: str, *, status: int = 503, times: int | None = 1, where: Where = "any", repo: str | None = None
    ) -> Fault:
        """Answer `status` instead (500 or 503, as the Hub does when it is unwell)."""
        if status < 500:
            raise ValueError(f"fail(status={status}): give a 5xx; the Hub's 4xx answers come from the repos")
        return self.arm(Fault("fail", target, repo, times, status=status, where=where))

    def refuse_range(self, target: str, *, times: int | None = None, repo: str | None = None) -> Fault:
        """Ignore Range: 200 with the whole file, as a server without range support."""
        return self.arm(Fault("refuse_range", target, repo, times))

    def arm(self, fault: Fault) -> Fault:
        with self._lock:
            self._armed.append(fault)
            self._every.append(fault)
        return fault

    def disarm(self, fault: Fault) -> None:
        with self._lock:
            if fault in self._armed:
                self._armed.remove(fault)
        fault.release()

    def clear(self) -> None:
        with self._lock:
            armed, self._armed = self._armed, []
        for fault in armed:
            fault.release()

    def release_all(self) -> None:
        with self._lock:
            armed = list(self._every)
        for fault in armed:
            fault.release()

    def take(
        self,
        kind: FaultKind,
        repo_id: str,
        path: str,
        sha256: str,
        *,
        where: str = "any",
        since: int = 0,
        within: int | None = None,
    ) -> Fault | None:
        """The first armed fault of `kind` for this file, counted as fired (gone when used up);
        with `within` only one whose `after` is in [since, within): in the body sent (cut,
        stall) or in the file's bytes it covers (corrupt). The server sets `reached` once it has acted."""
        with self._lock:
            for fault in self._armed:
                if fault.kind != kind or not fault.matches(repo_id, path, sha256):
                    continue
                if kind == "fail" and fault.where not in ("any", where):
                    continue
                if within is not None and not since <= fault.after < within:
                    continue
                fault.fired += 1
                if fault.times is not None and fault.fired >= fault.times:
                    self._armed.remove(fault)
                return fault
        return None


@attrs.define
class Served:
    """One request: `kind` is "list", "info", "tree", "resolve", "cdn" or "other"."""

    method: str
    kind: str
    repo_id: str | None = None
    revision: str | None = None
    path: str | None = None
    range: str | None = None
    authorization: str | None = None
    status: int = 0
    body_bytes: int = 0  # of the body sent (0 for HEAD)
    cut: bool = False  # ended by a cut fault, or by the client going away
    # Set once the handler is done with it: a client may have read the last byte before the
    # server thread counted it (`HubLog.bytes_sent` waits for this).
    finished: threading.Event = attrs.field(factory=threading.Event, eq=False, repr=False)


class HubLog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._served: list[Served] = []

    def add(self, served: Served) -> Served:
        with self._lock:
            self._served.append(served)
        return served

    def __iter__(self) -> Iterator[Served]:
        with self._lock:
            return iter(list(self._served))

    def requests(self, **where: object) -> list[Served]:
        """The requests whose fields equal those given, e.g. requests(kind="cdn", path="x.gguf")."""
        unknown = set(where) - set(attrs.fields_dict(Served))
        if unknown:
            raise TypeError(f"no field {sorted(unknown)} in Served; fields: {list(attrs.fields_dict(Served))}")
        return [s for s in self if all(getattr(s, k) == v for k, v in where.items())]

    def count(self, **where: object) -> int:
        return len(self.requests(**where))

    def bytes_sent(self, path: str | None = None, *, settle_s: float = 5.0) -> int:
        """Bytes sent of the file at `path` (resolve and CDN bodies, not redirects or errors;
        None: of every file), once the requests counted are done (each waited for at most
        `settle_s`: a stalled one is counted as far as it got)."""
        files = [s for s in self if s.kind in ("resolve", "cdn") and path in (None, s.path)]
        for s in files:
            s.finished.wait(settle_s)
        return sum(s.body_bytes for s in files if s.status in (200, 206))

    @property
    def partial_responses(self) -> int:
        return self.count(status=206)

    def clear(self) -> None:
        with self._lock:
            self._served.clear()
