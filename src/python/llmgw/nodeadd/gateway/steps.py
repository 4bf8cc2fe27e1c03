"""The steps of `llmgw gateway add`, in the order they run; the toolkit's checklist and screens
(`llmgw.nodeadd.steps`, `llmgw.nodeadd.screen`) draw them. Pure: no I/O here."""

from __future__ import annotations

from llmgw.nodeadd.steps import Steps

# (name, what the operator reads), in order. The authority is read before the machine is touched,
# and nothing is changed there (but the stage under /tmp) before the release has run there.
STEPS: Steps = (
    ("authority", "read the certificate authority and the gateways connected"),
    ("connect", "connect over SSH and verify the host key"),
    ("identify", "read the machine's hostname and architecture, and name the gateway"),
    ("address", "find the address the gateway will dial, covered by the server certificate"),
    ("ship", "ship the release for the machine's architecture, verify its sha256 and run it"),
    ("install", "install llmgw, the gateway's user and its directory"),
    ("identity", "make the gateway's key and CSR there, sign it here"),
    ("configure", "write the service"),
    ("start", "start the gateway"),
    ("join", "wait for the control plane to list the gateway connected"),
)
NAMES = tuple(name for name, _ in STEPS)
