"""Which replica serves a request: pure routing state, no I/O, no clock of its own.

`Router` holds, per model, the endpoints in rotation (from the control plane, replaced whole
by `update`) and the requests outstanding on each (kept by `acquire`/`release`, keyed by
replica id so a count survives an update). `pick` chooses the endpoint with the fewest
outstanding requests, ties broken at random, never one already tried for this request (at the
address it was tried at: a replica started again at another address may be tried again), one
that is draining, one down, or one at its per-replica cap.

Down replicas: an attempt that fails on a replica (`failed`: no connection, no answer in time,
a 502/503, an answer cut off) takes it out of rotation until a probe reaches it again. The
prober (I/O, elsewhere) asks `due_probes` which to try now, and reports each result with
`probed`; one probe per replica per `probe_interval_s`. There is no timed return: a replica
that cannot be reached stays out however long that lasts, and one that answers is back within
an interval. A replica the control plane removes from rotation, or moves to another address,
is forgotten, down state included.

Invariants: an endpoint leaves rotation the moment `update` omits it or marks it draining, or
`failed` says it failed; requests already on it are not touched, and their `release` still
balances the count.

Policies, per model (`policies`, from the control plane's `ModelInfo.routing`):
`least_outstanding` as above; `prefix` (`llmgw.gateway.prefix`) the replica that holds the
request's conversation in its cache, or that its rank names, within a load bound. `route` says
which replica and how it was chosen, for the answer's `x-llmgw-route` header and /metrics; the
gateway tells `served` what each replica was given, and a replica that leaves rotation has what
it held forgotten. What engines say of their caches corrects that: llama.cpp's slots
(`engine_report`: a restart) and vLLM's and SGLang's KV-cache events (`engine_events`: a
restart, a cleared cache, and how much the engine holds).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable, Mapping

import attrs

from llmgw.gateway.kvevents import Cleared, Event, Removed, Stored
from llmgw.gateway.prefix import LOAD_FACTOR, TABLE_ENTRIES, PrefixTable, Prompt, choose, replica_key
from llmgw.wire.gateway_link import ModelInfo

LEAST_OUTSTANDING = "least_outstanding"
PREFIX = "prefix"
POLICIES = (LEAST_OUTSTANDING, PREFIX)
# Bytes of rendered prompt per token, to compare what the router recorded (bytes) with what an
# engine says it holds (blocks of tokens): English text and JSON run at about 4 (code lower,
# CJK about 2); too high a figure trims less than the engine evicted, never more.
BYTES_PER_TOKEN = 4
ENGINE_BLOCKS = 1 << 20  # block hashes remembered per replica from its events


@attrs.frozen(kw_only=True)
class Endpoint:
    replica_id: str
    model: str
    host: str
    port: int
    api_key: str = attrs.field(default="", repr=False)
    draining: bool = False
    events_port: int = 0  # where its engine publishes KV-cache events (`llmgw.gateway.kvevents`); 0: none

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@attrs.frozen(kw_only=True)
class Down:
    """Why and since when a replica is out of rotation, and when it is next probed."""

    reason: str  # as the retries metric names it: connect, first_byte, 502, 503, broken
    since: float
    address: str  # where it failed: a replica that moves to another address is forgotten
    next_probe: float


@attrs.frozen(kw_only=True)
class Verdict:
    """What a failed attempt means: whether the request may go to another replica, and whether
    this failure is the one that took the replica out of rotation."""

    retry: bool
    went_down: bool


class Router:
    def __init__(
        self,
        *,
        rng: random.Random | None = None,
        max_outstanding: int = 0,
        probe_interval_s: float = 1.0,
        prefix_load_factor: float = LOAD_FACTOR,
        prefix_table_entries: int = TABLE_ENTRIES,
    ) -> None:
        self.rng = rng or random.Random()
        self.max_outstanding = max_outstanding  # per replica; 0 = no cap
        self.probe_interval_s = probe_interval_s
        self.prefix_load_factor = prefix_load_factor
        self.prefix = PrefixTable(prefix_table_entries)
        self.models: frozenset[str] = frozenset()
        self.endpoints: dict[str, tuple[Endpoint, ...]] = {}
        self.policies: dict[str, str] = {}  # model -> PREFIX; absent: LEAST_OUTSTANDING
        self.outstanding: dict[str, int] = {}
        # replica id -> bytes of prompt sent to it whose answers have not begun (`acquire`,
        # `prefilled`, `release`): the work ahead of a request sent there now.
        self.prefilling: dict[str, int] = {}
        self.down: dict[str, Down] = {}
        self._keys: dict[str, int] = {}  # replica id -> its `prefix.replica_key`
        self._engine_tasks: dict[str, int] = {}  # replica id -> the newest task its engine reported
        self._engine_caches: dict[str, EngineCache] = {}  # replica id -> what its KV-cache events said

    def update(
        self, models: Iterable[str], endpoints: Iterable[Endpoint], policies: Mapping[str, str] | None = None
    ) -> None:
        """The models served (known, even with nothing ready), the endpoints ready now, and
        each model's policy (absent: least outstanding)."""
        by_model: dict[str, list[Endpoint]] = {}
        for ep in endpoints:
            by_model.setdefault(ep.model, []).append(ep)
        self.models = frozenset(models) | frozenset(by_model)
        self.endpoints = {m: tuple(sorted(eps, key=lambda e: e.replica_id)) for m, eps in by_model.items()}
        if policies is not None:
            self.policies = {m: p for m, p in policies.items() if p == PREFIX}
        live = {ep.replica_id: ep.address for eps in self.endpoints.values() for ep in eps}
        self.down = {k: d for k, d in self.down.items() if live.get(k) == d.address}
        for rid in self._keys.keys() - live.keys():
            self.prefix.forget(rid)  # left rotation: what it held counts no more
            self._engine_tasks.pop(rid, None)
            self._engine_caches.pop(rid, None)
        self._keys = {rid: self._keys.get(rid) or replica_key(rid) for rid in live}

    def _current(self, ep: Endpoint) -> bool:
        return any(e.replica_id == ep.replica_id and e.address == ep.address for e in self.endpoints.get(ep.model, ()))

    def failed(self, ep: Endpoint, reason: str, now: float, *, client_saw_bytes: bool) -> Verdict:
        """An attempt on `ep` failed: it leaves rotation until a probe reaches it (unless it
        already left: down, removed or moved). The request may go to another replica only while
        nothing of the answer went to the client: a retry then is invisible to it, later it is
        not (a client cannot tell a second answer from the rest of the first)."""
        went_down = ep.replica_id not in self.down and self._current(ep)
        if went_down:
            self.down[ep.replica_id] = Down(
                reason=reason, since=now, address=ep.address, next_probe=now + self.probe_interval_s
            )
        return Verdict(retry=not client_saw_bytes, went_down=went_down)

    def due_probes(self, now: float) -> list[Endpoint]:
        """The down endpoints whose probe is due now, each scheduled again one interval on (so
        a probe that times out is not started twice). Report each result with `probed`."""
        due = []
        for eps in self.endpoints.values():
            for ep in eps:
                d = self.down.get(ep.replica_id)
                if d is not None and d.next_probe <= now:
                    self.down[ep.replica_id] = attrs.evolve(d, next_probe=now + self.probe_interval_s)
                    due.append(ep)
        return due

    def next_probe_at(self) -> float | None:
        return min((d.next_probe for d in self.down.values()), default=None)

    def probed(self, ep: Endpoint, started: float, *, reached: bool) -> bool:
        """A probe of `ep` begun at `started` reached it or not; whether it is back in rotation.
        A probe begun before the replica's latest failure says nothing about it, and one of a
        replica forgotten meanwhile changes nothing."""
        d = self.down.get(ep.replica_id)
        if d is None or d.address != ep.address or d.since > started or not reached:
            return False
        del self.down[ep.replica_id]
        return True

    def in_rotation(self, model: str) -> list[Endpoint]:
        """The endpoints that may take a new request. A draining one does only while no other
        of its model can: a drain of a model's only replica must not be an outage while its
        replacement starts (the control plane retires it once the replacement is ready)."""
        eps = self.endpoints.get(model, ())
        up = [ep for ep in eps if ep.replica_id not in self.down] if self.down else list(eps)
        return [ep for ep in up if not ep.draining] or up

    def pick(self, model: str, *, exclude: Collection[Endpoint] = (), prompt: Prompt | None = None) -> Endpoint | None:
        return self.route(model, exclude=exclude, prompt=prompt)[0]

    def route(
        self, model: str, *, exclude: Collection[Endpoint] = (), prompt: Prompt | None = None
    ) -> tuple[Endpoint | None, Route]:
        """The endpoint for a request of `model` (None: none may take it now) and how it was
        chosen. `prompt`: the request's, for a model routed by prefix. `exclude`: the endpoints
        the request tried; a replica of theirs that is now at another address (started again
        elsewhere, or on another port) is another endpoint, as for its down state."""
        outstanding, cap = self.outstanding, self.max_outstanding
        tried = {(e.replica_id, e.address) for e in exclude}
        candidates: list[Endpoint] = []
        loads: list[int] = []
        for ep in self.in_rotation(model):
            load = outstanding.get(ep.replica_id, 0)
            if (ep.replica_id, ep.address) not in tried and (cap <= 0 or load < cap):
                candidates.append(ep)
                loads.append(load)
        by_prefix = prompt is not None and model in self.policies
        if len(candidates) <= 1:
            ep = candidates[0] if candidates else None
            if by_prefix and ep is not None:
                assert prompt is not None
                held = self.prefix.matches(prompt, (ep.replica_id,)).get(ep.replica_id, 0)
                return ep, Route(PREFIX, "only", prompt.matched_chars(held))
            return ep, LEAST
        if by_prefix:
            assert prompt is not None
            ids = [ep.replica_id for ep in candidates]
            keys, prefilling = self._keys, self.prefilling
            c = choose(
                prompt,
                ids,
                [keys.get(rid) or replica_key(rid) for rid in ids],
                loads,
                self.prefix,
                load_factor=self.prefix_load_factor,
                prefilling=[prefilling.get(rid, 0) for rid in ids],
            )
            return candidates[c.index], Route(PREFIX, c.reason, c.matched_chars)
        least = min(loads)
        return self.rng.choice([ep for ep, load in zip(candidates, loads, strict=True) if load == least]), LEAST

    def engine_report(self, ep: Endpoint, tasks: Collection[int]) -> bool:
        """What `ep`'s engine says of its cache (llama-server's /slots: the ids of the tasks its
        slots last ran, a count that begins again at 0 when the engine starts): one whose newest
        task is older than one it reported before has restarted, its cache empty, and what it
        was recorded as holding is forgotten. Whether it was."""
        if not self._current(ep):
            return False
        newest = max(tasks, default=-1)
        before = self._engine_tasks.get(ep.replica_id)
        self._engine_tasks[ep.replica_id] = newest
        if before is not None and newest < before:
            self.prefix.forget(ep.replica_id)
            return True
        return False

    def engine_events(self, ep: Endpoint, seq: int, events: Iterable[Event]) -> EventsReport:
        """A batch of `ep`'s KV-cache events (vLLM's, SGLang's: `llmgw.gateway.kvevents`),
        numbered `seq` by the engine (from 0 at each start). The engine's block hashes are over
        tokens, which the gateway cannot compute, so what they correct is what needs none:

        - a sequence number that does not follow the last one (the engine started again) or an
          `AllBlocksCleared`: the cache is empty, what the replica was recorded as holding is
          forgotten;
        - the blocks it holds (stored minus evicted, as far as these events told) and their
          tokens (a partial block counts what it has): when it evicts a block it said it
          stored, the router's record of the replica is trimmed, least recently used first, to
          what those tokens can hold (`BYTES_PER_TOKEN`). Each gateway process records only
          what it served, so its record is at most what the engine holds from every gateway.

        A gap in the numbers (a publisher drops what a slow subscriber misses) is counted; the
        blocks stored meanwhile are not known, so later trims go further than needed, never
        less far."""
        report = EventsReport()
        if not self._current(ep):
            return report
        rid = ep.replica_id
        cache = self._engine_caches.get(rid)
        if cache is None:
            cache = self._engine_caches[rid] = EngineCache()
        elif seq <= cache.seq:
            report.restarted = True
        elif seq > cache.seq + 1:
            report.missed = seq - cache.seq - 1
        cache.seq = seq
        if report.restarted:
            cache.clear()
            self.prefix.forget(rid)
        removed = False
        for event in events:
            if isinstance(event, Stored):
                cache.store(event)
            elif isinstance(event, Removed):
                # Blocks it never said it stored (before the subscription) say nothing of its size.
                removed = cache.remove(event.hashes) or removed
            elif isinstance(event, Cleared):
                cache.clear()
                self.prefix.forget(rid)
                report.cleared = True
        if removed:
            report.trimmed = self.prefix.trim(rid, cache.tokens * BYTES_PER_TOKEN)
        return report

    def served(self, ep: Endpoint, prompt: Prompt) -> None:
        """`ep` took `prompt` (its answer began): it holds the prompt's prefixes now."""
        if self._current(ep):
            self.prefix.record(prompt, ep.replica_id)

    def acquire(self, ep: Endpoint, prefill: int = 0) -> None:
        """A request goes to `ep`, `prefill` bytes of its prompt new to it (routed by prefix:
        `Prompt.size` less `Route.matched_chars`)."""
        self.outstanding[ep.replica_id] = self.outstanding.get(ep.replica_id, 0) + 1
        if prefill:
            self.prefilling[ep.replica_id] = self.prefilling.get(ep.replica_id, 0) + prefill

    def prefilled(self, ep: Endpoint, prefill: int) -> None:
        """The answer of a request given `acquire(ep, prefill)` began: its prompt is processed."""
        if prefill:
            left = self.prefilling.get(ep.replica_id, 0) - prefill
            if left > 0:
                self.prefilling[ep.replica_id] = left
            else:
                self.prefilling.pop(ep.replica_id, None)

    def release(self, ep: Endpoint, prefill: int = 0) -> None:
        """The request ended; `prefill`: what of it `prefilled` has not taken back (its answer
        never began)."""
        self.prefilled(ep, prefill)
        left = self.outstanding.get(ep.replica_id, 0) - 1
        if left > 0:
            self.outstanding[ep.replica_id] = left
        else:
            self.outstanding.pop(ep.replica_id, None)

    def state_of(self, ep: Endpoint) -> str:
        if ep.replica_id in self.down:
            return "down"
        return "draining" if ep.draining else "ready"


