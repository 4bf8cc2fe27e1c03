"""The one converter of the wire types: JSON text <-> message objects, for both links (the agent
link's messages, `llmgw.wire.agent_link`, and the gateway link's, `llmgw.wire.gateway_link`: a
tagged union each, LinkError and Redirect in both).

Every message is a JSON object whose "type" field names it (the class name in snake case).
Unknown fields are errors, as are unknown types, so a peer speaking another dialect is told
at once instead of being half-understood.

Scalars are taken as JSON gives them, never converted: an `int` field takes a JSON whole number
from 0 to 2**63 - 1 (every int of the link is a count, a size, a port or an id; SQLite and
float arithmetic hold that range), not `true`, `1.5`, `"12"` or 10**400; a `float` field takes a
finite number (`NaN` and `Infinity`, which Python's JSON reads, are refused: they would travel on
into views as JSON no browser parses); a `str` field a string, a `bool` field `true` or `false`.
cattrs' own hooks would call `int(...)`, `str(...)`, `bool(...)` on whatever came.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, get_args

import attrs
import cattrs
from cattrs.strategies import configure_tagged_union

from llmgw.errors import shown
from llmgw.wire import agent_link, gateway_link
from llmgw.wire.errors import WireError

TAG = "type"


def tag(cls: type) -> str:
    """The "type" of a message class on the wire: `LogsReply` -> "logs_reply"."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()


converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)

MAX_INT = (1 << 63) - 1


class _NotTaken(ValueError):
    """A scalar of the wrong kind or range; its message says which and what was expected."""


def _int(value: Any, _: type) -> int:
    # A bool is an int to Python, not a number to JSON.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INT:
        raise _NotTaken(f"expected a whole number from 0 to 2**63 - 1, got {shown(value)}")
    return value


def _float(value: Any, _: type) -> float:
    if isinstance(value, int) and not isinstance(value, bool) and -MAX_INT - 1 <= value <= MAX_INT:
        return float(value)
    if not isinstance(value, float) or not math.isfinite(value):
        raise _NotTaken(f"expected a finite number, got {shown(value)}")
    return value


def _str(value: Any, _: type) -> str:
    if not isinstance(value, str):
        raise _NotTaken(f"expected a string, got {shown(value)}")
    return value


def _bool(value: Any, _: type) -> bool:
    if not isinstance(value, bool):
        raise _NotTaken(f"expected true or false, got {shown(value)}")
    return value


for _type, _hook in ((int, _int), (float, _float), (str, _str), (bool, _bool)):
    converter.register_structure_hook(_type, _hook)

# A gateway's heartbeat carries its /metrics, a series per replica in two of its families (10,000
# series with 5,000 replicas): those are read and written here, by the rules above, instead of by
# cattrs' generated hooks with detailed validation (about 7 µs a series each way; 120 ms for
# one heartbeat of 5,000 replicas, on the control plane's loop). A sample leaves out its fields
# at their defaults (gateway protocol 5).
_FAMILY_FIELDS = frozenset(f.name for f in attrs.fields(gateway_link.MetricFamily))
_FAMILY_NEEDS = ("name", "help", "kind")
_SAMPLE_FIELDS = frozenset(f.name for f in attrs.fields(gateway_link.Sample))


