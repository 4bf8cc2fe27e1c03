"""The steps of `llmgw gateway add` that are a gateway's own: what the machine is and what the
gateway is called (`identify`), `install`, `identity`, `configure`, `start` and `join`, each
built from the toolkit's (llmgw.nodeadd: identify, certs, service). Connecting, the address,
shipping and trying the shipped release are the toolkit's as they are.

A gateway's name is `--name` or the machine's hostname, and never a node's id: the control plane
records a gateway's certificates under its name as a node's under its id (so `llmgw node remove
NAME` revokes them), so a shared name would make removing or re-adding the node revoke the
gateway's too. Several machines may serve under one gateway name (each with a key and certificate
of its own); `identify` says so when it sees one.

`identity` follows the toolkit's certificate rules (llmgw.nodeadd.certs): the key is made on the
machine and never leaves it, the request is signed here with the gateway role, and the serial is
recorded through the admin API before the certificate is installed. A certificate the machine
holds is kept while it fits (ours, a gateway's, for this name and key, more than a week left, not
revoked) unless `--reissue`; the one it replaces is revoked. Other machines' certificates of the
same name are left alone (no `revoke_others`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import trio
from cryptography import x509

from llmgw import config as cfg
from llmgw.ctl.client import AdminClient
from llmgw.errors import PeerError, UsageError
from llmgw.nodeadd import certs, context, service, ssh
from llmgw.nodeadd.context import DOCTOR_S, SHORT_S, must, put_text, servers
from llmgw.nodeadd.gateway import layout
from llmgw.nodeadd.identify import check_sudo, probe_machine
from llmgw.nodeadd.steps import OK, WARN
from llmgw.pki.ca import CA, ROLE_GATEWAY, CertInfo, cert_info, check_own_gateway_name
from llmgw.pki.files import gateway_paths

POLL_S = 1.0
GIVE_UP_RESTARTS = 3  # systemd restarted the gateway this often since the start: it will not come up


@attrs.frozen(kw_only=True)
class Options(context.Options):
    # The toolkit's (SSH, the control plane's files, the release, --server-address,
    # --control-plane, --reissue and the join's timeout), and the gateway's own.
    name: str = ""  # --name; "": the machine's hostname
    listen: str = layout.DEFAULT_LISTEN
    workers: str = "1"  # a number, or "auto" (one per CPU there)


@attrs.frozen(kw_only=True)
class Authority(context.Authority):
    gateways: list[dict[str, Any]]  # the gateway instances connected when the run started


@attrs.define
class Facts(context.Facts):
    name: str = ""  # the gateway's: its certificate's CN
    named_by: str = ""  # "--name" or "its hostname"
    held: bytes | None = None  # the gateway.crt the machine had, as it was


# -- identify ------------------------------------------------------------------------------


async def identify(opts: Options, s: ssh.SshSession, facts: Facts, auth: Authority) -> tuple[str, str]:
    found = await probe_machine(
        s,
        facts,
        without_systemd="does not run systemd, and `llmgw gateway add` installs the gateway as a systemd service; "
        "run `llmgw gateway --server wss://HOST:PORT` there under the service manager it has, with a certificate "
        'from `llmgw ca issue --gateway NAME` (docs/gateway.md, "Running gateways of their own")',
    )
    facts.name, facts.named_by = gateway_name(opts.name, found.hostname, str(s.target))
    refuse_a_node_name(facts.name, auth.nodes)
    await check_sudo(s)
    held = await s.run(["cat", "--", str(gateway_paths(Path(layout.PKI_DIR)).cert)], sudo=True, timeout_s=SHORT_S)
    facts.held = held.stdout.encode() if held.exit_status == 0 else None
    text = f"gateway {facts.name!r} ({facts.named_by}), {facts.machine}, systemd"
    shared = sharing(auth.gateways, facts.name, _serial_of(facts.held))
    return (WARN, f"{text}; {shared}") if shared else (OK, text)


def gateway_name(given: str, hostname: str, target: str) -> tuple[str, str]:
    if given:
        return check_own_gateway_name(given), "--name"
    try:
        return check_own_gateway_name(hostname), "its hostname"
    except UsageError:
        raise UsageError(
            f"{target}: its hostname {hostname!r} cannot be a gateway's name (letters, digits, '.', '_' and '-', "
            "63 at most); name the gateway with --name NAME"
        ) from None


def refuse_a_node_name(name: str, nodes: list[dict[str, Any]]) -> None:
    if any(n["id"] == name for n in nodes):
        raise UsageError(
            f"{name!r} is a node of the cluster. A gateway's certificates are recorded under its name as a node's "
            f"are under its id, so `llmgw node remove {name}` would revoke both, and adding that node again would "
            f"revoke the gateway's; give the gateway a name of its own: --name {name}-gw"
        )


def sharing(gateways: list[dict[str, Any]], name: str, held_serial: int | None) -> str:
    """What to say when a gateway of this name is connected with a certificate this machine does
    not hold (another machine under the same name); "" when none is."""
    held = f"{held_serial:x}" if held_serial is not None else None
    theirs = [g for g in gateways if g["name"] == name and g.get("cert_serial") != held]
    if not theirs:
        return ""
    where = ", ".join(sorted({str(g.get("address", "?")) for g in theirs}))
    return (
        f"a gateway {name!r} is connected already from {where} with another certificate: that machine keeps it, "
        f"both serve under one name (its share of the keys' limits is split between them) and `llmgw node remove "
        f"{name}` revokes both; to keep them apart, run again with --name NAME"
    )


def _serial_of(pem: bytes | None) -> int | None:
    try:
        return x509.load_pem_x509_certificate(pem).serial_number if pem else None
    except ValueError:
        return None


# -- install -------------------------------------------------------------------------------


async def install(s: ssh.SshSession, facts: Facts) -> str:
    art = facts.artifact
    assert art is not None
    user = service.user_text(layout.USER, await service.ensure_user(s, layout.USER, layout.user_argv()))
    await must(s, layout.dirs_argv(), sudo=True, what=f"making {layout.PKI_DIR}")
    await service.install_bin(s, facts)
    return f"{layout.BIN} ({art.version}), {user}, {layout.PKI_DIR} (0700, its own)"


# -- identity ------------------------------------------------------------------------------


async def identity(opts: Options, s: ssh.SshSession, facts: Facts, auth: Authority) -> str:
    paths = gateway_paths(Path(layout.PKI_DIR))
    had_key = (await s.run(["test", "-e", str(paths.key)], sudo=True, timeout_s=SHORT_S)).exit_status == 0
    if opts.reissue:
        await must(
            s,
            ["rm", "-f", "--", str(paths.key), str(paths.cert), str(paths.csr)],
            sudo=True,
            what="removing the old identity",
        )
    await must(
        s, layout.csr_argv(facts.name), sudo=True, what="making the gateway's key and request", timeout_s=DOCTOR_S
    )
    csr_pem = (await must(s, ["cat", "--", str(paths.csr)], sudo=True, what="reading the request")).encode()
    kept = None if opts.reissue else fitting_cert(facts.held, csr_pem, auth.ca, facts.name)
    if kept is not None and await trio.to_thread.run_sync(auth.admin.is_revoked, kept.serial):
        kept = None
    if kept is not None:
        facts.cert_pem, facts.cert_serial = facts.held or b"", f"{kept.serial:x}"
        text = f"kept its certificate (serial {facts.cert_serial}, until {kept.not_after:%Y-%m-%d}); --reissue makes a new key"
    else:
        text = await _issue(opts.server_config, facts, auth, csr_pem, new_key=opts.reissue or not had_key)
    await _install_certs(s, facts, auth.ca)
    return text


async def _issue(config: cfg.ServerConfig, facts: Facts, auth: Authority, csr_pem: bytes, *, new_key: bool) -> str:
    days = config.ca.node_cert_validity_days
    facts.cert_pem = auth.ca.sign_gateway_csr(csr_pem, facts.name, validity_days=days)
    info = cert_info(x509.load_pem_x509_certificate(facts.cert_pem))
    facts.cert_serial = f"{info.serial:x}"
    old = certs.cert_or_none(facts.held)
    revoked = await trio.to_thread.run_sync(record, auth.admin, facts.name, info, old, auth.ca)
    also = f"; revoked the one it replaces (serial {revoked[0]})" if revoked else ""
    key = "a new key" if new_key else "its key"
    return f"issued CN={facts.name} (gateway role) for {key}, serial {facts.cert_serial}, until {info.not_after:%Y-%m-%d}{also}"


def fitting_cert(pem: bytes | None, csr_pem: bytes, ca: CA, name: str) -> CertInfo | None:
    """The machine's certificate, if it can stay: the toolkit's rule (llmgw.nodeadd.certs), and a
    gateway's."""
    return certs.fitting_cert(pem, csr_pem, ca, name, role=ROLE_GATEWAY)


