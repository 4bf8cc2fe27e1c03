"""Errors of the gateway process, by blame."""

from __future__ import annotations

from llmgw.errors import MachineError


class WorkerFailed(MachineError):
    """A worker process ended before it served: the same cause would end every restart (a port
    taken, a certificate missing), so the gateway stops and says so."""

    def __init__(self, index: int, returncode: int | None) -> None:
        self.index, self.returncode = index, returncode
        how = "could not be started" if returncode is None else f"exited with status {returncode}"
        super().__init__(f"gateway worker {index} {how} before it was ready to serve; its error is above")
