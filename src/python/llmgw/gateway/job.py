"""One forwarded request's accounting (`Job`) and the relay of a streamed answer (`stream`).

A `Job` is made once a request is admitted (its key counted against its limits, its model known):
it counts the request as taken for its model (`Gateway.taken`, what the control plane scales by;
those refused later too) and in flight on its model until `finish`, which runs once however the
request ends: answered, refused on the way, broken off by its replica, or abandoned by its client
(499, as nginx logs it). While it holds a replica (`endpoint`) that replica counts it outstanding,
and the part of its prompt new to that replica (`prefill`) counts as work ahead of others there
until the engine's answer begins (`answering`). Its end lets go of all of it and wakes what waits
for a replica of its model (`Gateway.wake`) and for the last request in flight (`Gateway.finished`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

import trio

from llmgw.gateway.budgets import Hold, prompt_estimate
from llmgw.gateway.errors import UpstreamError
from llmgw.gateway.migrate import Events, KeptBudget, Rewrite
from llmgw.gateway.prefix import Prompt
from llmgw.gateway.routing import LEAST, Endpoint, Route
from llmgw.gateway.upstream import UpstreamResponse
from llmgw.gateway.usage import StreamUsage, Tokens
from llmgw.http.errors import BodyAborted
from llmgw.log import get_logger
from llmgw.wire.gateway_link import GatewayKey

if TYPE_CHECKING:
    from llmgw.gateway.app import Gateway
    from llmgw.telemetry.otel import RequestTrace

log = get_logger("llmgw.gateway")
NOTHING_KEPT = KeptBudget(0)  # the budget of a stream cut at its events that cannot be continued


class Job:
    """One forwarded request's accounting; `finish` runs once, however the request ends."""

    __slots__ = (
        "gw",
        "key",
        "model",
        "started",
        "rid",
        "endpoint",
        "sent_at",
        "prompt",
        "route",
        "prefill",
        "trace",
        "body",
        "served",
        "tokens",
        "meter",
        "hold",
        "_first_byte_seen",
        "_done",
    )

    def __init__(self, gw: Gateway, key: GatewayKey, model: str, started: float, rid: str = "") -> None:
        self.gw, self.key, self.model, self.started, self.rid = gw, key, model, started, rid
        self.endpoint: Endpoint | None = None
        self.sent_at = started
        self.prompt: Prompt | None = None  # for a model routed by prefix
        self.route: Route = LEAST  # how `endpoint` was chosen
        self.prefill = 0  # bytes of its prompt new to `endpoint` while its answer has not begun
        self.trace: RequestTrace | None = None  # its spans, when traced (`llmgw.telemetry`)
        self.body = b""  # what is sent to the engines (the client's, or a stream's asking for its usage)
        self.served = False  # an engine answered it with a success status: it counts in the usage
        self.tokens: Tokens | None = None  # an answer read whole: its engine's usage
        self.meter: StreamUsage | None = None  # a stream's usage, read as it is relayed
        self.hold: Hold | None = None  # what it reserved of its key's token budgets (`gateway/budgets.py`)
        self._first_byte_seen = False
        self._done = False
        gw.in_flight[model] = gw.in_flight.get(model, 0) + 1
        gw.in_flight_total += 1
        gw.taken[model] = gw.taken.get(model, 0) + 1

    def answering(self) -> None:
        """The engine began its answer (a buffered one read, a stream's first chunk): the prompt
        is no longer work ahead of others on its replica."""
        if self.prefill and self.endpoint is not None:
            self.gw.router.prefilled(self.endpoint, self.prefill)
        self.prefill = 0

    def leave_replica(self) -> None:
        """It no longer counts on its replica (it ended, or the replica failed and another is
        tried), and what waits for one of its model is woken."""
        if self.endpoint is not None:
            self.gw.router.release(self.endpoint, self.prefill)
            self.prefill = 0
            self.endpoint = None
            self.gw.wake(self.model)

    def first_byte(self, now: float) -> None:
        if not self._first_byte_seen:
            self._first_byte_seen = True
            self.gw.metrics.first_byte(self.model, now - self.started)

    def _end_trace(self, status: int) -> None:
        """Its spans end, with the engine's usage when it said it (`gen_ai.usage.*`)."""
        assert self.trace is not None
        tokens = self.tokens if self.meter is None else self.meter.tokens
        if self.served and tokens is not None:
            self.trace.usage(tokens.prompt, tokens.completion)
        self.trace.end(status)

    def finish(self, status: int | None, now: float | None = None) -> None:
        """`status` None: the request ended without an answer of ours (counted where raised,
        or the client went away: 499, as nginx logs it). `now`: the clock's time, when the
        caller has just read it."""
        if self._done:
            return
        self._done = True
        gw = self.gw
        gw.in_flight[self.model] -= 1
        gw.in_flight_total -= 1
        if not gw.in_flight_total:
            gw.finished.fire()
        gw.keys.leave(self.key)
        self.leave_replica()
        if status is not None:
            gw.metrics.answered(self.model, status)
            gw.metrics.timed(self.model, (gw.clock() if now is None else now) - self.started)
            if self.trace is not None:
                self._end_trace(status)
        t = None
        if self.served:
            meter = self.meter
            t = self.tokens if meter is None else meter.tokens
            if t is None and meter is not None:
                t = self._estimated(meter, status)
            key = self.key
            if t is None:
                gw.usage.record(key.name, key.team, self.model, 0, 0, 0)
            else:
                gw.usage.record(key.name, key.team, self.model, t.prompt, t.cached, t.completion)
        if self.hold is not None and gw.budgets is not None:
            # What the ledger counts (its engine's usage, or a cut stream's estimate); nothing if
            # none answered; its reservation if one answered whole without saying.
            used = (t.prompt + t.completion if t is not None else None) if self.served else 0
            gw.budgets.finish(self.hold, used)
            self.hold = None

    def _estimated(self, meter: StreamUsage, status: int | None) -> Tokens:
        """A stream that ended without its engine's usage: the tokens relayed as completion, and
        an earlier attempt's prompt, else the prompt estimated as the budgets reserve it."""
        earlier = meter.earlier
        completion = meter.relayed_tokens()
        if earlier is not None:
            t = Tokens(earlier.prompt, earlier.cached, max(completion, earlier.completion))
        else:
            t = Tokens(prompt_estimate(meter.body_bytes), 0, completion)
        reason = "client_gone" if status == 499 else "cut" if status is None or status >= 400 else "no_usage"
        self.gw.usage.estimated_total.inc(model=self.model, reason=reason)
        log.debug(
            "gateway_usage_estimated",
            model=self.model,
            reason=reason,
            prompt_tokens=t.prompt,
            completion_tokens=t.completion,
            events=meter.relayed,
            request_id=self.rid,
        )
        return t