def record(admin: AdminClient, name: str, info: CertInfo, old: x509.Certificate | None, ca: CA) -> list[str]:
    """Have the control plane remember the new serial under the gateway's name (so `llmgw node
    remove NAME` revokes it), and revoke the certificate this machine held, if ours. Other
    certificates of the name stay: they are other machines'. Returns the serials revoked, in
    hex. Blocking: one request."""
    return certs.record(admin, name, info, old, ca, revoke_others=False)


async def _install_certs(s: ssh.SshSession, facts: Facts, ca: CA) -> None:
    paths = gateway_paths(Path(layout.PKI_DIR))
    await put_text(s, facts.cert_pem.decode(), f"{facts.stage}/gateway.crt", mode=0o644)
    await put_text(s, ca.cert_pem().decode(), f"{facts.stage}/ca.crt", mode=0o644)
    for name, dest in (("gateway.crt", paths.cert), ("ca.crt", paths.ca_cert)):
        argv = ["install", "-m", "0644", "-o", layout.USER, "-g", layout.USER, f"{facts.stage}/{name}", str(dest)]
        await must(s, argv, sudo=True, what=f"installing {dest}")


# -- configure, start ----------------------------------------------------------------------


async def configure(opts: Options, s: ssh.SshSession, facts: Facts) -> str:
    unit = layout.systemd_unit(server=servers(opts, facts), listen=opts.listen, workers=opts.workers, name=facts.name)
    await service.install_unit(s, facts.stage, unit, layout.UNIT, layout.UNIT_NAME)
    return f"{layout.UNIT} (enabled): dials {facts.server}, serves {opts.listen} with {opts.workers} worker(s)"


