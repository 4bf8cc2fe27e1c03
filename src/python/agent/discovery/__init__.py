"""Hardware discovery for the agent and `llmgw doctor`.

`snapshot.discover(Sources) -> Snapshot` looks at the node once; `cpu`, `gpus`, `infiniband`, `vulkan`
and `system` read one part each (pure parsers apart from the reads and tool runs), and
`fabrics` decides fabric groups and checks declarations, purely. `agent.inventory` turns a
snapshot into the hello's `Inventory`; `agent.doctor_checks` turns it into checks.
"""
