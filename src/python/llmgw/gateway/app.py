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
it is known: one the key may not use is a 403, an unknown one a 404, one whose engine does not
serve the route a 404 naming the model, its engine and the routes it serves. A replica is picked
by `Router`; with none free the request waits in a bounded queue until one is, or 503 with
Retry-After at the deadline — but only while one can come: a model the control plane says no
replica of can become ready now (`ModelInfo.unservable`: none placed, every one failed, their
nodes lost) is a 503 at once, with `x-should-retry: false` so that OpenAI's SDK does not retry it. The request goes out with the replica's
own engine key. An attempt that fails while nothing has gone to the client yet (no connection
within the connect timeout, refused or reset, no response head within the first-byte timeout
and no answer to a probe, a 502/503, a body read whole that broke off) takes the replica out
of rotation and sends the request to another, at most `max_attempts` times in all; a stream
that breaks once relayed takes the replica out too, but is not retried. A replica out of
rotation is probed (`serve_probes`) every `probe_interval_s` and returns when a probe reaches
it. The answer is relayed as it comes: a body with a length is read whole (bounded), anything
else (SSE) is passed on chunk by chunk without being parsed; a client that goes away closes the
upstream connection, which cancels the work on the engine.

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
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import attrs
import trio

from llmgw.config import GatewaySection
from llmgw.errors import cut
from llmgw.gateway.engineerrors import normalized
from llmgw.gateway.errors import (
    UpstreamBroken,
    UpstreamError,
    UpstreamNoFirstByte,
    UpstreamTooLarge,
    UpstreamUnavailable,
)
from llmgw.gateway.fields import NO_PREFIX, PrefixModels, RequestFields, request_fields, slot_tasks
from llmgw.gateway.headers import REQUEST_ID, relayed_headers, request_id, upstream_headers
from llmgw.gateway.keys import KeyTable
from llmgw.gateway.kvevents import Event, EventsError, Subscription, batch_of, decode_batch_async
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.prefix import Prompt
from llmgw.gateway.routing import LEAST, Endpoint, Rotation, Route, Router, Verdict
from llmgw.gateway.upstream import Connect, UpstreamPool, UpstreamResponse
from llmgw.http.errors import BodyAborted, HTTPError
from llmgw.http.jsonbody import InvalidJson, JsonWorkers, ParserBusy, parse_body
from llmgw.http.messages import Request, Response, StreamingResponse, allow
from llmgw.log import get_logger
from llmgw.wakeup import Wakeup
from llmgw.wire.gateway_link import OPENAI_ROUTES, GatewayKey, ModelInfo

log = get_logger("llmgw.gateway")

FORWARDED = frozenset(OPENAI_ROUTES)
MODELS_PREFIX = "/v1/models/"
_RETRY_STATUSES = (502, 503)
# What the gateway's knobs do not set (server.toml's `[gateway]`, `GatewaySection`, sets the rest):
RETRY_AFTER_S = 5  # Retry-After of a 503 for no replica, in seconds
MAX_BUFFERED_BODY = 64 << 20  # an upstream answer with a length is read whole, up to this
# How often a llama.cpp replica of a model routed by prefix is asked what its cache holds (`_cache_reports`).
CACHE_REPORT_INTERVAL_S = 2.0


class EndpointProvider(Protocol):
    """Where the gateway's rotation comes from: the control plane (`server.views.GatewayEndpoints`),
    the table a gateway process holds (`gatewayd.table.TableEndpoints`), or a fixed set in the
    tests and the bench (`testlib.endpoints.StaticEndpoints`)."""

    def gateway_rotation(self) -> Rotation: ...

    def rotation_changed(self) -> trio.Event:
        """An event set at the next change of `gateway_rotation()`."""
        ...