def _fields(value: Any, fields: frozenset[str], where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _NotTaken(f"{where}expected an object, got {shown(value)}")
    if not value.keys() <= fields:
        raise _NotTaken(f"{where}unknown fields {', '.join(sorted(map(repr, value.keys() - fields)))}")
    return value


def _each(value: Any, hook: Any, where: str) -> tuple[Any, ...]:
    if not isinstance(value, list):
        raise _NotTaken(f"{where}expected a list, got {shown(value)}")
    try:
        return tuple(hook(v, None) for v in value)
    except _NotTaken as exc:
        raise _NotTaken(f"{where}{exc}") from None


_Sample = gateway_link.Sample
_isfinite = math.isfinite


def _quick_sample(value: Any) -> gateway_link.Sample | None:
    """The sample `value` says if it is well formed (the usual case, checked in one go), else None."""
    if not isinstance(value, dict) or not value.keys() <= _SAMPLE_FIELDS:
        return None
    labels = value.get("labels", ())
    if isinstance(labels, list):
        for label in labels:
            if not isinstance(label, str):
                return None
        labels = tuple(labels)
    elif labels != ():
        return None
    number = value.get("value", 0.0)
    if not isinstance(number, float) or not _isfinite(number):
        return None
    counts = value.get("counts", ())
    if counts != ():
        if not isinstance(counts, list):
            return None
        for count in counts:
            if count.__class__ is not int or not 0 <= count <= MAX_INT:
                return None
        counts = tuple(counts)
    total = value.get("sum", 0.0)
    if not isinstance(total, float) or not _isfinite(total):
        return None
    return _Sample(labels=labels, value=number, counts=counts, sum=total)


def _sample(value: Any, where: str) -> gateway_link.Sample:
    """`_quick_sample`'s answer, or what is wrong with `value` (its whole numbers taken as floats too)."""
    d = _fields(value, _SAMPLE_FIELDS, where)
    return gateway_link.Sample(
        labels=_each(d["labels"], _str, f"{where}labels: ") if "labels" in d else (),
        value=_taken(_float, d.get("value", 0.0), f"{where}value: "),
        counts=_each(d["counts"], _int, f"{where}counts: ") if "counts" in d else (),
        sum=_taken(_float, d.get("sum", 0.0), f"{where}sum: "),
    )


def _taken(hook: Any, value: Any, where: str) -> Any:
    try:
        return hook(value, None)
    except _NotTaken as exc:
        raise _NotTaken(f"{where}{exc}") from None


def _family(value: Any, _: type) -> gateway_link.MetricFamily:
    d = _fields(value, _FAMILY_FIELDS, "")
    missing = [name for name in _FAMILY_NEEDS if name not in d]
    if missing:
        raise _NotTaken(f"missing fields {', '.join(map(repr, missing))}")
    samples = d.get("samples", [])
    if not isinstance(samples, list):
        raise _NotTaken(f"samples: expected a list, got {shown(samples)}")
    return gateway_link.MetricFamily(
        name=_taken(_str, d["name"], "name: "),
        help=_taken(_str, d["help"], "help: "),
        kind=_taken(_str, d["kind"], "kind: "),
        labels=_each(d.get("labels", []), _str, "labels: "),
        buckets=_each(d.get("buckets", []), _float, "buckets: "),
        samples=tuple(_quick_sample(s) or _sample(s, f"samples[{i}]: ") for i, s in enumerate(samples)),
    )


def _family_json(f: gateway_link.MetricFamily) -> dict[str, Any]:
    d: dict[str, Any] = {"name": f.name, "help": f.help, "kind": f.kind}
    if f.labels:
        d["labels"] = list(f.labels)
    if f.buckets:
        d["buckets"] = list(f.buckets)
    d["samples"] = [_sample_json(s) for s in f.samples]
    return d


def _sample_json(s: gateway_link.Sample) -> dict[str, Any]:
    d: dict[str, Any] = {"labels": list(s.labels)} if s.labels else {}
    if s.value:
        d["value"] = s.value
    if s.counts:
        d["counts"] = list(s.counts)
    if s.sum:
        d["sum"] = s.sum
    return d


converter.register_structure_hook(gateway_link.MetricFamily, _family)
converter.register_unstructure_hook(gateway_link.MetricFamily, _family_json)

# One union of everything either side may send; AgentMessage and ServerMessage are its halves.
_ALL = (
    agent_link.Hello
    | agent_link.Heartbeat
    | agent_link.InventoryChanged
    | agent_link.EnginesChanged
    | agent_link.ReplicasChanged
    | agent_link.WeightsChanged
    | agent_link.SpeedsChanged
    | agent_link.LogsReply
    | agent_link.LogsRequest
    | agent_link.Welcome
    | agent_link.DesiredState
    | agent_link.ServerHeartbeat
    | agent_link.Redirect
    | agent_link.LinkError
)
configure_tagged_union(_ALL, converter, tag_generator=tag, tag_name=TAG)
# The gateway link's: GatewayMessage and ControlMessage are its halves.
_GATEWAY = (
    gateway_link.GatewayHello
    | gateway_link.GatewayHeartbeat
    | gateway_link.GatewayWelcome
    | gateway_link.RotationChanged
    | gateway_link.KeysChanged
    | gateway_link.ShareChanged
    | gateway_link.BudgetsChanged
    | gateway_link.GrantsChanged
    | gateway_link.BudgetReport
    | gateway_link.TableHeartbeat
    | gateway_link.UsageReport
    | gateway_link.UsageAck
    | agent_link.Redirect
    | agent_link.LinkError
)
configure_tagged_union(_GATEWAY, converter, tag_generator=tag, tag_name=TAG)
TYPES = {tag(cls): cls for cls in get_args(_ALL)}
GATEWAY_TYPES = {tag(cls): cls for cls in get_args(_GATEWAY)}
# The union each message class is encoded with (a LinkError or a Redirect is the same JSON in either).
_UNION_OF = {**{cls: _GATEWAY for cls in get_args(_GATEWAY)}, **{cls: _ALL for cls in get_args(_ALL)}}


# The last message of each type encoded, and its frame: the same message to many peers (the
# rotation to every gateway instance, thousands of replicas) is encoded once. Every message type
# is frozen, so the same object says the same thing.
_last_encoded: dict[type, tuple[Any, str]] = {}


def encode(message: Any) -> str:
    last = _last_encoded.get(type(message))
    if last is not None and last[0] is message:
        return last[1]
    union = _UNION_OF.get(type(message), _ALL)  # another type: cattrs' own error names it
    text = json.dumps(converter.unstructure(message, union), separators=(",", ":"))
    _last_encoded[type(message)] = (message, text)
    return text


def decode(text: str | bytes, expected: Any) -> Any:
    """Parse one frame; `expected` is the union the receiving side accepts."""
    return structure(parse(text), expected)


def parse(text: str | bytes) -> dict[str, Any]:
    """A frame's JSON object, not yet a message: a session looks at it first (a hello's protocol
    version is checked before the rest, since another version's hello may not parse as ours)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise WireError(agent_link.BAD_MESSAGE, f"frame is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise WireError(agent_link.BAD_MESSAGE, f"frame is a JSON {type(data).__name__}, expected an object")
    return data


def structure(data: dict[str, Any], expected: Any) -> Any:
    """The message a parsed frame holds, if it is one of `expected`."""
    kind = data.get(TAG)
    allowed = {tag(c) for c in get_args(expected)}
    if kind not in allowed:
        raise WireError(
            agent_link.UNKNOWN_TYPE,
            f"unknown message type {kind!r} (this side accepts: {', '.join(sorted(allowed))}); "
            "the peer runs a different llmgw version",
        )
    union = _ALL if set(get_args(expected)) <= set(get_args(_ALL)) else _GATEWAY
    try:
        return converter.structure(data, union)
    except cattrs.BaseValidationError as exc:
        problems = "; ".join(cattrs.transform_error(exc, path=kind, format_exception=_problem))
        raise WireError(agent_link.BAD_MESSAGE, f"malformed {kind}: {problems}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(agent_link.BAD_MESSAGE, f"malformed {kind}: {exc}") from None


def _problem(exc: BaseException, expected: type | None) -> str:
    return str(exc) if isinstance(exc, _NotTaken) else cattrs.v.format_exception(exc, expected)
