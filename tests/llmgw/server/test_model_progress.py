"""A model's replicas on their way, as `ctl models` and the cluster page show them (issue 44): each
replica downloading or starting is a line of its model, "REPLICA on NODES: DETAIL" (its state when
it says nothing more), at most PROGRESS_SHOWN a model; a ready replica is counted, not listed; and
`llmgw ctl models` prints each line under its table. Pure: views in, views and text out."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from llmgw.config import Model
from llmgw.ctl.models import run_list
from llmgw.server.state.views import PROGRESS_SHOWN, model_views
from llmgw.wire import agent_link as w

DOWNLOADING = "downloading weights: 3 of 12 MiB (25%, 1.5 MiB/s)"  # agent.weights.describe's words


def placed(replica: str, model: str, state: str, *nodes: str, detail: str = "") -> dict[str, Any]:
    """A placed replica's view as `views.replica_view` makes it (the fields model_views reads)."""
    return {"replica": replica, "model": model, "nodes": list(nodes or ("n1",)), "state": state, "detail": detail}


def pending(model: str, reason: str) -> dict[str, Any]:
    """A replica the scheduler holds back, as `views.pending_views` makes it."""
    return {"replica": None, "model": model, "state": "pending", "detail": reason, "nodes": []}


def by_model(views: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {v["model"]: v for v in views}


def test_each_replica_downloading_or_starting_is_a_line_of_its_model() -> None:
    models = [
        Model(name="a", engine="llamacpp", replicas=4),
        Model(name="b", engine="vllm", replicas=1, nodes_per_replica=2, gpus_per_replica=1),
        Model(name="c", engine="sim", replicas=2),
        Model(name="d", engine="sim", replicas=1),
    ]
    replicas = [
        placed("a-1", "a", w.FETCHING, "n1", detail=DOWNLOADING),
        placed("a-2", "a", w.STARTING, "n2"),  # nothing more to say: its state
        placed("a-3", "a", w.READY, "n3"),
        placed("a-4", "a", w.FETCHING, "n3", detail="waiting for another replica's download of these weights"),
        placed("b-1", "b", w.FETCHING, "n1", "n2", detail=DOWNLOADING),  # a replica across two nodes
        placed("c-1", "c", w.FAILED, "n2", detail="engine exited with status 1"),
        pending("c", "no node has 4 GiB free"),
        placed("d-1", "d", w.READY, "n4"),
    ]
    views = by_model(model_views(models, replicas))
    assert views["a"]["progress"] == [
        f"a-1 on n1: {DOWNLOADING}",
        "a-2 on n2: starting",
        "a-4 on n3: waiting for another replica's download of these weights",
    ]
    assert views["a"]["ready"] == 1 and views["a"]["pending"] == []
    assert views["b"]["progress"] == [f"b-1 on n1,n2: {DOWNLOADING}"]
    # Failed and pending replicas are not on their way: the pending one is said as such.
    assert views["c"]["progress"] == [] and views["c"]["pending"] == ["no node has 4 GiB free"]
    assert views["d"]["progress"] == [] and views["d"]["ready"] == 1  # ready: counted, not listed


def test_at_most_progress_shown_lines_a_model_every_ready_replica_counted() -> None:
    models = [Model(name="big", engine="sim", replicas=PROGRESS_SHOWN + 12), Model(name="small", engine="sim")]
    coming = [placed(f"big-{i}", "big", w.FETCHING, f"n{i}", detail=DOWNLOADING) for i in range(PROGRESS_SHOWN + 5)]
    ready = [placed(f"big-r{i}", "big", w.READY, f"n{i}") for i in range(7)]
    views = by_model(model_views(models, [*coming, *ready, placed("small-1", "small", w.STARTING, "n0")]))
    assert views["big"]["progress"] == [f"big-{i} on n{i}: {DOWNLOADING}" for i in range(PROGRESS_SHOWN)]
    assert views["big"]["ready"] == 7  # the ready ones after the bound are all counted
    assert views["small"]["progress"] == ["small-1 on n0: starting"]  # the bound is a model's own


class Answers:
    """What the admin API answers `ctl models` (the AdminClient's `request`)."""

    def __init__(self, models: list[dict[str, Any]]) -> None:
        self.models = models

    def request(self, method: str, path: str, *rest: Any, **options: Any) -> Any:
        assert (method, path) == ("GET", "/admin/v1/models")
        return {"models": self.models}


def test_ctl_models_prints_each_progress_line_under_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    models = [Model(name="qwen", engine="llamacpp", replicas=2), Model(name="sim-small", engine="sim")]
    replicas = [
        placed("r1", "qwen", w.FETCHING, "node-a", detail=DOWNLOADING),
        placed("r2", "qwen", w.STARTING, "node-b"),
        placed("r3", "sim-small", w.READY, "node-a"),
    ]
    # As the admin API answers: each view with where its model comes from (admin.models.detail).
    listed = [{**v, "from": "server.toml", "staging_to": []} for v in model_views(models, replicas)]
    client: Any = Answers(listed)  # an AdminClient to `run_list`
    assert run_list(lambda _: client, argparse.Namespace(json=False)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["MODEL", "ENGINE", "READY", "GPUS", "NODES", "SOURCE", "PENDING"]
    assert out[1].split()[:3] == ["qwen", "llamacpp", "0/2"] and out[2].split()[:3] == ["sim-small", "sim", "1/1"]
    assert out[3:] == [f"  qwen: r1 on node-a: {DOWNLOADING}", "  qwen: r2 on node-b: starting"]
