"""Follow a job live: a progress bar with the step, the latest training loss and the ETA, and its events as lines.

Reads the job's server-sent feed (GET /jobs/{id}/events?stream=true); a dropped connection resumes where it left
off with Last-Event-ID, so nothing is shown twice and nothing is missed.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeRemainingColumn

from trainserve.client import SHORT_METRICS, STATUS_STYLE
from trainserve.client.api import Api, ApiError, loads
from trainserve.client.text import plain

RECONNECTS = 20


def _metrics_text(latest: dict[str, float]) -> str:
    return "  ".join(f"{short} {latest[name]:.4f}" for name, short in SHORT_METRICS.items() if name in latest)


class _Feed:
    """What the feed has said so far, and how to draw it."""

    def __init__(self, job_id: str, progress: Progress) -> None:
        self.job_id, self.progress = job_id, progress
        self.bar = progress.add_task(job_id, total=None, metrics="")
        self.state: dict[str, Any] = {"status": "queued"}
        self.latest: dict[str, float] = {}

    def take(self, event: str, payload: Any) -> bool:
        """Apply one message; True once the job has ended."""
        if event == "state":
            self.state = payload
            self.latest.update({k: v for k, v in (payload.get("metrics") or {}).items() if isinstance(v, int | float)})
        elif event == "metrics":
            for point in payload.get("points", []):
                self.latest[point["name"]] = point["value"]
        elif event == "job_event":
            self.progress.console.print(f"[dim]{plain(str(payload.get('created_at', ''))[11:19])}[/] "
                                        f"{plain(payload.get('message'))}")
        status = str(self.state.get("status"))
        style = STATUS_STYLE.get(status, "white")
        self.progress.update(self.bar, completed=self.state.get("step") or 0, total=self.state.get("total_steps"),
                             description=f"{plain(self.job_id)} [{style}]{plain(status)}[/]",
                             metrics=plain(_metrics_text(self.latest)))
        return event == "end"


def follow(api: Api, job_id: str, console: Console) -> dict[str, Any]:
    """Draw the job until it ends; returns its last state (status, step, metrics, error)."""
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(),
               TextColumn("{task.fields[metrics]}"), TimeRemainingColumn())
    cursor: str | None = None
    with Progress(*columns, console=console) as progress:
        feed = _Feed(job_id, progress)
        for attempt in range(RECONNECTS + 1):
            headers = {"Last-Event-ID": cursor} if cursor else {}
            try:
                for event, data, event_id in api.events("GET", f"/jobs/{job_id}/events", params={"stream": "true"},
                                                        headers=headers):
                    cursor = event_id or cursor
                    if feed.take(event, loads(data)):
                        return feed.state
            except ApiError as exc:
                if exc.status or attempt == RECONNECTS:  # the service refused (4xx/5xx), or it stays unreachable
                    raise
            time.sleep(min(2.0, 0.2 * (attempt + 1)))
    return feed.state


def summary(state: dict[str, Any]) -> str:
    """One line on how the job ended."""
    status = str(state.get("status"))
    metrics = ", ".join(f"{k} {v:.4g}" for k, v in sorted((state.get("metrics") or {}).items())
                        if isinstance(v, int | float) and not k.endswith(("_per_second", "runtime")))
    error = state.get("error") or {}
    tail = f": {error.get('message')}" if error else (f" ({metrics})" if metrics else "")
    rest = f"at step {state.get('step')}{tail}"
    return f"[{STATUS_STYLE.get(status, 'white')}]{plain(status)}[/] {plain(rest)}"
