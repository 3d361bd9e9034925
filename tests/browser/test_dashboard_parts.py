"""Dashboard parts in headless Chromium on the running service, with routes the server does not have yet played
by Playwright (page.route): chart ticks for a small learning rate and a short run, the new-job form built from a
typed job spec's JSON schema (a discriminated union, made by FastAPI from pydantic models here), the chat mode
with logprobs on hover and a JSON schema, and the whole dashboard under a CSP without 'unsafe-inline'."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import pytest
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from tests.browser.conftest import Service
from tests.factories import job_body, sentiment_rows, tsv_bytes

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _chart_ticks(page: Any, values: list[tuple[int, float]], log: bool = False) -> dict[str, list[str]]:
    """Draws one MetricChart with uPlot and returns the tick labels it printed on each axis."""
    return page.evaluate("""async ([values, log]) => {
      const { MetricChart } = await import("/ui/js/charts.js");
      const box = document.createElement("div");
      box.style.width = "600px";
      document.body.append(box);
      const chart = new MetricChart(box, "lr", [{ key: "lr", label: "learning_rate", color: "#2563eb" }],
        { smoothing: 0, log, xMode: "step" });
      chart.add(values.map(([step, value]) => ({ key: "lr", step, time: step, value })));
      await new Promise((resolve) => setTimeout(resolve, 600));
      box.remove();
      return { x: JSON.parse(chart.el.dataset.xTicks), y: JSON.parse(chart.el.dataset.yTicks) };
    }""", [values, log])


def test_chart_axes_print_a_small_learning_rate_and_whole_steps(page):
    page.goto(page.url.split("#")[0] + "#/compare")
    # Warmup to 5e-5 over three steps: uPlot's own labels printed 0, 0, 0 and steps 1, 1.5, 2, 2.5, 3.
    ticks = _chart_ticks(page, [(1, 0.0), (2, 2.5e-5), (3, 5e-5)])
    assert ticks["x"] and all(label.isdigit() for label in ticks["x"]), ticks
    labels = [label for label in ticks["y"] if label]
    assert len(set(labels)) == len(labels) > 2, ticks
    assert all(label == "0" or float(label) != 0 for label in labels), ticks
    assert max(float(label) for label in labels) >= 4e-5
    log = _chart_ticks(page, [(1, 1e-6), (2, 1e-5), (3, 5e-5)], log=True)["y"]
    assert [label for label in log if label] and "0" not in log, log
    plain = _chart_ticks(page, [(s, s / 10) for s in range(1, 400)])
    assert "10" not in plain["y"] and all("e" not in label for label in plain["y"]), plain  # 0 to 40: plain figures


# A typed job spec of the shape the API's own is heading to: a union keyed on the job's kind, typed
# hyperparameters per kind with bounds and defaults.
class ClassifierHyperparameters(BaseModel):
    model_config = ConfigDict(extra="forbid")
    epochs: int = Field(3, ge=1, le=100)
    learning_rate: float = Field(5e-5, gt=0, le=1)
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    freeze_word_embeddings: bool = False
    weight_decay: float = Field(0.01, ge=0)


class LMHyperparameters(BaseModel):
    model_config = ConfigDict(extra="forbid")
    block_size: int = Field(128, ge=8, le=4096)
    learning_rate: float = Field(3e-4, gt=0, le=1)
    weight_decay: float = Field(0.1, ge=0)  # another default than the classifier's: not carried over


class ClassificationJob(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: Literal["text-classification"]
    base_model: str = Field(min_length=1)
    train_dataset: str
    eval_dataset: str | None = None
    text_column: str = "text"
    label_column: str = "label"
    hyperparameters: ClassifierHyperparameters = Field(default_factory=ClassifierHyperparameters)


class Adapter(BaseModel):  # as core.adapters.AdapterConfig: a constant method, then numbers with defaults
    model_config = ConfigDict(extra="forbid")
    method: Literal["lora"] = "lora"
    r: int = Field(8, ge=1, le=1024)
    alpha: float = Field(16.0, gt=0)


class CausalLMJob(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: Literal["causal-lm"]
    base_model: str | None = None
    train_dataset: str
    text_column: str = "text"
    hyperparameters: LMHyperparameters = Field(default_factory=LMHyperparameters)
    adapter: Adapter | None = Field(None, description="LoRA settings")
    metadata: dict[str, str] = Field(default_factory=dict)


JobSpec = Annotated[ClassificationJob | CausalLMJob, Field(discriminator="task")]


def _typed_openapi() -> dict[str, Any]:
    app = FastAPI()

    @app.post("/jobs")
    def create(body: JobSpec) -> dict[str, str]:  # pragma: no cover - only its schema is used
        return {}

    return app.openapi()


def _serve_typed_spec(page: Any) -> None:
    """The typed spec's openapi.json; POST /jobs answered with a 422 (no job is made, the body is read)."""
    def jobs(route: Any) -> None:
        if route.request.method != "POST":
            return route.fallback()
        return route.fulfill(status=422, json={"error": {"code": "validation_error", "message": "captured"}})

    page.route("**/openapi.json", lambda route: route.fulfill(json=_typed_openapi()))
    page.route("**/jobs", jobs)


