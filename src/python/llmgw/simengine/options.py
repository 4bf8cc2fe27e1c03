"""What one sim engine process is asked to do, checked once: `SimOptions`.

The command line (`llmgw.commands.engine`) is the only source; every cross-flag rule lives in
`SimOptions.check` so a bad combination is refused before anything listens.
"""

from __future__ import annotations

import attrs

from llmgw.errors import UsageError

DEFAULT_PORT = 8080
DEFAULT_MAX_TOKENS = 256
# torch.distributed's TCPStore waits 300 s for its members by default; so does the sim.
DEFAULT_RENDEZVOUS_TIMEOUT_S = 300.0


@attrs.frozen(kw_only=True)
class SimOptions:
    model: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str | None = attrs.field(default=None, repr=False)
    prompt_token_ms: float = 0.0
    output_token_ms: float = 0.0
    max_tokens_default: int = DEFAULT_MAX_TOKENS
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: tuple[str, int] | None = None
    rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S
    startup_delay_s: float = 0.0
    fail_after_s: float | None = None

    def check(self) -> SimOptions:
        """Self, or a `UsageError` naming the flag at fault and what would be right."""
        if not self.model.strip():
            raise UsageError("--model is empty; give the name clients will ask for")
        if self.nnodes < 1:
            raise UsageError(f"--nnodes {self.nnodes} is not a number of nodes; use 1 or more")
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}; use 0..{self.nnodes - 1}"
            )
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise UsageError(
                f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT, rank 0's rendezvous address, "
                "the same on every member"
            )
        if self.api_key is not None and not self.api_key:
            raise UsageError("--api-key is empty; give a key or leave the flag out to serve without one")
        return self

    @property
    def is_worker(self) -> bool:
        return self.node_rank > 0


def parse_addr(text: str) -> tuple[str, int]:
    """`HOST:PORT` or `[V6]:PORT` as (host, port); ValueError saying what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{text!r} is not HOST:PORT (e.g. 10.0.0.1:29500 or [fd00::1]:29500)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{text!r}: write an IPv6 address in brackets, e.g. [{host}]:{port}")
    number = int(port)
    if not 0 < number < 65536:
        raise ValueError(f"{text!r}: port {number} is not in 1..65535")
    return host, number


def format_addr(addr: tuple[str, int]) -> str:
    host, port = addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
