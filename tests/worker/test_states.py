"""The job state machine on real PostgreSQL: random walks through every caller, and fencing of stale attempts."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import HealthCheck, example, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from app.services.jobs import cancel_job
from core import states
from core.auth import Principal
from core.db import session_scope
from core.errors import Conflict, StaleAttempt
from core.rows import TERMINAL, Job, JobStatus, OutboxMessage, new_id, utcnow
from core.store import jobs as store
from tests.conftest import RecordingQueue
from worker.jobs.recovery import Heartbeat, reap

ADMIN = Principal(key_id="key_test", tenant_id="default", is_admin=True)


def _new_job(factory) -> str:
    job = Job(id=new_id("job"), task="text-classification", text_column="text", hyperparameters={}, metrics={},
              created_at=utcnow())
    with session_scope(factory) as session:
        states.create(session, job)
    return job.id


def _claim(factory, job_id, timeout_s=60.0):
    now = utcnow()
    with session_scope(factory) as session:
        job = states.claim_job(session, job_id=job_id, device="cpu", now=now,
                              stale_before=now - timedelta(seconds=timeout_s))
        return None if job is None else job.attempts


def _move(factory, job_id, target, attempt, **kwargs):
    with session_scope(factory) as session:
        states.move(session, store.get_job(session, job_id=job_id), target, attempt=attempt, **kwargs)


def _operation(factory, settings, job_id, name, attempt):
    """One thing a caller does to a job; refusals (stale attempt, illegal move, 409) are part of the walk."""
    if name == "claim":
        _claim(factory, job_id)
    elif name == "progress":  # a beat plus an ETA, as the reporter writes it
        with session_scope(factory) as session:
            if store.beat(session, job_id=job_id, attempt=attempt, now=utcnow()):
                store.update_progress(session, job_id=job_id, attempt=attempt, values={"eta_seconds": 12.5})
    elif name == "die":  # the worker goes silent
        with session_scope(factory) as session:
            session.get(Job, job_id).heartbeat_at = utcnow() - timedelta(hours=1)
    elif name == "reap":
        reap(factory, settings, RecordingQueue())
    elif name == "preempt":
        _move(factory, job_id, JobStatus.QUEUED, attempt, kind="preempted", message="worker shut down")
    elif name == "cancel":
        with factory() as session:
            cancel_job(session, RecordingQueue(), ADMIN, job_id=job_id)
    elif name == "watchdog":  # a cancel ignored past the grace period: the heartbeat ends the job
        with session_scope(factory) as session:
            job = session.get(Job, job_id)
            if job.cancel_requested_at is not None:
                job.cancel_requested_at = utcnow() - timedelta(hours=1)
        Heartbeat(factory, settings, job_id, attempt, exit_process=lambda code: None).tick()
    elif name == "finish":
        _move(factory, job_id, JobStatus.SUCCEEDED, attempt, message="done")
    elif name == "fail":
        _move(factory, job_id, JobStatus.FAILED, attempt, code="training_error", message="boom")


OPERATIONS = st.lists(st.tuples(st.sampled_from(["claim", "progress", "die", "reap", "preempt", "cancel",
                                                 "watchdog", "finish", "fail"]), st.booleans()), max_size=14)


@hypothesis_settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(walk=OPERATIONS)
# Walks that must always be tried: each ends a job that has an ETA, by each way out of running.
@example(walk=[("claim", False), ("progress", False), ("finish", False)])
@example(walk=[("claim", False), ("progress", False), ("cancel", False), ("watchdog", False)])
@example(walk=[("claim", False), ("progress", False), ("die", False), ("reap", False), ("claim", False),
               ("progress", True), ("preempt", False), ("claim", False), ("fail", True), ("fail", False)])
def test_random_walks_make_only_legal_moves(factory, settings, walk):
    job_id = _new_job(factory)
    entered_queue = 1  # creation queues the job and writes its outbox message
    with factory() as session:
        before = session.get(Job, job_id)
        status, attempts = before.status, before.attempts
    for name, stale in walk:
        attempt = attempts - 1 if stale else attempts  # writes from the current attempt, or the one before
        try:
            _operation(factory, settings, job_id, name, attempt)
        except (StaleAttempt, Conflict):
            pass  # refused: the row must be unchanged in status (checked below like any other step)
        with factory() as session:
            job = session.get(Job, job_id)
            messages = session.scalar(select(func.count()).where(OutboxMessage.job_id == job_id))
            new_status, new_attempts, eta = job.status, job.attempts, job.eta_seconds
        if status in TERMINAL:
            assert new_status == status, f"{name}: terminal {status} changed to {new_status}"
        elif new_status != status:
            assert states.allowed(status, new_status), f"{name}: illegal move {status} -> {new_status}"
        elif status == JobStatus.RUNNING and new_attempts != attempts:
            assert name == "claim", "only a claim takes over a running (silent) job"
        if new_status == JobStatus.QUEUED and status != JobStatus.QUEUED:
            entered_queue += 1
        assert messages == entered_queue, "every move into the queue writes exactly one outbox message"
        if new_status != JobStatus.RUNNING:
            assert eta is None, f"{name}: ETA left on a {new_status} job"
        assert new_attempts >= attempts
        status, attempts = new_status, new_attempts


def test_the_table_refuses_illegal_moves(factory):
    job_id = _new_job(factory)
    with pytest.raises(Conflict, match="cannot move from queued to succeeded"):
        _move(factory, job_id, JobStatus.SUCCEEDED, None, message="never ran")
    _move(factory, job_id, JobStatus.CANCELLED, None, message="cancelled")
    with pytest.raises(Conflict, match="cannot move from cancelled to queued"):
        _move(factory, job_id, JobStatus.QUEUED, None, message="back again")


def test_a_stale_attempt_is_refused_while_the_current_one_writes(factory, settings):
    from core.paths import job_model_dir
    from worker.jobs.reporter import JobReporter, artifact_row

    job_id = _new_job(factory)
    assert _claim(factory, job_id) == 1
    with session_scope(factory) as session:  # the first worker went silent; the job was taken over
        session.get(Job, job_id).heartbeat_at = utcnow() - timedelta(hours=1)
    assert _claim(factory, job_id) == 2
    stale = JobReporter(factory, settings, job_id, attempt=1)
    current = JobReporter(factory, settings, job_id, attempt=2)
    for reporter, loss in ((stale, 9.0), (current, 0.5)):
        reporter.on_log(1, 0.1, {"train_loss": loss})
        reporter.try_flush()
        reporter.on_event("note", f"from attempt {reporter.attempt}")
    assert stale.lost.is_set() and not current.lost.is_set()
    folder = job_model_dir(settings, job_id)
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    with pytest.raises(StaleAttempt), session_scope(factory) as session:
        store.add_artifact(session, artifact=artifact_row(settings, job_id, "model", folder, 1), attempt=1)
    with pytest.raises(StaleAttempt):
        _move(factory, job_id, JobStatus.SUCCEEDED, 1, message="stale result")
    with session_scope(factory) as session:
        store.add_artifact(session, artifact=artifact_row(settings, job_id, "model", folder, 1), attempt=2)
    _move(factory, job_id, JobStatus.SUCCEEDED, 2, message="current result")
    with factory() as session:
        job = session.get(Job, job_id)
        points = store.list_metric_points(session, job_id=job_id)
        events = [e.message for e in store.list_events(session, job_id=job_id) if e.kind == "note"]
        assert job.status == JobStatus.SUCCEEDED and job.metrics == {"train_loss": 0.5}
        assert [(p.step, p.value) for p in points] == [(1, 0.5)]
        assert events == ["from attempt 2"]
        assert [a.kind for a in job.artifacts] == ["model"]
    # once finished, even the attempt that finished it writes nothing more
    with pytest.raises(StaleAttempt), session_scope(factory) as session:
        store.update_progress(session, job_id=job_id, attempt=2, values={"step": 99})
