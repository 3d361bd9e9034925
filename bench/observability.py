"""Cost of the observability hooks per optimizer step: the Prometheus and TensorBoard reporter sinks.

Baseline: the same number of bare `TrainCallbacks.on_log` calls (what an engine pays without sinks). Prints
microseconds per step for each and the share of a reference training step (MiniLM-L6 on this CPU by default).
    python bench/observability.py --steps 2000 --reference-step-ms 275
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from worker.engines.training.loop import TrainCallbacks
from worker.jobs.prometheus import TrainingMetrics
from worker.jobs.tensorboard import TensorBoardSink


def _time(sink: TrainCallbacks, steps: int) -> float:
    sink.on_start({"device": "cpu", "total_steps": steps})
    started = time.perf_counter()
    for step in range(1, steps + 1):
        sink.on_log(step, step / 100, {"train_loss": 1.0 / step, "learning_rate": 1e-4, "grad_norm": 0.5,
                                       "samples_per_second": 120.0})
        if step % 50 == 0:
            sink.on_eval(step, {"eval_loss": 0.5, "eval_accuracy": 0.8})
    elapsed = time.perf_counter() - started
    close = getattr(sink, "close", None)
    if close is not None:
        close()
    return elapsed / steps * 1e6


def main() -> None:
    """Print per-step microseconds of each sink and their share of a reference step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--reference-step-ms", type=float, default=275.0,
                        help="a real step to compare with (MiniLM-L6, batch 32, fp32 on the dev CPU: ~275 ms)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        baseline = _time(TrainCallbacks(), args.steps)
        prometheus = _time(TrainingMetrics("cpu"), args.steps)
        tensorboard = _time(TensorBoardSink(Path(folder) / "tb", {"learning_rate": 1e-4}), args.steps)
        size = sum(p.stat().st_size for p in (Path(folder) / "tb").rglob("*") if p.is_file())
    both = prometheus + tensorboard
    print(f"steps {args.steps}: bare callbacks {baseline:.1f} us/step, prometheus sink {prometheus:.1f} us/step, "
          f"tensorboard sink {tensorboard:.1f} us/step")
    print(f"both sinks: {both:.0f} us/step = {both / (args.reference_step_ms * 1e3):.3%} of a "
          f"{args.reference_step_ms:.0f} ms step; event file {size / args.steps:.0f} bytes/step")


if __name__ == "__main__":
    main()
