"""`[store] url`: which database holds the control plane's state, read without a driver.

The value is "sqlite" (the state directory's `llmgw.db`, the default) or a libpq connection
string: a URI (`postgresql://USER@HOST:PORT,HOST:PORT/DBNAME?target_session_attrs=read-write`)
or keywords (`host=db1,db2 port=5432 dbname=llmgw user=llmgw`), parsed here by libpq's own
rules (https://www.postgresql.org/docs/current/libpq-connect.html#LIBPQ-CONNSTRING) so that
the configuration is checked, and the url printed, without importing psycopg: a SQLite user
never loads it, and a bad url is a config error with its path, not a driver's traceback.

Two invariants: a password never comes from the url (`problems` refuses one, naming
`password_file` and libpq's own files instead), and the url is never printed whole: `redact`
keeps the hosts, ports and database name, and drops the user and every other parameter.
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

import attrs

SQLITE = "sqlite"
SCHEMES = ("postgresql://", "postgres://")
# Parameters that carry a secret: refused in the url (server.toml is read by more than the
# server and copied around); the password comes from password_file, ~/.pgpass or PGPASSFILE.
SECRET_KEYS = ("password", "sslpassword")
EXAMPLE = "postgresql://llmgw@db1:5432,db2:5432/llmgw?target_session_attrs=read-write"


class BadUrl(ValueError):
    """The text is neither "sqlite" nor a connection string libpq would read. The message never
    quotes the text (it may hold a password)."""


@attrs.frozen(kw_only=True)
class ConnInfo:
    """A connection string's parameters by libpq keyword (a URI's parts under the keywords
    libpq gives them: user, password, host, port, dbname)."""

    form: str  # "uri" or "keywords"
    params: dict[str, str]

    def get(self, key: str) -> str:
        return self.params.get(key, "")


def is_postgresql(url: str) -> bool:
    return url != SQLITE


def parse(text: str) -> ConnInfo:
    if text.startswith(SCHEMES):
        return ConnInfo(form="uri", params=_parse_uri(text))
    if "=" in text:
        return ConnInfo(form="keywords", params=_parse_keywords(text))
    raise BadUrl(
        f'expected "{SQLITE}" (the state directory\'s llmgw.db) or a PostgreSQL connection string, either a URI '
        f"starting with postgresql:// (e.g. {EXAMPLE}) or keywords (host=db1 port=5432 dbname=llmgw user=llmgw)"
    )


def _parse_uri(text: str) -> dict[str, str]:
    rest = text.split("://", 1)[1]
    authority_end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    authority, rest = rest[:authority_end], rest[authority_end:]
    params: dict[str, str] = {}
    userinfo, at, hostlist = authority.rpartition("@")
    if at:
        user, colon, password = userinfo.partition(":")
        if user:
            params["user"] = unquote(user)
        if colon:
            params["password"] = unquote(password)
    hosts, ports = [], []
    for spec in hostlist.split(",") if hostlist else []:
        m = re.fullmatch(r"(\[[^\]]*\]|[^:\[\]]*)(?::(\d*))?", spec)
        if m is None:
            raise BadUrl(f"a host of the URI cannot be read: {spec!r}; write HOST:PORT or [IPv6]:PORT")
        hosts.append(unquote(m.group(1).strip("[]")))
        ports.append(m.group(2) or "")
    if any(hosts):
        params["host"] = ",".join(hosts)
    if any(ports):
        params["port"] = ",".join(ports)
    path, _, query = rest.partition("?")
    if path.strip("/"):
        params["dbname"] = unquote(path[1:])
    for pair in query.split("&") if query else []:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise BadUrl("a parameter of the URI has no value: write ?key=value&key=value")
        params[unquote(key)] = unquote(value)
    return params


def _parse_keywords(text: str) -> dict[str, str]:
    """libpq's `conninfo_parse`: `key = value` pairs separated by spaces; a value is a run of
    non-spaces or a single-quoted string, `\\` escaping the next character in either."""
    params: dict[str, str] = {}
    i, n = 0, len(text)
    while True:
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            return params
        start = i
        while i < n and text[i] != "=" and not text[i].isspace():
            i += 1
        key = text[start:i]
        while i < n and text[i].isspace():
            i += 1
        if i >= n or text[i] != "=":
            raise BadUrl(f'missing "=" after {key!r} in the connection string: write key=value pairs')
        i += 1
        while i < n and text[i].isspace():
            i += 1
        value: list[str] = []
        if i < n and text[i] == "'":
            i += 1
            while True:
                if i >= n:
                    raise BadUrl(f"the quoted value of {key!r} is not closed: end it with '")
                if text[i] == "\\" and i + 1 < n:
                    value.append(text[i + 1])
                    i += 2
                elif text[i] == "'":
                    i += 1
                    break
                else:
                    value.append(text[i])
                    i += 1
        else:
            while i < n and not text[i].isspace():
                if text[i] == "\\" and i + 1 < n:
                    value.append(text[i + 1])
                    i += 2
                else:
                    value.append(text[i])
                    i += 1
        if not key:
            raise BadUrl('a "=" without a key before it in the connection string: write key=value pairs')
        params[key] = "".join(value)


def redact(url: str) -> str:
    """The url as it may be printed: `postgresql://HOST:PORT,.../DBNAME`, with no user, no
    password and no other parameter; "sqlite" as it is; a url that cannot be read, as
    `postgresql://(unreadable)`."""
    if not is_postgresql(url):
        return url
    try:
        info = parse(url)
    except BadUrl:
        return "postgresql://(unreadable)"
    hosts = (info.get("host") or info.get("hostaddr")).split(",") if (info.get("host") or info.get("hostaddr")) else []
    ports = info.get("port").split(",") if info.get("port") else []
    if len(ports) == 1:
        ports = ports * max(len(hosts), 1)  # one port is every host's (libpq's rule)
    parts = []
    for i in range(max(len(hosts), len(ports))):
        host = hosts[i] if i < len(hosts) else ""
        port = ports[i] if i < len(ports) else ""
        if host.startswith("/"):
            host = quote(host, safe="")  # a socket directory, as libpq's URIs write it
        elif ":" in host:
            host = f"[{host}]"
        parts.append(f"{host}:{port}" if port else host)
    return f"postgresql://{','.join(parts)}/{info.get('dbname')}"


def problems(
    url: str, password_file: str, *, url_key: str = "$.store.url", password_key: str = "$.store.password_file"
) -> list[str]:
    """What is wrong with a store's url and password file, each ending with where it was given
    (`@ $.store.url` in server.toml; a command's flags name themselves)."""
    if not is_postgresql(url):
        if password_file:
            return [
                f'a password file is for a PostgreSQL url; the url is "{SQLITE}" (the state directory\'s llmgw.db), '
                f"which needs none: remove the password file, or give a PostgreSQL url @ {password_key}"
            ]
        return []
    try:
        info = parse(url)
    except BadUrl as exc:
        return [f"{exc} @ {url_key}"]
    found = []
    secrets = [k for k in SECRET_KEYS if k in info.params]
    if secrets:
        found.append(
            f"the url holds a {' and an '.join(secrets)} ({redact(url)}, shown without it); a url is no place for a "
            "secret (server.toml is read by more than the server, a command line by every user of the machine): "
            "remove it, and put the password in a file named by password_file (mode 0600), or in ~/.pgpass or the "
            f"file PGPASSFILE names (libpq's own password files) @ {url_key}"
        )
    if password_file and not password_file.startswith("/"):
        found.append(f"expected an absolute path, got {password_file!r} @ {password_key}")
    return found
