"""Models staged to nodes ahead of their replicas: asked of the nodes lacking a file, listed in
their desired state, done once a node reports holding every file, forgotten with the model."""

from __future__ import annotations

from llmgw.config import Model, ModelFile, ModelSource
from llmgw.server.state.staging import Staging
from llmgw.wire import agent_link as w

A, B = "a" * 64, "b" * 64
MODEL = Model(
    name="m",
    engine="llamacpp",
    source=ModelSource(
        hf="o/r",
        commit="c" * 40,
        files=(ModelFile(path="m-1.gguf", size=1, sha256=A), ModelFile(path="m-2.gguf", size=1, sha256=B)),
    ),
)


def held(*digests: str, partial: tuple[str, ...] = ()) -> w.WeightsHeld:
    files = [w.HeldFile(sha256=d, size=1) for d in digests]
    files += [w.HeldFile(sha256=d, size=0, complete=False) for d in partial]
    return w.WeightsHeld(files=tuple(files), cache_bytes=len(files))


def test_a_model_is_staged_to_the_nodes_lacking_a_file_until_they_hold_all() -> None:
    staging = Staging()
    holds = {"n1": frozenset({A, B}), "n2": frozenset({A}), "n3": frozenset()}
    assert staging.add(MODEL, ["n1", "n2", "n3"], holds.__getitem__) == ["n2", "n3"]
    assert staging.models_for("n2") == ["m"] and staging.models_for("n1") == []
    assert staging.view() == {"m": ["n2", "n3"]}
    assert staging.reported("n2", held(A, partial=(B,))) is False  # a part under way is not held
    assert staging.reported("n2", held(A, B)) is True
    assert staging.models_for("n2") == [] and staging.view() == {"m": ["n3"]}
    assert staging.reported("n1", held(A, B)) is False  # nothing was staged there
    staging.forget("m")
    assert staging.view() == {} and staging.models_for("n3") == []


def test_a_url_model_counts_its_one_file() -> None:
    url = Model(name="u", engine="llamacpp", source=ModelSource(url="http://x/u.gguf", sha256=A.upper()))
    staging = Staging()
    assert staging.add(url, ["n1"], lambda node: frozenset()) == ["n1"]
    assert staging.reported("n1", held(A)) is True
