"""The memory a model replica needs: weights, KV cache, compute buffers and the engine's own.

llama.cpp (llama-server of b11434, as llmgw launches it) allocates at start, and keeps:
  model buffer   the tensor data (mmap'd from the file on a CPU; copied to the GPUs when offloaded)
  KV cache       per layer with attention: cells x (n_head_kv x key_length x size(type_k)
                 + n_head_kv x value_length x size(type_v)); cells is the context padded to 256
                 (per stream: one stream when the cache is unified, else one per slot holding
                 context/slots); a sliding-window layer holds only window x slots + n_ubatch cells
  compute        ggml's graph reserve for one ubatch of min(n_ctx, n_ubatch) tokens: the attention
                 mask (cells x tokens, f16) and the activations (tokens x (5 n_embd + 3 n_ff) f32:
                 fitted to this build's measured buffers, tools/bench/estimate.py; the logits of
                 one output a slot reuse them); without flash attention also the scores
                 (cells x tokens x heads f32)
  output         the logits buffer: n_vocab x slots x 4 bytes
  overhead       the process beyond its buffers (measured RSS, a constant)
llama-server's defaults: the context is the model's trained context when --ctx-size is absent;
4 slots and a unified cache when --parallel is absent (with -np N the cache is split in N).

vLLM takes a fraction (gpu_memory_utilization) of each GPU whatever the model; what is
estimated is the least that fraction must hold for vLLM to start with one sequence of the full
context: the weights' shard, the KV cache of that sequence, the activations of its profiling run,
CUDA graphs and the CUDA context. Per GPU with tensor parallelism: weights / gpus, KV heads
/ gpus (at least one each).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from llmgw.sizing.errors import MalformedGguf, MissingMetadata
from llmgw.sizing.gguf import GGML_TYPE_BY_NAME, GgufHeader, ggml_nbytes
from llmgw.sizing.model import ModelShape, gguf_shape

MiB = 1024 * 1024
KV_PAD = 256  # llama.cpp pads the context and the SWA cache to this many cells
LLAMA_DEFAULT_SLOTS = 4  # -np -1 (auto): 4 slots, unified cache
LLAMA_DEFAULT_UBATCH = 512
LLAMA_OVERHEAD = 24 * MiB  # the most RSS beyond the buffers measured was 16.4 MiB (docs/engines.md)
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")

VLLM_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1, "float8_e4m3fn": 1}
VLLM_BATCHED_TOKENS = 8192  # max_num_batched_tokens of the profiling run (vLLM V1's default)
VLLM_MAX_SEQS = 256  # max_num_seqs: the sampler's warm-up takes logits for this many
VLLM_CUDA_GRAPHS = 512 * MiB  # vLLM logs 0.2-1 GiB for graph capture; 0 with enforce_eager
VLLM_CUDA_CONTEXT = 512 * MiB  # CUDA context and torch's allocator, outside vLLM's budget


@attrs.frozen(kw_only=True)
class Estimate:
    """Bytes a replica needs, by part. `per_gpu` is what each of `gpus` GPUs must hold (the
    whole, on a CPU: gpus == 0)."""

    engine: str
    context: int  # tokens of KV the engine allocates (all slots together)
    parallel: int
    weights: int
    kv_cache: int
    compute: int
    output: int
    overhead: int
    gpus: int
    per_gpu: int
    # llama.cpp: the repeating layers (`<arch>.block_count`) and the bytes of their tensors
    # (`blk.*`), which a replica over several nodes splits by whole layers; 0 when unknown.
    layers: int = 0
    layer_bytes: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute + self.output + self.overhead

    @property
    def buffers(self) -> int:
        """What the engine allocates for the model (all but the process's own overhead)."""
        return self.weights + self.kv_cache + self.compute + self.output


@attrs.frozen(kw_only=True)
class LlamaSettings:
    """The llama-server settings sizing depends on; None: llama-server's default."""

    context: int | None = None
    parallel: int | None = None
    kv_unified: bool | None = None
    ubatch: int = LLAMA_DEFAULT_UBATCH
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: bool = True  # "auto" turns it on where the backend has it (CPU, CUDA, Metal)
    swa_full: bool = False

    @classmethod
    def from_args(cls, args: Sequence[str], context: int | None = None) -> LlamaSettings:
        """From a llama-server command line's arguments (the catalog's, with `context` as llmgw's
        `--ctx-size`); arguments sizing ignores are skipped."""
        values: dict[str, object] = {"context": context or None}
        flags = {
            "-c": "context", "--ctx-size": "context", "-np": "parallel", "--parallel": "parallel",
            "-ub": "ubatch", "--ubatch-size": "ubatch", "-ctk": "cache_type_k", "--cache-type-k": "cache_type_k",
            "-ctv": "cache_type_v", "--cache-type-v": "cache_type_v", "-fa": "flash_attn", "--flash-attn": "flash_attn",
        }  # fmt: skip
        args = list(args)
        for i, arg in enumerate(args):
            name, _, inline = arg.partition("=")
            if name in ("-kvu", "--kv-unified"):
                values["kv_unified"] = True
            elif name in ("-no-kvu", "--no-kv-unified"):
                values["kv_unified"] = False
            elif name == "--swa-full":
                values["swa_full"] = True
            elif name in flags:
                value = inline or (args[i + 1] if i + 1 < len(args) else "")
                key = flags[name]
                if key in ("context", "parallel", "ubatch"):
                    number = int(value)
                    values[key] = None if number <= 0 and key != "ubatch" else number
                elif key == "flash_attn":
                    values[key] = value != "off"
                else:
                    values[key] = value
        return cls(**values)


def _pad(n: int, to: int = KV_PAD) -> int:
    return -(-n // to) * to


def _row(cache_type: str, n: int) -> int:
    name = cache_type.upper()
    if cache_type not in KV_CACHE_TYPES:
        raise MissingMetadata(f"KV cache type {cache_type!r} is not one of {', '.join(KV_CACHE_TYPES)}")
    return ggml_nbytes(GGML_TYPE_BY_NAME[name], (n,))


def llama_kv_cells(shape: ModelShape, s: LlamaSettings) -> tuple[int, int, int, int]:
    """(n_ctx, slots, streams, cells a stream) as llama-server sizes them."""
    n_ctx = _pad(s.context or shape.context_length)
    slots = s.parallel or LLAMA_DEFAULT_SLOTS
    unified = s.kv_unified if s.kv_unified is not None else s.parallel is None
    if unified:
        return n_ctx, slots, 1, n_ctx
    return n_ctx, slots, slots, _pad(n_ctx // slots)


def llama_kv_bytes(shape: ModelShape, s: LlamaSettings) -> int:
    n_ctx, slots, streams, cells = llama_kv_cells(shape, s)
    unified = streams == 1
    swa_cells = min(cells, _pad(shape.sliding_window * (slots if unified else 1) + s.ubatch))
    total = 0
    for il, n_kv in enumerate(shape.head_count_kv):
        if n_kv == 0:
            continue  # no attention in this layer (a recurrent layer of a hybrid model)
        layer_cells = swa_cells if shape.swa_layers and shape.swa_layers[il] and not s.swa_full else cells
        per_cell = _row(s.cache_type_k, n_kv * shape.key_length) + _row(s.cache_type_v, n_kv * shape.value_length)
        total += streams * layer_cells * per_cell
    return total


def llama_compute_bytes(shape: ModelShape, s: LlamaSettings) -> int:
    n_ctx, slots, _, cells = llama_kv_cells(shape, s)
    tokens = min(n_ctx, s.ubatch)
    masks = cells * tokens * 2
    if shape.swa_layers and any(shape.swa_layers) and not s.swa_full:
        masks += min(cells, _pad(shape.sliding_window * slots + s.ubatch)) * tokens * 2
    activations = tokens * 4 * (5 * shape.embedding_length + 3 * shape.feed_forward_length)
    # The logits of one output a slot come after the last layer, in memory the layers freed.
    logits = shape.vocab_size * min(tokens, slots) * 4
    scores = 0 if s.flash_attn else cells * tokens * shape.head_count * 4
    return masks + max(activations, logits) + scores


def estimate_gguf(
    headers: GgufHeader | Sequence[GgufHeader],
    settings: LlamaSettings | None = None,
    *,
    gpus: int = 0,
    overhead: int = LLAMA_OVERHEAD,
) -> Estimate:
    """What llama-server needs to run the model whose GGUF header (or split parts' headers) is
    given, with `settings`; over `gpus` GPUs (layer split) each holds its share of the weights and
    KV cache and a compute buffer of its own."""
    s = settings or LlamaSettings()
    shape = gguf_shape([headers] if isinstance(headers, GgufHeader) else headers)
    if s.context is None and shape.context_length <= 0:
        raise MalformedGguf(f"{shape.architecture}.context_length is {shape.context_length}; give a context")
    n_ctx, slots, _, _ = llama_kv_cells(shape, s)
    parts = [headers] if isinstance(headers, GgufHeader) else headers
    layer_bytes = sum(t.nbytes for h in parts for t in h.tensors if t.name.startswith("blk."))
    kv = llama_kv_bytes(shape, s)
    compute = llama_compute_bytes(shape, s)
    output = shape.vocab_size * slots * 4
    per_gpu = (shape.weights_bytes + kv) // gpus + compute + overhead if gpus else 0
    total = shape.weights_bytes + kv + compute + output + overhead
    return Estimate(
        engine="llamacpp",
        context=n_ctx,
        parallel=slots,
        weights=shape.weights_bytes,
        kv_cache=kv,
        compute=compute,
        output=output,
        overhead=overhead,
        gpus=gpus,
        per_gpu=per_gpu if gpus else total,
        layers=shape.block_count,
        layer_bytes=layer_bytes,
    )


def llama_member_bytes(e: Estimate, members: int) -> int:
    """What each node of a llama.cpp replica over `members` nodes must hold on its CPU (llama.cpp's
    RPC, `nodes_per_replica`). Rank 0 splits the layers evenly (engines.llamacpp.rpc_layer_split:
    layers // members each, the remainder one more on some), keeping its share on its own CPU, so a
    member holds at most ceil(layers / members) layers and their KV cache (llama.cpp keeps each
    layer's cache on the layer's device), and at most the tensors outside the layers (the token
    embeddings stay on rank 0, the output layer goes to the last helper: with tied embeddings a
    copy of them), with a compute buffer of its own, the output buffer and the process's
    overhead. One number is asked of every member, so any node may be rank 0. Without the layer
    count (an estimate not from a GGUF), (weights + KV cache) / members. One node: the whole."""
    if members <= 1:
        return e.total
    if e.layers and e.layer_bytes:
        most = -(-e.layers // members)
        layers = -(-(e.layer_bytes + e.kv_cache) * most // e.layers)
        share = layers + (e.weights - e.layer_bytes)
    else:
        share = -(-(e.weights + e.kv_cache) // members)
    return share + e.compute + e.output + e.overhead


def _config_int(config: Mapping[str, object], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def estimate_safetensors(
    config_json: Mapping[str, object],
    weights_bytes: int,
    *,
    context: int | None = None,
    gpus: int = 1,
    kv_cache_dtype: str = "auto",
    max_num_batched_tokens: int = VLLM_BATCHED_TOKENS,
    max_num_seqs: int = VLLM_MAX_SEQS,
    enforce_eager: bool = False,
) -> Estimate:
    """The least each of `gpus` GPUs (tensor parallel) must give vLLM for the model of this
    config.json and these shard sizes (their sum, `weights_bytes`) to serve one sequence of
    `context` tokens (default: the model's max_position_embeddings). See the module's docstring."""
    config = dict(config_json)
    if isinstance(config.get("text_config"), Mapping):  # multimodal configs nest the language model
        config = {**config, **config["text_config"]}
    n_layer = _config_int(config, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _config_int(config, "hidden_size", "n_embd", "d_model")
    n_head = _config_int(config, "num_attention_heads", "n_head")
    if n_layer is None or hidden is None or n_head is None:
        raise MissingMetadata(
            "config.json lacks num_hidden_layers, hidden_size or num_attention_heads; sizing needs all three"
        )
    n_kv = _config_int(config, "num_key_value_heads", "num_kv_heads") or n_head
    head_dim = _config_int(config, "head_dim") or hidden // n_head
    n_ctx = context or _config_int(config, "max_position_embeddings", "max_sequence_length", "seq_length")
    if not n_ctx:
        raise MissingMetadata("config.json has no max_position_embeddings: give the context the replica runs with")
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    if dtype not in VLLM_DTYPE_BYTES:
        raise MissingMetadata(f"torch_dtype {dtype!r} is not one of {', '.join(VLLM_DTYPE_BYTES)}")
    kv_bytes = VLLM_DTYPE_BYTES[dtype] if kv_cache_dtype == "auto" else 1 if kv_cache_dtype.startswith("fp8") else 2
    gpus = max(gpus, 1)
    kv_heads_per_gpu = max(1, -(-n_kv // gpus))
    kv_per_gpu = 2 * n_layer * n_ctx * kv_heads_per_gpu * head_dim * kv_bytes
    intermediate = _config_int(config, "intermediate_size", "n_inner") or 4 * hidden
    vocab = _config_int(config, "vocab_size") or 0
    act_bytes = VLLM_DTYPE_BYTES[dtype]
    tokens = min(max_num_batched_tokens, max(n_ctx, max_num_batched_tokens))
    activations = tokens * (4 * hidden + 2 * intermediate // gpus) * act_bytes + max_num_seqs * vocab * 4
    overhead = VLLM_CUDA_CONTEXT + (0 if enforce_eager else VLLM_CUDA_GRAPHS)
    weights_per_gpu = -(-weights_bytes // gpus)
    return Estimate(
        engine="vllm",
        context=n_ctx,
        parallel=1,
        weights=weights_bytes,
        kv_cache=kv_per_gpu * gpus,
        compute=activations * gpus,
        output=0,
        overhead=overhead * gpus,
        gpus=gpus,
        per_gpu=weights_per_gpu + kv_per_gpu + activations + overhead,
    )
