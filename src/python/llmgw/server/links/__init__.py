"""The links' ends on the control plane: the agent port's listener and routes, the one link
runtime (linkserver), the agents linked (agentlinks) and the gateways linked (gatewaylinks), the
table a gateway is sent, and the figures /metrics shows of them.
"""
