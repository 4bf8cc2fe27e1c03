"""What each node is told to have (`DesiredStates.of`): the engines (`engines.wants.engines_for`:
server.toml's `[engines]`, the node's inventory, what the mirror and the release hold) and the
replicas placed on it (`Replicas.assignments_for`), cordoned or not, each look a new generation.
The agent links send it (`AgentLinks.push_desired_state`) after a change; the agent follows it.

Also here, because it is the same question asked of every node: when a node may build llama.cpp
from its source (`a_node_may_build`), which is when the mirror fetches that source.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from llmgw.config import Model, ServerConfig
from llmgw.engines.wants import engines_for, may_build, release_for
from llmgw.log import get_logger
from llmgw.server.nodes.artifacts import Artifacts
from llmgw.server.nodes.releases import Releases
from llmgw.server.state.changes import Changes
from llmgw.server.state.registry import NodeRegistry
from llmgw.server.state.replicas import Replicas
from llmgw.server.state.staging import Staging
from llmgw.server.state.weights import catalog_digests, weights_source
from llmgw.wire import agent_link as w

log = get_logger("llmgw.server")


class DesiredStates:
    def __init__(
        self,
        *,
        config: Callable[[], ServerConfig],
        registry: NodeRegistry,
        replicas: Replicas,
        artifacts: Artifacts,
        releases: Releases,
        changes: Changes,
        node_coming: Callable[[], bool],
        staging: Staging | None = None,
    ) -> None:
        """`config()`: the configuration running now (a reload replaces it); `node_coming()`:
        whether a node certificate was issued since start (`Operations.node_coming`)."""
        self.config = config
        self.registry = registry
        self.replicas = replicas
        self.artifacts = artifacts
        self.releases = releases
        self.changes = changes
        self.node_coming = node_coming
        self.staging = staging or Staging()  # models staged to nodes ahead of their replicas
        self._generation = 0

    def of(self, node_id: str) -> w.DesiredState:
        config = self.config()
        node = self.registry.nodes.get(node_id)
        self._generation += 1
        engines = engines_for(
            config.engines,
            node.inventory if node else None,
            self.artifacts.available(),
            max_archive_bytes=config.downloads.max_archive_bytes,
            release=self.releases.llama_archives(),
        )
        return w.DesiredState(
            generation=self._generation,
            cordoned=bool(node and node.cordoned),
            engines=engines,
            replicas=self.replicas.assignments_for(
                node_id,
                self.model,
                partial(weights_source, max_weights_bytes=config.downloads.max_weights_bytes, hub=config.hub),
            ),
            # Also the weights of the older versions replicas still run (a rollout under way).
            keep_files=catalog_digests([*config.models, *self.replicas.versions.known.values()]),
            stage=tuple(
                weights_source(m, max_weights_bytes=config.downloads.max_weights_bytes, hub=config.hub)
                for m in (self.model(name) for name in self.staging.models_for(node_id))
                if m is not None
            ),
            bench=node.bench_asked if node else "",
        )

    def model(self, name: str) -> Model | None:
        return next((m for m in self.config().models if m.name == name), None)

    async def a_node_may_build(self) -> None:
        """Returns once a node may build llama.cpp from its source, so the mirror fetches the
        source then and not before. Without release archives of llama.cpp: once the registry
        knows a node, or a node certificate was issued (`node add` records it before it installs
        the agent: the mirror fetches meanwhile). With them, only a node they do not cover (another
        architecture, or an NVIDIA GPU for a CUDA build) needs the source."""
        release = (await self.releases.catalog()).llama_archives()
        while True:
            changed = self.changes.nodes.next()
            engines = self.config().engines
            if not release_for(engines.llamacpp, release):
                if self.registry.nodes or self.node_coming():
                    return
            elif any(n.inventory and may_build(engines, n.inventory, release) for n in self.registry.nodes.values()):
                return
            # Why the source is not fetched yet, at each look (debug: there is a look per node change).
            log.debug("mirror_source_not_needed", nodes=len(self.registry.nodes), release_llamacpp=bool(release))
            await changed.wait()
