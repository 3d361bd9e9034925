"""A daemon thread that runs one round of work periodically and backs off while the round fails."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0


class Periodic:
    """Run `work()` every `interval` seconds; after a failure wait twice as long (up to 30 s) before retrying."""

    def __init__(self, name: str, interval: float, work: Callable[[], object]) -> None:
        self.name = name
        self.interval = interval
        self.work = work
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread (the first round runs at once)."""
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the thread to stop and wait for the round in progress."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        wait = self.interval
        while True:
            try:
                self.work()
                wait = self.interval
            except Exception:  # noqa: BLE001 - broker or database down: back off and try again
                log.warning("%s round failed; next try in %.0f s", self.name, wait, exc_info=True)
                wait = min(max(wait, self.interval) * 2, max(MAX_BACKOFF_S, self.interval))
            if self._stop.wait(wait):
                return
