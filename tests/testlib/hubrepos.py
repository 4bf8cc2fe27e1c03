"""Test repositories laid out as real ones on the Hugging Face Hub, for testlib.hubserver.

`gguf_repo`: quantisations side by side (`Model-Q4_K_M.gguf`, `Model-Q8_0.gguf`) and one split
into parts named as llama.cpp's gguf-split names them (`Model-Q6_K-00001-of-00002.gguf`), with
README.md and .gitattributes. The files are testlib.tinygguf's tiny llama (F32 whatever the name
says): each one loads in a real llama-server, the split one through its first part.

`safetensors_repo`: what vLLM reads: config.json (a small llama), two safetensors shards and their
index, tokenizer.json (byte-level BPE), tokenizer_config.json, generation_config.json. The
safetensors are written here in the format's own layout (an 8-byte little-endian header length,
a JSON header of dtype/shape/data_offsets padded to 8 bytes, then the data), seeded, so the bytes
are the same in every run.
"""

from __future__ import annotations

import functools
import json
import math
import struct
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import gguf
import numpy as np

from llmgw.wire import agent_link as w
from testlib.hubrepo import HubRepo
from testlib.tinygguf import CHATML, write_tiny_llama

if TYPE_CHECKING:
    from testlib.hubserver import HubServer

GITATTRIBUTES = b"".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n".encode()
    for pattern in ("*.bin", "*.gguf", "*.h5", "*.model", "*.msgpack", "*.onnx", "*.pt", "*.pth", "*.safetensors")
)


@functools.cache
def tiny_gguf(seed: int = 0) -> bytes:
    """testlib.tinygguf's model, as bytes (made once per seed and process)."""
    with tempfile.TemporaryDirectory() as tmp:
        return write_tiny_llama(Path(tmp) / "m.gguf", seed=seed).read_bytes()


@functools.cache
def split_gguf(seed: int = 0, parts: int = 2) -> tuple[bytes, ...]:
    """The tiny model split into `parts` as gguf-split splits one: the first part holds the
    metadata, every part `split.no`/`split.count`/`split.tensors.count` and its share of tensors."""
    with tempfile.TemporaryDirectory() as tmp:
        reader = gguf.GGUFReader(write_tiny_llama(Path(tmp) / "whole.gguf", seed=seed))
        arch = reader.fields["general.architecture"].contents()
        writer = gguf.GGUFWriter(Path(tmp) / "m.gguf", arch, split_max_tensors=math.ceil(len(reader.tensors) / parts))
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue  # the writer writes these itself
            vtype = field.types[0]
            sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), vtype, sub_type=sub_type)
        for tensor in reader.tensors:
            writer.add_tensor(tensor.name, np.array(tensor.data))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        shards = sorted(Path(tmp).glob("m-*-of-*.gguf"))
        if len(shards) != parts:
            raise AssertionError(f"gguf split made {[s.name for s in shards]}, not {parts} parts")
        return tuple(shard.read_bytes() for shard in shards)


def gguf_files(
    model: str = "Tiny-Llama",
    *,
    quants: tuple[str, ...] = ("Q4_K_M", "Q8_0"),
    split_quant: str | None = "Q6_K",
    parts: int = 2,
) -> dict[str, bytes]:
    """The files of a GGUF repo: one `{model}-{quant}.gguf` per quant (seeds 0, 1, ...: the
    Q4_K_M of the defaults is seed 0, testlib.tinygguf's own model), `split_quant` in `parts`."""
    files = {
        ".gitattributes": GITATTRIBUTES,
        "README.md": (
            f"---\nlicense: apache-2.0\ntags:\n- gguf\nbase_model: llmgw-tests/{model}\n---\n\n"
            f"# {model} GGUF\n\nQuantisations: {', '.join((*quants, *([split_quant] if split_quant else [])))}.\n"
        ).encode(),
    }
    for seed, quant in enumerate(quants):
        files[f"{model}-{quant}.gguf"] = tiny_gguf(seed)
    if split_quant:
        for i, part in enumerate(split_gguf(len(quants), parts), start=1):
            files[f"{model}-{split_quant}-{i:05d}-of-{parts:05d}.gguf"] = part
    return files


def gguf_repo(repo_id: str = "llmgw-tests/Tiny-Llama-GGUF", *, model: str = "Tiny-Llama", **repo: object) -> HubRepo:
    """A GGUF repo of `gguf_files(model)`; `repo` goes to HubRepo (gated, token, ...)."""
    return HubRepo(repo_id, gguf_files(model), library_name="gguf", tags=["gguf", "llama"], **repo)  # type: ignore[arg-type]


# -- safetensors

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "vocab_size": 320,  # the tokenizer's 259, padded to a multiple of 64 as many models are
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 256,
    "eos_token_id": 257,
    "transformers_version": "4.44.0",
}


