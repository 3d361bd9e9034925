"""Fair-share claiming on real PostgreSQL: tenant turns by recent device time, priority, device limits, placement."""

from __future__ import annotations

from datetime import timedelta

from core import job_order, states
from core.db import session_scope
from core.rows import Job, JobStatus, OutboxMessage, new_id, utcnow
from core.store import jobs as store


def _job(factory, tenant: str, *, priority: int = 0, age_s: float = 0.0) -> str:
    job = Job(id=new_id("job"), tenant_id=tenant, task="text-classification", text_column="text",
              hyperparameters={}, metrics={}, priority=priority, created_at=utcnow() - timedelta(seconds=age_s))
    with session_scope(factory) as session:
        states.create(session, job)
    return job.id


def _claim(factory, settings) -> Job | None:
    with session_scope(factory) as session:
        return job_order.claim_next(session, settings, device="cpu", now=utcnow())


def _finish(factory, job: Job, *, ran_s: float) -> None:
    """End a claimed job as if it had run `ran_s` seconds (its device time counts for its tenant)."""
    with session_scope(factory) as session:
        row = store.get_job(session, job_id=job.id)
        states.move(session, row, JobStatus.SUCCEEDED, attempt=row.attempts, message="done",
                    now=(row.claimed_at or utcnow()) + timedelta(seconds=ran_s))


def _place(factory, settings, job_id: str) -> tuple[int, str] | None:
    with factory() as session:
        return job_order.place(session, settings, store.get_job(session, job_id=job_id), now=utcnow())


def test_tenants_take_turns_and_priority_orders_within_a_tenant(factory, settings):
    a = [_job(factory, "team-a", age_s=100 - i) for i in range(3)]
    urgent = _job(factory, "team-a", priority=5)  # newest, but first among team-a's
    b = [_job(factory, "team-b", age_s=50 - i) for i in range(2)]
    order = []
    while (job := _claim(factory, settings)) is not None:
        order.append(job.id)
        _finish(factory, job, ran_s=1.0)
    assert order == [urgent, b[0], a[0], b[1], a[1], a[2]]


def test_least_recent_device_time_goes_first(factory, settings):
    settings.fair_share_quantum_s = 10.0
    heavy = _job(factory, "team-a", age_s=30)
    job = _claim(factory, settings)
    assert job is not None and job.id == heavy
    _finish(factory, job, ran_s=120.0)  # team-a used two minutes
    _job(factory, "team-b", age_s=1)
    _finish(factory, _claim(factory, settings), ran_s=5.0)  # team-b: 5 s
    waiting_a, waiting_b = _job(factory, "team-a", age_s=20), _job(factory, "team-b", age_s=10)
    _job(factory, "team-b")
    assert _claim(factory, settings).id == waiting_b  # team-b's turn again, although team-a waited longer
    settings.tenant_weights = "team-a=100"  # 120 s at weight 100 is under one quantum: turns by last start
    assert _claim(factory, settings).id == waiting_a


def test_device_limit_holds_a_tenant_back_and_its_release_wakes_a_worker(factory, settings):
    settings.tenant_device_limits = "team-a=1"
    first, second = _job(factory, "team-a", age_s=10), _job(factory, "team-a", age_s=5)
    running = _claim(factory, settings)
    assert running is not None and running.id == first
    assert _claim(factory, settings) is None  # the limit, not an empty queue
    assert _place(factory, settings, second) == (1, "tenant at its device limit (1 of 1 devices in use)")
    _finish(factory, running, ran_s=1.0)
    with factory() as session:  # the end of the run left a wake-up message for the job it held back
        wakes = session.query(OutboxMessage).filter_by(job_id=second).count()
    assert wakes == 2  # its own message from creation, and the wake-up
    assert _claim(factory, settings).id == second


def test_queue_position_and_waiting_reason(factory, settings):
    a = [_job(factory, "team-a", age_s=100 - i) for i in range(3)]
    b = [_job(factory, "team-b", age_s=50 - i) for i in range(3)]
    # Nobody has run yet: team-a goes first by name, then the teams alternate a0 b0 a1 b1 a2 b2.
    assert _place(factory, settings, a[0]) == (1, "next in line; waiting for a free worker")
    assert _place(factory, settings, b[0]) == (2, "behind 1 job of teams whose turn comes first")
    assert _place(factory, settings, a[2]) == (5, "behind 2 jobs of your team and 2 of other teams taking turns")
    assert _place(factory, settings, b[2]) == (6, "behind 2 jobs of your team and 3 of other teams taking turns")
    claimed = _claim(factory, settings)
    assert claimed is not None and claimed.id == a[0]
    assert _place(factory, settings, a[0]) is None  # running: no place in the queue


def test_a_job_another_transaction_only_references_is_still_claimed_in_turn(factory, settings):
    """Broker recovery inserts an outbox row per queued job in one transaction; each insert holds FOR KEY SHARE on
    its job's row until commit. The claim must still take the tenant's oldest job, not skip it as locked."""
    from core.store import outbox

    oldest, newer = _job(factory, "team-a", age_s=20), _job(factory, "team-a", age_s=10)
    with factory() as recovering:  # open, uncommitted: the first job's row is referenced by a new outbox row
        outbox.add_train(recovering, job_id=oldest, devices=1)
        recovering.flush()
        job = _claim(factory, settings)
        recovering.rollback()
    assert job is not None and job.id == oldest, (job and job.id, oldest, newer)


def test_a_job_whose_row_the_relay_holds_is_waited_for_not_passed_over(factory, settings):
    """The relay stamps a job's task id as it sends its message (an UPDATE holding the row until commit): a claim
    meanwhile waits for that row and takes the tenant's oldest job, never the next one."""
    import threading

    from sqlalchemy import update

    oldest, _newer = _job(factory, "team-a", age_s=20), _job(factory, "team-a", age_s=10)
    claimed: list[Job | None] = []
    with factory() as relay:
        relay.execute(update(Job).where(Job.id == oldest).values(task_id="sent"))
        claimer = threading.Thread(target=lambda: claimed.append(_claim(factory, settings)))
        claimer.start()
        claimer.join(0.5)
        assert claimer.is_alive()  # waiting on the row, not skipping it
        relay.commit()
    claimer.join(10)
    assert claimed and claimed[0] is not None and claimed[0].id == oldest