class Resume(Protocol):
    """How a broken stream goes on (`Gateway._continue`): given what the client has had (its
    whole events) and the migration's number, another replica's answer to the continuation and
    how to rewrite its events, or the last bytes to send (an error event, or the answer's end)."""

    max_migrations: int
    stall_s: float
    budget: KeptBudget

    async def __call__(self, job: Job, sent: bytes, migration: int) -> tuple[UpstreamResponse, Rewrite] | bytes: ...


async def stream(upstream: UpstreamResponse, job: Job, resume: Resume | None = None) -> AsyncIterator[bytes]:
    """The answer's body as it comes; its end (or the client's departure, which closes the
    upstream connection and so stops the engine's work) finishes the job. A stream that breaks
    once relayed takes its replica out. Without `resume` it is passed on without being parsed and
    a break cuts it; with one it is passed on in whole SSE events, kept (`migrate.Events`), and a
    break has `resume` continue it on another replica, up to `resume.max_migrations` times."""
    status: int | None = 499
    meter = job.meter
    if resume is not None:
        events: Events | None = Events(resume.budget)
    else:  # a stream whose usage is read is cut at its events too, none kept
        events = Events(NOTHING_KEPT) if meter is not None else None
    rewrite: Rewrite | None = None
    migration = 0
    ttft = job.trace  # its first bytes are the trace's first token, then None
    try:
        while True:
            try:
                async for chunk in upstream.body():
                    if job.prefill:
                        job.answering()
                    if ttft is not None:
                        ttft.first_token()
                        ttft = None
                    if events is None:
                        yield chunk
                        continue
                    whole = events.feed(chunk)
                    if whole:
                        if upstream.stall_s is None and resume is not None:
                            upstream.stall_s = resume.stall_s  # its tokens flow: a silence now is a stall
                        if rewrite is not None:
                            whole = rewrite.events(whole)
                        if meter is None:
                            yield whole
                            continue
                        whole = meter.events(whole)
                        yield whole
                        meter.sent(whole)  # the client took it (it asked for more)
                if events is not None and (rest := events.rest()):
                    yield rest
                status = upstream.status
                return
            except UpstreamError as exc:
                log.warning(
                    "gateway_stream_broken", replica=upstream.key, model=job.model, reason=str(exc), request_id=job.rid
                )
                status = 502
                if job.trace is not None:
                    job.trace.relay_broken(str(exc))
                if job.endpoint is not None:  # out of rotation until probed
                    job.gw.replica_failed(job.endpoint, "broken", client_saw_bytes=True)
                if resume is None or events is None or events.overflow or migration >= resume.max_migrations:
                    raise BodyAborted(str(exc)) from None
                with trio.CancelScope(shield=True):
                    await upstream.aclose()
                job.leave_replica()
                migration += 1
                outcome = await resume(job, events.kept, migration)
                if isinstance(outcome, bytes):  # the answer's end, or an error event: nothing more comes
                    if outcome:
                        yield outcome
                    status = 200 if outcome.endswith(b"data: [DONE]\n\n") else 502
                    return
                upstream, rewrite = outcome
                if meter is not None and meter.tokens is not None:  # an attempt's usage, not the answer's
                    meter.earlier, meter.tokens = meter.tokens, None
    finally:
        if events is not None:
            events.release()
        with trio.CancelScope(shield=True):
            await upstream.aclose()  # not read to its end: closed, which stops the engine's work
        job.finish(status)
