"""Decisions the API and the worker both make, each made by one function: precision, cadence, context, SSE, keys."""

from __future__ import annotations

import json

import pytest

from app.sse import COMPACT, sse_comment, sse_message, sse_retry
from core import redis_keys
from core.capacity import DeviceCapacity
from core.precision import auto_precision
from worker.engines.device import resolve_device
from worker.engines.generation.requests import context_overflow
from worker.engines.training.loop import checkpoint_due


@pytest.mark.parametrize(("facts", "expected"), [
    ({"is_cuda": True, "bf16_supported": True}, "bf16"),
    ({"is_cuda": True, "bf16_supported": False}, "fp16"),  # pre-Ampere: the API used to assume bf16 here
    ({"is_cuda": False}, "fp32"),
    ({"is_cuda": False, "cpu_bf16_faster": True}, "bf16"),
])
def test_auto_precision_from_the_device_facts(facts, expected):
    assert auto_precision(**facts) == expected


def test_the_worker_plan_and_the_reported_capacity_agree_with_auto_precision():
    plan = resolve_device("cpu", "auto")  # neither training nor generation: no calibration, fp32
    assert plan.precision == auto_precision(is_cuda=False) == "fp32"
    old_gpu = DeviceCapacity(worker="w:1", device="cuda:0", total_bytes=1, bf16=False)
    assert auto_precision(is_cuda=old_gpu.is_cuda, bf16_supported=old_gpu.bf16) == "fp16"


def test_checkpoint_due_every_n_steps_and_never_without_a_cadence():
    assert [s for s in range(1, 11) if checkpoint_due(s, 4)] == [4, 8]
    assert not any(checkpoint_due(s, None) for s in range(1, 11))


def test_context_overflow_names_the_sizes_only_when_they_do_not_fit():
    assert context_overflow(100, 28, 128) is None
    message = context_overflow(120, 16, 128)
    assert message is not None and "(120 tokens)" in message and "= 136" in message and "128" in message


def test_sse_framing_of_both_streams():
    assert sse_message({"a": 1, "b": [2]}) == 'data: {"a": 1, "b": [2]}\n\n'
    assert sse_message("[DONE]") == "data: [DONE]\n\n"
    framed = sse_message({"a": 1}, event="state", id="4-12", separators=COMPACT)
    assert framed == 'id: 4-12\nevent: state\ndata: {"a":1}\n\n'
    fields = dict(line.split(": ", 1) for line in framed.strip().splitlines())
    assert json.loads(fields["data"]) == {"a": 1}
    assert sse_comment("ping") == ": ping\n\n" and sse_retry(2000) == "retry: 2000\n\n"


def test_redis_keys_share_one_prefix_and_never_collide():
    keys = [redis_keys.capacity_key("h:1"), redis_keys.stream_key("r"), redis_keys.cancel_key("r"),
            redis_keys.slots_key("m"), redis_keys.tenant_slots_key("m", "t"), redis_keys.rate_key("k"),
            redis_keys.classify_reply_key("r"), redis_keys.abandoned_key("r"), redis_keys.uploads_key("t"),
            redis_keys.inference_key("t"), redis_keys.BROKER_SENTINEL]
    assert all(key.startswith(redis_keys.PREFIX) for key in keys) and len(set(keys)) == len(keys)
    assert redis_keys.capacity_key("h:1").startswith(redis_keys.CAPACITY_PREFIX)
