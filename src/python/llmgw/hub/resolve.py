"""A model named by its Hub repository, made into a catalog entry: the revision pinned to its
commit, the files the engine needs with their sizes and SHA-256, and the memory a replica needs
from those files (`llmgw.sizing`), all before anything reaches a node.

The Hub gives a large (LFS) file's SHA-256 in its metadata; a small file (config.json, the
tokenizer's) has only git's blob id there, so it is read here, checked against that id, and
hashed: the nodes verify every file alike. Reading them costs a few MiB at most (`MAX_SMALL`).
For a GGUF model the memory comes from the header of its first file, read with a range request
(`read_gguf_header`: a few MiB, more for a large vocabulary, never past `MAX_HEADER`); for
safetensors from config.json and the shards' sizes.

Every call to the Hub runs in a worker thread; whatever fails raises before the catalog changes.
"""

from __future__ import annotations

import hashlib
import json
import math
from functools import partial
from typing import Any

import attrs
import trio

from llmgw.config import Model, ModelFile, ModelSource
from llmgw.engines.spec import flag_value
from llmgw.errors import UsageError
from llmgw.hub.client import HubClient, HubError, HubFile, RepoRevision, check_repo_id
from llmgw.hub.files import Choice, choose, default_engine
from llmgw.sizing import estimate as sizing
from llmgw.sizing.errors import NeedMore, SizingError
from llmgw.sizing.gguf import parse_header

GIB = 1 << 30
MAX_SMALL = 64 << 20  # a file the Hub gives no SHA-256 for is read here whole: no more than this
FIRST_READ = 4 << 20  # of a GGUF's header at first; a larger vocabulary asks for more
MAX_HEADER = 256 << 20


@attrs.frozen(kw_only=True)
class AddRequest:
    """`llmgw ctl models add NAME --hf ORG/REPO ...` (the admin API's POST /admin/v1/models)."""

    name: str
    hf: str
    revision: str = ""
    file: str = ""  # a glob over the repository's paths
    quant: str = ""
    engine: str = ""  # "": llamacpp for GGUF repositories, vllm for safetensors
    replicas: int = 1
    gpus_per_replica: int = 0
    nodes_per_replica: int = 1
    memory_gb: float = 0.0  # an override of the estimate; 0: the estimate
    args: tuple[str, ...] = ()
    routing: str = ""


@attrs.frozen(kw_only=True)
class Resolved:
    model: Model
    estimate: sizing.Estimate
    quant: str = ""


async def resolve(client: HubClient, req: AddRequest) -> Resolved:
    """The catalog entry `req` asks for; raises (UsageError for what the operator fixes, HubError
    for the Hub) without side effects."""
    check_repo_id(req.hf)
    rev = await trio.to_thread.run_sync(client.revision, req.hf, req.revision or "main")
    engine = req.engine or default_engine(rev.files)
    if not engine:
        raise UsageError(
            f"{req.hf} at {rev.commit[:12]} holds neither GGUF files (llama.cpp) nor safetensors (vLLM, SGLang); "
            "it is not a model llmgw can serve"
        )
    choice = choose(rev.files, engine, pattern=req.file, quant=req.quant, repo=req.hf)
    pinned, small = await _pin(client, rev, choice)
    estimate = await _estimate(client, rev, choice, engine, small, req)
    # What placement counts on each node: a CPU replica's whole need, shared by its nodes (llama.cpp:
    # each member's share of the layers and their cache, and buffers of its own); a replica on GPUs
    # holds its weights and cache there (estimate.per_gpu), and takes no node memory unless told.
    nodes = max(req.nodes_per_replica, 1)
    if req.gpus_per_replica:
        per_node = 0.0
    elif engine == "llamacpp":
        per_node = sizing.llama_member_bytes(estimate, nodes)
    else:
        per_node = estimate.total / nodes
    memory_gb = req.memory_gb or math.ceil(per_node / GIB * 100) / 100
    model = Model(
        name=req.name,
        engine=engine,
        source=ModelSource(hf=req.hf, revision=req.revision or "main", commit=rev.commit, files=pinned),
        replicas=req.replicas,
        gpus_per_replica=req.gpus_per_replica,
        nodes_per_replica=req.nodes_per_replica,
        memory_gb=memory_gb,
        args=req.args,
        routing=req.routing,
    )
    return Resolved(model=model, estimate=estimate, quant=choice.quant)


