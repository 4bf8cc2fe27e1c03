"""Fabric groups and declarations against the fixture trees: every case from the issue."""

from __future__ import annotations

import attrs

from agent.discovery import fabrics
from agent.discovery import infiniband as ib
from llmgw.config import FabricDecl
from llmgw.wire import agent_link as w
from testlib.hardware import NO_TOOL, ib_root, ip, sminfo

SM_A = "ib-sm:0x0002c90300a1b2c3"
SM_B = "ib-sm:0x98039b0300c0ffee"


def adapters(case: str, sminfo_path: str | None = None) -> tuple[w.IbAdapter, ...]:
    path = sminfo_path if sminfo_path is not None else sminfo(case)
    return ib.probe_infiniband(ib_root(case), sminfo=path, ip=ip(case), timeout_s=10).adapters


def decl(name: str, *names: str) -> FabricDecl:
    return FabricDecl(name=name, adapters=names)


def codes(check: fabrics.FabricCheck) -> list[tuple[str, str]]:
    return [(p.code, p.fabric) for p in check.problems]


def test_two_independent_fabrics_form_two_groups() -> None:
    groups = fabrics.group_adapters(adapters("two-fabrics"))
    assert [(g.identity, g.kind, g.adapters) for g in groups] == [
        (SM_A, "infiniband", ("mlx5_0", "mlx5_1")),
        (SM_B, "infiniband", ("mlx5_2", "mlx5_3")),
    ]
    assert groups[0].detail == (
        "subnet manager 0x0002c90300a1b2c3 (LID 1), GID prefix fe80:0000:0000:0000; 200 Gb/sec (4X HDR)"
    )


def test_two_fabrics_declared_by_name_take_two_adapters_each() -> None:
    check = fabrics.check_declarations([decl("ib-a"), decl("ib-b")], adapters("two-fabrics"))
    assert check.problems == ()
    assert check.fabrics == (
        w.Fabric(name="ib-a", identity=SM_A, adapters=("mlx5_0", "mlx5_1"), kind="infiniband"),
        w.Fabric(name="ib-b", identity=SM_B, adapters=("mlx5_2", "mlx5_3"), kind="infiniband"),
    )


def test_one_fabric_declared_across_two_subnet_managers_is_refused_with_the_split() -> None:
    check = fabrics.check_declarations([decl("ib-a", "mlx5_0", "mlx5_1", "mlx5_2")], adapters("two-fabrics"))
    assert check.fabrics == ()
    [p] = check.problems
    assert p.code == fabrics.SPANS_FABRICS and p.severity == fabrics.FAIL
    assert p.message.startswith(
        f"fabric 'ib-a' spans 2 fabrics: mlx5_0,mlx5_1 on {SM_A}; mlx5_2 on {SM_B} (the ports of one fabric"
    )
    assert p.fix.endswith("--fabric ib-a:mlx5_0,mlx5_1 --fabric OTHER:mlx5_2")


def test_one_fabric_with_two_adapters() -> None:
    found = adapters("one-fabric")
    assert [(g.identity, g.adapters) for g in fabrics.group_adapters(found)] == [(SM_A, ("mlx5_0", "mlx5_1"))]
    check = fabrics.check_declarations([decl("ib-a")], found)
    assert check.problems == () and check.declared == (decl("ib-a", "mlx5_0", "mlx5_1"),)
    assert check.fabrics[0].identity == SM_A


def test_roce_groups_by_network() -> None:
    found = adapters("roce")
    groups = fabrics.group_adapters(found)
    assert [(g.identity, g.kind, g.adapters) for g in groups] == [
        ("roce:192.168.50.0/24", "roce", ("mlx5_0", "mlx5_1")),
        ("roce:192.168.60.0/24", "roce", ("mlx5_2",)),
    ]
    assert groups[0].detail == "IP network 192.168.50.0/24 on ens1f0np0, ens1f1np1; 100 Gb/sec (4X EDR)"
    ok = fabrics.check_declarations([decl("roce-1", "mlx5_0", "mlx5_1"), decl("roce-2", "mlx5_2")], found)
    assert ok.problems == () and [f.kind for f in ok.fabrics] == ["roce", "roce"]


def test_a_port_down_is_refused_with_its_state() -> None:
    check = fabrics.check_declarations([decl("ib-a")], adapters("port-down"))
    assert check.fabrics == ()
    [p] = check.problems
    assert p.code == fabrics.ADAPTER_NOT_ACTIVE
    assert p.message == "fabric 'ib-a': adapter 'mlx5_1' is not active (port 1: DOWN, Polling)"
    assert p.fix == "check its cable and switch port (`ibstat mlx5_1`), or leave it out: --fabric ib-a:mlx5_0"
    assert fabrics.check_declarations([decl("ib-a", "mlx5_0")], adapters("port-down")).problems == ()


