"""InfiniBand and RoCE adapters from sysfs, and the fabric each active port is on.

sysfs (/sys/class/infiniband/ADAPTER/ports/N/...) gives each port's state, link layer, rate,
LIDs and GIDs, as the kernel writes them ("4: ACTIVE", "0x1", "200 Gb/sec (4X HDR)"). What it
cannot give is which fabric a port is on: an SM LID is not unique across fabrics (every
fabric's first subnet manager tends to be LID 1) and the default GID prefix fe80:: is shared by
every fabric that keeps it. So a port's identity is:

- InfiniBand: the master subnet manager's port GUID as `sminfo -C ADAPTER -P PORT`
  (infiniband-diags) reports it: "ib-sm:0x0002c90300a1b2c3";
- RoCE: the IP network of the port's Ethernet interface, from `ip -j addr show dev NETDEV`:
  "roce:192.168.50.0/24".

Parsing is pure (`parse_*`); `read_adapters` reads sysfs only; `identify` runs the tools.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from pathlib import Path

import attrs

from agent.discovery.tools import MISSING, ToolRun, run_tool
from llmgw.wire import agent_link as w

ACTIVE = "ACTIVE"
LINK_UP = "LinkUp"
INFINIBAND = "InfiniBand"
ETHERNET = "Ethernet"
IB_PREFIX = "ib-sm:"
ROCE_PREFIX = "roce:"
DEFAULT_GID_PREFIX = "fe80:0000:0000:0000"

_SMINFO = re.compile(r"sm lid (\d+) sm guid (0x[0-9a-fA-F]+)")


class ToolOutputError(ValueError):
    """A tool printed something other than what it prints."""


@attrs.frozen(kw_only=True)
class SmInfo:
    lid: int
    guid: str  # "0x0002c90300a1b2c3": lower case, 16 hex digits


@attrs.frozen(kw_only=True)
class IbReport:
    ib_root: str
    root_found: bool  # no directory: no RDMA driver loaded, which is a node without adapters
    adapters: tuple[w.IbAdapter, ...] = ()
    sminfo: str = ""
    sminfo_installed: bool = False
    ip: str = ""


# -- pure parsing ----------------------------------------------------------------------------


def parse_enum(text: str) -> str:
    """ "4: ACTIVE" -> "ACTIVE", "5: LinkUp" -> "LinkUp" (the kernel's name after the number)."""
    _, sep, name = text.strip().partition(":")
    return name.strip() if sep else text.strip()


def parse_lid(text: str) -> int:
    """ "0x1" -> 1; the kernel writes LIDs in hex."""
    try:
        return int(text.strip(), 0)
    except ValueError:
        return 0


def gid_prefix(gid: str) -> str:
    """The subnet prefix (first 64 bits) of a GID as sysfs writes it."""
    return ":".join(gid.strip().split(":")[:4])


def normalize_guid(text: str) -> str:
    return f"0x{int(text, 16):016x}"


def parse_sminfo(text: str) -> SmInfo:
    """`sminfo: sm lid 1 sm guid 0x2c90300a1b2c3, activity count 123 priority 15 state 3 SMINFO_MASTER`"""
    m = _SMINFO.search(text)
    if not m:
        raise ToolOutputError(f"expected 'sm lid N sm guid 0x...', got {text.strip()[:200]!r}")
    return SmInfo(lid=int(m.group(1)), guid=normalize_guid(m.group(2)))


def parse_ip_network(text: str) -> str:
    """The network of an interface from `ip -j addr show dev X`: IPv4 first, else global IPv6; "" if none."""
    try:
        data = json.loads(text or "[]")
    except ValueError as exc:
        raise ToolOutputError(f"not JSON: {exc}") from None
    found: dict[str, str] = {}
    for iface in data if isinstance(data, list) else []:
        for a in iface.get("addr_info", []):
            family, local, plen = a.get("family"), a.get("local"), a.get("prefixlen")
            if family not in ("inet", "inet6") or local is None or plen is None:
                continue
            if family == "inet6" and a.get("scope") != "global":
                continue  # link-local addresses are the same shape on every network
            found.setdefault(family, str(ipaddress.ip_interface(f"{local}/{plen}").network))
    return found.get("inet") or found.get("inet6") or ""


def is_active(port: w.IbPort) -> bool:
    return port.state == ACTIVE


# -- sysfs -----------------------------------------------------------------------------------


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:  # absent, or EINVAL as sysfs answers for a GID attribute that is not set
        return ""


def _netdev(adapter_dir: Path, port_dir: Path) -> str:
    name = _read(port_dir / "gid_attrs" / "ndevs" / "0")
    if name:
        return name
    try:
        nets = sorted(os.listdir(adapter_dir / "device" / "net"))
    except OSError:
        return ""
    return nets[0] if len(nets) == 1 else ""


def _natural(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def read_port(adapter_dir: Path, port_dir: Path) -> w.IbPort:
    layer = _read(port_dir / "link_layer")
    return w.IbPort(
        port=int(port_dir.name),
        state=parse_enum(_read(port_dir / "state")),
        phys_state=parse_enum(_read(port_dir / "phys_state")),
        link_layer=layer,
        rate=_read(port_dir / "rate"),
        lid=parse_lid(_read(port_dir / "lid")),
        sm_lid=parse_lid(_read(port_dir / "sm_lid")),
        gid_prefix=gid_prefix(_read(port_dir / "gids" / "0")),
        netdev=_netdev(adapter_dir, port_dir) if layer == ETHERNET else "",
    )


def read_adapters(ib_root: Path) -> tuple[w.IbAdapter, ...] | None:
    """Every adapter and port under ib_root, sorted by name; None when ib_root does not exist."""
    try:
        names = sorted((e.name for e in os.scandir(ib_root) if e.is_dir() and not e.name.startswith(".")), key=_natural)
    except OSError:
        return None
    adapters = []
    for name in names:
        adir = ib_root / name
        try:
            port_dirs = sorted((p for p in (adir / "ports").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
        except OSError:
            port_dirs = []
        adapters.append(
            w.IbAdapter(
                name=name,
                node_guid=_read(adir / "node_guid"),
                ports=tuple(read_port(adir, p) for p in port_dirs),
            )
        )
    return tuple(adapters)


# -- identities (runs sminfo and ip) ------------------------------------------------------------


def _tool_problem(run: ToolRun, what: str, install: str) -> str:
    if run.outcome == MISSING:
        return f"{what}: {run.argv[0]} is not installed ({install})"
    return f"{what}: {run.argv[0]} {run.problem()}"


def identify_port(adapter: str, port: w.IbPort, *, sminfo: str, ip: str, timeout_s: float) -> w.IbPort:
    if not is_active(port):
        return port
    if port.link_layer == INFINIBAND:
        if port.sm_lid == 0:
            return attrs.evolve(port, identity_error="no subnet manager (sm_lid 0x0)")
        run = run_tool([sminfo, "-C", adapter, "-P", str(port.port)], timeout_s=timeout_s)
        if not run.ok:
            why = _tool_problem(run, "cannot read the subnet manager's GUID", "package infiniband-diags")
            return attrs.evolve(port, identity_error=why)
        try:
            sm = parse_sminfo(run.stdout)
        except ToolOutputError as exc:
            return attrs.evolve(port, identity_error=f"sminfo printed something unexpected: {exc}")
        return attrs.evolve(port, sm_guid=sm.guid, identity=IB_PREFIX + sm.guid)
    if port.link_layer == ETHERNET:
        if not port.netdev:
            return attrs.evolve(port, identity_error="no network interface is attached to this RoCE port")
        run = run_tool([ip, "-j", "addr", "show", "dev", port.netdev], timeout_s=timeout_s)
        if not run.ok:
            why = _tool_problem(run, f"cannot read {port.netdev}'s network", "package iproute2")
            return attrs.evolve(port, identity_error=why)
        try:
            network = parse_ip_network(run.stdout)
        except ToolOutputError as exc:
            return attrs.evolve(port, identity_error=f"ip printed something unexpected: {exc}")
        if not network:
            return attrs.evolve(port, identity_error=f"{port.netdev} has no IP address; RoCE v2 needs one")
        return attrs.evolve(port, network=network, identity=ROCE_PREFIX + network)
    return attrs.evolve(port, identity_error=f"unknown link layer {port.link_layer!r}")


def probe_infiniband(ib_root: Path, *, sminfo: str, ip: str, timeout_s: float) -> IbReport:
    adapters = read_adapters(ib_root)
    installed = os.access(sminfo, os.X_OK)
    if adapters is None:
        return IbReport(ib_root=str(ib_root), root_found=False, sminfo=sminfo, sminfo_installed=installed, ip=ip)
    identified = tuple(
        attrs.evolve(
            a,
            ports=tuple(identify_port(a.name, p, sminfo=sminfo, ip=ip, timeout_s=timeout_s) for p in a.ports),
        )
        for a in adapters
    )
    return IbReport(
        ib_root=str(ib_root), root_found=True, adapters=identified, sminfo=sminfo, sminfo_installed=installed, ip=ip
    )
