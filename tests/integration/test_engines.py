"""Both generation engines through the same routes, one suite: trainserve's own and vLLM (its CPU build, eager).

Each engine gets its own started service (the API, a training and a generation worker as processes) with
TRAINSERVE_GENERATION_ENGINE set, serving the real SmolLM2-135M-Instruct and a tiny Qwen2 with Qwen 2.5's tool
template; every test runs against both and asks the same of each, with the official openai client: greedy chat
equal to HF `generate` in a mixed batch, streaming, seeds, logprobs, stop strings, prefix caching, structured output
valid, a tool call constrained (on SmolLM2 by the default tool prompt, and beside a response_format), an echoed
prompt scored as HF scores it, a LoRA fine-tune served equal to HF + PEFT, cancel on disconnect, and two tenants
sharing the engine's rows fairly.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from tests.conftest import INTEGRATION_REDIS, make_key
from tests.integration.conftest import wait_for
from tests.integration.test_lora_jobs import _download
from tests.service import started_service
from tests.tiny_adapters import hf_greedy, peft_model
from tests.tiny_chat import chat_jsonl
from tests.tiny_tools import ASKS, TOOLS, build_tool_base, tool_conversation
from tests.worker.test_real_model import CHATS

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]
NEW_TOKENS = 24
ROWS = 4  # TRAINSERVE_MAX_BATCH_SIZE of the generation worker (vLLM's --max-num-seqs)


@dataclass(frozen=True)
class Served:
    engine: str
    base: str
    key: str
    smollm2: Path
    tool_base: Path

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=key or self.key, max_retries=0, timeout=300)


@pytest.fixture(scope="module", params=["builtin", "vllm"])
def served(request, pg_url, tmp_path_factory) -> Served:
    from trainserve.real_models import build_smollm2
    from worker.engines.vllm.server import find_python

    engine = request.param
    if engine == "vllm" and find_python() is None:
        pytest.skip("vLLM's CPU build is not installed: `make vllm` (make test does)")
    root = tmp_path_factory.mktemp(f"engine-{engine}")
    home = root / "home"
    (home / "models").mkdir(parents=True)
    smollm2 = build_smollm2()
    (home / "models" / "smollm2").symlink_to(smollm2)  # a fine-tune of it reads the link's target (a model root)
    # Heads of 32: vLLM's CPU attention has no kernel for narrower ones.
    tool_base = build_tool_base(home / "models" / "tiny-qwen", [tool_conversation(*ask) for ask in ASKS],
                                hidden_size=128)
    with started_service(pg_url, INTEGRATION_REDIS, home, root, TRAINSERVE_GENERATION_ENGINE=engine,
                         TRAINSERVE_MAX_BATCH_SIZE=str(ROWS), TRAINSERVE_GENERATION_WAIT_S="300",
                         TRAINSERVE_MAX_TOKENS_IN_FLIGHT="16384", TRAINSERVE_MODEL_ROOTS=str(smollm2.parent)) as base:
        served = Served(engine, base, make_key(pg_url, tenant="engines"), smollm2, tool_base)
        api = served.client()
        with ThreadPoolExecutor(2) as pool:  # each model's first request waits for its engine, both loading at once
            list(pool.map(lambda model: api.completions.create(model=model, prompt="Hi", max_tokens=1, timeout=600),
                          ("smollm2", "tiny-qwen")))
        yield served
    # The generation worker stopped: every vLLM server it started (one per model) stopped with it.
    wait_for(lambda: not _vllm_servers(str(tool_base)), 60, "the worker's vLLM servers to stop")


def _vllm_servers(model: str) -> list[int]:
    """Processes whose command line runs vLLM's server on `model`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in command and model.encode() in command:
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def hf_chats(served) -> list[list[int]]:
    """HF `generate`'s greedy tokens for each chat of CHATS, one at a time (no padding), fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = PreTrainedTokenizerFast.from_pretrained(served.smollm2)
    model = AutoModelForCausalLM.from_pretrained(served.smollm2, dtype=torch.float32).eval()
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
               for c in CHATS]
    return [hf_greedy(model, list(ids), NEW_TOKENS) for ids in prompts]


def test_greedy_chat_in_a_mixed_batch_equals_hf_generate(served, hf_chats) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(served.smollm2)
    api = served.client()

    def chat(messages):
        return api.chat.completions.create(model="smollm2", messages=messages, max_tokens=NEW_TOKENS, temperature=0)

    with ThreadPoolExecutor(len(CHATS)) as pool:  # decoded together
        replies = list(pool.map(chat, CHATS))
    for reply, tokens in zip(replies, hf_chats, strict=True):
        assert reply.choices[0].message.content == tokenizer.decode(tokens, skip_special_tokens=True)
        ended = tokens[-1] == tokenizer.eos_token_id
        assert reply.choices[0].finish_reason == ("stop" if ended else "length")
        assert reply.usage.completion_tokens == len(tokens)


def test_streaming_seeds_logprobs_stop_and_prefix_cache(served) -> None:
    api = served.client()
    messages = CHATS[1]
    whole = api.chat.completions.create(model="smollm2", messages=messages, max_tokens=NEW_TOKENS, temperature=0)
    chunks = list(api.chat.completions.create(model="smollm2", messages=messages, max_tokens=NEW_TOKENS,
                                              temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content

    def sampled():
        return api.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                      n=2, seed=7, logprobs=2)

    first, second = sampled(), sampled()
    assert [c.text for c in first.choices] == [c.text for c in second.choices]  # a seed means one answer
    assert first.choices[0].text != first.choices[1].text  # choice i is seeded seed + i
    logprobs = first.choices[0].logprobs
    assert logprobs.tokens and len(logprobs.tokens) == len(logprobs.top_logprobs) == len(logprobs.token_logprobs)
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert all(lp <= 0 for lp in logprobs.token_logprobs)

    stop = whole.choices[0].message.content.split()[2]  # a word of the greedy answer: the answer ends before it
    stopped = api.chat.completions.create(model="smollm2", messages=messages, max_tokens=NEW_TOKENS,
                                          temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert whole.choices[0].message.content.startswith(stopped.choices[0].message.content)
    assert stop not in stopped.choices[0].message.content

    system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer in plain words." for i in range(60))
    for _ in range(2):  # the second request finds the long system prompt's blocks cached
        reply = api.chat.completions.create(model="smollm2", max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": "Hi"}])
    assert reply.usage.prompt_tokens_details.cached_tokens >= 128, reply.usage


def test_a_tenants_cached_prompt_is_no_hit_for_another(served, pg_url) -> None:
    """Tenant A's prompt (a long system prompt: a secret) is cached for A alone. A's repeat hits its own blocks and
    answers sooner; each of three new tenants sending the same prompt is told 0 cached tokens and waits as long as for
    a cold prompt of its own (a hit would tell it, by usage or by timing, that someone sent that text)."""
    def contract(word: str) -> str:  # the word first: two contracts differ from the template's first block on
        return f"{word} " + " ".join(f"Clause {i} of this contract: the buyer pays within {i} days." for i in range(40))

    def ask(api: openai.OpenAI, system: str) -> tuple[float, int]:
        started = time.monotonic()
        reply = api.chat.completions.create(model="smollm2", max_tokens=1, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": "Summarise."}])
        assert reply.usage.prompt_tokens > 600
        return time.monotonic() - started, reply.usage.prompt_tokens_details.cached_tokens

    owner = served.client(make_key(pg_url, tenant="engines-owner"))
    secret = contract("Gold")
    assert ask(owner, secret)[1] == 0
    seconds: dict[str, list[float]] = {"owner": [], "other": [], "cold": []}
    for round_, word in enumerate(("Iron", "Silk", "Wool")):
        other = served.client(make_key(pg_url, tenant=f"engines-other-{round_}"))
        for who, api, system in (("other", other, secret), ("cold", other, contract(word)), ("owner", owner, secret)):
            elapsed, cached = ask(api, system)
            assert (cached >= 600) if who == "owner" else (cached == 0), (who, cached)
            seconds[who].append(elapsed)
    median = {who: sorted(times)[1] for who, times in seconds.items()}
    assert median["owner"] < 0.5 * median["cold"], median  # a hit is visible in the time: the test can see one
    assert 0.6 < median["other"] / median["cold"] < 1.67, median


def test_an_echoed_prompt_is_scored_as_hf_scores_it(served) -> None:
    """lm-evaluation-harness's log-likelihood request (echo, logprobs, max_tokens 0) on the prompt's own tokens, as
    /tokenize gives them: each prompt token's logprob is HF's fp32 log-softmax at the position before it, the first
    one null, and nothing is generated."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = "To be, or not to be: that is the question."
    with httpx.Client(base_url=served.base, headers={"Authorization": f"Bearer {served.key}"}, timeout=120) as c:
        ids = c.post("/tokenize", json={"model": "smollm2", "prompt": prompt}).json()["tokens"]
    reply = served.client().completions.create(model="smollm2", prompt=prompt, max_tokens=0, echo=True, logprobs=2,
                                               temperature=0)
    scored = reply.choices[0].logprobs
    assert reply.choices[0].text == prompt and reply.usage.completion_tokens == 0
    assert len(scored.token_logprobs) == len(ids)
    assert scored.token_logprobs[0] is None and scored.top_logprobs[0] is None
    model = AutoModelForCausalLM.from_pretrained(served.smollm2, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = model(torch.tensor([ids])).logits[0].log_softmax(dim=-1)
    for position, token in enumerate(ids[1:]):
        assert scored.token_logprobs[position + 1] == pytest.approx(expected[position, token].item(), abs=1e-4)
        assert max(scored.top_logprobs[position + 1].values()) == pytest.approx(expected[position].max().item(),
                                                                                abs=1e-4)


def test_structured_output_is_valid(served) -> None:
    api = served.client()
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    for temperature in (0, 1.0):
        reply = api.chat.completions.create(
            model="smollm2", max_tokens=60, temperature=temperature, seed=3,
            messages=[{"role": "user", "content": "Name a big city and its population as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    choice = api.completions.create(model="smollm2", prompt="Is the sky blue? Answer:", max_tokens=5,
                                    temperature=1.0, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    regex = api.completions.create(model="smollm2", prompt="A phone number:", max_tokens=20, temperature=1.0,
                                   extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"})
    assert len(regex.choices[0].text) == 8 and regex.choices[0].text[3] == "-"
    bad = httpx.post(f"{served.base}/v1/chat/completions", headers={"Authorization": f"Bearer {served.key}"},
                     timeout=120, json={"model": "smollm2", "messages": [{"role": "user", "content": "x"}],
                                        "response_format": {"type": "json_schema", "json_schema": {
                                            "name": "x", "schema": {"type": "array", "uniqueItems": True}}}})
    assert bad.status_code == 422 and "response_format" in bad.text, bad.text  # refused alike on both engines


PICK = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                        "count": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["colour", "count"], "additionalProperties": False}


def test_a_tool_call_is_constrained_to_the_schema(served) -> None:
    """A random model (the tiny Qwen2's weights are untrained): only the grammar makes its calls parse and validate;
    the schema is bounded, so every call closes within max_tokens."""
    api = served.client()
    tools = [*TOOLS, {"type": "function", "function": {"name": "pick", "description": "Pick a colour and a count",
                                                      "parameters": PICK}}]
    for seed in (5, 6):
        reply = api.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": "Pick one."}],
                                            tools=tools, tool_choice={"type": "function", "function": {"name": "pick"}},
                                            temperature=1.0, max_tokens=120, seed=seed)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert [c.function.name for c in choice.message.tool_calls] == ["pick"]
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), PICK)


def test_tools_on_a_template_without_them_and_beside_a_response_format(served) -> None:
    """SmolLM2's template has no tool section: the default tool prompt, its call constrained as the Hermes family's.
    Beside a response_format, the one lark grammar allows calls or the format's JSON on either engine."""
    api = served.client()
    tools = [{"type": "function", "function": {"name": "pick", "description": "Pick a colour and a count",
                                               "parameters": PICK}}]
    ask = [{"role": "user", "content": "Pick a colour and a count."}]
    reply = api.chat.completions.create(model="smollm2", messages=ask, tools=tools, tool_choice="required",
                                        temperature=0, max_tokens=60, parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), PICK)
    reply = api.chat.completions.create(model="tiny-qwen", messages=ask, tools=tools, temperature=1.0, seed=3, n=4,
                                        max_tokens=120, parallel_tool_calls=False, response_format={
                                            "type": "json_schema", "json_schema": {"name": "pick", "schema": PICK}})
    for choice in reply.choices:
        if choice.message.tool_calls:
            jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), PICK)
        else:
            jsonschema.validate(json.loads(choice.message.content), PICK)


