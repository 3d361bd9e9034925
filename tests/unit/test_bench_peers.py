"""bench/peers.py's figures: answers re-tokenized, refused and failed requests kept in the percentiles as infinite
latency, and a summary bench/results/ accepts."""

from __future__ import annotations

import math

from bench.peers import agreement, parse_args, report, result_json, summarize
from core.settings import Settings
from tests.tiny_chat import build_chat_tokenizer
from trainserve.docs_reference import BenchmarkResult


def _run(sent: float, ttft: float | None, end: float, text: str, status: int = 200) -> dict:
    return {"sent": sent, "ttft": ttft, "end": end, "text": text, "status": status, "error": ""}


def test_refused_requests_count_as_infinite_latency_and_answers_are_re_tokenized() -> None:
    tokenizer = build_chat_tokenizer()
    args = parse_args(["--slo-ttft", "1", "--slo-itl", "10"])
    answer = "hello there, hello again"
    runs = [_run(0.0, 0.5, 2.0, answer), _run(1.0, 0.2, 3.0, answer), _run(1.2, 0.3, 3.2, answer),
            _run(1.5, None, 1.6, "", status=429), _run(2.0, None, 4.0, "", status=599)]
    figures = summarize(runs, tokenizer, args)
    tokens = len(tokenizer(answer, add_special_tokens=False)["input_ids"])
    assert figures["tokens"] == 3 * tokens and math.isclose(figures["tokens_per_s"], 3 * tokens / 4.0)
    assert (figures["served"], figures["refused"], figures["failed"]) == (3, 1, 1)
    assert figures["e2e_p50"] == 2.0 and math.isinf(figures["e2e_p90"]) and math.isinf(figures["ttft_p99"])
    assert math.isclose(figures["goodput"], 3 / 4.0)  # the served requests met the SLO; the others did not
    assert math.isclose(runs[0]["itl"], 1.5 / (tokens - 1))


def test_the_summary_is_a_benchmark_result_naming_sides_that_did_not_run() -> None:
    args = parse_args(["--sides", "trainserve,hf-serve", "--repeats", "1", "--target", "4x"])
    row = {"tokens_per_s": 10.0, "goodput": 1.0, "ttft_p50": 0.1, "ttft_p90": 0.2, "itl_p50": 0.05, "itl_p99": 0.1,
           "e2e_p50": 1.0, "e2e_p90": 2.0, "e2e_p99": math.inf, "refused": 1, "failed": 0, "load": 1.5}
    rows = {("rate 1/s", "trainserve"): [row], ("rate 1/s", "hf-serve"): [{**row, "tokens_per_s": 2.5}]}
    lines = report(rows)
    assert any("trainserve / hf-serve: 4.00x tokens/s" in line for line in lines)
    summary = BenchmarkResult.model_validate(result_json(args, rows, lines, {"llama-f32": "no GGUF"}))
    assert summary.benchmark == "bench/peers.py" and "llama-f32 did not run: no GGUF" in summary.result
    assert summary.load == "1.5-1.5" and summary.target == "4x" and "e2e p99 s inf" in summary.result


def test_greedy_answers_are_compared_with_trainserves_skipping_requests_a_side_did_not_serve() -> None:
    answers = {("rate 1/s", "trainserve"): ["a", "b", "c", None], ("rate 1/s", "llama"): ["a", "x", None, "d"]}
    assert agreement(answers) == ["rate 1/s: llama answered as trainserve in 1 of 2 chats"]


def test_llama_sides_serve_their_own_precision_with_a_slot_per_engine_row(tmp_path) -> None:
    args = parse_args(["--sides", "trainserve,llama-f16,llama-q4_k_m", "--llama-server", str(tmp_path / "none")])
    assert args.slots == Settings().max_batch_size
    row = {"tokens_per_s": 10.0, "goodput": 1.0, "ttft_p50": 0.1, "ttft_p90": 0.2, "itl_p50": 0.05, "itl_p99": 0.1,
           "e2e_p50": 1.0, "e2e_p90": 2.0, "e2e_p99": 3.0, "refused": 0, "failed": 0, "load": 1.0}
    summary = BenchmarkResult.model_validate(result_json(args, {("rate 1/s", "trainserve"): [row]}, [], {}))
    assert "(f16/q4_k_m GGUFs for llama.cpp)" in summary.what
    assert f"llama-server -np {args.slots}, one thread pinned per core" in summary.what
    assert "llama-server unknown" in summary.what  # no binary there: its version is not made up
