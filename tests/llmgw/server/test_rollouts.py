"""A changed model's replicas replaced one at a time (llmgw.server.state.rollouts, .versions): a
reload that changes a model's args restarts nothing in place; each replica keeps its exact
assignment (its agent's fingerprint) until its replacement of the new version is ready, and the
model never has fewer ready replicas than before. A replacement that fails stops the rollout:
it is withdrawn, the old replicas keep their assignments and the model is held at their version
(its new replicas get it too) until it changes again or an operator retries. The versions and
the old definitions are in the store: a reopened control plane (a restart, a new leader) keeps
the old replicas' assignments and goes on. Everything on a real `ControlPlane` with its store
and scheduler, on trio's autojump clock, the agents' reports made by hand."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from agent.adoption import fingerprint
from llmgw.config import Model, ServerConfig, ServerSection
from llmgw.server.app import ControlPlane
from llmgw.server.state.scheduler import NodeView, Placement, plan
from llmgw.server.state.versions import version_of
from llmgw.wire import agent_link as w
from testlib.controlplane import OFFLINE_ENGINES, make_state

pytestmark = pytest.mark.trio

GIB = 1 << 30
SIM = (w.EngineStatus(name="sim", version="1", ok=True),)
CODER = Model(name="coder", engine="sim", replicas=2, memory_gb=1.0, args=("--output-token-ms", "5"))


def config(state: Path, *models: Model) -> ServerConfig:
    return ServerConfig(engines=OFFLINE_ENGINES, server=ServerSection(state_dir=str(state)), models=models)


def join(plane: ControlPlane, node_id: str = "a", memory_gib: int = 16) -> None:
    hello = w.Hello(
        protocol_version=w.PROTOCOL_VERSION,
        node_id=node_id,
        agent_version="t",
        boot_id="b",
        started_at=1.0,
        inventory=w.Inventory(
            hostname=node_id,
            os="l",
            arch="x86_64",
            python="3.11",
            cpu_model="c",
            cpu_cores=2,
            memory_total_bytes=memory_gib * GIB,
        ),
        engines=SIM,
    )
    now = trio.current_time()
    conn = plane.registry.connect(hello, address="127.0.0.1", cert_serial=1, cert_not_after=2e9, now=now)
    plane.registry.heartbeat(node_id, conn, now)


async def plane_with(tmp_path: Path, *models: Model, memory_gib: int = 16) -> ControlPlane:
    state = tmp_path / "cp"
    make_state(state)
    plane = ControlPlane.open(config(state, *models), state)
    await plane.store.saw_node("a", "127.0.0.1")
    join(plane, memory_gib=memory_gib)
    plane.replicas.reconcile(trio.current_time())
    return plane


def beat(plane: ControlPlane, node_id: str = "a") -> None:
    """The node's agent heartbeats (a test that lets the clock run keeps its node joined)."""
    link = plane.registry.nodes[node_id].link
    assert link is not None
    plane.registry.heartbeat(node_id, link.conn_id, trio.current_time())


def report(plane: ControlPlane, states: dict[str, str], detail: str = "") -> None:
    """Node a's agent says each replica of `states` is in its state (the others it runs: ready),
    as its link would: the registry, then the control plane's hook."""
    statuses = tuple(
        w.ReplicaStatus(
            replica_id=rid,
            model=s.placement.model,
            state=states.get(rid, w.READY),
            port=9000 + i,
            detail=detail if rid in states else "",
        )
        for i, (rid, s) in enumerate(sorted(plane.replicas.placed.items()))
    )
    node = plane.registry.nodes["a"]
    assert node.link is not None
    plane.registry.replicas_changed("a", node.link.conn_id, statuses)
    plane._replicas_reported("a", statuses)


def ready(plane: ControlPlane) -> set[str]:
    return {s.replica_id for s in plane.registry.nodes["a"].replicas if s.state == w.READY}


def prints(plane: ControlPlane) -> dict[str, str]:
    """Each replica on node a with its assignment's fingerprint (what its agent restarts on)."""
    model_of = {m.name: m for m in plane.config.models}.get
    return {a.replica_id: fingerprint(a) for a in plane.replicas.assignments_for("a", model_of)}


def args_of(plane: ControlPlane) -> dict[str, tuple[str, ...]]:
    model_of = {m.name: m for m in plane.config.models}.get
    return {a.replica_id: a.args for a in plane.replicas.assignments_for("a", model_of)}


