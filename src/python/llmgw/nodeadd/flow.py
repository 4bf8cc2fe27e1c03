"""`llmgw node add`: the steps, run against one node over SSH, in the order of `steps.STEPS`.

Invariants:

- The authority (CA, server certificate, a running control plane) is read before the node is
  touched: a missing one is said before any SSH connection is made.
- Nothing is changed on the node until doctor has passed there. The release is staged in a
  private directory under /tmp, its sha256 checked on the node, and doctor run from it; the
  stage is removed at the end whatever happens.
- Every remote command is argv (llmgw.nodeadd.remote quotes it); stdout and stderr stay apart.
- Running it again converges: the same files are rewritten, the zipapp replaced only when its
  sha256 differs, the node's key and certificate kept unless `reissue`, and the agent restarted;
  "joined" then means a heartbeat from the restarted agent (its start time differs).
"""

from __future__ import annotations

import ipaddress
import json
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import attrs
import trio
import trio_asyncio
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from llmgw import config as cfg
from llmgw.ctl.client import AdminClient
from llmgw.errors import ConfigError, LlmgwError, MachineError, PeerError, UsageError, leaves, only
from llmgw.nodeadd import identity, layout, ssh
from llmgw.nodeadd.questions import DoctorFailure, Questions
from llmgw.nodeadd.release import Artifact, find_artifact, release_arch
from llmgw.nodeadd.steps import FAILED, OK, STARTED, WARN, Event
from llmgw.pki.ca import CA, CertInfo, cert_info, check_node_id
from llmgw.pki.files import ca_paths, load_ca, load_cert, node_paths
from llmgw.wire.agent_link import FabricGroup

Emit = Callable[[Event], None]

_SHORT_S = 60  # a command that only reads or writes a file
_DOCTOR_S = 180  # doctor runs nvidia-smi and sminfo, and unpacks the zipapp first
_FETCH_S = 600
_POLL_S = 1.0
_LOG_LINES = 15


@attrs.frozen(kw_only=True)
class Options:
    target: str  # user@host
    server_config: cfg.ServerConfig
    state_dir: Path
    known_hosts: Path
    identity_files: tuple[Path, ...] | None = None
    accept_new_host_key: bool = False  # trust a host absent from known_hosts without asking
    ssh_port: int = 22
    release: str = ""
    server_address: str = ""
    fabrics: tuple[cfg.FabricDecl, ...] = ()
    ignore_doctor: frozenset[str] = frozenset()
    reissue: bool = False
    system_trust: bool = True  # also trust the CA root in the node's system store (layout.TRUST_STORES)
    join_timeout_s: float = 600.0
    llamacpp_bin: str = ""
    vllm_bin: str = ""
    sglang_python: str = ""


@attrs.frozen(kw_only=True)
class Added:
    node_id: str
    server: str
    version: str
    service: str  # "systemd" or "supervisor"
    cert_serial: str
    log: str  # where the agent's log is, on the node


@attrs.define
class _Outcome:
    status: str = OK
    detail: str = ""

    def ok(self, detail: str) -> None:
        self.status, self.detail = OK, detail

    def warn(self, detail: str) -> None:
        self.status, self.detail = WARN, detail

    def say(self, status: str, detail: str) -> None:
        """OK or WARN, as a step's helper decided."""
        self.status, self.detail = status, detail


@asynccontextmanager
async def _step(emit: Emit, name: str) -> AsyncIterator[_Outcome]:
    emit(Event(step=name, status=STARTED))
    outcome = _Outcome()
    try:
        yield outcome
    except LlmgwError as exc:
        emit(Event(step=name, status=FAILED, detail=str(exc)))
        raise
    except (trio.Cancelled, KeyboardInterrupt):
        emit(Event(step=name, status=FAILED, detail="interrupted"))
        raise
    except BaseException as exc:
        emit(Event(step=name, status=FAILED, detail=f"internal error (a bug in llmgw): {exc!r}"))
        raise
    emit(Event(step=name, status=outcome.status, detail=outcome.detail))


@attrs.frozen(kw_only=True)
class _Authority:
    """What the control plane holds, read before the node is touched."""

    ca: CA
    server_cert: CertInfo
    admin: AdminClient
    nodes: list[dict[str, Any]]


