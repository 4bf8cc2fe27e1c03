"""A gateway's table from a file instead of the link (`llmgw gateway --table-file FILE`): a gateway
with no control plane at all, for tests and benchmarks (`tools/bench/gateway.py`).

The file holds what the link would send, as JSON, with the link's field names and rules
(`llmgw.wire.gateway_link`; unknown keys are errors):

    {"rotation": {"models": ["chat"],
                  "endpoints": [{"replica_id": "r1", "model": "chat", "host": "10.0.0.5",
                                 "port": 8001, "api_key": "ENGINE-KEY"}]},
     "keys": [{"name": "team-a", "token_sha256": "HEX", "models": [],
               "rate_per_minute": 0, "max_concurrency": 0}],
     "share": {"index": 0, "count": 1}}

`share` may be left out (the whole of every limit). It is read once, at start; the link never
comes up (/health says why, naming the file by its base name only: /health needs no key, and a
caller learns nothing of the machine's directories from it; the log line `gateway_ready` names
the whole path for the operator) and the staleness counts from then.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import cattrs

from llmgw.errors import ConfigError
from llmgw.gateway.keys import ALONE
from llmgw.wire.convert import converter
from llmgw.wire.gateway_link import GatewayKey, KeysChanged, RotationChanged, ShareChanged, TableSink

FILE_DETAIL = "no link: serving the table read from {name} at start (--table-file)"


@attrs.frozen(kw_only=True)
class TableFile:
    rotation: RotationChanged
    keys: tuple[GatewayKey, ...]
    share: ShareChanged = ALONE


def parse_table(text: str, label: str) -> TableFile:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(label, [f"not valid JSON: {exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigError(label, [f"expected a JSON object, got a JSON {type(data).__name__}"])
    try:
        return converter.structure(data, TableFile)
    except cattrs.BaseValidationError as exc:
        raise ConfigError(label, cattrs.transform_error(exc, path="$")) from None


def load_table(path: Path) -> TableFile:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), [f"cannot be read: {exc.__class__.__name__}: {exc}"]) from None
    return parse_table(text, str(path))


def feed(sink: TableSink, table: TableFile, *, now: float, path: Path) -> None:
    """Give `sink` the file's table as the link would give it; its link detail (shown by the
    keyless /health) names the file by its base name, not by its path."""
    sink.rotation_changed(table.rotation)
    sink.keys_changed(KeysChanged(keys=table.keys))
    sink.share_changed(table.share)
    sink.heard(now)
    sink.link_state(False, FILE_DETAIL.format(name=Path(path).name))
