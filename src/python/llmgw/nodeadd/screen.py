"""The terminal screen of the onboarding flows: a urwid checklist of a flow's steps and the operator's questions.

`run_with_screen` runs the urwid main loop and the caller's body in one nursery. The body
reports progress through `emit` (applied to a `steps.Checklist`, which keeps the order rules)
and asks through a `Questions` whose answers come from keys. The screen owns the terminal only
while the body runs and gives it back however the body ends (cbreak off, the normal buffer,
Ctrl-C a signal again); then the final checklist is printed so it stays in the scrollback.
A key answers only the question on screen: keys typed while none is open are dropped (but q
and Ctrl-C, which stop), so a stray `y` cannot answer a question the operator has not read.
No I/O but the terminal: what the steps do is the body's business.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import trio
import urwid

from llmgw.config import FabricDecl, parse_fabric_flag
from llmgw.errors import UsageError, leaves
from llmgw.nodeadd import steps
from llmgw.nodeadd.questions import DoctorFailure, Questions
from llmgw.wire.agent_link import FabricGroup

T = TypeVar("T")
Emit = Callable[[steps.Event], None]

MARKS = {
    None: "[  ]",
    steps.STARTED: "[..]",
    steps.OK: "[ok]",
    steps.WARN: "[!!]",
    steps.FAILED: "[XX]",
}
PALETTE = [
    ("title", "bold", ""),
    (steps.STARTED, "light cyan", ""),
    (steps.OK, "light green", ""),
    (steps.WARN, "yellow", ""),
    (steps.FAILED, "light red", ""),
    ("error", "light red", ""),
    ("hint", "dark gray", ""),
]
# ASCII borders: the screen must read the same under any locale and in `tmux capture-pane`.
BORDER = {
    "tlcorner": "+",
    "tline": "-",
    "lline": "|",
    "trcorner": "+",
    "blcorner": "+",
    "rline": "|",
    "bline": "-",
    "brcorner": "+",
}
IDLE_HINT = "q or Ctrl-C: stop"
DETAIL_INDENT = len(MARKS[None]) + 1


async def run_with_screen(title: str, body: Callable[[Emit, Questions], Awaitable[T]], checklist: steps.Steps) -> T:
    """Run `body(emit, questions)` under the checklist screen; return what it returns, raise what it raises.

    `checklist` is the flow's steps, as shown. Call from inside `trio.run`. q (when no question is open) or Ctrl-C cancels the body and
    raises UsageError; the body's own exception comes out as itself, not in an exception group.
    """
    ui = _Screen(title, checklist)
    returned: list[T] = []
    raised: list[Exception] = []
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(_serve_screen, ui)
            try:
                with ui.body_scope:
                    returned.append(await body(ui.emit, _ScreenQuestions(ui)))
            except Exception as exc:  # noqa: BLE001 - re-raised below, once the terminal is back
                raised.append(exc)
            nursery.cancel_scope.cancel()
    except BaseException as exc:
        # A group of one (a bug in a key handler, or a real SIGINT) comes out as its leaf, which
        # the CLI knows how to report. (No `except*`: nodes run 3.10.)
        inner = leaves(exc)
        if len(inner) == 1 and inner[0] is not exc:
            raise inner[0] from None
        raise
    finally:
        print("\n".join(summary_lines(title, ui.checklist)), flush=True)
    if raised:
        raise raised[0]
    if returned:
        return returned[0]
    raise UsageError(f"stopped by the operator (q or Ctrl-C) {ui.where()}; the checklist above shows what was done")


def summary_lines(title: str, checklist: steps.Checklist) -> list[str]:
    """What stays in the scrollback: every step's status, and the detail of a warning or failure."""
    latest = {e.step: e for e in checklist.events}
    lines = [title]
    for name, line in zip(checklist.names, steps.summary(checklist), strict=True):
        lines.append(line)
        event = latest.get(name)
        if event is not None and event.status in (steps.WARN, steps.FAILED) and event.detail:
            lines += [f"        {text}" for text in event.detail.splitlines()]
    return lines


