"""The vLLM engine's plain parts, without a server: which engine a model gets, how vLLM is started, trainserve's
sampling in vLLM's completions body, and vLLM's streamed chunks read back as trainserve's choices."""

from __future__ import annotations

import json
import os

import pytest
from pydantic import ValidationError

from core.protocol import Constraint, SamplingParams
from core.settings import Settings
from worker.engines.vllm.server import ServerSpec, find_python
from worker.engines.vllm.wire import ChoiceStream, choice_body, error_message, finish_reason, structured_outputs

TABLE = [b"a", b"b", b" c", b"\xe2\x82", b""]  # token ids 0-4; 4 is the eos


def test_engine_choice_per_worker_and_per_model() -> None:
    settings = Settings(generation_engine_models="big=vllm,small=builtin")
    assert settings.generation_engine_for("big", cuda=False, vllm_installed=False) == "vllm"
    assert settings.generation_engine_for("small", cuda=True, vllm_installed=True) == "builtin"
    # auto: vLLM on a CUDA worker that has it; the built-in engine on a CPU, or where vLLM is missing
    assert settings.generation_engine_for("other", cuda=True, vllm_installed=True) == "vllm"
    assert settings.generation_engine_for("other", cuda=True, vllm_installed=False) == "builtin"
    assert settings.generation_engine_for("other", cuda=False, vllm_installed=True) == "builtin"
    assert Settings(generation_engine="vllm").generation_engine_for("x", cuda=False, vllm_installed=False) == "vllm"
    assert Settings(vllm_model_devices="big=4", vllm_devices=2).vllm_devices_for("big") == 4
    assert Settings(vllm_devices=2).vllm_devices_for("other") == 2
    for bad in ({"generation_engine_models": "big=tgi"}, {"generation_engine_models": "big"},
                {"vllm_model_devices": "big=1.5"}, {"generation_engine": "sglang"}):
        with pytest.raises(ValidationError):
            Settings(**bad)


def test_a_configured_python_that_is_missing_is_not_found(tmp_path) -> None:
    python = tmp_path / "python"
    assert find_python(str(python)) != str(python)
    python.write_text("")
    assert find_python(str(python)) == str(python)


def _spec(**changes) -> ServerSpec:
    base = {"python": "/venv/bin/python", "model": "/models/m", "served_name": "base", "dtype": "float32",
            "device": "cpu", "visible_devices": None, "tensor_parallel": 1, "max_num_seqs": 8, "max_model_len": 2048,
            "kv_cache_gib": 2, "gpu_memory_utilization": 0.9, "enforce_eager": True, "prefix_caching": True,
            "max_loras": 4, "max_lora_rank": 32, "threads": 2}
    return ServerSpec(**{**base, **changes})


