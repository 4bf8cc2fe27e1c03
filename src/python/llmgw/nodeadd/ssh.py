"""The SSH session `llmgw node add` drives a node through: run a command, ship a file, close.

Owns the host-key decision and the translation of asyncssh's errors; nothing else here speaks
asyncssh. Invariants:

- Every command is built from argv by `llmgw.nodeadd.remote` (quoted, never a string), and its
  standard output and standard error come back apart: ssh's "Permanently added" warning on
  stderr was once read as the node's hostname.
- A host key is trusted only if known_hosts (OpenSSH format) holds it, or the host is absent from
  known_hosts and the operator accepted its fingerprint; an accepted key is appended to
  known_hosts. A host whose key differs from the one known is refused, never re-accepted here.
  Host keys are checked before authentication, so a refused host never runs anything.
- asyncssh runs on asyncio; this module alone knows it. `open_session` opens trio-asyncio's
  loop for as long as the session lasts and closes it after the session, and every `SshSession`
  method is a trio function, so a caller sees trio only:

      async with open_session("ubuntu@10.0.0.21", known_hosts=..., accept_new_host_key=ask) as s:
          result = await s.run(["hostname"], timeout_s=30)

  The loop runs in a nursery, which wraps what passes through it in an exception group; an
  llmgw error (the session's, or the caller's from inside the block) comes out bare, as if
  there were no loop.

- ~/.ssh/config is not read: what is connected to, as whom, and with which keys is what the
  command line says.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import asyncssh
import attrs
import trio
import trio_asyncio
from trio_asyncio import aio_as_trio

from llmgw.errors import LlmgwError, MachineError, PeerError, UsageError, leaves, only
from llmgw.nodeadd.errors import AuthFailed, ChangedHostKey, RemoteTimeout, UnknownHostKey
from llmgw.nodeadd.remote import command, sudo_command

AcceptNewHostKey = bool | Callable[[str], Awaitable[bool]]

# POSIX-portable login names (useradd's default pattern, upper case allowed) and RFC 1123 labels.
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?\Z")
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")
# The identities ssh(1) tries when none is named, for the message when all were refused.
_DEFAULT_KEY_NAMES = ("id_ed25519", "id_ecdsa", "id_ed25519_sk", "id_ecdsa_sk", "id_rsa", "id_dsa")
_CLOSE_TIMEOUT_S = 5.0
# After a deadline: how long to wait for the remote command to end. sshd refuses the signal
# request for a root login ("session signalling requires privilege separation"), and then the
# command runs on, its channel closing only when it exits.
_CANCEL_GRACE_S = 1.0


@attrs.frozen(kw_only=True)
class Target:
    user: str
    host: str

    def __str__(self) -> str:
        return f"{self.user}@{self.host}"


@attrs.frozen(kw_only=True)
class Result:
    exit_status: int  # negative -N when the command was killed by signal N, as in subprocess
    stdout: str
    stderr: str


def parse_target(target: str) -> Target:
    """`user@host`, host being a hostname, an IPv4 address or an IPv6 address (bare or in [])."""
    fix = "give the node as USER@HOST, e.g. ubuntu@10.0.0.21"
    user, sep, host = target.partition("@")
    if not sep or not user or not host:
        raise UsageError(f"node {target!r} names no login: {fix}")
    if not _USER.match(user):
        raise UsageError(f"node {target!r}: {user!r} is not a login name: {fix}")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return Target(user=user, host=str(ipaddress.ip_address(bare)))
    except ValueError:
        pass
    if bare is host and len(host) <= 253 and all(_LABEL.match(label) for label in host.split(".")):
        return Target(user=user, host=host.lower())  # ssh(1) matches known_hosts in lower case
    raise UsageError(f"node {target!r}: {host!r} is neither a hostname nor an IP address: {fix}")


def known_hosts_pattern(host: str, port: int) -> str:
    """The name known_hosts files the host under, as ssh(1) writes it."""
    return host if port == 22 else f"[{host}]:{port}"


def fingerprint(key: asyncssh.SSHKey) -> str:
    """`SHA256:...`, as `ssh-keygen -lf` prints it."""
    return key.get_fingerprint("sha256")


class SshSession:
    """A connected, authenticated SSH session to one node. Use `open_session` to make one."""

    def __init__(self, conn: asyncssh.SSHClientConnection, *, target: Target, port: int) -> None:
        self._conn = conn
        self.target = target
        self.port = port
        self._closed = False

    @property
    def user(self) -> str:
        return self.target.user

    async def run(self, argv: Sequence[str], *, sudo: bool = False, timeout_s: float) -> Result:
        """Run argv on the node (through `sudo -n` if `sudo` and the login is not root).

        Standard input is empty. A non-zero exit status is returned, not raised: the caller knows
        what it means. Past `timeout_s` the command is cancelled and `RemoteTimeout` raised.
        """
        cmd = sudo_command(argv, user=self.user) if sudo else command(argv)
        with trio.move_on_after(timeout_s):
            try:
                status, out, err = await aio_as_trio(self._aio_run)(cmd)
            except (asyncssh.Error, OSError) as exc:
                raise PeerError(f"{self.target}: running {cmd} failed: {_reason(exc)}") from exc
            if status is None:
                raise PeerError(f"{self.target}: {cmd} ended without an exit status; the connection may have dropped")
            return Result(exit_status=status, stdout=out, stderr=err)
        raise RemoteTimeout(
            f"{self.target}: {cmd} did not finish within {timeout_s:g} s; it was sent SIGTERM and abandoned"
        )

    async def put(self, local: Path, remote: str, mode: int = 0o755, *, timeout_s: float = 600) -> None:
        """Copy `local` to `remote` over SFTP with `mode`, atomically: written beside it, then renamed."""
        if not local.is_file():
            raise MachineError(f"cannot ship {local} to {self.target}: it is not a file here")
        partial = f"{remote}.llmgw-part"
        with trio.move_on_after(timeout_s):
            try:
                await aio_as_trio(self._aio_put)(str(local), remote, partial, mode)
            except asyncssh.SFTPError as exc:
                raise PeerError(
                    f"{self.target}: cannot write {remote}: {exc.reason}; "
                    f"check that its directory exists and that {self.user} may write there"
                ) from exc
            except (asyncssh.Error, OSError) as exc:
                raise PeerError(f"{self.target}: copying {local} to {remote} failed: {_reason(exc)}") from exc
            return
        raise RemoteTimeout(f"{self.target}: copying {local} to {remote} took longer than {timeout_s:g} s")

    @asynccontextmanager
    async def forward(self, host: str, port: int) -> AsyncIterator[int]:
        """For the block, a port on 127.0.0.1 here that reaches `host:port` as the node sees it
        (`ssh -L`): a service the node keeps on its loopback, reached without opening it wider."""
        try:
            listener = await aio_as_trio(self._conn.forward_local_port)("127.0.0.1", 0, host, port)
        except (asyncssh.Error, OSError) as exc:
            raise PeerError(f"{self.target}: forwarding a port to {host}:{port} there failed: {_reason(exc)}") from exc
        try:
            yield listener.get_port()
        finally:
            listener.close()
            with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_TIMEOUT_S):
                await aio_as_trio(listener.wait_closed)()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._conn.close()
        with trio.move_on_after(_CLOSE_TIMEOUT_S) as scope:
            scope.shield = True
            await aio_as_trio(self._conn.wait_closed)()

    async def __aenter__(self) -> SshSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # asyncio side: each is one coroutine per operation, so the trio/asyncio boundary is crossed once.

    async def _aio_run(self, cmd: str) -> tuple[int | None, str, str]:
        proc = await self._conn.create_process(cmd, stdin=asyncssh.DEVNULL, encoding="utf-8", errors="replace")
        try:
            done = await proc.wait(check=False)
        except BaseException:
            # Cancelled (a deadline) or failed: sshd closes the channel only once the command has
            # exited, so ask it to end the command, and do not wait on it for long.
            with suppress(asyncssh.Error, OSError):
                proc.terminate()
            proc.close()
            with suppress(asyncio.TimeoutError, asyncssh.Error, OSError):
                await asyncio.wait_for(proc.wait_closed(), _CANCEL_GRACE_S)
            raise
        return done.returncode, str(done.stdout or ""), str(done.stderr or "")

    async def _aio_put(self, local: str, remote: str, partial: str, mode: int) -> None:
        async with self._conn.start_sftp_client() as sftp:
            try:
                await sftp.put(local, partial)
                await sftp.chmod(partial, mode)
                await sftp.posix_rename(partial, remote)
            except BaseException:
                with suppress(asyncssh.Error, OSError):
                    await sftp.remove(partial)
                raise


@asynccontextmanager
async def open_session(
    target: str,
    *,
    known_hosts: Path,
    accept_new_host_key: AcceptNewHostKey,
    client_keys: Sequence[Path] | None = None,
    port: int = 22,
    connect_timeout_s: float = 15,
) -> AsyncIterator[SshSession]:
    """Connect to `user@host`, verify its host key, authenticate by key; close on exit.

    `accept_new_host_key` decides for a host absent from `known_hosts`: True accepts
    (`--accept-new-host-key`), False refuses, or an async callable is given the key's fingerprint
    (`SHA256:...`) and returns whether the operator accepts it. `client_keys` are private key
    files; None means ssh's default files in ~/.ssh. The SSH agent (SSH_AUTH_SOCK) is used in
    both cases, as ssh(1) does.
    """
    parsed = parse_target(target)
    keys = _load_client_keys(client_keys)
    async with _asyncio_bridge():
        session = await _connect(parsed, known_hosts, accept_new_host_key, client_keys, keys, port, connect_timeout_s)
        async with session:
            yield session


@asynccontextmanager
async def _asyncio_bridge() -> AsyncIterator[None]:
    """trio-asyncio's loop, for asyncssh, around one session; llmgw errors come out of it bare."""
    try:
        async with trio_asyncio.open_loop():
            yield
    except BaseException as exc:
        mine = [e for e in leaves(exc) if isinstance(e, LlmgwError)]
        if mine and mine[0] is not exc and only(exc, (LlmgwError, trio.Cancelled)):
            raise mine[0] from None
        raise


