"""The limits one HTTP listener serves under (its deadlines, sizes and connection cap), as the
HTTP stack's modules import them. They are server.toml's `[http]` table and are declared in
`llmgw.config` (`Limits`, which `HttpSection` extends with the agent port's own budget), so the
config, which the agent imports, imports nothing of the HTTP stack.
"""

from __future__ import annotations

from llmgw.config.schema import Limits

__all__ = ["Limits"]