async def start(s: ssh.SshSession) -> None:
    await service.restart(s, layout.UNIT_NAME)


def instances(gateways: list[dict[str, Any]], name: str) -> frozenset[str]:
    return frozenset(g["instance"] for g in gateways if g["name"] == name)


# -- join ----------------------------------------------------------------------------------


def link_progress(
    gateways: list[dict[str, Any]], *, name: str, serial: str, before: frozenset[str], workers: int
) -> tuple[bool, str]:
    """Whether the gateway just started is linked: `workers` instances of `name` that were not
    connected before the restart, with the certificate just installed (`serial`, hex); and
    what is seen so far, in words."""
    ours = [g for g in gateways if g["name"] == name and g.get("cert_serial") == serial and g["instance"] not in before]
    if len(ours) >= workers:
        where = ", ".join(sorted({str(g.get("address", "?")) for g in ours}))
        return True, f"linked: {len(ours)} worker(s) of gateway {name!r} connected from {where}"
    if ours:
        return False, f"{len(ours)} of {workers} worker(s) linked"
    if any(g["name"] == name and g["instance"] in before for g in gateways):
        return False, "the control plane still lists the gateway's workers from before the restart, none of the new"
    return False, "the control plane has no link from the gateway yet"


async def wait_for_link(
    opts: Options,
    s: ssh.SshSession,
    facts: Facts,
    admin: AdminClient,
    before: frozenset[str],
    *,
    progress: Callable[[str], None] = lambda said: None,
    poll: Callable[[], Awaitable[list[dict[str, Any]]]] | None = None,
    restarts: Callable[[], Awaitable[int]] | None = None,
) -> str:
    """Poll the control plane until the restarted gateway is linked; each new thing seen goes to
    `progress`. A unit systemd keeps restarting ends the wait early, with its log."""
    poll = poll or partial(trio.to_thread.run_sync, admin.gateways)
    restarts = restarts or partial(service.unit_restarts, s, layout.UNIT_NAME)
    expected = int(opts.workers) if opts.workers.isdigit() else 1  # auto: as many as CPUs there; one says it runs
    seen = ""
    with trio.move_on_after(opts.join_timeout_s):
        while True:
            done, now = link_progress(
                await poll(), name=facts.name, serial=facts.cert_serial, before=before, workers=expected
            )
            if done:
                return now
            if now != seen:
                progress(now)
                seen = now
            restarted = await restarts()
            if restarted >= GIVE_UP_RESTARTS:
                raise PeerError(
                    f"the gateway on {s.target} keeps exiting: systemd started it again {restarted} times. What it "
                    f"said ({layout.log_hint()}) names the cause, e.g. --listen's port taken by another program"
                    + await service.journal_tail(s, layout.UNIT_NAME)
                )
            await trio.sleep(POLL_S)
    raise PeerError(
        f"gateway {facts.name!r} did not link to the control plane within {opts.join_timeout_s:g} s: {seen}. Its "
        f"log on the machine ({layout.log_hint()}) says why" + await service.journal_tail(s, layout.UNIT_NAME)
    )
