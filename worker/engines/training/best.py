"""Which evaluation was best, and whether evaluations have stopped improving (early stopping)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class BestTracker:
    """Follows one eval metric across evaluations; its state travels in every checkpoint for an exact resume.

    The best moves on any strict improvement; the patience counter resets only on an improvement larger
    than `threshold` (as Hugging Face's EarlyStoppingCallback), so a flat run stops even while it creeps.
    """

    metric: str
    greater_is_better: bool
    patience: int | None = None
    threshold: float = 0.0
    step: int | None = None
    value: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    bad_evaluations: int = 0

    def update(self, step: int, metrics: dict[str, float]) -> bool:
        """Record one evaluation; True when it is the new best."""
        value = metrics.get(self.metric)
        if value is None:
            raise ValueError(f"metric_for_best {self.metric!r} is not among this task's eval metrics "
                             f"({', '.join(sorted(metrics))})")
        value = float(value)
        if self.value is None:
            self._take(step, value, metrics)
            return True
        gain = value - self.value if self.greater_is_better else self.value - value
        self.bad_evaluations = 0 if gain > self.threshold else self.bad_evaluations + 1
        if gain > 0:
            self._take(step, value, metrics)
            return True
        return False

    @property
    def exhausted(self) -> bool:
        """Whether `patience` evaluations in a row brought no improvement beyond the threshold."""
        return self.patience is not None and self.bad_evaluations >= self.patience

    def best(self) -> dict[str, Any] | None:
        """{step, metric, value} of the best evaluation so far, or None before the first."""
        if self.step is None:
            return None
        return {"step": self.step, "metric": self.metric, "value": self.value}

    def state(self) -> dict[str, Any]:
        """What a checkpoint stores (plain JSON)."""
        return {"step": self.step, "value": self.value, "metrics": dict(self.metrics),
                "bad_evaluations": self.bad_evaluations}

    def restore(self, state: dict[str, Any] | None) -> None:
        """Take back the state a checkpoint stored (checkpoints from before best tracking have none)."""
        if not state:
            return
        self.step, self.value = state["step"], state["value"]
        self.metrics = dict(state["metrics"])
        self.bad_evaluations = int(state["bad_evaluations"])

    def _take(self, step: int, value: float, metrics: dict[str, float]) -> None:
        self.step, self.value, self.metrics = step, value, dict(metrics)
