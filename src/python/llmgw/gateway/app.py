"""The gateway's request handler: OpenAI-compatible routes in front of the replicas.

    GET  /health                 200 while serving (ready replicas per model); 503 while draining
    GET  /metrics                Prometheus text
    GET  /v1/models              the models this key may use
    GET  /v1/models/{id}         one of them
    POST /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses, /v1/rerank,
         /v1/score, /tokenize, /detokenize   forwarded to a replica whose engine serves the route

A forwarded request is decided from its head first: the API key (401) and its limits (429)
before a byte of the body is read (`llmgw.http.server`: a refused request's body is never
buffered). Then the body is parsed only to read "model" and "stream" (400 naming what is wrong;
`gateway/fields.py`, in a worker process for a large body), and the model is checked as soon as
it is known (`gateway/checks.py`: 403 for a key that may not use it, 404 for an unknown one or
one whose engine does not serve the route). A key with token budgets (its own or its team's)
then reserves the request's tokens from each (`gateway/budgets.py`): 429 `budget_exceeded` naming
the budget and when it resets, or 503 `budget_unavailable` when no grant of it can be had now. A replica is picked by `Router`; with none free the
request waits in its model's queue (`gateway/queues.py`) until one is, or 503 with Retry-After at
the deadline — but only while one can come: a model the control plane says no replica of can
become ready now (`ModelInfo.unservable`) is a 503 at once, with `x-should-retry: false` so that
OpenAI's SDK does not retry it, and so are the requests waiting for it when the control plane
says so. How many may wait and for how long is the model's own (`ModelInfo.max_queue`,
`queue_timeout_s`) or else the gateway's (`[gateway] max_queue`, for all such models together,
and `queue_timeout_s`); past the bound, 503 at once. A model with no replica at all (one on
demand, scaled to zero) is started by the control plane from what the gateways report
(`model_loads`): the first request that waits for it is reported at once (`cold`).

The request goes out with the replica's own engine key. An attempt that fails while nothing has
gone to the client yet (no connection within the connect timeout, refused or reset, no response
head within the first-byte timeout and no answer to a probe, a 502/503, a body read whole that
broke off) takes the replica out of rotation and sends the request to another, at most
`max_attempts` times in all; a stream that breaks once relayed takes the replica out too, and a
streamed chat or text completion is continued on another replica from where it was
(`gateway/migrate.py`, `Gateway._continue`). A replica out of rotation returns when a probe
reaches it (`gateway/probes.py`). The answer is relayed as it comes (`gateway/job.py`): a body
with a length is read whole (bounded), a stream that may be continued in whole SSE events (kept,
bounded), any other chunk by chunk without being parsed; a client that goes away
closes the upstream connection, which cancels the work on the engine. The services beside the
handler (the rotation, the prober, the caches' reports and events) are started by
`gateway/services.py`.

Each response carries `x-request-id` (the caller's own when it sent a usable one; passed to the
engine and logged with the request's warnings), and a forwarded one `x-llmgw-replica` and
`x-llmgw-overhead-ms`: the time the gateway spent before the request reached the replica that
answered (parsing, auth, queueing, failed attempts). Errors are in OpenAI's shape with the codes
of docs/gateway.md's error table; an engine's own error is rewritten to that shape
(`gateway/engineerrors.py`: a prompt past the context is `context_length_exceeded` whichever
engine says it).
"""

from __future__ import annotations

import math
import random
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

import attrs
import trio

