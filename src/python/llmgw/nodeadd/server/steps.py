"""The steps of `llmgw server add`, in the order they run; the toolkit's checklist and screens
(`llmgw.nodeadd.steps`, `llmgw.nodeadd.screen`) draw them. Pure: no I/O here."""

from __future__ import annotations

from llmgw.nodeadd.steps import Steps

# (name, what the operator reads), in order. What this control plane holds is read, and its store
# found shared, before the machine is touched; nothing is changed there (but the stage under
# /tmp) before the release has run there; the service is started only once the machine has
# been seen to reach the same store.
STEPS: Steps = (
    ("authority", "read the CA, the secrets every leader needs and the shared store"),
    ("connect", "connect over SSH and verify the host key"),
    ("identify", "read the machine's hostname and architecture, and the CA it holds"),
    ("ship", "ship the release for the machine's architecture, verify its sha256 and run it"),
    ("install", "install llmgw, the control plane's user and its state directory"),
    ("secrets", "copy the CA, the engine-key secret, the admin credential and the store's password"),
    ("configure", "write server.toml, the agent port's certificate and the service"),
    ("store", "check from the machine that it reaches the same store"),
    ("start", "start the control plane"),
    ("verify", "wait for its admin API to answer with the same CA"),
)
NAMES = tuple(name for name, _ in STEPS)
