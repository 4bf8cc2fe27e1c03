"""The made model the agent measures llama.cpp with (agent.bench): a small llama-architecture
GGUF written here, with no third-party package and no download.

Four layers 256 wide (4 heads of 64), a feed-forward of 768, a vocabulary of 4,096 (llama.cpp's
SPM tokenizer: the specials, the 256 byte tokens it falls back to, the letters with and without
the word-start mark, then plain filler tokens the prompt never produces), every matrix Q8_0 as
many quantized models are, the norms F32. About 6 MB, so that writing it costs nothing and
llama-server loads it in well under a second; big enough that a token is real matrix work for
the backend, not only llama-server's overhead. What it says is noise: only its speed is read.

The weights come from SHAKE-256 of the tensor's name (each Q8_0 block: a fixed scale and 32
bytes of the hash as its int8 values, a spread like 0.02 × a normal's), so the file is the same
bytes on every node and every run: a speed measured on two nodes is of the same model.

Layout written (GGUF v3, little-endian; `llmgw.sizing.gguf` reads the same): magic, version,
tensor count, metadata count; the metadata (key, u32 type, value); the tensor infos (name, u32
dims, u64 each dim (ggml's order: the row length first), u32 ggml type, u64 offset in the data);
the data, each tensor at a multiple of 32 bytes.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

N_LAYER = 4
N_EMBD = 256
N_HEAD = 4
N_FF = 768
N_VOCAB = 4096
CONTEXT = 2048
NAME = "llmgw-bench"
# A new shape or layout is a new name: a node never measures with a file of another shape.
FILE_NAME = f"{NAME}-v1-{N_LAYER}x{N_EMBD}-q8_0.gguf"

ALIGNMENT = 32
GGUF_VERSION = 3
F32, Q8_0 = 0, 8  # ggml types
Q8_0_BLOCK, Q8_0_BYTES = 32, 34  # elements per block; bytes per block (f16 scale + 32 int8)
FILE_TYPE_Q8_0 = 7  # llama_ftype: MOSTLY_Q8_0
# int8 uniform over [-128, 127] has a deviation of about 74: this scale makes the weights' 0.02.
SCALE = struct.pack("<e", 0.02 / 74)
# GGUF value types.
T_U32, T_I32, T_F32, T_BOOL, T_STRING, T_ARRAY = 4, 5, 6, 7, 8, 9
# llama.cpp's token types.
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types in id order: <unk>=0, <s>=1, </s>=2."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [UNKNOWN, CONTROL, CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces = ["\u2581", *letters, *("\u2581" + c for c in letters)]
    filler = [f"<w{i:04d}>" for i in range(N_VOCAB - len(tokens) - len(pieces))]
    tokens += pieces + filler
    types += [NORMAL] * (len(pieces) + len(filler))
    scores = [0.0] * 259 + [1.0] * len(pieces) + [-1.0] * len(filler)
    return tokens, scores, types


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, kind: int, value: object) -> bytes:
    out = _string(key) + struct.pack("<I", kind)
    if kind == T_STRING:
        return out + _string(str(value))
    if kind == T_ARRAY:
        element, items = value  # type: ignore[misc]
        out += struct.pack("<IQ", element, len(items))
        if element == T_STRING:
            return out + b"".join(_string(s) for s in items)
        code = {T_F32: "f", T_I32: "i", T_U32: "I"}[element]
        return out + struct.pack(f"<{len(items)}{code}", *items)
    code = {T_U32: "<I", T_I32: "<i", T_F32: "<f", T_BOOL: "<?"}[kind]
    return out + struct.pack(code, value)


def metadata() -> list[bytes]:
    tokens, scores, types = vocabulary()
    arch = "llama"
    return [
        _kv("general.architecture", T_STRING, arch),
        _kv("general.name", T_STRING, NAME),
        _kv("general.alignment", T_U32, ALIGNMENT),
        _kv("general.file_type", T_U32, FILE_TYPE_Q8_0),
        _kv(f"{arch}.context_length", T_U32, CONTEXT),
        _kv(f"{arch}.embedding_length", T_U32, N_EMBD),
        _kv(f"{arch}.block_count", T_U32, N_LAYER),
        _kv(f"{arch}.feed_forward_length", T_U32, N_FF),
        _kv(f"{arch}.vocab_size", T_U32, N_VOCAB),
        _kv(f"{arch}.attention.head_count", T_U32, N_HEAD),
        _kv(f"{arch}.attention.head_count_kv", T_U32, N_HEAD),
        _kv(f"{arch}.attention.layer_norm_rms_epsilon", T_F32, 1e-5),
        _kv(f"{arch}.rope.dimension_count", T_U32, N_EMBD // N_HEAD),
        _kv(f"{arch}.rope.freq_base", T_F32, 10000.0),
        _kv("tokenizer.ggml.model", T_STRING, "llama"),
        _kv("tokenizer.ggml.tokens", T_ARRAY, (T_STRING, tokens)),
        _kv("tokenizer.ggml.scores", T_ARRAY, (T_F32, scores)),
        _kv("tokenizer.ggml.token_type", T_ARRAY, (T_I32, types)),
        _kv("tokenizer.ggml.unknown_token_id", T_U32, 0),
        _kv("tokenizer.ggml.bos_token_id", T_U32, 1),
        _kv("tokenizer.ggml.eos_token_id", T_U32, 2),
        _kv("tokenizer.ggml.add_bos_token", T_BOOL, True),
        _kv("tokenizer.ggml.add_eos_token", T_BOOL, False),
        _kv("tokenizer.ggml.add_space_prefix", T_BOOL, False),
    ]


def tensors() -> list[tuple[str, tuple[int, ...], int]]:
    """(name, dims in ggml's order: the row length first, ggml type) of every tensor."""
    out: list[tuple[str, tuple[int, ...], int]] = [("token_embd.weight", (N_EMBD, N_VOCAB), Q8_0)]
    for i in range(N_LAYER):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (N_EMBD,), F32),
            (b + "attn_q.weight", (N_EMBD, N_EMBD), Q8_0),
            (b + "attn_k.weight", (N_EMBD, N_EMBD), Q8_0),
            (b + "attn_v.weight", (N_EMBD, N_EMBD), Q8_0),
            (b + "attn_output.weight", (N_EMBD, N_EMBD), Q8_0),
            (b + "ffn_norm.weight", (N_EMBD,), F32),
            (b + "ffn_gate.weight", (N_EMBD, N_FF), Q8_0),
            (b + "ffn_up.weight", (N_EMBD, N_FF), Q8_0),
            (b + "ffn_down.weight", (N_FF, N_EMBD), Q8_0),
        ]
    out += [("output_norm.weight", (N_EMBD,), F32), ("output.weight", (N_EMBD, N_VOCAB), Q8_0)]
    return out


