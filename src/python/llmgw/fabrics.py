"""Which nodes share a fabric, decided from what their agents report. Pure: no I/O.

Each agent reports the fabrics it was declared on, as (name, identity, adapters), where the
identity comes from the adapters (the subnet manager's GUID, or a RoCE network) and was checked
on the node (`agent.discovery.fabrics`). The control plane places a multi-node replica only
inside one `PlacementFabric`, keyed by name *and* identity:

- one name reported with two identities is two fabrics (two independent fabrics given one
  name): they are placed as two and a note says so;
- one identity reported under two names is kept apart too (a typo in a name must not decide
  placement either way), and a note asks for one name;
- a node that reports no fabric is its own island and appears in no PlacementFabric.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from llmgw.wire.agent_link import Fabric


@attrs.frozen(kw_only=True)
class PlacementFabric:
    name: str
    identity: str
    nodes: tuple[str, ...]

    @property
    def key(self) -> str:
        return f"{self.name}@{self.identity}"


@attrs.frozen(kw_only=True)
class FabricMap:
    fabrics: tuple[PlacementFabric, ...]
    notes: tuple[str, ...]  # for the operator (ctl nodes, the cluster page), each with its fix


def fabric_map(reports: Mapping[str, Sequence[Fabric]]) -> FabricMap:
    members: dict[tuple[str, str], list[str]] = {}
    for node, fabrics in sorted(reports.items()):
        for f in fabrics:
            if f.identity:  # an agent sends only checked fabrics; be strict about it anyway
                members.setdefault((f.name, f.identity), []).append(node)
    placed = tuple(
        PlacementFabric(name=name, identity=identity, nodes=tuple(sorted(set(nodes))))
        for (name, identity), nodes in sorted(members.items())
    )
    notes = []
    by_name: dict[str, list[PlacementFabric]] = {}
    by_identity: dict[str, list[PlacementFabric]] = {}
    for p in placed:
        by_name.setdefault(p.name, []).append(p)
        by_identity.setdefault(p.identity, []).append(p)
    for name, ps in sorted(by_name.items()):
        if len(ps) > 1:
            parts = "; ".join(f"{', '.join(p.nodes)} on {p.identity}" for p in ps)
            notes.append(
                f"fabric name {name!r} covers {len(ps)} independent fabrics ({parts}); they are placed as "
                f"{len(ps)} fabrics. Give each fabric its own name (`llmgw node add ... --fabric NAME:ADAPTERS`)"
            )
    for identity, ps in sorted(by_identity.items()):
        if len(ps) > 1:
            parts = "; ".join(f"{', '.join(p.nodes)} call it {p.name!r}" for p in ps)
            notes.append(
                f"fabric {identity} has {len(ps)} names ({parts}); nodes under different names are not placed "
                "together. Use one name for it on every node"
            )
    return FabricMap(fabrics=placed, notes=tuple(notes))


def shared_fabrics(fabric_map_: FabricMap, nodes: Sequence[str]) -> tuple[PlacementFabric, ...]:
    """The fabrics every one of `nodes` is on: where a replica spanning them may be placed."""
    want = set(nodes)
    return tuple(p for p in fabric_map_.fabrics if want <= set(p.nodes))
