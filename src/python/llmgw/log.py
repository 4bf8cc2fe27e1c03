"""Structured logging: one line per event, `key=value` or JSON, to standard error.

Code logs events, not sentences: `log.info("node_joined", node=node_id, addr=addr)`. The
formatter renders the event name and its fields; nothing else decides the format.

Secrets never reach the output, by two independent rules: a `config.Secret` renders as
`<redacted>` wherever it appears, and a field whose name says it holds a secret (key, token,
password, credential, secret, authorization) is redacted whatever its value is.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any, TextIO

from llmgw.secret import Secret  # not llmgw.config: see llmgw.secret

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("kv", "json")

_SECRET_FIELD = re.compile(r"(^|_)(key|token|password|passwd|credential|secret|authorization|api_key)s?($|_)", re.I)
_BARE = re.compile(r"^[A-Za-z0-9_./:@+-]+$")
REDACTED = "<redacted>"


def redact(name: str, value: Any) -> Any:
    if isinstance(value, Secret) or (_SECRET_FIELD.search(name) and value not in (None, "", False)):
        return REDACTED
    if isinstance(value, dict):
        return {k: redact(str(k), v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(name, v) for v in value]
    return value


class Logger:
    """A thin front on `logging.Logger` taking an event name and keyword fields."""

    def __init__(self, name: str) -> None:
        self._log = logging.getLogger(name)

    def _emit(self, level: int, event: str, fields: dict[str, Any], exc_info: bool = False) -> None:
        if self._log.isEnabledFor(level):
            self._log.log(level, event, extra={"llmgw_fields": fields}, exc_info=exc_info)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, event, fields)

    def exception(self, event: str, **fields: Any) -> None:
        """An error with its traceback; only inside an `except` block."""
        self._emit(logging.ERROR, event, fields, exc_info=True)


def get_logger(name: str) -> Logger:
    return Logger(name)


def _kv_value(value: Any) -> str:
    if isinstance(value, (dict, list, tuple)):
        value = json.dumps(value, default=str, separators=(",", ":"))
    text = str(value)
    return text if text and _BARE.match(text) else json.dumps(text)


class EventFormatter(logging.Formatter):
    def __init__(self, fmt: str) -> None:
        super().__init__()
        self.fmt = fmt

    def format(self, record: logging.LogRecord) -> str:
        fields = {k: redact(k, v) for k, v in getattr(record, "llmgw_fields", {}).items()}
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        head = {"ts": ts, "level": record.levelname.lower(), "logger": record.name, "event": record.getMessage()}
        if record.exc_info:
            fields["traceback"] = self.formatException(record.exc_info)
        if self.fmt == "json":
            return json.dumps({**head, **fields}, default=str)
        return " ".join(f"{k}={_kv_value(v)}" for k, v in {**head, **fields}.items())


_settings = {"level": "info", "format": "kv"}


def settings() -> tuple[str, str]:
    """The level and format `setup` was last given: what llmgw tells a process of its own it starts."""
    return _settings["level"], _settings["format"]


def setup(level: str = "info", fmt: str = "kv", stream: TextIO | None = None) -> None:
    """Route every logger (ours and libraries') through one handler; idempotent."""
    _settings.update(level=level, format=fmt)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "llmgw", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.llmgw = True  # type: ignore[attr-defined]
    handler.setFormatter(EventFormatter(fmt))
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
