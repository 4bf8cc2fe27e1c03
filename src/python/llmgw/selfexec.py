"""How llmgw runs itself again (the sim engine, the JSON worker): the same Python and the same code.

Run as a zipapp, `sys.argv[0]` is the zip file (a .pyz, or installed as /usr/local/bin/llmgw
by `llmgw node add`); run from a PEX, $PEX names the file; run as
`python -m llmgw` (a checkout), the package is importable by this interpreter.
"""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path


def llmgw_command() -> list[str]:
    pex = os.environ.get("PEX")  # set by a running PEX (`./pants run`, dist/llmgw.pex) to its own file
    if pex and Path(pex).is_file():
        return [sys.executable, pex]
    first = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if first is not None and first.is_file() and zipfile.is_zipfile(first):
        return [sys.executable, str(first.resolve())]
    return [sys.executable, "-m", "llmgw"]
