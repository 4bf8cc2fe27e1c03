"""llmgw: an LLM serving cluster built from machines you already own.

The package holds the control plane, the CLI and what control plane and agent share
(`wire`, `pki`, `config`, `engines`). The node side lives in the top-level `agent` package.
"""

__version__ = "0.1.0.dev0"
