"""The one converter of the wire types: JSON text <-> message objects.

Every message is a JSON object whose "type" field names it (the class name in snake case).
Unknown fields are errors, as are unknown types, so a peer speaking another dialect is told
at once instead of being half-understood.
"""

from __future__ import annotations

import json
import re
from typing import Any, get_args

import cattrs
from cattrs.strategies import configure_tagged_union

from llmgw.wire import agent_link
from llmgw.wire.errors import WireError

TAG = "type"


def tag(cls: type) -> str:
    """The "type" of a message class on the wire: `LogsReply` -> "logs_reply"."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()


converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)

# One union of everything either side may send; AgentMessage and ServerMessage are its halves.
_ALL = (
    agent_link.Hello
    | agent_link.Heartbeat
    | agent_link.InventoryChanged
    | agent_link.EnginesChanged
    | agent_link.ReplicasChanged
    | agent_link.LogsReply
    | agent_link.LogsRequest
    | agent_link.Welcome
    | agent_link.DesiredState
    | agent_link.LinkError
)
configure_tagged_union(_ALL, converter, tag_generator=tag, tag_name=TAG)
TYPES = {tag(cls): cls for cls in get_args(_ALL)}


def encode(message: Any) -> str:
    return json.dumps(converter.unstructure(message, _ALL), separators=(",", ":"))


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
    try:
        return converter.structure(data, _ALL)
    except cattrs.BaseValidationError as exc:
        problems = "; ".join(cattrs.transform_error(exc, path=kind))
        raise WireError(agent_link.BAD_MESSAGE, f"malformed {kind}: {problems}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(agent_link.BAD_MESSAGE, f"malformed {kind}: {exc}") from None
