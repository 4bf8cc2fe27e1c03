"""The steps of `llmgw server add` that are a control plane's own: `identify` (the machine, and
the CA it may hold), `install`, `secrets`, `configure`, `store`, `start` and `verify`, built from
the toolkit's (llmgw.nodeadd: identify, service). Connecting, shipping and trying the release are
the toolkit's as they are.

Invariants:

- A secret crosses as a file, never as a word of a command: written into the stage (0700, the
  login's) over SFTP, 0600, moved into place by `install -m 0600 -o llmgw`, and its staged copy
  removed at once. No command, and no message, holds one; a file's sha256 is what is compared.
- Every file is written only where the machine's differs (its sha256, mode and owner), so a
  second run changes nothing, and `Facts.changed` says what did; the service is restarted only
  when something changed or it is not running.
- A machine that holds another CA is refused before anything is written there: its control
  plane, and every certificate it issued, would be orphaned.
- The service starts only once `llmgw server check-store` has run there, as the service's user,
  with the files the service will read, and found the store this control plane uses.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import trio
from cryptography import x509
from cryptography.exceptions import InvalidSignature

from llmgw.config import storeurl
from llmgw.ctl.client import AdminClient
from llmgw.errors import LlmgwError, PeerError, UsageError
from llmgw.nodeadd import context, service, ssh
from llmgw.nodeadd.context import DOCTOR_S, SHORT_S, must, put_text, said
from llmgw.nodeadd.identify import check_sudo, probe_machine
from llmgw.nodeadd.server import layout
from llmgw.pki.ca import CA, cert_info

POLL_S = 1.0
GIVE_UP_RESTARTS = 3  # systemd restarted the server this often since the start: it will not come up
KEEP_FOR_S = 30 * 86400  # an agent port certificate with less left than this is made anew


@attrs.frozen(kw_only=True)
class Options(context.Options):
    # The toolkit's (SSH, the control plane's state directory and server.toml, the release), and
    # a second control plane's own.
    config_path: Path | None = None  # this control plane's server.toml, whose catalog the new one gets
    source: dict[str, Any] = attrs.field(factory=dict)  # that file, parsed
    store_url: str = ""  # --store: the url the machine reaches the store at ("": this control plane's)
    advertise: tuple[str, ...] = ()
    # Which store this control plane's [store] names, read here (llmgw.server.store.check.look, in a
    # thread): node add's code never opens the store itself; the command gives it the way.
    look_store: Callable[[], Any] | None = None


@attrs.frozen(kw_only=True)
class Held:
    """What this control plane holds that the new one gets: each file's bytes, by `Copied`."""

    ca: CA
    files: tuple[tuple[layout.Copied, bytes], ...]
    store: Any  # llmgw.server.store.check.Seen: the store as this control plane sees it


@attrs.define
class Facts(context.Facts):
    machine_id: str = ""
    advertise: tuple[str, ...] = ()
    changed: list[str] = attrs.Factory(list)  # what this run changed on the machine, in words
    config_notes: tuple[str, ...] = ()


# -- identify ------------------------------------------------------------------------------

MACHINE_ID_ARGV = ["cat", "--", "/etc/machine-id"]  # tells this machine from another


async def identify(opts: Options, s: ssh.SshSession, facts: Facts, held: Held, here_machine_id: str) -> str:
    await probe_machine(
        s,
        facts,
        without_systemd="does not run systemd, and `llmgw server add` installs the control plane as a systemd "
        'service; set it up by hand there (docs/high-availability.md, "Adding a second control plane")',
    )
    mid = await s.run(MACHINE_ID_ARGV, timeout_s=SHORT_S)
    facts.machine_id = mid.stdout.strip() if mid.exit_status == 0 else ""
    if facts.machine_id and facts.machine_id == here_machine_id:
        raise UsageError(
            f"{s.target} is this machine (the same /etc/machine-id): a second control plane goes on another machine, "
            "so that one outlives the other"
        )
    await check_sudo(s)
    theirs = await s.run(["cat", "--", layout.CA_CERT], sudo=True, timeout_s=SHORT_S)
    ours = held.ca.info()
    text = f"{facts.hostname}, {facts.machine}, systemd"
    if theirs.exit_status != 0:
        return f"{text}; no CA there yet"
    refuse_another_ca(theirs.stdout.encode(), held.ca, str(s.target))
    return f"{text}; it holds this cluster's CA already (sha256 {ours.fingerprint_sha256[:23]}...)"


