"""The steps of `llmgw node add`, in the order they run; the toolkit's checklist and screens
(`llmgw.nodeadd.steps`, `llmgw.nodeadd.screen`) draw them. Pure: no I/O here."""

from __future__ import annotations

from llmgw.nodeadd.steps import Steps

# (name, what the operator reads), in order. The authority is read before the node is touched,
# and nothing is changed there (but the stage under /tmp) before doctor has passed there.
STEPS: Steps = (
    ("authority", "read the certificate authority"),
    ("connect", "connect over SSH and verify the host key"),
    ("identify", "read the node's hostname and architecture"),
    ("address", "find the address the agent will dial, covered by the server certificate"),
    ("ship", "ship the release for the node's architecture and verify its sha256"),
    ("doctor", "run llmgw doctor on the node"),
    ("fabrics", "name the fabrics of the node's adapters"),
    ("identity", "make the node's key and CSR there, sign it here"),
    ("trust", "install the certificate and trust the CA root"),
    ("configure", "write agent.toml and the service"),
    ("start", "start the agent"),
    ("join", "wait for the node to join and install llama.cpp"),
)
NAMES = tuple(name for name, _ in STEPS)