def test_the_server_command_and_environment() -> None:
    cpu = _spec()
    command = cpu.command(8000)
    assert command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    value = {command[i]: command[i + 1] for i in range(3, len(command) - 1) if command[i].startswith("--")}
    assert value["--max-num-seqs"] == "8" and value["--max-lora-rank"] == "32" and value["--port"] == "8000"
    assert json.loads(value["--structured-outputs-config"]) == {"backend": "guidance", "disable_any_whitespace": True}
    assert "--enforce-eager" in command and "--enable-prefix-caching" in command
    assert "--gpu-memory-utilization" not in command
    assert "--enable-lora" not in _spec(lora=False).command(8000)  # enabled when an adapter is first asked for
    env = cpu.environment()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["OMP_NUM_THREADS"] == "2"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and len(env["VLLM_CPU_OMP_THREADS_BIND"].split(",")) == min(
        2, len(os.sched_getaffinity(0)))  # one engine thread per core, none kept for its API server
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and "PYTHONPATH" not in env
    gpu = _spec(device="cuda", tensor_parallel=4, enforce_eager=False, prefix_caching=False, visible_devices="2,3",
                extra_args=("--max-num-batched-tokens", "8192"))
    command = gpu.command(8001)
    assert "--enforce-eager" not in command and "--no-enable-prefix-caching" in command
    assert command[command.index("--tensor-parallel-size") + 1] == "4" and command[-2:] == [
        "--max-num-batched-tokens", "8192"]
    assert gpu.environment()["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_sampling_goes_whole_into_the_body() -> None:
    params = SamplingParams(max_new_tokens=7, temperature=0.5, top_k=3, top_p=0.9, repetition_penalty=1.2,
                            stop=("END",), seed=10, n=3, logprobs=2)
    body = choice_body("base", [1, 2], params, index=2, cache_salt="tenant-a")
    assert body["cache_salt"] == "tenant-a"  # vLLM keys the prompt's cached blocks by it: one tenant's own
    assert body["seed"] == 12 and body["n"] == 1  # choice i is seeded seed + i, as the built-in engine's rows
    assert (body["max_tokens"], body["temperature"], body["top_k"], body["top_p"], body["repetition_penalty"]) == (
        7, 0.5, 3, 0.9, 1.2)
    assert body["stop"] == ["END"] and body["logprobs"] == 2 and body["stream"] is True
    plain = choice_body("job_x", [1], SamplingParams(), index=0)
    assert plain["top_k"] == -1 and plain["repetition_penalty"] == 1.0 and plain["model"] == "job_x"
    assert "seed" not in plain and "logprobs" not in plain and "structured_outputs" not in plain
    assert "cache_salt" not in plain
    assert plain["ignore_eos"] is False and plain["min_tokens"] == 0  # sent always, as every sampling parameter


def test_ignore_eos_and_min_tokens_go_into_the_body() -> None:
    body = choice_body("base", [1], SamplingParams(max_new_tokens=9, min_tokens=5, ignore_eos=True), index=0)
    assert body["ignore_eos"] is True and body["min_tokens"] == 5 and body["max_tokens"] == 9


def test_constraints_map_to_structured_outputs() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert structured_outputs(Constraint(kind="json_schema", spec=json.dumps(schema))) == {"json": schema}
    assert structured_outputs(Constraint(kind="json_object")) == {"json_object": True}
    assert structured_outputs(Constraint(kind="regex", spec="[0-9]+")) == {"regex": "[0-9]+"}
    assert structured_outputs(Constraint(kind="choice", spec='["yes", "no"]')) == {"choice": ["yes", "no"]}
    assert structured_outputs(Constraint(kind="lark", spec="start: \"x\"")) == {"grammar": "start: \"x\""}


def test_finish_reasons() -> None:
    assert finish_reason("length", None) == "length"
    assert finish_reason("stop", None) == "eos"  # no stop string: an end-of-sequence token
    assert finish_reason("stop", 128009) == "eos"  # a stop token id (generation_config's eos list)
    assert finish_reason("stop", "END") == "stop"
    assert finish_reason("abort", None) == "cancelled"


def _chunk(text: str, ids: list[int], logprobs: dict | None = None, finish: str | None = None,
           stop_reason=None) -> dict:
    return {"choices": [{"index": 0, "text": text, "token_ids": ids, "logprobs": logprobs, "finish_reason": finish,
                         "stop_reason": stop_reason}]}


def test_chunks_fold_into_a_choice_with_logprobs_by_token_id() -> None:
    stream = ChoiceStream(0, TABLE, frozenset({4}))
    delta, logprobs = stream.take(_chunk("a", [0], {"tokens": ["token_id:0"], "token_logprobs": [-0.5],
                                                    "top_logprobs": [{"token_id:0": -0.5, "token_id:2": -1.5,
                                                                      "token_id:1": -0.7}]}), top=2)
    assert delta == "a" and logprobs is not None
    assert (logprobs[0].token, logprobs[0].bytes, logprobs[0].logprob) == ("a", [97], -0.5)
    assert [(t.token, t.logprob) for t in logprobs[0].top_logprobs] == [("a", -0.5), ("b", -0.7)]  # the 2 best
    delta, logprobs = stream.take(_chunk(" c", [2, 4], {"tokens": ["token_id:2", "token_id:4"],
                                                        "token_logprobs": [-1.0, -0.1],
                                                        "top_logprobs": [{"token_id:2": -1.0}, {"token_id:4": -0.1}]},
                                         finish="stop"), top=2)
    assert delta == " c" and logprobs is not None and len(logprobs) == 1  # no logprob for the eos, as built-in
    assert stream.text == "a c" and stream.token_ids == [0, 2, 4] and stream.finish == "eos"
    assert stream.logprobs is not None and len(stream.logprobs) == 2
    stream.take({"choices": [], "usage": {"prompt_tokens": 300, "prompt_tokens_details": {"cached_tokens": 256}}},
                top=None)
    assert stream.cached_tokens == 256
    raw = ChoiceStream(0, TABLE, frozenset({4}))
    raw.take(_chunk("\ufffd", [3], {"tokens": ["token_id:3"], "token_logprobs": [-2.0], "top_logprobs": [{}]}), top=0)
    assert raw.logprobs is not None and raw.logprobs[0].bytes == [0xE2, 0x82]  # a token's own bytes, not its text
    assert raw.take(_chunk("x", [0]), top=None) == ("x", None)


def test_error_messages_are_read_from_vllms_envelope() -> None:
    assert error_message(json.dumps({"error": {"message": "bad grammar", "type": "BadRequestError"}})) == "bad grammar"
    assert error_message("not json") == "not json"


def test_a_scored_prompt_is_asked_of_choice_0_as_an_echo_and_read_back_apart() -> None:
    params = SamplingParams(max_new_tokens=1, n=2, logprobs=1, prompt_logprobs=2)
    first = choice_body("base", [0, 2, 1], params, index=0)
    assert first["echo"] is True and first["logprobs"] == 2 and first["return_token_ids"] is True  # echo text ""
    second = choice_body("base", [0, 2, 1], params, index=1)
    assert "echo" not in second and second["logprobs"] == 1
    stream = ChoiceStream(0, TABLE, frozenset({4}), echoed=3)
    # vLLM's echo chunk: the prompt's entries (the first null), then the generated token's; its text only the output.
    delta, logprobs = stream.take(_chunk("b", [1], {
        "tokens": ["token_id:0", "token_id:2", "token_id:4", "token_id:1"],
        "token_logprobs": [None, -1.25, -0.5, -0.75],
        "top_logprobs": [None, {"token_id:2": -1.25, "token_id:0": -0.25, "token_id:1": -2.0},
                         {"token_id:4": -0.5}, {"token_id:1": -0.75, "token_id:3": -1.0}],
        "text_offset": [0, 1, 3, 3]}), top=1, prompt_top=2)
    assert delta == "b" and stream.text == "b"
    assert logprobs is not None and [(e.token, e.logprob) for e in logprobs] == [("b", -0.75)]
    assert [t.token for t in logprobs[0].top_logprobs] == ["b"]
    prompt = stream.prompt_logprobs
    assert prompt is not None and (prompt.first.token, prompt.first.bytes) == ("a", [97])
    assert [(e.token, e.logprob) for e in prompt.scored] == [(" c", -1.25), ("", -0.5)]  # a prompt's eos is scored
    assert [(t.token, t.logprob) for t in prompt.scored[0].top_logprobs] == [("a", -0.25), (" c", -1.25)]
    later, _ = stream.take(_chunk("a", [0], {"tokens": ["token_id:0"], "token_logprobs": [-0.1],
                                             "top_logprobs": [{"token_id:0": -0.1}]}), top=1, prompt_top=2)
    assert later == "a" and len(prompt.scored) == 2 and stream.logprobs is not None and len(stream.logprobs) == 2
    with pytest.raises(ValueError, match="echoed 1 prompt tokens"):
        ChoiceStream(0, TABLE, frozenset({4}), echoed=3).take(_chunk("", [], {
            "tokens": ["token_id:0"], "token_logprobs": [None], "top_logprobs": [None]}), top=None, prompt_top=0)