def test_a_lora_fine_tune_is_served_equal_to_hf_peft(served, tmp_path) -> None:
    api = served.client()
    training = api.files.create(file=("blue.jsonl", chat_jsonl("Blue.", repeat=2)), purpose="fine-tune")
    job = api.fine_tuning.jobs.create(
        model="smollm2", training_file=training.id, seed=1,
        method={"type": "supervised", "supervised": {"hyperparameters": {
            "batch_size": 2, "max_steps": 6, "learning_rate": 1e-3, "precision": "fp32", "block_size": 64}}},
        extra_body={"adapter": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}})
    deadline = time.monotonic() + 600
    while (job := api.fine_tuning.jobs.retrieve(job.id)).status not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, f"job {job.id} still {job.status}"
        time.sleep(2)
    assert job.status == "succeeded", job.error
    messages = [{"role": "user", "content": "What colour is the sky?"}]
    reply = api.chat.completions.create(model=job.fine_tuned_model, messages=messages, max_tokens=NEW_TOKENS,
                                        temperature=0)
    with httpx.Client(base_url=served.base, headers={"Authorization": f"Bearer {served.key}"}, timeout=120) as c:
        folder = _download(c, c.get(f"/jobs/{job.id}").json(), tmp_path / "adapter")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(served.smollm2)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    tuned = hf_greedy(peft_model(served.smollm2, folder), list(ids), NEW_TOKENS)
    assert reply.choices[0].message.content == tokenizer.decode(tuned, skip_special_tokens=True)
    assert tuned != hf_greedy(peft_model(served.smollm2, None), list(ids), NEW_TOKENS)  # the adapter did steer


