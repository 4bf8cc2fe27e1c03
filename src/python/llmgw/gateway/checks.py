"""The checks a request meets on its way to a replica, each refusal an `HTTPError` in the gateway's
words (docs/gateway.md's error table) and counted in `llmgw_gateway_requests_total` where it is
made: who is asking (`authenticate`: 401), may that key use the model and is it served
(`check_model`: 403, 404), does the model's engine serve the route (`check_route`: 404 naming
what it serves), can any replica of it serve now (`unservable`: 503 at once, not retried).

Pure: each takes what it judges by (the key table, the router's models, the provider's details)
and returns or raises; `Gateway._forward` calls them in that order, from the head first, so a
refused request's body is never read.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from llmgw.errors import cut
from llmgw.gateway.keys import KeyTable
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.http.errors import HTTPError
from llmgw.http.messages import Request
from llmgw.wire.gateway_link import GatewayKey, ModelInfo

RETRY_AFTER_S = 5  # Retry-After of a 503 for no replica, in seconds


def authenticate(keys: KeyTable, request: Request, metrics: GatewayMetrics) -> GatewayKey:
    """The valid key the request's `Authorization: Bearer` names, or 401."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise counted(
            metrics,
            "-",
            HTTPError(
                401,
                "no API key: send 'Authorization: Bearer KEY'; an operator creates keys with "
                "`llmgw ctl keys create NAME`",
                code="invalid_api_key",
                headers=(("www-authenticate", "Bearer"),),
            ),
        )
    row = keys.authenticate(token.strip(), request.per_connection)
    if row is None:
        raise counted(
            metrics,
            "-",
            HTTPError(
                401,
                "invalid API key: it is unknown or revoked (`llmgw ctl keys list`)",
                code="invalid_api_key",
                headers=(("www-authenticate", "Bearer"),),
            ),
        )
    return row


def check_model(key: GatewayKey, model: str, models: Collection[str], metrics: GatewayMetrics) -> None:
    """As soon as the model is known, before anything is queued: may this key use it, and is it
    one of `models` (those in rotation)."""
    if key.models and model not in key.models:
        raise counted(
            metrics,
            model,
            HTTPError(
                403,
                f"API key {key.name!r} may not use model {model!r}; it may use {', '.join(key.models)}",
                code="model_not_allowed",
                param="model",
            ),
        )
    if model not in models:
        raise counted(metrics, "-", model_not_found(model, models))


def check_route(details: Mapping[str, ModelInfo], model: str, path: str, metrics: GatewayMetrics) -> None:
    """A model whose engine does not serve `path` gets the gateway's own 404 (not the engine's,
    whatever that would say): the model, its engine and what it serves."""
    info = details.get(model)
    if info is None or not info.routes or path in info.routes:
        return
    raise counted(
        metrics,
        model,
        HTTPError(
            404,
            f"the model {model!r} (engine {info.engine or 'unknown'}) does not serve POST {path}; "
            f"it serves {', '.join(info.routes)}",
            code="unsupported_route",
            param="model",
        ),
    )


def unavailable(why: str, code: str, retry_after_s: int = RETRY_AFTER_S) -> HTTPError:
    """A 503 with Retry-After."""
    return HTTPError(503, why, kind="server_error", code=code, headers=(("retry-after", str(max(1, retry_after_s))),))


def unservable(details: Mapping[str, ModelInfo], endpoints: Mapping[str, Sequence], model: str) -> HTTPError | None:
    """503 at once for a model none of whose replicas can become ready (the provider says why)
    and that has none in this gateway's rotation either (`endpoints`, the router's by model);
    None while one may come."""
    info = details.get(model)
    if info is None or not info.unservable or endpoints.get(model):
        return None
    error = unavailable(
        f"no replica of {model!r} can serve now: {info.unservable}", "model_unavailable", info.retry_after_s
    )
    error.headers = (*error.headers, ("x-should-retry", "false"))
    return error


def model_not_found(model: str, known: Collection[str]) -> HTTPError:
    listed = ", ".join(sorted(known)) or "none"
    return HTTPError(
        404,
        f"the model {cut(model)!r} does not exist; this gateway serves: {listed}",
        code="model_not_found",
        param="model",
    )


def counted(metrics: GatewayMetrics, model: str, error: HTTPError) -> HTTPError:
    """`error`, counted as the answer to a request for `model` ("-": not known yet)."""
    metrics.answered(model, error.status)
    return error
