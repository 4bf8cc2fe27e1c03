"""A real PostgreSQL for tests: a cluster made with `initdb` in a temporary directory.

One cluster serves a whole test session (one test file under Pants), started and stopped with
`pg_ctl -w`; each test gets a fresh database in it (`CREATE DATABASE t_<n>`), owned by a test
role that logs in over TCP on 127.0.0.1 with a password (scram-sha-256), so the store's
`password_file` is what lets it in. The superuser (`postgres`) is reached over the unix socket in
the cluster's directory, with trust: that is the test's own door, for making databases and
looking behind the store's back.

PostgreSQL refuses to run as root: as root, the cluster's directory belongs to the `postgres`
user (Debian's package makes it) and its programs run as that user through `setpriv`. The
programs are found whatever the version: Debian's /usr/lib/postgresql/<version>/bin (not on
PATH), the newest first, then PATH. Durability is turned off (fsync, synchronous_commit): a
test's cluster is thrown away, and a test on this loaded machine should not wait for fsyncs.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pwd
import re
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from llmgw.config import StoreSection
from testlib.needs import find, missing_message
from testlib.ports import free_port

PACKAGE = "postgresql"
ROLE = "llmgw_test"
START_TIMEOUT_S = 60


def bindir() -> Path:
    """The directory of initdb, pg_ctl and postgres: Debian's versioned one (the newest), else
    where PATH has pg_ctl."""
    versioned = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
        key=lambda p: [int(n) for n in re.findall(r"\d+", p.split("/")[4])] or [0],
    )
    found = versioned[-1] if versioned else find("pg_ctl")
    if found is None:
        pytest.fail(missing_message("PostgreSQL's server programs (initdb, pg_ctl)", PACKAGE))
    return Path(found).resolve().parent


def _runs_as() -> tuple[int, int] | None:
    """The uid and gid the cluster runs as when we are root (PostgreSQL refuses root); None: as us."""
    if os.geteuid() != 0:
        return None
    try:
        user = pwd.getpwnam("postgres")
    except KeyError:
        pytest.fail(
            "PostgreSQL refuses to run as root and there is no postgres user to run it as: "
            + missing_message("the postgres user", PACKAGE)
        )
    return user.pw_uid, user.pw_gid


@attrs.frozen(kw_only=True)
class Database:
    """A database of the test cluster, owned by the test role: its url (no password in it) and
    the password file that lets the role in (None: libpq's own files, for a database given by
    its url, as the chaos bench takes one)."""

    name: str
    url: str
    password_file: Path | None

    @property
    def settings(self) -> StoreSection:
        """server.toml's `[store]` for it."""
        return StoreSection(url=self.url, password_file=str(self.password_file) if self.password_file else "")