def _open_and_leave(base: str, key: str) -> None:
    """A long streamed completion whose client goes away after its first chunk."""
    with httpx.Client(timeout=300) as client, client.stream(
            "POST", f"{base}/v1/completions", headers={"Authorization": f"Bearer {key}"},
            json={"model": "smollm2", "prompt": "Write a very long story.", "max_tokens": 1000, "temperature": 1.0,
                  "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                return


def test_clients_that_leave_free_their_rows(served) -> None:
    """Every row is taken by a long stream whose client leaves; a request after them is served at once (the
    1000-token streams, had they gone on, would hold every row for about a minute)."""
    with ThreadPoolExecutor(ROWS) as pool:
        list(pool.map(lambda _: _open_and_leave(served.base, served.key), range(ROWS)))
    started = time.monotonic()
    reply = served.client().completions.create(model="smollm2", prompt="Hello", max_tokens=4, temperature=0,
                                               timeout=60)
    assert reply.usage.completion_tokens == 4 and time.monotonic() - started < 30


def test_a_flood_of_one_tenant_does_not_hold_another_back(served, pg_url) -> None:
    """Tenant A sends three waves of requests (3 x ROWS); tenant B's one request, sent after them, takes the next
    free row (A's turn comes after it): it ends before A's last wave does. First come first served would put it
    after all of A's."""
    flood, other = served.client(), served.client(make_key(pg_url, tenant="engines-other"))
    done: dict[str, list[float]] = {"a": [], "b": []}
    lock = threading.Lock()

    def ask(api: openai.OpenAI, who: str) -> None:
        api.completions.create(model="smollm2", prompt=f"Count slowly ({who}):", max_tokens=48, temperature=0,
                               timeout=600)
        with lock:
            done[who].append(time.monotonic())

    with ThreadPoolExecutor(3 * ROWS + 1) as pool:
        futures = [pool.submit(ask, flood, "a") for _ in range(3 * ROWS)]
        time.sleep(1.0)  # A's requests are all in: ROWS running, the rest waiting
        futures.append(pool.submit(ask, other, "b"))
        for future in futures:
            future.result()
    assert done["b"][0] < sorted(done["a"])[-ROWS], done


def test_one_tenants_long_answers_on_every_row_do_not_hold_back_anothers_chat(served, pg_url) -> None:
    """Tenant A's request of ROWS choices holds every row of the engine for 120 greedy tokens; tenant B's completion,
    sent once A decodes, ends while A's answers still run (first come, first served would make it wait for them all):
    the built-in engine pauses one of A's rows for it and resumes it after; vLLM's engine starts it in a spare row."""
    holder = served.client(make_key(pg_url, tenant="engines-holder"))
    newcomer = served.client(make_key(pg_url, tenant="engines-newcomer"))
    decoding, ended = threading.Event(), threading.Event()
    finishes: dict[int, str] = {}

    def hold() -> None:
        for chunk in holder.completions.create(model="smollm2", prompt="1, 2, 3, 4, 5, 6, 7, 8,", max_tokens=120,
                                               temperature=0, n=ROWS, stream=True, timeout=600):
            decoding.set()
            for choice in chunk.choices:
                if choice.finish_reason:
                    finishes[choice.index] = choice.finish_reason
        ended.set()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert decoding.wait(300)
    started = time.monotonic()
    reply = newcomer.completions.create(model="smollm2", prompt="Hello", max_tokens=8, temperature=0, timeout=300)
    waited = time.monotonic() - started
    still_running = not ended.is_set()
    thread.join(600)
    assert reply.usage.completion_tokens == 8
    assert finishes == dict.fromkeys(range(ROWS), "length")  # every row was held to the end: none freed early
    assert still_running, waited
