"""A model's shape, as sizing needs it, from GGUF headers (one per split part) or a config.json.

Per-layer values (KV heads, sliding-window layers) are tuples of length `block_count`: GGUF may
give `head_count_kv` as one number or an array per layer (0 for a layer without attention), and
llama.cpp decides which layers use a sliding window from `attention.sliding_window_pattern` or,
without it, from a pattern fixed per architecture (the table below, from llama.cpp b11434's
`load_swa_pattern` calls).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from llmgw.sizing.errors import MalformedGguf, MissingMetadata
from llmgw.sizing.gguf import ArrayInfo, GgufHeader

# architecture -> (n_pattern, dense_first): with n_pattern 4, layers 0-2 slide and 3 is full
# (dense_first: 0 is full and 1-3 slide). Used only when `attention.sliding_window` is set.
SWA_PATTERNS: Mapping[str, tuple[int, bool]] = {
    "gemma2": (2, False),
    "gemma3": (6, False),
    "gemma3n": (5, False),
    "gemma-embedding": (6, False),
    "cohere2": (4, False),
    "exaone4": (4, False),
    "gpt-oss": (2, False),
    "llama4": (4, False),
    "olmo2": (4, False),
    "afmoe": (4, False),
    "smallthinker": (4, True),
}


@attrs.frozen(kw_only=True)
class SplitInfo:
    """`split.*` of one part of a model split by gguf-split: part `no` of `count`, and the
    tensor count of all parts together."""

    no: int
    count: int
    tensors_count: int


@attrs.frozen(kw_only=True)
class ModelShape:
    """What sizes a model's memory. `weights_bytes` is all parts' tensor data."""

    architecture: str
    block_count: int
    context_length: int
    embedding_length: int
    head_count: int
    head_count_kv: tuple[int, ...]  # per layer
    key_length: int
    value_length: int
    vocab_size: int
    feed_forward_length: int
    weights_bytes: int
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = ()  # per layer; empty: none slides


def split_info(header: GgufHeader) -> SplitInfo | None:
    """The part's `split.*` metadata, or None for a file that is not a part."""
    md = header.metadata
    if "split.count" not in md:
        return None
    no, count, tensors = md.get("split.no"), md.get("split.count"), md.get("split.tensors.count")
    if not all(isinstance(v, int) for v in (no, count, tensors)) or not 0 <= no < count:
        raise MalformedGguf(f"split.no {no!r}, split.count {count!r}, split.tensors.count {tensors!r} do not agree")
    return SplitInfo(no=no, count=count, tensors_count=tensors)


def _int(md: Mapping[str, object], key: str, default: int | None = None) -> int:
    value = md.get(key, default)
    if value is None:
        raise MissingMetadata(f"the GGUF metadata has no {key}; sizing needs it")
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedGguf(f"{key} is {value!r}, not an integer")
    return value


def _per_layer(md: Mapping[str, object], key: str, n_layer: int, default: int) -> tuple[int, ...]:
    value = md.get(key, default)
    if isinstance(value, list):
        if len(value) != n_layer or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise MalformedGguf(f"{key} is an array of {len(value)} items; expected {n_layer} integers (one a layer)")
        return tuple(value)
    if isinstance(value, ArrayInfo):
        raise MalformedGguf(f"{key} is an array of {value.length}; expected {n_layer} (one a layer)")
    return (_int(md, key, default),) * n_layer


def _swa_layers(md: Mapping[str, object], arch: str, n_layer: int) -> tuple[bool, ...]:
    given = md.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(given, list):
        if len(given) != n_layer:
            raise MalformedGguf(f"{arch}.attention.sliding_window_pattern has {len(given)} items for {n_layer} layers")
        return tuple(bool(v) for v in given)
    n_pattern, dense_first = SWA_PATTERNS.get(arch, (0, False))
    if isinstance(given, int) and not isinstance(given, bool):
        n_pattern = given
    if n_pattern == 0:
        return (True,) * n_layer
    if dense_first:
        return tuple(il % n_pattern != 0 for il in range(n_layer))
    return tuple(il % n_pattern < n_pattern - 1 for il in range(n_layer))


def combine_parts(headers: Sequence[GgufHeader]) -> tuple[GgufHeader, int]:
    """The first part's header (which carries the metadata) and the tensor bytes of all parts,
    checked to be one whole split model: every part once, and the tensor counts adding up."""
    if not headers:
        raise MissingMetadata("no GGUF header given")
    infos = [split_info(h) for h in headers]
    if len(headers) == 1 and infos[0] is None:
        return headers[0], headers[0].tensor_bytes
    if any(i is None for i in infos):
        raise MalformedGguf("some parts given have split.* metadata and some do not: give one model's parts only")
    count = infos[0].count
    nos = sorted(i.no for i in infos)
    if nos != list(range(count)):
        raise MissingMetadata(f"the model is split in {count} parts; the parts given are numbered {nos} (0-based)")
    tensors = sum(len(h.tensors) for h in headers)
    if tensors != infos[0].tensors_count:
        raise MalformedGguf(f"the parts hold {tensors} tensors; split.tensors.count says {infos[0].tensors_count}")
    first = next(h for h, i in zip(headers, infos, strict=True) if i.no == 0)
    return first, sum(h.tensor_bytes for h in headers)


def gguf_shape(headers: Sequence[GgufHeader]) -> ModelShape:
    """The shape of the model whose (one or all split) GGUF headers are given."""
    header, weights = combine_parts(headers)
    md = header.metadata
    arch = md.get("general.architecture")
    if not isinstance(arch, str):
        raise MissingMetadata("the GGUF metadata has no general.architecture; sizing needs it")
    n_layer = _int(md, f"{arch}.block_count")
    n_embd = _int(md, f"{arch}.embedding_length")
    head_counts = _per_layer(md, f"{arch}.attention.head_count", n_layer, 0)
    n_head = max(head_counts, default=0)
    if n_head <= 0:
        raise MalformedGguf(f"{arch}.attention.head_count is {n_head}; a model with attention has at least one head")
    kv = _per_layer(md, f"{arch}.attention.head_count_kv", n_layer, n_head)
    tokens = md.get("tokenizer.ggml.tokens")
    n_vocab_default = (
        tokens.length if isinstance(tokens, ArrayInfo) else len(tokens) if isinstance(tokens, list) else None
    )
    ff = _per_layer(md, f"{arch}.feed_forward_length", n_layer, 0)
    window = _int(md, f"{arch}.attention.sliding_window", 0)
    return ModelShape(
        architecture=arch,
        block_count=n_layer,
        context_length=_int(md, f"{arch}.context_length"),
        embedding_length=n_embd,
        head_count=n_head,
        head_count_kv=kv,
        key_length=_int(md, f"{arch}.attention.key_length", n_embd // n_head),
        value_length=_int(md, f"{arch}.attention.value_length", n_embd // n_head),
        vocab_size=_int(md, f"{arch}.vocab_size", n_vocab_default),
        feed_forward_length=max(ff, default=0),
        weights_bytes=weights,
        sliding_window=window,
        swa_layers=_swa_layers(md, arch, n_layer) if window > 0 else (),
    )
