"""`llmgw server add`: its steps (`steps.STEPS`), each a function over the toolkit (llmgw.nodeadd),
run against one machine over SSH by the toolkit's `run_flow`.

The same SSH session and host-key questions, the same release shipped the same way, the same
checklist, events and screens as node add and gateway add, with a control plane at the end.
What a second control plane needs that no database holds in plain text — the CA key, the
engine-key secret, the admin credential, the store's password — is read here first
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

from pathlib import Path

import attrs
import trio

from llmgw import private
from llmgw.errors import LlmgwError, MachineError
from llmgw.nodeadd import checklist, ship, ssh
from llmgw.nodeadd.checklist import Emit, Flow, Outcome, read_authority
from llmgw.nodeadd.identify import agent_address
from llmgw.nodeadd.questions import Questions
from llmgw.nodeadd.release import HTTPS, SSH
from llmgw.nodeadd.server import install, layout
from llmgw.nodeadd.server.install import Facts, Held, Options
from llmgw.nodeadd.server.steps import STEPS
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


@attrs.define(kw_only=True)
class ServerRun(checklist.Run):
    opts: Options
    facts: Facts
    timeout_s: float  # --start-timeout: how long `verify` waits for the admin API
    held: Held | None = None

    @property
    def hold(self) -> Held:
        assert self.held is not None
        return self.held


async def add_server(opts: Options, *, emit: Emit, questions: Questions, timeout_s: float = 120.0) -> Added:
    facts = Facts(advertise=layout.advertised(opts.advertise, ssh.parse_target(opts.target).host))
    run = ServerRun(opts=opts, facts=facts, emit=emit, questions=questions, timeout_s=timeout_s)
    await checklist.run_flow(FLOW, run)
    assert facts.artifact is not None
    return Added(
        host=run.s.target.host,
        version=facts.artifact.version,
        fingerprint=run.hold.ca.info().fingerprint_sha256,
        store=install.redacted(opts.store_url),
        changed=tuple(c for c in facts.changed if not c.endswith(" restarted")),
        log=layout.log_hint(),
    )


async def _authority(run: ServerRun, st: Outcome) -> None:
    held = run.held = await trio.to_thread.run_sync(read_held, run.opts)
    info = held.ca.info()
    st.ok(
        f"CA {info.common_name!r} (sha256 {info.fingerprint_sha256[:23]}...); "
        f"{', '.join(c.what for c, _ in held.files)}; store {held.store.text()}"
    )


async def _identify(run: ServerRun, st: Outcome) -> None:
    st.ok(await install.identify(run.opts, run.s, run.facts, run.hold, _machine_id()))


async def _ship(run: ServerRun, st: Outcome) -> None:
    fell_back = await choose_release(run.opts, run.s, run.facts, run.hold)
    await ship.ship(run.s, run.facts, run.hold.ca.cert_pem())
    ran = await ship.tried(run.s, run.facts)
    detail = f"{ship.ship_detail(run.facts, machine='machine')}; it runs there: {ran}"
    st.say(WARN if fell_back else OK, f"{detail}; {fell_back}" if fell_back else detail)


async def _install(run: ServerRun, st: Outcome) -> None:
    st.ok(await install.install(run.s, run.facts))


async def _secrets(run: ServerRun, st: Outcome) -> None:
    st.ok(await install.secrets(run.s, run.facts, run.hold))


async def _configure(run: ServerRun, st: Outcome) -> None:
    text = await install.configure(run.opts, run.s, run.facts, run.hold)
    st.say(WARN if run.facts.config_notes else OK, text)


async def _store(run: ServerRun, st: Outcome) -> None:
    st.ok(await install.store(run.s, run.hold, run.opts.store_url))


async def _start(run: ServerRun, st: Outcome) -> None:
    st.ok(await install.start(run.s, run.facts))


async def _verify(run: ServerRun, st: Outcome) -> None:
    st.ok(await install.verify(run.s, run.hold, timeout_s=run.timeout_s, progress=st.progress))


FLOW: Flow[ServerRun] = Flow(
    STEPS,
    {
        "authority": _authority,
        "connect": checklist.connect,
        "identify": _identify,
        "ship": _ship,
        "install": _install,
        "secrets": _secrets,
        "configure": _configure,
        "store": _store,
        "start": _start,
        "verify": _verify,
    },
)


async def choose_release(opts: Options, s: ssh.SshSession, facts: Facts, held: Held) -> str:
    """The toolkit's `ship.choose`, the control plane's release fetched by the machine from its
    agent port when it serves one; where that cannot be (no server certificate for an address the
    machine reaches, the control plane not answering) the file goes over SSH unless
    `--release-via https` was asked for. Returns why it went over SSH when it fell back, else ""."""
    if opts.release or opts.release_via == SSH:
        return await ship.choose(opts, facts, held.ca.cert_pem())
    try:
        _, server_cert = await trio.to_thread.run_sync(read_authority, opts.state_dir)
        facts.address, facts.port = agent_address(opts, s.target.host, server_cert, who="machine")
        return await ship.choose(opts, facts, held.ca.cert_pem())
    except LlmgwError as exc:
        if opts.release_via == HTTPS:
            raise
        why = str(exc)
    await ship.choose(attrs.evolve(opts, release_via=SSH), facts, held.ca.cert_pem())
    return f"the control plane's release could not be fetched from its agent port ({why}), so it went over SSH"


def read_held(opts: Options) -> Held:
    """This control plane's CA, the files every leader needs, and its store as seen from here.
    Blocking: files, and one connection to the store."""
    layout.refuse_sqlite(opts.server_config.store, opts.config_path)
    state_dir = opts.state_dir
    ca = load_ca(state_dir)
    files = []
    for copied in layout.secrets(state_dir, opts.server_config.store.password_file):
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