async def _pin(client: HubClient, rev: RepoRevision, choice: Choice) -> tuple[tuple[ModelFile, ...], dict[str, bytes]]:
    """Each file with its SHA-256; the small files' contents, read to hash them."""
    out, small = [], {}
    for f in choice.files:
        if f.sha256:
            out.append(ModelFile(path=f.path, size=f.size, sha256=f.sha256))
            continue
        data = await _read_small(client, rev, f)
        small[f.path] = data
        out.append(ModelFile(path=f.path, size=len(data), sha256=hashlib.sha256(data).hexdigest()))
    return tuple(out), small


async def _read_small(client: HubClient, rev: RepoRevision, f: HubFile) -> bytes:
    if f.size > MAX_SMALL:
        raise HubError(
            f"{rev.repo} gives no SHA-256 for {f.path} ({f.size} bytes), and it is too large to hash here; "
            "the Hub keeps files this large in LFS: is the endpoint a Hub?"
        )
    data = await trio.to_thread.run_sync(partial(client.read, rev.repo, rev.commit, f.path, length=max(f.size, 1)))
    if len(data) != f.size:
        raise HubError(f"{rev.repo}'s {f.path} is {f.size} bytes in its metadata but {len(data)} were read; try again")
    if f.blob_id and git_blob_id(data) != f.blob_id:
        raise HubError(
            f"{rev.repo}'s {f.path} as read does not match its git blob id {f.blob_id}: the endpoint sent other "
            "content than its metadata names (a broken mirror?); nothing was added"
        )
    return data


def git_blob_id(data: bytes) -> str:
    """git's id of a file's content (SHA-1 of "blob SIZE\\0" and the content), as the Hub gives it."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


async def read_gguf_header(client: HubClient, repo: str, commit: str, f: HubFile) -> Any:
    """The parsed header of a remote GGUF file, read in growing ranges."""
    want = min(FIRST_READ, f.size)
    while True:
        prefix = await trio.to_thread.run_sync(partial(client.read, repo, commit, f.path, length=want))
        try:
            return parse_header(prefix)
        except NeedMore as more:
            needed = max(more.needed, want * 2)
            if want >= f.size or needed > MAX_HEADER:
                raise HubError(
                    f"{repo}'s {f.path} has a header larger than {MAX_HEADER >> 20} MiB or is cut short; "
                    "it is not a GGUF llmgw can size: give --memory-gb"
                ) from None
            want = min(needed, f.size)
        except SizingError as exc:
            raise HubError(f"{repo}'s {f.path} is not a GGUF file llmgw can size ({exc}); give --memory-gb") from None


async def _estimate(
    client: HubClient, rev: RepoRevision, choice: Choice, engine: str, small: dict[str, bytes], req: AddRequest
) -> sizing.Estimate:
    gpus = req.gpus_per_replica * max(req.nodes_per_replica, 1)
    try:
        if engine == "llamacpp":
            # Each part of a split GGUF holds its own tensors: every part's header is read.
            headers = [await read_gguf_header(client, rev.repo, rev.commit, f) for f in choice.files]
            return sizing.estimate_gguf(headers, sizing.LlamaSettings.from_args(req.args), gpus=gpus)
        try:
            config = json.loads(small["config.json"])
        except (KeyError, ValueError):
            raise HubError(f"{rev.repo}'s config.json is not JSON; it is not a model vLLM or SGLang can load") from None
        if not isinstance(config, dict):
            raise HubError(f"{rev.repo}'s config.json is not a JSON object")
        shards = sum(f.size for f in choice.files if f.path.endswith(".safetensors"))
        context = flag_value(req.args, "--max-model-len", "--context-length")
        return sizing.estimate_safetensors(
            config, shards, context=int(context) if context and context.isdigit() else None, gpus=max(gpus, 1)
        )
    except SizingError as exc:
        raise UsageError(f"{req.hf}: {exc}; or give the memory a replica needs with --memory-gb") from None
    except ValueError as exc:  # an argument sizing reads is not a number
        raise UsageError(f"--args: {exc}") from None
