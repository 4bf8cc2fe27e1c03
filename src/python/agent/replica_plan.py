"""The replica supervisor's decisions, pure: the member state table, the restart policy, the plan
that turns a desired set of assignments into starts, stops and keeps, and how an engine's end
is told. `agent.replica_supervisor` and `agent.replica_life` perform them.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Mapping

import attrs

from agent.adoption import fingerprint
from agent.engine_proc import EngineProcess
from llmgw.backoff import Backoff
from llmgw.wire import agent_link as w

Key = tuple[str, int]  # (replica_id, node_rank)

# Every move a member's state may make (staying put, with new fields, is always allowed). A
# member being stopped only goes on to stopped: whatever else it was about to report is moot.
TRANSITIONS: Mapping[str, frozenset[str]] = {
    w.FETCHING: frozenset({w.STARTING, w.FAILED, w.STOPPING}),
    # PARKED at once: an engine an earlier agent left parked (agent.replica_watch).
    w.STARTING: frozenset({w.READY, w.PARKED, w.RESTARTING, w.FAILED, w.STOPPING}),
    w.READY: frozenset({w.PARKED, w.RESTARTING, w.FAILED, w.STOPPING}),
    # Parked and woken by its engine (rank 0 asks it: `agent.replica_watch`), it runs throughout.
    w.PARKED: frozenset({w.READY, w.RESTARTING, w.FAILED, w.STOPPING}),
    # An adopted engine that exited is followed by an ordinary start, which may fetch first.
    w.RESTARTING: frozenset({w.FETCHING, w.STARTING, w.FAILED, w.STOPPING}),
    w.FAILED: frozenset({w.FETCHING, w.STARTING, w.STOPPING}),  # waiting for an engine or GPUs
    w.STOPPING: frozenset({w.STOPPED}),
    w.STOPPED: frozenset(),
}


# When to start an engine again after it exited, and when to stop trying: exits within 10 min
# count, and 5 of them fail the member (the control plane places it elsewhere). Otherwise the
# wait doubles with each recent exit from 1 s up to 60 s, so an engine that ran for hours and
# crashed once is back after 1 s.
RESTART_BACKOFF = Backoff(first_s=1.0, max_s=60.0, window_s=600.0, give_up_after=5)


@attrs.frozen(kw_only=True)
class Plan:
    start: tuple[w.ReplicaAssignment, ...] = ()
    stop: tuple[Key, ...] = ()
    keep: tuple[w.ReplicaAssignment, ...] = ()  # running already, identical: confirms an adopted member


def key_of(a: w.ReplicaAssignment) -> Key:
    return (a.replica_id, a.node_rank)


def plan(running: Mapping[Key, str], wanted: Iterable[w.ReplicaAssignment]) -> Plan:
    """What to stop and start so that exactly `wanted` runs. `running` holds the fingerprint of
    what each member runs (an adopted engine's comes from its record). Identical ones are kept."""
    want = {key_of(a): a for a in wanted}
    prints = {k: fingerprint(a) for k, a in want.items()}
    return Plan(
        start=tuple(a for k, a in sorted(want.items()) if running.get(k) != prints[k]),
        stop=tuple(k for k, f in sorted(running.items()) if prints.get(k) != f),
        keep=tuple(a for k, a in sorted(want.items()) if running.get(k) == prints[k]),
    )


def describe_exit(code: int | None) -> str:
    if code is None:
        return "the engine could not be started"
    if code < 0:
        try:
            return f"the engine was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"the engine was killed by signal {-code}"
    return f"the engine exited with status {code}"


def describe_end(engine: EngineProcess) -> str:
    if engine.returncode is not None:
        return describe_exit(engine.returncode)
    if engine.exited:
        return f"the engine (pid {engine.pid}, adopted) exited; its exit status went to its parent"
    return f"the engine (pid {engine.pid}) is still running"