from llmgw.config import GatewaySection
from llmgw.errors import cut
from llmgw.gateway.budgets import Budgets, Hold, Refused, estimate, reserve
from llmgw.gateway.checks import (
    authenticate,
    check_model,
    check_route,
    counted,
    model_not_found,
    unavailable,
    unservable,
)
from llmgw.gateway.engineerrors import MAX_REWRITTEN, normalized, openai_error
from llmgw.gateway.errors import UpstreamBroken, UpstreamNoFirstByte, UpstreamTooLarge, UpstreamUnavailable
from llmgw.gateway.fields import NO_PREFIX, PrefixModels, RequestFields, request_fields
from llmgw.gateway.headers import REQUEST_ID, relayed_headers, request_id, upstream_headers
from llmgw.gateway.job import Job, stream
from llmgw.gateway.keys import KeyTable
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.migrate import (
    FINISHED,
    NOT_EXACT,
    ROUTES,
    KeptBudget,
    Reading,
    Rewrite,
    continuation_payload,
    data_of,
    encode,
    error_event,
    finish_event,
)
from llmgw.gateway.prefix import Prompt
from llmgw.gateway.queues import Queues
from llmgw.gateway.routing import LEAST, Endpoint, Rotation, Route, Router, Verdict
from llmgw.gateway.upstream import Connect, UpstreamPool, UpstreamResponse
from llmgw.gateway.usage import StreamUsage, Usage, body_usage, with_usage
from llmgw.http.errors import HTTPError
from llmgw.http.jsonworkers import JsonWorkers, ParserBusy, parse_body
from llmgw.http.messages import Request, Response, StreamingResponse, allow
from llmgw.log import get_logger
from llmgw.wakeup import Wakeup
from llmgw.wire.gateway_link import OPENAI_ROUTES, RESPONSES, GatewayKey, ModelInfo, ModelLoad

if TYPE_CHECKING:
    from llmgw.telemetry.otel import RequestTrace, Tracing

log = get_logger("llmgw.gateway")

FORWARDED = frozenset(OPENAI_ROUTES)
MODELS_PREFIX = "/v1/models/"
_RETRY_STATUSES = (502, 503)
# What the gateway's knobs do not set (server.toml's `[gateway]`, `GatewaySection`, sets the rest):
MAX_BUFFERED_BODY = 64 << 20  # an upstream answer with a length is read whole, up to this


class EndpointProvider(Protocol):
    """Where the gateway's rotation comes from: a gateway worker's table (`gatewayd.table`: filled
    over the link, from a file, or in memory, `server/gateways/inprocess.py`), or a fixed set in the tests
    and the bench (`testlib.endpoints.StaticEndpoints`)."""

    def gateway_rotation(self) -> Rotation: ...

    def rotation_changed(self) -> trio.Event:
        """An event set at the next change of `gateway_rotation()`."""
        ...


