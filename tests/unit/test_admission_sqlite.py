"""Admission is atomic on SQLite too (local mode): concurrent count-then-insert stops exactly at the cap."""

from __future__ import annotations

import threading

from sqlalchemy import func, select

from core.admission import admit_endpoint
from core.db import make_engine, make_sessionmaker
from core.errors import TooManyRequests
from core.migrate import upgrade
from core.rows import WebhookEndpoint
from core.settings import Settings
from core.store import webhooks as store


def test_concurrent_registrations_on_sqlite_leave_exactly_the_cap(tmp_path):
    url = f"sqlite:///{tmp_path / 'db' / 'trainserve.db'}"
    (tmp_path / "db").mkdir()
    upgrade(url)
    settings = Settings(home=tmp_path, database_url=url, max_webhook_endpoints=3)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    outcomes: list[str] = []
    start = threading.Barrier(10, timeout=30)

    def register() -> None:
        with sessions() as session:
            session.scalar(select(func.count()).select_from(WebhookEndpoint))  # an earlier read, as a route does
            start.wait()
            try:
                admit_endpoint(session, settings, tenant_id="t")
            except TooManyRequests:
                outcomes.append("refused")
                return
            store.add_endpoint(session, tenant_id="t", url="https://example.com/h", event_types=["job.queued"],
                               description="", secret="whsec_x")
            session.commit()
            outcomes.append("created")

    threads = [threading.Thread(target=register) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    with sessions() as session:
        stored = store.count_endpoints(session, tenant="t")
    engine.dispose()
    assert (outcomes.count("created"), outcomes.count("refused"), stored) == (3, 7, 3)