@attrs.define
class EngineCache:
    """What a replica's KV-cache events said: the last batch's number, the blocks held (hash ->
    its tokens: vLLM stores a prompt's last, partial block with the tokens it has) and their
    tokens in all."""

    seq: int = -1
    blocks: dict = attrs.Factory(dict)
    tokens: int = 0

    def store(self, event: Stored) -> None:
        blocks, left = self.blocks, event.tokens or event.block_size * len(event.hashes)
        for h in event.hashes:
            size = min(event.block_size, left) if left > 0 else event.block_size
            left -= size
            if h in blocks:
                self.tokens -= blocks[h]
            elif len(blocks) >= ENGINE_BLOCKS:
                break
            blocks[h] = size
            self.tokens += size

    def remove(self, hashes: Iterable) -> bool:
        """Whether any of `hashes` was held."""
        pop, before = self.blocks.pop, len(self.blocks)
        for h in hashes:
            self.tokens -= pop(h, 0)
        return len(self.blocks) < before

    def clear(self) -> None:
        self.blocks.clear()
        self.tokens = 0


@attrs.define
class EventsReport:
    """What a batch of engine events changed (`Router.engine_events`)."""

    restarted: bool = False  # its numbers began again: forgotten
    cleared: bool = False  # it emptied its cache: forgotten
    missed: int = 0  # batches it sent that did not arrive
    trimmed: int = 0  # entries dropped to fit what it holds


