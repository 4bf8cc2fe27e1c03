"""A tiny llama-architecture GGUF model that a real llama-server loads, made here: no downloads.

Two layers, 64-wide embeddings, 4 heads, a ~600-token SentencePiece-style vocabulary (the
specials, the 256 byte tokens llama.cpp falls back to, and short words with and without the
word-start mark), a ChatML chat template, and seeded random F32 weights. It says nothing
sensible, quickly: enough to exercise loading, the HTTP API, streaming and throughput.

The file is byte-identical for a given seed, so a test failure reproduces exactly.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

N_LAYER = 2
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 4
N_FF = 256
CONTEXT = 4096

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this from or "
    "had by word but what some we can out other were all there when up use your how said an each "
    "she which do their time if will way about many then them write would like so these her long "
    "make thing see him two has look more day could go come did number sound no most people my over "
    "know water than call first who may down side been now find any new work part take get place "
    "made live where after back little only round man year came show every good hello model token "
    "llama server"
).split()


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types, in id order: <unk>=0, <s>=1, </s>=2."""
    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    # llama.cpp's SPM tokenizer falls back to these for any byte, and looks up "\n" as <0x0A>.
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    pieces = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += ["\u2581" + chr(c) for c in range(ord("a"), ord("z") + 1)]
    for word in dict.fromkeys(WORDS):
        pieces += [word, "\u2581" + word]
    pieces = list(dict.fromkeys(p for p in pieces if p not in tokens))
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    # Longer pieces score higher, so the tokenizer prefers whole words to letters.
    scores = [0.0] * (len(tokens) - len(pieces)) + [float(len(p)) - i * 1e-4 for i, p in enumerate(pieces)]
    return tokens, scores, [int(t) for t in types]


def write_tiny_llama(
    path: Path,
    *,
    seed: int = 0,
    n_layer: int = N_LAYER,
    n_embd: int = N_EMBD,
    n_head: int = N_HEAD,
    n_ff: int = N_FF,
    context: int = CONTEXT,
    name: str = "llmgw-tiny-llama",
) -> Path:
    """The model, at the sizes given (the defaults: the tiny one the tests load; a wider and
    deeper one makes prefill measurable on a CPU, as tools/bench/prefix.py needs)."""
    tokens, scores, types = vocabulary()
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_context_length(context)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_vocab_size(n_vocab)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(0)  # all F32
    add_tokenizer(writer, tokens, scores, types)

    # numpy shapes are ggml's reversed: token_embd is (n_vocab, n_embd).
    writer.add_tensor("token_embd.weight", weight(n_vocab, n_embd))
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones(n_embd))
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(n_head * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(n_head * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones(n_embd))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(n_embd, n_ff))
    writer.add_tensor("output_norm.weight", ones(n_embd))
    writer.add_tensor("output.weight", weight(n_vocab, n_embd))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_tokenizer(writer: gguf.GGUFWriter, tokens: list, scores: list, types: list) -> None:
    """The tokenizer's metadata of every llama GGUF the tests make (`vocabulary`'s, ChatML)."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    # No space before the text, as the BPE vocabularies of today's models: llama.cpp (b11434)
    # primes a JSON-schema grammar with the chat template's generation prompt, tokenized; with a
    # space prefix "assistant" comes back as " assistant", the grammar refuses it, and every
    # chat request with response_format fails ("Failed to initialize samplers").
    writer.add_add_space_prefix(False)
    writer.add_chat_template(CHATML)
