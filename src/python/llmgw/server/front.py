"""The control plane's HTTP front: the addresses it reports once it listens (`Bound`), how
`[server] http_listen` and `agent_listen` are read (`split_hostport`), and the error for a port it
cannot listen on (`cannot_listen`). What serves `http_listen` is `llmgw.server.gateways.own`' (the
gateway's workers, or one on this loop), each stopping as every gateway's listener does
(`llmgw.gateway.front.serve_draining`).
"""

from __future__ import annotations

import attrs

from llmgw.errors import MachineError


@attrs.frozen(kw_only=True)
class Bound:
    agent_address: tuple[str, int]
    http_address: tuple[str, int]

    @property
    def admin_url(self) -> str:
        host, port = self.http_address
        return f"http://{_url_host(host)}:{port}"


def cannot_listen(key: str, value: str, exc: OSError) -> MachineError:
    return MachineError(
        f"cannot listen on {value} ([server] {key}): {exc.strerror or exc}; is another llmgw server running, "
        "or is the port taken? Stop it, or set another address in server.toml"
    )


def split_hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
