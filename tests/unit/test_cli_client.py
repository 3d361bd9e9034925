"""The client commands' pieces without a service: where the URL and key come from, the job body the flags build,
and following a job's feed over a transport that drops the connection once (it resumes with Last-Event-ID)."""

from __future__ import annotations

import io
import json
import sys

import httpx
import pytest
from rich.console import Console

from trainserve.cli import build_parser
from trainserve.client.api import Api, ApiError
from trainserve.client.chat import chat
from trainserve.client.commands import FLAGS, hyperparameter_flag, job_spec
from trainserve.client.config import ClientConfig, ConfigError, load_config
from trainserve.client.follow import follow, summary


@pytest.fixture()
def no_env(monkeypatch, tmp_path):
    for name in ("TRAINSERVE_URL", "TRAINSERVE_API_KEY", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRAINSERVE_CONFIG", str(tmp_path / "config.toml"))
    return tmp_path / "config.toml"


def test_flags_win_over_the_environment_which_wins_over_the_file(no_env, monkeypatch):
    assert load_config() == ClientConfig(url="http://127.0.0.1:8000", api_key=None)
    no_env.write_text('url = "http://file:1/"\napi_key = "ts_file"\n')
    assert load_config() == ClientConfig(url="http://file:1", api_key="ts_file")
    monkeypatch.setenv("TRAINSERVE_API_KEY", "ts_env")
    assert load_config().api_key == "ts_env"
    assert load_config(url="http://flag:2", api_key="ts_flag") == ClientConfig(url="http://flag:2", api_key="ts_flag")
    no_env.write_text("url = [")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config()


def test_train_flags_build_the_jobs_body(tmp_path):
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"task": "causal-lm", "train_dataset": "ds_a", "hyperparameters": {"epochs": 3}}))
    args = build_parser().parse_args(["train", "--spec", str(spec), "--learning-rate", "1e-4", "--set",
                                      "eval_steps=50", "--set", "lr_scheduler=cosine", "--base-model", "minilm-l6"])
    assert job_spec(args) == {"task": "causal-lm", "train_dataset": "ds_a", "base_model": "minilm-l6",
                              "hyperparameters": {"epochs": 3, "learning_rate": 1e-4, "eval_steps": 50,
                                                  "lr_scheduler": "cosine"}}
    with pytest.raises(ConfigError, match="--dataset"):
        job_spec(build_parser().parse_args(["train"]))


def test_hyperparameter_flags_take_their_types_and_help_from_the_kinds_models():
    from core.hyperparams import Hyperparameters, LMHyperparameters

    args = build_parser().parse_args(["train", "--dataset", "ds_a", "--epochs", "0.5", "--batch-size", "4"])
    assert job_spec(args)["hyperparameters"] == {"epochs": 0.5, "batch_size": 4}  # epochs is a float in the models
    for name in FLAGS:
        kind, description = hyperparameter_flag(name)
        model = Hyperparameters if name in Hyperparameters.model_fields else LMHyperparameters
        assert model.model_fields[name].description == description and kind in (int, float), name
    assert [hyperparameter_flag(name)[0] for name in ("epochs", "learning_rate", "max_steps")] == [float, float, int]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--batch-size", "4.5"])  # an int in every kind's model


def test_train_offers_the_registered_kinds_those_of_plugin_modules_too(monkeypatch):
    from core.jobspec import KINDS, unregister
    from core.settings import Settings

    monkeypatch.setattr("core.settings.get_settings", lambda: Settings(job_kind_modules="tests.toy_kind"))
    monkeypatch.delitem(sys.modules, "tests.toy_kind", raising=False)  # imported afresh, as a new process would
    try:
        args = build_parser().parse_args(["train", "--task", "text-length", "--dataset", "ds_a"])
        assert job_spec(args)["task"] == "text-length" and "text-length" in KINDS
    finally:
        unregister("text-length")
    with pytest.raises(SystemExit):  # not a registered kind: argparse refuses it
        build_parser().parse_args(["train", "--task", "text-lengths"])


def _sse(*messages: tuple[str, dict, str]) -> bytes:
    return "".join(f"id: {i}\nevent: {e}\ndata: {json.dumps(d)}\n\n" for e, d, i in messages).encode()


