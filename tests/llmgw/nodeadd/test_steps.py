"""The node-add checklist: order, one outcome per step, stop at the first failure, renderings."""

from __future__ import annotations

import json

import pytest

from llmgw.nodeadd.node.steps import NAMES, STEPS
from llmgw.nodeadd.steps import (
    FAILED,
    OK,
    PROGRESS,
    STARTED,
    WARN,
    Checklist,
    Event,
    json_line,
    plain_line,
    summary,
)


def run(checklist: Checklist, step: str, outcome: str, detail: str = "") -> None:
    checklist.apply(Event(step=step, status=STARTED))
    checklist.apply(Event(step=step, status=outcome, detail=detail))


def test_the_authority_is_read_before_the_node_is_touched() -> None:
    assert NAMES[0] == "authority" and NAMES[1] == "connect"
    assert NAMES.index("doctor") < NAMES.index("identity") < NAMES.index("start") < NAMES.index("join")


def test_a_whole_run_in_order() -> None:
    c = Checklist(steps=STEPS)
    for name in NAMES:
        run(c, name, WARN if name == "doctor" else OK)
    assert c.done and c.failed is None and len(c.events) == 2 * len(NAMES)


def test_steps_cannot_skip_ahead_repeat_or_finish_unstarted() -> None:
    c = Checklist(steps=STEPS)
    with pytest.raises(ValueError, match="before 'authority' finished"):
        c.apply(Event(step="connect", status=STARTED))
    with pytest.raises(ValueError, match="without starting"):
        c.apply(Event(step="authority", status=OK))
    run(c, "authority", OK)
    with pytest.raises(ValueError, match="started twice"):
        c.apply(Event(step="authority", status=STARTED))


def test_the_first_failure_stops_the_run() -> None:
    c = Checklist(steps=STEPS)
    run(c, "authority", FAILED, "no CA in /var/lib/llmgw; run `llmgw ca init`")
    assert c.done and c.failed == "authority"
    with pytest.raises(ValueError, match="after 'authority' failed"):
        c.apply(Event(step="connect", status=STARTED))


def test_renderings() -> None:
    event = Event(step="connect", status=OK, detail="ubuntu@10.0.0.21")
    assert plain_line(Event(step="connect", status=STARTED), STEPS) is None
    assert plain_line(event, STEPS) == "ok     connect    connect over SSH and verify the host key: ubuntu@10.0.0.21"
    assert json.loads(json_line(event)) == {"step": "connect", "status": "ok", "detail": "ubuntu@10.0.0.21"}


def test_a_running_step_reports_progress_in_every_rendering_and_keeps_its_status() -> None:
    c = Checklist(steps=STEPS)
    for name in NAMES[:-1]:
        run(c, name, OK)
    with pytest.raises(ValueError, match="progress while not running"):
        c.apply(Event(step="join", status=PROGRESS, detail="too early"))
    c.apply(Event(step="join", status=STARTED))
    said = Event(step="join", status=PROGRESS, detail="joined; installing llama.cpp 40% (build)")
    c.apply(said)
    c.apply(said)
    assert c.status["join"] == STARTED and not c.done and summary(c)[-1].startswith("started")
    assert plain_line(said, STEPS) == "..     join       joined; installing llama.cpp 40% (build)"
    assert json.loads(json_line(said)) == {
        "step": "join",
        "status": "progress",
        "detail": "joined; installing llama.cpp 40% (build)",
    }
    c.apply(Event(step="join", status=OK, detail="joined"))
    assert c.done and c.failed is None
    with pytest.raises(ValueError, match="progress while not running"):
        c.apply(Event(step="join", status=PROGRESS, detail="after the end"))
