"""The admin API's routes for the catalog's models added while the cluster runs (`HubModels`):

    POST   /admin/v1/models                 add one from the Hub: {name, hf, revision, file, quant,
                                            engine, replicas, gpus_per_replica, nodes_per_replica,
                                            memory_gb, args, routing, token}; 201 with the entry
    DELETE /admin/v1/models/NAME            remove one added so; its replicas stop
    GET    /admin/v1/models/search?q=TEXT[&limit=N]   repositories of the Hub matching TEXT
    POST   /admin/v1/models/NAME/stage      {nodes}: those nodes download its files now, ahead of
                                            its replicas; 202 with the nodes asked
    POST   /admin/v1/models/NAME/update     {revision, engine, args, retry}: a model added so
                                            resolved again with what is given (its replicas are
                                            replaced one at a time); `retry`: a stopped rollout of
                                            any model goes again; 200 with the entry

The body is read strictly, as every admin input is (`llmgw.server.admin.api`): only these
fields, of their types and within their ranges. `token` (a gated repository's) is taken here and
never answered back. The route is reached, and its caller authorized, through `api.AdminAPI`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import attrs

from llmgw.config import NAME, Secret
from llmgw.errors import LlmgwError, MachineError, UsageError, shown
from llmgw.http import params
from llmgw.http.errors import HTTPError
from llmgw.http.jsonbody import read_json
from llmgw.http.messages import Request, Response, allow
from llmgw.hub.client import GatedRepository, HubError
from llmgw.hub.resolve import AddRequest
from llmgw.server.admin import audit
from llmgw.server.admin.models import ModelDoesNotFit, ModelExists, UnknownModel
from llmgw.server.errors import StoreError

if TYPE_CHECKING:
    from llmgw.server.admin.models import HubModels

MODELS = "/admin/v1/models"
SEARCH = "/admin/v1/models/search"
_MODEL = re.compile(r"^/admin/v1/models/([^/]+)$")
_STAGE = re.compile(r"^/admin/v1/models/([^/]+)/stage$")
_UPDATE = re.compile(r"^/admin/v1/models/([^/]+)/update$")
UPDATE_FIELDS = {"revision", "engine", "args", "retry"}
MAX_STAGE_NODES = 10_000
MAX_REPLICAS = 1000
MAX_GPUS = 64
MAX_NODES = 64
MAX_ARGS = 64
MAX_TEXT = 200  # a repository name, a revision, a pattern
MAX_TOKEN = 4096
SEARCH_QUERY = {"q": "the text to look for in repository names", "limit": "how many to list, 1 to 100 (default 20)"}

_STRINGS = {"hf", "revision", "file", "quant", "engine", "routing", "token"}
_COUNTS = {"replicas": (1, MAX_REPLICAS), "gpus_per_replica": (0, MAX_GPUS), "nodes_per_replica": (1, MAX_NODES)}
FIELDS = {"name", *_STRINGS, *_COUNTS, "memory_gb", "args"}


def serves(path: str) -> bool:
    return path in (SEARCH, MODELS) or any(p.match(path) is not None for p in (_MODEL, _STAGE, _UPDATE))


# How the catalog's and the Hub's errors are answered (the most specific class first); the
# store's are the admin API's (`api.ANSWERS`: 503 with Retry-After). Whatever is refused, the
# catalog is as it was.
_ANSWERS: tuple[tuple[type[LlmgwError], int, str], ...] = (
    (ModelExists, 409, "invalid_request_error"),
    (UnknownModel, 404, "not_found_error"),
    (ModelDoesNotFit, 422, "invalid_request_error"),
    (GatedRepository, 403, "permission_error"),
    (UsageError, 400, "invalid_request_error"),
    (HubError, 502, "upstream_error"),
    (MachineError, 500, "server_error"),
)


async def model_routes(models: HubModels, request: Request) -> Response:
    """POST /admin/v1/models, DELETE /admin/v1/models/NAME, GET /admin/v1/models/search."""
    try:
        return await _route(models, request)
    except LlmgwError as exc:
        if isinstance(exc, StoreError):
            raise
        for kind, status, error_type in _ANSWERS:
            if isinstance(exc, kind):
                raise HTTPError(status, str(exc), kind=error_type) from None
        raise


async def _route(models: HubModels, request: Request) -> Response:
    if request.path == SEARCH:
        allow(request, "GET")
        q = params.query(request, SEARCH_QUERY)
        text = q.get("q", "")
        if len(text) > MAX_TEXT:
            raise HTTPError(400, f"q is {len(text)} characters; give at most {MAX_TEXT}")
        limit = params.whole_number(q["limit"], "limit", 1, 100) if "limit" in q else 20
        return Response.json(200, {"results": await models.search(text, limit=limit)})
    stage = _STAGE.match(request.path)
    if stage is not None:
        allow(request, "POST")
        params.query(request, {})
        name = _model_name(stage.group(1))
        body = await read_json(request)
        nodes = body.get("nodes") if isinstance(body, dict) and set(body) == {"nodes"} else None
        if (
            not isinstance(nodes, list)
            or not 0 < len(nodes) <= MAX_STAGE_NODES
            or not all(isinstance(n, str) and NAME.fullmatch(n) for n in nodes)
        ):
            raise HTTPError(400, f'the body must be {{"nodes": [NODE, ...]}}: 1 to {MAX_STAGE_NODES} node ids')
        staged = await models.stage(name, list(dict.fromkeys(nodes)))
        audit.describe(request, "model.stage", name, nodes=nodes)
        return Response.json(202, staged)
    update = _UPDATE.match(request.path)
    if update is not None:
        allow(request, "POST")
        params.query(request, {})
        name = _model_name(update.group(1))
        asked = update_request(await read_json(request))
        updated = await models.update(name, **asked)
        audit.describe(request, "model.update", name, **{k: v for k, v in asked.items() if v})
        return Response.json(200, updated)
    if request.path != MODELS:
        allow(request, "DELETE")
        params.query(request, {})
        name = _model_name(_MODEL.match(request.path).group(1))
        removed = await models.remove(name)
        audit.describe(request, "model.remove", name)
        return Response.json(200, removed)
    allow(request, "POST")
    params.query(request, {})
    req, token = add_request(await read_json(request))
    added = await models.add(req, token)
    asked = {k: v for k, v in attrs.asdict(req).items() if v and k != "name"}
    audit.describe(request, "model.add", req.name, **asked, token=token is not None)  # "(given)", never the token
    return Response.json(201, {"model": added})


def _model_name(raw: str) -> str:
    name = params.path_segment(raw, "model name")
    if not NAME.fullmatch(name):
        raise HTTPError(400, f"model name {shown(name)} is not valid: letters, digits, '.', '_' and '-'")
    return name


def update_request(body: Any) -> dict[str, Any]:
    """The body of POST /admin/v1/models/NAME/update, checked field by field: `HubModels.update`'s
    keywords. 400 naming the first wrong one."""
    if not isinstance(body, dict):
        raise HTTPError(400, "the body must be a JSON object: {revision, engine, args, retry}")
    unknown = sorted(set(body) - UPDATE_FIELDS)
    if unknown:
        raise HTTPError(400, f"unknown fields {unknown}; an update takes {', '.join(sorted(UPDATE_FIELDS))}")
    out: dict[str, Any] = {}
    for key in ("revision", "engine"):
        value = body.get(key, "")
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            raise HTTPError(400, f"'{key}' must be a string of at most {MAX_TEXT} characters, got {shown(value)}")
        out[key] = value
    if "args" in body:
        args = body["args"]
        if (
            not isinstance(args, list)
            or len(args) > MAX_ARGS
            or not all(isinstance(a, str) and len(a) <= 1000 for a in args)
        ):
            raise HTTPError(400, f"'args' must be a list of at most {MAX_ARGS} strings, got {shown(args)}")
        out["args"] = tuple(args)
    retry = body.get("retry", False)
    if not isinstance(retry, bool):
        raise HTTPError(400, f"'retry' must be true or false, got {shown(retry)}")
    out["retry"] = retry
    return out


def add_request(body: Any) -> tuple[AddRequest, Secret | None]:
    """The body of POST /admin/v1/models, checked field by field; 400 naming the first wrong one."""
    if not isinstance(body, dict):
        raise HTTPError(400, "the body must be a JSON object: {name, hf, ...}")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise HTTPError(400, f"unknown fields {unknown}; a model takes {', '.join(sorted(FIELDS))}")
    for key in ("name", "hf"):
        if not isinstance(body.get(key), str) or not body[key]:
            raise HTTPError(400, f"'{key}' must be a non-empty string, got {shown(body.get(key))}")
    if not NAME.fullmatch(body["name"]):
        raise HTTPError(
            400, f"model name {shown(body['name'])} may use only letters, digits, '.', '_' and '-' (63 at most)"
        )
    fields: dict[str, Any] = {"name": body["name"]}
    for key in _STRINGS:
        value = body.get(key, "")
        limit = MAX_TOKEN if key == "token" else MAX_TEXT
        if not isinstance(value, str) or len(value) > limit:
            what = "a string" if not isinstance(value, str) else f"at most {limit} characters"
            raise HTTPError(400, f"'{key}' must be {what}, got {shown(value) if key != 'token' else 'something else'}")
        if key != "token":
            fields[key] = value
    for key, (low, high) in _COUNTS.items():
        if key in body:
            value = body[key]
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise HTTPError(400, f"'{key}' must be a whole number from {low} to {high}, got {shown(value)}")
            fields[key] = value
    if "memory_gb" in body:
        value = body["memory_gb"]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1 << 20:
            raise HTTPError(400, f"'memory_gb' must be a number of GiB from 0 (the estimate) up, got {shown(value)}")
        fields["memory_gb"] = float(value)
    args = body.get("args", [])
    if (
        not isinstance(args, list)
        or len(args) > MAX_ARGS
        or not all(isinstance(a, str) and len(a) <= 1000 for a in args)
    ):
        raise HTTPError(400, f"'args' must be a list of at most {MAX_ARGS} strings, got {shown(args)}")
    fields["args"] = tuple(args)
    token = body.get("token") or ""
    return AddRequest(**fields), (Secret(token) if token else None)
