"""`llmgw gateway`: the gateway as a process of its own, on any machine (the data plane apart from
the control plane): worker processes sharing one port (`processes`), each serving the gateway
(`llmgw.gateway`) from its own table (`table`), filled by its own link to the control plane
(`link`) or a table file (`sources`). It never imports the control plane (`llmgw.server`)."""
