"""Alembic is the only way the schema is made: upgrade from empty works and matches the ORM models."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from core.migrate import upgrade
from core.rows import Base


def _diff(url: str) -> list:
    engine = create_engine(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    engine.dispose()
    return diff


def test_sqlite_upgrade_from_empty_matches_models(tmp_path):
    url = f"sqlite:///{tmp_path / 'db' / 'trainserve.db'}"
    upgrade(url)
    engine = create_engine(url)
    assert set(inspect(engine).get_table_names()) >= {"datasets", "jobs", "metric_points", "job_events",
                                                      "artifacts", "alembic_version"}
    engine.dispose()
    assert _diff(url) == []
    upgrade(url)  # idempotent


def test_postgres_upgrade_from_empty_matches_models(pg_url):
    assert _diff(pg_url) == []


def test_migration_file_names_follow_the_convention():
    import re
    from pathlib import Path

    versions = Path(__file__).resolve().parents[2] / "migrations" / "versions"
    names = [p.name for p in versions.glob("*.py")]
    assert names and all(re.match(r"^\d{4}-\d{2}-\d{2}_\w+_\w+\.py$", n) for n in names), names
