"""Python packages made in the test and a PEP 503 package index on loopback serving them, so
real pip installs from it with no network: wheels are built by hand (a zip with its dist-info),
needing neither setuptools nor a build backend, and pip is given only this index."""

from __future__ import annotations

import base64
import hashlib
import io
import zipfile

import attrs
import trio

from llmgw.http.errors import HTTPError
from llmgw.http.messages import Request, Response
from llmgw.http.server import bound_address, serve_http


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def wheel(
    name: str,
    version: str,
    files: dict[str, str | bytes],
    *,
    requires: tuple[str, ...] = (),
    scripts: dict[str, str] | None = None,
) -> tuple[str, bytes]:
    """A pure-Python wheel: its file name and bytes. `files` are paths inside it (the package's
    modules and data); `scripts` are console scripts, `name = module:function`."""
    dist = f"{name.replace('-', '_')}-{version}.dist-info"
    meta = [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"]
    meta += [f"Requires-Dist: {r}\n" for r in requires]
    members: dict[str, bytes] = {p: (c.encode() if isinstance(c, str) else c) for p, c in files.items()}
    members[f"{dist}/METADATA"] = "".join(meta).encode()
    members[f"{dist}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: llmgw-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    if scripts:
        entry = "[console_scripts]\n" + "".join(f"{k} = {v}\n" for k, v in scripts.items())
        members[f"{dist}/entry_points.txt"] = entry.encode()
    record = "".join(f"{p},{_record_hash(d)},{len(d)}\n" for p, d in members.items()) + f"{dist}/RECORD,,\n"
    members[f"{dist}/RECORD"] = record.encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in members.items():
            z.writestr(path, data)
    return f"{name.replace('-', '_')}-{version}-py3-none-any.whl", buf.getvalue()


@attrs.define
class Index:
    """PEP 503: /simple/NAME/ lists NAME's files (with their sha256), /files/FILE serves one."""

    wheels: dict[str, dict[str, bytes]] = attrs.Factory(dict)  # project -> file name -> bytes
    gets: list[str] = attrs.Factory(list)

    def add(self, project: str, filename: str, data: bytes) -> None:
        self.wheels.setdefault(project, {})[filename] = data

    async def handle(self, request: Request) -> Response:
        self.gets.append(request.path)
        html = (("content-type", "text/html"),)
        if request.path.startswith("/simple/"):
            project = request.path.removeprefix("/simple/").strip("/")
            if project not in self.wheels:
                raise HTTPError(404, "no such project")
            links = "".join(
                f'<a href="/files/{f}#sha256={hashlib.sha256(d).hexdigest()}">{f}</a>\n'
                for f, d in sorted(self.wheels[project].items())
            )
            return Response(
                status=200, body=f"<!DOCTYPE html><html><body>\n{links}</body></html>\n".encode(), headers=html
            )
        if request.path.startswith("/files/"):
            name = request.path.removeprefix("/files/")
            for files in self.wheels.values():
                if name in files:
                    return Response(status=200, body=files[name])
        raise HTTPError(404, "no such file")


async def serve_index(nursery: trio.Nursery) -> tuple[Index, str]:
    """A running index and its URL for pip's --index-url."""
    index = Index()
    listeners = await nursery.start(serve_http, index.handle, "127.0.0.1", 0)
    host, port = bound_address(listeners)
    return index, f"http://{host}:{port}/simple"
