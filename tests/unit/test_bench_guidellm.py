"""bench/guidellm_load.py without a server: guidellm's own report read into the figures its console tables print,
the scenario each side gets, the ratios to trainserve per repeat, and a record bench/results/ accepts.

The reports under data/ are real: guidellm 0.8.1's JSON reports of a smoke run of the script (2 loaded cores,
`--sides trainserve,vllm --rates 1 --sweep-size 3 --max-concurrency 8 --max-seconds 10 --prompt-tokens 64
--output-tokens 16`), cut to the fields the script reads (each benchmark's strategy, duration, request totals, and the
`successful` and `total` summaries of the metrics it reports); the figures asserted are those guidellm's own console
tables printed for the same run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.guidellm_load import benchmarks, parse_args, placement, ratios, result_json, scenario, table
from bench.peers import Side
from trainserve.docs_reference import BenchmarkResult

DATA = Path(__file__).parent / "data"


def _report(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def test_a_report_reads_as_guidellms_own_tables() -> None:
    points = list(benchmarks("sweep", _report("guidellm-0.8.1-vllm-sweep.json")))
    assert [point for point, _ in points] == ["sweep 1 synchronous", "sweep 2 throughput", "sweep 3 poisson"]
    synchronous, throughput, poisson = (run for _, run in points)
    # guidellm's tables: "Request Latency Statistics (Completed Requests)" (Mdn) and "Server Throughput Statistics
    # (All Requests)" (Mean), and the run summary's request counts.
    assert synchronous["ttft_p50"] == pytest.approx(873.4, abs=0.05)
    assert synchronous["itl_p50"] == pytest.approx(197.1, abs=0.05)
    assert synchronous["tpot_p50"] == pytest.approx(239.4, abs=0.05)
    assert synchronous["e2e_p50"] == pytest.approx(3.8, abs=0.05)
    assert synchronous["requests_per_s"] == pytest.approx(0.2, abs=0.005)
    assert synchronous["output_tokens_per_s"] == pytest.approx(3.2, abs=0.05)
    assert (synchronous["completed"], synchronous["incomplete"], synchronous["errored"]) == (2, 1, 0)
    assert throughput["output_tokens_per_s"] == pytest.approx(12.9, abs=0.05)
    assert throughput["ttft_p50"] == pytest.approx(2783.2, abs=0.05) and throughput["offered"] is None
    assert (throughput["completed"], throughput["incomplete"]) == (8, 8)
    assert poisson["offered"] == pytest.approx(0.8, abs=0.005) and poisson["itl_p50"] == pytest.approx(434.2, abs=0.05)
    assert poisson["ttft_p90"] >= poisson["ttft_p50"] and poisson["e2e_p90"] >= poisson["e2e_p50"]
    assert synchronous["seconds"] == 10.0


def test_a_benchmark_without_a_completed_request_has_no_latency_but_keeps_its_throughput() -> None:
    [(point, run)] = benchmarks("poisson", _report("guidellm-0.8.1-trainserve-poisson.json"))
    assert point == "poisson 1/s" and run["offered"] == 1.0
    assert (run["completed"], run["incomplete"], run["errored"]) == (0, 11, 0)
    assert all(math.isnan(run[key]) for key in ("ttft_p50", "itl_p90", "tpot_p50", "e2e_p90"))  # never 0 ms
    assert run["output_tokens_per_s"] > 0  # the chunks the cut-off requests streamed
    [line] = table({(point, "trainserve"): [{**run, "repeat": 0}]})
    assert "offered req/s 1.00 [1.00-1.00]" in line and "TTFT p50 ms n/a" in line and "incomplete 11 [11-11]" in line


def test_every_side_gets_the_same_scenario_but_its_address_and_key() -> None:
    args, _ = parse_args(["--sides", "trainserve,vllm", "--rates", "1", "2", "--max-seconds", "30",
                          "--max-requests", "200", "--output-tokens", "32"])
    ours = Side("trainserve", "http://127.0.0.1:1", "smollm2", None, {"Authorization": "Bearer ts_key"})  # type: ignore[arg-type]
    vllm = Side("vllm", "http://127.0.0.1:2", "smollm2", None)  # type: ignore[arg-type]
    folder, report = Path("/models/smollm2"), Path("/tmp/report.json")
    for profile in ("synchronous", "poisson", "sweep"):
        mine, theirs = (scenario(args, side, profile, folder, report)["spec"] for side in (ours, vllm))
        assert mine["backend"].pop("api_key") == "ts_key" and theirs["backend"].pop("api_key") is None
        assert mine["backend"].pop("target") != theirs["backend"].pop("target")
        assert mine == theirs
    spec = scenario(args, vllm, "poisson", folder, report)["spec"]
    assert spec["profile"] == {"kind": "poisson", "rate": [1.0, 2.0]}
    assert spec["constraints"] == [{"kind": "max_duration", "seconds": 30.0}, {"kind": "max_requests", "count": 200}]
    assert spec["data"] == [{"kind": "synthetic_text", "prompt_tokens": 128, "output_tokens": 32}]
    assert spec["backend"]["request_format"] == "/v1/chat/completions" and spec["backend"]["stream"] is True
    assert spec["tokenizer"]["model"] == str(folder)
    sweep = scenario(args, vllm, "sweep", folder, report)["spec"]["profile"]
    assert sweep["max_concurrency"] == parse_args(["--sides", "vllm"])[1].slots  # the engine's rows by default


def test_server_options_go_to_peers_parser_and_its_load_options_are_refused() -> None:
    args, servers = parse_args(["--sides", "trainserve,llama-q8_0", "--slots", "8", "--vllm-compile"])
    assert servers.slots == 8 and servers.vllm_compile and servers.sides == ["trainserve", "llama-q8_0"]
    assert args.max_concurrency == 8
    with pytest.raises(SystemExit):
        parse_args(["--requests", "60"])  # peers.py's own load: meaningless here
    with pytest.raises(SystemExit):
        parse_args(["--sides", "trainserve,llama"])  # not a side of peers.ALL_SIDES


def test_the_client_has_a_core_of_its_own_only_from_four_cores() -> None:
    assert placement([0, 1]) == (None, [0, 1])
    assert placement(list(range(8))) == (7, list(range(7)))


def _run(repeat: int, tokens_per_s: float, itl: float = 50.0) -> dict:
    return {"repeat": repeat, "requests_per_s": 1.0, "output_tokens_per_s": tokens_per_s, "ttft_p50": 100.0,
            "ttft_p90": 200.0, "itl_p50": itl, "itl_p90": itl, "tpot_p50": itl, "tpot_p90": itl, "e2e_p50": 1.0,
            "e2e_p90": 2.0, "errored": 0, "incomplete": 1, "completed": 5, "offered": None, "seconds": 10.0}


def test_ratios_pair_the_sides_of_one_repeat_and_skip_figures_a_side_lacks() -> None:
    rows = {("synchronous", "trainserve"): [_run(0, 20.0), _run(1, 30.0), _run(2, 40.0)],
            # vllm's repeat 1 failed: its repeats 0 and 2 pair with trainserve's 0 and 2, never 1
            ("synchronous", "vllm"): [_run(0, 10.0, itl=math.nan), _run(2, 20.0)]}
    [line] = ratios(rows)
    assert "output tok/s 2.00 [2.00-2.00]x (higher is better)" in line
    assert "ITL p50 1.00 [1.00-1.00]x" in line  # the repeat without an ITL is left out, not a nan ratio
    assert table(rows)[0].startswith("synchronous trainserve: req/s 1.00 [1.00-1.00], output tok/s 30.0 [20.0-40.0]")


def test_the_record_is_a_benchmark_result_naming_guidellm_the_profile_and_the_pinning(tmp_path) -> None:
    args, servers = parse_args(["--sides", "trainserve,llama-q8_0", "--llama-server", str(tmp_path / "none"),
                                "--repeats", "3", "--target", "within 10% of peers.py"])
    rows = {("synchronous", "trainserve"): [_run(0, 20.0)], ("synchronous", "llama-q8_0"): [_run(0, 10.0)]}
    lines = table(rows) + ratios(rows)
    record = result_json(args, servers, "0.8.1", (None, [0, 1]), lines, ["hf-serve did not run: no"], [1.5, 2.5])
    summary = BenchmarkResult.model_validate(record)
    assert summary.benchmark == "bench/guidellm_load.py" and summary.load == "1.5-2.5"
    assert "guidellm 0.8.1" in summary.what and "llama-server unknown" in summary.what  # no version made up
    assert "guidellm not pinned" in summary.what and "128 prompt tokens and exactly 64 output tokens" in summary.what
    assert "each benchmark at most 20 s or 1000 requests on every side" in summary.what
    assert "3 interleaved repeats" in summary.what and "(q8_0 GGUFs for llama.cpp)" in summary.what
    assert "trainserve / llama-q8_0: output tok/s 2.00" in summary.result and "hf-serve did not run" in summary.result
    assert "bench/peers.py" in summary.measures and "bench/guidellm_load.py" in summary.measures
    pinned = result_json(args, servers, "0.8.1", (7, list(range(7))), lines, [], [1.0])
    assert "guidellm pinned to core 7 (taskset), the servers on the other 7" in pinned["what"]
