"""Rank 0 of a llama.cpp replica over RPC reads its model's layer count from the GGUF's header
(`agent.replica_rpc.model_layers`), to split the layers over the members: from a made model
whose vocabulary outgrows the first read, a split model's first part, and refusals that name the
file for what is not a whole GGUF header."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent import replica_rpc
from llmgw.sizing.errors import MalformedGguf, NotGguf
from testlib.makegguf import make_gguf


def test_the_layer_count_is_read_from_the_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_gguf(tmp_path / "m.gguf", n_layer=5, n_embd=64, n_vocab=2000)
    assert replica_rpc.model_layers(str(model)) == 5
    # A header longer than the first read: read again, larger.
    monkeypatch.setattr(replica_rpc, "HEADER_READ", 64)
    assert replica_rpc.model_layers(str(model)) == 5


def test_a_split_models_first_part_carries_the_count(tmp_path: Path) -> None:
    make_gguf(tmp_path / "s.gguf", n_layer=3, split_max_tensors=4)
    [first, *rest] = sorted(tmp_path.glob("s*.gguf"))
    assert rest, "the model was not split"
    assert replica_rpc.model_layers(str(first)) == 3


def test_what_is_no_whole_header_is_refused_naming_the_file(tmp_path: Path) -> None:
    model = make_gguf(tmp_path / "m.gguf", n_layer=2)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(model.read_bytes()[:1000])
    with pytest.raises(MalformedGguf, match=f"{cut} ends at byte 1000, inside its GGUF header"):
        replica_rpc.model_layers(str(cut))
    other = tmp_path / "weights.safetensors"
    other.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(NotGguf):
        replica_rpc.model_layers(str(other))
