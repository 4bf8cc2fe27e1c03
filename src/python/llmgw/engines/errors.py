"""Errors of llmgw.engines, by who has to act. Both exit 2 from the CLI: nothing was checked or
started, which a script must not mistake for `engine-check`'s 1 (warnings only)."""

from __future__ import annotations

from llmgw.errors import LlmgwError


class LaunchError(LlmgwError):
    """A replica spec this engine cannot launch; the catalog entry (or the placement) is at fault."""

    exit_status = 2


class EngineHelpError(LlmgwError):
    """The installed engine could not be asked for its help: not found, failed, or hung. The
    operator installs it, names it with --binary, or passes its help as text."""

    exit_status = 2
