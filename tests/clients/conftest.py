"""One started service for the third-party client tests: the API and both workers as processes, serving the real
SmolLM2-135M-Instruct (a Llama chat template with no tool section, as most models have) and a tiny Qwen2 with Qwen
2.5's tool template, on the built-in engine.

Every module under tests/clients drives it with a client installed from PyPI (the Agents SDK, LangChain, instructor,
lm-evaluation-harness), unchanged: its own requests, its own parsing. Package-scoped: the xdist worker that runs
these modules one after another starts it once (and stops it before any other module's service starts, which
empties the tables and Redis when it stops).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.conftest import INTEGRATION_REDIS, make_key
from tests.service import started_service
from tests.tiny_tools import ASKS, build_tool_base, tool_conversation

MODELS = ("smollm2", "tiny-qwen")  # the template without tools, the one with Qwen 2.5's


@dataclass(frozen=True)
class ClientService:
    base: str  # the API's root URL; OpenAI clients take f"{base}/v1"
    key: str
    smollm2: Path  # the model folders, for reference runs in-process
    tool_base: Path

    @property
    def v1(self) -> str:
        return f"{self.base}/v1"

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.v1, api_key=self.key, max_retries=0, timeout=300)


@pytest.fixture(scope="package")
def client_service(pg_url, tmp_path_factory) -> Iterator[ClientService]:
    from trainserve.real_models import build_smollm2

    root = tmp_path_factory.mktemp("clients")
    home = root / "home"
    (home / "models").mkdir(parents=True)
    smollm2 = build_smollm2()
    (home / "models" / "smollm2").symlink_to(smollm2)
    tool_base = build_tool_base(home / "models" / "tiny-qwen", [tool_conversation(*ask) for ask in ASKS])
    with started_service(pg_url, INTEGRATION_REDIS, home, root, TRAINSERVE_GENERATION_WAIT_S="300",
                         TRAINSERVE_MODEL_ROOTS=str(smollm2.parent)) as base:
        service = ClientService(base, make_key(pg_url, tenant="clients"), smollm2, tool_base)
        api = service.openai()
        with ThreadPoolExecutor(2) as pool:  # each model's first request waits for its engine, both loading at once
            list(pool.map(lambda model: api.completions.create(model=model, prompt="Hi", max_tokens=1, timeout=600),
                          MODELS))
        yield service
