"""The sim engine's HTTP side: routes, the API key, readiness, and the time each answer takes.

Time is simulated with `trio.sleep`, so a test on a fake clock sees exact figures: an answer
takes `prompt_tokens * prompt_token_ms` before its first token and `output_token_ms` before
each token. A streamed answer sends each token as it is "generated"; a whole one is sent
after the same total time.

Until `serving` is set (rank 0, after the rendezvous and the startup delay) every route
answers 503 with what it is waiting for, as llama-server answers "Loading model" — except
`/metrics`, the process's own figures (its event loop's lag, `llmgw.looplag`), which answers
from the start and needs no key, as vLLM's does.
"""

from __future__ import annotations

import hmac
import time
import uuid
from collections.abc import AsyncIterator, Callable

import trio

from llmgw.http.errors import HTTPError
from llmgw.http.jsonworkers import JsonWorkers, parse_body
from llmgw.http.messages import Request, Response, StreamingResponse, allow
from llmgw.log import get_logger
from llmgw.looplag import LagMonitor
from llmgw.simengine import api
from llmgw.simengine.options import SimOptions

log = get_logger("llmgw.sim")

ROUTES = {
    "/health": "GET",
    "/v1/models": "GET",
    "/v1/chat/completions": "POST",
    "/v1/completions": "POST",
    "/metrics": "GET",
}


class SimEngine:
    def __init__(
        self,
        options: SimOptions,
        *,
        wall_clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
        json_workers: JsonWorkers | None = None,
        loop_lag: LagMonitor | None = None,
    ) -> None:
        self.options = options
        # Large bodies are parsed in a worker process (started at the first); `aclose` stops it.
        self.json = json_workers or JsonWorkers()
        self.loop_lag = loop_lag or LagMonitor()  # fed by `serve_loop_lag` where the process runs one
        self.wall_clock = wall_clock
        self.new_id = new_id
        self.created = int(wall_clock())
        self.serving = False
        self._waiting_for: Callable[[], str] = lambda: "starting"

    async def aclose(self) -> None:
        await self.json.aclose()

    def set_waiting(self, describe: Callable[[], str]) -> None:
        """What the 503 answers say while not serving: asked at each request, so it is current."""
        self._waiting_for = describe

    async def handle(self, request: Request) -> Response | StreamingResponse:
        fields: dict[str, object] = {}
        try:
            response = await self._route(request, fields)
        except HTTPError as exc:
            log.debug("sim_request", method=request.method, path=request.path, status=exc.status, error=exc.message)
            raise
        log.debug("sim_request", method=request.method, path=request.path, status=response.status, **fields)
        return response

    async def _route(self, request: Request, fields: dict[str, object]) -> Response | StreamingResponse:
        method = ROUTES.get(request.path)
        if method is None:
            raise HTTPError(
                404, f"no route {request.path!r}; this server has {', '.join(ROUTES)}", kind="not_found_error"
            )
        allow(request, method)
        if request.path == "/metrics":
            return Response(
                status=200,
                body=self.loop_lag.render(trio.current_time()).encode(),
                headers=(("content-type", "text/plain; version=0.0.4; charset=utf-8"),),
            )
        if request.path.startswith("/v1/"):
            self._authorize(request)
        if not self.serving:
            raise HTTPError(503, f"not serving yet: {self._waiting_for()}", kind="unavailable_error")
        if request.path == "/health":
            return Response.json(200, {"status": "ok"})
        if request.path == "/v1/models":
            return Response.json(200, api.models_body(self.options.model, self.created))
        kind: api.Kind = "chat" if request.path == "/v1/chat/completions" else "completion"
        job = await parse_body(
            request, self.json, api.job_of, kind, self.options.model, self.options.max_tokens_default
        )
        return await self.answer(job, fields)

    def _authorize(self, request: Request) -> None:
        key = self.options.api_key
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise _unauthorized("missing API key: send 'Authorization: Bearer KEY' with this replica's key")
        if not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise _unauthorized("incorrect API key for this replica")

    async def answer(self, job: api.Job, fields: dict[str, object] | None = None) -> Response | StreamingResponse:
        """The answer to a checked request, after the time it takes (a stream: as it goes)."""
        completion = api.answer_of(job)
        if fields is not None:
            fields.update(prompt_tokens=job.prompt_tokens, completion_tokens=completion.tokens, stream=job.stream)
        prefix = "chatcmpl-" if job.kind == "chat" else "cmpl-"
        ident, created = prefix + self.new_id(), int(self.wall_clock())
        prompt_s = job.prompt_tokens * self.options.prompt_token_ms / 1000
        token_s = self.options.output_token_ms / 1000
        if not job.stream:
            await trio.sleep(prompt_s + completion.tokens * token_s)
            body = b""
            for part in api.whole_body(job, completion, id=ident, created=created):
                if part is None:
                    await trio.lowlevel.checkpoint()  # a slice of logprobs built: let others run
                else:
                    body = part
            return Response(status=200, body=body, headers=(("content-type", "application/json"),))

        async def events() -> AsyncIterator[bytes]:
            await trio.sleep(prompt_s)
            for is_token, event in api.stream_events(job, completion, id=ident, created=created):
                if is_token:
                    await trio.sleep(token_s)
                yield event

        return StreamingResponse(
            status=200,
            body=events(),
            headers=(("content-type", "text/event-stream"), ("cache-control", "no-cache")),
        )


def _unauthorized(message: str) -> HTTPError:
    return HTTPError(401, message, kind="authentication_error", headers=(("www-authenticate", "Bearer"),))
