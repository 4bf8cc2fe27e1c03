"""The gateway process's own parts (`llmgw gateway`): on machines of its own, linked to the
control plane by the gateway link alone (`link`), never importing the control plane."""
