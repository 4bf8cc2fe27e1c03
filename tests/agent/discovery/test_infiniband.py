"""sysfs trees as the kernel writes them, sminfo and ip stood in for by scripts."""

from __future__ import annotations

import attrs
import pytest

from agent.discovery import infiniband as ib
from testlib.hardware import NO_TOOL, ib_root, ip, sminfo

SM_A = "0x0002c90300a1b2c3"
SM_B = "0x98039b0300c0ffee"


def probe(case: str, sminfo_path: str | None = None) -> ib.IbReport:
    return ib.probe_infiniband(
        ib_root(case), sminfo=sminfo_path if sminfo_path is not None else sminfo(case), ip=ip(case), timeout_s=10
    )


def ports(report: ib.IbReport) -> dict[str, object]:
    return {a.name: a.ports[0] for a in report.adapters}


def test_kernel_formats() -> None:
    assert ib.parse_enum("4: ACTIVE\n") == "ACTIVE"
    assert ib.parse_enum("5: LinkUp") == "LinkUp"
    assert ib.parse_lid("0x1\n") == 1 and ib.parse_lid("0xffff") == 0xFFFF and ib.parse_lid("") == 0
    assert ib.gid_prefix("fe80:0000:0000:0000:0c42:a1ff:fe12:3456\n") == ib.DEFAULT_GID_PREFIX
    assert ib.normalize_guid("0x2c90300a1b2c3") == SM_A


def test_sminfo_output() -> None:
    out = "sminfo: sm lid 1 sm guid 0x0002c90300a1b2c3, activity count 123456 priority 15 state 3 SMINFO_MASTER\n"
    assert ib.parse_sminfo(out) == ib.SmInfo(lid=1, guid=SM_A)
    with pytest.raises(ib.ToolOutputError):
        ib.parse_sminfo("ibwarn: [4711] mad_rpc_open_port: can't open UMAD port")


def test_ip_json_gives_the_ipv4_network_and_ignores_link_local() -> None:
    text = (
        '[{"ifname":"e","addr_info":[{"family":"inet6","local":"fe80::1","prefixlen":64,"scope":"link"},'
        '{"family":"inet","local":"10.1.2.3","prefixlen":16,"scope":"global"}]}]'
    )
    assert ib.parse_ip_network(text) == "10.1.0.0/16"
    six = '[{"addr_info":[{"family":"inet6","local":"fd00:1::5","prefixlen":64,"scope":"global"}]}]'
    assert ib.parse_ip_network(six) == "fd00:1::/64"
    assert ib.parse_ip_network('[{"addr_info":[]}]') == ""
    with pytest.raises(ib.ToolOutputError):
        ib.parse_ip_network("Device does not exist")


def test_two_independent_fabrics_differ_only_in_their_subnet_managers_guid() -> None:
    report = probe("two-fabrics")
    p = ports(report)
    assert list(p) == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    # What sysfs alone shows cannot tell the two apart: same SM LID, same default GID prefix, same LIDs.
    assert {(x.sm_lid, x.gid_prefix) for x in p.values()} == {(1, ib.DEFAULT_GID_PREFIX)}
    assert p["mlx5_0"].lid == p["mlx5_2"].lid == 5
    assert [x.identity for x in p.values()] == [f"ib-sm:{SM_A}"] * 2 + [f"ib-sm:{SM_B}"] * 2
    first = p["mlx5_0"]
    assert (first.state, first.phys_state, first.link_layer, first.rate) == (
        "ACTIVE",
        "LinkUp",
        "InfiniBand",
        "200 Gb/sec (4X HDR)",
    )
    assert first.sm_guid == SM_A and first.netdev == "" and first.identity_error == ""
    assert report.adapters[0].node_guid == "0c42:a103:0012:3456"


def test_roce_ports_are_identified_by_their_interfaces_network() -> None:
    p = ports(probe("roce"))
    assert {n: (x.link_layer, x.netdev, x.identity) for n, x in p.items()} == {
        "mlx5_0": ("Ethernet", "ens1f0np0", "roce:192.168.50.0/24"),
        "mlx5_1": ("Ethernet", "ens1f1np1", "roce:192.168.50.0/24"),
        "mlx5_2": ("Ethernet", "ens2f0np0", "roce:192.168.60.0/24"),
    }
    assert p["mlx5_0"].sm_lid == 0 and p["mlx5_0"].network == "192.168.50.0/24"


def test_a_port_down_has_no_identity_and_sminfo_is_not_asked() -> None:
    p = ports(probe("port-down"))
    assert (p["mlx5_1"].state, p["mlx5_1"].phys_state, p["mlx5_1"].lid) == ("DOWN", "Polling", 0xFFFF)
    assert p["mlx5_1"].identity == "" and p["mlx5_1"].identity_error == ""
    assert p["mlx5_0"].identity == f"ib-sm:{SM_A}"


def test_a_linked_port_without_a_subnet_manager() -> None:
    p = ports(probe("sm-lid-zero"))
    assert (p["mlx5_1"].state, p["mlx5_1"].phys_state, p["mlx5_1"].sm_lid) == ("INIT", "LinkUp", 0)
    assert p["mlx5_1"].identity == ""


def test_an_active_port_with_sm_lid_zero_says_so() -> None:
    port = ib.read_adapters(ib_root("one-fabric"))[0].ports[0]
    zero = ib.identify_port("mlx5_0", attrs.evolve(port, sm_lid=0), sminfo=NO_TOOL, ip=NO_TOOL, timeout_s=1)
    assert zero.identity == "" and zero.identity_error == "no subnet manager (sm_lid 0x0)"


def test_without_sminfo_an_infiniband_port_cannot_be_identified() -> None:
    report = probe("one-fabric", sminfo_path=NO_TOOL)
    assert not report.sminfo_installed
    port = report.adapters[0].ports[0]
    assert port.identity == ""
    assert port.identity_error == (
        f"cannot read the subnet manager's GUID: {NO_TOOL} is not installed (package infiniband-diags)"
    )


def test_sminfo_failing_keeps_its_message() -> None:
    # The two-fabrics stand-in knows mlx5_0..3 only; ask it about another adapter.
    port = ib.read_adapters(ib_root("one-fabric"))[0].ports[0]
    out = ib.identify_port("mlx5_9", port, sminfo=sminfo("two-fabrics"), ip=NO_TOOL, timeout_s=10)
    assert out.identity == ""
    assert out.identity_error == (
        f"cannot read the subnet manager's GUID: {sminfo('two-fabrics')} exits 255: ibwarn: [4711] "
        "mad_rpc_open_port: can't open UMAD port (mlx5_9:1) sminfo: iberror: failed: Failed to open 'mlx5_9' port '1'"
    )


def test_empty_and_missing_trees() -> None:
    empty = probe("empty")
    assert empty.root_found and empty.adapters == ()
    missing = probe("no-such-case")
    assert not missing.root_found and missing.adapters == ()
