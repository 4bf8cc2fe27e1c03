"""The tiny GGUF model the llama.cpp tests make: reproducible, and what llama.cpp needs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf

from testlib import tinygguf


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_byte_identical_for_a_seed(tmp_path: Path) -> None:
    a = tinygguf.write_tiny_llama(tmp_path / "a.gguf", seed=3)
    b = tinygguf.write_tiny_llama(tmp_path / "b.gguf", seed=3)
    c = tinygguf.write_tiny_llama(tmp_path / "c.gguf", seed=4)
    assert digest(a) == digest(b) != digest(c)
    assert a.stat().st_size < 1_000_000


def test_what_llama_cpp_looks_up(tmp_path: Path) -> None:
    reader = gguf.GGUFReader(tinygguf.write_tiny_llama(tmp_path / "m.gguf"))
    tokens, _, types = tinygguf.vocabulary()
    assert 550 <= len(tokens) <= 650
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert "<0x0A>" in tokens  # llama.cpp's newline
    assert types.count(int(gguf.TokenType.BYTE)) == 256
    assert len(set(tokens)) == len(tokens)
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "output.weight", "blk.1.ffn_down.weight"} <= names
    assert len(names) == 3 + 9 * tinygguf.N_LAYER
    assert "tokenizer.chat_template" in reader.fields
