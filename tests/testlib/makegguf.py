"""Llama-architecture GGUF models of any shape that a real llama-server loads, made here.

tinygguf.py makes the one tiny model the tests talk to; this makes models whose memory is
measured (tools/bench/estimate.py, tests/llmgw/sizing): any number of layers, width, heads and
KV heads (GQA when fewer), feed-forward width and vocabulary size, with F32, F16 or Q8_0
matrices. The vocabulary is tinygguf's, padded with plain tokens up to `n_vocab`, so the
tokenizer still works. Weights are seeded: the same arguments make the same bytes.

With `cycle=True` the weights are crafted, not random, so that greedy decoding says `CYCLE`'s
words over and over, whatever the prompt: every matrix whose output is added to the residual
stream (attention's output, the feed-forward's down projection) is zero, so the last layer's
output is the current token's embedding; each word of the cycle has an axis of its own
(`token_embd`: a unit vector), every other token shares one more, and `output` maps the axis of
a word to the next word of the cycle (the shared axis to the first). The next token is a function
of the current one alone, with a margin of sqrt(n_embd) over every other token. The words are
whole tokens with the word-start mark (" of", " to", ...) that llama.cpp's tokenizer gives back,
token for token, when it tokenizes any run of them after any prompt: the text of a greedy answer
so far, appended to the prompt (a text completion's continuation) or as the assistant's prefill
(a chat's), ends on the token the answer ended on, and the answer goes on exactly as it would
have uninterrupted (tests/integration/test_migration_llama.py, tools/bench/chaos_llama.py).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType as Q

from testlib.tinygguf import add_tokenizer, vocabulary

DTYPES = ("F32", "F16", "Q8_0")
# Two-letter words: the tokenizer (tinygguf's pieces, longer ones scoring higher) merges the mark
# and two letters into the word's token whichever pair it merges first.
CYCLE = tuple(" " + w for w in "of to in is it he on as be at or by we up an if do so no my go".split())
FILE_TYPES = {"F32": 0, "F16": 1, "Q8_0": 7}  # llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_Q8_0


def make_gguf(
    path: Path,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int | None = None,
    n_ff: int | None = None,
    n_vocab: int = 600,
    context: int = 4096,
    dtype: str = "F32",
    seed: int = 0,
    split_max_tensors: int = 0,
    cycle: bool = False,
) -> Path:
    """Write the model to `path` (with `split_max_tensors`, as split parts named as
    llama.cpp's gguf-split names them, `path` being the first) and return `path`.

    Matrices are `dtype`; norms stay F32 as converters leave them. Q8_0 needs `n_embd` and
    `n_ff` to be multiples of 32 (its block). `cycle`: crafted weights whose greedy answer is
    `CYCLE` repeated (the module's docstring); `n_embd` must exceed the cycle's length."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    n_head_kv = n_head if n_head_kv is None else n_head_kv
    n_ff = 4 * n_embd if n_ff is None else n_ff
    head_dim = n_embd // n_head
    tokens, scores, types = vocabulary()
    if n_vocab < len(tokens):
        raise ValueError(f"n_vocab {n_vocab} is below the {len(tokens)} tokens the tokenizer needs")
    pad = n_vocab - len(tokens)
    tokens += [f"<pad_{i}>" for i in range(pad)]
    scores += [-1e4] * pad
    types += [int(gguf.TokenType.USER_DEFINED)] * pad
    rng = np.random.default_rng(seed)
    if cycle and n_embd <= len(CYCLE):
        raise ValueError(f"n_embd {n_embd}: a cycle of {len(CYCLE)} words needs at least {len(CYCLE) + 1}")

    writer = gguf.GGUFWriter(str(path), "llama", split_max_tensors=split_max_tensors)
    writer.add_name(f"llmgw-shaped-{n_layer}x{n_embd}")
    writer.add_context_length(context)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_vocab_size(n_vocab)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(FILE_TYPES[dtype])
    add_tokenizer(writer, tokens, scores, types)

    def matrix(name: str, rows: int, cols: int, data: np.ndarray | None = None) -> None:
        # numpy shapes are ggml's reversed: (rows, cols) is ggml's [cols, rows].
        random = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
        data = random if data is None else data.astype(np.float32)
        if dtype == "F32":
            writer.add_tensor(name, data)
        elif dtype == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, Q.Q8_0), raw_dtype=Q.Q8_0)

    def norm(name: str) -> None:
        writer.add_tensor(name, np.ones(n_embd, dtype=np.float32))

    embd = output = silent = silent_ff = None
    if cycle:
        embd, output = cycle_weights(tokens, n_embd)
        silent = np.zeros((n_embd, n_head * head_dim), dtype=np.float32)
        silent_ff = np.zeros((n_embd, n_ff), dtype=np.float32)
    matrix("token_embd.weight", n_vocab, n_embd, embd)
    for i in range(n_layer):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", n_head * head_dim, n_embd)
        matrix(f"blk.{i}.attn_k.weight", n_head_kv * head_dim, n_embd)
        matrix(f"blk.{i}.attn_v.weight", n_head_kv * head_dim, n_embd)
        matrix(f"blk.{i}.attn_output.weight", n_embd, n_head * head_dim, silent)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        matrix(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        matrix(f"blk.{i}.ffn_down.weight", n_embd, n_ff, silent_ff)
    norm("output_norm.weight")
    matrix("output.weight", n_vocab, n_embd, output)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def cycle_weights(tokens: list[str], n_embd: int) -> tuple[np.ndarray, np.ndarray]:
    """`token_embd` and `output` (numpy shapes (n_vocab, n_embd)) of the crafted model: word i of
    `CYCLE` on axis i, every other token on axis len(CYCLE); axis i scores word i + 1 (the last
    the first), the shared axis the first word."""
    ids = [tokens.index("\u2581" + w[1:]) for w in CYCLE]
    n = len(CYCLE)
    embd = np.zeros((len(tokens), n_embd), dtype=np.float32)
    embd[:, n] = 1.0
    output = np.zeros((len(tokens), n_embd), dtype=np.float32)
    for i, token in enumerate(ids):
        embd[token] = 0.0
        embd[token, i] = 1.0
        output[ids[(i + 1) % n], i] = 1.0
    output[ids[0], n] = 1.0
    return embd, output


def cycle_text(n: int, start: int = 0) -> str:
    """The crafted model's greedy answer of `n` tokens (from the cycle's word `start`)."""
    return "".join(CYCLE[(start + i) % len(CYCLE)] for i in range(n))
