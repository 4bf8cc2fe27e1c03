"""`llmgw up`'s server.toml: what its flags write, and what a later `up` on the same state
directory changes (and says it changed), refuses, or leaves to the operator. Pure."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.commands._upconfig import Shape, first, legacy_owned, render, update
from llmgw.config import parse_toml, server_config_from_dict
from llmgw.errors import UsageError

STATE = Path("/state")
FILE = STATE / "server.toml"
GGUF = Path("/models/tiny.gguf")


def names(doc: dict) -> list[str]:
    return [m["name"] for m in doc["models"]]


def test_a_plain_first_up_serves_sim_small_on_8080_without_llamacpp() -> None:
    planned = first(STATE, Shape(nodes=1))
    assert names(planned.doc) == ["sim-small"] and planned.owned == ("sim-small",) and planned.changes == ()
    config = server_config_from_dict(planned.doc)
    assert config.server.http_listen == "127.0.0.1:8080"
    assert not config.engines.llamacpp.enabled  # no node is asked for an engine nothing uses


def test_flags_of_a_first_up_shape_the_catalog() -> None:
    planned = first(STATE, Shape(nodes=3, port=9000, fabric="ib-a", gguf=GGUF, llama_server=True))
    assert names(planned.doc) == ["sim-small", "sim-big", "tiny"]
    config = server_config_from_dict(planned.doc)
    assert config.server.http_listen == "127.0.0.1:9000" and config.engines.llamacpp.enabled
    assert config.models[1].nodes_per_replica == 2 and config.models[2].source.path == str(GGUF)
    # The named llama-server on the local nodes: the control plane fetches no source, nothing is built.
    assert config.engines.llamacpp.version == "" and config.engines.llamacpp.build is None


def test_fabric_flags_after_a_plain_up_add_sim_big_and_a_plain_up_takes_it_away_again() -> None:
    plain = first(STATE, Shape(nodes=1))
    fabric = update(plain.doc, plain.owned, Shape(nodes=3, fabric="ib-a"), FILE)
    assert names(fabric.doc) == ["sim-small", "sim-big"] and "sim-big" in fabric.owned
    assert fabric.changes == ("added model sim-big: one replica across 2 nodes of fabric ib-a",)
    assert update(fabric.doc, fabric.owned, Shape(nodes=3, fabric="ib-a"), FILE).changes == ()  # the same again
    back = update(fabric.doc, fabric.owned, Shape(nodes=1), FILE)
    assert names(back.doc) == ["sim-small"] and back.owned == ("sim-small",)
    assert back.changes == (
        "removed model sim-big: its replica spans 2 nodes of a fabric, and this `up` starts 1 node without "
        "--fabric (`--nodes 2 --fabric NAME` brings it back)",
    )


def test_the_operators_edits_and_models_stay() -> None:
    plain = first(STATE, Shape(nodes=1))
    edited = dict(plain.doc, models=[dict(plain.doc["models"][0], replicas=3), {"name": "mine", "engine": "sim"}])
    edited["server"] = dict(edited["server"], http_listen="0.0.0.0:8181")
    again = update(edited, plain.owned, Shape(nodes=2, fabric="ib-a"), FILE)
    assert again.doc["models"][:2] == edited["models"] and names(again.doc)[2] == "sim-big"
    assert again.doc["server"]["http_listen"] == "0.0.0.0:8181"  # no --port: the saved one stays
    moved = update(again.doc, again.owned, Shape(nodes=2, fabric="ib-a", port=9000), FILE)
    assert moved.doc["server"]["http_listen"] == "0.0.0.0:9000"
    assert moved.changes == ("gateway port 8181 -> 9000 (--port)",)


def test_a_model_the_operator_removed_is_not_ours_to_add_back_or_to_remove() -> None:
    plain = first(STATE, Shape(nodes=1))
    emptied = dict(plain.doc, models=[{"name": "mine", "engine": "sim"}])
    again = update(emptied, plain.owned, Shape(nodes=1), FILE)
    assert names(again.doc) == ["mine"] and again.owned == () and again.changes == ()


def test_a_catalog_this_up_cannot_serve_is_refused_with_the_file_and_the_fix() -> None:
    plain = first(STATE, Shape(nodes=1))
    theirs = dict(
        plain.doc, models=[*plain.doc["models"], {"name": "sim-big", "engine": "sim", "nodes_per_replica": 2}]
    )
    with pytest.raises(UsageError) as info:
        update(theirs, plain.owned, Shape(nodes=1), FILE)  # the operator's sim-big: not removed, not servable
    assert str(info.value) == (
        "model 'sim-big' in /state/server.toml needs 2 nodes on one fabric, and this `up` starts 1 node without "
        "--fabric: add `--nodes 2 --fabric NAME`, or remove the model from /state/server.toml, or use another "
        "--state-dir"
    )


def test_a_gguf_model_follows_model_and_needs_a_llama_server() -> None:
    plain = first(STATE, Shape(nodes=1))
    with pytest.raises(UsageError) as info:
        update(plain.doc, plain.owned, Shape(nodes=1, gguf=GGUF), FILE)
    assert "runs on llama.cpp, and no llama-server is named: give --llama-server PATH" in str(info.value)
    served = update(plain.doc, plain.owned, Shape(nodes=1, gguf=GGUF, llama_server=True), FILE)
    assert served.changes == (
        "added model tiny: /models/tiny.gguf with llama.cpp (--model)",
        "llama.cpp wanted on the nodes again (a model uses it)",
    )
    moved = update(served.doc, served.owned, Shape(nodes=1, gguf=Path("/elsewhere/tiny.gguf"), llama_server=True), FILE)
    assert moved.changes == ("model tiny now serves /elsewhere/tiny.gguf (was /models/tiny.gguf)",)
    other = update(moved.doc, moved.owned, Shape(nodes=1, gguf=Path("/m/other.gguf"), llama_server=True), FILE)
    assert names(other.doc) == ["sim-small", "other"]
    dropped = update(other.doc, other.owned, Shape(nodes=1), FILE)
    assert names(dropped.doc) == ["sim-small"] and not server_config_from_dict(dropped.doc).engines.llamacpp.enabled
    assert dropped.changes == (
        "removed model other (/m/other.gguf): this `up` has no --model for it",
        "llama.cpp off: no model uses it",
    )


def test_a_gguf_named_like_a_model_of_the_operators_is_refused() -> None:
    plain = first(STATE, Shape(nodes=1))
    with pytest.raises(UsageError) as info:
        update(plain.doc, plain.owned, Shape(nodes=1, gguf=Path("/m/sim-small.gguf"), llama_server=True), FILE)
    assert "already has a model of that name (engine 'sim'); rename the file" in str(info.value)


def test_a_state_directory_from_before_up_json_knows_what_up_wrote() -> None:
    doc = first(STATE, Shape(nodes=2, fabric="ib-a", gguf=GGUF, llama_server=True)).doc
    doc["models"].append({"name": "mine", "engine": "sim"})
    assert legacy_owned(doc) == ("sim-small", "sim-big", "tiny")


def test_the_written_file_reads_back_as_the_same_config() -> None:
    planned = first(STATE, Shape(nodes=3, fabric="ib-a", gguf=GGUF, llama_server=True))
    text = render(planned.doc, "# written by a test\n")
    assert text.startswith("# written by a test\n[server]\n") and text.count("[[models]]") == 3
    assert parse_toml(text, "t") == planned.doc
