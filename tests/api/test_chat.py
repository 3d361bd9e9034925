"""/v1/chat/completions, logprobs and structured output through the real gateway, Redis streams and a tiny GPT-2,
driven with the official `openai` client (streamed and not) and raw HTTP for the refusals.
"""

from __future__ import annotations

import json
import math

import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.tiny_lm import build_tiny_gpt2

# ChatML with the tokenizer's bos token and a raise_exception, as hub templates use them.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' and loop.first %}{{ raise_exception('a chat cannot open with the assistant') }}"
    "{% endif %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour, s'il vous plaît"}]
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]},
                                           "shade": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["colour", "shade"], "additionalProperties": False}


@pytest.fixture()
def served(settings, worker_ctx):
    """A tiny GPT-2 with a chat template ("chat") and one without ("plain"), served by the worker in-process."""
    chat = build_tiny_gpt2(settings.home / "models" / "chat", n_positions=128)
    tokenizer = AutoTokenizer.from_pretrained(chat)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(chat)
    build_tiny_gpt2(settings.home / "models" / "plain", n_positions=64)
    return chat


@pytest.fixture()
def api(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=client.headers["Authorization"].split()[1],
                         http_client=client, max_retries=0)


def _reference(path, messages, max_new_tokens):
    """HF's own rendering and greedy generate: the ids and text the route must reproduce."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.inference_mode():
        out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=50256)
        logits = model(out).logits[0].float()
    new = out[0, ids.shape[1]:]
    logprobs = logits.log_softmax(-1)[ids.shape[1] - 1:-1].gather(1, new[:, None])[:, 0]
    return ids.shape[1], tokenizer.decode(new, skip_special_tokens=True), logprobs.tolist()


def test_chat_equals_hf_chat_template_and_generate_streamed_and_not(api, served):
    prompt_tokens, text, logprobs = _reference(served, CHAT, 10)
    reply = api.chat.completions.create(model="chat", messages=CHAT, max_completion_tokens=10, temperature=0,
                                        logprobs=True, top_logprobs=3)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason in ("length", "stop")
    assert reply.usage.prompt_tokens == prompt_tokens and reply.usage.completion_tokens == 10
    assert reply.usage.prompt_tokens_details.cached_tokens == 0  # the engine's first sight of this chat
    assert [e.logprob for e in choice.logprobs.content] == pytest.approx(logprobs, abs=1e-3)
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob for e in choice.logprobs.content)
    assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in choice.logprobs.content) == text

    chunks = list(api.chat.completions.create(model="chat", messages=CHAT, max_tokens=10, temperature=0, stream=True,
                                              stream_options={"include_usage": True}, logprobs=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == prompt_tokens + 10
    # The same chat again: its full 16-token blocks come from the prefix cache, and the output is unchanged.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == min(prompt_tokens // 16 * 16, prompt_tokens - 1) > 0
    streamed = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx(logprobs[:len(streamed)], abs=1e-3) and len(streamed) >= 9


def test_chat_sampling_options_n_seed_stop(api, served):
    body = {"model": "chat", "messages": CHAT, "max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "seed": 4, "n": 3}
    first, second = api.chat.completions.create(**body), api.chat.completions.create(**body)
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and len({c.message.content for c in first.choices}) > 1
    stop = first.choices[0].message.content[2:4]
    if stop.strip():
        cut = api.chat.completions.create(**{**body, "n": 1, "stop": [stop]}).choices[0]
        assert cut.finish_reason == "stop" and stop not in cut.message.content


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_structured_output_through_the_openai_client(api, served, temperature):
    response_format = {"type": "json_schema", "json_schema": {"name": "colour", "schema": SCHEMA, "strict": True}}
    reply = api.chat.completions.create(model="chat", messages=CHAT, max_tokens=40, temperature=temperature,
                                        response_format=response_format, n=2, seed=1)
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    streamed = list(api.chat.completions.create(model="chat", messages=CHAT, max_tokens=40, temperature=temperature,
                                                response_format=response_format, stream=True, seed=1))
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in streamed if c.choices)), SCHEMA)
    choice = api.chat.completions.create(model="chat", messages=CHAT, max_tokens=10, temperature=temperature,
                                         extra_body={"guided_choice": ["left", "right"]}).choices[0]
    assert choice.message.content in ("left", "right")
    done = api.completions.create(model="chat", prompt="Code:", max_tokens=12, temperature=temperature,
                                  extra_body={"guided_regex": "[A-Z]{2}[0-9]{2}"})
    text = done.choices[0].text
    assert len(text) == 4 and text[:2].isupper() and text[2:].isdigit() and done.choices[0].finish_reason == "stop"
    for guided_json in (SCHEMA, json.dumps(SCHEMA)):  # vLLM's guided_json, as an object or its text
        guided = api.completions.create(model="chat", prompt="Colour:", max_tokens=40, temperature=temperature,
                                        extra_body={"guided_json": guided_json}).choices[0]
        jsonschema.validate(json.loads(guided.text), SCHEMA)
    loose = api.chat.completions.create(model="chat", messages=CHAT, max_tokens=5, temperature=temperature,
                                        response_format={"type": "json_object"}).choices[0]
    assert loose.message.content.startswith("{") and loose.finish_reason in ("length", "stop")


def test_completions_logprobs_in_openai_legacy_format(api, served):
    done = api.completions.create(model="plain", prompt="ROMEO:", max_tokens=6, temperature=0, logprobs=4)
    logprobs = done.choices[0].logprobs
    assert "".join(logprobs.tokens) == done.choices[0].text and len(logprobs.token_logprobs) == 6
    assert all(len(top) <= 4 and max(top.values()) >= lp - 1e-6
               for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs, strict=True))
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    assert all(lp <= 0 and not math.isnan(lp) for lp in logprobs.token_logprobs)
    chunks = list(api.completions.create(model="plain", prompt="ROMEO:", max_tokens=6, temperature=0, logprobs=4,
                                         stream=True))
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs
                for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(logprobs.token_logprobs[:len(streamed)], abs=1e-5) and len(streamed) >= 5


@pytest.mark.parametrize(("body", "field"), [
    ({"model": "plain"}, "model"),  # no chat template
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages"),  # the template's raise_exception
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools.0.function.parameters"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"n": 16, "logprobs": True, "top_logprobs": 20, "max_tokens": 480}, "max_tokens"),  # 161,280 entries: 13 MB
    ({"max_tokens": 120}, "max_tokens"),  # prompt + 120 > 128 positions: the worker names the field sent, not
    ({"max_tokens": None, "max_completion_tokens": 120}, "max_completion_tokens"),  # /generate's max_new_tokens
    ({"made_up_option": 1}, "made_up_option"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json"),  # the worker's refusal names it too
    ({"guided_json": {"type": "integer"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),  # the same bounds as /v1/completions (one shared schema)
    ({"stop": [""]}, "stop"),
    ({"temperature": 2.5}, "temperature"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
])
def test_bad_chat_requests_are_422_naming_the_field(client, served, body, field):
    response = client.post("/v1/chat/completions", json={"model": "chat", "messages": CHAT, "max_tokens": 4, **body})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "validation_error" and field in (error["field"] or ""), error


def test_completions_refuse_more_than_five_logprobs(client, served):
    response = client.post("/v1/completions", json={"model": "plain", "prompt": "Hi", "logprobs": 6})
    assert response.status_code == 422 and response.json()["error"]["field"].endswith("logprobs")


def test_the_worker_renders_chats_exactly_as_apply_chat_template(served):
    from core.protocol import ChatMessage, GenerateTask, SamplingParams
    from worker.engines.generation.engine import GenerationEngine
    from worker.servers.chat_plan import plan_chat

    tokenizer = AutoTokenizer.from_pretrained(served)
    chats = [CHAT, CHAT + [{"role": "assistant", "content": "Rouge 🙂"}, {"role": "user", "content": "Encore ?"}]]
    with GenerationEngine(served, device="cpu", precision="fp32", max_batch_size=2) as engine:
        for chat in chats:
            task = GenerateTask(request_id="r", model=str(served), prompt="", deadline=0, params=SamplingParams(),
                                messages=[ChatMessage(**m) for m in chat])
            expected = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
            assert plan_chat(engine, task).ids == list(expected)
            assert expected[0] == tokenizer.bos_token_id  # the template's bos_token came from tokenizer_config.json


WIDE = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}


@pytest.mark.parametrize("found", ["before", "mid-stream"])
def test_a_schema_the_matcher_cannot_follow_is_an_error_never_a_stop(client, served, monkeypatch, found):
    """600 optional properties compiled, then the matcher failed and allowed only the end: 200, "stop", empty."""
    if found == "mid-stream":
        from worker.engines.generation.sampling import grammar

        monkeypatch.setattr(grammar, "probe", lambda *args, **kwargs: None)
    body = {"model": "chat", "messages": CHAT, "max_tokens": 16, "temperature": 1.0, "seed": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": found, "schema": WIDE}}}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == "response_format"
    streamed = client.post("/v1/chat/completions", json={**body, "stream": True})
    if found == "before":
        assert streamed.status_code == 422
    else:
        assert streamed.status_code == 200 and "event: error" in streamed.text
        assert '"finish_reason":"stop"' not in streamed.text.replace(" ", "")


def test_a_prompt_too_large_for_the_context_is_refused_before_any_worker_tokenizes_it(client, served, queue):
    """A 960 kB prompt was tokenized on the generation worker (1.5 s) before its 422."""
    sent = len(queue.sent)
    huge = "To be, or not to be " * 250  # 5,000 bytes: more than 128 positions x 32 bytes
    chat = client.post("/v1/chat/completions", json={"model": "chat", "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": huge}]})
    assert chat.status_code == 422 and chat.json()["error"]["field"] == "messages", chat.text
    plain = client.post("/v1/completions", json={"model": "plain", "prompt": huge, "max_tokens": 4})
    assert plain.status_code == 422 and plain.json()["error"]["field"] == "prompt", plain.text
    assert "at most 64 tokens" in plain.json()["error"]["message"]
    # A template renders the tools, and earlier calls' arguments, into the prompt too: they count.
    tool = {"type": "function", "function": {"name": "f", "description": huge, "parameters": {"type": "object"}}}
    tools = client.post("/v1/chat/completions", json={"model": "chat", "max_tokens": 4, "messages": CHAT,
                                                      "tools": [tool]})
    assert tools.status_code == 422 and tools.json()["error"]["field"] == "tools", tools.text
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"text": huge})}}
    called = [*CHAT, {"role": "assistant", "tool_calls": [call]},
              {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    calls = client.post("/v1/chat/completions", json={"model": "chat", "max_tokens": 4, "messages": called})
    assert calls.status_code == 422 and calls.json()["error"]["field"] == "messages", calls.text
    assert len(queue.sent) == sent  # no generation task was sent


def _route_body(route: str, extra: dict) -> dict:
    base = {"messages": CHAT} if route == "/v1/chat/completions" else {"prompt": "Name a colour"}
    return {"model": "chat", "max_tokens": 6, **base, **extra}


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(("extra", "field"), [
    ({"made_up_option": 1}, "made_up_option"),  # /v1/completions ignored unknown fields
    ({"min_p": 0.1}, "min_p"),  # not honoured by the built-in engine: refused on every route, not ignored
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"min_tokens": 7}, "min_tokens"),  # more than max_tokens
    ({"min_tokens": -1}, "min_tokens"),
    ({"top_k": -2}, "top_k"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"ignore_eos": True, "guided_regex": "a+"}, "ignore_eos"),  # the grammar decides where the output ends
])
def test_sampling_extras_are_refused_alike_on_both_routes(client, served, route, extra, field):
    response = client.post(route, json=_route_body(route, extra))
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "validation_error" and field in (error["field"] or ""), error


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_sampling_extras_are_honoured_alike_on_both_routes(client, served, route):
    """guidellm's ignore_eos was a 422 on chat and silently ignored on completions."""
    extra = {"ignore_eos": True, "min_tokens": 6, "top_k": 5, "repetition_penalty": 1.2, "temperature": 0}
    response = client.post(route, json=_route_body(route, extra))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["finish_reason"] == "length"
