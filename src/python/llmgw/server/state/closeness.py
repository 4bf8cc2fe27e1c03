"""Which nodes are close enough to share one replica: the groups a multi-node replica's members
must all be in. Pure: an address and a model in, group keys out.

A fabric (by identity, "name@identity") is close for every engine. llama.cpp's RPC needs no
fabric -- its tensors cross plain TCP -- so for a llama.cpp model the nodes of one subnet are
close too: the subnet of the address the control plane reaches the node at (IPv4 /24, IPv6 /64;
the agent reports no interface prefix), keyed "subnet:10.0.0.0/24". A fabric is preferred to a
subnet (`GROUP_ORDER`): the nodes of one InfiniBand fabric are closer than those of one subnet.
"""

from __future__ import annotations

import ipaddress

from llmgw.engines import SPECS

SUBNET = "subnet:"
SUBNET_BITS = {4: 24, 6: 64}


def subnet_of(address: str) -> str:
    """The subnet key of a node reached at `address` ("" for none: no address, or not an IP
    address); an IPv4-mapped IPv6 address is its IPv4 address."""
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return ""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    net = ipaddress.ip_network(f"{ip}/{SUBNET_BITS[ip.version]}", strict=False)
    return f"{SUBNET}{net}"


def over_rpc(engine: str) -> bool:
    """Whether the members of a multi-node replica of `engine` speak plain TCP to each other (its
    spec's `rpc_helpers`: llama.cpp's RPC): it may span the nodes of one subnet without a fabric,
    and its members are told every member's address."""
    spec = SPECS.get(engine)
    return spec is not None and spec.rpc_helpers


def groups_of(engine: str, fabrics: tuple[str, ...], subnet: str) -> tuple[str, ...]:
    """The group keys a node of these `fabrics` and `subnet` is in for a replica of `engine`."""
    if subnet and over_rpc(engine):
        return (*fabrics, subnet)
    return fabrics


def group_order(key: str) -> int:
    """Fabrics (0) before subnets (1)."""
    return int(key.startswith(SUBNET))


def group_name(key: str) -> str:
    """A group as people read it: a fabric's name, "subnet 10.0.0.0/24"."""
    if key.startswith(SUBNET):
        return f"subnet {key[len(SUBNET) :]}"
    return key.split("@")[0]


def group_kinds(engine: str) -> str:
    """What a multi-node replica of `engine` needs its nodes to share, for its pending reason."""
    return "one fabric or subnet" if over_rpc(engine) else "one fabric"
