"""The estimate's formulas against numbers worked by hand, llama-server's defaults and flags, and
config.json variants for vLLM (no head_dim, GQA, each dtype, tensor parallel)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.sizing.errors import MissingMetadata
from llmgw.sizing.estimate import (
    LLAMA_OVERHEAD,
    VLLM_CUDA_CONTEXT,
    VLLM_CUDA_GRAPHS,
    LlamaSettings,
    estimate_gguf,
    estimate_safetensors,
    llama_compute_bytes,
    llama_kv_bytes,
    llama_member_bytes,
)
from llmgw.sizing.gguf import parse_header
from llmgw.sizing.model import ModelShape
from testlib.makegguf import make_gguf

MiB = 1024 * 1024
# Llama-2-7B's shape.
LLAMA7B = ModelShape(
    architecture="llama",
    block_count=32,
    context_length=4096,
    embedding_length=4096,
    head_count=32,
    head_count_kv=(32,) * 32,
    key_length=128,
    value_length=128,
    vocab_size=32000,
    feed_forward_length=11008,
    weights_bytes=13_476_839_424,
)


def test_kv_cache_by_hand() -> None:
    # 32 layers x 4096 cells x (4096 K + 4096 V) x 2 bytes (f16) = 2 GiB.
    assert llama_kv_bytes(LLAMA7B, LlamaSettings()) == 32 * 4096 * 8192 * 2 == 2 * 1024 * MiB
    # q8_0: 34 bytes a 32 values.
    q8 = LlamaSettings(cache_type_k="q8_0", cache_type_v="q8_0")
    assert llama_kv_bytes(LLAMA7B, q8) == 32 * 4096 * 2 * (4096 // 32 * 34)
    # A context not a multiple of 256 is padded; split slots share it (per slot padded too).
    assert llama_kv_bytes(LLAMA7B, LlamaSettings(context=1000)) == 32 * 1024 * 8192 * 2
    assert llama_kv_bytes(LLAMA7B, LlamaSettings(context=3000, parallel=2)) == 2 * 32 * 1536 * 8192 * 2
    gqa = attrs.evolve(LLAMA7B, head_count_kv=(8,) * 32)
    assert llama_kv_bytes(gqa, LlamaSettings()) == 512 * MiB


def test_sliding_window_layers_hold_the_window() -> None:
    swa = attrs.evolve(LLAMA7B, sliding_window=1024, swa_layers=(True, False) * 16)
    # unified, 4 slots: pad(1024 x 4 + 512) = 4608 > 4096 cells, so the whole context...
    assert llama_kv_bytes(swa, LlamaSettings()) == llama_kv_bytes(LLAMA7B, LlamaSettings())
    # ...and at 32k: 16 full layers of 32768 cells, 16 of 4608.
    big = LlamaSettings(context=32768)
    assert llama_kv_bytes(swa, big) == 16 * (32768 + 4608) * 8192 * 2
    assert llama_kv_bytes(swa, LlamaSettings(context=32768, swa_full=True)) == 32 * 32768 * 8192 * 2


def test_compute_buffer_by_hand() -> None:
    mask = 4096 * 512 * 2
    activations = 512 * 4 * (5 * 4096 + 3 * 11008)
    assert llama_compute_bytes(LLAMA7B, LlamaSettings()) == mask + activations
    scores = 4096 * 512 * 32 * 4
    assert llama_compute_bytes(LLAMA7B, LlamaSettings(flash_attn=False)) == mask + activations + scores
    # A context under the ubatch: a ubatch of the context's tokens.
    assert llama_compute_bytes(LLAMA7B, LlamaSettings(context=256)) == 256 * 256 * 2 + 256 * 4 * 53504


def test_settings_from_a_command_line() -> None:
    s = LlamaSettings.from_args(["-np", "2", "--ctx-size=8192", "-ctk", "q8_0", "-fa", "off", "--swa-full"])
    assert (s.parallel, s.context, s.cache_type_k, s.flash_attn, s.swa_full) == (2, 8192, "q8_0", False, True)
    assert LlamaSettings.from_args([], context=2048).context == 2048
    assert LlamaSettings.from_args(["-c", "0", "-np", "-1"]) == LlamaSettings()
    assert LlamaSettings.from_args(["-np", "3", "-kvu"]).kv_unified is True


def test_a_made_model_with_llama_servers_defaults(tmp_path: Path) -> None:
    path = make_gguf(tmp_path / "m.gguf", n_layer=2, n_embd=64, n_head=4, n_vocab=600, context=2048)
    e = estimate_gguf(parse_header(path.read_bytes()))
    assert (e.context, e.parallel) == (2048, 4)  # the trained context; -np auto: 4 slots, unified
    assert e.kv_cache == 2 * 2048 * 128 * 2 and e.output == 600 * 4 * 4 and e.overhead == LLAMA_OVERHEAD
    assert e.weights == parse_header(path.read_bytes()).tensor_bytes
    assert e.total == e.weights + e.kv_cache + e.compute + e.output + e.overhead == e.per_gpu
    two = estimate_gguf(parse_header(path.read_bytes()), gpus=2)
    assert two.per_gpu == (two.weights + two.kv_cache) // 2 + two.compute + two.overhead


def test_a_llamacpp_replica_over_several_nodes_shares_its_layers_and_their_cache(tmp_path: Path) -> None:
    path = make_gguf(tmp_path / "m.gguf", n_layer=8, n_embd=64, n_head=4, n_vocab=600, context=2048)
    header = parse_header(path.read_bytes())
    e = estimate_gguf(header)
    assert e.layers == 8
    outside = sum(t.nbytes for t in header.tensors if not t.name.startswith("blk."))  # embeddings, output, norm
    assert e.layer_bytes == e.weights - outside > 0
    assert llama_member_bytes(e, 1) == e.total
    own = e.compute + e.output + e.overhead  # each member's buffers and process, not shared
    # Every member holds its layers (rank 0 on its own CPU) with their cache, and at most the tensors
    # outside the layers (rank 0 the embeddings, the last helper the output layer).
    assert llama_member_bytes(e, 2) == (e.layer_bytes + e.kv_cache) // 2 + outside + own
    # 8 layers over 3: at most 3 on one member.
    assert llama_member_bytes(e, 3) == -(-(e.layer_bytes + e.kv_cache) * 3 // 8) + outside + own
    # Two members hold the whole between them, not one (the split pools memory); the members
    # together are not an undercount.
    assert llama_member_bytes(e, 2) < e.total <= 2 * llama_member_bytes(e, 2)
    assert e.total <= 3 * llama_member_bytes(e, 3)
    # Without the layer count, an even share of weights and cache.
    unknown = attrs.evolve(e, layers=0, layer_bytes=0)
    assert llama_member_bytes(unknown, 2) == -(-(e.weights + e.kv_cache) // 2) + own


def test_unknown_kv_cache_type_is_named(tmp_path: Path) -> None:
    path = make_gguf(tmp_path / "m.gguf")
    with pytest.raises(MissingMetadata, match="q3_k"):
        estimate_gguf(parse_header(path.read_bytes()), LlamaSettings(cache_type_k="q3_k"))


LLAMA3_8B = {
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


def test_vllm_kv_from_config_variants() -> None:
    e = estimate_safetensors(LLAMA3_8B, 16_060_522_496)
    assert e.kv_cache == 2 * 32 * 8192 * 8 * 128 * 2 == 1024 * MiB  # head_dim from hidden/heads
    assert e.overhead == VLLM_CUDA_CONTEXT + VLLM_CUDA_GRAPHS
    assert e.per_gpu == e.total
    f32 = estimate_safetensors({**LLAMA3_8B, "torch_dtype": "float32", "head_dim": 64}, 1, context=1000)
    assert f32.kv_cache == 2 * 32 * 1000 * 8 * 64 * 4 and f32.context == 1000
    mha = estimate_safetensors({k: v for k, v in LLAMA3_8B.items() if k != "num_key_value_heads"}, 1)
    assert mha.kv_cache == 4 * e.kv_cache
    f16 = estimate_safetensors({**LLAMA3_8B, "torch_dtype": "float16"}, 1, kv_cache_dtype="fp8")
    assert f16.kv_cache == e.kv_cache // 2
    nested = estimate_safetensors({"architectures": ["X"], "text_config": LLAMA3_8B}, 1)
    assert nested.kv_cache == e.kv_cache


def test_vllm_tensor_parallel_splits_weights_and_kv_heads() -> None:
    one = estimate_safetensors(LLAMA3_8B, 16_000_000_000)
    four = estimate_safetensors(LLAMA3_8B, 16_000_000_000, gpus=4)
    assert four.kv_cache == one.kv_cache and four.weights == one.weights
    assert four.per_gpu < one.per_gpu and four.per_gpu > 4_000_000_000 + one.kv_cache // 4
    sixteen = estimate_safetensors(LLAMA3_8B, 16_000_000_000, gpus=16)  # 8 KV heads: one each, replicated
    assert sixteen.kv_cache == 16 * (2 * 32 * 8192 * 1 * 128 * 2)


def test_vllm_config_without_what_sizing_needs() -> None:
    with pytest.raises(MissingMetadata, match="num_hidden_layers"):
        estimate_safetensors({"hidden_size": 8}, 1)
    with pytest.raises(MissingMetadata, match="max_position_embeddings"):
        estimate_safetensors({k: v for k, v in LLAMA3_8B.items() if k != "max_position_embeddings"}, 1)
    with pytest.raises(MissingMetadata, match="int8"):
        estimate_safetensors({**LLAMA3_8B, "torch_dtype": "int8"}, 1)


@given(
    layers=st.integers(1, 128),
    kv_heads=st.integers(1, 64),
    head_dim=st.sampled_from([64, 80, 128, 256]),
    context=st.integers(1, 1 << 20),
    slots=st.integers(1, 64),
)
def test_kv_grows_with_context_and_never_undercounts_the_tokens(
    layers: int, kv_heads: int, head_dim: int, context: int, slots: int
) -> None:
    shape = attrs.evolve(
        LLAMA7B,
        block_count=layers,
        head_count=kv_heads,
        head_count_kv=(kv_heads,) * layers,
        key_length=head_dim,
        value_length=head_dim,
    )
    s = LlamaSettings(context=context, parallel=slots)
    kv = llama_kv_bytes(shape, s)
    assert kv >= layers * context * 2 * kv_heads * head_dim * 2  # every token of every slot has its cells
    assert kv <= layers * (context + 256 * (slots + 1)) * 2 * kv_heads * head_dim * 2  # padding only
    assert llama_kv_bytes(shape, LlamaSettings(context=context + 256, parallel=slots)) >= kv
