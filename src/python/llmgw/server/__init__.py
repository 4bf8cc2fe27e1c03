"""The control plane, in rooms named for what they hold; each room imports only those before it
(its BUILD file says which, `.ci/check-import-rules` plants a violation in each):

    nodes       what is served to nodes: the engine archives' mirror and its fill, the release files
    store       the durable state (SQLite or PostgreSQL), used off the loop (`asyncstore`), its
                backup, migration and check, and engine keys sealed at rest
    state       the cluster's state and scheduling: the registry, intent, replicas and the pure
                scheduler, moves and drains, the reconciler, what each node is told, the API keys,
                the views of all of it
    links       the agent port and the one link runtime; the agents and the gateways linked
    gateways    the control plane's own gateway: its workers, or one on the loop
    admin       the admin API and the cluster page, their private socket, what an operator does
    leadership  the lease several control planes share, a standby, the seat a server takes

At the top: `app` (`ControlPlane`: the rooms wired and served), `errors` (by blame, for every
room), `settings` (server.toml as run), `front` (the HTTP front's addresses), `lifecycle` and
`activation` (the process around the services).
"""
