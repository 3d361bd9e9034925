"""The exchange that gathers a job's nodes (core.gang): one call per other node, answers gathered until the deadline."""

from __future__ import annotations

import time

import pytest
import redis

from core import gang
from core.redis_keys import gang_key
from tests.conftest import REDIS_URL


@pytest.fixture()
def client():
    connection = redis.Redis.from_url(REDIS_URL)
    yield connection
    connection.delete(gang_key("job_1", 2))
    connection.close()


def test_a_head_calls_each_other_node_by_rank():
    calls = gang.calls(job_id="job_1", attempt=2, nodes=3, devices=2, address="10.0.0.1", port=29400, deadline=9.0)
    assert [c.node_rank for c in calls] == [1, 2] and {c.world_size for c in calls} == {6}
    assert gang.GangCall.model_validate(calls[0].model_dump(mode="json")) == calls[0]  # what crosses the broker
    with pytest.raises(ValueError):
        gang.GangCall(job_id="job_1", attempt=1, node_rank=0, nodes=2, devices=1, address="h", port=1, deadline=0)


def test_the_head_gathers_every_ready_node_and_clears_the_list(client):
    call = gang.calls(job_id="job_1", attempt=2, nodes=3, devices=1, address="h", port=1, deadline=time.time() + 5)
    for c in reversed(call):
        gang.answer(client, c, gang.GangAnswer(node_rank=c.node_rank, worker=f"w{c.node_rank}", ready=True))
    joined = gang.gather(client, job_id="job_1", attempt=2, nodes=3, deadline=time.time() + 5)
    assert [a.worker for a in joined] == ["w1", "w2"]
    assert not client.exists(gang_key("job_1", 2))


def test_a_missing_or_refusing_node_gives_the_job_back(client):
    with pytest.raises(gang.GangIncomplete, match="1 of 2 nodes joined"):
        gang.gather(client, job_id="job_1", attempt=2, nodes=2, deadline=time.time() + 0.3)
    (call,) = gang.calls(job_id="job_1", attempt=2, nodes=2, devices=1, address="h", port=1, deadline=time.time() + 5)
    gang.answer(client, call, gang.GangAnswer(node_rank=1, worker="w1", ready=False, reason="dataset gone"))
    with pytest.raises(gang.GangIncomplete, match="dataset gone"):
        gang.gather(client, job_id="job_1", attempt=2, nodes=2, deadline=time.time() + 5)
