"""The `identify` step of `llmgw node add`: what the node is.

It reads the node (the toolkit's probe: hostname, architecture, init system; the trust store its
OS family has; an agent.toml from an earlier add) and, when the cluster knows a node by that
hostname, asks whether this machine holds that node's certificate (identity.py decides; the
control plane says whether the serial is revoked). Nothing is written on the node here.
"""

from __future__ import annotations

from pathlib import Path

import trio
from cryptography import x509

from llmgw import config as cfg
from llmgw.errors import ConfigError, PeerError, UsageError
from llmgw.nodeadd import ssh
from llmgw.nodeadd.context import SHORT_S, Authority, view_of
from llmgw.nodeadd.identify import check_sudo, probe_machine
from llmgw.nodeadd.node import identity, layout
from llmgw.nodeadd.node.install import Facts, Options
from llmgw.pki.ca import check_node_id
from llmgw.pki.files import node_paths


async def identify(opts: Options, s: ssh.SshSession, facts: Facts, auth: Authority) -> str:
    await probe(opts, s, facts)
    kb = view_of(auth.nodes, facts.node_id)
    again = ""
    if kb is not None:
        marks = "".join(f", {m}" for m in ("cordoned", "draining") if kb.get(m))
        again = f"; known to the cluster already ({kb['state']}{marks}): adding it again"
        why = await _why_not_the_holder(s, facts.node_id, auth)
        if why and not opts.reissue:
            raise UsageError(identity.refusal(facts.node_id, kb, str(s.target), why))
        if why:
            again = (
                f"; known to the cluster already ({kb['state']}{marks}), and this machine {why}: --reissue makes it "
                f"{facts.node_id!r} and revokes the certificates of the machine it replaces"
            )
    service = "systemd" if facts.systemd else "no systemd"
    store = f", {facts.trust_store.family} trust store" if facts.trust_store else ""
    return f"node id {facts.node_id!r} (its hostname), {facts.machine}, {service}{store}{again}"


async def probe(opts: Options, s: ssh.SshSession, facts: Facts) -> None:
    found = await probe_machine(s, facts, machine="node", tools=layout.TRUST_TOOLS)
    hostname = found.hostname
    try:
        facts.node_id = check_node_id(hostname)
    except UsageError:
        raise PeerError(
            f"{s.target}: its hostname {hostname!r} cannot be a node id (letters, digits, '-' and '.'); "
            "give the machine a proper hostname (`sudo hostnamectl set-hostname NAME`) and run again"
        ) from None
    if opts.system_trust:
        facts.trust_store = layout.trust_store(found, str(s.target))
    await check_sudo(s)
    current = await s.run(["cat", "--", layout.CONFIG], sudo=True, timeout_s=SHORT_S)
    if current.exit_status == 0:
        try:
            facts.existing = cfg.agent_config_from_dict(cfg.parse_toml(current.stdout, layout.CONFIG), layout.CONFIG)
        except ConfigError as exc:
            raise PeerError(
                f"{s.target}: its {layout.CONFIG} (from an earlier add, or written by hand) does not load: {exc}. "
                f"Fix it, or remove it to have it written afresh"
            ) from None


async def _why_not_the_holder(s: ssh.SshSession, node_id: str, auth: Authority) -> str:
    """Empty if the machine holds the known node's certificate, else what it holds (identity.why_not_the_holder)."""
    node = node_paths(Path(layout.STATE_DIR))
    res = await s.run(["cat", "--", str(node.cert)], sudo=True, timeout_s=SHORT_S)
    pem = res.stdout.encode() if res.exit_status == 0 else None
    revoked = False
    try:
        held = x509.load_pem_x509_certificate(pem).serial_number if pem is not None else None
    except ValueError:
        held = None  # not a certificate: why_not_the_holder says so
    if held is not None:
        revoked = await trio.to_thread.run_sync(auth.admin.is_revoked, held)
    return identity.why_not_the_holder(
        pem, ca_cert=auth.ca.cert, node_id=node_id, is_revoked=lambda n: revoked and n == held
    )
