"""Fabric groups and fabric declarations, decided from what the adapters report. Pure: no I/O.

A fabric's identity is derived from the adapters, never from its name: the subnet manager an
InfiniBand port sees (its GUID, from sminfo), or the IP network of a RoCE port. So:

- `group_adapters` puts the active adapters into groups by identity; these are what
  `llmgw node add` asks the operator to name.
- `check_declarations` checks `--fabric NAME[:ADAPTER,...]` against the adapters. An adapter
  under two fabrics is refused (a replica given adapters on two fabrics starts, passes its
  health checks and hangs on its first all-reduce); so is a fabric whose adapters see
  different subnet managers, an adapter that does not exist or is not active. Problems are
  returned as data; only the declarations that hold become `Fabric`s for the hello.

A declaration without adapters takes the next two adapters by name that no declaration names
("two adapters per fabric"), in name order rather than by what is up, so that a flapping link
cannot silently move a fabric onto other adapters; the checks then say if the two disagree.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import attrs

from agent.discovery.infiniband import IB_PREFIX, ROCE_PREFIX, is_active
from llmgw.config import FabricDecl
from llmgw.wire import agent_link as w

FAIL = "fail"
UNKNOWN = "unknown"
DEFAULT_ADAPTERS_PER_FABRIC = 2

# Problem codes, for programs (tests, node add); messages are for people.
DECLARED_TWICE = "fabric_declared_twice"
ADAPTER_IN_TWO_FABRICS = "adapter_in_two_fabrics"
NO_ADAPTER_LEFT = "no_adapter_left"
UNKNOWN_ADAPTER = "unknown_adapter"
ADAPTER_NOT_ACTIVE = "adapter_not_active"
IDENTITY_UNKNOWN = "identity_unknown"
PORTS_DISAGREE = "adapter_ports_disagree"
SPANS_FABRICS = "fabric_spans_fabrics"

WHY_ONE_FABRIC = (
    "a replica given adapters on two fabrics starts, passes its health checks and hangs on its first all-reduce"
)


@attrs.frozen(kw_only=True)
class Problem:
    code: str
    severity: str  # FAIL, or UNKNOWN when the adapters could not be identified
    fabric: str
    message: str
    fix: str


@attrs.frozen(kw_only=True)
class AdapterView:
    """One adapter as fabric logic sees it."""

    name: str
    active: bool  # at least one port ACTIVE
    identity: str  # "" unless every active port reports the same, known identity
    why: str  # why an active adapter has no identity
    state: str  # "port 1: DOWN, Polling" for people


@attrs.frozen(kw_only=True)
class FabricCheck:
    declared: tuple[FabricDecl, ...]  # as given, with default adapters filled in
    fabrics: tuple[w.Fabric, ...]  # the declarations that hold
    problems: tuple[Problem, ...]


def kind_of(identity: str) -> str:
    if identity.startswith(IB_PREFIX):
        return "infiniband"
    if identity.startswith(ROCE_PREFIX):
        return "roce"
    return ""


def natural(name: str) -> tuple:
    """mlx5_2 before mlx5_10."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name))


def view(adapter: w.IbAdapter) -> AdapterView:
    active = [p for p in adapter.ports if is_active(p)]
    state = "; ".join(f"port {p.port}: {p.state or '?'}, {p.phys_state or '?'}" for p in adapter.ports) or "no ports"
    if not active:
        return AdapterView(name=adapter.name, active=False, identity="", why="", state=state)
    unknown = [p for p in active if not p.identity]
    if unknown:
        why = "; ".join(f"port {p.port}: {p.identity_error or 'no identity'}" for p in unknown)
        return AdapterView(name=adapter.name, active=True, identity="", why=why, state=state)
    identities = sorted({p.identity for p in active})
    if len(identities) > 1:
        why = "its ports are on different fabrics: " + ", ".join(f"port {p.port} on {p.identity}" for p in active)
        return AdapterView(name=adapter.name, active=True, identity="", why=why, state=state)
    return AdapterView(name=adapter.name, active=True, identity=identities[0], why="", state=state)


