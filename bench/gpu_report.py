"""Print the GPU check's table from the JSON files bench/gpu_check.sh wrote; also save it as summary.txt."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _pct(value: float | None) -> str:
    return f"{100 * value:.1f}%" if value is not None else "-"


def partial_summary(data: dict) -> dict:
    """Medians of the runs a cut-short fine-tune part finished (its JSON is rewritten after every run)."""
    summary = {}
    for side, runs in data["runs"].items():
        if runs:
            summary[side] = {key: statistics.median(r[key] for r in runs)
                             for key in ("samples_per_second", "tflops", "dev_accuracy")}
            summary[side]["precision"] = runs[0]["precision"]
            mfus = [r["mfu"] for r in runs if r.get("mfu") is not None]
            summary[side]["mfu"] = statistics.median(mfus) if mfus else None
    return summary


def graph_lines(folder: Path) -> list[str]:
    """The decode-graphs part (graphs-c*.json): the engine with and without CUDA graphs, greedy outputs compared."""
    paths = sorted(folder.glob("graphs-c*.json"), key=lambda p: int(p.stem.split("-c")[1]))
    if not paths:
        return []
    lines = ["", f"{'decode graphs (GPT-2 small shape)':<34}{'eager':>10}{'graphs':>10}{'ratio':>8}  "
                 "greedy identical, graphs captured"]
    for path in paths:
        data = json.loads(path.read_text())
        rates = data["tokens_per_second"]
        eager = next(rate for name, rate in rates.items() if name.startswith("engine"))
        graphs = rates.get("graphs-engine")
        if graphs is None:
            continue
        same = data["greedy_identical"].get("graphs-engine", "-")
        lines.append(f"{'engine, ' + str(data['concurrency']) + ' concurrent':<34}{eager:>10.1f}{graphs:>10.1f}"
                     f"{graphs / eager:>7.2f}x  {same}/{data['requests']}, "
                     f"{data.get('graphs', {}).get('captures', '-')}")
    return lines


def main() -> None:
    """Fine-tune per precision and side, generation per concurrency and side, the device pinning check."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--env", type=Path, default=None, help="a header to print first (date, GPU, versions)")
    parser.add_argument("--more", type=Path, default=None, help="another folder with graphs-c*.json (part 4)")
    args = parser.parse_args()
    folder = args.folder
    lines = []
    if args.env and args.env.is_file():
        lines += [args.env.read_text().strip(), ""]
    models = sorted({json.loads(p.read_text())['model'] for p in folder.glob('finetune-*.json')})
    lines.append(f"{'fine-tune (' + ', '.join(models) + ')':<34}{'prec':>6}{'samples/s':>11}{'TFLOP/s':>9}{'MFU':>7}"
                 f"{'dev acc':>9}  ratio")
    for path in sorted(folder.glob("finetune-*.json")):
        data = json.loads(path.read_text())
        summary = data["summary"] or partial_summary(data)
        baseline = summary.get("hf-trainer-grouped", {}).get("samples_per_second")
        for side, s in summary.items():
            ratio = f"{s['samples_per_second'] / baseline:.2f}x" if baseline and side == "engine" else ""
            label = side + " seq " + str(data["max_length"]) + (" (partial)" if data.get("partial") else "")
            lines.append(f"{label:<34}{s['precision']:>6}"
                         f"{s['samples_per_second']:>11.1f}{s['tflops']:>9.2f}{_pct(s['mfu']):>7}"
                         f"{s['dev_accuracy']:>9.4f}  {ratio}")
    lines += ["", f"{'generation (GPT-2 small shape)':<34}{'tokens/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}  ratio"]
    for path in sorted(folder.glob("generate-c*.json"), key=lambda p: int(p.stem.split("-c")[1])):
        data = json.loads(path.read_text())
        rates = data["tokens_per_second"]
        engine_name = next(name for name in rates if name.startswith("engine"))
        for name, rate in rates.items():
            if name == engine_name:
                ratios = ", ".join(f"{rate / r:.2f}x {n.split('-')[0]}" for n, r in rates.items() if n != name)
                e = data["engine"]
                lines.append(f"{'engine, ' + str(data['concurrency']) + ' concurrent':<34}{rate:>10.1f}"
                             f"{e['ttft_p50_ms']:>8.0f}ms{e['ttft_p99_ms']:>8.0f}ms  {ratios}")
            else:
                label = f"{name} (x{data['concurrency']})" if name.startswith("batched") else name
                lines.append(f"{label:<34}{rate:>10.1f}")
    lines += graph_lines(args.more or folder)
    pin = folder / "device_pin.json"
    if pin.is_file():
        lines.append("")
        for r in json.loads(pin.read_text())["results"]:
            lines.append(f"worker --device {r['requested']}: sees {r.get('visible', '?')} GPU(s), plans "
                         f"{r.get('plan_device', '?')}: {'ok' if r['ok'] else 'FAILED'}")
    text = "\n".join(lines)
    (folder / "summary.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
