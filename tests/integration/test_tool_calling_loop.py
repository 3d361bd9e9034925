"""The tool-calling loop with the official client against real processes: a LoRA fine-tune of a tiny Qwen2 (Qwen
2.5's tool template) on tool-call conversations through /v1/fine_tuning/jobs learns to call the right tool; the
served adapter's calls parse and validate at temperature 0 and 1, streamed and not, and its greedy answer equals
HF + PEFT's on the downloaded adapter, read with the same template's parser."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from core.tool_calls import HERMES, ChoiceParser
from tests.conftest import INTEGRATION_REDIS, make_key
from tests.integration.test_lora_jobs import _download
from tests.service import started_service
from tests.tiny_adapters import hf_greedy, peft_model
from tests.tiny_tools import ASKS, SCHEMAS, TOOLS, build_tool_base, tool_conversation

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]
TERMINAL = ("succeeded", "failed", "cancelled")


def _dataset() -> bytes:
    return "".join(json.dumps(tool_conversation(*ask)) + "\n" for ask in ASKS * 6).encode()


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _valid(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _streamed(api, **kwargs) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for chunk in api.chat.completions.create(stream=True, **kwargs):
        for piece in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(piece.index, ["", ""])
            call[0] += piece.function.name or ""
            call[1] += piece.function.arguments or ""
    return [(name, arguments) for name, arguments in (calls[i] for i in sorted(calls))]


def test_fine_tuned_tool_calls_are_right_valid_and_equal_hf_peft(pg_url, tmp_path):
    home = tmp_path / "home"
    base_dir = build_tool_base(home / "models" / "tiny-qwen", [tool_conversation(*ask) for ask in ASKS])
    with started_service(pg_url, INTEGRATION_REDIS, home, tmp_path, TRAINSERVE_GENERATION_PRECISION="fp32",
                         TRAINSERVE_MAX_LORAS="1") as base:
        key = make_key(pg_url, tenant="tools")
        api = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
        training = api.files.create(file=("tools.jsonl", _dataset()), purpose="fine-tune")
        job = api.fine_tuning.jobs.create(
            model="tiny-qwen", training_file=training.id, seed=1,
            method={"type": "supervised", "supervised": {"hyperparameters": {
                "batch_size": 4, "max_steps": 40, "learning_rate": 3e-2, "precision": "fp32", "block_size": 512}}},
            extra_body={"adapter": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}})
        deadline = time.monotonic() + 420
        while (job := api.fine_tuning.jobs.retrieve(job.id)).status not in TERMINAL:
            assert time.monotonic() < deadline, f"job {job.id} still {job.status}"
            time.sleep(2)
        assert job.status == "succeeded", job.error

        answers = {}
        for question, name, _ in ASKS:  # greedy: the right tool, its arguments valid
            chat = [{"role": "user", "content": question}]
            reply = api.chat.completions.create(model=job.fine_tuned_model, messages=chat, tools=TOOLS,
                                                temperature=0, max_tokens=60)
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            assert [c.function.name for c in choice.message.tool_calls] == [name], (question, choice.message)
            _valid(_calls(choice.message))
            assert _streamed(api, model=job.fine_tuned_model, messages=chat, tools=TOOLS, temperature=0,
                             max_tokens=60) == _calls(choice.message)
            answers[question] = _calls(choice.message)
        for question, _, _ in ASKS[:2]:  # sampled: every call still parses and validates, streamed and not
            chat = [{"role": "user", "content": question}]
            reply = api.chat.completions.create(model=job.fine_tuned_model, messages=chat, tools=TOOLS,
                                                tool_choice="required", temperature=1.0, max_tokens=60, n=4, seed=5)
            for choice in reply.choices:
                _valid(_calls(choice.message))
            _valid(_streamed(api, model=job.fine_tuned_model, messages=chat, tools=TOOLS, tool_choice="required",
                             temperature=1.0, max_tokens=60, seed=6))

        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
            folder = _download(client, client.get(f"/jobs/{job.id}").json(), tmp_path / "adapter")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(base_dir)  # its tokenizer.json, as trained and served
    model = peft_model(base_dir, folder)
    for question, _, _ in ASKS:  # HF + PEFT, unconstrained, read by the template's own parser: the same calls
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], tools=TOOLS,
                                            add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        parser = ChoiceParser(HERMES, reasoning=False)
        parser.feed(tokenizer.decode(hf_greedy(model, ids, 60), skip_special_tokens=True))
        parsed = parser.result()
        assert [(c.name, c.arguments) for c in parsed.calls] == answers[question], question