class Gateway:
    """The request handler and the state it routes by: the rotation (`apply`), the replicas'
    load and who is down (`router`), the connections to them (`pool`), the requests in flight
    and queued, the figures (`metrics`). Its services run beside it (`gateway/services.py`)."""

    def __init__(
        self,
        provider: EndpointProvider,
        keys: KeyTable,
        *,
        options: GatewaySection | None = None,
        pool: UpstreamPool | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = trio.current_time,
        json_workers: JsonWorkers | None = None,
        connect: Connect | None = None,
        open_events: Callable[[str, int], Awaitable[trio.abc.Stream]] = trio.open_tcp_stream,
        tracing: Tracing | None = None,
        budgets: Budgets | None = None,
    ) -> None:
        """`connect`: how the pool opens a connection to an engine (`upstream.open_tcp` by
        default; tests reach engines' handlers over memory streams). `tracing`: the process's
        traces (`llmgw.telemetry.start`; None: off, and each hook is then one branch)."""
        self.provider = provider
        # Large bodies are parsed in a worker process (started at the first); its owner closes it.
        self.json = json_workers or JsonWorkers()
        self.keys = keys
        self.options = options = options or GatewaySection()
        self.kept = KeptBudget()  # what the streams that may be continued keep, all together
        self.pool = pool or UpstreamPool(
            max_idle_per_endpoint=options.max_idle_per_replica,
            connect_timeout_s=options.connect_timeout_s,
            first_byte_timeout_s=options.first_byte_timeout_s,
            read_timeout_s=options.read_timeout_s,
            probe_timeout_s=options.probe_timeout_s,
            connect=connect,
        )
        self.tracing = tracing
        self.budgets = budgets  # the token budgets this instance enforces (None: none)
        self.open_events = open_events  # how a KV-cache events subscription connects (`gateway/cachewatch.py`)
        self.clock = clock  # trio's, or one that agrees with it: the prober sleeps until its times
        self.router = Router(
            rng=rng,
            max_outstanding=options.max_outstanding_per_replica,
            probe_interval_s=options.probe_interval_s,
            prefix_load_factor=options.prefix_load_factor,
            prefix_table_entries=options.prefix_table_entries,
        )
        self.prefix_models = NO_PREFIX  # whose requests' prompts are read for routing
        self.metrics = GatewayMetrics()
        self.usage = Usage(self.metrics.registry)  # who used what: the ledger's counts (`gateway/usage.py`)
        self.rotation_version = 0  # of the rotation routed by now (`Rotation.version`)
        self.details: dict[str, ModelInfo] = {}  # of the models in rotation, as the provider says them
        self.queues = Queues()  # the requests waiting for a replica, per model
        self.in_flight: dict[str, int] = {}  # per model, from its `Job` to its end: the queued ones too
        self.in_flight_total = 0  # the sum of `in_flight`, kept so that a request's end need not add it up
        self.taken: dict[str, int] = {}  # per model, the requests taken since the start (`Job`)
        self.draining = False
        self.refusing = False
        self.freed = Wakeup()  # a replica may have become free (`wake`); each model's waiters have their own
        self.went_down = Wakeup()  # a replica left rotation: the prober looks again (`gateway/probes.py`)
        self.finished = Wakeup()  # the last request in flight finished
        self.applied = Wakeup()  # a new rotation is routed by (`rotation_version`)
        self.cold = Wakeup()  # a request began to wait for a model with no replica in rotation (`model_loads`)

    # -- rotation -------------------------------------------------------------------------

    async def serve_rotation(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Follow the provider: the rotation is replaced the moment it changes."""
        started = False
        while True:
            changed = self.provider.rotation_changed()
            self.apply(self.provider.gateway_rotation())
            if not started:
                task_status.started()
                started = True
            await changed.wait()

    def apply(self, rotation: Rotation) -> None:
        before = {(ep.host, ep.port) for eps in self.router.endpoints.values() for ep in eps}
        policies = {d.name: d.routing for d in rotation.details}
        self.router.update(rotation.models, rotation.endpoints, policies)
        self.rotation_version = rotation.version
        self.details = {d.name: d for d in rotation.details}
        by_prefix = frozenset(self.router.policies)
        if by_prefix != self.prefix_models.models:
            self.prefix_models = PrefixModels(
                models=by_prefix,
                block_chars=self.options.prefix_block_chars,
                max_blocks=max(1, self.options.prefix_max_chars // self.options.prefix_block_chars),
            )
        self.applied.fire()
        after = {(ep.host, ep.port) for ep in rotation.endpoints}
        for host, port in before - after:
            self.pool.close_idle(host, port)
        self.wake()

    def wake(self, model: str | None = None) -> None:
        """A replica may have become free: a request let go of it, the rotation changed, a probe
        reached it. The requests queued for its `model` (None: for any) pick again, and `quiesce`
        looks again."""
        self.freed.fire()
        if model is None:
            self.queues.wake_all()
        else:
            self.queues.wake(model)

    def at_once(self) -> tuple[trio.Event, trio.Event]:
        """Events set when what a heartbeat says should reach the control plane at once: the
        gateway routes by a new rotation (its version: a move waits for it), or a request began to
        wait for a model with no replica (the models' load: the control plane starts one)."""
        return self.applied.next(), self.cold.next()

    @property
    def queued(self) -> dict[str, int]:
        """Requests waiting for a replica now, per model."""
        return self.queues.queued

    def model_loads(self) -> tuple[ModelLoad, ...]:
        """Each model's requests, by name, as the heartbeats say them (`GatewayWorker.load`): waiting
        now, in flight now (taken and not waiting: on a replica, or between two attempts), taken
        since the start, and how long the oldest waiting has. The models a request was ever taken
        for; O(models)."""
        now = self.clock()
        loads = []
        for model, taken in sorted(self.taken.items()):
            queued = self.queues.queued.get(model, 0)
            loads.append(
                ModelLoad(
                    model=model,
                    queued=queued,
                    in_flight=self.in_flight.get(model, 0) - queued,
                    requests_total=taken,
                    oldest_wait_s=round(self.queues.oldest_wait(model, now), 3),
                )
            )
        return tuple(loads)

    # -- down replicas --------------------------------------------------------------------

    def replica_failed(self, ep: Endpoint, reason: str, *, client_saw_bytes: bool) -> Verdict:
        """An attempt on `ep` failed: by the router's rule it may leave rotation, until a probe
        reaches it (`gateway/probes.py`); whether the request may be tried again elsewhere."""
        verdict = self.router.failed(ep, reason, self.clock(), client_saw_bytes=client_saw_bytes)
        if verdict.went_down:
            log.warning("gateway_replica_down", replica=ep.replica_id, model=ep.model, reason=reason)
            self.metrics.replica_down.inc(model=ep.model, reason=reason)
            self.pool.close_idle(ep.host, ep.port)  # after silence they are likely dead too
            self.went_down.fire()
        return verdict

    async def drain(self, timeout_s: float, *, refuse_new: bool = True) -> bool:
        """Wait for the requests in flight; whether they all finished. With `refuse_new`, new
        requests meanwhile get 503 with Retry-After; without it (the listener stopped accepting
        and each connection closes after its request: a socket-activated restart) the few that
        still arrive on open connections are served."""
        self.draining = True
        self.refusing = refuse_new
        with trio.move_on_after(timeout_s):
            while True:
                finished = self.finished.next()
                if not self.in_flight_total:
                    return True
                await finished.wait()
        return False

    def ready(self) -> dict[str, int]:
        """Replicas that may take a request now, per model, as the router sees them (failures out)."""
        return {m: len(self.router.in_rotation(m)) for m in sorted(self.router.models)}

    async def quiesce(self, replica_id: str, timeout_s: float) -> bool:
        """Wait until no request is outstanding on `replica_id` (which the caller has taken out
        of rotation first), for at most `timeout_s`; whether it got there."""
        with trio.move_on_after(timeout_s):
            while True:
                freed = self.freed.next()  # fired whenever a request lets go of its replica
                if self.router.outstanding.get(replica_id, 0) == 0:
                    return True
                await freed.wait()
        return False

    # -- requests -------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response | StreamingResponse:
        """Every answer, errors too, carries the request's id: a forwarded one's from the start
        (`_relay`), the others' added here."""
        rid = request_id(request.headers.get(REQUEST_ID))
        try:
            if request.path in FORWARDED:
                allow(request, "POST")
                if self.tracing is not None:
                    return await self._forward_traced(request, rid)
                return await self._forward(request, rid)
            response = self._local(request)
        except HTTPError as exc:
            exc.headers = (*exc.headers, (REQUEST_ID, rid))
            raise
        return attrs.evolve(response, headers=(*response.headers, (REQUEST_ID, rid)))

    def _local(self, request: Request) -> Response:
        """The routes the gateway answers itself."""
        if request.path == "/health":
            allow(request, "GET")
            ready = self.ready()
            if self.draining:
                return Response.json(503, {"status": "draining", "ready": ready})
            return Response.json(200, {"status": "ok", "ready": ready})
        if request.path == "/metrics":
            allow(request, "GET")
            return Response(
                status=200,
                body=self.render_metrics().encode(),
                headers=(("content-type", "text/plain; version=0.0.4; charset=utf-8"),),
            )
        if request.path == "/v1/models":
            allow(request, "GET")
            key = authenticate(self.keys, request, self.metrics)
            allowed = sorted(m for m in self.router.models if not key.models or m in key.models)
            return Response.json(200, {"object": "list", "data": [self._model_object(m) for m in allowed]})
        if request.path.startswith(MODELS_PREFIX):
            allow(request, "GET")
            key = authenticate(self.keys, request, self.metrics)
            model = urllib.parse.unquote(request.path[len(MODELS_PREFIX) :])
            if model not in self.router.models or (key.models and model not in key.models):
                raise model_not_found(model, self.router.models if not key.models else key.models)
            return Response.json(200, self._model_object(model))
        raise HTTPError(
            404,
            f"no route {cut(request.method, 20)} {cut(request.path)}; the gateway serves /v1/models, "
            + ", ".join(OPENAI_ROUTES)
            + ", /health and /metrics",
            code="unknown_url",
        )

    def _model_object(self, model: str) -> dict:
        info = self.details.get(model)
        created = info.created if info is not None else 0
        return {"id": model, "object": "model", "created": created, "owned_by": "llmgw"}

    async def _forward_traced(self, request: Request, rid: str) -> Response | StreamingResponse:
        """`_forward` with the request's spans (`llmgw.telemetry.otel`): ended by the job's end,
        or here when the request fails or is refused."""
        assert self.tracing is not None
        trace = self.tracing.request(request.path, request.headers, rid)
        if trace is None:  # not sampled: its traceparent, if any, goes on as it came
            return await self._forward(request, rid)
        try:
            return await self._forward(request, rid, trace)
        except HTTPError as exc:
            trace.failed(exc.status, exc.code or "", exc.message)
            raise
        except BaseException:
            trace.end(499)  # cancelled: the client went away
            raise

    async def _forward(
        self, request: Request, rid: str, trace: RequestTrace | None = None
    ) -> Response | StreamingResponse:
        started = self.clock()
        if self.refusing:
            raise counted(self.metrics, "-", unavailable("the gateway is shutting down", "shutting_down"))
        # From the head alone: who is asking, and may they ask now. The body is not read yet.
        key = authenticate(self.keys, request, self.metrics)
        request.body_owner = "key:" + key.token_sha256  # its bodies held to a share of the budget
        limited = self.keys.admit(key)
        if limited is not None:
            retry = str(max(1, math.ceil(limited.retry_after_s)))
            raise counted(
                self.metrics,
                "-",
                HTTPError(
                    429, limited.message, kind="requests", code="rate_limit_exceeded", headers=(("retry-after", retry),)
                ),
            )
        hold = None
        try:
            fields = await self._read_fields(request)
            check_model(key, fields.model, self.router.models, self.metrics)
            check_route(self.details, fields.model, request.path, self.metrics)
            if self.budgets is not None and self.budgets.applies(key):
                hold = await self._reserve(self.budgets, key, fields, request)
        except BaseException:
            self.keys.leave(key)
            raise
        job = Job(self, key, fields.model, started, rid)
        job.hold = hold
        if trace is not None:
            job.trace = trace
            trace.admitted(fields.model)
        try:
            job.prompt = fields.prompt
            job.body = await request.read()
            if fields.stream and request.path in ROUTES:  # the engine says the usage, the client sees what it asked
                job.meter = StreamUsage(fields.include_usage, len(job.body))
                if not fields.include_usage:
                    job.body = fields.usage_body or with_usage(job.body)
            elif fields.stream and request.path == RESPONSES:  # its usage is in its stream already
                job.meter = StreamUsage(True, len(job.body), responses=True)
            response = await self._attempts(request, job, fields.prompt)
        except BaseException:
            job.finish(None)
            raise
        return response

    async def _reserve(self, budgets: Budgets, key: GatewayKey, fields: RequestFields, request: Request) -> Hold:
        """The request's tokens reserved from its key's budgets and its team's, or 429/503 (counted)."""
        tokens = estimate(len(await request.read()), fields.max_tokens)
        outcome = await reserve(budgets, key, fields.model, tokens)
        if isinstance(outcome, Refused):
            headers = [("retry-after", str(max(1, math.ceil(outcome.retry_after_s))))]
            if outcome.resets_at:
                headers.append(("x-llmgw-budget-resets-at", str(outcome.resets_at)))
            kind = "tokens" if outcome.status == 429 else "server_error"
            error = HTTPError(
                outcome.status, outcome.message, kind=kind, code=outcome.code, param=outcome.param, headers=headers
            )
            raise counted(self.metrics, fields.model, error)
        return outcome

    async def _read_fields(self, request: Request) -> RequestFields:
        try:
            return await parse_body(request, self.json, request_fields, self.prefix_models)
        except HTTPError as exc:
            raise counted(self.metrics, "-", exc) from None

    async def _attempts(self, request: Request, job: Job, prompt: Prompt | None) -> Response | StreamingResponse:
        timeout_s = self._queue_timeout_s(job.model)
        deadline = job.started + timeout_s
        tried: set[Endpoint] = set()
        last = last_reason = ""
        for attempt in range(self.options.max_attempts):
            ep, job.route = await self._wait_for_endpoint(job.model, tried, prompt, deadline, job.trace)
            if ep is None:
                if last:
                    why, code = f"no replica of {job.model!r} could answer: {last}", "overloaded"
                else:
                    why, code = f"no ready replica of {job.model!r} within {timeout_s:g} s", "model_not_ready"
                raise counted(self.metrics, job.model, unavailable(why + "; try again later", code))
            if attempt:
                self.metrics.retries.inc(model=job.model, reason=last_reason)
            job.prefill = prompt.size - job.route.matched_chars if prompt is not None and job.route is not LEAST else 0
            self.router.acquire(ep, job.prefill)
            job.endpoint = ep
            job.sent_at = self.clock()
            headers = upstream_headers(request, ep, job.rid)
            if job.trace is not None:
                headers = job.trace.attempt(ep.replica_id, ep.host, ep.port, headers)
            try:
                upstream = await self.pool.send(
                    ep.host,
                    ep.port,
                    request.method,
                    request.path,
                    headers,
                    job.body,
                )
            except UpstreamUnavailable as exc:
                last, last_reason = str(exc), "first_byte" if isinstance(exc, UpstreamNoFirstByte) else "connect"
            else:
                if upstream.status in _RETRY_STATUSES:
                    await upstream.aclose()
                    last, last_reason = f"{ep.replica_id} answered {upstream.status}", str(upstream.status)
                else:
                    try:
                        return await self._relay(upstream, job, request)
                    except UpstreamBroken as exc:  # a body read whole: none of it went to the client
                        last, last_reason = str(exc), "broken"
            self._attempt_failed(job, ep, last, last_reason, tried)
        raise counted(
            self.metrics,
            job.model,
            unavailable(f"{self.options.max_attempts} replicas failed; the last: {last}", "overloaded"),
        )

    def _queue_timeout_s(self, model: str) -> float:
        """How long a request of `model` may wait for a replica: its own, else the gateway's."""
        info = self.details.get(model)
        return info.queue_timeout_s if info is not None and info.queue_timeout_s else self.options.queue_timeout_s

    def _attempt_failed(self, job: Job, ep: Endpoint, why: str, reason: str, tried: set[Endpoint]) -> None:
        """An attempt on `ep` failed with nothing of it sent to the client: the job leaves it, it
        leaves rotation (a retry, by the rule) and is not tried again for this request."""
        log.warning("gateway_upstream_failed", replica=ep.replica_id, model=job.model, reason=why, request_id=job.rid)
        if job.trace is not None:
            job.trace.attempt_failed(reason, why)
        job.leave_replica()
        self.replica_failed(ep, reason, client_saw_bytes=False)
        tried.add(ep)

    async def _wait_for_endpoint(
        self,
        model: str,
        tried: set[Endpoint],
        prompt: Prompt | None,
        deadline: float,
        trace: RequestTrace | None = None,
    ) -> tuple[Endpoint | None, Route]:
        """A replica for the next attempt, at once or once one is free; None: none by `deadline`.
        503 at once (raised, counted) while the model is unservable, when it becomes so while the
        request waits, and when its queue is full."""
        ep, route = self.router.route(model, exclude=tried, prompt=prompt)
        if ep is not None:
            return ep, route
        self._refuse_if_unservable(model)
        info = self.details.get(model)
        own = info.max_queue if info is not None else 0
        if own and self.queues.queued.get(model, 0) >= own:
            why = f"the queue of {model!r} is full ({own} requests)"
            raise counted(self.metrics, model, unavailable(why + "; try again later", "overloaded"))
        if not own and self.queues.shared >= self.options.max_queue:
            why = f"the queue is full ({self.options.max_queue} requests)"
            raise counted(self.metrics, model, unavailable(why + "; try again later", "overloaded"))
        ticket = self.queues.enter(model, self.clock(), shared=not own)
        if self.queues.queued[model] == 1 and not self.router.endpoints.get(model):
            self.cold.fire()  # the first to wait for a model with no replica: the control plane starts one
        waiting = trace.queue() if trace is not None else None
        try:
            with trio.move_on_at(deadline):
                while True:
                    # Every change that can free a replica of it wakes us: a rotation update (which
                    # may also say it is unservable now), a request of it finished, a probe that
                    # reached a down replica.
                    freed = ticket.queue.freed.next()
                    ep, route = self.router.route(model, exclude=tried, prompt=prompt)
                    if ep is not None:
                        return ep, route
                    self._refuse_if_unservable(model)
                    await freed.wait()
        finally:
            self.queues.leave(ticket)
            if waiting is not None:
                waiting.end()
        return None, route

    def _refuse_if_unservable(self, model: str) -> None:
        if (refused := unservable(self.details, self.router.endpoints, model)) is not None:
            raise counted(self.metrics, model, refused)

    async def _relay(self, upstream: UpstreamResponse, job: Job, request: Request) -> Response | StreamingResponse:
        ep = job.endpoint
        assert ep is not None
        if job.trace is not None:
            job.trace.relaying(upstream.status)
        route = job.route
        headers = relayed_headers(
            upstream.headers,
            replica_id=ep.replica_id,
            overhead_s=job.sent_at - job.started,
            request_id=job.rid,
            route=route.header if route is not LEAST else "",
        )
        if route is not LEAST:
            self.metrics.routed(job.model, route)
            if job.prompt is not None and upstream.status < 400:
                self.router.served(ep, job.prompt)  # the engine has the prompt now (its answer began)
        if upstream.header(b"content-length") is not None:
            try:
                body = await upstream.read(MAX_BUFFERED_BODY)  # UpstreamBroken: the caller retries
            except UpstreamTooLarge as exc:
                raise counted(self.metrics, job.model, HTTPError(502, str(exc), code="upstream_error")) from None
            finally:
                await upstream.aclose()
            now = self.clock()
            if upstream.status < 400:
                job.served = True
                job.tokens, job.meter = body_usage(body), None  # an answer read whole, streamed or not
            job.answering()
            job.first_byte(now)
            job.finish(upstream.status, now)
            if upstream.status >= 400 and (rewritten := normalized(upstream.status, body)) is not None:
                body = rewritten
                headers = (*(h for h in headers if h[0] != b"content-type"), (b"content-type", b"application/json"))
            return Response(status=upstream.status, body=body, headers=headers)
        job.first_byte(self.clock())
        job.served = upstream.status < 400
        resume = None
        info = self.details.get(job.model)
        sse = (upstream.header(b"content-type") or b"").startswith(b"text/event-stream")
        if not sse or upstream.status != 200:
            job.meter = None
        if (
            self.options.max_migrations
            and upstream.status == 200
            and sse
            and info is not None
            and request.path in ROUTES
        ):
            resume = Continuer(self, request, info.engine)
        return StreamingResponse(status=upstream.status, body=stream(upstream, job, resume), headers=headers)

    async def _continue(
        self, request: Request, engine: str, job: Job, sent_events: bytes, migration: int
    ) -> tuple[UpstreamResponse, Rewrite] | bytes:
        """Continue a stream whose replica failed mid-answer on another (`Continuer`): the
        continuation sent to the next replica that takes it (as a request's attempts go), or the
        stream's last bytes: the end of an answer that was over, or an error event saying why it
        cannot go on."""
        model, route = job.model, request.path
        reading = Reading(route)
        for i, data in enumerate(data_of(sent_events)):  # a long answer's events read a slice at a time
            reading.add(data)
            if i % 256 == 255:
                await trio.lowlevel.checkpoint()
        sent = reading.sent()
        if sent.done:
            return self._migrated(job, "finished", b"")
        if sent.finished:  # the last token had come; only its usage and [DONE] were missing
            return self._migrated(job, "finished", b"data: [DONE]\n\n")
        why, payload = sent.not_exact, b""
        if not why:
            try:
                outcome, why, payload = await self.json.parse(
                    job.body, continuation_payload, route, engine, sent.text, sent.tokens
                )
            except (HTTPError, ParserBusy) as exc:  # InvalidJson is an HTTPError
                outcome, why = NOT_EXACT, f"its body could not be read again: {exc}"
            if outcome == FINISHED:
                return self._migrated(job, "finished", finish_event(route, sent, "length") + b"data: [DONE]\n\n")
        if why:
            message = f"the replica answering failed mid-answer, and this answer cannot be continued exactly: {why}"
            return self._migrated(job, "not_exact", error_event(message, "replica_failed"))
        timeout_s = self._queue_timeout_s(model)
        deadline = self.clock() + timeout_s
        tried: set[Endpoint] = set()
        last = ""
        for _ in range(self.options.max_attempts):
            try:
                ep, job.route = await self._wait_for_endpoint(model, tried, None, deadline, job.trace)
            except HTTPError as exc:
                last = exc.message
                break
            if ep is None:
                last = last or f"no ready replica of {model!r} within {timeout_s:g} s"
                break
            self.router.acquire(ep)
            job.endpoint = ep
            headers = upstream_headers(request, ep, job.rid)
            if job.trace is not None:
                headers = job.trace.attempt(ep.replica_id, ep.host, ep.port, headers, migration)
            try:
                upstream = await self.pool.send(ep.host, ep.port, request.method, route, headers, payload)
            except UpstreamUnavailable as exc:
                last, reason = str(exc), "first_byte" if isinstance(exc, UpstreamNoFirstByte) else "connect"
            else:
                if upstream.status == 200:
                    log.info(
                        "gateway_stream_migrated",
                        model=model,
                        to=ep.replica_id,
                        migration=migration,
                        pieces_before=sent.tokens,
                        request_id=job.rid,
                    )
                    self.metrics.migrations.inc(model=model, outcome="continued")
                    if job.trace is not None:
                        job.trace.relaying(200)
                    return upstream, Rewrite(route, sent, migration)
                if upstream.status not in _RETRY_STATUSES:
                    # The replica is well and refused the continuation itself (say 400: the prompt
                    # and the answer so far past its context): another would too. It stays in
                    # rotation, and the client gets its reason.
                    job.leave_replica()
                    return self._migrated(job, "refused", await _refusal_event(upstream, ep.replica_id))
                await upstream.aclose()
                last, reason = f"{ep.replica_id} answered {upstream.status}", str(upstream.status)
            self._attempt_failed(job, ep, last, reason, tried)
        message = f"the replica answering failed mid-answer, and no other could continue it: {last}"
        return self._migrated(job, "failed", error_event(message, "replica_failed"))

    def _migrated(self, job: Job, outcome: str, last: bytes) -> bytes:
        self.metrics.migrations.inc(model=job.model, outcome=outcome)
        if outcome != "continued":
            log.warning("gateway_stream_not_continued", model=job.model, outcome=outcome, request_id=job.rid)
        return last

    def render_metrics(self) -> str:
        self.metrics.mirror(self.router, self.queued, self.in_flight)
        return self.metrics.render()


async def _refusal_event(upstream: UpstreamResponse, replica_id: str) -> bytes:
    """A stream's last event when `replica_id` refused its continuation with an error answer: the
    engine's own error in OpenAI's shape (its code kept: `context_length_exceeded` where the
    prompt and the answer so far do not fit), its message saying the replica before failed. The
    answer is read bounded and closed."""
    try:
        body = await upstream.read(MAX_REWRITTEN)
    except (UpstreamBroken, UpstreamTooLarge):
        body = b""
    finally:
        await upstream.aclose()
    prefix = f"the replica answering failed mid-answer, and {replica_id} refused to continue it ({upstream.status})"
    error = openai_error(upstream.status, body)
    if error is None:
        return error_event(prefix, "replica_failed")
    error["message"] = f"{prefix}: {error['message']}"
    return encode({"error": error})


@attrs.define
class Continuer:
    """A stream's way on (`job.Resume`): `Gateway._continue` for its request and its model's engine."""

    gw: Gateway
    request: Request
    engine: str

    @property
    def max_migrations(self) -> int:
        return self.gw.options.max_migrations

    @property
    def stall_s(self) -> float:
        return self.gw.options.stream_stall_s

    @property
    def budget(self) -> KeptBudget:
        return self.gw.kept

    async def __call__(self, job: Job, sent: bytes, migration: int) -> tuple[UpstreamResponse, Rewrite] | bytes:
        return await self.gw._continue(self.request, self.engine, job, sent, migration)
