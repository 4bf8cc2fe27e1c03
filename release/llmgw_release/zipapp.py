"""Writing the zipapp: a shebang line, then a zip whose bytes depend only on its contents.

Layout (shiv's, so shiv's runtime bootstrap can unpack and run it):

    __main__.py                   llmgw's entry (pyz_main): checks the Python and the machine,
                                  picks SHIV_ROOT, then hands over to shiv's bootstrap
    _bootstrap/                   shiv's bootstrap package, copied from the shiv that builds
    environment.json              shiv's settings: entry point, build id, preamble
    site-packages/                what shiv unpacks: the wheels, llmgw, agent,
      bin/llmgw_preamble.py       run by shiv after unpacking (pyz_preamble)

shiv's own builder is not used because it cannot put a module next to `__main__.py` (so nothing
could choose SHIV_ROOT before its bootstrap runs), and it copies file modes from disk, which
depend on the umask. Here every entry has the same timestamp (SOURCE_DATE_EPOCH) and mode, and
entries are sorted, so two builds of the same inputs are byte-identical (given the same zlib).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
import time
import zipfile
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path

import shiv
from shiv.bootstrap.environment import Environment
from shiv.constants import BUILD_AT_TIMESTAMP_FORMAT

SHEBANG = b"#!/usr/bin/env python3\n"
ZIP_EPOCH = 315532800  # 1980-01-01T00:00:00Z, the earliest time a zip entry can hold
SITE_PACKAGES = "site-packages"
PREAMBLE = "llmgw_preamble.py"
ENTRY_POINT = "llmgw.cli:main"


def shiv_bootstrap() -> dict[str, bytes]:
    """shiv's runtime bootstrap package, as zip entries under `_bootstrap/`."""
    files = importlib.resources.files("shiv.bootstrap")
    return {f"_bootstrap/{f.name}": f.read_bytes() for f in files.iterdir() if f.is_file() and f.name.endswith(".py")}


def build_id(version: str, site: Mapping[str, bytes]) -> str:
    """Names the directory the artifact unpacks to: the version, and a hash of what is unpacked."""
    digest = hashlib.sha256()
    for name in sorted(site):
        digest.update(name.encode() + b"\0" + hashlib.sha256(site[name]).digest())
    return f"llmgw-{version}-{digest.hexdigest()[:16]}"


def environment_json(build: str, epoch: int) -> bytes:
    env = Environment(
        built_at=datetime.fromtimestamp(epoch, tz=timezone.utc).strftime(BUILD_AT_TIMESTAMP_FORMAT),
        shiv_version=shiv.__version__,
        build_id=build,
        entry_point=ENTRY_POINT,
        # Python writes the .pyc of what it imports into the unpacked tree by itself; compiling
        # everything at unpack time would only make the first start slower.
        compile_pyc=False,
        preamble=PREAMBLE,
        reproducible=True,
    )
    return env.to_json().encode()


def assemble(*, version: str, main: bytes, preamble: bytes, site: Mapping[str, bytes], epoch: int) -> dict[str, bytes]:
    """Every entry of the archive, by name."""
    site = {**site, f"bin/{PREAMBLE}": preamble}
    build = build_id(version, site)
    entries = {f"{SITE_PACKAGES}/{name}": data for name, data in site.items()}
    entries.update(shiv_bootstrap())
    entries["environment.json"] = environment_json(build, epoch)
    entries["__main__.py"] = main
    return entries


def write(path: Path, entries: Mapping[str, bytes], epoch: int) -> None:
    date_time = time.gmtime(max(epoch, ZIP_EPOCH))[:6]
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        f.write(SHEBANG)
        with zipfile.ZipFile(f, "w") as z:
            for name in sorted(entries):
                info = zipfile.ZipInfo(name, date_time=date_time)
                info.compress_type = zipfile.ZIP_DEFLATED
                info.create_system = 3  # Unix, so the mode below is read
                info.external_attr = 0o100644 << 16  # shiv's bootstrap restores it on unpacking
                z.writestr(info, entries[name], compresslevel=6)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
