"""The generation worker's adapter serving (GenerationService with real Redis streams and a home artifact store):
tasks naming a base and an adapter job share one engine of the base; with TRAINSERVE_MAX_LORAS=2 a third adapter
evicts the least recently used idle one; a concurrent mix of adapters and base equals HF + PEFT; an adapter over
a GPT-2 engine is a validation error event."""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from core.paths import MANIFEST_NAME, job_model_dir
from core.protocol import DoneEvent, ErrorCode, ErrorEvent, GenerateTask, SamplingParams, parse_event
from core.redis_keys import stream_key
from core.rows import new_id
from tests.tiny_adapters import ADAPTERS, hf_greedy, make_adapters, peft_model
from tests.tiny_llama import build_tiny_decoder
from tests.tiny_lm import build_tiny_gpt2

PROMPT = [1, 17, 42, 99, 7]


@pytest.fixture()
def service(settings, queue):
    from worker.context import WorkerContext
    from worker.servers import generation as serving

    ctx = WorkerContext(settings.model_copy(update={"max_loras": 2}), queue)
    service = ctx.service("generation", serving.GenerationService.build)
    yield service
    service.registry.close()
    ctx.close()


def _store_adapters(settings, base, tmp_path) -> dict[str, tuple[str, object]]:
    """Three adapter jobs' folders in the home store: name -> (job id, folder)."""
    folders = make_adapters(base, tmp_path, {**ADAPTERS, "third": ADAPTERS["narrow"].model_copy(update={"r": 3})})
    jobs = {}
    for name, folder in folders.items():
        job_id = new_id("job")
        shutil.copytree(folder, job_model_dir(settings, job_id))
        (job_model_dir(settings, job_id) / MANIFEST_NAME).write_text(json.dumps({"task": "causal-lm"}))
        jobs[name] = (job_id, folder)
    return jobs


def _serve(service, model: str, adapter: str | None, max_new_tokens: int = 8) -> DoneEvent | ErrorEvent:
    task = GenerateTask(request_id=new_id("gen"), model=model, adapter=adapter, prompt="",
                        params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0), deadline=time.time() + 60)
    # A prompt of ids, as the API would send text: encode through the engine's own tokenizer (ids are what we compare).
    with service.registry.use(model) as engine:
        task.prompt = engine.tokenizer.decode(PROMPT)
    service.serve(task.model_dump(mode="json"))
    entries = service.redis.xrange(stream_key(task.request_id))
    events = [parse_event(fields[b"data"]) for _, fields in entries]
    return next(e for e in events if isinstance(e, DoneEvent | ErrorEvent))


def test_adapters_share_the_base_engine_lru_and_equal_peft(service, settings, tmp_path):
    base = tmp_path / "base"
    build_tiny_decoder("llama", base)
    jobs = _store_adapters(settings, base, tmp_path)
    names = [None, "wide", "narrow", None, "wide", "narrow"]
    with ThreadPoolExecutor(max_workers=len(names)) as pool:  # a concurrent mix: rows of both and the base
        done = list(pool.map(lambda n: _serve(service, str(base), None if n is None else jobs[n][0]), names))
    with service.registry.use(str(base)) as engine:
        ids = engine.encode(engine.tokenizer.decode(PROMPT))
        assert sorted(engine.stats()["adapters"]) == sorted([jobs["wide"][0], jobs["narrow"][0]])
    for name, event in zip(names, done, strict=True):
        assert isinstance(event, DoneEvent), event
        model = peft_model(base, None if name is None else jobs[name][1])
        want = engine.tokenizer.decode(hf_greedy(model, ids, 8), skip_special_tokens=True)
        assert event.choices[0].text == want, name
    assert service.registry.loaded() == [str(base)]  # one engine: the base loaded once
    _serve(service, str(base), jobs["wide"][0])  # wide is now the most recently used
    third = _serve(service, str(base), jobs["third"][0])
    assert isinstance(third, DoneEvent)
    assert engine.stats()["adapters"] == [jobs["wide"][0], jobs["third"][0]]  # narrow (idle, LRU) went


def test_an_adapter_on_a_gpt2_engine_is_a_validation_error(service, settings, tmp_path):
    base = build_tiny_gpt2(tmp_path / "gpt2", n_positions=32)
    job_id = new_id("job")
    job_model_dir(settings, job_id).mkdir(parents=True)
    event = _serve(service, str(base), job_id)
    assert isinstance(event, ErrorEvent) and event.error.code == ErrorCode.VALIDATION_ERROR
    assert "llama-family" in event.error.message