def change(plane: ControlPlane, *models: Model) -> None:
    """A reload that brought these models (as `Settings.reread` leaves the configuration)."""
    plane.settings.file_models = models
    plane.settings.current = attrs.evolve(plane.config, models=models)
    plane.changes.catalog_changed()


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


def counted(plane: ControlPlane, model: str = "coder") -> list[str]:
    return sorted(
        rid
        for rid, s in plane.replicas.placed.items()
        if s.placement.model == model and rid not in plane.replicas.surge
    )


async def roll_one(plane: ControlPlane, nursery: trio.Nursery, seen_ready: list[int]) -> str:
    """One move of the rollout, its replacement reported starting then ready: the replacement's
    id. `seen_ready`: the ready replicas counted at each step."""
    done = trio.Event()

    async def roll() -> None:
        await plane.rollouts.roll_once()
        done.set()

    before = set(plane.replicas.placed)
    nursery.start_soon(roll)
    await settle()
    [new] = set(plane.replicas.placed) - before
    assert new in plane.replicas.surge  # on top of the count
    seen_ready.append(len(ready(plane)))
    report(plane, {new: w.STARTING})
    await settle()
    seen_ready.append(len(ready(plane)))
    report(plane, {})  # every one placed ready, the replacement too
    await done.wait()
    report(plane, {})  # the one retired is no longer reported
    seen_ready.append(len(ready(plane)))
    return new