async def _serve_screen(ui: _Screen, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    event_loop = urwid.TrioEventLoop()
    # No probing for paste and focus modes: their replies would arrive as keys we do not use.
    screen = urwid.display.raw.Screen(bracketed_paste_mode=False, focus_reporting=False)
    loop = urwid.MainLoop(
        ui.top,
        PALETTE,
        screen=screen,
        handle_mouse=False,  # leave the mouse to the terminal, so text can be selected and copied
        unhandled_input=ui.key,
        event_loop=event_loop,
    )
    with loop.start():  # stops the loop, restoring the terminal, however this task ends
        # Ctrl-C as a key rather than SIGINT, so that stopping cancels the body like q does;
        # loop.stop() puts the interrupt key back.
        screen.tty_signal_keys(intr="undefined")
        ui.loop = loop
        try:
            task_status.started()
            await event_loop.run_async()
        finally:
            ui.loop = None


class _StepRow:
    """One step: its mark and text, and under them the detail of its latest event, wrapped."""

    def __init__(self, text: str) -> None:
        self._mark = urwid.Text(MARKS[None])
        self._line = urwid.Columns([(DETAIL_INDENT, self._mark), urwid.Text(text)])
        self._detail = urwid.Text("")
        self._indented = urwid.Padding(self._detail, left=DETAIL_INDENT)
        self.widget = urwid.Pile([self._line])

    def show(self, status: str, detail: str) -> None:
        self._mark.set_text((status, MARKS[status]))
        self._detail.set_text(detail)
        shown = [self._line, self._indented] if detail else [self._line]
        self.widget.contents[:] = [(w, self.widget.options()) for w in shown]


class _Screen:
    """The widgets and what the keys do; synchronous, drawn by the urwid loop while it runs."""

    def __init__(self, title: str, checklist: steps.Steps) -> None:
        self.checklist = steps.Checklist(steps=checklist)
        self.rows = {name: _StepRow(text) for name, text in checklist}
        self.steps_list = urwid.ListBox(urwid.SimpleFocusListWalker([r.widget for r in self.rows.values()]))
        self.panel = urwid.WidgetPlaceholder(urwid.Text(("hint", IDLE_HINT)))
        header = urwid.Pile([urwid.Text(("title", title)), urwid.Divider("-")])
        self.top = urwid.Frame(body=self.steps_list, header=header, footer=self.panel)
        self.body_scope = trio.CancelScope()
        self.loop: urwid.MainLoop | None = None
        self._on_key: Callable[[str], None] | None = None  # the open question's

    def emit(self, event: steps.Event) -> None:
        self.checklist.apply(event)
        # Progress keeps the step's running mark and replaces the detail under it.
        status = steps.STARTED if event.status == steps.PROGRESS else event.status
        self.rows[event.step].show(status, event.detail)
        self.steps_list.focus_position = self.checklist.names.index(event.step)  # keep it in view
        self.redraw()

    def redraw(self) -> None:
        if self.loop is not None and self.loop.screen.started:
            self.loop.draw_screen()

    def open(self, panel: urwid.Widget, on_key: Callable[[str], None]) -> None:
        self.panel.original_widget = panel
        self.top.focus_position = "footer"  # an Edit in the panel gets the typing
        self._on_key = on_key
        self.redraw()

    def close(self, panel: urwid.Widget) -> None:
        if self.panel.original_widget is not panel:
            return  # closed already, when it was answered
        self.panel.original_widget = urwid.Text(("hint", IDLE_HINT))
        self.top.focus_position = "body"
        self._on_key = None
        self.redraw()

    def key(self, key: str | tuple[str, int, int, int]) -> bool:
        """What the focused widget left unhandled."""
        if key == "ctrl c" or (key in ("q", "Q") and self._on_key is None):
            self.body_scope.cancel()
            return True
        if isinstance(key, str) and self._on_key is not None:
            self._on_key(key)
            return True
        return False

    def where(self) -> str:
        events = self.checklist.events
        if not events:
            return "before the first step"
        last = events[-1].step
        return f"{'during' if self.checklist.status[last] == steps.STARTED else 'after'} step {last!r}"


class _Pending:
    """A key that does not answer the open question."""


PENDING = _Pending()
YES_NO = {"y": True, "Y": True, "n": False, "N": False}


class _ScreenQuestions:
    """`Questions` answered by keys: one panel at a time under the checklist."""

    def __init__(self, ui: _Screen) -> None:
        self._ui = ui
        self._lock = trio.Lock()  # two questions at once would fight over the panel

    async def accept_host_key(self, target: str, algorithm_and_fingerprint: str) -> bool:
        panel = _panel(
            "new host key",
            [
                urwid.Text(f"{target} is not in known_hosts. It offers this host key:"),
                urwid.Text(("title", f"  {algorithm_and_fingerprint}")),
                urwid.Text("Compare it with the host's own (ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub there)."),
            ],
            "y: trust it (it is added to known_hosts)   n: refuse (nothing runs there)   Ctrl-C: stop",
        )
        return await self._ask(panel, lambda key: YES_NO.get(key, PENDING))

    async def go_past_doctor(self, failures: Sequence[DoctorFailure]) -> bool:
        lines: list[urwid.Widget] = [urwid.Text(f"llmgw doctor failed {len(failures)} check(s) on the node:")]
        for f in failures:
            lines.append(urwid.Text([("failed", f"- {f.check}: "), f.detail]))
            if f.fix:
                lines.append(urwid.Padding(urwid.Text(f"fix: {f.fix}"), left=2))
        panel = _panel("doctor failed", lines, "y: go on anyway   n: stop here   Ctrl-C: stop")
        return await self._ask(panel, lambda key: YES_NO.get(key, PENDING))

    async def name_fabrics(
        self, groups: Sequence[FabricGroup], existing: Sequence[str], given: Sequence[FabricDecl]
    ) -> tuple[FabricDecl, ...]:
        named: list[FabricDecl] = []
        for number, group in enumerate(groups, 1):
            taken = [d.name for d in named]
            edit = urwid.Edit(("title", "fabric name: "), offered_name(group, existing, given, taken))
            error = urwid.Text("")
            heading = f"group {number} of {len(groups)}: {group.kind} adapters {', '.join(group.adapters)}"
            panel = _panel(
                "name the fabric",
                [
                    urwid.Text(heading),
                    urwid.Text(f"identity {group.identity}" + (f" ({group.detail})" if group.detail else "")),
                    urwid.Text(f"fabrics in the cluster: {', '.join(existing) or 'none yet'}"),
                    edit,
                    error,
                ],
                "Enter: accept   empty name: leave this group unnamed (no multi-node replica on it)   "
                "Ctrl-U: clear   Ctrl-C: stop",
                focus=edit,
            )

            def answer(key: str, edit: urwid.Edit = edit, error: urwid.Text = error, group: FabricGroup = group):
                if key == "ctrl u":
                    edit.set_edit_text("")
                    return PENDING
                if key != "enter":
                    return PENDING
                try:
                    return typed_name(edit.edit_text, group, named)
                except ValueError as exc:
                    error.set_text(("error", str(exc)))
                    return PENDING

            name = await self._ask(panel, answer)
            if name:
                named.append(FabricDecl(name=name, adapters=group.adapters))
        return tuple(named)

    async def _ask(self, panel: urwid.Widget, answer: Callable[[str], object]) -> object:
        """Show `panel` until `answer(key)` is something other than PENDING, and return that."""
        async with self._lock:
            answered = trio.Event()
            got: list[object] = []

            def on_key(key: str) -> None:
                value = answer(key)
                if value is not PENDING and not answered.is_set():
                    got.append(value)
                    answered.set()
                    self._ui.close(panel)  # now: the keys after this one are not for this question

            self._ui.open(panel, on_key)
            try:
                await answered.wait()
            finally:
                self._ui.close(panel)
            return got[0]


def offered_name(group: FabricGroup, existing: Sequence[str], given: Sequence[FabricDecl], taken: Sequence[str]) -> str:
    """The name an operator most likely means: a --fabric naming any of the group's adapters,
    else the first of the cluster's fabrics this node does not use yet, else none."""
    for decl in given:
        if set(decl.adapters) & set(group.adapters):
            return decl.name
    return next((name for name in existing if name not in taken), "")


def typed_name(text: str, group: FabricGroup, named: Sequence[FabricDecl]) -> str:
    """The fabric name typed for `group` ("" leaves it unnamed); ValueError says what is wrong."""
    text = text.strip()
    if not text:
        return ""
    if ":" in text:
        raise ValueError(
            f"type the fabric's name only: this group's adapters ({', '.join(group.adapters)}) are implied"
        )
    name = parse_fabric_flag(text).name
    clash = next((d for d in named if d.name == name), None)
    if clash is not None:
        # Adapters in one fabric report one identity; the agent refuses a name that spans two.
        raise ValueError(
            f"fabric {name!r} already names {', '.join(clash.adapters)}, whose adapters report another "
            "identity; give this group another name, or none"
        )
    return name


def _panel(title: str, lines: list[urwid.Widget], keys: str, focus: urwid.Widget | None = None) -> urwid.Widget:
    pile = urwid.Pile([*lines, urwid.Divider(), urwid.Text(("hint", keys))])
    if focus is not None:
        pile.focus_position = lines.index(focus)
    return urwid.LineBox(pile, title=title, **BORDER)
