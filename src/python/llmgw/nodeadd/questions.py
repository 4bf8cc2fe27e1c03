"""What `llmgw node add` may ask the operator, and the answers given without a terminal.

The steps ask through a `Questions` object; the terminal screen answers with dialogs, and
`Unattended` answers from the command line's flags, so a script never waits on a prompt:

- a host absent from known_hosts: refused (`--accept-new-host-key` accepts it before anyone is asked);
- doctor failures: never gone past (`--ignore-doctor CHECK` leaves a check out of doctor's verdict);
- the fabrics of the node's active adapters: named only by `--fabric NAME[:ADAPTERS]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs

from llmgw.config import FabricDecl
from llmgw.wire.agent_link import FabricGroup


@attrs.frozen(kw_only=True)
class DoctorFailure:
    check: str  # doctor's check name, what --ignore-doctor takes
    detail: str
    fix: str = ""


class Questions(Protocol):
    async def accept_host_key(self, target: str, algorithm_and_fingerprint: str) -> bool:
        """A host absent from known_hosts offers this key: trust it (it is then added)?"""

    async def go_past_doctor(self, failures: Sequence[DoctorFailure]) -> bool:
        """Doctor failed these checks on the node: go on anyway?"""

    async def name_fabrics(
        self, groups: Sequence[FabricGroup], existing: Sequence[str], given: Sequence[FabricDecl]
    ) -> tuple[FabricDecl, ...]:
        """Which fabric is each group of active adapters on? `existing` are the cluster's fabric
        names, offered first; `given` are the `--fabric` flags. The answer is every declaration
        (an unnamed group is left out: its adapters serve no multi-node replica)."""


@attrs.frozen(kw_only=True)
class Unattended:
    async def accept_host_key(self, target: str, algorithm_and_fingerprint: str) -> bool:
        return False

    async def go_past_doctor(self, failures: Sequence[DoctorFailure]) -> bool:
        return False

    async def name_fabrics(
        self, groups: Sequence[FabricGroup], existing: Sequence[str], given: Sequence[FabricDecl]
    ) -> tuple[FabricDecl, ...]:
        return tuple(given)
