"""Webhook endpoints over HTTP and the sender in-process: address checks, signatures, rotation, fairness, backoff."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from core.rows import utcnow
from core.webhook_sender import WebhookSender, retry_at
from tests.conftest import make_key
from tests.factories import job_body, sentiment_rows, tsv_bytes, upload
from tests.webhook_receiver import Receiver

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def receiver():
    server = Receiver().start()
    yield server
    if server.server is not None:
        server.stop()


def _register(client, url, types=("job.queued", "job.cancelled")):
    response = client.post("/webhooks", json={"url": url, "event_types": list(types)})
    assert response.status_code == 201, response.text
    return response.json()


def _send(settings, factory) -> None:
    """One sender round, waiting for its attempts to finish."""
    sender = WebhookSender(factory, settings)
    sender.round()
    sender.close()


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/hook", "http://localhost/hook", "http://10.1.2.3/hook",
                                 "http://169.254.169.254/latest/meta-data", "http://[::1]/hook",
                                 "http://[::ffff:127.0.0.1]/hook", "ftp://example.com/hook",
                                 "http://user:pw@example.com/hook", "http://no-such-host.invalid/hook"])
def test_private_loopback_and_bad_urls_are_refused(client, url):
    response = client.post("/webhooks", json={"url": url, "event_types": ["job.succeeded"]})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == "url"


def test_endpoints_are_tenant_scoped_listed_and_deleted(client, settings, receiver):
    assert client.post("/webhooks", json={"url": receiver.url, "event_types": ["job.nope"]}).status_code == 422
    settings.webhook_allow_private = True
    created = _register(client, receiver.url)
    assert created["secret"].startswith("whsec_")
    listed = client.get("/webhooks").json()
    assert [e["id"] for e in listed] == [created["id"]] and listed[0]["secret"] is None
    other = {"Authorization": f"Bearer {make_key(settings.resolved_database_url, tenant='tenant-b')}"}
    assert client.get(f"/webhooks/{created['id']}", headers=other).status_code == 404
    assert client.get("/webhooks", headers=other).json() == []
    assert client.delete(f"/webhooks/{created['id']}", headers=other).status_code == 404
    assert client.delete(f"/webhooks/{created['id']}").status_code == 204
    assert client.get(f"/webhooks/{created['id']}").status_code == 404


def test_events_arrive_signed_and_a_rotation_signs_with_both_secrets(client, settings, factory, receiver):
    settings.webhook_allow_private = True
    endpoint = _register(client, receiver.url)
    train = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
    job = client.post("/jobs", json=job_body(train)).json()
    client.post(f"/jobs/{job['id']}/cancel")
    _send(settings, factory)
    old = Webhook(endpoint["secret"])
    bodies = [old.verify(r.body, r.headers) for r in receiver.requests]
    # Two deliveries to one endpoint may be in flight at once: order is not promised (the timestamp tells it).
    assert sorted((b["type"], b["data"]["id"], b["data"]["status"]) for b in bodies) == [
        ("job.cancelled", job["id"], "cancelled"), ("job.queued", job["id"], "queued")]
    assert len({r.headers["webhook-id"] for r in receiver.requests}) == 2

    rotated = client.post(f"/webhooks/{endpoint['id']}/rotate-secret", json={"grace_seconds": 3600}).json()
    assert rotated["secret"] != endpoint["secret"] and rotated["previous_secret_until"]
    client.post("/jobs", json=job_body(train))
    _send(settings, factory)
    latest = receiver.requests[-1]
    assert len(latest.headers["webhook-signature"].split(" ")) == 2
    for secret in (endpoint["secret"], rotated["secret"]):  # either side of the switch verifies
        assert Webhook(secret).verify(latest.body, latest.headers)["type"] == "job.queued"
    with pytest.raises(WebhookVerificationError):
        Webhook(endpoint["secret"]).verify(latest.body.replace("queued", "running"), latest.headers)

    log = client.get(f"/webhooks/{endpoint['id']}/deliveries").json()["data"]
    assert [d["status"] for d in log] == ["delivered"] * 3
    assert log[0]["attempt_log"][0]["status_code"] == 200 and log[0]["attempt_log"][0]["response_body"] == "ok"


def test_the_address_is_checked_again_at_delivery_time(client, settings, factory, receiver):
    settings.webhook_allow_private = True
    endpoint = _register(client, receiver.url)
    settings.webhook_allow_private = False  # as if the name now resolved to a private address (DNS rebinding)
    train = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
    client.post("/jobs", json=job_body(train))
    _send(settings, factory)
    assert receiver.requests == []
    [delivery] = client.get(f"/webhooks/{endpoint['id']}/deliveries").json()["data"]
    assert delivery["status"] == "pending" and delivery["attempts"] == 1
    assert "private, loopback or link-local" in delivery["attempt_log"][0]["error"]


def test_a_slow_endpoint_does_not_hold_up_the_others(client, settings, factory, receiver):
    settings.webhook_allow_private = True
    settings.webhook_concurrency, settings.webhook_per_endpoint = 2, 1
    slow = Receiver(delay_s=3.0).start()  # answers one request in 3 s: three take 9 s one after another
    try:
        _register(client, slow.url, types=["job.queued"])
        _register(client, receiver.url, types=["job.queued"])
        train = upload(client, tsv_bytes(sentiment_rows())).json()["id"]
        for _ in range(3):
            client.post("/jobs", json=job_body(train))
        sender = WebhookSender(factory, settings)
        started = time.monotonic()
        while len(receiver.requests) < 3 and time.monotonic() - started < 20:
            sender.round()
            time.sleep(0.05)
        # Without the per-endpoint cap the slow endpoint's deliveries would soon hold both slots.
        assert len(receiver.requests) == 3 and len(slow.requests) <= 1, time.monotonic() - started
        sender.close()
    finally:
        slow.stop()


def test_retries_back_off_exponentially_and_stop_after_the_retry_period(settings):
    now = utcnow()
    delays = [(retry_at(settings, event_created=now, attempts=n, now=now) - now).total_seconds() for n in (1, 2, 3)]
    assert delays == [5.0, 10.0, 20.0]
    assert retry_at(settings, event_created=now, attempts=40, now=now) == now + timedelta(hours=1)
    assert retry_at(settings, event_created=now - timedelta(days=1), attempts=20, now=now) is None
