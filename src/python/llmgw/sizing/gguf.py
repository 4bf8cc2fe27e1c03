"""A GGUF file's header, read from a prefix of its bytes, with no third-party package.

The control plane sizes a model before any node has it: it fetches the file's first bytes (an
HTTP Range request) and parses them here. `parse_header(prefix)` either returns the whole header
or raises `NeedMore` with how many bytes it needs at least; the caller fetches that many (or more)
and calls again. Parsing does no I/O and keeps no state between calls.

Layout (GGUF v2 and v3; v3 only adds big-endian files, which are read too): magic "GGUF",
u32 version, u64 tensor count, u64 metadata count; the metadata (key string, u32 value type,
value); the tensor infos (name, u32 n_dims, u64 dims, u32 ggml type, u64 offset); then the
tensor data at the next multiple of `general.alignment` (32 when absent). A string is a u64
length and UTF-8 bytes; an array is a u32 element type, a u64 count and the elements.

A hostile header must not make this allocate or loop without bound: every count and length is
checked against `GgufLimits` before it is acted on, and large arrays (a tokenizer's vocabulary)
are walked but kept only as their type and length.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping

import attrs

from llmgw.sizing.errors import GgufLimitExceeded, MalformedGguf, NeedMore, NotGguf, UnsupportedGguf

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

# GGUF value types: number -> (struct code, size) for the fixed-size ones.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
SCALARS = {
    UINT8: ("B", 1),
    INT8: ("b", 1),
    UINT16: ("H", 2),
    INT16: ("h", 2),
    UINT32: ("I", 4),
    INT32: ("i", 4),
    FLOAT32: ("f", 4),
    BOOL: ("?", 1),
    UINT64: ("Q", 8),
    INT64: ("q", 8),
    FLOAT64: ("d", 8),
}

# ggml types: number -> (name, elements per block, bytes per block), as ggml.c's type_traits
# in llama.cpp b11434 (ggml/include/ggml.h numbers them; removed numbers stay unknown).
GGML_TYPES: Mapping[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
    42: ("Q2_0", 64, 18),
}
GGML_TYPE_BY_NAME = {name: number for number, (name, _, _) in GGML_TYPES.items()}


def ggml_nbytes(ggml_type: int, dims: tuple[int, ...]) -> int:
    """Bytes of a tensor of `dims` (ggml order: dims[0] is the row) stored as `ggml_type`."""
    try:
        name, block, size = GGML_TYPES[ggml_type]
    except KeyError:
        raise UnsupportedGguf(f"ggml type {ggml_type} is not one llama.cpp b11434 knows") from None
    if dims and dims[0] % block:
        raise MalformedGguf(f"a {name} row of {dims[0]} elements is not a whole number of {block}-element blocks")
    return math.prod(dims) // block * size


@attrs.frozen(kw_only=True)
class GgufLimits:
    """Bounds on what a header may declare; past one, parsing stops with `GgufLimitExceeded`.

    The defaults are well above any published model's (a 256k-token vocabulary is a 256k array
    of short strings; the largest headers are a few tens of MB) and well below harm."""

    max_header_bytes: int = 128 * 1024 * 1024
    max_string_bytes: int = 16 * 1024 * 1024
    max_array_len: int = 16 * 1024 * 1024
    max_metadata: int = 1 << 16
    max_tensors: int = 1 << 20
    max_array_depth: int = 2
    keep_array_len: int = 1024  # longer arrays are kept as `ArrayInfo` only


@attrs.frozen(kw_only=True)
class ArrayInfo:
    """An array too long to keep (a tokenizer's tokens, scores, merges): its type and length."""

    item_type: int
    length: int


@attrs.frozen(kw_only=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int  # from the start of the data section
    nbytes: int


@attrs.frozen(kw_only=True)
class GgufHeader:
    """What a GGUF file's header says. `metadata` maps keys to ints, floats, bools, strings,
    lists (arrays up to `keep_array_len`) or `ArrayInfo` (longer arrays)."""

    version: int
    byteorder: str  # "<" or ">"
    metadata: Mapping[str, object]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    header_bytes: int  # where the tensor infos end
    data_offset: int  # where the tensor data starts: header_bytes rounded up to `alignment`

    @property
    def tensor_bytes(self) -> int:
        """The tensor data's size: each tensor's bytes, padded to the alignment as written."""
        return sum(-(-t.nbytes // self.alignment) * self.alignment for t in self.tensors)

    @property
    def file_size(self) -> int:
        """The size of the whole file, as its header implies (the last tensor's end)."""
        end = max((t.offset + t.nbytes for t in self.tensors), default=0)
        return self.data_offset + end


class _Reader:
    """A cursor over the prefix: every read past its end raises NeedMore with the bytes known
    needed, and never before checking a length against the limits."""

    def __init__(self, data: bytes, order: str, limits: GgufLimits) -> None:
        self.data = memoryview(data)
        self.pos = 0
        self.order = order
        self.limits = limits

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > self.limits.max_header_bytes:
            raise GgufLimitExceeded("max_header_bytes", end, self.limits.max_header_bytes, "the header's length")
        if end > len(self.data):
            raise NeedMore(end, len(self.data))
        out = self.data[self.pos : end]
        self.pos = end
        return out

    def scalar(self, value_type: int) -> object:
        code, size = SCALARS[value_type]
        return struct.unpack(self.order + code, self.take(size))[0]

    def u32(self) -> int:
        return struct.unpack(self.order + "I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack(self.order + "Q", self.take(8))[0]

    def string(self, where: str) -> str:
        n = self.u64()
        if n > self.limits.max_string_bytes:
            raise GgufLimitExceeded("max_string_bytes", n, self.limits.max_string_bytes, where)
        raw = self.take(n)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise MalformedGguf(f"{where}: a string that is not UTF-8 ({exc.reason} at byte {exc.start})") from None

    def skip_strings(self, count: int, where: str) -> None:
        # A vocabulary: walk it without decoding or keeping it.
        for _ in range(count):
            n = self.u64()
            if n > self.limits.max_string_bytes:
                raise GgufLimitExceeded("max_string_bytes", n, self.limits.max_string_bytes, where)
            self.take(n)

    def value(self, value_type: int, where: str, depth: int = 0) -> object:
        if value_type in SCALARS:
            return self.scalar(value_type)
        if value_type == STRING:
            return self.string(where)
        if value_type != ARRAY:
            raise MalformedGguf(f"{where}: value type {value_type} is not a GGUF type (0-12)")
        if depth >= self.limits.max_array_depth:
            raise GgufLimitExceeded("max_array_depth", depth + 1, self.limits.max_array_depth, where)
        item_type = self.u32()
        count = self.u64()
        if count > self.limits.max_array_len:
            raise GgufLimitExceeded("max_array_len", count, self.limits.max_array_len, where)
        if item_type in SCALARS:
            code, size = SCALARS[item_type]
            raw = self.take(size * count)  # one bounds check for the whole array
            if count > self.limits.keep_array_len:
                return ArrayInfo(item_type=item_type, length=count)
            return list(struct.unpack(f"{self.order}{count}{code}", raw))
        if item_type == STRING and count > self.limits.keep_array_len:
            self.skip_strings(count, where)
            return ArrayInfo(item_type=item_type, length=count)
        if item_type not in (STRING, ARRAY):
            raise MalformedGguf(f"{where}: array item type {item_type} is not a GGUF type (0-12)")
        keep = count <= self.limits.keep_array_len
        items = []
        for i in range(count):
            item = self.value(item_type, f"{where}[{i}]", depth + 1)
            if keep:
                items.append(item)
        return items if keep else ArrayInfo(item_type=item_type, length=count)


def _byteorder(prefix: bytes) -> tuple[str, int]:
    if len(prefix) < 8:
        raise NeedMore(24, len(prefix))  # magic, version and the two counts
    if prefix[:4] != MAGIC:
        raise NotGguf(f"the file starts with {bytes(prefix[:4])!r}, not GGUF's magic {MAGIC!r}: not a GGUF model")
    little, big = struct.unpack("<I", prefix[4:8])[0], struct.unpack(">I", prefix[4:8])[0]
    # A big-endian file's version reads as a huge number little-endian (v3 allows them).
    order, version = ("<", little) if little <= 0xFFFF else (">", big)
    if version == 1:
        raise UnsupportedGguf("GGUF version 1 (32-bit counts) is not read; convert the model again with today's tools")
    if version not in (2, 3):
        raise UnsupportedGguf(f"GGUF version {version} is not one this reads (2, 3)")
    return order, version


def parse_header(prefix: bytes, limits: GgufLimits | None = None) -> GgufHeader:
    """The header of the GGUF file whose first bytes are `prefix`.

    Raises NeedMore when the header goes on past the prefix (fetch `exc.needed` bytes or more
    and call again), NotGguf / UnsupportedGguf / MalformedGguf for a file that is no GGUF this
    reads, and GgufLimitExceeded when a count or length is over `limits`."""
    limits = limits or GgufLimits()
    order, version = _byteorder(prefix)
    r = _Reader(prefix, order, limits)
    r.take(8)
    n_tensors, n_kv = r.u64(), r.u64()
    if n_tensors > limits.max_tensors:
        raise GgufLimitExceeded("max_tensors", n_tensors, limits.max_tensors, "the tensor count")
    if n_kv > limits.max_metadata:
        raise GgufLimitExceeded("max_metadata", n_kv, limits.max_metadata, "the metadata count")
    metadata: dict[str, object] = {}
    for i in range(n_kv):
        key = r.string(f"metadata key {i}")
        metadata[key] = r.value(r.u32(), key)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise MalformedGguf(f"general.alignment is {alignment!r}, not a power of two")
    tensors = []
    for i in range(n_tensors):
        name = r.string(f"tensor {i}'s name")
        n_dims = r.u32()
        if not 1 <= n_dims <= MAX_DIMS:
            raise MalformedGguf(f"tensor {name!r} has {n_dims} dimensions; ggml allows 1 to {MAX_DIMS}")
        dims = tuple(r.u64() for _ in range(n_dims))
        ggml_type, offset = r.u32(), r.u64()
        if offset % alignment:
            raise MalformedGguf(f"tensor {name!r} starts at {offset}, not a multiple of the alignment {alignment}")
        nbytes = ggml_nbytes(ggml_type, dims)
        tensors.append(TensorInfo(name=name, dims=dims, ggml_type=ggml_type, offset=offset, nbytes=nbytes))
    header_bytes = r.pos
    return GgufHeader(
        version=version,
        byteorder=order,
        metadata=metadata,
        tensors=tuple(tensors),
        alignment=alignment,
        header_bytes=header_bytes,
        data_offset=-(-header_bytes // alignment) * alignment,
    )