def _submitted(page: Any) -> dict[str, Any]:
    with page.expect_request(lambda r: r.method == "POST" and r.url.endswith("/jobs")) as request:
        page.click("#new-job button[type=submit]")
    return dict(json.loads(request.value.post_data))


def _dataset(service: Service) -> str:
    response = service.api.post("/datasets", files={"file": ("t.tsv", tsv_bytes(sentiment_rows()))})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def test_the_new_job_form_is_built_from_the_typed_spec_and_sends_a_valid_body(page, service: Service):
    train = _dataset(service)
    _dataset(service)  # listed first (newest): the one picked must be kept when the kind changes
    _serve_typed_spec(page)
    page.reload()
    page.click("#new-job-toggle")
    page.wait_for_selector("#new-job[data-ready=true]")
    assert page.locator("#new-job select[name=task] option").all_inner_texts() == ["text-classification", "causal-lm"]
    epochs = page.locator('#new-job input[name="hyperparameters.epochs"]')
    assert epochs.input_value() == "3"
    assert [epochs.get_attribute(a) for a in ("min", "max", "step")] == ["1", "100", "1"]
    rate = page.locator('#new-job input[name="hyperparameters.learning_rate"]')
    assert float(rate.input_value()) == 5e-5 and rate.get_attribute("step") == "any"
    assert page.locator('#new-job select[name="hyperparameters.precision"] option').all_inner_texts() \
        == ["auto", "fp32", "bf16"]
    assert page.locator("#new-job textarea").count() == 0  # everything typed: no JSON to write
    # Bounds are the browser's own validation: nothing is sent while one is broken.
    epochs.fill("0")
    rate.fill("0")  # exclusiveMinimum
    page.fill("#new-job input[name=base_model]", "minilm-l6")
    page.select_option("#new-job select[name=train_dataset]", train)
    page.click("#new-job button[type=submit]")
    assert not page.evaluate("document.getElementById('new-job').checkValidity()")
    assert page.evaluate("document.querySelector('[name=\"hyperparameters.learning_rate\"]').validity.customError")
    epochs.fill("2")
    rate.fill("0.001")
    page.check('#new-job input[name="hyperparameters.freeze_word_embeddings"]')
    body = _submitted(page)
    adapter = TypeAdapter(JobSpec)
    assert body == {"task": "text-classification", "base_model": "minilm-l6", "train_dataset": train,
                    "text_column": "sentence",
                    "hyperparameters": {"epochs": 2, "learning_rate": 0.001, "freeze_word_embeddings": True}}
    assert isinstance(adapter.validate_python(body), ClassificationJob)
    page.wait_for_selector("#new-job .error")  # the server's answer is shown by the form
    # Another kind: its own fields and defaults, what was changed in fields of the same name kept, a free-form
    # field as JSON.
    page.select_option("#new-job select[name=task]", "causal-lm")
    assert page.locator('#new-job [name="hyperparameters.epochs"]').count() == 0
    assert page.locator("#new-job [name=label_column]").count() == 0
    assert page.input_value('#new-job input[name="hyperparameters.block_size"]') == "128"
    assert page.input_value('#new-job input[name="hyperparameters.weight_decay"]') == "0.1"
    assert page.input_value("#new-job select[name=train_dataset]") == train
    page.fill('#new-job input[name="hyperparameters.block_size"]', "64")
    page.fill("#new-job textarea[name=metadata]", '{"team": "nlp"}')
    body = _submitted(page)
    assert body == {"task": "causal-lm", "base_model": "minilm-l6", "train_dataset": train, "text_column": "sentence",
                    "hyperparameters": {"block_size": 64, "learning_rate": 0.001}, "metadata": {"team": "nlp"}}
    assert isinstance(adapter.validate_python(body), CausalLMJob)
    # The adapter is sent once its box is ticked (untouched above: no adapter in either body).
    assert page.locator('#new-job input[name="adapter.r"]').is_disabled()
    page.check("#new-job input[name=adapter]")
    page.fill('#new-job input[name="adapter.r"]', "4")
    body = _submitted(page)
    assert body["adapter"] == {"method": "lora", "r": 4}
    assert adapter.validate_python(body).adapter.r == 4


