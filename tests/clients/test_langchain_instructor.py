"""LangChain's ChatOpenAI and instructor, installed from PyPI and unchanged, against the started service: tools bound
with tool_choice auto, a named tool and "any"; structured output by function calling and by json_schema; instructor's
TOOLS and JSON_SCHEMA modes. Each on SmolLM2 (no tool section in its template: the default tool prompt) and on a
tiny Qwen2 with Qwen 2.5's tool template. The models are small or random, so what is asserted is the shape: every
call and every structured answer parses into the pydantic model (the grammar holds them to its schema), never
particular values.
"""

from __future__ import annotations

import instructor
import pytest
from langchain_core.messages import AIMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.clients.conftest import MODELS

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# A call of these tools is about 40 tokens on SmolLM2; the random tiny Qwen2 may spell the city's 16 characters as
# escapes or multi-byte ones, several tokens each (its decoding is cheap).
MAX_TOKENS = {"smollm2": 80, "tiny-qwen": 160}
ASK = "What is the weather in Paris for the next 3 days?"


class GetWeather(BaseModel):
    """The weather in a city for a number of days."""

    city: str = Field(max_length=16, description="The city")
    days: int = Field(ge=1, le=7, description="How many days")


class Add(BaseModel):
    """The sum of two small numbers."""

    a: int = Field(ge=0, le=99)
    b: int = Field(ge=0, le=99)


BY_NAME: dict[str, type[BaseModel]] = {"GetWeather": GetWeather, "Add": Add}


def _chat(client_service, model: str) -> ChatOpenAI:
    return ChatOpenAI(model=model, base_url=client_service.v1, api_key=client_service.key, temperature=0,
                      max_tokens=MAX_TOKENS[model], max_retries=0, timeout=300)


def _valid_calls(message: AIMessage, names: set[str]) -> None:
    assert message.tool_calls and not message.invalid_tool_calls, message
    for call in message.tool_calls:
        assert call["name"] in names and call["id"]
        BY_NAME[call["name"]].model_validate(call["args"])


@pytest.mark.parametrize("model", MODELS)
def test_langchain_bound_tools(client_service, model):
    llm = _chat(client_service, model)
    named = llm.bind_tools([GetWeather, Add], tool_choice="GetWeather").invoke(ASK)
    _valid_calls(named, {"GetWeather"})
    assert len(named.tool_calls) == 1
    _valid_calls(llm.bind_tools([GetWeather, Add], tool_choice="any", parallel_tool_calls=False).invoke(ASK),
                 set(BY_NAME))
    auto = llm.bind_tools([GetWeather, Add], tool_choice="auto").invoke(ASK)
    if auto.tool_calls:
        _valid_calls(auto, set(BY_NAME))
    else:
        assert isinstance(auto.content, str) and "<tool_call>" not in auto.content


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output(client_service, model, method):
    answer = _chat(client_service, model).with_structured_output(GetWeather, method=method).invoke(ASK)
    assert isinstance(answer, GetWeather), answer


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor(client_service, model, mode):
    client = instructor.from_openai(client_service.openai(), mode=mode)
    answer = client.chat.completions.create(model=model, response_model=GetWeather, max_retries=1, temperature=0,
                                            max_tokens=MAX_TOKENS[model], messages=[{"role": "user", "content": ASK}])
    assert isinstance(answer, GetWeather), answer
