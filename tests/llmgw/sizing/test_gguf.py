"""GGUF headers read from prefixes: files gguf-py writes (every value type, v2 and v3, split
parts, per-layer arrays), prefixes cut anywhere (NeedMore, with a hint that is enough), and
hostile headers (huge counts and lengths) refused by name before anything is allocated."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as V
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.sizing.errors import GgufLimitExceeded, MalformedGguf, NeedMore, NotGguf, UnsupportedGguf
from llmgw.sizing.gguf import GGML_TYPES, ArrayInfo, GgufLimits, ggml_nbytes, parse_header
from llmgw.sizing.model import combine_parts, gguf_shape, split_info
from testlib.makegguf import make_gguf

EVERY_TYPE = {
    "t.u8": (200, V.UINT8),
    "t.i8": (-100, V.INT8),
    "t.u16": (60000, V.UINT16),
    "t.i16": (-30000, V.INT16),
    "t.u32": (4_000_000_000, V.UINT32),
    "t.i32": (-2_000_000_000, V.INT32),
    "t.f32": (0.5, V.FLOAT32),
    "t.bool": (True, V.BOOL),
    "t.str": ("héllo", V.STRING),
    "t.u64": (2**63 + 5, V.UINT64),
    "t.i64": (-(2**62), V.INT64),
    "t.f64": (1e300, V.FLOAT64),
}


def write(path: Path, extra: dict | None = None, tensors: int = 2, arrays: dict | None = None) -> bytes:
    w = gguf.GGUFWriter(str(path), "llama")
    for key, (value, vtype) in (extra or {}).items():
        w.add_key_value(key, value, vtype)
    for key, value in (arrays or {}).items():
        w.add_array(key, value)
    for i in range(tensors):
        w.add_tensor(f"t{i}", np.zeros((3, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def test_every_value_type_and_arrays(tmp_path: Path) -> None:
    arrays = {"a.ints": [1, 2, 3], "a.strs": ["x", "", "zz"], "a.floats": [0.25, 1.5], "a.nested": [[1, 2], [3]]}
    data = write(tmp_path / "m.gguf", EVERY_TYPE, arrays=arrays)
    h = parse_header(data)
    for key, (value, _) in EVERY_TYPE.items():
        assert h.metadata[key] == value, key
    assert h.metadata["a.ints"] == [1, 2, 3] and h.metadata["a.strs"] == ["x", "", "zz"]
    assert h.metadata["a.floats"] == [0.25, 1.5] and h.metadata["a.nested"] == [[1, 2], [3]]
    assert h.version == 3 and h.byteorder == "<" and h.alignment == 32
    assert [t.name for t in h.tensors] == ["t0", "t1"] and h.tensors[0].dims == (32, 3)
    assert h.tensors[0].nbytes == 3 * 32 * 4
    assert h.file_size == len(data) and h.data_offset % 32 == 0


def test_long_arrays_are_kept_as_their_length(tmp_path: Path) -> None:
    data = write(tmp_path / "m.gguf", arrays={"tok": [f"t{i}" for i in range(3000)], "n": list(range(2000))})
    h = parse_header(data)
    assert h.metadata["tok"] == ArrayInfo(item_type=V.STRING, length=3000)
    assert h.metadata["n"] == ArrayInfo(item_type=V.INT32, length=2000)


def test_version_2_and_big_endian(tmp_path: Path) -> None:
    data = write(tmp_path / "m.gguf")
    v2 = data[:4] + struct.pack("<I", 2) + data[8:]  # v2's layout is v3's
    assert parse_header(v2).version == 2
    w = gguf.GGUFWriter(str(tmp_path / "be.gguf"), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_uint32("llama.block_count", 7)
    w.add_tensor("t", np.zeros(64, dtype=np.float32).byteswap())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    h = parse_header((tmp_path / "be.gguf").read_bytes())
    assert h.byteorder == ">" and h.metadata["llama.block_count"] == 7 and h.tensors[0].dims == (64,)


def test_alignment_and_data_offset(tmp_path: Path) -> None:
    h = parse_header(write(tmp_path / "m.gguf", {"general.alignment": (64, V.UINT32)}))
    assert h.alignment == 64 and h.data_offset % 64 == 0 and h.data_offset >= h.header_bytes
    assert all(t.offset % 64 == 0 for t in h.tensors)


def test_a_model_shape_and_split_parts(tmp_path: Path) -> None:
    whole = make_gguf(tmp_path / "whole.gguf", n_layer=3, n_embd=64, n_head=4, n_head_kv=2, n_vocab=700)
    shape = gguf_shape([parse_header(whole.read_bytes())])
    assert (shape.block_count, shape.embedding_length, shape.head_count) == (3, 64, 4)
    assert shape.head_count_kv == (2, 2, 2) and shape.key_length == shape.value_length == 16
    assert shape.vocab_size == 700 and shape.context_length == 4096 and shape.swa_layers == ()
    make_gguf(tmp_path / "split.gguf", n_layer=3, n_embd=64, n_head=4, n_head_kv=2, n_vocab=700, split_max_tensors=10)
    parts = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(parts) > 1
    headers = [parse_header(p.read_bytes()) for p in parts]
    assert split_info(headers[1]).no == 1 and split_info(headers[0]).count == len(parts)
    assert gguf_shape(headers).weights_bytes == shape.weights_bytes
    with pytest.raises(Exception, match="numbered"):
        combine_parts(headers[:-1])


def test_per_layer_head_counts_and_sliding_windows(tmp_path: Path) -> None:
    extra = {
        "general.architecture": ("gemma3", V.STRING),
        "gemma3.block_count": (4, V.UINT32),
        "gemma3.context_length": (8192, V.UINT32),
        "gemma3.embedding_length": (128, V.UINT32),
        "gemma3.attention.head_count": (4, V.UINT32),
        "gemma3.attention.key_length": (256, V.UINT32),
        "gemma3.attention.sliding_window": (512, V.UINT32),
        "gemma3.vocab_size": (1000, V.UINT32),
    }
    path = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.kv_data[0].pop("general.architecture")
    for key, (value, vtype) in extra.items():
        w.add_key_value(key, value, vtype)
    w.add_array("gemma3.attention.head_count_kv", [1, 2, 0, 1])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.close()
    shape = gguf_shape([parse_header(path.read_bytes())])
    assert shape.head_count_kv == (1, 2, 0, 1) and shape.key_length == 256 and shape.value_length == 32
    assert shape.sliding_window == 512 and shape.swa_layers == (True, True, True, True)  # gemma3: 5 of 6


def test_ggml_sizes_of_every_type() -> None:
    for number, (name, block, size) in GGML_TYPES.items():
        assert ggml_nbytes(number, (block * 3, 2)) == size * 6, name
    assert ggml_nbytes(12, (4096, 4096)) == 4096 * 4096 // 256 * 144  # Q4_K
    with pytest.raises(MalformedGguf, match="blocks"):
        ggml_nbytes(8, (33,))
    with pytest.raises(UnsupportedGguf, match="ggml type 4"):
        ggml_nbytes(4, (32,))


def test_every_cut_asks_for_more_and_the_hint_is_enough(tmp_path: Path) -> None:
    data = write(tmp_path / "m.gguf", EVERY_TYPE, arrays={"s": ["ab"] * 5})
    end = parse_header(data).header_bytes
    for cut in range(end):
        with pytest.raises(NeedMore) as asked:
            parse_header(data[:cut])
        assert cut < asked.value.needed <= end, cut
    # Following the bare hints from nothing reaches the header exactly (one round a field: a
    # caller over HTTP asks for max(needed, 2 * have) and takes a few rounds).
    have, rounds = 0, 0
    while True:
        try:
            parse_header(data[:have])
            break
        except NeedMore as more:
            have, rounds = more.needed, rounds + 1
    assert have <= end and rounds <= end


def hostile(n_tensors: int = 0, n_kv: int = 1, body: bytes = b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + body


def key(name: bytes) -> bytes:
    return struct.pack("<Q", len(name)) + name


@pytest.mark.parametrize(
    "data, limit",
    [
        (hostile(n_tensors=2**62), "max_tensors"),
        (hostile(n_kv=2**40), "max_metadata"),
        (hostile(body=struct.pack("<Q", 2**60)), "max_string_bytes"),
        (hostile(body=key(b"k") + struct.pack("<IQ", 8, 2**50)), "max_string_bytes"),
        (hostile(body=key(b"k") + struct.pack("<IIQ", 9, 8, 2**40)), "max_array_len"),
        (hostile(body=key(b"k") + struct.pack("<IIQ", 9, 6, 2**24)), "max_header_bytes"),
        (hostile(body=key(b"k") + struct.pack("<IIQIQ", 9, 9, 1, 9, 1)), "max_array_depth"),
    ],
)
def test_hostile_counts_are_refused_by_name(data: bytes, limit: str) -> None:
    limits = GgufLimits(max_header_bytes=32 * 1024 * 1024, max_array_len=2**30)
    with pytest.raises(GgufLimitExceeded) as refused:
        parse_header(data, limits)
    assert refused.value.limit == limit and limit in str(refused.value)


def test_what_is_not_gguf() -> None:
    with pytest.raises(NotGguf, match="magic"):
        parse_header(b"PK\x03\x04" + bytes(40))
    with pytest.raises(UnsupportedGguf, match="version 1"):
        parse_header(b"GGUF" + struct.pack("<I", 1) + bytes(40))
    with pytest.raises(MalformedGguf, match="value type 13"):
        parse_header(hostile(body=key(b"k") + struct.pack("<I", 13)))
    with pytest.raises(MalformedGguf, match="UTF-8"):
        parse_header(hostile(body=key(b"\xff\xfe")))
    with pytest.raises(MalformedGguf, match="dimensions"):
        parse_header(hostile(n_tensors=1, n_kv=0, body=key(b"t") + struct.pack("<I", 9)))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_after_the_magic_end_in_a_header_or_a_named_refusal(tail: bytes) -> None:
    try:
        parse_header(b"GGUF" + struct.pack("<I", 3) + tail, GgufLimits(max_header_bytes=4096))
    except (NeedMore, GgufLimitExceeded, MalformedGguf, UnsupportedGguf):
        pass