def _group_detail(identity: str, members: list[w.IbAdapter]) -> str:
    ports = [p for a in members for p in a.ports if is_active(p) and p.identity == identity]
    rates = ", ".join(sorted({p.rate for p in ports if p.rate}))
    if identity.startswith(IB_PREFIX):
        lids = ", ".join(sorted({str(p.sm_lid) for p in ports}))
        prefixes = ", ".join(sorted({p.gid_prefix for p in ports if p.gid_prefix}))
        text = f"subnet manager {identity[len(IB_PREFIX) :]} (LID {lids}), GID prefix {prefixes or '?'}"
    else:
        netdevs = ", ".join(sorted({p.netdev for p in ports if p.netdev}))
        text = f"IP network {identity[len(ROCE_PREFIX) :]} on {netdevs}"
    return f"{text}; {rates}" if rates else text


def group_adapters(adapters: Sequence[w.IbAdapter]) -> tuple[w.FabricGroup, ...]:
    """Active, identified adapters grouped by the fabric they report, in identity order."""
    members: dict[str, list[w.IbAdapter]] = {}
    for adapter in adapters:
        v = view(adapter)
        if v.identity:
            members.setdefault(v.identity, []).append(adapter)
    return tuple(
        w.FabricGroup(
            identity=identity,
            kind=kind_of(identity),
            adapters=tuple(a.name for a in ms),
            detail=_group_detail(identity, ms),
        )
        for identity, ms in sorted(members.items())
    )


def groups_text(groups: Sequence[w.FabricGroup]) -> str:
    if not groups:
        return "no adapter here is active and identified"
    return "; ".join(f"{g.identity}: {','.join(g.adapters)}" for g in groups)


def fabric_flag(name: str, adapters: Sequence[str]) -> str:
    return f"--fabric {name}:{','.join(adapters)}"


def resolve_defaults(
    decls: Sequence[FabricDecl], adapters: Sequence[w.IbAdapter]
) -> tuple[tuple[FabricDecl, ...], list[Problem]]:
    named = {a for d in decls for a in d.adapters}
    pool = [a.name for a in sorted(adapters, key=lambda a: natural(a.name)) if a.name not in named]
    out, problems = [], []
    for d in decls:
        if d.adapters:
            out.append(d)
            continue
        take, pool = pool[:DEFAULT_ADAPTERS_PER_FABRIC], pool[DEFAULT_ADAPTERS_PER_FABRIC:]
        if not take:
            have = ", ".join(a.name for a in adapters) or "none"
            problems.append(
                Problem(
                    code=NO_ADAPTER_LEFT,
                    severity=FAIL,
                    fabric=d.name,
                    message=f"fabric {d.name!r} names no adapters and none is left to default to "
                    f"(adapters on this node: {have})",
                    fix=f"name its adapters ({fabric_flag(d.name, ['mlx5_0', 'mlx5_1'])}), or leave --fabric out: "
                    "a node with no fabric is its own island",
                )
            )
        out.append(FabricDecl(name=d.name, adapters=tuple(take)))
    return tuple(out), problems


