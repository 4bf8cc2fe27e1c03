"""llmgw's HTTP/1.1 codec, both roles, without I/O (after h11): bytes in, events out, bytes to
write; the trio loops around it are elsewhere (`llmgw.http.server` for the listeners,
`llmgw.gateway.upstream` to engines, `llmgw.http.relay` to the control plane's private socket,
`agent.engine_proc` to an engine's /health).

    readers      what both roles read with: the buffer, a head found and bounded, its framing
                 fields, a body by Content-Length, by chunks with their trailers, or to the close
    server_role  requests parsed, answers written, the connection's reuse (`ServerConnection`)
    client_role  requests written (`request_bytes`), responses parsed (`ResponseParser`)
    fields       header field lines read and written, a peer's bytes shown as text
    errors       by blame: the peer's `ProtocolError`, this side's `LocalProtocolError`

It imports nothing of llmgw but its errors' helpers (BUILD), so the agent uses it as the
listeners do. Everything is imported from here; the modules are the rooms it is kept in.
"""

from llmgw.h1.client_role import MAX_HEAD_BYTES, Head, ResponseParser, request_bytes
from llmgw.h1.errors import ClosedBeforeResponse, LocalProtocolError, ProtocolError
from llmgw.h1.readers import END, MAX_LINE_BYTES, MAX_STEPS, NEED_DATA
from llmgw.h1.server_role import CLOSED, PAUSED, Data, RequestHead, ServerConnection

__all__ = [
    "CLOSED",
    "END",
    "MAX_HEAD_BYTES",
    "MAX_LINE_BYTES",
    "MAX_STEPS",
    "NEED_DATA",
    "PAUSED",
    "ClosedBeforeResponse",
    "Data",
    "Head",
    "LocalProtocolError",
    "ProtocolError",
    "RequestHead",
    "ResponseParser",
    "ServerConnection",
    "request_bytes",
]
