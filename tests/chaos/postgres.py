"""A throwaway PostgreSQL cluster for a test deployment's metadata DB, as MWAA uses (PostgreSQL,
not SQLite): Debian's server binaries, an unprivileged cluster in a temp dir, trust auth on
127.0.0.1 only, stopped (and its files removed) at teardown.

    with PostgresCluster() as pg:          # in a new temp dir, removed at stop
        env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = pg.url("airflow")

PostgreSQL refuses to run as root: as root the commands run as `nobody` (`runuser`), with the
directory handed to that user; otherwise they run as the current user. Airflow derives its async
URL (the API server's) from the sync one: `postgresql+psycopg2` -> `postgresql+asyncpg`, so both
drivers are in requirements-dev.txt.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

BIN = Path(os.environ.get("LLMOPS_PG_BIN", "/usr/lib/postgresql/15/bin"))
USER = "airflow"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PostgresError(RuntimeError):
    pass


class StartStop:
    """`with thing:` starts it and stops it at the end, and stops what a failed start left
    running (a KeyboardInterrupt during start included)."""

    def start(self) -> Any:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class PostgresCluster(StartStop):
    """initdb + pg_ctl start in `directory` (default: a new temp dir; either way nobody must be
    able to reach it, which a dir under a 0700 pytest tmp_path is not); `stop()` (also from
    `__exit__`, on any exception or KeyboardInterrupt) stops it with `-m fast` and removes it."""

    def __init__(self, directory: Path | None = None, port: int | None = None):
        self.dir = Path(directory or tempfile.mkdtemp(prefix="llmops-pg-"))
        self.data = self.dir / "data"
        self.port = port or _free_port()
        self.started = False
        self.as_nobody = os.geteuid() == 0

    def _cmd(self, *args: str) -> list[str]:
        return (["runuser", "-u", "nobody", "--"] if self.as_nobody else []) + list(args)

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        proc = subprocess.run(self._cmd(*args), capture_output=True, text=True, timeout=timeout,
                              cwd=self.dir)
        if proc.returncode:
            log = self.dir / "log"
            raise PostgresError(f"{' '.join(args[:2])} failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                                f"\n{proc.stderr[-2000:]}\n{log.read_text()[-2000:] if log.exists() else ''}")
        return proc

    def start(self, timeout: float = 60) -> "PostgresCluster":
        if not (BIN / "initdb").exists():
            raise PostgresError(f"no PostgreSQL server binaries in {BIN} (Debian's postgresql "
                                "package; set LLMOPS_PG_BIN to another bin directory)")
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.as_nobody:
            shutil.chown(self.dir, "nobody")
        self._run(str(BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", USER, "-E", "UTF8")
        options = (f"-k {self.dir} -p {self.port} -c listen_addresses=127.0.0.1 "
                   # A test DB: durability is not what we measure, and fsync costs the 2 cores.
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
                   "-c max_connections=300")
        self._run(str(BIN / "pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.dir / "log"),
                  "-w", "-t", str(int(timeout)), "start", timeout=timeout + 10)
        self.started = True
        self.create_database(USER)
        return self

    def create_database(self, name: str) -> None:
        self.psql(f'CREATE DATABASE "{name}"', database="postgres")

    def psql(self, sql: str, database: str = USER) -> str:
        return self._run(str(BIN / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", USER,
                         "-d", database, "-v", "ON_ERROR_STOP=1", "-Atc", sql).stdout

    def url(self, database: str = USER, driver: str = "psycopg2") -> str:
        return f"postgresql+{driver}://{USER}@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        if self.started:
            self.started = False
            subprocess.run(self._cmd(str(BIN / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w",
                                     "-t", "60", "stop"), capture_output=True, timeout=90, cwd=self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)