def _data(name: str, dims: tuple[int, ...], kind: int) -> bytes:
    elements = 1
    for d in dims:
        elements *= d
    if kind == F32:  # the norms: ones
        return struct.pack("<f", 1.0) * elements
    blocks = elements // Q8_0_BLOCK
    data = bytearray(hashlib.shake_256(f"{NAME}/{name}".encode()).digest(blocks * Q8_0_BYTES))
    # Each block's first two bytes are its f16 scale, the same for every block.
    data[0::Q8_0_BYTES] = SCALE[:1] * blocks
    data[1::Q8_0_BYTES] = SCALE[1:] * blocks
    return bytes(data)


def _pad(n: int) -> int:
    return -n % ALIGNMENT


def model_bytes() -> bytes:
    """The whole file: the same bytes every time."""
    infos, chunks, offset = [], [], 0
    for name, dims, kind in tensors():
        data = _data(name, dims, kind)
        infos.append(_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, kind, offset))
        chunks.append(data + b"\0" * _pad(len(data)))
        offset += len(chunks[-1])
    kvs = metadata()
    head = b"GGUF" + struct.pack("<IQQ", GGUF_VERSION, len(infos), len(kvs)) + b"".join(kvs) + b"".join(infos)
    return head + b"\0" * _pad(len(head)) + b"".join(chunks)


def ensure(directory: Path) -> Path:
    """The model's file in `directory`, written there if it is not (blocking: run it in a thread).
    Written beside and renamed, so that a file of that name is always whole."""
    path = directory / FILE_NAME
    if path.is_file():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f".{FILE_NAME}.{os.getpid()}"
    partial.write_bytes(model_bytes())
    os.replace(partial, path)
    return path
