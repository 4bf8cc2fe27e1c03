"""The limits one HTTP listener serves under: its deadlines, sizes and connection cap.

Declared once, here: server.toml's `[http]` section is this class (`llmgw.config.HttpSection`
adds the agent port's own budget to it), the control plane's listeners take it as it is, and the
sim engine serves at the defaults. What each limit does is `llmgw.http.server`'s docstring; why
each default, docs/configuration.md.
"""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class Limits:
    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    body_min_bytes_per_s: int = 1024  # bytes per second, averaged over the body so far; 0 = no minimum
    keepalive_timeout_s: float = 60.0
    send_timeout_s: float = 30.0
    max_head_bytes: int = 16384
    max_body_bytes: int = 8 << 20
    body_budget_bytes: int = 64 << 20  # request bodies buffered at once, all connections together
    max_connections: int = 0  # 0 = sized from the open-file limit, see `listeners.default_max_connections`