def safetensors_bytes(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """A .safetensors file of `tensors` (float32 arrays are stored as F32, uint16 as the BF16
    bits they hold)."""
    dtypes = {np.dtype(np.float32): "F32", np.dtype(np.uint16): "BF16"}
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    data, offset = [], 0
    for name, array in tensors.items():
        raw = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()
        header[name] = {
            "dtype": dtypes[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        data.append(raw)
        offset += len(raw)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
    return struct.pack("<Q", len(encoded)) + encoded + b"".join(data)


def llama_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """A llama's weights by their transformers names, BF16 bits of seeded random values."""
    rng = np.random.default_rng(seed)
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def bf16(*shape: int, ones: bool = False) -> np.ndarray:
        values = np.ones(shape, np.float32) if ones else (rng.standard_normal(shape) * 0.02).astype(np.float32)
        return (values.view(np.uint32) >> 16).astype(np.uint16)

    tensors = {"model.embed_tokens.weight": bf16(vocab, h)}
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        tensors |= {
            f"{layer}.input_layernorm.weight": bf16(h, ones=True),
            f"{layer}.self_attn.q_proj.weight": bf16(q, h),
            f"{layer}.self_attn.k_proj.weight": bf16(kv, h),
            f"{layer}.self_attn.v_proj.weight": bf16(kv, h),
            f"{layer}.self_attn.o_proj.weight": bf16(h, q),
            f"{layer}.post_attention_layernorm.weight": bf16(h, ones=True),
            f"{layer}.mlp.gate_proj.weight": bf16(inter, h),
            f"{layer}.mlp.up_proj.weight": bf16(inter, h),
            f"{layer}.mlp.down_proj.weight": bf16(h, inter),
        }
    tensors |= {"model.norm.weight": bf16(h, ones=True), "lm_head.weight": bf16(vocab, h)}
    return tensors


def byte_level_tokenizer() -> dict:
    """tokenizer.json of a byte-level BPE with no merges: the 256 bytes (GPT-2's mapping of
    bytes to printable characters), then <s>, </s>, <unk>."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    vocab = {chars[b]: b for b in range(256)} | {"<s>": 256, "</s>": 257, "<unk>": 258}
    special = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for t, i in (("<s>", 256), ("</s>", 257), ("<unk>", 258))
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab, "merges": []},
    }  # fmt: skip


def safetensors_files(config: dict | None = None, *, seed: int = 0) -> dict[str, bytes]:
    """The files of a transformers llama repo in two safetensors shards (the first layer half
    and the embeddings in the first, the rest in the second)."""
    config = config or LLAMA_CONFIG
    tensors = llama_tensors(config, seed)
    names = list(tensors)
    cut = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:cut], "model-00002-of-00002.safetensors": names[cut:]}
    files = {name: safetensors_bytes({t: tensors[t] for t in held}) for name, held in shards.items()}
    index = {
        "metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
        "weight_map": {t: name for name, held in shards.items() for t in held},
    }
    tokenizer_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML,
        "added_tokens_decoder": {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in byte_level_tokenizer()["added_tokens"]},
    }  # fmt: skip
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "_from_model_config": True,
    }
    files |= {
        ".gitattributes": GITATTRIBUTES,
        "README.md": b"---\nlibrary_name: transformers\nlicense: apache-2.0\n---\n\n# A tiny llama for llmgw's tests\n",
        "config.json": json.dumps(config, indent=2).encode(),
        "model.safetensors.index.json": json.dumps(index, indent=2).encode(),
        "tokenizer.json": json.dumps(byte_level_tokenizer(), ensure_ascii=False).encode(),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2).encode(),
        "generation_config.json": json.dumps(generation, indent=2).encode(),
    }
    return files


def safetensors_repo(repo_id: str = "llmgw-tests/tiny-llama", *, seed: int = 0, **repo: object) -> HubRepo:
    """A transformers repo of `safetensors_files()`; `repo` goes to HubRepo (gated, token, ...)."""
    return HubRepo(  # type: ignore[arg-type]
        repo_id, safetensors_files(seed=seed), library_name="transformers", pipeline_tag="text-generation",
        tags=["transformers", "safetensors", "llama", "text-generation"], **repo,
    )  # fmt: skip


def weights_source(hub: HubServer, repo: str, *paths: str, revision: str = "main", **kw: object) -> w.WeightsSource:
    """What a control plane sends a node for these files of `repo` at `revision` on `hub`."""
    commit = hub.repos[repo].resolve(revision)
    return w.WeightsSource(
        repo=repo,
        commit=commit.sha,
        files=tuple(
            w.WeightsFile(
                path=p,
                url=f"{hub.url}/{repo}/resolve/{commit.sha}/{p}",
                sha256=commit.files[p].sha256,
                size=commit.files[p].size,
            )
            for p in paths
        ),
        **kw,  # type: ignore[arg-type]
    )