SCHEMA = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}}, "required": ["mood"]}


def _chunk(content: str | None, logprobs: list[dict[str, Any]] | None = None, finish: str | None = None,
           usage: dict[str, int] | None = None) -> str:
    choices = [] if usage else [{"index": 0, "delta": {"content": content} if content is not None
                                 else {"role": "assistant"}, "logprobs": {"content": logprobs} if logprobs else None,
                                 "finish_reason": finish}]
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "chatty",
             "choices": choices, **({"usage": usage} if usage else {})}
    return f"data: {json.dumps(chunk)}\n\n"


def _entry(token: str, logprob: float, *alternatives: tuple[str, float]) -> dict[str, Any]:
    top = [{"token": token, "logprob": logprob, "bytes": None}] + [
        {"token": t, "logprob": lp, "bytes": None} for t, lp in alternatives]
    return {"token": token, "logprob": logprob, "bytes": None, "top_logprobs": top}


def test_chat_mode_sends_the_conversation_and_shows_logprobs_on_hover(page):
    requests: list[dict[str, Any]] = []
    stream = "".join([_chunk(None), _chunk('{"mood"', [_entry('{"mood"', -0.01, ("{", -4.2))]),
                      _chunk(': "happy"}', [_entry(': "happy"}', -1.6, (': "sad"}', -0.3), (":", -3.0))]),
                      _chunk("", finish="stop"), _chunk(None, usage={"prompt_tokens": 9, "completion_tokens": 2,
                                                                     "total_tokens": 11}), "data: [DONE]\n\n"])

    def chat(route: Any) -> None:
        requests.append(json.loads(route.request.post_data))
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=stream)

    card = {"object": "model", "created": 0, "owned_by": "me"}
    page.route("**/v1/models", lambda route: route.fulfill(json={"object": "list", "data": [
        {"id": "chatty", "chat_template": True, **card}, {"id": "plain", "chat_template": False, **card}]}))
    page.route("**/v1/chat/completions", chat)
    page.goto(page.url.split("#")[0] + "#/playground")
    page.click("[data-mode=chat]")
    page.fill("#chat textarea[name=system]", "Answer in JSON.")
    page.fill("#chat input[name=max_tokens]", "32")
    page.fill("#chat input[name=temperature]", "0")
    page.fill("#chat input[name=top_logprobs]", "3")
    page.fill("#chat textarea[name=schema]", json.dumps(SCHEMA))
    page.fill("#chat textarea[name=message]", "How are you?")
    page.click("#chat button[type=submit]")
    page.wait_for_selector("#chat[data-done=true]")
    assert requests == [{
        "model": "chatty", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 32,
        "temperature": 0, "logprobs": True, "top_logprobs": 3,
        "messages": [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "How are you?"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "response", "schema": SCHEMA,
                                                                   "strict": True}}}]
    reply = page.locator("#chat-messages [data-role=assistant] .text")
    assert json.loads(reply.inner_text()) == {"mood": "happy"}
    assert "2 tokens, finish: stop" in page.inner_text("#chat-stats")
    assert page.locator("#chat-messages .tok.p-high").count() == 1
    page.hover("#chat-messages .tok.p-mid")  # e^-1.6 is 20%: shaded as a doubtful token
    tip = page.locator("#logprob-tip")
    assert tip.is_visible()
    assert '": \\"sad\\"}"' in tip.inner_text() and "74.1%" in tip.inner_text() and "20.2%" in tip.inner_text()
    # The next turn carries the reply; the schema box emptied means free text again.
    page.fill("#chat textarea[name=schema]", "")
    page.fill("#chat textarea[name=message]", "Why?")
    page.click("#chat button[type=submit]")
    page.wait_for_function("document.querySelectorAll('#chat-messages [data-role=assistant]').length === 2")
    page.wait_for_selector("#chat[data-done=true]")
    assert [m["content"] for m in requests[1]["messages"]] == [
        "Answer in JSON.", "How are you?", '{"mood": "happy"}', "Why?"]
    assert "response_format" not in requests[1]
    # A model whose card says it has no chat template gets completion mode only.
    page.select_option("#model", "plain")
    assert page.locator("[data-mode=chat]").is_disabled()
    assert page.locator("#completion-panel").is_visible()