async def _connect(
    parsed: Target,
    known_hosts: Path,
    accept_new_host_key: AcceptNewHostKey,
    client_keys: Sequence[Path] | None,
    keys: list[asyncssh.SSHKeyPair] | None,
    port: int,
    connect_timeout_s: float,
) -> SshSession:
    # asyncssh narrates every connection at INFO; what matters reaches the operator as our errors.
    logging.getLogger("asyncssh").setLevel(max(logging.WARNING, logging.getLogger("asyncssh").level))
    asked = False
    while True:
        trusted = _read_known_hosts(known_hosts)
        witness = _HostKeyWitness()
        try:
            conn = await aio_as_trio(_aio_connect)(parsed, port, trusted, keys, witness, connect_timeout_s)
        except asyncssh.HostKeyNotVerifiable as exc:
            offered = witness.offered
            if offered is None:  # marked @revoked, or a certificate that did not verify
                raise PeerError(
                    f"{parsed.host} port {port}: its host key was refused ({_reason(exc)}); "
                    f"see its entries in {known_hosts}"
                ) from exc
            known = _known_keys(trusted, parsed.host, witness.addr, port)
            if known:
                raise _changed(parsed, port, known_hosts, offered, known) from exc
            if asked:  # accepted and appended, yet still not known: never ask twice
                raise PeerError(f"{parsed.host}: the host key just added to {known_hosts} was not matched") from exc
            asked = True
            if not await _operator_accepts(accept_new_host_key, fingerprint(offered)):
                raise UnknownHostKey(
                    f"{parsed.host} port {port} is not in {known_hosts} and its host key "
                    f"{offered.get_algorithm()} {fingerprint(offered)} was not accepted; nothing was run there. "
                    f"Compare it with `ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub` on the node's console, "
                    f"then answer yes or pass --accept-new-host-key",
                    fingerprint=fingerprint(offered),
                ) from exc
            _append_known_host(known_hosts, known_hosts_pattern(parsed.host, port), offered)
            continue
        except asyncssh.PermissionDenied as exc:
            raise AuthFailed(_auth_failed_message(parsed, port, client_keys)) from exc
        except asyncio.TimeoutError as exc:  # before OSError: on 3.11+ it is the builtin TimeoutError
            raise PeerError(
                f"{parsed.host} port {port}: no SSH session within {connect_timeout_s:g} s; "
                "check the address, that sshd runs there and that no firewall drops the port"
            ) from exc
        except OSError as exc:
            raise PeerError(
                f"{parsed.host} port {port}: cannot connect: {_reason(exc)}; "
                "check the address and that sshd runs there"
            ) from exc
        except asyncssh.Error as exc:
            raise PeerError(f"{parsed} port {port}: SSH failed: {_reason(exc)}") from exc
        return SshSession(conn, target=parsed, port=port)