async def test_changed_args_restart_nothing_in_place_and_roll_one_replica_at_a_time(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    plane = await plane_with(tmp_path, CODER)
    report(plane, {})
    old = prints(plane)
    assert sorted(old) == ["coder-0", "coder-1"]

    new_args = ("--output-token-ms", "9")
    change(plane, attrs.evolve(CODER, args=new_args))
    assert plane.replicas.reconcile(trio.current_time()) == set()  # no node's assignments changed
    assert prints(plane) == old  # the agent would restart nothing
    assert plane.replicas.behind() == {"coder": ["coder-0", "coder-1"]}
    [view] = plane.views.model_views()
    assert view["rollout"]["state"] == "updating" and (view["rollout"]["updated"], view["rollout"]["replicas"]) == (
        0,
        2,
    )

    seen_ready: list[int] = []
    first = await roll_one(plane, nursery, seen_ready)
    args = args_of(plane)
    assert args[first] == new_args
    [left] = plane.replicas.behind()["coder"]
    assert prints(plane)[left] == old[left]  # the one not yet replaced runs as it did, exactly
    assert len(counted(plane)) == 2 and not plane.replicas.surge
    [view] = plane.views.model_views()
    assert (view["rollout"]["updated"], view["rollout"]["replicas"]) == (1, 2)

    second = await roll_one(plane, nursery, seen_ready)
    assert counted(plane) == sorted([first, second])
    assert set(args_of(plane).values()) == {new_args}
    assert plane.replicas.behind() == {}
    assert plane.views.model_views()[0]["rollout"] is None
    assert min(seen_ready) >= 2  # never fewer ready replicas than before the change
    assert plane.replicas.reconcile(trio.current_time()) == set()  # and the count is as the catalog says


async def test_a_replacement_that_fails_stops_the_rollout_and_the_old_replicas_serve_on(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    plane = await plane_with(tmp_path, CODER)
    report(plane, {})
    old = prints(plane)
    bad = attrs.evolve(CODER, args=("--output-token-ms", "-1"))
    change(plane, bad)
    plane.replicas.reconcile(trio.current_time())

    moved: list[bool] = []

    async def roll() -> None:
        moved.append(await plane.rollouts.roll_once())

    nursery.start_soon(roll)
    await settle()
    [new] = plane.replicas.surge
    detail = "the engine exited with status 2: --output-token-ms must be at least 0"
    report(plane, {new: w.FAILED}, detail)  # its agent gave up on it
    await settle()
    assert moved == [False]
    assert sorted(plane.replicas.placed) == ["coder-0", "coder-1"] and not plane.replicas.surge
    assert prints(plane) == old  # the old replicas keep their assignments: nothing restarts
    [view] = plane.views.model_views()
    rollout = view["rollout"]
    assert rollout["state"] == "stopped" and (rollout["updated"], rollout["replicas"]) == (0, 2)
    assert rollout["reason"] == f"update of coder stopped: {new} on a failed: {detail}"
    # Held: not rolled again, and a replica placed meanwhile runs the version that serves.
    assert plane.replicas.behind() == {}
    assert await plane.rollouts.roll_once() is False and not plane.replicas.surge
    change(plane, attrs.evolve(bad, replicas=3))  # the count is not the version: still held
    plane.replicas.reconcile(trio.current_time())
    [third] = set(plane.replicas.placed) - set(old)
    assert args_of(plane)[third] == CODER.args
    assert plane.views.model_views()[0]["rollout"]["state"] == "stopped"
    # The operator retries: rolled again; or the model changes again: a rollout of the new version.
    assert plane.rollouts.retry("coder") is True and plane.rollouts.retry("coder") is False
    assert sorted(plane.replicas.behind()["coder"]) == sorted(plane.replicas.placed)
    fixed = attrs.evolve(bad, args=("--output-token-ms", "7"))
    change(plane, fixed)
    assert plane.replicas.behind()["coder"] and plane.views.model_views()[0]["rollout"]["state"] == "updating"


async def test_a_failed_version_is_held_and_a_new_one_rolls_after_it(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The node a failed version failed on is not avoided by the next version: with one node, the
    fixed version goes where the bad one failed."""
    plane = await plane_with(tmp_path, CODER)
    report(plane, {})
    change(plane, attrs.evolve(CODER, args=("--bad",)))
    nursery.start_soon(plane.rollouts.roll_once)
    await settle()
    [new] = plane.replicas.surge
    report(plane, {new: w.FAILED}, "exited")
    await settle()
    assert plane.views.model_views()[0]["rollout"]["state"] == "stopped"
    fixed = attrs.evolve(CODER, args=("--output-token-ms", "7"))
    change(plane, fixed)
    plane.replicas.reconcile(trio.current_time())
    seen: list[int] = []
    await roll_one(plane, nursery, seen)
    await roll_one(plane, nursery, seen)
    assert set(args_of(plane).values()) == {fixed.args} and min(seen) >= 2


async def test_no_room_for_a_replacement_waits_and_says_why(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    plane = await plane_with(tmp_path, attrs.evolve(CODER, memory_gb=7.0), memory_gib=16)
    report(plane, {})
    change(plane, attrs.evolve(CODER, memory_gb=7.0, args=("--output-token-ms", "9")))
    plane.replicas.reconcile(trio.current_time())
    assert await plane.rollouts.roll_once() is False  # two of 7 GiB on 16: no room for a third
    [view] = plane.views.model_views()
    assert view["rollout"]["state"] == "updating" and "GiB free" in view["rollout"]["waiting"]
    assert sorted(plane.replicas.placed) == ["coder-0", "coder-1"]
    assert plane.replicas.behind() == {"coder": ["coder-0", "coder-1"]}  # not held: tried again at the next change


async def test_a_replacement_never_takes_the_id_of_a_replica_its_agent_still_reports(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The replica retired a moment ago is still reported ready (its agent has not reported
    since it stopped it): a replacement of the same id would pass for ready at once, and its
    original be retired before it ran."""
    plane = await plane_with(tmp_path, CODER)
    report(plane, {})
    change(plane, attrs.evolve(CODER, args=("--output-token-ms", "9")))
    first = trio.Event()

    async def roll(done: trio.Event) -> None:
        await plane.rollouts.roll_once()
        done.set()

    nursery.start_soon(roll, first)
    await settle()
    report(plane, {})  # the replacement ready (and the two it may replace)
    await first.wait()
    [retired] = {"coder-0", "coder-1"} - set(plane.replicas.placed)
    assert retired in {s.replica_id for s in plane.registry.nodes["a"].replicas}  # still reported, ready
    second = trio.Event()
    nursery.start_soon(roll, second)
    await settle()
    [new] = plane.replicas.surge
    assert new != retired and not second.is_set()  # waiting for its own report
    [left] = plane.replicas.behind()["coder"]
    assert left in plane.replicas.placed
    report(plane, {})
    await second.wait()
    assert plane.replicas.behind() == {}


async def test_the_loop_rolls_by_itself_and_a_wait_for_room_looks_again(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """`Rollouts.serve`: no room for a replacement (two of 5 GiB and another model's 5 GiB on 16),
    then room made where no reconcile pass sees it (the other model's replica retired): it looks
    again within WAITING_LOOK_S, and replaces both replicas one after the other."""
    from llmgw.server.state.rollouts import WAITING_LOOK_S

    coder = attrs.evolve(CODER, memory_gb=5.0)
    other = Model(name="other", engine="sim", memory_gb=5.0)
    plane = await plane_with(tmp_path, coder, other)
    report(plane, {})
    updated = attrs.evolve(coder, args=("--output-token-ms", "9"))
    change(plane, updated, other)
    plane.replicas.reconcile(trio.current_time())
    await nursery.start(plane.rollouts.serve)
    await settle()
    assert not plane.replicas.surge and "GiB free" in plane.rollouts.waiting["coder"]
    plane.replicas.retire("other-0", None)  # room, unseen by the reconciler
    began = trio.current_time()
    while not plane.replicas.surge and trio.current_time() - began <= WAITING_LOOK_S + 1:
        beat(plane)
        await trio.sleep(1)
    assert plane.replicas.surge, plane.rollouts.waiting
    while plane.replicas.behind() and trio.current_time() - began < 100:
        beat(plane)
        report(plane, {})
        await trio.sleep(1)
    assert set(args_of(plane).values()) == {updated.args} and not plane.rollouts.waiting


async def test_a_changed_memory_keeps_the_old_placements_until_replaced(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """A change of what placement reads (memory) would have made every placement invalid, all
    stopped and placed again at once; each is kept, judged by the definition it runs."""
    plane = await plane_with(tmp_path, CODER)
    report(plane, {})
    old = prints(plane)
    change(plane, attrs.evolve(CODER, memory_gb=2.0))
    assert plane.replicas.reconcile(trio.current_time()) == set()
    assert prints(plane) == old
    seen: list[int] = []
    new = await roll_one(plane, nursery, seen)
    assert plane.replicas.placed[new].placement.memory_bytes == 2 * GIB
    await roll_one(plane, nursery, seen)
    assert {s.placement.memory_bytes for s in plane.replicas.placed.values()} == {2 * GIB} and min(seen) >= 2


async def test_the_scheduler_judges_a_placement_by_the_definition_it_runs() -> None:
    node = NodeView(node_id="a", schedulable=True, engines=frozenset({"sim"}), gpus=0, memory_bytes=16 * GIB)
    was = Placement(replica_id="coder-0", model="coder", nodes=("a",), memory_bytes=GIB, engine="sim")
    now = attrs.evolve(CODER, replicas=1, memory_gb=2.0)
    assert plan([node], [now], [was]).stop == (was,)  # judged by the catalog: invalid
    kept = plan([node], [now], [was], runs={"coder-0": CODER})
    assert kept.keep == (was,) and kept.start == () and kept.stop == ()


async def test_the_versions_survive_a_reopen_and_a_new_control_plane_goes_on(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """A leader change (or a restart) in the middle of a rollout: the new control plane reads
    each placement's version and the old definition from the store, gives the old replica the
    same assignment (its engine is adopted, not restarted) and goes on replacing it."""
    plane = await plane_with(tmp_path, CODER)
    report(plane, {})
    old = prints(plane)
    updated = attrs.evolve(CODER, args=("--output-token-ms", "9"))
    change(plane, updated)
    plane.replicas.reconcile(trio.current_time())
    first = await roll_one(plane, nursery, [])
    [left] = plane.replicas.behind()["coder"]
    await plane.store.set_placements(plane.replicas.rows(), plane.replicas.version_rows())  # the saver's write
    plane.store.close()

    state = tmp_path / "cp"
    again = ControlPlane.open(config(state, updated), state)
    try:
        stored = {rid: s.version for rid, s in again.replicas.placed.items()}
        assert stored == {first: version_of(updated), left: version_of(CODER)}
        join(again)
        again.replicas.reconcile(trio.current_time())
        assert sorted(again.replicas.placed) == sorted([first, left])  # nothing placed or stopped
        assert prints(again)[left] == old[left]  # the old replica's engine is adopted as it runs
        assert again.replicas.behind() == {"coder": [left]}
        report(again, {})
        second = await roll_one(again, nursery, [])
        assert set(args_of(again).values()) == {updated.args} and sorted(again.replicas.placed) == sorted(
            [first, second]
        )
        await again.store.set_placements(again.replicas.rows(), again.replicas.version_rows())
        # Only the version in use is kept once the rollout is done.
        assert [b["version"] for b in (await _versions(again))] == [version_of(updated)]
    finally:
        again.store.close()


async def test_a_replacement_under_way_at_a_change_of_leader_is_withdrawn_and_the_rollout_goes_on(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The leader placed a replacement and was waiting for it when it lost its lease: the next
    leader does not count it (the count's excess would be stopped, maybe an old replica that
    serves), its agent stops it, and the rollout places another."""
    plane = await plane_with(tmp_path, CODER)
    report(plane, {})
    old = prints(plane)
    updated = attrs.evolve(CODER, args=("--output-token-ms", "9"))
    change(plane, updated)
    plane.replicas.reconcile(trio.current_time())
    leading = trio.CancelScope()

    async def roll() -> None:
        with leading:
            await plane.rollouts.roll_once()

    nursery.start_soon(roll)
    await settle()
    [under_way] = plane.replicas.surge
    await plane.store.set_placements(plane.replicas.rows(), plane.replicas.version_rows())  # the saver's write
    leading.cancel()  # its term is over
    plane.store.close()

    state = tmp_path / "cp"
    again = ControlPlane.open(config(state, updated), state)
    try:
        assert under_way not in again.replicas.placed  # not the replacement
        assert sorted(again.replicas.placed) == ["coder-0", "coder-1"]
        join(again)
        report(again, {})
        again.replicas.reconcile(trio.current_time())
        assert prints(again) == old and sorted(again.replicas.placed) == ["coder-0", "coder-1"]
        seen: list[int] = []
        await roll_one(again, nursery, seen)
        await roll_one(again, nursery, seen)
        assert set(args_of(again).values()) == {updated.args} and min(seen) >= 2
    finally:
        again.store.close()


async def test_a_catalog_changed_while_the_control_plane_was_down_is_rolled_too(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """server.toml edited and the control plane restarted (not reloaded): the replicas are of the
    stored version, whose definition the store has; they keep running and are rolled."""
    plane = await plane_with(tmp_path, CODER)
    report(plane, {})
    old = prints(plane)
    await plane.store.set_placements(plane.replicas.rows(), plane.replicas.version_rows())
    plane.store.close()
    state = tmp_path / "cp"
    edited = attrs.evolve(CODER, args=("--output-token-ms", "9"))
    again = ControlPlane.open(config(state, edited), state)
    try:
        join(again)
        again.replicas.reconcile(trio.current_time())
        assert prints(again) == old
        assert again.replicas.behind() == {"coder": ["coder-0", "coder-1"]}
    finally:
        again.store.close()


async def test_placements_stored_before_versions_are_taken_as_the_catalogs(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Rows of an earlier llmgw name no version: the replicas are taken as running the catalog's
    (nothing is rolled at the upgrade), and their rows say so from then on."""
    plane = await plane_with(tmp_path, CODER)
    rows = {rid: {k: v for k, v in row.items() if k != "version"} for rid, row in plane.replicas.rows().items()}
    await plane.store.set_placements(rows, {})
    plane.store.close()
    state = tmp_path / "cp"
    again = ControlPlane.open(config(state, CODER), state)
    try:
        assert {s.version for s in again.replicas.placed.values()} == {""}
        join(again)
        again.replicas.reconcile(trio.current_time())
        assert {s.version for s in again.replicas.placed.values()} == {version_of(CODER)}
        assert again.replicas.behind() == {}
    finally:
        again.store.close()


async def test_an_older_replica_that_is_parked_is_stopped_not_replaced(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    scaled = attrs.evolve(CODER, min_replicas=0, max_replicas=2, replicas=2)
    plane = await plane_with(tmp_path, scaled)
    report(plane, {})
    plane.replicas.parked.add("coder-1")  # as the autoscaler's park leaves it
    change(plane, attrs.evolve(scaled, args=("--output-token-ms", "9")))
    assert await plane.rollouts.roll_once() is True
    assert "coder-1" not in plane.replicas.placed and not plane.replicas.surge  # nothing placed for it


async def _versions(plane: ControlPlane) -> Iterable[dict]:
    return (await trio.to_thread.run_sync(plane.store._store.model_versions)).values()