class Gateway:
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
    ) -> None:
        """`connect`: how the pool opens a connection to an engine (`upstream.open_tcp` by
        default; tests reach engines' handlers over memory streams)."""
        self.provider = provider
        # Large bodies are parsed in a worker process (started at the first); its owner closes it.
        self.json = json_workers or JsonWorkers()
        self.keys = keys
        self.options = options = options or GatewaySection()
        self.pool = pool or UpstreamPool(
            max_idle_per_endpoint=options.max_idle_per_replica,
            connect_timeout_s=options.connect_timeout_s,
            first_byte_timeout_s=options.first_byte_timeout_s,
            read_timeout_s=options.read_timeout_s,
            probe_timeout_s=options.probe_timeout_s,
            connect=connect,
        )
        self.open_events = open_events  # how a KV-cache events subscription connects (`_subscribe`)
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
        self.rotation_version = 0  # of the rotation routed by now (`Rotation.version`)
        self.details: dict[str, ModelInfo] = {}  # of the models in rotation, as the provider says them
        self.queued: dict[str, int] = {}
        self.in_flight: dict[str, int] = {}
        self.in_flight_total = 0  # the sum of `in_flight`, kept so that a request's end need not add it up
        self.draining = False
        self.refusing = False
        self.freed = Wakeup()  # a replica may have become free (`_wake`)
        self.went_down = Wakeup()  # a replica left rotation: the prober looks again
        self.finished = Wakeup()  # the last request in flight finished
        self.applied = Wakeup()  # a new rotation is routed by (`rotation_version`)

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
        self._wake()

    def _wake(self) -> None:
        self.freed.fire()

    # -- down replicas --------------------------------------------------------------------

    def _failed(self, ep: Endpoint, reason: str, *, client_saw_bytes: bool) -> Verdict:
        verdict = self.router.failed(ep, reason, self.clock(), client_saw_bytes=client_saw_bytes)
        if verdict.went_down:
            log.warning("gateway_replica_down", replica=ep.replica_id, model=ep.model, reason=reason)
            self.metrics.replica_down.inc(model=ep.model, reason=reason)
            self.pool.close_idle(ep.host, ep.port)  # after silence they are likely dead too
            self.went_down.fire()
        return verdict

    async def serve_probes(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Probe each replica out of rotation every `probe_interval_s`; one that answers is back.
        The probes of one round run together, each bounded by the connect and probe timeouts.
        Meanwhile ask the engines that report their cache what they hold (`_cache_reports`)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._cache_reports)
            nursery.start_soon(self._cache_events)
            task_status.started()
            await self._probe_rounds()

    async def _probe_rounds(self) -> None:
        while True:
            went_down = self.went_down.next()
            due = self.router.due_probes(self.clock())
            if due:
                async with trio.open_nursery() as nursery:
                    for ep in due:
                        nursery.start_soon(self._probe, ep)
                continue
            next_at = self.router.next_probe_at()
            with trio.move_on_at(math.inf if next_at is None else next_at):
                await went_down.wait()

    async def _cache_reports(self) -> None:
        """Every `CACHE_REPORT_INTERVAL_S`, each llama.cpp replica of a model routed by prefix is
        asked what it holds (`GET /slots`, with its key; the answer parsed as any body is, off
        the loop when large): one that restarted since, on the same address, is no longer taken
        to hold what it served (`Router.engine_report`). Each bounded by the probe's timeouts; a
        replica that does not answer is the prober's business, not this."""
        while True:
            eps = [
                ep
                for model in self.router.policies
                if (info := self.details.get(model)) is not None and info.engine == "llamacpp"
                for ep in self.router.endpoints.get(model, ())
            ]
            async with trio.open_nursery() as nursery:
                for ep in eps:
                    nursery.start_soon(self._cache_report, ep)
            await trio.sleep(CACHE_REPORT_INTERVAL_S)

    async def _cache_report(self, ep: Endpoint) -> None:
        headers = [(b"authorization", f"Bearer {ep.api_key}".encode())] if ep.api_key else []
        try:
            with trio.fail_after(self.options.connect_timeout_s + self.options.probe_timeout_s):
                upstream = await self.pool.send(ep.host, ep.port, "GET", "/slots", headers, b"")
                try:
                    body = await upstream.read(MAX_BUFFERED_BODY) if upstream.status == 200 else b""
                finally:
                    await upstream.aclose()
            if upstream.status != 200:
                log.debug("gateway_cache_report_refused", replica=ep.replica_id, status=upstream.status)
                return
            tasks = await self.json.parse(body, slot_tasks, what="llama-server's /slots")
        except (
            trio.TooSlowError,
            UpstreamUnavailable,
            UpstreamBroken,
            UpstreamTooLarge,
            InvalidJson,
            ParserBusy,
        ) as exc:
            log.debug("gateway_cache_report_failed", replica=ep.replica_id, reason=str(exc) or type(exc).__name__)
            return
        except Exception:  # - a bug of ours: this report is lost, the gateway's other work goes on
            log.exception("gateway_cache_report_bug", replica=ep.replica_id)
            return
        if self.router.engine_report(ep, tasks):
            log.info("gateway_replica_cache_reset", replica=ep.replica_id, model=ep.model)
            self.metrics.cache_resets.inc(model=ep.model)

    async def _cache_events(self) -> None:
        """A subscription to the KV-cache events of each replica that publishes them (vLLM's,
        SGLang's, `Endpoint.events_port`) of a model routed by prefix, kept while it is in
        rotation at that address (`_subscribe`)."""
        running: dict[str, tuple[tuple[str, int], trio.CancelScope]] = {}
        async with trio.open_nursery() as nursery:
            while True:
                changed = self.applied.next()
                wanted = {
                    ep.replica_id: ep
                    for model in self.router.policies
                    for ep in self.router.endpoints.get(model, ())
                    if ep.events_port
                }
                for rid, (where, scope) in list(running.items()):
                    ep = wanted.get(rid)
                    if ep is None or (ep.host, ep.events_port) != where:
                        scope.cancel()
                        del running[rid]
                for rid, ep in wanted.items():
                    if rid not in running:
                        scope = trio.CancelScope()
                        running[rid] = ((ep.host, ep.events_port), scope)
                        nursery.start_soon(self._subscribe, ep, scope)
                await changed.wait()

    async def _subscribe(self, ep: Endpoint, scope: trio.CancelScope) -> None:
        """Read `ep`'s KV-cache events into the router (`Router.engine_events`) until cancelled;
        a publisher that cannot be reached, or breaks the protocol, is tried again after a
        backoff (1 s doubling to 30 s; from 1 s again after a subscription that delivered)."""
        failures = 0
        with scope:
            while True:
                delivered = False
                try:
                    with trio.fail_after(self.options.connect_timeout_s + self.options.probe_timeout_s):
                        stream = await self.open_events(ep.host, ep.events_port)
                    async with stream:
                        sub = Subscription(stream)
                        with trio.fail_after(self.options.connect_timeout_s + self.options.probe_timeout_s):
                            await sub.open()
                        log.info("gateway_cache_events_subscribed", replica=ep.replica_id, port=ep.events_port)
                        async for frames in sub.messages():
                            seq, payload = batch_of(frames)
                            events = await decode_batch_async(payload)
                            self._engine_events(ep, seq, events)
                            delivered = True
                    reason = "the publisher closed the connection"
                except (OSError, trio.TooSlowError, trio.BrokenResourceError, EventsError) as exc:
                    reason = str(exc) or type(exc).__name__
                except Exception:  # - a bug of ours: this subscription stops, the gateway's other work goes on
                    log.exception("gateway_cache_events_bug", replica=ep.replica_id)
                    return
                failures = 1 if delivered else failures + 1
                (log.info if failures == 1 else log.debug)(
                    "gateway_cache_events_lost", replica=ep.replica_id, port=ep.events_port, reason=reason
                )
                self.metrics.cache_event_failures.inc(model=ep.model)
                await trio.sleep(min(30.0, 2.0 ** (failures - 1)))

    def _engine_events(self, ep: Endpoint, seq: int, events: list[Event]) -> None:
        report = self.router.engine_events(ep, seq, events)
        if report.restarted or report.cleared:
            why = "restarted" if report.restarted else "cleared"
            log.info("gateway_replica_cache_reset", replica=ep.replica_id, model=ep.model, why=why)
            self.metrics.cache_resets.inc(model=ep.model)
        if report.missed:
            self.metrics.cache_events_missed.inc(report.missed, model=ep.model)
        if report.trimmed:
            self.metrics.cache_trimmed.inc(report.trimmed, model=ep.model)

    async def _probe(self, ep: Endpoint) -> None:
        started = self.clock()
        why = await self.pool.probe(ep.host, ep.port)
        self.metrics.probes.inc(result="failed" if why else "reached")
        down = self.router.down.get(ep.replica_id)
        if self.router.probed(ep, started, reached=why is None):
            assert down is not None
            log.info(
                "gateway_replica_back", replica=ep.replica_id, model=ep.model, down_s=round(started - down.since, 3)
            )
            self._wake()
        elif why is not None:
            log.debug("gateway_probe_failed", replica=ep.replica_id, model=ep.model, reason=why)

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
        """Replicas that may take a request now, per model, as the router sees them (its own
        failures taken out)."""
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
            key = self._authenticate(request)
            allowed = sorted(m for m in self.router.models if not key.models or m in key.models)
            return Response.json(200, {"object": "list", "data": [self._model_object(m) for m in allowed]})
        if request.path.startswith(MODELS_PREFIX):
            allow(request, "GET")
            key = self._authenticate(request)
            model = urllib.parse.unquote(request.path[len(MODELS_PREFIX) :])
            if model not in self.router.models or (key.models and model not in key.models):
                raise _model_not_found(model, self.router.models if not key.models else key.models)
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

    def _authenticate(self, request: Request) -> GatewayKey:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _counted(
                self,
                "-",
                HTTPError(
                    401,
                    "no API key: send 'Authorization: Bearer KEY'; an operator creates keys with "
                    "`llmgw ctl keys create NAME`",
                    code="invalid_api_key",
                    headers=(("www-authenticate", "Bearer"),),
                ),
            )
        row = self.keys.authenticate(token.strip(), request.per_connection)
        if row is None:
            raise _counted(
                self,
                "-",
                HTTPError(
                    401,
                    "invalid API key: it is unknown or revoked (`llmgw ctl keys list`)",
                    code="invalid_api_key",
                    headers=(("www-authenticate", "Bearer"),),
                ),
            )
        return row

    async def _forward(self, request: Request, rid: str) -> Response | StreamingResponse:
        started = self.clock()
        if self.refusing:
            raise _counted(self, "-", self._unavailable("the gateway is shutting down", "shutting_down"))
        # From the head alone: who is asking, and may they ask now. The body is not read yet.
        key = self._authenticate(request)
        request.body_owner = "key:" + key.token_sha256  # its bodies held to a share of the budget
        limited = self.keys.admit(key)
        if limited is not None:
            retry = str(max(1, math.ceil(limited.retry_after_s)))
            raise _counted(
                self,
                "-",
                HTTPError(
                    429, limited.message, kind="requests", code="rate_limit_exceeded", headers=(("retry-after", retry),)
                ),
            )
        try:
            fields = await self._read_fields(request)
            self._check_model(key, fields.model)
            self._check_route(fields.model, request.path)
        except BaseException:
            self.keys.leave(key)
            raise
        job = _Job(self, key, fields.model, started, rid)
        try:
            job.prompt = fields.prompt
            response = await self._attempts(request, job, fields.prompt)
        except BaseException:
            job.finish(None)
            raise
        return response

    async def _read_fields(self, request: Request) -> RequestFields:
        try:
            return await parse_body(request, self.json, request_fields, self.prefix_models)
        except HTTPError as exc:
            raise _counted(self, "-", exc) from None

    def _check_model(self, key: GatewayKey, model: str) -> None:
        """As soon as the model is known, before anything is queued: may this key use it, and
        is it served."""
        if key.models and model not in key.models:
            raise _counted(
                self,
                model,
                HTTPError(
                    403,
                    f"API key {key.name!r} may not use model {model!r}; it may use {', '.join(key.models)}",
                    code="model_not_allowed",
                    param="model",
                ),
            )
        if model not in self.router.models:
            raise _counted(self, "-", _model_not_found(model, self.router.models))

    def _check_route(self, model: str, path: str) -> None:
        """A model whose engine does not serve `path` gets the gateway's own 404 (not the
        engine's, whatever that would say): the model, its engine and what it serves."""
        info = self.details.get(model)
        if info is None or not info.routes or path in info.routes:
            return
        raise _counted(
            self,
            model,
            HTTPError(
                404,
                f"the model {model!r} (engine {info.engine or 'unknown'}) does not serve POST {path}; "
                f"it serves {', '.join(info.routes)}",
                code="unsupported_route",
                param="model",
            ),
        )

    def _unavailable(self, why: str, code: str, retry_after_s: int = RETRY_AFTER_S) -> HTTPError:
        return HTTPError(
            503, why, kind="server_error", code=code, headers=(("retry-after", str(max(1, retry_after_s))),)
        )

    def _unservable(self, model: str) -> HTTPError | None:
        """503 at once for a model none of whose replicas can become ready (the provider says
        why) and that has none in this gateway's rotation either; None while one may come."""
        info = self.details.get(model)
        if info is None or not info.unservable or self.router.endpoints.get(model):
            return None
        error = self._unavailable(
            f"no replica of {model!r} can serve now: {info.unservable}", "model_unavailable", info.retry_after_s
        )
        error.headers = (*error.headers, ("x-should-retry", "false"))
        return error

    async def _attempts(self, request: Request, job: _Job, prompt: Prompt | None) -> Response | StreamingResponse:
        deadline = job.started + self.options.queue_timeout_s
        tried: set[str] = set()
        last = last_reason = ""
        for attempt in range(self.options.max_attempts):
            if not attempt and (unservable := self._unservable(job.model)) is not None:
                raise _counted(self, job.model, unservable)
            ep, job.route = await self._wait_for_endpoint(job.model, tried, prompt, deadline)
            if ep is None:
                if not last and (unservable := self._unservable(job.model)) is not None:
                    raise _counted(self, job.model, unservable)  # became so while it waited
                if last:
                    why, code = f"no replica of {job.model!r} could answer: {last}", "overloaded"
                elif sum(self.queued.values()) >= self.options.max_queue:
                    why, code = f"the queue is full ({self.options.max_queue} requests)", "overloaded"
                else:
                    why, code = (
                        f"no ready replica of {job.model!r} within {self.options.queue_timeout_s:g} s",
                        "model_not_ready",
                    )
                raise _counted(self, job.model, self._unavailable(why + "; try again later", code))
            if attempt:
                self.metrics.retries.inc(model=job.model, reason=last_reason)
            job.prefill = prompt.size - job.route.matched_chars if prompt is not None and job.route is not LEAST else 0
            self.router.acquire(ep, job.prefill)
            job.endpoint = ep
            job.sent_at = self.clock()
            try:
                upstream = await self.pool.send(
                    ep.host,
                    ep.port,
                    request.method,
                    request.path,
                    upstream_headers(request, ep, job.rid),
                    await request.read(),
                )
            except UpstreamUnavailable as exc:
                last, last_reason = str(exc), "first_byte" if isinstance(exc, UpstreamNoFirstByte) else "connect"
            else:
                if upstream.status in _RETRY_STATUSES:
                    await upstream.aclose()
                    last, last_reason = f"{ep.replica_id} answered {upstream.status}", str(upstream.status)
                else:
                    try:
                        return await self._relay(upstream, job)
                    except UpstreamBroken as exc:  # a body read whole: none of it went to the client
                        last, last_reason = str(exc), "broken"
            log.warning(
                "gateway_upstream_failed", replica=ep.replica_id, model=job.model, reason=last, request_id=job.rid
            )
            self.router.release(ep, job.prefill)
            job.endpoint = None
            self._failed(ep, last_reason, client_saw_bytes=False)  # a retry, by the rule
            tried.add(ep.replica_id)
            self._wake()
        raise _counted(
            self,
            job.model,
            self._unavailable(f"{self.options.max_attempts} replicas failed; the last: {last}", "overloaded"),
        )

    async def _wait_for_endpoint(
        self, model: str, tried: set[str], prompt: Prompt | None, deadline: float
    ) -> tuple[Endpoint | None, Route]:
        ep, route = self.router.route(model, exclude=tried, prompt=prompt)
        if ep is not None:
            return ep, route
        if sum(self.queued.values()) >= self.options.max_queue:
            return None, route
        self.queued[model] = self.queued.get(model, 0) + 1
        try:
            with trio.move_on_at(deadline):
                while True:
                    # Every change that can free a replica wakes us: a rotation update, a request
                    # finished, a probe that reached a down replica.
                    freed = self.freed.next()
                    ep, route = self.router.route(model, exclude=tried, prompt=prompt)
                    if ep is not None:
                        return ep, route
                    await freed.wait()
        finally:
            self.queued[model] -= 1
        return None, route

    async def _relay(self, upstream: UpstreamResponse, job: _Job) -> Response | StreamingResponse:
        ep = job.endpoint
        assert ep is not None
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
                raise _counted(self, job.model, HTTPError(502, str(exc), code="upstream_error")) from None
            finally:
                await upstream.aclose()
            now = self.clock()
            job.answering()
            job.first_byte(now)
            job.finish(upstream.status, now)
            if upstream.status >= 400 and (rewritten := normalized(upstream.status, body)) is not None:
                body = rewritten
                headers = (*(h for h in headers if h[0] != b"content-type"), (b"content-type", b"application/json"))
            return Response(status=upstream.status, body=body, headers=headers)
        job.first_byte(self.clock())
        return StreamingResponse(status=upstream.status, body=_stream(upstream, job), headers=headers)

    def render_metrics(self) -> str:
        self.metrics.mirror(self.router, self.queued, self.in_flight)
        return self.metrics.render()


