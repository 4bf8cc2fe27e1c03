"""Errors of the admin API client, by blame, for a caller that acts on which one it got.

`llmgw ca issue` writes the database itself when no control plane runs, and only then: these
two classes are how it knows, never the message text.
"""

from __future__ import annotations

from llmgw.errors import MachineError, PeerError


class NoControlPlane(MachineError):
    """No control plane runs with this state directory: it has no `admin.url` (a server removes
    its own when it stops)."""


class NotAnswering(PeerError):
    """Nothing listens at the admin URL: the control plane that wrote it is gone (killed, the
    machine restarted) or not listening yet."""
