"""Models staged to nodes ahead of their replicas (`llmgw ctl models stage NAME --nodes ...`):
the nodes download the model's files into their weights cache now, so that a replica placed
there later, a drain's move or a scale-up, starts without a download.

`Staging` owns the operator's wish until it is met: each node's desired state lists the weights
sources staged to it (`DesiredState.stage`), and once the node reports holding every file of a
staged model (`WeightsChanged`), that model leaves its list. The wish is kept in memory only: a
control plane that restarts mid-way forgets it (what arrived stays in the cache, and staging
again resumes the downloads).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from llmgw.config import Model
from llmgw.log import get_logger
from llmgw.server.state.scheduler import model_files
from llmgw.wire import agent_link as w

log = get_logger("llmgw.server")


class Staging:
    def __init__(self) -> None:
        self.wanted: dict[str, dict[str, frozenset[str]]] = {}  # node -> model -> the files it needs

    def add(self, model: Model, nodes: Iterable[str], holds: Callable[[str], frozenset[str]]) -> list[str]:
        """Stage `model` to `nodes`; the nodes that still need a file of it (the others hold
        it whole already: nothing is asked of them)."""
        files = model_files(model)
        asked = []
        for node in nodes:
            if files <= holds(node):
                continue
            self.wanted.setdefault(node, {})[model.name] = files
            asked.append(node)
        if asked:
            log.info("model_staging", model=model.name, nodes=asked, files=len(files))
        return asked

    def models_for(self, node_id: str) -> list[str]:
        return sorted(self.wanted.get(node_id, {}))

    def reported(self, node_id: str, held: w.WeightsHeld) -> bool:
        """The node holds these files now: the staged models it holds whole are done. Whether
        anything was (the node's desired state then changes)."""
        mine = self.wanted.get(node_id)
        if not mine:
            return False
        whole = {f.sha256 for f in held.files if f.complete}
        done = [name for name, files in mine.items() if files <= whole]
        for name in done:
            del mine[name]
            log.info("model_staged", model=name, node=node_id)
        if not mine:
            del self.wanted[node_id]
        return bool(done)

    def forget(self, model: str) -> None:
        """The model left the catalog: nothing more to stage of it."""
        for node in list(self.wanted):
            self.wanted[node].pop(model, None)
            if not self.wanted[node]:
                del self.wanted[node]

    def view(self) -> dict[str, list[str]]:
        """Model -> the nodes it is being staged to."""
        out: dict[str, list[str]] = {}
        for node, models in sorted(self.wanted.items()):
            for name in models:
                out.setdefault(name, []).append(node)
        return out