class PostgresServer:
    def __init__(self, *, listen: tuple[str, ...] = ("127.0.0.1",), clients: tuple[str, ...] = ()) -> None:
        """`listen`: its addresses (loopback unless a test's machine in a network namespace must
        reach it: then also this machine's side of that machine's link); `clients`: addresses
        besides loopback that the test role may log in from, with its password."""
        self.listen = listen
        self.clients = clients
        self.bin = bindir()
        self.as_user = _runs_as()
        self.dir = Path(tempfile.mkdtemp(prefix="llmgw-test-pg-"))
        self.data = self.dir / "data"
        self.sockets = self.dir / "run"
        self.log = self.dir / "postgres.log"
        self.port = free_port()
        self.password = secrets.token_urlsafe(18)
        # The password file is the test's (root's) own, 0600, outside the cluster's directory.
        self._secrets = Path(tempfile.mkdtemp(prefix="llmgw-test-pgpass-"))
        self.password_file = self._secrets / "store.password"
        self.password_file.write_text(self.password + "\n")
        self.password_file.chmod(0o600)
        self._names = itertools.count(1)
        self.running = False

    # -- the cluster ------------------------------------------------------------------------

    def _run(self, *argv: str, timeout: float = START_TIMEOUT_S) -> str:
        command = [str(self.bin / argv[0]), *argv[1:]]
        if self.as_user is not None:
            uid, gid = self.as_user
            command = [find("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *command]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, cwd=self.dir, env={**os.environ, "LC_ALL": "C"}
        )
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout}{done.stderr}\n{log}")
        return done.stdout

    def init(self) -> PostgresServer:
        self.sockets.mkdir()
        if self.as_user is not None:
            for d in (self.dir, self.sockets):
                os.chown(d, *self.as_user)
        pwfile = self.dir / "superuser.pw"  # initdb wants one for scram; the superuser uses the socket
        pwfile.write_text(secrets.token_urlsafe(18) + "\n")
        if self.as_user is not None:
            os.chown(pwfile, *self.as_user)
        self._run(
            "initdb",
            "--pgdata",
            str(self.data),
            "--username=postgres",
            f"--pwfile={pwfile}",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        )
        pwfile.unlink()
        if self.clients:
            with (self.data / "pg_hba.conf").open("a") as hba:
                for client in self.clients:
                    hba.write(f"host all {ROLE} {client}/32 scram-sha-256\n")
        return self

    def start(self) -> None:
        options = " ".join(
            [
                f"-c listen_addresses={','.join(self.listen)}",
                f"-c port={self.port}",
                f"-c unix_socket_directories={self.sockets}",
                "-c fsync=off",
                "-c synchronous_commit=off",
                "-c full_page_writes=off",
                "-c shared_buffers=16MB",
                "-c max_connections=40",
            ]
        )
        self._run(
            "pg_ctl",
            "start",
            "-w",
            f"--timeout={START_TIMEOUT_S}",
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-o",
            options,
        )
        self.running = True

    def stop(self, mode: str = "fast") -> None:
        """`pg_ctl stop`: "fast" ends every session (as an operator's restart does), "immediate"
        as a crash would."""
        self._run("pg_ctl", "stop", "-w", "-m", mode, "-D", str(self.data))
        self.running = False

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        if self.running:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self._secrets, ignore_errors=True)

    # -- what tests use -------------------------------------------------------------------

    def admin(self):
        """A superuser connection over the unix socket (autocommit): the test's own door."""
        import psycopg

        return psycopg.connect(
            host=str(self.sockets), port=self.port, user="postgres", dbname="postgres", autocommit=True
        )

    def setup_role(self) -> None:
        import psycopg.sql as sql

        with self.admin() as conn:
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(ROLE), sql.Literal(self.password))
            )

    def url(self, dbname: str, host: str = "127.0.0.1") -> str:
        return f"postgresql://{ROLE}@{host}:{self.port}/{dbname}"

    def create_database(self) -> Database:
        """A fresh, empty database owned by the test role."""
        import psycopg.sql as sql

        name = f"t_{next(self._names)}"
        with self.admin() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(name), sql.Identifier(ROLE)))
        return Database(name=name, url=self.url(name), password_file=self.password_file)

    def connect(self, db: Database):
        """A superuser connection to `db` (autocommit), to look at or change what the store holds."""
        import psycopg

        return psycopg.connect(host=str(self.sockets), port=self.port, user="postgres", dbname=db.name, autocommit=True)


def expire_lease(pg: PostgresServer, db: Database) -> None:
    """The leader lease's time runs out, as the database's clock would have it after a TTL."""
    with pg.connect(db) as conn:
        conn.execute("UPDATE leader_lease SET expires_at = 0")


@contextlib.contextmanager
def running_server(**kwargs) -> Iterator[PostgresServer]:
    """A cluster made, started and its test role made; `kwargs` are PostgresServer's."""
    server = PostgresServer(**kwargs)
    try:
        server.init()
        server.start()
        server.setup_role()
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL cluster for the test session (a test file, under Pants)."""
    with running_server() as server:
        yield server


@pytest.fixture
def postgres_db(postgres_server: PostgresServer) -> Database:
    """A fresh database of the session's cluster."""
    if not postgres_server.running:
        postgres_server.start()  # a test that stopped it and failed before starting it again
    return postgres_server.create_database()