def test_follow_draws_progress_and_loss_and_resumes_after_a_dropped_stream():
    seen_ids: list[str | None] = []
    first = _sse(("state", {"status": "running", "step": 2, "total_steps": 10, "metrics": {}}, "1-0"),
                 ("metrics", {"points": [{"name": "train_loss", "value": 0.6931, "step": 2}]}, "1-5"))
    rest = _sse(("job_event", {"message": "evaluation at step 10", "created_at": "2026-12-01T10:00:00"}, "2-5"),
                ("state", {"status": "succeeded", "step": 10, "total_steps": 10,
                           "metrics": {"train_loss": 0.25, "eval_loss": 0.3}}, "2-9"),
                ("end", {"status": "succeeded"}, "2-9"))

    def handler(request: httpx.Request) -> httpx.Response:
        seen_ids.append(request.headers.get("Last-Event-ID"))
        if len(seen_ids) == 2:
            raise httpx.ReadError("connection dropped")
        return httpx.Response(200, content=first if len(seen_ids) == 1 else rest,
                              headers={"content-type": "text/event-stream"})

    out = io.StringIO()
    api = Api(ClientConfig(url="http://svc", api_key="k"), transport=httpx.MockTransport(handler))
    state = follow(api, "job_x", Console(file=out, width=120))
    assert state["status"] == "succeeded" and state["step"] == 10
    assert seen_ids == [None, "1-5", "1-5"]  # resumed after what it had drawn
    text = out.getvalue()
    assert "10/10" in text and "loss 0.2500  eval 0.3000" in text and "evaluation at step 10" in text


def test_errors_name_the_field_and_chat_streams_each_turn():
    turns: list[list[dict]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["model"] == "nope":
            return httpx.Response(404, json={"error": {"code": "not_found", "message": "model 'nope' not found",
                                                       "field": "model"}})
        turns.append(body["messages"])
        chunks = [{"choices": [{"delta": {"content": piece}}]} for piece in ("Hel", "lo")]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})

    api = Api(ClientConfig(url="http://svc", api_key="k"), transport=httpx.MockTransport(handler))
    out = io.StringIO()
    code = chat(api, Console(file=out), io.StringIO("hi\n\nagain\n/exit\n"), model="m", system="Be brief.",
                max_tokens=8, temperature=0)
    assert code == 0 and out.getvalue().count("Hello") == 2
    assert turns[1] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "again"}]
    with pytest.raises(ApiError, match=r"not found \(field model\) \[404 not_found\]"):
        chat(api, Console(file=io.StringIO()), io.StringIO("x\n"), model="nope", system=None, max_tokens=8,
             temperature=0)


def test_server_text_is_printed_as_text_without_markup_or_terminal_escapes(tmp_path, capsys):
    """A column named `[/bold]` used to raise MarkupError after the upload succeeded; escape codes in events and
    chat text reached the terminal."""
    hostile = "[/bold][red]x\x1b[2J\x1b]0;owned\x07 :smile:"

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/datasets":
            return httpx.Response(201, json={"id": "ds_1", "rows": 2, "columns": ["text", hostile]})
        if request.url.path.endswith("/events"):
            return httpx.Response(200, content=_sse(
                ("job_event", {"message": hostile, "created_at": "2026-12-01T10:00:00"}, "1-1"),
                ("state", {"status": "failed", "step": 1, "total_steps": 1,
                           "error": {"code": "x", "message": hostile}}, "1-2"),
                ("end", {"status": "failed"}, "1-2")), headers={"content-type": "text/event-stream"})
        chunk = {"choices": [{"delta": {"content": hostile}}]}
        return httpx.Response(200, content=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode(),
                              headers={"content-type": "text/event-stream"})

    from trainserve.client import commands

    data = tmp_path / "d.csv"
    data.write_text("text\nhi\n")
    api = Api(ClientConfig(url="http://svc", api_key="k"), transport=httpx.MockTransport(handler))
    out = io.StringIO()
    console = Console(file=out, width=400, emoji=False)
    args = build_parser().parse_args(["upload", str(data)])
    assert commands._upload(api, args, console) == 0
    state = follow(api, "job_x", console)
    console.print(summary(state))
    chat(api, console, io.StringIO("hi\n"), model="m", system=None, max_tokens=4, temperature=0)
    text = out.getvalue()
    assert "\x1b" not in text and "\x07" not in text
    assert text.count("[/bold][red]x\\x1b[2J\\x1b]0;owned\\x07 :smile:") == 4  # column, event, summary, chat reply
