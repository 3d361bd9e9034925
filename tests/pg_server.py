"""A private PostgreSQL cluster for tests that stop and start their database server.

The shared server at TRAINSERVE_TEST_DATABASE_URL stays up for every other test (and every parallel xdist
worker); a fault test stops only its own cluster. initdb refuses to run as root, so as root the cluster belongs
to the `postgres` user, as a packaged one does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.integration.conftest import _free_port

BIN_DIRS = sorted(Path("/usr/lib/postgresql").glob("*/bin"))  # Debian's layout; else initdb on the PATH


def _binary(name: str) -> str:
    for folder in reversed(BIN_DIRS):
        if (folder / name).exists():
            return str(folder / name)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is missing: install PostgreSQL's server package (apt-get install postgresql)")
    return found


class PostgresServer:
    """initdb in a temporary folder, then start/stop it on a free port (trust auth, user postgres)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="trainserve-pg-"))
        self.data = self.dir / "data"
        self.port = _free_port()
        self.as_postgres = os.geteuid() == 0
        if self.as_postgres:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run(_binary("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                  "--no-sync")

    def _run(self, *args: str) -> None:
        command = ["runuser", "-u", "postgres", "--", *args] if self.as_postgres else list(args)
        result = subprocess.run(command, capture_output=True, text=True, cwd=self.dir)
        assert result.returncode == 0, f"{' '.join(args)}: {result.stdout}{result.stderr}"

    def start(self) -> None:
        options = f"-p {self.port} -h 127.0.0.1 -k {self.dir} -c fsync=off -c full_page_writes=off"
        self._run(_binary("pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"), "-o", options, "-w",
                  "start")

    def stop(self) -> None:
        self._run(_binary("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def remove(self) -> None:
        """Stop the cluster if it runs and delete its folder."""
        subprocess.run(["runuser", "-u", "postgres", "--"] * self.as_postgres + [
            _binary("pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)