def test_a_port_whose_sm_lid_is_zero_is_not_grouped_or_accepted() -> None:
    found = adapters("sm-lid-zero")
    assert [g.adapters for g in fabrics.group_adapters(found)] == [("mlx5_0",)]
    check = fabrics.check_declarations([decl("ib-a", "mlx5_0", "mlx5_1")], found)
    assert codes(check) == [(fabrics.ADAPTER_NOT_ACTIVE, "ib-a")]
    assert "port 1: INIT, LinkUp" in check.problems[0].message


def test_an_adapter_declared_under_two_fabrics_is_refused_in_both() -> None:
    check = fabrics.check_declarations(
        [decl("ib-a", "mlx5_0", "mlx5_1"), decl("ib-b", "mlx5_1")], adapters("one-fabric")
    )
    assert check.fabrics == ()
    assert codes(check) == [(fabrics.ADAPTER_IN_TWO_FABRICS, "ib-a"), (fabrics.ADAPTER_IN_TWO_FABRICS, "ib-b")]
    p = check.problems[0]
    assert p.message == (
        "adapter 'mlx5_1' is under fabrics 'ib-a' and 'ib-b'; an adapter belongs to one fabric "
        "(a replica given adapters on two fabrics starts, passes its health checks and hangs on its first all-reduce)"
    )
    assert p.fix == f"name mlx5_1 under one fabric only; the adapters here report: {SM_A}: mlx5_0,mlx5_1"


def test_an_empty_tree_has_no_groups_and_no_adapter_to_declare() -> None:
    found = adapters("empty")
    assert fabrics.group_adapters(found) == ()
    check = fabrics.check_declarations([decl("ib-a")], found)
    assert codes(check) == [(fabrics.NO_ADAPTER_LEFT, "ib-a")]
    assert check.problems[0].message == (
        "fabric 'ib-a' names no adapters and none is left to default to (adapters on this node: none)"
    )
    named = fabrics.check_declarations([decl("ib-a", "mlx5_0")], found)
    assert codes(named) == [(fabrics.UNKNOWN_ADAPTER, "ib-a")]
    assert named.problems[0].message == "fabric 'ib-a': there is no adapter 'mlx5_0' on this node (adapters: none)"


def test_no_declaration_is_an_island_with_no_problems() -> None:
    check = fabrics.check_declarations([], adapters("two-fabrics"))
    assert check == fabrics.FabricCheck(declared=(), fabrics=(), problems=())


def test_without_sminfo_a_declaration_cannot_be_verified() -> None:
    found = adapters("one-fabric", sminfo_path=NO_TOOL)
    assert fabrics.group_adapters(found) == ()
    check = fabrics.check_declarations([decl("ib-a")], found)
    assert check.fabrics == ()
    assert {p.code for p in check.problems} == {fabrics.IDENTITY_UNKNOWN}
    assert {p.severity for p in check.problems} == {fabrics.UNKNOWN}


def test_a_fabric_declared_twice() -> None:
    check = fabrics.check_declarations([decl("ib-a", "mlx5_0"), decl("ib-a", "mlx5_1")], adapters("one-fabric"))
    assert check.fabrics == ()
    assert (fabrics.DECLARED_TWICE, "ib-a") in codes(check)


def test_an_adapter_whose_ports_see_two_fabrics() -> None:
    a, b = adapters("two-fabrics")[:3:2]
    two_ports = attrs.evolve(a, ports=(a.ports[0], attrs.evolve(b.ports[0], port=2)))
    check = fabrics.check_declarations([decl("ib-a", "mlx5_0")], [two_ports])
    assert codes(check) == [(fabrics.PORTS_DISAGREE, "ib-a")]
    assert check.problems[0].severity == fabrics.FAIL


def test_default_adapters_skip_the_ones_named_elsewhere_in_natural_order() -> None:
    names = ["mlx5_10", "mlx5_2", "mlx5_1", "mlx5_0"]
    found = [w.IbAdapter(name=n) for n in names]
    resolved, problems = fabrics.resolve_defaults([decl("a", "mlx5_1"), decl("b")], found)
    assert resolved == (decl("a", "mlx5_1"), decl("b", "mlx5_0", "mlx5_2")) and problems == []
