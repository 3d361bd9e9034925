"""Generated tokens to streamed text: whole characters only, held back while a stop sequence may be forming."""

from __future__ import annotations

from worker.engines.generation.sampling.detokenize import Pieces


class TextStream:
    """Generated tokens -> text deltas: whole characters only (detokenize.Pieces), held back while a stop may form."""

    def __init__(self, pieces: Pieces, stop: tuple[str, ...] = ()) -> None:
        self._pieces = pieces
        self._stop = stop
        self._parts: list[str] = []
        self._pending = ""  # decoded but not yet handed out: a possible start of a stop sequence
        self.stopped = False
        self.stops_armed = True  # False: text passes unsearched (a request's first min_tokens tokens)

    @property
    def text(self) -> str:
        """The text so far, including what is held back."""
        return "".join(self._parts) + self._pending

    def push(self, token_id: int) -> str:
        """Add a token; returns the text that is now safe to emit ("" while held back). Sets `stopped`."""
        return self._feed(self._pieces.push(token_id))

    def finish(self) -> str:
        """End of generation: flush what the pieces held (incomplete bytes as U+FFFD, as decode) and held-back text."""
        delta = self._feed(self._pieces.finish())
        if self.stopped:
            return delta
        rest, self._pending = self._pending, ""
        self._parts.append(rest)
        return delta + rest

    def _feed(self, piece: str) -> str:
        if self.stopped or not piece:
            return ""
        if not self._stop or not self.stops_armed:
            self._parts.append(piece)
            return piece
        # A stop cannot start inside text already emitted (the longest possible start was held back),
        # so searching the pending tail is enough and the cost per token stays bounded.
        pending = self._pending + piece
        hits = [at for at in (pending.find(s) for s in self._stop) if at >= 0]
        if hits:
            self.stopped = True
            out, self._pending = pending[: min(hits)], ""
        else:
            hold = _longest_stop_prefix(pending, self._stop)
            out, self._pending = pending[: len(pending) - hold], pending[len(pending) - hold :]
        self._parts.append(out)
        return out


def _longest_stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    longest = min(len(text), max(len(s) for s in stops) - 1)
    for size in range(longest, 0, -1):
        tail = text[-size:]
        if any(s.startswith(tail) for s in stops):
            return size
    return 0