def refuse_another_ca(pem: bytes, ca: CA, target: str) -> None:
    """The machine's ca.crt is this CA's, or a UsageError: it belongs to another cluster."""
    try:
        theirs = cert_info(x509.load_pem_x509_certificate(pem))
    except ValueError:
        raise UsageError(
            f"{target}: {layout.CA_CERT} is there and is not a certificate; if no control plane uses that machine's "
            f"{layout.STATE_DIR}, move it aside (`sudo mv {layout.STATE_DIR} {layout.STATE_DIR}.old`) and run again"
        ) from None
    ours = ca.info()
    if theirs.fingerprint_sha256 != ours.fingerprint_sha256:
        raise UsageError(
            f"{target} holds another CA in {layout.STATE_DIR} ({theirs.common_name!r}, sha256 "
            f"{theirs.fingerprint_sha256[:23]}...; this cluster's is {ours.common_name!r}, sha256 "
            f"{ours.fingerprint_sha256[:23]}...): it is another cluster's control plane, and replacing its CA would "
            "orphan every certificate it issued. Nothing was changed there. If that cluster is retired, stop it "
            f"(`sudo systemctl disable --now {layout.UNIT_NAME}`), move its state aside (`sudo mv {layout.STATE_DIR} "
            f"{layout.STATE_DIR}.old`) and run again"
        )


# -- install -------------------------------------------------------------------------------


async def install(s: ssh.SshSession, facts: Facts) -> str:
    art = facts.artifact
    assert art is not None
    made = await service.ensure_user(s, layout.USER, layout.user_argv())
    if made:
        facts.changed.append(f"user {layout.USER}")
    user = service.user_text(layout.USER, made)
    for argv in layout.dirs_argv():
        await must(s, argv, sudo=True, what=f"making {argv[-1]}")
    if await service.install_bin(s, facts):
        facts.changed.append(layout.BIN)
    return f"{layout.BIN} ({art.version}), {user}, {layout.STATE_DIR} (0700, its own)"


# -- placing files -------------------------------------------------------------------------


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def place(
    s: ssh.SshSession, facts: Facts, data: bytes, dest: str, *, mode: int, owner: str, group: str, what: str
) -> bool:
    """`data` at `dest` with `mode`, `owner` and `group`, unless it is there so already; True if
    written. The bytes go over SFTP into the stage and are moved into place: never on argv."""
    meta = await s.run(["stat", "-c", "%a %U %G", "--", dest], sudo=True, timeout_s=SHORT_S)
    if meta.exit_status == 0 and meta.stdout.split() == [f"{mode:o}", owner, group]:
        held = await s.run(["sha256sum", "--", dest], sudo=True, timeout_s=SHORT_S)
        if held.exit_status == 0 and held.stdout.split()[:1] == [sha256_hex(data)]:
            return False
    staged = f"{facts.stage}/placing"
    await put_text(s, data.decode(), staged, mode=0o600)
    try:
        await must(
            s,
            ["install", "-m", f"{mode:04o}", "-o", owner, "-g", group, staged, dest],
            sudo=True,
            what=f"installing {what} as {dest}",
        )
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(SHORT_S):
            await s.run(["rm", "-f", "--", staged], sudo=True, timeout_s=SHORT_S)
    return True


async def secrets(s: ssh.SshSession, facts: Facts, held: Held) -> str:
    placed, kept = [], []
    for copied, data in held.files:
        if await place(
            s, facts, data, copied.remote, mode=copied.mode, owner=layout.USER, group=layout.USER, what=copied.what
        ):
            placed.append(copied.what)
            facts.changed.append(copied.what)
        else:
            kept.append(copied.what)
    where = f"in {layout.STATE_DIR} (0600 and {layout.USER}'s; the CA certificate 0644)"
    if not placed:
        return f"the same as there: {', '.join(kept)} {where}"
    return f"placed {', '.join(placed)} {where}" + (f"; the same as there: {', '.join(kept)}" if kept else "")


# -- configure -----------------------------------------------------------------------------


