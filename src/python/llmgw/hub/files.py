"""Which of a Hub repository's files an engine needs (pure: names and sizes in, a choice out).

llama.cpp takes one GGUF: a file, or the parts gguf-split made of one (`NAME-00001-of-00003.gguf`
..., which llama-server loads from the first), whichever quantisation the operator names by
`--quant Q4_K_M` or a `--file` pattern; a repository holding one quantisation needs neither.
Projector files (`mmproj-*.gguf`, for images) are not a model.

vLLM and SGLang take a directory as `transformers` lays it out: `config.json`, the safetensors
shards and their index, the tokenizer's files, the generation config and chat template. Only the
repository's top level: subdirectories hold other formats (`original/` for Meta's own weights).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence

import attrs

from llmgw.errors import UsageError
from llmgw.hub.client import HubFile

_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
# A quantisation's label in a file name: Q4_K_M, IQ4_XS, Q8_0, F16, BF16, UD-Q4_K_XL, MXFP4...
_QUANT = re.compile(
    r"(?:^|[-_.])(?P<q>(?:UD-)?(?:I?Q[1-8](?:_[A-Z0-9]+)*|F16|BF16|F32|FP16|FP8|MXFP4))(?=[-_.]|$)", re.IGNORECASE
)
# What vLLM and SGLang read of a repository besides the shards (transformers' file names).
_DIRECTORY_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "processor_config.json",
)


class FileChoiceError(UsageError):
    """The repository's files do not say which the engine should take: the message lists them."""


@attrs.frozen(kw_only=True)
class Choice:
    """The files chosen for an engine: `files[0]` is what it is given (the GGUF or its first
    part; for vLLM/SGLang, `config.json`, whose directory it is given)."""

    files: tuple[HubFile, ...]
    quant: str = ""  # the quantisation's label, for GGUF

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def default_engine(files: Sequence[HubFile]) -> str:
    """llamacpp for a repository of GGUF files, vllm for one of safetensors; "" for neither."""
    if _gguf_choices(files):
        return "llamacpp"
    if any(_top_safetensors(f) for f in files):
        return "vllm"
    return ""


def choose(files: Sequence[HubFile], engine: str, *, pattern: str = "", quant: str = "", repo: str = "") -> Choice:
    """The files `engine` needs from `files`; `FileChoiceError` naming what is there when the
    choice is empty or ambiguous."""
    if engine == "llamacpp":
        return _choose_gguf(files, pattern=pattern, quant=quant, repo=repo)
    if engine in ("vllm", "sglang"):
        if quant:
            raise FileChoiceError(
                f"--quant picks one of a repository's GGUF files, for llama.cpp; {engine} takes {repo}'s "
                "safetensors as they are: leave --quant out, or use --engine llamacpp with a GGUF repository"
            )
        return _choose_directory(files, engine, pattern=pattern, repo=repo)
    raise FileChoiceError(f"engine {engine!r} takes no files from the Hub; use llamacpp, vllm or sglang")


def quant_of(name: str) -> str:
    """The quantisation label in a GGUF file's name, upper case ("" if none)."""
    base = name.rsplit("/", 1)[-1]
    split = _SPLIT.match(base)
    stem = split.group("stem") if split else base.rsplit(".", 1)[0]
    found = list(_QUANT.finditer(stem))
    return found[-1].group("q").upper() if found else ""


def gguf_choices(files: Sequence[HubFile]) -> list[Choice]:
    """Every GGUF model in `files`: each single file, each complete set of split parts."""
    return _gguf_choices(files)


def _gguf_choices(files: Sequence[HubFile]) -> list[Choice]:
    singles: list[Choice] = []
    groups: dict[tuple[str, int], dict[int, HubFile]] = {}
    for f in files:
        base = f.path.rsplit("/", 1)[-1]
        if not base.lower().endswith(".gguf") or base.lower().startswith("mmproj"):
            continue
        split = _SPLIT.match(f.path)
        if split:
            groups.setdefault((split.group("stem"), int(split.group("count"))), {})[int(split.group("no"))] = f
        else:
            singles.append(Choice(files=(f,), quant=quant_of(f.path)))
    for (_stem, count), parts in sorted(groups.items()):
        if sorted(parts) == list(range(1, count + 1)):  # an incomplete set is no model
            ordered = tuple(parts[n] for n in range(1, count + 1))
            singles.append(Choice(files=ordered, quant=quant_of(ordered[0].path)))
    return sorted(singles, key=lambda c: c.files[0].path)


def _describe(choices: Sequence[Choice]) -> str:
    return ", ".join(
        f"{c.files[0].path}"
        + (f" (+{len(c.files) - 1} parts)" if len(c.files) > 1 else "")
        + f" [{c.quant or 'no label'}, {_gib(c.size)}]"
        for c in choices
    )


def _choose_gguf(files: Sequence[HubFile], *, pattern: str, quant: str, repo: str) -> Choice:
    choices = _gguf_choices(files)
    if not choices:
        engine = default_engine(files)
        also = f"; it holds safetensors: use --engine {engine}" if engine else ""
        raise FileChoiceError(f"{repo} has no GGUF file for llama.cpp{also}")
    picked = choices
    if pattern:
        picked = [c for c in picked if any(_matches(f.path, pattern) for f in c.files)]
        if not picked:
            raise FileChoiceError(f"--file {pattern!r} matches no GGUF model in {repo}; it has: {_describe(choices)}")
    if quant:
        picked = [c for c in picked if c.quant == quant.upper()]
        if not picked:
            labels = sorted({c.quant for c in choices if c.quant})
            raise FileChoiceError(
                f"{repo} has no {quant.upper()} quantisation; it has {', '.join(labels) or 'no labelled one'}: "
                f"{_describe(choices)}"
            )
    if len(picked) > 1:
        how = "--quant Q (e.g. --quant Q4_K_M)" if not quant else "--file PATTERN"
        raise FileChoiceError(
            f"{repo} holds {len(picked)} GGUF models{' matching' if pattern or quant else ''}: {_describe(picked)}; "
            f"pick one with {how}"
        )
    return picked[0]


def _top_safetensors(f: HubFile) -> bool:
    return "/" not in f.path and f.path.endswith(".safetensors")


def _choose_directory(files: Sequence[HubFile], engine: str, *, pattern: str, repo: str) -> Choice:
    shards = [f for f in files if _top_safetensors(f) and (not pattern or _matches(f.path, pattern))]
    if not shards:
        if pattern:
            raise FileChoiceError(f"--file {pattern!r} matches no safetensors file at the top of {repo}")
        gguf = "; it holds GGUF files: use --engine llamacpp" if _gguf_choices(files) else ""
        raise FileChoiceError(f"{repo} has no safetensors weights at its top level, which {engine} needs{gguf}")
    # Mistral's repositories hold the same weights twice at the top: transformers' shards and
    # their own consolidated.safetensors, which vLLM skips (it loads what the index names).
    if any(not _consolidated(f) for f in shards):
        shards = [f for f in shards if not _consolidated(f)]
    by_name = {f.path: f for f in files}
    if "config.json" not in by_name:
        raise FileChoiceError(f"{repo} has no config.json, which {engine} needs beside the weights")
    rest = [by_name[name] for name in _DIRECTORY_FILES if name in by_name]
    return Choice(files=(rest[0], *rest[1:], *sorted(shards, key=lambda f: f.path)))


def _consolidated(f: HubFile) -> bool:
    return f.path.startswith("consolidated") and f.path.endswith(".safetensors")


def _matches(path: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pattern)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"