def _delta_chunk(delta: dict[str, Any], finish: str | None = None) -> str:
    chunk = {"id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 0, "model": "chatty",
             "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    return f"data: {json.dumps(chunk)}\n\n"


def test_chat_mode_shows_reasoning_and_streamed_tool_calls(page):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    requests: list[dict[str, Any]] = []
    stream = "".join([
        _delta_chunk({"role": "assistant", "reasoning_content": "The user wants "}),
        _delta_chunk({"reasoning_content": "the weather."}),
        _delta_chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": '{"city": '}}]}),
        _delta_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Rome"}'}}]}),
        _delta_chunk({}, finish="tool_calls"), "data: [DONE]\n\n"])

    def chat(route: Any) -> None:
        requests.append(json.loads(route.request.post_data))
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=stream)

    card = {"object": "model", "created": 0, "owned_by": "me"}
    page.route("**/v1/models", lambda route: route.fulfill(json={"object": "list", "data": [
        {"id": "chatty", "chat_template": True, **card}]}))
    page.route("**/v1/chat/completions", chat)
    page.goto(page.url.split("#")[0] + "#/playground")
    page.click("[data-mode=chat]")
    page.fill("#chat textarea[name=tools]", json.dumps(tools))
    page.fill("#chat textarea[name=message]", "Weather in Rome?")
    page.click("#chat button[type=submit]")
    page.wait_for_selector("#chat[data-done=true]")
    assert requests[0]["tools"] == tools
    reply = page.locator("#chat-messages [data-role=assistant]")
    assert reply.locator(".thinking").inner_text() == "The user wants the weather."
    assert reply.locator(".tool-calls").inner_text() == 'get_weather({"city": "Rome"})'
    assert "finish: tool_calls" in page.inner_text("#chat-stats")
    page.fill("#chat textarea[name=message]", "And tomorrow?")  # the call goes back in the history
    page.click("#chat button[type=submit]")
    page.wait_for_function("document.querySelectorAll('#chat-messages [data-role=assistant]').length === 2")
    assert requests[1]["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}


@pytest.mark.enforce_csp
def test_the_dashboard_runs_under_a_csp_without_unsafe_inline(page, service: Service):
    violations: list[str] = []
    page.on("console", lambda m: violations.append(m.text) if "Content Security Policy" in m.text else None)
    policy = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' blob: data:; object-src 'none'"

    def document(route: Any) -> None:
        response = route.fetch()
        route.fulfill(response=response, headers={**response.headers, "content-security-policy": policy})

    page.route(service.base + "/", document)
    page.reload()  # the page came without the policy; a change of hash alone would not fetch it again
    job = service.api.post("/jobs", json=job_body(_dataset(service), base_model=str(service.tiny_bert))).json()
    service.api.post(f"/jobs/{job['id']}/cancel")
    for view in ("#/jobs", f"#/jobs/{job['id']}", "#/datasets", "#/compare", "#/playground?mode=chat"):
        page.goto(f"{service.base}/{view}")
        page.wait_for_selector("#view > *")
        if view == "#/jobs":
            page.click("#new-job-toggle")
            page.wait_for_selector("#new-job[data-ready=true]")
            page.wait_for_selector(".progress > span", state="attached")  # its width is set through the CSSOM
    page.evaluate("document.body.setAttribute('style', 'color: red')")  # the policy is in force: this is refused
    page.wait_for_timeout(200)
    assert len(violations) == 1 and "style" in violations[0], violations
