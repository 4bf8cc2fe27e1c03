"""What a node is told of a model's weights: where it downloads them (a url, the Hub's files at
the pinned commit through [hub] endpoint) or finds them (a path), and which downloaded files the
catalog still names (the rest a node may delete)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from llmgw.config import HubSection, Model
from llmgw.log import get_logger
from llmgw.server.nodes.weightsorigin import FileSource
from llmgw.wire import agent_link as w

log = get_logger("llmgw.server")


def weights_source(model: Model, *, max_weights_bytes: int, hub: HubSection) -> w.WeightsSource:
    """Where a node gets `model`'s weights: its url or path, or its files on the Hub ([hub]
    endpoint), with the model's token or else [hub] token_file's."""
    source = model.source
    token = source.token.reveal() if source.token else ""
    if not source.hf:
        return w.WeightsSource(
            url=source.url,
            sha256=source.sha256,
            path=source.path,
            token=token,
            size=source.size,
            max_bytes=max_weights_bytes if source.url else 0,
        )
    endpoint = hub.endpoint.rstrip("/")
    return w.WeightsSource(
        repo=source.hf,
        commit=source.commit,
        token=token or hub_file_token(hub),
        max_bytes=max_weights_bytes,
        files=tuple(
            w.WeightsFile(
                path=f.path,
                url=f"{endpoint}/{source.hf}/resolve/{source.commit}/{quote(f.path)}",
                sha256=f.sha256,
                size=f.size,
            )
            for f in source.files
        ),
        directory=model.engine in ("vllm", "sglang"),
    )


def default_weights(model: Model) -> w.WeightsSource:
    """`weights_source` with [downloads] and [hub] at their defaults."""
    return weights_source(model, max_weights_bytes=0, hub=HubSection())


def hub_file_token(hub: HubSection) -> str:
    """[hub] token_file's token ("" for none, or a file that cannot be read: the download then
    fails as the Hub refuses it, and says so)."""
    if not hub.token_file:
        return ""
    try:
        return Path(hub.token_file).read_text().strip()
    except OSError as exc:
        log.warning("hub_token_unreadable", path=hub.token_file, error=exc.strerror)
        return ""


def catalog_digests(models: Iterable[Model]) -> tuple[str, ...]:
    """The SHA-256 of every weights file the catalog names (`DesiredState.keep_files`)."""
    out = set()
    for m in models:
        if m.source.url:
            out.add(m.source.sha256.lower())
        out.update(f.sha256 for f in m.source.files)
    return tuple(sorted(out))


def catalog_files(models: Iterable[Model], *, max_weights_bytes: int, hub: HubSection) -> dict[str, FileSource]:
    """Every weights file of the catalog a node downloads (a URL source, a Hub model's files), by
    SHA-256, with where it comes from: what the control plane fetches as origin."""
    out: dict[str, FileSource] = {}
    for m in models:
        source = weights_source(m, max_weights_bytes=max_weights_bytes, hub=hub)
        if source.url:
            name = unquote(urlsplit(source.url).path.rsplit("/", 1)[-1])
            out[source.sha256.lower()] = FileSource(
                url=source.url, size=source.size, name=name, token=source.token, max_bytes=source.max_bytes
            )
        for f in source.files:
            out[f.sha256.lower()] = FileSource(
                url=f.url, size=f.size, name=f.path.rsplit("/", 1)[-1], token=source.token, max_bytes=source.max_bytes
            )
    return out
