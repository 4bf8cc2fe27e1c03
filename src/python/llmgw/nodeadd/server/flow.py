"""`llmgw server add`: the steps, run against one machine over SSH, in the order of `steps.STEPS`.

Node add's machinery (llmgw.nodeadd) with a control plane at the end: the same SSH session and
host-key questions, the same release shipped the same way, the same checklist, events and
screens. What a second control plane needs that no database holds in plain text — the CA key,
the engine-key secret, the admin credential, the store's password — is read here first
(`authority`) and copied as files (install.py says how); everything else it shares with this
one through the PostgreSQL store both name.

Invariants:

- This control plane's files and its store are read before the machine is touched: a SQLite
  store, a missing secret or a store this machine cannot read is said before any SSH connection.
- Nothing is changed on the machine outside the stage until the release has run there
  (`ship.tried`) and the machine has been found not to hold another CA. The stage is removed at
  the end whatever happens.
- The service is started only after the machine reached the same store (`store`), and the run
  succeeds only once its admin API answered, through SSH, with this CA.
- Running it again converges and changes nothing when nothing differs: `Added.changed` is empty
  then, and the service is not restarted.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import attrs
import trio

from llmgw import private
from llmgw.errors import LlmgwError, MachineError
from llmgw.nodeadd import flow, identify, ship, ssh
from llmgw.nodeadd.context import SHORT_S
from llmgw.nodeadd.flow import Emit, read_authority, remove_stage, run_step
from llmgw.nodeadd.questions import Questions
from llmgw.nodeadd.release import HTTPS, SSH
from llmgw.nodeadd.server import install, layout
from llmgw.nodeadd.server.install import Facts, Held, Options
from llmgw.nodeadd.steps import OK, WARN
from llmgw.pki.files import load_ca

__all__ = ["Added", "Options", "add_server"]

MACHINE_ID = Path("/etc/machine-id")


@attrs.frozen(kw_only=True)
class Added:
    host: str
    version: str
    fingerprint: str  # the CA's, which the new control plane answered with
    store: str  # redacted
    changed: tuple[str, ...]  # what this run changed there; () when nothing
    log: str


async def add_server(opts: Options, *, emit: Emit, questions: Questions, timeout_s: float = 120.0) -> Added:
    async with run_step(emit, "authority") as st:
        held = await trio.to_thread.run_sync(read_held, opts)
        info = held.ca.info()
        st.ok(
            f"CA {info.common_name!r} (sha256 {info.fingerprint_sha256[:23]}...); "
            f"{', '.join(c.what for c, _ in held.files)}; store {held.store.text()}"
        )
    facts = Facts()
    facts.advertise = layout.advertised(opts.advertise, ssh.parse_target(opts.base.target).host)
    async with AsyncExitStack() as stack:
        async with run_step(emit, "connect") as st:
            session = await stack.enter_async_context(flow.open_session(opts.base, questions))
            st.ok(f"{session.target} port {opts.base.ssh_port}, host key verified against {opts.base.known_hosts}")
        try:
            return await _on_machine(opts, session, facts, emit, held, timeout_s)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(SHORT_S):
                await remove_stage(session, facts.stage)


async def _on_machine(opts: Options, s: ssh.Session, facts: Facts, emit: Emit, held: Held, timeout_s: float) -> Added:
    async with run_step(emit, "identify") as st:
        st.ok(await install.identify(opts, s, facts, held, _machine_id()))

    async with run_step(emit, "ship") as st:
        fell_back = await choose_release(opts, s, facts, held)
        await ship.ship(s, facts, held.ca.cert_pem())
        ran = await ship.tried(s, facts)
        detail = f"{ship.ship_detail(facts, machine='machine')}; it runs there: {ran}"
        st.say(WARN if fell_back else OK, f"{detail}; {fell_back}" if fell_back else detail)

    async with run_step(emit, "install") as st:
        st.ok(await install.install(s, facts))

    async with run_step(emit, "secrets") as st:
        st.ok(await install.secrets(s, facts, held))

    async with run_step(emit, "configure") as st:
        text = await install.configure(opts, s, facts, held)
        st.say(WARN if facts.config_notes else OK, text)

    async with run_step(emit, "store") as st:
        st.ok(await install.store(s, held, opts.store_url))

    async with run_step(emit, "start") as st:
        st.ok(await install.start(s, facts))

    async with run_step(emit, "verify") as st:
        st.ok(await install.verify(s, held, timeout_s=timeout_s, progress=st.progress))

    assert facts.artifact is not None
    return Added(
        host=s.target.host,
        version=facts.artifact.version,
        fingerprint=held.ca.info().fingerprint_sha256,
        store=install.redacted(opts.store_url),
        changed=tuple(c for c in facts.changed if not c.endswith(" restarted")),
        log=layout.log_hint(),
    )


async def choose_release(opts: Options, s: ssh.Session, facts: Facts, held: Held) -> str:
    """`ship.choose` as node add's, the control plane's release fetched by the machine from its
    agent port when it serves one; where that cannot be (no server certificate for an address the
    machine reaches, the control plane not answering) the file goes over SSH unless
    `--release-via https` was asked for. Returns why it went over SSH when it fell back, else ""."""
    base = opts.base
    if base.release or base.release_via == SSH:
        return await ship.choose(base, facts, held.ca.cert_pem())
    try:
        _, server_cert = await trio.to_thread.run_sync(read_authority, base.state_dir)
        facts.address, facts.port = identify.agent_address(base, s.target.host, server_cert, who="machine")
        return await ship.choose(base, facts, held.ca.cert_pem())
    except LlmgwError as exc:
        if base.release_via == HTTPS:
            raise
        why = str(exc)
    await ship.choose(attrs.evolve(base, release_via=SSH), facts, held.ca.cert_pem())
    return f"the control plane's release could not be fetched from its agent port ({why}), so it went over SSH"


def read_held(opts: Options) -> Held:
    """This control plane's CA, the files every leader needs, and its store as seen from here.
    Blocking: files, and one connection to the store."""
    layout.refuse_sqlite(opts.base.server_config.store, opts.config_path)
    state_dir = opts.base.state_dir
    ca = load_ca(state_dir)
    files = []
    for copied in layout.secrets(state_dir, opts.base.server_config.store.password_file):
        files.append((copied, _read(copied, state_dir)))
    if opts.look_store is None:
        raise ValueError("server add needs a way to look at the store")  # a bug in the caller
    seen = opts.look_store()
    if seen.version == 0:
        raise MachineError(
            f"the store {seen.store} holds no llmgw state: this control plane has never run on it. Start "
            "`llmgw server` here with it once (or copy its SQLite state there with `llmgw server migrate-store "
            "--to URL`), then run `llmgw server add` again"
        )
    return Held(ca=ca, files=tuple(files), store=seen)


def _read(copied: layout.Copied, state_dir: Path) -> bytes:
    try:
        if not copied.secret:
            return copied.local.read_bytes()
        # Its mode, not its owner: root may add a control plane whose files another user owns.
        return private.read(copied.local, copied.what, owner=False)
    except FileNotFoundError:
        made_by = (
            "server.toml's [store] password_file names it: write the store's password there (mode 0600)"
            if copied.remote == layout.PASSWORD_FILE
            else f"`llmgw ca init --state-dir {state_dir}` makes it, and so does the first `llmgw server` start"
        )
        raise MachineError(f"{copied.what} is not at {copied.local}; {made_by}") from None
    except PermissionError:
        raise MachineError(f"cannot read {copied.local} ({copied.what}); run the command with sudo") from None


def _machine_id() -> str:
    try:
        return MACHINE_ID.read_text().strip()
    except OSError:
        return ""