async def configure(opts: Options, s: ssh.SshSession, facts: Facts, held: Held) -> str:
    rendered = layout.server_toml(
        opts.source,
        store_url=opts.store_url,
        advertise=facts.advertise,
        password_file=any(c.remote == layout.PASSWORD_FILE for c, _ in held.files),
    )
    facts.config_notes = rendered.notes
    done = []
    if await place(
        s, facts, rendered.text.encode(), layout.CONFIG, mode=0o640, owner="root", group=layout.USER, what="server.toml"
    ):
        facts.changed.append(layout.CONFIG)
        done.append(f"wrote {layout.CONFIG}")
    cert = await server_cert(s, facts, held.ca, validity_days=opts.server_config.ca.server_cert_validity_days)
    unit_changed = await place(
        s, facts, layout.systemd_unit().encode(), layout.UNIT, mode=0o644, owner="root", group="root", what="the unit"
    )
    if unit_changed:
        facts.changed.append(layout.UNIT)
        await must(s, ["systemctl", "daemon-reload"], sudo=True, what="reloading systemd")
        done.append(f"wrote {layout.UNIT}")
    enabled = await s.run(["systemctl", "is-enabled", layout.UNIT_NAME], timeout_s=SHORT_S)
    if enabled.stdout.strip() != "enabled":
        await must(s, ["systemctl", "enable", layout.UNIT_NAME], sudo=True, what=f"enabling {layout.UNIT_NAME}")
        facts.changed.append(f"{layout.UNIT_NAME} enabled")
        done.append(f"enabled {layout.UNIT_NAME}")
    text = "; ".join(done) if done else f"{layout.CONFIG} and {layout.UNIT} (enabled) the same as there"
    notes = "".join(f"; {n}" for n in rendered.notes)
    return f"{text}; {cert}; store {redacted(opts.store_url)}{notes}"


def redacted(url: str) -> str:
    return storeurl.redact(url)


async def server_cert(s: ssh.SshSession, facts: Facts, ca: CA, *, validity_days: int) -> str:
    """The agent port's certificate there: kept while it fits (this CA's, for exactly the
    addresses advertised, a month or more left), else made there (its key never leaves)."""
    res = await s.run(["cat", "--", layout.SERVER_CERT], sudo=True, timeout_s=SHORT_S)
    pem = res.stdout.encode() if res.exit_status == 0 else None
    why = cert_misfit(pem, ca, facts.advertise)
    if not why:
        return f"its agent port's certificate kept (for {', '.join(facts.advertise)})"
    argv = ["ca", "server-cert", "--config", layout.CONFIG, "--validity-days", str(validity_days)]
    for address in facts.advertise:
        argv += ["--san", address]
    await must(s, layout.service_argv(*argv), sudo=True, what="making the agent port's certificate", timeout_s=DOCTOR_S)
    facts.changed.append("the agent port's certificate")
    return f"its agent port's certificate made there for {', '.join(facts.advertise)} ({why})"


def cert_misfit(pem: bytes | None, ca: CA, advertise: tuple[str, ...], now: float | None = None) -> str:
    """ "" when `pem` may stay as the agent port's certificate, else why not, in words."""
    if pem is None:
        return "there was none"
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return "the one there is not a certificate"
    try:
        cert.verify_directly_issued_by(ca.cert)
    except (ValueError, TypeError, InvalidSignature):
        return "the one there is another CA's"
    info = cert_info(cert)
    if sorted(info.sans) != sorted(advertise):
        return f"the one there is for {', '.join(info.sans) or 'no address'}"
    now = time.time() if now is None else now
    if info.not_after.timestamp() - now < KEEP_FOR_S or not info.valid_at(datetime.now(timezone.utc)):
        return f"the one there ends {info.not_after:%Y-%m-%d}"
    return ""


# -- store ---------------------------------------------------------------------------------