@attrs.define
class _Facts:
    node_id: str = ""
    arch: str = ""
    machine: str = ""
    systemd: bool = False
    trust_store: layout.TrustStore | None = None  # None: --no-system-trust
    address: str = ""
    port: int = 0
    stage: str = ""
    artifact: Artifact | None = None
    installed_sha256: str = ""
    fabrics: tuple[cfg.FabricDecl, ...] = ()
    cert_pem: bytes = b""
    cert_serial: str = ""
    existing: cfg.AgentConfig | None = None  # the node's agent.toml from an earlier add, if it loads

    def given_fabrics(self, opts: Options) -> tuple[cfg.FabricDecl, ...]:
        """--fabric flags, else what the node declared before: adding again does not drop them."""
        return opts.fabrics or (self.existing.fabrics if self.existing else ())

    @property
    def server(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"wss://{host}:{self.port}"


async def add_node(opts: Options, *, emit: Emit, questions: Questions) -> Added:
    async with _step(emit, "authority") as st:
        ca, server_cert = _read_authority(opts.state_dir)
        admin = AdminClient.locate(server=None, credential=None, state_dir=str(opts.state_dir))
        nodes = await trio.to_thread.run_sync(admin.nodes)
        info = ca.info()
        st.ok(
            f"CA {info.common_name!r} (sha256 {info.fingerprint_sha256[:23]}...), "
            f"control plane at {admin.url} with {len(nodes)} node(s)"
        )
    auth = _Authority(ca=ca, server_cert=server_cert, admin=admin, nodes=nodes)
    try:
        return await _over_ssh(opts, emit, questions, auth)
    except BaseExceptionGroup as group:  # trio-asyncio's loop runs in a nursery, which wraps what it raises
        mine = [e for e in leaves(group) if isinstance(e, LlmgwError)]
        if mine and only(group, (LlmgwError, trio.Cancelled)):
            raise mine[0] from None
        raise


async def _over_ssh(opts: Options, emit: Emit, questions: Questions, auth: _Authority) -> Added:
    facts = _Facts()
    async with trio_asyncio.open_loop():
        async with _step(emit, "connect") as st:
            session = await ssh.connect(
                opts.target,
                known_hosts=opts.known_hosts,
                accept_new_host_key=opts.accept_new_host_key or (lambda fp: questions.accept_host_key(opts.target, fp)),
                client_keys=opts.identity_files,
                port=opts.ssh_port,
            )
            st.ok(f"{session.target} port {opts.ssh_port}, host key verified against {opts.known_hosts}")
        async with session:
            try:
                return await _on_node(opts, session, facts, emit, questions, auth)
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(_SHORT_S):
                    await _remove_stage(session, facts.stage)


async def _on_node(
    opts: Options, s: ssh.Session, facts: _Facts, emit: Emit, questions: Questions, auth: _Authority
) -> Added:
    async with _step(emit, "identify") as st:
        st.ok(await _identify(opts, s, facts, auth))

    async with _step(emit, "address") as st:
        facts.address, facts.port = _agent_address(opts, s.target.host, auth.server_cert)
        st.ok(f"the agent will dial {facts.server}, covered by the server certificate")

    async with _step(emit, "ship") as st:
        facts.artifact = await trio.to_thread.run_sync(find_artifact, opts.release, facts.arch)
        await _ship(s, facts)
        st.ok(_ship_detail(facts))

    async with _step(emit, "doctor") as st:
        status, text, inventory = await _doctor(opts, s, facts, questions)
        st.say(status, text)

    async with _step(emit, "fabrics") as st:
        status, text = await _fabrics(opts, facts, inventory, auth.nodes, questions)
        st.say(status, text)

    async with _step(emit, "identity") as st:
        st.ok(await _identity(opts, s, facts, auth.ca))

    async with _step(emit, "trust") as st:
        status, text = await _trust(s, facts, auth.ca)
        st.say(status, text)

    async with _step(emit, "configure") as st:
        status, text = await _configure(opts, s, facts)
        st.say(status, text)

    async with _step(emit, "start") as st:
        before = _view_of(await trio.to_thread.run_sync(auth.admin.nodes), facts.node_id)
        started_at = before.get("agent_started_at") if before else None
        await _start(s, facts)
        how = f"systemctl restart {layout.UNIT_NAME}" if facts.systemd else "llmgw agent supervise --daemon"
        st.ok(f"started ({how}); its log: {layout.log_hint(facts.systemd)}")

    async with _step(emit, "join") as st:
        st.ok(await _wait_for_join(opts, s, facts, auth.admin, started_at))

    assert facts.artifact is not None
    return Added(
        node_id=facts.node_id,
        server=facts.server,
        version=facts.artifact.version,
        service="systemd" if facts.systemd else "supervisor",
        cert_serial=facts.cert_serial,
        log=layout.log_hint(facts.systemd),
    )


# -- authority -----------------------------------------------------------------------------


def _read_authority(state_dir: Path) -> tuple[CA, CertInfo]:
    ca = load_ca(state_dir)
    paths = ca_paths(state_dir)
    if not paths.server_cert.exists():
        raise MachineError(
            f"{paths.server_cert} is missing: the control plane has no certificate for agents to check; "
            f"issue one with `llmgw ca server-cert --state-dir {state_dir} --san ADDRESS`"
        )
    return ca, cert_info(load_cert(paths.server_cert))


# -- identify ------------------------------------------------------------------------------


async def _identify(opts: Options, s: ssh.Session, facts: _Facts, auth: _Authority) -> str:
    await _probe(opts, s, facts)
    kb = _view_of(auth.nodes, facts.node_id)
    again = ""
    if kb is not None:
        marks = "".join(f", {m}" for m in ("cordoned", "draining") if kb.get(m))
        again = f"; known to the cluster already ({kb['state']}{marks}): adding it again"
        why = await _why_not_the_holder(s, facts.node_id, auth.ca, opts.state_dir)
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


async def _probe(opts: Options, s: ssh.Session, facts: _Facts) -> None:
    res = await s.run(["sh", "-c", layout.PROBE], timeout_s=_SHORT_S)
    if res.exit_status != 0:
        raise PeerError(f"{s.target}: probing the node failed ({_said(res)})")
    found = layout.parse_probe(res.stdout)
    hostname = found.hostname
    try:
        facts.node_id = check_node_id(hostname)
    except UsageError:
        raise PeerError(
            f"{s.target}: its hostname {hostname!r} cannot be a node id (letters, digits, '-' and '.'); "
            "give the machine a proper hostname (`sudo hostnamectl set-hostname NAME`) and run again"
        ) from None
    facts.machine = found.arch
    facts.arch = release_arch(facts.machine)
    facts.systemd = found.systemd
    if opts.system_trust:
        facts.trust_store = layout.trust_store(found, str(s.target))
    if s.user != "root":
        res = await s.run(["sudo", "-n", "true"], timeout_s=_SHORT_S)
        if res.exit_status != 0:
            raise PeerError(
                f"{s.target}: {s.user} cannot use sudo without a password there ({_said(res)}); "
                f"log in as root, or allow it: `echo '{s.user} ALL=(ALL) NOPASSWD: ALL' | "
                f"sudo tee /etc/sudoers.d/llmgw-{s.user}` on the node"
            )
    current = await s.run(["cat", "--", layout.CONFIG], sudo=True, timeout_s=_SHORT_S)
    if current.exit_status == 0:
        try:
            facts.existing = cfg.agent_config_from_dict(cfg.parse_toml(current.stdout, layout.CONFIG), layout.CONFIG)
        except ConfigError as exc:
            raise PeerError(
                f"{s.target}: its {layout.CONFIG} (from an earlier add, or written by hand) does not load: {exc}. "
                f"Fix it, or remove it to have it written afresh"
            ) from None


async def _why_not_the_holder(s: ssh.Session, node_id: str, ca: CA, state_dir: Path) -> str:
    """Empty if the machine holds the known node's certificate, else what it holds (identity.why_not_the_holder)."""
    node = node_paths(Path(layout.STATE_DIR))
    res = await s.run(["cat", "--", str(node.cert)], sudo=True, timeout_s=_SHORT_S)
    pem = res.stdout.encode() if res.exit_status == 0 else None
    revoked = await trio.to_thread.run_sync(_revoked_serials, state_dir)
    return identity.why_not_the_holder(pem, ca_cert=ca.cert, node_id=node_id, is_revoked=lambda n: str(n) in revoked)


def _revoked_serials(state_dir: Path) -> set[str]:
    from llmgw.server.store import Store

    store = Store.open(state_dir)
    try:
        return set(store.revoked_serials())
    finally:
        store.close()


async def _has_identity(s: ssh.Session) -> bool:
    key = node_paths(Path(layout.STATE_DIR)).key
    return (await s.run(["test", "-e", str(key)], sudo=True, timeout_s=_SHORT_S)).exit_status == 0


# -- address -------------------------------------------------------------------------------


def source_address(host: str, port: int = 22) -> str:
    """This machine's address on the route to `host` (no packet is sent: a UDP connect picks it)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise PeerError(f"cannot resolve {host}: {exc.strerror}") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(sockaddr)
        except OSError as exc:
            raise MachineError(f"no route from this machine to {host}: {exc.strerror or exc}") from None
        return str(sock.getsockname()[0])


def _agent_address(opts: Options, host: str, server_cert: CertInfo) -> tuple[str, int]:
    listen_host, _, port_text = opts.server_config.server.agent_listen.rpartition(":")
    listen_host = listen_host.strip("[]")
    port = int(port_text)
    if port == 0:
        raise ConfigError(
            "server.toml",
            [
                f"[server].agent_listen is {opts.server_config.server.agent_listen}: port 0 is a new port each "
                "start, so no node can be told where to dial; give it a fixed port (e.g. 0.0.0.0:7443)"
            ],
        )
    address = opts.server_address or source_address(host)
    covered = {_norm(n) for n in server_cert.sans}
    if _norm(address) not in covered:
        how = "--server-address" if opts.server_address else f"this machine's address on the route to {host}"
        raise ConfigError(
            "server certificate",
            [
                f"{address} ({how}) is not among its addresses ({', '.join(server_cert.sans) or 'none'}), so the "
                f"agent would refuse the control plane. Add it: `llmgw ca server-cert --state-dir {opts.state_dir} "
                f"--san {' --san '.join([*server_cert.sans, address])}`, add it to [server].advertise and restart "
                "`llmgw server`; or pass --server-address NAME for an address the certificate covers"
            ],
        )
    if listen_host not in ("", "0.0.0.0", "::") and _is_ip(address) and _norm(listen_host) != _norm(address):
        raise ConfigError(
            "server.toml",
            [
                f"[server].agent_listen is {opts.server_config.server.agent_listen}, so the node cannot reach "
                f"it at {address}; listen on 0.0.0.0 (or on {address}) and restart `llmgw server`"
            ],
        )
    return address, port


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _norm(text: str) -> str:
    try:
        return str(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        return text.lower().rstrip(".")


# -- ship ----------------------------------------------------------------------------------


async def _ship(s: ssh.Session, facts: _Facts) -> None:
    art = facts.artifact
    assert art is not None
    res = await s.run(["mktemp", "-d", f"{layout.STAGE_PREFIX}XXXXXXXX"], timeout_s=_SHORT_S)
    stage = res.stdout.strip()
    if res.exit_status != 0 or not stage.startswith(layout.STAGE_PREFIX) or "/" in stage[len("/tmp/") :]:
        raise PeerError(f"{s.target}: cannot make a staging directory under /tmp ({_said(res)})")
    facts.stage = stage
    staged = f"{stage}/llmgw"
    if art.path is not None:
        await s.put(art.path, staged, mode=0o755, timeout_s=_FETCH_S)
    else:
        await _fetch_on_node(s, art.url, staged)
    actual = await _remote_sha256(s, staged)
    if actual != art.sha256:
        raise PeerError(
            f"{s.target}: {art.name} arrived with sha256 {actual or 'unreadable'}, not {art.sha256}; "
            "nothing ran it. The transfer was damaged or the file at the source changed: run again"
        )
    facts.installed_sha256 = await _remote_sha256(s, layout.BIN)
    res = await s.run(["mkdir", "-m", "0700", f"{stage}/pyz"], sudo=True, timeout_s=_SHORT_S)
    if res.exit_status != 0:
        raise PeerError(f"{s.target}: cannot make {stage}/pyz ({_said(res)})")


async def _fetch_on_node(s: ssh.Session, url: str, dest: str) -> None:
    for argv in (
        ["curl", "-fsSL", "--retry", "3", "-o", dest, url],
        ["wget", "-q", "-O", dest, url],
    ):
        res = await s.run(argv, timeout_s=_FETCH_S)
        if res.exit_status == 0:
            return
        if res.exit_status != 127:  # 127: the tool is not there, try the next
            raise PeerError(f"{s.target}: fetching {url} failed ({_said(res)}); check that the node reaches it")
    raise PeerError(
        f"{s.target}: neither curl nor wget is installed there to fetch {url}; install one, "
        "or give --release a directory here so the file is copied over SSH"
    )


async def _remote_sha256(s: ssh.Session, path: str) -> str:
    res = await s.run(["sha256sum", "--", path], timeout_s=_SHORT_S)
    if res.exit_status != 0:
        return ""
    return res.stdout.split()[0] if res.stdout.split() else ""


def _ship_detail(facts: _Facts) -> str:
    art = facts.artifact
    assert art is not None
    how = "copied over SSH" if art.path else f"fetched by the node from {art.url}"
    if not facts.installed_sha256:
        was = f"new install at {layout.BIN}"
    elif facts.installed_sha256 == art.sha256:
        was = f"the same as {layout.BIN} there"
    else:
        was = f"will replace {layout.BIN} there (sha256 {facts.installed_sha256[:12]})"
    return f"{art.name} {how}, sha256 {art.sha256[:12]} verified on the node; {was}"


def _staged_llmgw(facts: _Facts, *args: str) -> list[str]:
    """Run the staged release (as root, through sudo), unpacking into the stage, not the node."""
    return ["env", f"SHIV_ROOT={facts.stage}/pyz", "python3", f"{facts.stage}/llmgw", *args]


# -- doctor --------------------------------------------------------------------------------


async def _doctor(
    opts: Options, s: ssh.Session, facts: _Facts, questions: Questions
) -> tuple[str, str, dict[str, Any]]:
    host = f"[{facts.address}]" if ":" in facts.address else facts.address
    args = ["doctor", "--json", "--server", f"{host}:{facts.port}"]
    if facts.existing is not None:
        args += ["--config", layout.CONFIG]  # its paths (nvidia_smi, ib_root, ...) as the agent will use them
    for decl in facts.given_fabrics(opts):
        args += ["--fabric", f"{decl.name}:{','.join(decl.adapters)}" if decl.adapters else decl.name]
    if opts.ignore_doctor:
        args += ["--ignore", ",".join(sorted(opts.ignore_doctor))]
    res = await s.run(_staged_llmgw(facts, *args), sudo=True, timeout_s=_DOCTOR_S)
    try:
        report = json.loads(res.stdout)
        checks = report["checks"]
    except (ValueError, KeyError, TypeError):
        raise PeerError(
            f"{s.target}: llmgw doctor did not run there ({_said(res)}); nothing was changed on the node"
        ) from None
    failures = [
        DoctorFailure(check=c["name"], detail=c["detail"], fix=c.get("fix", ""))
        for c in checks
        if c["status"] == "fail" and not c.get("ignored")
    ]
    warnings = [c for c in checks if c["status"] in ("warn", "unknown") and not c.get("ignored")]
    ignored = [c["name"] for c in checks if c.get("ignored")]
    tail = f"; ignored: {', '.join(ignored)}" if ignored else ""
    if failures:
        listed = "; ".join(f"{f.check}: {f.detail}" + (f" (fix: {f.fix})" if f.fix else "") for f in failures)
        if not await questions.go_past_doctor(failures):
            names = ",".join(f.check for f in failures)
            raise MachineError(
                f"doctor failed on {facts.node_id}: {listed}. Nothing was changed on the node. Fix this and run "
                f"again, or go on past it with --ignore-doctor {names}"
            )
        return WARN, f"went on past failed checks: {listed}{tail}", report.get("inventory") or {}
    if warnings:
        listed = "; ".join(f"{c['name']}: {c['detail']}" for c in warnings)
        return WARN, f"{len(checks) - len(warnings)} checks ok; warnings: {listed}{tail}", report.get("inventory") or {}
    return OK, f"{len(checks)} checks ok{tail}", report.get("inventory") or {}


# -- fabrics -------------------------------------------------------------------------------


async def _fabrics(
    opts: Options, facts: _Facts, inventory: dict[str, Any], nodes: list[dict[str, Any]], questions: Questions
) -> tuple[str, str]:
    groups = [
        FabricGroup(identity=g["identity"], kind=g["kind"], adapters=tuple(g["adapters"]), detail=g.get("detail", ""))
        for g in inventory.get("fabric_groups") or ()
    ]
    existing = sorted({f["name"] for n in nodes for f in n.get("fabrics") or ()})
    given = facts.given_fabrics(opts)
    if not groups and not given:
        return OK, "no active InfiniBand or RoCE adapter: the node is its own island"
    answered = tuple(await questions.name_fabrics(groups, existing, given)) if groups else ()
    # A declaration no group accounts for (doctor has checked it) is kept: the answer covers groups only.
    grouped = {a for g in groups for a in g.adapters}
    kept = tuple(d for d in given if d.name not in {a.name for a in answered} and not set(d.adapters) & grouped)
    facts.fabrics = answered + kept
    named = {a for d in facts.fabrics for a in d.adapters}
    said = "; ".join(f"{d.name}: {','.join(d.adapters) or 'the next two adapters'}" for d in facts.fabrics)
    unnamed = [g for g in groups if not set(g.adapters) & named and not _default_covers(facts.fabrics)]
    if unnamed:
        flags = " ".join(f"--fabric NAME:{','.join(g.adapters)}" for g in unnamed)
        left = "; ".join(f"{','.join(g.adapters)} on {g.identity}" for g in unnamed)
        return WARN, f"{said + '; ' if said else ''}not named, so unused for multi-node replicas: {left} ({flags})"
    return OK, said


def _default_covers(decls: Sequence[cfg.FabricDecl]) -> bool:
    return any(not d.adapters for d in decls)


# -- identity ------------------------------------------------------------------------------


async def _identity(opts: Options, s: ssh.Session, facts: _Facts, ca: CA) -> str:
    config_text = _agent_toml(opts, facts)
    await _put_text(s, config_text, f"{facts.stage}/agent.toml", mode=0o644)
    node = node_paths(Path(layout.STATE_DIR))
    current = await s.run(["cat", "--", str(node.cert)], sudo=True, timeout_s=_SHORT_S)
    had_key = await _has_identity(s)
    if opts.reissue:
        await _must(s, ["rm", "-f", "--", str(node.key), str(node.cert)], sudo=True, what="removing the old identity")
    await _must(
        s,
        _staged_llmgw(facts, "agent", "csr", "--config", f"{facts.stage}/agent.toml"),
        sudo=True,
        what="making the node's key and request",
        timeout_s=_DOCTOR_S,
    )
    csr_pem = (await _must(s, ["cat", "--", str(node.csr)], sudo=True, what="reading the request")).encode()
    kept = (
        None
        if opts.reissue or current.exit_status != 0
        else _fitting_cert(current.stdout.encode(), csr_pem, ca, facts.node_id, opts.state_dir)
    )
    if kept is not None:
        facts.cert_pem, info = current.stdout.encode(), kept
        facts.cert_serial = f"{info.serial:x}"
        return f"kept its certificate (serial {facts.cert_serial}, until {info.not_after:%Y-%m-%d}); --reissue makes a new key"
    old = _cert_or_none(current.stdout.encode()) if current.exit_status == 0 else None
    days = opts.server_config.ca.node_cert_validity_days
    facts.cert_pem = ca.sign_csr(csr_pem, facts.node_id, validity_days=days)
    info = cert_info(x509.load_pem_x509_certificate(facts.cert_pem))
    facts.cert_serial = f"{info.serial:x}"
    revoked = _record(opts.state_dir, facts.node_id, info, old, ca)
    also = ""
    if len(revoked) == 1:
        also = f"; revoked the previous one (serial {revoked[0]})"
    elif revoked:
        also = f"; revoked the previous ones (serials {', '.join(revoked)})"
    key = "a new key" if opts.reissue or not had_key else "its key"
    return f"issued CN={facts.node_id} for {key}, serial {facts.cert_serial}, until {info.not_after:%Y-%m-%d}{also}"


def _agent_toml(opts: Options, facts: _Facts) -> str:
    before = facts.existing
    return layout.agent_toml(
        server=facts.server,
        node_id=facts.node_id,
        fabrics=facts.fabrics,
        llamacpp_bin=opts.llamacpp_bin or (before.llamacpp_bin if before else ""),
        vllm_bin=opts.vllm_bin or (before.vllm_bin if before else ""),
        sglang_python=opts.sglang_python or (before.sglang_python if before else ""),
        keep=before,
    )


def _cert_or_none(pem: bytes) -> x509.Certificate | None:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError:
        return None


def _fitting_cert(pem: bytes, csr_pem: bytes, ca: CA, node_id: str, state_dir: Path) -> CertInfo | None:
    """The node's certificate, if it can stay: ours, for this node and its key, valid a while, not revoked."""
    from llmgw.server.store import Store

    cert = _cert_or_none(pem)
    if cert is None:
        return None
    info = cert_info(cert)
    csr = x509.load_pem_x509_csr(csr_pem)
    try:
        cert.verify_directly_issued_by(ca.cert)
    except (ValueError, TypeError, InvalidSignature):
        return None
    same_key = _public_der(cert.public_key()) == _public_der(csr.public_key())
    fresh = info.not_after.timestamp() - time.time() > 7 * 86400
    if not (same_key and fresh and info.common_name == node_id and info.valid_at(datetime.now(timezone.utc))):
        return None
    store = Store.open(state_dir)
    try:
        return None if store.is_revoked(info.serial) else info
    finally:
        store.close()


def _public_der(key: Any) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _record(state_dir: Path, node_id: str, info: CertInfo, old: x509.Certificate | None, ca: CA) -> list[str]:
    """Remember the new serial (so `node remove` revokes it), and revoke every other certificate
    of the node id: the one it replaces on this machine, if ours, and those of a machine it
    replaces. Returns the serials revoked, in hex."""
    from llmgw.server.store import Store

    store = Store.open(state_dir)
    try:
        store.record_certificate(info.serial, node_id, info.not_after.timestamp())
        revoked = [int(n) for n in store.revoke_others(node_id, keep=info.serial)]
        if old is not None and old.issuer == ca.cert.subject and old.serial_number not in revoked:
            store.revoke_serial(old.serial_number, node_id)
            revoked.append(old.serial_number)
        return [f"{n:x}" for n in sorted(revoked)]
    finally:
        store.close()


# -- trust ---------------------------------------------------------------------------------


async def _trust(s: ssh.Session, facts: _Facts, ca: CA) -> tuple[str, str]:
    node = node_paths(Path(layout.STATE_DIR))
    await _put_text(s, facts.cert_pem.decode(), f"{facts.stage}/node.crt", mode=0o644)
    await _put_text(s, ca.cert_pem().decode(), f"{facts.stage}/ca.crt", mode=0o644)
    for name, dest in (("node.crt", node.cert), ("ca.crt", node.ca_cert)):
        await _must(
            s, ["install", "-m", "0644", f"{facts.stage}/{name}", str(dest)], sudo=True, what=f"installing {dest}"
        )
    store = facts.trust_store
    if store is None:
        return OK, (
            f"certificate and CA root installed in {node.dir}; the root is not added to the system store "
            "(--no-system-trust): the agent trusts only its own ca.crt"
        )
    tool = store.tool.rsplit("/", 1)[-1]
    for argv in layout.trust_commands(store, f"{facts.stage}/ca.crt"):
        await _must(s, argv, sudo=True, what=f"running `{' '.join(argv)}`", timeout_s=_DOCTOR_S)
    return OK, f"certificate and CA root installed in {node.dir}; root trusted system-wide ({store.anchor}, {tool})"


# -- configure and start -------------------------------------------------------------------


async def _configure(opts: Options, s: ssh.Session, facts: _Facts) -> tuple[str, str]:
    assert facts.artifact is not None
    if facts.installed_sha256 != facts.artifact.sha256:
        await _must(
            s,
            ["install", "-D", "-m", "0755", f"{facts.stage}/llmgw", layout.BIN],
            sudo=True,
            what=f"installing {layout.BIN}",
        )
    await _must(
        s,
        ["install", "-D", "-m", "0644", f"{facts.stage}/agent.toml", layout.CONFIG],
        sudo=True,
        what=f"writing {layout.CONFIG}",
    )
    written = f"{layout.BIN} ({facts.artifact.version}), {layout.CONFIG}"
    if facts.systemd:
        await _put_text(s, layout.systemd_unit(), f"{facts.stage}/unit", mode=0o644)
        await _must(
            s, ["install", "-m", "0644", f"{facts.stage}/unit", layout.UNIT], sudo=True, what=f"writing {layout.UNIT}"
        )
        await _must(s, ["systemctl", "daemon-reload"], sudo=True, what="reloading systemd")
        await _must(s, ["systemctl", "enable", layout.UNIT_NAME], sudo=True, what=f"enabling {layout.UNIT_NAME}")
        return OK, f"{written}, {layout.UNIT} (enabled)"
    return WARN, (
        f"{written}; no systemd on the node, so the agent runs under llmgw's own supervisor "
        f"(`llmgw agent supervise`, pid file {layout.PID_FILE}, log {layout.LOG_FILE}), which does not "
        "start it again after a reboot"
    )


async def _start(s: ssh.Session, facts: _Facts) -> None:
    if facts.systemd:
        await _must(s, ["systemctl", "restart", layout.UNIT_NAME], sudo=True, what=f"starting {layout.UNIT_NAME}")
        return
    await _must(s, stop_supervisor_argv(), sudo=True, what="stopping the running agent", timeout_s=_DOCTOR_S)
    await _must(
        s,
        [
            layout.BIN, "agent", "supervise", "--daemon", "--config", layout.CONFIG,
            "--pid-file", layout.PID_FILE, "--log", layout.LOG_FILE,
        ],
        sudo=True,
        what="starting the agent",
        timeout_s=_DOCTOR_S,
    )  # fmt: skip


def stop_supervisor_argv() -> list[str]:
    return [layout.BIN, "agent", "stop", "--pid-file", layout.PID_FILE]


def _view_of(nodes: list[dict[str, Any]], node_id: str) -> dict[str, Any] | None:
    """The admin API's view of one node, if the control plane knows it."""
    return next((n for n in nodes if n["id"] == node_id), None)


# -- join ----------------------------------------------------------------------------------


JOINED, WAITING, BROKEN = "joined", "waiting", "broken"


def join_progress(node: dict[str, Any] | None, started_before: float | None) -> tuple[str, str]:
    """JOINED (the restarted agent heartbeated and llama.cpp is checked), WAITING (and for what),
    or BROKEN (the agent said llama.cpp cannot be used: waiting longer would not change it)."""
    if node is None:
        return WAITING, "the control plane has not heard from the agent"
    if not node.get("connected"):
        return WAITING, f"the agent is not connected (state {node['state']})"
    if node.get("agent_started_at") == started_before:
        return WAITING, "the agent connected is the one from before the restart"
    if node["state"] != "joined":
        return WAITING, f"the agent is connected but has not sent a heartbeat (state {node['state']})"
    llama = next((e for e in node.get("engines") or () if e["name"] == "llamacpp"), None)
    if llama is None:
        return WAITING, "joined; llama.cpp is not installed yet"
    if not llama["ok"]:
        return BROKEN, f"joined, but llama.cpp cannot be used: {llama['detail']}"
    return JOINED, f"joined; llama.cpp installed and checked ({llama['version']})"


async def _wait_for_join(
    opts: Options, s: ssh.Session, facts: _Facts, admin: AdminClient, started_before: float | None
) -> str:
    state, said = WAITING, ""
    with trio.move_on_after(opts.join_timeout_s):
        while state == WAITING:
            nodes = await trio.to_thread.run_sync(admin.nodes)
            node = _view_of(nodes, facts.node_id)
            state, said = join_progress(node, started_before)
            if state == JOINED:
                marks = " (cordoned: no new work until `llmgw ctl uncordon`)" if node and node.get("cordoned") else ""
                return said + marks
            if state == WAITING:
                await trio.sleep(_POLL_S)
    tail = await _log_tail(s, facts.systemd)
    why = said if state == BROKEN else f"did not finish joining within {opts.join_timeout_s:g} s: {said}"
    raise PeerError(
        f"{facts.node_id} {why}. The agent's log on the node ({layout.log_hint(facts.systemd)}) says more"
        + (f"; its last lines:\n{tail}" if tail else "")
    )


async def _log_tail(s: ssh.Session, systemd: bool) -> str:
    argv = (
        ["journalctl", "-u", layout.UNIT_NAME, "-n", str(_LOG_LINES), "--no-pager"]
        if systemd
        else ["tail", "-n", str(_LOG_LINES), "--", layout.LOG_FILE]
    )
    try:
        res = await s.run(argv, sudo=True, timeout_s=_SHORT_S)
    except LlmgwError:
        return ""
    return res.stdout.rstrip() if res.exit_status == 0 else ""


# -- helpers -------------------------------------------------------------------------------


async def _must(s: ssh.Session, argv: list[str], *, sudo: bool, what: str, timeout_s: float = _SHORT_S) -> str:
    res = await s.run(argv, sudo=sudo, timeout_s=timeout_s)
    if res.exit_status != 0:
        raise PeerError(f"{s.target}: {what} failed ({_said(res)})")
    return res.stdout


async def _put_text(s: ssh.Session, text: str, remote: str, *, mode: int) -> None:
    with tempfile.TemporaryDirectory(prefix="llmgw-node-add-") as d:
        local = Path(d) / "file"
        local.write_text(text)
        await s.put(local, remote, mode=mode, timeout_s=_SHORT_S)


async def _remove_stage(s: ssh.Session, stage: str) -> None:
    if not stage.startswith(layout.STAGE_PREFIX):
        return
    try:
        await s.run(["rm", "-rf", "--", stage], sudo=True, timeout_s=_SHORT_S)
    except LlmgwError:
        pass  # the session is gone; the stage is under /tmp and holds nothing secret


def _said(res: ssh.Result) -> str:
    err = res.stderr.strip() or res.stdout.strip()
    err = err[-600:] if len(err) > 600 else err
    return f"exit status {res.exit_status}" + (f": {err}" if err else "")