@attrs.frozen
class Route:
    """How a replica was chosen: the policy, and for `prefix` why (`prefix.Choice.reason`, or
    "only": one candidate) and how much of the prompt the replica was known to hold."""

    policy: str
    reason: str = ""
    matched_chars: int = 0

    @property
    def header(self) -> str:
        """The answer's `x-llmgw-route`: `least_outstanding`, or `prefix;matched=1536;hit`."""
        if self.policy != PREFIX:
            return self.policy
        return f"{PREFIX};matched={self.matched_chars};{self.reason}"

    @property
    def metric(self) -> str:
        """Its label on /metrics' routes counter."""
        return self.policy if self.policy != PREFIX else f"{PREFIX}_{self.reason}"


LEAST = Route(LEAST_OUTSTANDING)


@attrs.frozen(kw_only=True)
class Rotation:
    """What an endpoint provider tells the gateway: the models it serves (a known model with
    nothing ready queues; an unknown one is a 404) and the endpoints ready now. `unknown`: the
    replicas whose state the provider does not know yet (a control plane just started, their
    node not back yet): not in `endpoints`, but not gone either; a gateway that had them keeps
    them (`llmgw.gatewayd.table`). `version`: the control plane's number for it, where it has
    one (the gateway link's `RotationChanged`)."""

    models: frozenset[str]
    endpoints: tuple[Endpoint, ...]
    unknown: frozenset[str] = frozenset()
    version: int = 0
    details: tuple[ModelInfo, ...] = ()  # what else the gateway knows of each model (`ModelInfo`)
