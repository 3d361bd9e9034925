"""Database engine and session factory, the same code on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker


def make_engine(url: str, *, pool_size: int | None = None, max_overflow: int | None = None,
                pool_timeout_s: float | None = None) -> Engine:
    """Create an engine; SQLite gets WAL and a busy timeout because API and workers share the file.

    Pool bounds default to SQLAlchemy's (5 + 10 overflow, 30 s wait); the API passes its settings, and a
    request that waits longer than `pool_timeout_s` for a connection gets 503 database_unavailable.
    """
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    for name, value in (("pool_size", pool_size), ("max_overflow", max_overflow), ("pool_timeout", pool_timeout_s)):
        if value is not None:
            kwargs[name] = value
    if url.startswith("sqlite"):
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
    engine = create_engine(url, **kwargs)
    if url.startswith("sqlite"):
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded attributes after commit, so rows can be serialised afterwards."""
    return sessionmaker(bind=engine, expire_on_commit=False)


def release(session: Session) -> None:
    """End the session's transaction and give its connection back to the pool before a wait on a client or
    the network; rows already loaded stay readable (expire_on_commit is off), a later query takes a fresh one."""
    session.commit()


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
