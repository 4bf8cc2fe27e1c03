"""The admin API client used by `llmgw ctl`, `llmgw node` and `llmgw ca issue`.

Finds the control plane in one of two ways: `--server URL` with `--credential FILE`, or a
local control plane's state directory (`--state-dir`, $LLMGW_STATE_DIR, or the default), whose
`admin.url` a running server wrote and whose `admin.token` is the credential. Synchronous:
one request per command, stdlib `http.client`.

Where several control planes share a store, a standby answers every admin call with 503 and
`{"error": {"code": "not_leader", "leader": {"admin_url": ...}}}`: the request is sent again, once,
to the leader's admin URL it names, with the same credential (every control plane of a cluster
holds the same one). A standby that knows no leader (a takeover under way) is answered as any
503: the message says so and to try again.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from llmgw import paths
from llmgw.config import DEFAULT_SERVER_STATE_DIR
from llmgw.ctl.errors import NoControlPlane, NotAnswering
from llmgw.errors import MachineError, PeerError, UsageError

TIMEOUT_S = 30.0
NODES_PAGE = 1000  # nodes a request asks for when listing all of them


class AdminClient:
    def __init__(self, url: str, token: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(f"admin URL {url!r} must look like http://HOST:PORT")
        self.url = url.rstrip("/")
        self._parts = parts
        self._token = token

    @classmethod
    def locate(cls, *, server: str | None, credential: str | None, state_dir: str | None) -> AdminClient:
        if server:
            if not credential:
                raise UsageError("--server needs --credential FILE (a copy of the control plane's admin.token)")
            return cls(server, paths.read_admin_token(Path(credential)))
        directory = paths.state_dir_from(state_dir, DEFAULT_SERVER_STATE_DIR)
        url_file = paths.admin_url_path(directory)
        token_file = Path(credential) if credential else paths.admin_token_path(directory)
        try:
            url = url_file.read_text().strip()
        except FileNotFoundError:
            raise NoControlPlane(
                f"no control plane has run with state directory {directory} ({url_file} is missing); start "
                "`llmgw server`, or point at one with --state-dir DIR or --server URL --credential FILE"
            ) from None
        except PermissionError:
            raise MachineError(f"cannot read {url_file}; run the command with sudo") from None
        return cls(url, paths.read_admin_token(token_file))

    def request(
        self, method: str, path: str, body: Any = None, *, follow: bool = True, timeout_s: float = TIMEOUT_S
    ) -> Any:
        """One call; a standby's answer is followed to the leader it names (`follow`, once).
        `timeout_s`: how long a call that asks the control plane to reach out (the Hub) may take."""
        status, data, raw = self._exchange(method, path, body, timeout_s)
        leader = _leader_of(status, data)
        if follow and leader and leader.rstrip("/") != self.url:
            return AdminClient(leader, self._token).request(method, path, body, follow=False, timeout_s=timeout_s)
        if status >= 400:
            message = (data or {}).get("error", {}).get("message", raw.decode("utf-8", "replace"))
            error = UsageError if status in (404, 405) else PeerError
            raise error(f"{message} (HTTP {status} from {self.url})")
        return data

    def _exchange(self, method: str, path: str, body: Any, timeout_s: float = TIMEOUT_S) -> tuple[int, Any, bytes]:
        conn_cls = http.client.HTTPSConnection if self._parts.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(self._parts.hostname, self._parts.port, timeout=timeout_s)
        headers = {"authorization": f"Bearer {self._token}", "accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["content-type"] = "application/json"
        try:
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            body = response.read()
        except ConnectionRefusedError:
            raise NotAnswering(f"no control plane answers at {self.url}: is `llmgw server` running?") from None
        except (OSError, http.client.HTTPException) as exc:
            raise PeerError(f"the admin API at {self.url} failed: {exc}") from None
        finally:
            conn.close()
        try:
            data = json.loads(body or b"null")
        except ValueError:
            raise PeerError(
                f"the admin API at {self.url} answered {response.status} with a body that is not JSON"
            ) from None
        return response.status, data, body

    def nodes(self, *, state: str = "") -> list[dict[str, Any]]:
        return self.cluster(state=state)["nodes"]

    def gateways(self) -> list[dict[str, Any]]:
        """The gateway instances connected now (name, instance, address, cert_serial in hex, ...)."""
        return self.request("GET", "/admin/v1/gateways")["gateways"]

    def authority(self) -> dict[str, Any]:
        """The CA the control plane signs with: common_name, fingerprint_sha256, not_after."""
        return self.request("GET", "/admin/v1/authority")["ca"]

    def cluster(self, *, state: str = "", limit: int | None = None, after: str = "") -> dict[str, Any]:
        """Nodes (in `state`, if given), the fabrics placement sees, and notes for the operator.
        `limit`: one page of at most that many nodes after `after`, its `next` saying where the
        next one starts (null on the last); None: every node, fetched a page of `NODES_PAGE` at
        a time."""
        query = {"state": state} if state else {}
        if limit is not None:
            return self.request("GET", "/admin/v1/nodes?" + urlencode({**query, "limit": limit, "after": after}))
        nodes: list[dict[str, Any]] = []
        while True:
            page = self.request("GET", "/admin/v1/nodes?" + urlencode({**query, "limit": NODES_PAGE, "after": after}))
            nodes += page["nodes"]
            after = page.get("next") or ""
            if not after:
                return {**page, "nodes": nodes, "next": None}

    def cordon(self, node_id: str, cordoned: bool) -> dict[str, Any]:
        action = "cordon" if cordoned else "uncordon"
        return self.request("POST", f"/admin/v1/nodes/{quote(node_id, safe='')}/{action}")["node"]

    def remove_node(self, node_id: str) -> dict[str, Any]:
        return self.request("DELETE", f"/admin/v1/nodes/{quote(node_id, safe='')}")

    def record_certificate(
        self,
        serial: int,
        node_id: str,
        not_after: float,
        *,
        revoke_others: bool = False,
        also_revoke: Sequence[int] = (),
    ) -> list[int]:
        """Have the control plane record a certificate it issued (server.store `record_issued`);
        returns the serials it revoked with it."""
        body = {
            "serial": str(serial),
            "node_id": node_id,
            "not_after": not_after,
            "revoke_others": revoke_others,
            "also_revoke": [str(n) for n in also_revoke],
        }
        return [int(n) for n in self.request("POST", "/admin/v1/certificates", body)["revoked_serials"]]

    def is_revoked(self, serial: int) -> bool:
        return bool(self.request("GET", f"/admin/v1/certificates/{serial}")["revoked"])


def _leader_of(status: int, data: Any) -> str:
    """The leader's admin URL a standby's answer names; "" for any other answer."""
    if status != 503 or not isinstance(data, dict):
        return ""
    error = data.get("error")
    if not isinstance(error, dict) or error.get("code") != "not_leader":
        return ""
    leader = error.get("leader")
    url = leader.get("admin_url") if isinstance(leader, dict) else None
    return url if isinstance(url, str) and url.startswith(("http://", "https://")) else ""
