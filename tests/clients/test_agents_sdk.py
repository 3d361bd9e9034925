"""The OpenAI Agents SDK 0.24, unchanged, on its default model API (the Responses API: OpenAIResponsesModel over an
AsyncOpenAI client pointed at trainserve): a plain run and a streamed run on SmolLM2, function tools and multi-turn
runs (input lists and previous_response_id) and an output_type, each on SmolLM2 (whose template has no tool section:
the default tool prompt) and on the tiny Qwen 2.5 tool template; a tool then an output_type on the tiny Qwen2.

The tiny Qwen2 is random: its text never ends before the token limit (which the SDK rightly takes for a failed
response), so its turns end in tool calls or in a structured output, whose grammar ends it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from openai.types.responses import ResponseTextDeltaEvent
from pydantic import BaseModel, Field

from tests.clients.conftest import MODELS, ClientService

QUESTION = "What is the capital of France?"


class Weather(BaseModel):
    city: str = Field(max_length=12)
    sunny: bool


@pytest.fixture(autouse=True, scope="module")
def _no_tracing():
    set_tracing_disabled(True)  # traces would go to OpenAI's servers


def _model(service: ClientService, name: str) -> OpenAIResponsesModel:
    client = AsyncOpenAI(base_url=service.v1, api_key=service.key, max_retries=0, timeout=300)
    return OpenAIResponsesModel(model=name, openai_client=client)


def _weather_tool(calls: list[str]):
    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
        """Weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    return get_weather


def test_a_plain_run_answers_as_chat_completions(client_service):
    agent = Agent(name="helper", instructions="You are a helpful assistant.", model=_model(client_service, "smollm2"),
                  model_settings=ModelSettings(temperature=0, max_tokens=64))
    result = asyncio.run(Runner.run(agent, QUESTION))
    chat = client_service.openai().chat.completions.create(
        model="smollm2", temperature=0, max_completion_tokens=64,
        messages=[{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": QUESTION}])
    assert result.final_output == chat.choices[0].message.content and "Paris" in result.final_output
    [raw] = result.raw_responses
    assert raw.usage.output_tokens == chat.usage.completion_tokens and raw.response_id.startswith("resp_")


def test_a_streamed_run_sends_the_text_as_it_comes(client_service):
    agent = Agent(name="helper", instructions="You are a helpful assistant.", model=_model(client_service, "smollm2"),
                  model_settings=ModelSettings(temperature=0, max_tokens=64))

    async def run() -> tuple[list[str], str, str]:
        result = Runner.run_streamed(agent, QUESTION)
        deltas = [event.data.delta async for event in result.stream_events()
                  if event.type == "raw_response_event" and isinstance(event.data, ResponseTextDeltaEvent)]
        return deltas, result.final_output, (await Runner.run(agent, QUESTION)).final_output

    deltas, final, whole = asyncio.run(run())
    assert len(deltas) > 1 and "".join(deltas) == final == whole


@pytest.mark.parametrize("model", MODELS)
def test_a_function_tool_over_several_turns(client_service, model):
    """Each turn calls the tool (required, the tool's answer the turn's output); the second turn is sent as the
    first's items (its function_call and function_call_output), the third as previous_response_id. On SmolLM2,
    whose template renders no tools, through the default tool prompt. One call a turn: greedy SmolLM2 repeats a call
    while parallel calls are allowed, until the token limit."""
    calls: list[str] = []
    agent = Agent(name="weather", instructions="Answer with the tool.", model=_model(client_service, model),
                  tools=[_weather_tool(calls)], tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(temperature=0, max_tokens=60, tool_choice="required",
                                               parallel_tool_calls=False))

    async def run():
        first = await Runner.run(agent, "What is the weather in Paris?")
        second = await Runner.run(agent, [*first.to_input_list(),
                                          {"role": "user", "content": "What is the weather in Rome?"}])
        third = await Runner.run(agent, "What is the weather in Oslo?", previous_response_id=second.last_response_id)
        return first, second, third

    first, second, third = asyncio.run(run())
    assert len(calls) == 3 and all(isinstance(city, str) for city in calls)
    assert [first.final_output, second.final_output, third.final_output] == [f"sunny in {c}" for c in calls]
    sent = [item for item in first.to_input_list() if item.get("type") in ("function_call", "function_call_output")]
    assert [item["type"] for item in sent] == ["function_call", "function_call_output"]
    assert json.loads(sent[0]["arguments"]) == {"city": calls[0]}


@pytest.mark.parametrize("model", MODELS)
def test_an_output_type_is_a_structured_answer(client_service, model):
    agent = Agent(name="weather", instructions="Report the weather as JSON.", model=_model(client_service, model),
                  output_type=Weather, model_settings=ModelSettings(temperature=0, max_tokens=120))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?"))
    assert isinstance(result.final_output, Weather)


def test_a_tool_then_an_output_type(client_service):
    """Tools beside a structured output: a call first (required), then (the SDK resets tool_choice to auto) calls
    or the output type's JSON, one call a turn. On the tiny Qwen2 only: greedy SmolLM2, offered both under auto,
    calls the tool again every turn (each call valid) until the SDK's max_turns."""
    model = "tiny-qwen"
    calls: list[str] = []
    agent = Agent(name="weather", instructions="Look the weather up, then report it.",
                  model=_model(client_service, model), tools=[_weather_tool(calls)], output_type=Weather,
                  model_settings=ModelSettings(temperature=0, max_tokens=120, tool_choice="required",
                                               parallel_tool_calls=False))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=6))
    assert calls and isinstance(result.final_output, Weather)
