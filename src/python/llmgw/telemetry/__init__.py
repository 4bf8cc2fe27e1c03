"""The gateway's traces: OpenTelemetry spans for each forwarded request, exported over OTLP/HTTP
to the collector `[telemetry]` names (docs/operations.md, "Traces").

Off by default, and off costs a branch: `start` returns None for a section without a collector,
and the gateway's hooks are each `if trace is not None`. Nothing of OpenTelemetry is imported
until `start` is given a collector (`llmgw.telemetry.otel` holds all of it), so a gateway that
does not trace neither loads the SDK nor runs its exporter thread.

The file `llmgw gateway --telemetry FILE` reads (`load_section`) is TOML with the `[telemetry]`
table server.toml takes, checked by the same rules.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from llmgw.config import TelemetrySection
from llmgw.errors import ConfigError

if TYPE_CHECKING:
    from llmgw.telemetry.otel import Tracing


def start(section: TelemetrySection, *, instance: str = "") -> Tracing | None:
    """The tracing of this process, its exporter started; None when `section` names no collector.
    `instance`: this process's name among its service's (`service.instance.id`). A `ConfigError`
    for a headers file that cannot be read."""
    if not section.enabled:
        return None
    headers = read_headers(section.headers_file) if section.headers_file else {}
    from llmgw.telemetry.otel import Tracing

    return Tracing(section, headers=headers, instance=instance)


def read_headers(path: str) -> dict[str, str]:
    """The export's headers from `path`: one `Name: value` a line (blank lines and `#` comments
    skipped). The file must not be readable by others: its values are credentials. Problems name
    the line, never a value."""
    try:
        mode = os.stat(path).st_mode
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(path, [f"cannot be read: {exc.__class__.__name__} (the telemetry headers_file)"]) from None
    if mode & 0o077:
        raise ConfigError(path, [f"holds credentials and is readable by others (mode {mode & 0o777:o}); chmod 600 it"])
    headers, problems = {}, []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition(":")
        if not sep or not name.strip() or any(c in name for c in " \t"):
            problems.append(f"line {n}: expected 'Name: value'")
            continue
        headers[name.strip().lower()] = value.strip()
    if problems:
        raise ConfigError(path, problems)
    return headers


def load_section(path: Path) -> TelemetrySection:
    """`[telemetry]` from a TOML file of that one table (`llmgw gateway --telemetry FILE`),
    checked; a `ConfigError` naming the file and every problem."""
    from llmgw.config import parse_toml
    from llmgw.config.checks import check_telemetry
    from llmgw.config.convert import structure

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), [f"cannot be read: {exc.__class__.__name__}: {exc}"]) from None
    data = parse_toml(text, str(path))
    extra = sorted(set(data) - {"telemetry"})
    if extra:
        raise ConfigError(str(path), [f"unknown table {', '.join(map(repr, extra))} (allowed here: telemetry)"])
    section = structure(data.get("telemetry", {}), TelemetrySection, str(path))
    problems = check_telemetry(section)
    if problems:
        raise ConfigError(str(path), problems)
    return section
