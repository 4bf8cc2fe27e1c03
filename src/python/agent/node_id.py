"""The node's id: agent.toml's `node_id`, else the machine's host name.

`llmgw agent csr` puts it in the certificate request and `llmgw agent run` says it in its hello,
so both take it from here; a module of its own so that `agent csr`, a short command the tests run
for every node they add, does not import the agent's runtime (0.4 CPU-s of imports) to read it.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmgw.config import AgentConfig


def node_id_of(config: AgentConfig) -> str:
    return config.node_id or socket.gethostname()
