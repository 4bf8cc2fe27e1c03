"""The llama.cpp half of the release build's errors (the zipapps' is `build.BuildError`).

`LlamaBuildError` is raised by every step of a portable llama.cpp archive: its source fetched
(`llamabuild`), compiled (`llamacompile`), unpacked or run (`llamabuild`, `llamasmoke`); what
imports it from `llamabuild` finds it there too. Standard library only, CPython 3.9+.
"""

from __future__ import annotations


class LlamaBuildError(Exception):
    """llama.cpp could not be fetched, built, checked or run; the message says what and what to do."""
