"""Messages of the gateway link (gateway <-> control plane), one JSON text frame each.

A gateway (`llmgw gateway`, or one of the control plane's own gateway workers) holds a
certificate of the gateway role (`llmgw ca issue --gateway NAME`; `llmgw.pki.ca.ROLE_GATEWAY`)
and opens a WebSocket at GATEWAY_PATH on the agent port, its upgrade request naming the
gateway in GATEWAY_NAME_HEADER (the certificate's CN) and the process in GATEWAY_INSTANCE_HEADER.
A node certificate is refused there, and a gateway certificate at the agent's AGENT_PATH.

    gateway                                        control plane
    GatewayHello  -------------------------------> first; of GATEWAY_PROTOCOL_VERSION
                  <------------------------------- GatewayWelcome, then RotationChanged,
                                                   KeysChanged and ShareChanged: the whole table
                  <------------------------------- each again, whole, whenever it changes (within a
                                                   second); TableHeartbeat every heartbeat_interval_s
    GatewayHeartbeat  ---------------------------> every heartbeat_interval_s
    LinkError, either way: the sender's last frame before it closes.

Level-triggered like the agent link: each message says the whole of what it reports (the
rotation, the keys, this instance's share), a newer one replacing an unsent older one of its
kind, and a reconnect resends everything. A gateway keeps its last table while the link is
down and serves from it; its staleness is the time since the last frame from the control plane.

Limits across gateways (the stated rule, docs/gateway.md): every gateway instance connected
(each worker process counts as one) enforces its share of a key's limits, `ShareChanged(index,
count)`: with `count` instances, a key limited to R requests a minute refills at R / count a
minute with a burst of max(1, R / count), and one limited to C in flight allows
max(1, C // count + (1 if index < C % count else 0)). The control plane renumbers the
instances as they come and go. An instance cut off from it keeps its last share.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from llmgw.wire.agent_link import LinkError, Redirect

# 1: the first gateway link. 2: heartbeats carry the gateway's metrics (`MetricFamily`), its
# requests on each replica (`ReplicaLoad`), the rotation it routes by and the keys it holds (the
# `version` of each). 3: the rotation says what the gateway needs of each model besides its
# replicas (`ModelInfo`: its engine's routes, when it entered the catalog, why none can become
# ready), and which replicas' state is not known yet (`unknown`). 4: a standby control plane answers a
# hello with where the leader is (the agent link's `Redirect`). 5: a heartbeat sent at once (for a new
# rotation or new keys) leaves the metrics out (`metrics` null: as the last that had them said), a
# sample leaves out its fields at their defaults (a gauge's `counts` and `sum`, a histogram's `value`).
# 6: a model says how the gateway routes its requests (`ModelInfo.routing`). 8: models on demand:
# heartbeats carry each model's load (`ModelLoad`), one goes at once when a request starts waiting
# for a model with no replica ready, and a model says whether it starts on demand and how long
# and how many requests for it may wait (`ModelInfo.on_demand`, `max_queue`, `queue_timeout_s`).
# 9: who used what: a gateway reports its usage (`UsageReport`, one at a time, each acknowledged with
# `UsageAck` once it is in the ledger) and a key says its team (`GatewayKey.team`).
# 10: token budgets: the budgets (`BudgetsChanged`) and this instance's grants of them
# (`GrantsChanged`) are parts of the table; a gateway reports what it holds (`BudgetReport`).
GATEWAY_PROTOCOL_VERSION = 10

GATEWAY_PATH = "/v1/gateway"
GATEWAY_NAME_HEADER = "x-llmgw-gateway"
GATEWAY_INSTANCE_HEADER = "x-llmgw-gateway-instance"


# -- gateway -> control plane --------------------------------------------------------------


@attrs.frozen(kw_only=True)
class GatewayHello:
    protocol_version: int
    name: str  # the certificate's CN
    instance: str  # unique per process (a random token): one gateway runs several workers
    gateway_version: str
    started_at: float  # unix time the process started


@attrs.frozen(kw_only=True)
class Sample:
    """One series of a family: its label values, in the family's order, and its value (a counter
    or a gauge), or a histogram's observations per bucket (not cumulative, the last one above
    every bound) and their sum."""

    labels: tuple[str, ...] = ()
    value: float = 0.0
    counts: tuple[int, ...] = ()
    sum: float = 0.0


@attrs.frozen(kw_only=True)
class MetricFamily:
    """A metric family as the instance's own /metrics holds it (`llmgw.metrics`): what the
    control plane's /metrics shows of its own workers and the cluster page's history reads of
    every gateway (docs/gateway.md). Counters count since the instance started."""

    name: str
    help: str
    kind: str  # counter, gauge or histogram
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()  # a histogram's upper bounds
    samples: tuple[Sample, ...] = ()


@attrs.frozen(kw_only=True)
class ReplicaLoad:
    replica_id: str
    outstanding: int  # requests this instance has on the replica now


@attrs.frozen(kw_only=True)
class ModelLoad:
    """One model's requests on this instance now, and since it started: what the control plane
    scales the model's replicas by (`llmgw.server.state.autoscale`). Only models with a request
    queued or in flight now, or taken since the instance started, are listed."""

    model: str
    queued: int = 0  # waiting for a replica of it now
    in_flight: int = 0  # on its replicas now
    requests_total: int = 0  # taken for it since the instance started (counted as each arrives)
    oldest_wait_s: float = 0.0  # how long the request queued longest has waited (0: none queued)


@attrs.frozen(kw_only=True)
class GatewayHeartbeat:
    """How the instance is doing. Its counters are totals since it started (a restarted process
    is a new instance and starts from zero), so a heartbeat lost or replaced loses nothing."""

    seq: int
    in_flight: int = 0  # requests this instance is serving now
    requests_total: int = 0  # requests it answered since it started
    rotation_version: int = 0  # the version of the rotation it routes by now (0: none yet)
    keys_version: int = 0  # the version of the keys it holds now (0: none yet)
    outstanding: tuple[ReplicaLoad, ...] = ()  # the replicas it has requests on, by replica id
    models: tuple[ModelLoad, ...] = ()  # each model's requests, by model name
    # Its /metrics, family by family; None: as the last heartbeat that had them said. A heartbeat
    # every heartbeat interval has them; one sent at once (for a new rotation or new keys) has
    # not: they hold a series per replica, and during a rolling move the rotation changes every
    # second or so (issue 31's profile: their decoding was a quarter of the control plane's CPU).
    metrics: tuple[MetricFamily, ...] | None = None


@attrs.frozen(kw_only=True)
class UsageRow:
    """What one gateway instance counted for a key (of a team) and a model in one hour (`hour`:
    unix seconds of its start, UTC): answered requests and their engines' tokens
    (`llmgw.gateway.usage`)."""

    hour: int
    key: str
    team: str = ""
    model: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, where the engine says
    completion_tokens: int = 0


@attrs.frozen(kw_only=True)
class UsageReport:
    """Counts not yet in the ledger, numbered per instance (`seq` from 1, one more each report).
    The control plane adds them to the ledger and records `seq` in one transaction, skipping a
    report whose `seq` it recorded already, then answers `UsageAck(seq)`. A gateway has one report
    unacknowledged at a time and sends it again, unchanged, after a reconnect."""

    seq: int
    rows: tuple[UsageRow, ...] = ()


@attrs.frozen(kw_only=True)
class BudgetUse:
    """One day or month budget on one instance in one period (`period_start`, unix seconds,
    UTC): `used`, the tokens its answers took in the period (all links); `held`, its grant not
    used and not reserved; `debt`, what its answers used past its grants (an answer that overran:
    the next grant pays it first; `held` is 0 then); `reserved`, for its requests in flight;
    `granted`, the grants received on this link (`BudgetGrant.tokens`); `want`, how many more it
    asks for now (0: none). Every count is a whole number from 0, as every count on the links is."""

    budget_id: str
    period_start: int
    used: int = 0
    held: int = 0
    debt: int = 0
    reserved: int = 0
    granted: int = 0
    want: int = 0


@attrs.frozen(kw_only=True)
class BudgetReport:
    """Each budget the instance holds or wants a grant of, whole (level-triggered: a newer one
    replaces one unsent); sent at once when it wants more or reserves from a grant, and after
    every welcome (`llmgw.gateway.budgets`; the control plane's side: `llmgw.server.state.budgets`)."""

    budgets: tuple[BudgetUse, ...] = ()


# -- control plane -> gateway --------------------------------------------------------------


@attrs.frozen(kw_only=True)
class GatewayWelcome:
    name: str
    instance: str
    server_version: str
    heartbeat_interval_s: float


@attrs.frozen(kw_only=True)
class RouteEndpoint:
    """A replica in the rotation, as `llmgw.gateway.routing.Endpoint` holds it."""

    replica_id: str
    model: str
    host: str
    port: int
    api_key: str = attrs.field(default="", repr=False)  # the replica's engine key
    draining: bool = False
    events_port: int = 0  # where its engine publishes KV-cache events on `host`; 0: none


# The OpenAI-compatible routes a gateway forwards by model, each to the replicas whose engine
# serves it (`ModelInfo.routes`; the engines' specs say which: `llmgw.engines`).
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
RESPONSES = "/v1/responses"
RERANK = "/v1/rerank"
SCORE = "/v1/score"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
OPENAI_ROUTES = (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, RERANK, SCORE, TOKENIZE, DETOKENIZE)


@attrs.frozen(kw_only=True)
class ModelInfo:
    """What a gateway needs of a catalog model besides its replicas.

    `routes`: the OpenAI routes its engine serves with the model's arguments (`llmgw.engines`'
    specs); () where the sender does not say (any route is forwarded). `created`: unix time the
    model entered the catalog. `unservable`: why no replica of it can become ready now (none
    placed, every one failed, their nodes lost), "" while one is ready or on its way; a request
    for it then gets 503 at once instead of waiting in the queue, with Retry-After
    `retry_after_s`. `routing`: how the gateway picks a replica for its requests,
    "least_outstanding" or "prefix" (`llmgw.gateway.routing`). `on_demand`: the model may have no
    replica at all (the catalog's `min_replicas = 0`): a request for it waits while the control
    plane starts one, and its first waiting request is reported at once. `max_queue` and
    `queue_timeout_s`: how many of its requests may wait for a replica on an instance and for how
    long (0: the gateway's own `[gateway] max_queue` and `queue_timeout_s`)."""

    name: str
    engine: str = ""
    routes: tuple[str, ...] = ()
    created: int = 0
    unservable: str = ""
    retry_after_s: int = 0
    routing: str = "least_outstanding"
    on_demand: bool = False
    max_queue: int = 0
    queue_timeout_s: float = 0.0


@attrs.frozen(kw_only=True)
class RotationChanged:
    """The catalog's models (a known model with nothing ready queues; an unknown one is a 404)
    and the replicas ready now. `unknown`: the replica ids whose state the control plane does
    not know yet (it has just started and their node is not back): a gateway keeps those it
    had in its last rotation until a later message says which they are. `version` rises with
    every change the control plane makes to the rotation; a gateway's heartbeats say which one
    it routes by, so that the control plane knows when a replica it took out of rotation gets
    no more requests from it (a move waits for that, `llmgw.server.links.gatewaylinks.GatewayFeed.quiesce`)."""

    models: tuple[str, ...]
    endpoints: tuple[RouteEndpoint, ...]
    unknown: tuple[str, ...] = ()
    version: int = 0
    details: tuple[ModelInfo, ...] = ()  # of the models in `models`; one missing has the defaults


@attrs.frozen(kw_only=True)
class GatewayKey:
    """A valid API key: the sha256 of its token (never the token), its models and its limits
    (0 = none), as the store's `KeyRow` holds them. A revoked key is not sent."""

    name: str
    token_sha256: str
    models: tuple[str, ...] = ()
    rate_per_minute: int = 0
    max_concurrency: int = 0
    team: str = ""  # the team it belongs to ("": none), which its usage is counted under


@attrs.frozen(kw_only=True)
class KeysChanged:
    """The valid keys. `version` rises with every change; a gateway's heartbeats say which one
    it holds, so that the control plane knows when its own workers refuse a revoked key (its
    admin API answers then)."""

    keys: tuple[GatewayKey, ...]
    version: int = 0


@attrs.frozen(kw_only=True)
class ShareChanged:
    """This instance's share of every key's limits: it is `index` of `count` instances."""

    index: int
    count: int


@attrs.frozen(kw_only=True)
class TableHeartbeat:
    """The control plane is there: the gateway's staleness restarts from zero."""

    seq: int


@attrs.frozen(kw_only=True)
class UsageAck:
    """The report `seq` of this instance is in the ledger (now, or before: sent twice, counted once)."""

    seq: int


@attrs.frozen(kw_only=True)
class GatewayBudget:
    """A token budget of a key or of a team (`scope_kind` "key" or "team", `scope` its name), for
    one model or all (`model` ""), per "minute", "day" or "month": prompt plus completion tokens."""

    id: str
    scope_kind: str
    scope: str
    model: str = ""
    period: str
    tokens: int


@attrs.frozen(kw_only=True)
class BudgetsChanged:
    """The budgets, all of them (`version` rises with every change)."""

    budgets: tuple[GatewayBudget, ...]
    version: int = 0


@attrs.frozen(kw_only=True)
class BudgetGrant:
    """What this instance was granted of a day or month budget on this link in the period
    `period_start`, all together (a grant raises `tokens`); `exhausted`: nothing more is to be had
    in the period now (until a gateway that left gives its grant back)."""

    budget_id: str
    period_start: int
    tokens: int = 0
    exhausted: bool = False


@attrs.frozen(kw_only=True)
class GrantsChanged:
    """This instance's grants, whole: every budget it reported, once the control plane leads and
    knows what was spent (`llmgw.server.state.budgets`)."""

    grants: tuple[BudgetGrant, ...] = ()


GatewayMessage = GatewayHello | GatewayHeartbeat | UsageReport | BudgetReport | LinkError
ControlMessage = (
    GatewayWelcome
    | RotationChanged
    | KeysChanged
    | ShareChanged
    | BudgetsChanged
    | GrantsChanged
    | TableHeartbeat
    | UsageAck
    | Redirect
    | LinkError
)

# Error codes of LinkError on this link: the agent link's (`llmgw.wire.agent_link`: bad_message,
# unknown_type, protocol_version, unexpected_message, revoked, certificate_expired, silent), and:
NAME_MISMATCH = "gateway_name_mismatch"  # a hello or welcome for another gateway or instance


def share_of_rate(rate_per_minute: int, share: ShareChanged) -> tuple[float, float]:
    """A key's rate limit on one instance: (tokens a minute, burst). 0 = no limit."""
    if rate_per_minute <= 0:
        return 0.0, 0.0
    count = max(1, share.count)
    per_minute = rate_per_minute / count
    return per_minute, max(1.0, per_minute)


def share_of_concurrency(max_concurrency: int, share: ShareChanged) -> int:
    """A key's in-flight limit on one instance. 0 = no limit."""
    if max_concurrency <= 0:
        return 0
    count = max(1, share.count)
    part = max_concurrency // count + (1 if share.index < max_concurrency % count else 0)
    return max(1, part)


class TableSink(Protocol):
    """Where a gateway's link client (`llmgw.gatewayd.link`) puts what the control plane says;
    the gateway's table (`llmgw.gatewayd.table.GatewayTable`) is one. Called on the gateway's
    loop, in the order the frames came; none of them blocks."""

    def rotation_changed(self, message: RotationChanged) -> None: ...

    def keys_changed(self, message: KeysChanged) -> None: ...

    def share_changed(self, message: ShareChanged) -> None: ...

    def budgets_changed(self, message: BudgetsChanged) -> None: ...

    def grants_changed(self, message: GrantsChanged) -> None: ...

    def heard(self, now: float) -> None:
        """A frame came from the control plane at `now` (trio's clock): staleness restarts."""
        ...

    def link_state(self, connected: bool, detail: str) -> None:
        """The link came up (detail "") or went down (detail: why, as the log says it)."""
        ...