def check_declarations(decls: Sequence[FabricDecl], adapters: Sequence[w.IbAdapter]) -> FabricCheck:
    groups = group_adapters(adapters)
    here = groups_text(groups)
    problems: list[Problem] = []

    seen: set[str] = set()
    for d in decls:
        if d.name in seen:
            problems.append(
                Problem(
                    code=DECLARED_TWICE,
                    severity=FAIL,
                    fabric=d.name,
                    message=f"fabric {d.name!r} is declared twice",
                    fix=f"declare it once with all its adapters, e.g. {fabric_flag(d.name, ['mlx5_0', 'mlx5_1'])}",
                )
            )
        seen.add(d.name)

    owners: dict[str, list[str]] = {}
    for d in decls:
        for a in d.adapters:
            owners.setdefault(a, [])
            if d.name not in owners[a]:
                owners[a].append(d.name)
    for a, names in owners.items():
        if len(names) > 1:
            for name in names:
                problems.append(
                    Problem(
                        code=ADAPTER_IN_TWO_FABRICS,
                        severity=FAIL,
                        fabric=name,
                        message=f"adapter {a!r} is under fabrics {' and '.join(map(repr, names))}; an adapter belongs "
                        f"to one fabric ({WHY_ONE_FABRIC})",
                        fix=f"name {a} under one fabric only; the adapters here report: {here}",
                    )
                )

    resolved, default_problems = resolve_defaults(decls, adapters)
    problems += default_problems
    views = {a.name: view(a) for a in adapters}
    fabrics = []
    for d in resolved:
        mine = _check_one(d, views, here)
        problems += mine
        if any(p.fabric == d.name for p in problems) or not d.adapters:
            continue
        identity = views[d.adapters[0]].identity
        fabrics.append(w.Fabric(name=d.name, identity=identity, adapters=d.adapters, kind=kind_of(identity)))
    # One problem per (code, message): an adapter declared twice is one mistake, said once per fabric.
    unique = list({(p.code, p.fabric, p.message): p for p in problems}.values())
    return FabricCheck(declared=resolved, fabrics=tuple(fabrics), problems=tuple(unique))


def _check_one(d: FabricDecl, views: dict[str, AdapterView], here: str) -> list[Problem]:
    problems = []

    def problem(code: str, message: str, fix: str, severity: str = FAIL) -> None:
        problems.append(Problem(code=code, severity=severity, fabric=d.name, message=message, fix=fix))

    for a in d.adapters:
        v = views.get(a)
        if v is None:
            have = ", ".join(sorted(views, key=natural)) or "none"
            problem(
                UNKNOWN_ADAPTER,
                f"fabric {d.name!r}: there is no adapter {a!r} on this node (adapters: {have})",
                "name adapters as they appear under /sys/class/infiniband (`ls /sys/class/infiniband`)",
            )
        elif not v.active:
            others = [x for x in d.adapters if x != a]
            problem(
                ADAPTER_NOT_ACTIVE,
                f"fabric {d.name!r}: adapter {a!r} is not active ({v.state})",
                f"check its cable and switch port (`ibstat {a}`)"
                + (f", or leave it out: {fabric_flag(d.name, others)}" if others else ""),
            )
        elif not v.identity:
            ports_disagree = v.why.startswith("its ports")
            problem(
                PORTS_DISAGREE if ports_disagree else IDENTITY_UNKNOWN,
                f"fabric {d.name!r}: cannot tell which fabric adapter {a!r} is on: {v.why}",
                "cable each adapter's ports to one fabric"
                if ports_disagree
                else "install infiniband-diags (the agent does this itself on apt and dnf systems) and run doctor as "
                "root; for RoCE give the interface its IP address",
                FAIL if ports_disagree else UNKNOWN,
            )
    identities: dict[str, list[str]] = {}
    for a in d.adapters:
        v = views.get(a)
        if v and v.identity:
            identities.setdefault(v.identity, []).append(a)
    if len(identities) > 1:
        parts = [f"{','.join(names)} on {identity}" for identity, names in sorted(identities.items())]
        groups = list(identities.values())
        suggestion = " ".join(
            fabric_flag(d.name if i == 0 else "OTHER" if len(groups) == 2 else f"OTHER{i}", names)
            for i, names in enumerate(groups)
        )
        problem(
            SPANS_FABRICS,
            f"fabric {d.name!r} spans {len(identities)} fabrics: {'; '.join(parts)} (the ports of one fabric see one "
            "subnet manager, or for RoCE sit on one IP network)",
            f"declare one fabric per subnet manager or network, each with its own name: {suggestion}",
        )
    return problems
