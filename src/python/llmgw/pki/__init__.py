"""The cluster's PKI, in three rooms plus one: `ca` (the authority and its certificates, pure
crypto, no I/O), `files` (where keys and certificates live on the control plane and on a node,
and reading and writing them), `tls` (the SSL contexts of the agent link and the alert after a
refused handshake) and `tlsdiag` (why a handshake failed, in words; pure).

Imports run one way: `files` uses `ca`; `tls` uses `files` and `ca`; `tlsdiag` uses none of them.
Import each name from its module; this package re-exports nothing.
"""
