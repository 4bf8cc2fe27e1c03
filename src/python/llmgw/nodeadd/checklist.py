"""How an onboarding flow runs: its steps in order, each reported to the checklist, over one SSH
session, drawn on a screen or printed (`run_checklist`).

A flow (llmgw.nodeadd.node, .gateway, .server) is a `Flow`: its checklist (`steps.Steps`, the
names and what the operator reads, in order) and, for each name, an async function of the flow's
`Run` and the step's `Outcome`. `run_flow` runs them in order, each inside `run_step`: `started`,
then exactly one of `ok`, `warn` or `failed`, and the run stops at the first failure. Before
`connect` the machine is not touched (a flow reads its authority there); `connect` opens the
session (`connect`, the toolkit's step), which the later steps use as `run.session`; and the
stage a step made there is removed at the end whatever happens (shielded, bounded).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, Generic, TypeVar

import attrs
import trio

from llmgw.errors import LlmgwError, MachineError
from llmgw.nodeadd import layout, ssh, steps
from llmgw.nodeadd.context import SHORT_S, Facts, Options
from llmgw.nodeadd.questions import Questions, Unattended
from llmgw.nodeadd.steps import FAILED, OK, PROGRESS, STARTED, WARN, Event
from llmgw.pki.ca import CA, CertInfo, cert_info
from llmgw.pki.files import ca_paths, load_ca, load_cert

T = TypeVar("T")
Emit = Callable[[Event], None]


@attrs.define
class Outcome:
    step: str
    emit: Emit
    status: str = OK
    detail: str = ""

    def progress(self, detail: str) -> None:
        """What the running step is doing now (a line in --plain and --json, the detail on screen)."""
        self.emit(Event(step=self.step, status=PROGRESS, detail=detail))

    def ok(self, detail: str) -> None:
        self.status, self.detail = OK, detail

    def warn(self, detail: str) -> None:
        self.status, self.detail = WARN, detail

    def say(self, status: str, detail: str) -> None:
        """OK or WARN, as a step's helper decided."""
        self.status, self.detail = status, detail


@asynccontextmanager
async def run_step(emit: Emit, name: str) -> AsyncIterator[Outcome]:
    emit(Event(step=name, status=STARTED))
    outcome = Outcome(step=name, emit=emit)
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


@attrs.define(kw_only=True)
class Run:
    """One run of a flow: what every step reads and writes. A flow subclasses it with what its
    steps pass on (its authority, what a step learned for a later one)."""

    opts: Options
    facts: Facts
    emit: Emit
    questions: Questions
    stack: AsyncExitStack | None = None  # the run's: `connect` enters the session into it
    session: ssh.SshSession | None = None

    @property
    def s(self) -> ssh.SshSession:
        assert self.session is not None, "a step on the machine before `connect`"
        return self.session


R = TypeVar("R", bound=Run)
StepFn = Callable[[Any, Outcome], Awaitable[None]]


@attrs.frozen
class Flow(Generic[R]):
    """A checklist and, for each of its steps, what runs it, in the checklist's order."""

    checklist: steps.Steps
    do: Mapping[str, StepFn]

    def __attrs_post_init__(self) -> None:
        names = [name for name, _ in self.checklist]
        if list(self.do) != names:
            raise ValueError(f"a flow's steps {list(self.do)} are not its checklist's {names}")  # a bug


async def run_flow(flow: Flow[R], run: R) -> R:
    """Each step of `flow` in order, on `run`; the stage removed at the end however it ends."""
    async with AsyncExitStack() as stack:
        run.stack = stack
        try:
            for name, do in flow.do.items():
                async with run_step(run.emit, name) as st:
                    await do(run, st)
        finally:
            if run.session is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(SHORT_S):
                    await remove_stage(run.session, run.facts.stage)
    return run


async def connect(run: Run, st: Outcome) -> None:
    """The toolkit's `connect` step: the SSH session, the host key verified against known_hosts."""
    assert run.stack is not None
    run.session = await run.stack.enter_async_context(open_session(run.opts, run.questions))
    st.ok(f"{run.session.target} port {run.opts.ssh_port}, host key verified against {run.opts.known_hosts}")


def open_session(opts: Options, questions: Questions) -> AbstractAsyncContextManager[ssh.SshSession]:
    """The SSH session to `opts.target`; a host absent from known_hosts is accepted by the flag or
    by the operator's answer (questions.py)."""
    return ssh.open_session(
        opts.target,
        known_hosts=opts.known_hosts,
        accept_new_host_key=opts.accept_new_host_key or (lambda fp: questions.accept_host_key(opts.target, fp)),
        client_keys=opts.identity_files,
        port=opts.ssh_port,
    )


def read_authority(state_dir: Path) -> tuple[CA, CertInfo]:
    """The CA and the server certificate agents and gateways check: read before a machine is touched."""
    ca = load_ca(state_dir)
    paths = ca_paths(state_dir)
    if not paths.server_cert.exists():
        raise MachineError(
            f"{paths.server_cert} is missing: the control plane has no certificate for agents to check; "
            f"issue one with `llmgw ca server-cert --state-dir {state_dir} --san ADDRESS`"
        )
    return ca, cert_info(load_cert(paths.server_cert))


async def remove_stage(s: ssh.SshSession, stage: str) -> None:
    if not stage.startswith(layout.STAGE_PREFIX):
        return
    try:
        await s.run(["rm", "-rf", "--", stage], sudo=True, timeout_s=SHORT_S)
    except LlmgwError:
        pass  # the session is gone; the stage is under /tmp and holds nothing secret


def run_checklist(
    title: str,
    body: Callable[[Emit, Questions], Awaitable[T]],
    *,
    checklist: steps.Steps,
    plain: bool,
    as_json: bool,
) -> T | LlmgwError:
    """Run `body(emit, questions)` (a flow of `checklist`'s steps) under the checklist screen in a
    terminal, else printing one line per step (`plain`) or one JSON object per event (`as_json`),
    with unattended answers. A failure comes back, not raised: its step has shown it already."""
    if not (plain or as_json) and sys.stdin.isatty() and sys.stdout.isatty():
        from llmgw.nodeadd.screen import run_with_screen

        try:
            return trio.run(run_with_screen, title, body, checklist)
        except LlmgwError as exc:
            return exc  # the screen has printed the checklist and the failure
    render = steps.json_line if as_json else partial(steps.plain_line, steps=checklist)

    def emit(event: Event) -> None:
        line = render(event)
        if line is not None:
            print(line, flush=True)

    try:
        return trio.run(body, emit, Unattended())
    except LlmgwError as exc:
        return exc
