"""A standalone gateway cut off from a control plane that stays up: the issue's "a revocation made
while it was cut off applies within 5 s of its return".

The control plane runs in a network namespace joined to this machine by two links (testlib.netns):
its agent dials it over the first, the gateway (`llmgw gateway --server`, two workers, on this
machine's loopback) over the second. Cutting the second leaves the cluster whole — the agent
linked, its engine serving, the admin API answering — while the gateway hears nothing: its
packets go into silence, as when a switch port or a firewall between them dies. Meanwhile a
key is revoked; the gateway, cut off, still takes it (it cannot know), and serves every other
request from its table. The link restored, every worker refuses the key within 5 s.

The link is restored at the worst moment for the gateway: just after the kernel's last resend of
a SYN within one of its dials (seen in `ss`), so that the dial can only time out and the next one
finds the path; a restore at any other moment is found sooner. The figures are printed (run with
`-- -s` to see them); docs/gateway.md quotes them.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from llmgw.gatewayd.link import TCP_CONNECT_TIMEOUT_S
from testlib import gatewayd
from testlib.cluster import Cluster, ServerNet, wait_until
from testlib.load import Load
from testlib.netns import SYN_RESENDS_S, NetNS, preflight, syn_sent

CATALOG = """
[[models]]
name = "chat"
engine = "sim"
replicas = 1
"""
READY_S = 60.0
CUT_S = 10.0  # at least: long enough for both ends to give the link up, and for the gateway to dial into it
# The last SYN a dial of the gateway's sends (the kernel resends at these moments until the dial
# gives up): a path restored just after it is found only by the next dial.
LAST_RESEND_S = max(s for s in SYN_RESENDS_S if s < TCP_CONNECT_TIMEOUT_S)
LINK_DOWN_WITHIN_S = 15.0  # the gateway's silence limit (5 s) and a dial in flight
REVOKED_WITHIN_S = 5.0  # the issue's promise, from the link's return


def test_a_revocation_made_while_a_gateway_is_cut_off_applies_within_5_s_of_its_return(tmp_path: Path) -> None:
    assert not (why := preflight()), why
    with NetNS() as ns:
        gateway_link = ns.add_link()
        net = ServerNet(
            prefix=("ip", "netns", "exec", ns.name),
            agent_host="0.0.0.0",  # the namespace's addresses: one link for the agent, one for the gateway
            dial_host=ns.node_addr,
            advertise=(ns.node_addr, gateway_link.node_addr),
        )
        cluster = Cluster(tmp_path, heartbeat_interval_s=0.2, heartbeat_ttl_s=3.0, net=net)
        try:
            _scenario(cluster, ns, gateway_link)
        finally:
            cluster.close()


def _scenario(cluster: Cluster, ns: NetNS, gateway_link) -> None:
    cluster.init_ca()
    cluster.set_catalog(CATALOG)
    cluster.add_node("node-a")
    pki = gatewayd.issue_certificate(cluster, "gw1")
    cluster.start_server()
    cluster.start_agent("node-a")
    cluster.wait_replicas("the replica ready", lambda rs: [r["state"] for r in rs] == ["ready"], timeout=READY_S)
    alice = cluster.ctl("keys", "create", "alice")["token"]
    bob = cluster.ctl("keys", "create", "bob")["token"]
    gw = gatewayd.start(cluster, "gw1", pki, workers=2, server=f"wss://{gateway_link.node_addr}:{cluster.port}")
    gw.wait_serving()
    assert gw.accepts(bob, 200, samples=4)
    measured: dict[str, object] = {"cut_s": CUT_S}

    loads = [Load(gw.port, alice, max_s=120).start() for _ in range(2)]
    try:
        cut_at = time.monotonic()
        ns.cut(gateway_link)
        wait_until(
            "every worker sees its link down",
            lambda: gw.every_worker(lambda h: not h["link_up"]),
            procs=[gw.proc, *cluster.latest()],
            timeout=LINK_DOWN_WITHIN_S,
            last_seen=gw.health,
        )
        measured["link_down_after_s"] = round(time.monotonic() - cut_at, 2)
        wait_until(
            "the control plane without the gateway's links",
            # None of its instances (the control plane's own workers stay: they are not cut off).
            lambda: all(g["name"] != gw.name for g in gatewayd.admin(cluster, "GET", "/admin/v1/gateways")["gateways"]),
            procs=cluster.latest(),
        )
        cluster.ctl("keys", "revoke", "bob")  # the control plane is up; only the gateway is cut off
        assert gw.accepts(bob, 200), "cut off, the gateway still takes the keys it knew"
        assert cluster.replicas()[0]["state"] == "ready"  # the cluster itself is whole
        time.sleep(max(0.0, cut_at + CUT_S - time.monotonic()))

        # A dial begins (a new connect waiting for an answer); restore just after its last resend.
        seen = syn_sent(gateway_link.node_addr)
        began = wait_until(
            "a new dial of the gateway",
            lambda: syn_sent(gateway_link.node_addr) - seen and time.monotonic(),
            procs=[gw.proc],
            timeout=TCP_CONNECT_TIMEOUT_S + 5,
        )
        time.sleep(max(0.0, began + LAST_RESEND_S + 0.2 - time.monotonic()))
        ns.restore(gateway_link)
        restored_at = time.monotonic()
        measured["restored_into_the_dial_s"] = round(restored_at - began, 2)
        wait_until(
            "bob refused by every worker",
            lambda: gw.accepts(bob, 401),
            procs=[gw.proc],
            timeout=REVOKED_WITHIN_S,
            last_seen=gw.health,
        )
        measured["revoked_refused_after_return_s"] = round(time.monotonic() - restored_at, 2)
        wait_until("every worker linked", lambda: gw.every_worker(lambda h: h["link_up"]), procs=[gw.proc])
    finally:
        for load in loads:
            load.finish()

    failures = [f for load in loads for f in load.failures]
    measured |= {
        "requests": sum(len(load.answers) for load in loads),
        "failed": len(failures),
        "slowest_s": round(max(load.slowest_s for load in loads), 3),
    }
    print(f"\nstandalone gateway cut off from its control plane: {json.dumps(measured)}")
    assert failures == [], failures[:5]
    assert gw.ask(alice)[0] == 200
    assert gw.proc.stop(signal.SIGTERM, timeout=60) == 0, gw.proc.tail()
