"""The llmgw agent: the node side of the cluster.

It may import only `llmgw.wire`, `llmgw.pki`, `llmgw.config`, `llmgw.engines` (and the shared
`llmgw.errors`, `llmgw.log`, `llmgw.version`); the BUILD file enforces it.
"""