class _HostKeyWitness(asyncssh.SSHClient):
    """Sees the key of a host known_hosts does not vouch for, and refuses it.

    asyncssh asks synchronously, and the operator is asked asynchronously, so the connection is
    refused, the operator asked, and a second connection made with the accepted key pinned.
    """

    def __init__(self) -> None:
        self.offered: asyncssh.SSHKey | None = None
        self.addr = ""

    def validate_host_public_key(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
        self.offered, self.addr = key, addr
        return False


async def _aio_connect(
    target: Target,
    port: int,
    trusted: asyncssh.SSHKnownHosts,
    keys: Sequence[asyncssh.SSHKeyPair] | None,
    witness: _HostKeyWitness,
    timeout_s: float,
) -> asyncssh.SSHClientConnection:
    conn, _ = await asyncssh.create_connection(
        lambda: witness,
        target.host,
        port,
        username=target.user,
        known_hosts=trusted,
        client_keys=() if keys is None else keys,
        preferred_auth="publickey",  # nothing here can answer a password prompt
        config=[],
        connect_timeout=timeout_s,
    )
    return conn


async def _operator_accepts(accept: AcceptNewHostKey, fp: str) -> bool:
    if isinstance(accept, bool):
        return accept
    return bool(await accept(fp))


def _known_keys(trusted: asyncssh.SSHKnownHosts, host: str, addr: str, port: int) -> list[asyncssh.SSHKey]:
    host_keys, ca_keys, *_ = trusted.match(host, addr, None if port == 22 else port)
    unique: dict[str, asyncssh.SSHKey] = {}  # a line can match both by name and by address
    for key in (*host_keys, *ca_keys):
        unique.setdefault(fingerprint(key), key)
    return list(unique.values())


def _changed(
    target: Target, port: int, known_hosts: Path, offered: asyncssh.SSHKey, known: list[asyncssh.SSHKey]
) -> ChangedHostKey:
    was = tuple(fingerprint(k) for k in known)
    pattern = known_hosts_pattern(target.host, port)
    return ChangedHostKey(
        f"{target.host} port {port} offers host key {offered.get_algorithm()} {fingerprint(offered)}, "
        f"but {known_hosts} holds {', '.join(was)} for it: refused, nothing was run there. "
        "The node may have been reinstalled, or something is answering in its place. Check the key "
        "on the node's console (`ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub`); if it is the node's, "
        f"remove the old one with `ssh-keygen -R '{pattern}' -f {known_hosts}` and run again",
        offered=fingerprint(offered),
        known=was,
    )


def _read_known_hosts(path: Path) -> asyncssh.SSHKnownHosts:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = ""
    except (OSError, UnicodeDecodeError) as exc:
        raise MachineError(f"cannot read known hosts file {path}: {_reason(exc)}") from exc
    try:
        return asyncssh.import_known_hosts(text)
    except ValueError as exc:
        raise MachineError(f"known hosts file {path} is not in OpenSSH format: {exc}; fix or remove that line") from exc


def _append_known_host(path: Path, pattern: str, key: asyncssh.SSHKey) -> None:
    algorithm, blob = key.export_public_key("openssh").decode("ascii").split()[:2]
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with path.open("a+b") as f:
            f.seek(0, os.SEEK_END)
            if f.tell():
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
            f.write(f"{pattern} {algorithm} {blob}\n".encode("ascii"))
    except OSError as exc:
        raise MachineError(f"cannot add {pattern}'s host key to {path}: {_reason(exc)}") from exc


def _load_client_keys(paths: Sequence[Path] | None) -> list[asyncssh.SSHKeyPair] | None:
    if paths is None:
        return None
    keys: list[asyncssh.SSHKeyPair] = []
    for path in paths:
        try:
            keys += asyncssh.load_keypairs([str(path)])
        except asyncssh.KeyEncryptionError as exc:
            raise MachineError(
                f"SSH key {path} is protected by a passphrase; add it to your agent (`ssh-add {path}`) "
                "and leave it out of the command line"
            ) from exc
        except (OSError, ValueError) as exc:  # KeyImportError is a ValueError
            raise MachineError(f"cannot read SSH key {path}: {_reason(exc)}") from exc
    return keys


def _auth_failed_message(target: Target, port: int, client_keys: Sequence[Path] | None) -> str:
    if client_keys is None:
        ssh_dir = Path.home() / ".ssh"
        files = [str(ssh_dir / n) for n in _DEFAULT_KEY_NAMES if (ssh_dir / n).exists()]
    else:
        files = [str(p) for p in client_keys]
    agent = os.environ.get("SSH_AUTH_SOCK")
    tried = [f"key files {', '.join(files)}" if files else "no key files"]
    tried.append(f"the SSH agent at {agent}" if agent else "no SSH agent (SSH_AUTH_SOCK is not set)")
    port_flag = "" if port == 22 else f" -p {port}"
    return (
        f"{target.host} port {port} refused login as {target.user!r}; tried {' and '.join(tried)}. "
        f"Install a key for {target.user} on the node (`ssh-copy-id{port_flag} -i KEY.pub {target}`), "
        "or reach this machine with `ssh -A` and run `sudo --preserve-env=SSH_AUTH_SOCK llmgw node add ...` "
        "so your agent's key is used"
    )


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc)
    return str(reason) or type(exc).__name__