class _Job:
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
        self._first_byte_seen = False
        self._done = False
        gw.in_flight[model] = gw.in_flight.get(model, 0) + 1
        gw.in_flight_total += 1

    def answering(self) -> None:
        """The engine began its answer (a buffered one read, a stream's first chunk): the prompt
        is no longer work ahead of others on its replica."""
        if self.prefill and self.endpoint is not None:
            self.gw.router.prefilled(self.endpoint, self.prefill)
        self.prefill = 0

    def first_byte(self, now: float) -> None:
        if not self._first_byte_seen:
            self._first_byte_seen = True
            self.gw.metrics.first_byte(self.model, now - self.started)

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
        if self.endpoint is not None:
            gw.router.release(self.endpoint, self.prefill)
            self.prefill = 0
            gw._wake()
        if status is not None:
            gw.metrics.answered(self.model, status)
            gw.metrics.timed(self.model, (gw.clock() if now is None else now) - self.started)


async def _stream(upstream: UpstreamResponse, job: _Job) -> AsyncIterator[bytes]:
    status: int | None = 499
    try:
        async for chunk in upstream.body():
            if job.prefill:
                job.answering()
            yield chunk
        status = upstream.status
    except UpstreamError as exc:
        log.warning("gateway_stream_broken", replica=upstream.key, model=job.model, reason=str(exc), request_id=job.rid)
        status = 502
        if job.endpoint is not None:  # out of rotation until probed; the client has part of an answer: no retry
            job.gw._failed(job.endpoint, "broken", client_saw_bytes=True)
        raise BodyAborted(str(exc)) from None
    finally:
        with trio.CancelScope(shield=True):
            await upstream.aclose()  # not read to its end: closed, which stops the engine's work
        job.finish(status)


def _model_not_found(model: str, known) -> HTTPError:
    listed = ", ".join(sorted(known)) or "none"
    return HTTPError(
        404,
        f"the model {cut(model)!r} does not exist; this gateway serves: {listed}",
        code="model_not_found",
        param="model",
    )


def _counted(gw: Gateway, model: str, error: HTTPError) -> HTTPError:
    gw.metrics.answered(model, error.status)
    return error
