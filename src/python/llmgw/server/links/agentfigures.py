"""What /metrics shows of the agent links (`llmgw.server.links.agentlinks`): how long heartbeats took
to count, the heartbeat interval agents are told, the links up and the nodes by state. Kept
apart from the link's adapter, as `gatewayfigures` is from the gateway link's."""

from __future__ import annotations

import time

from llmgw.metrics import MetricsRegistry
from llmgw.server.state.registry import NodeRegistry

# From a millisecond (a quiet control plane on one machine) to the 20 s a swamped one would take.
HEARTBEAT_DELAY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0)


class AgentFigures:
    def __init__(self) -> None:
        self.metrics = MetricsRegistry()
        self._delays = self.metrics.histogram(
            "llmgw_agent_heartbeat_delay_seconds",
            "From an agent's sending a heartbeat (its clock) to the registry's counting it (this "
            "control plane's): network, queues, and this process's loop; across machines, also the "
            "difference of their clocks.",
            buckets=HEARTBEAT_DELAY_BUCKETS,
        )
        self._interval = self.metrics.gauge(
            "llmgw_agent_heartbeat_interval_seconds",
            "The heartbeat interval agents are told now, stretched as the cluster grows.",
        )
        self._linked = self.metrics.gauge("llmgw_agent_links", "Agents linked to this control plane now.")
        self._nodes = self.metrics.gauge("llmgw_nodes", "The nodes this control plane knows, by state.", ("state",))

    def heartbeat_counted(self, sent_at: float) -> None:
        """A heartbeat an agent sent at `sent_at` (unix time, its clock) was counted now; a clock
        behind ours counts as no delay, not a negative one."""
        self._delays.observe_at((), max(0.0, time.time() - sent_at))

    def render(self, *, links: int, interval_s: float, registry: NodeRegistry) -> str:
        """The families, as they are now (a standby knows no node)."""
        self._interval.set(interval_s)
        self._linked.set(links)
        for state, count in registry.counts(registry.clock.now()).items():
            self._nodes.set(count, state=state)
        return self.metrics.render()
