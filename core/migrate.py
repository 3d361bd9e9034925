"""Apply Alembic migrations programmatically (CLI, `trainserve up`, tests)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

ROOT = Path(__file__).resolve().parent.parent


def alembic_config(url: str) -> Config:
    """An Alembic config pointing at the repository's (or the installed package's) migrations and the given database."""
    ini = ROOT / "alembic.ini"
    # An installed wheel (the image) carries migrations/ but no alembic.ini: everything upgrade needs is set here.
    cfg = Config(str(ini)) if ini.is_file() else Config()
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    # '%' is ConfigParser's interpolation marker; URLs may contain it (escaped passwords).
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at `url` up to `revision`."""
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(url), revision)
