"""The admin API's routes for token budgets (`llmgw.server.state.budgetring.BudgetRing`):

    GET    /admin/v1/budgets            every budget with what it spent in its period now, what
                                        is handed out to gateways and not spent, what remains
                                        and when it resets
    POST   /admin/v1/budgets            set one: {scope_kind: "key"|"team", scope, model ("": all),
                                        period: "minute"|"day"|"month", tokens}; 201 when new,
                                        200 with the new amount of one there
    DELETE /admin/v1/budgets/ID         remove one (ID: SCOPE_KIND:SCOPE:MODEL:PERIOD)

The body is read strictly, as every admin input is (`llmgw.server.admin.api`): only these
fields, of their types. Each change is described for the audit log (`budget.set`,
`budget.remove`). The route is reached, and its caller authorized, through `api.AdminAPI`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from llmgw.errors import shown
from llmgw.http import params
from llmgw.http.errors import HTTPError
from llmgw.http.jsonbody import read_json
from llmgw.http.messages import Request, Response, allow
from llmgw.log import get_logger
from llmgw.server.admin import audit

if TYPE_CHECKING:
    from llmgw.server.state.budgetring import BudgetRing

log = get_logger("llmgw.admin")

BUDGETS = "/admin/v1/budgets"
_BUDGET = re.compile(r"^/admin/v1/budgets/([^/]+)$")
FIELDS = ("scope_kind", "scope", "model", "period", "tokens")


def serves(path: str) -> bool:
    return path == BUDGETS or _BUDGET.match(path) is not None


async def budget_routes(ring: BudgetRing, request: Request) -> Response:
    params.query(request, {})
    found = _BUDGET.match(request.path)
    if found is not None:
        allow(request, "DELETE")
        budget_id = params.path_segment(found.group(1), "budget id")
        removed = await ring.remove(budget_id)
        audit.describe(request, "budget.remove", budget_id, tokens=removed.tokens)
        log.info("budget_removed", budget=budget_id)
        return Response.json(200, {"removed": budget_id})
    if request.method in ("GET", "HEAD"):
        return Response.json(200, {"budgets": await ring.views()})
    allow(request, "POST")
    body = await read_json(request)
    if not isinstance(body, dict):
        raise HTTPError(400, f"the body must be a JSON object: {{{', '.join(FIELDS)}}}")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise HTTPError(400, f"unknown fields {unknown}; a budget takes {', '.join(FIELDS)}")
    for field in ("scope_kind", "scope", "period"):
        if not isinstance(body.get(field), str):
            raise HTTPError(400, f"{field!r} must be a string, got {shown(body.get(field))}")
    budget, new = await ring.set(
        body["scope_kind"], body["scope"], body.get("model", ""), body["period"], body.get("tokens")
    )
    audit.describe(request, "budget.set", budget.id, tokens=budget.tokens, new=new)
    log.info("budget_set", budget=budget.id, tokens=budget.tokens, new=new)
    views = {v["id"]: v for v in await ring.views()}
    return Response.json(201 if new else 200, {"budget": views.get(budget.id)})
