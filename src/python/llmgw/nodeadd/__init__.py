"""Onboarding over SSH: the toolkit three flows are built from, and the flows.

The toolkit (this package's modules): the SSH session (ssh, remote, errors), the operator's
flags and options (flags, context), the steps every flow shares (identify, ship with release,
certs, service), the checklist a flow runs as and reports to (checklist, steps), and its screens
and questions (screen, questions). The flows, peers that import the toolkit and never each other:
`node` (`llmgw node add`), `gateway` (`llmgw gateway add`), `server` (`llmgw server add`); each is
a list of steps over the toolkit (its flow.py), with its own layout and its own steps' code.
"""