async def store(s: ssh.SshSession, held: Held, store_url: str) -> str:
    """`llmgw server check-store` there, as the service's user, with its server.toml: the same
    store as this control plane's, or the run stops here, nothing started."""
    res = await s.run(
        layout.service_argv("server", "check-store", "--config", layout.CONFIG, "--json"),
        sudo=True,
        timeout_s=DOCTOR_S,
    )
    where = redacted(store_url)
    if res.exit_status != 0:
        raise PeerError(
            f"{s.target} cannot use the store at {where} ({said(res)}); the control plane there was not started. "
            "Let that machine reach it (PostgreSQL's listen_addresses and pg_hba.conf, a firewall), or give --store "
            "the url it reaches the same database at, and run again"
        )
    try:
        seen = json.loads(res.stdout)
        identity = seen["identity"]
    except (ValueError, KeyError, TypeError):
        raise PeerError(f"{s.target}: `llmgw server check-store` said what it should not ({said(res)})") from None
    if identity != held.store.identity:
        raise UsageError(
            f"{s.target} reaches another database at {where} than this control plane's {held.store.store} (schema "
            f"history {identity[:16] or 'empty'} there, {held.store.identity[:16]} here); the control plane there "
            "was not started. Give --store the url at which that machine reaches this control plane's database"
        )
    return f"{s.target.host} reaches {seen['store']}, the same store (schema version {seen['version']})"


# -- start, verify -------------------------------------------------------------------------


async def start(s: ssh.SshSession, facts: Facts) -> str:
    active = await s.run(["systemctl", "is-active", layout.UNIT_NAME], timeout_s=SHORT_S)
    if not facts.changed and active.stdout.strip() == "active":
        return "running already, with the same files: not restarted"
    await must(s, ["systemctl", "restart", layout.UNIT_NAME], sudo=True, what=f"starting {layout.UNIT_NAME}")
    why = ", ".join(facts.changed) if facts.changed else "it was not running"
    facts.changed.append(f"{layout.UNIT_NAME} restarted")
    return f"started (systemctl restart {layout.UNIT_NAME}: {why}); its log: {layout.log_hint()}"


async def admin_authority(s: ssh.SshSession, token: str) -> dict[str, Any]:
    """GET /admin/v1/authority of the control plane on the machine, through an SSH forward to
    the address in its admin.url (a loopback one stays loopback)."""
    res = await s.run(["cat", "--", layout.ADMIN_URL], sudo=True, timeout_s=SHORT_S)
    if res.exit_status != 0:
        raise PeerError(f"its admin API has not said where it answers yet ({layout.ADMIN_URL} is not there)")
    url = urlsplit(res.stdout.strip())
    host = url.hostname or "127.0.0.1"
    async with s.forward("127.0.0.1" if host in ("0.0.0.0", "::") else host, url.port or 80) as port:
        client = AdminClient(f"http://127.0.0.1:{port}", token)
        return await trio.to_thread.run_sync(client.authority)


async def verify(
    s: ssh.SshSession,
    held: Held,
    *,
    timeout_s: float,
    progress: Callable[[str], None] = lambda said: None,
    ask: Callable[[], Awaitable[dict[str, Any]]] | None = None,
    restarts: Callable[[], Awaitable[int]] | None = None,
) -> str:
    """Until the new control plane's admin API answers, and then that it signs with this CA."""
    token = next(data for c, data in held.files if c.what == "the admin credential").decode().strip()
    ask = ask or partial(admin_authority, s, token)
    restarts = restarts or partial(service.unit_restarts, s, layout.UNIT_NAME)
    ours = held.ca.info().fingerprint_sha256
    last = ""
    with trio.move_on_after(timeout_s):
        while True:
            try:
                ca = await ask()
            except LlmgwError as exc:
                if str(exc) != last:
                    last = str(exc)
                    progress(f"waiting: {last}")
            else:
                if ca.get("fingerprint_sha256") != ours:
                    raise PeerError(
                        f"the control plane on {s.target} answers with another CA (sha256 "
                        f"{str(ca.get('fingerprint_sha256'))[:23]}..., this cluster's is {ours[:23]}...): something "
                        f"else holds its admin port, or its {layout.STATE_DIR} changed meanwhile"
                    )
                return f"its admin API answers with this cluster's CA {ca.get('common_name')!r} (sha256 {ours[:23]}...)"
            restarted = await restarts()
            if restarted >= GIVE_UP_RESTARTS:
                raise PeerError(
                    f"the control plane on {s.target} keeps exiting: systemd started it again {restarted} times. What "
                    f"it said ({layout.log_hint()}) names the cause" + await service.journal_tail(s, layout.UNIT_NAME)
                )
            await trio.sleep(POLL_S)
    raise PeerError(
        f"the control plane on {s.target} did not answer within {timeout_s:g} s ({last}); its log "
        f"({layout.log_hint()}) says why" + await service.journal_tail(s, layout.UNIT_NAME)
    )
