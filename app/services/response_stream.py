"""A streamed chat choice as the Responses API's typed events, in OpenAI's order.

The chat path streams one choice as content, reasoning and tool-call deltas (core/tool_calls.py's ChoiceParser:
reasoning first, then content or calls). Each kind opens an output item when its first delta comes and the item
before it closes then: a reasoning item (reasoning_text deltas), a message (output_text deltas), one function_call
item per call (arguments deltas). Every event carries the next sequence_number. Plain state, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.services.response_items import call_item, item_id, message_item, reasoning_item

Event = dict[str, Any]  # {"type": "response.<...>", ..., "sequence_number": n}


@dataclass
class _Open:
    """The output item being streamed: its kind, index and text so far (a call: its arguments)."""

    kind: str  # reasoning, message, function_call
    index: int
    item: dict[str, Any]
    text: str = ""
    call: int | None = None  # a function_call's index among the choice's calls


@dataclass
class ResponseStream:
    """Turns a choice's deltas into Responses events; `items` holds the finished output items, in order."""

    sequence: int = 0
    items: list[dict[str, Any]] = field(default_factory=list)
    _open: _Open | None = None

    def event(self, kind: str, **values: Any) -> Event:
        """One event with the next sequence number."""
        out = {"type": kind, **values, "sequence_number": self.sequence}
        self.sequence += 1
        return out

    def feed(self, text: str, reasoning: str | None, tool_calls: list[dict[str, Any]] | None) -> list[Event]:
        """The events of one TokenEvent's deltas."""
        events: list[Event] = []
        if reasoning:
            events += self._delta("reasoning", reasoning)
        if text:
            events += self._delta("message", text)
        for delta in tool_calls or []:
            events += self._call(delta)
        return events

    def finish(self, status: str) -> list[Event]:
        """Close the open item (an answer with no delta at all: an empty message); `status` (completed or
        incomplete) is the last item's."""
        opened = self._start("message") if self._open is None and not self.items else []
        return [*opened, *self._close(status)]

    def _delta(self, kind: str, text: str) -> list[Event]:
        events = [] if self._open is not None and self._open.kind == kind else [*self._close(), *self._start(kind)]
        assert self._open is not None
        self._open.text += text
        where = {"item_id": self._open.item["id"], "output_index": self._open.index}
        if kind == "reasoning":
            events.append(self.event("response.reasoning_text.delta", **where, content_index=0, delta=text))
        else:
            events.append(self.event("response.output_text.delta", **where, content_index=0, delta=text,
                                     logprobs=[]))
        return events

    def _start(self, kind: str) -> list[Event]:
        index = len(self.items)
        part: dict[str, Any]
        if kind == "reasoning":
            item, part = reasoning_item(item_id("reasoning"), None, "in_progress"), {"type": "reasoning_text",
                                                                                    "text": ""}
        else:
            item, part = message_item(item_id("message"), None, "in_progress"), {
                "type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._open = _Open(kind, index, item)
        return [self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                           part=part)]

    def _call(self, delta: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        function = delta.get("function") or {}
        if "id" in delta:  # a new call: its first delta names it
            events += self._close()
            index = len(self.items)
            item = call_item(item_id("function_call"), delta["id"], function.get("name", ""), "", "in_progress")
            self._open = _Open("function_call", index, item, call=delta["index"])
            events.append(self.event("response.output_item.added", output_index=index, item=item))
        arguments = function.get("arguments") or ""
        if arguments and self._open is not None and self._open.call == delta["index"]:
            self._open.text += arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=self._open.item["id"],
                                     output_index=self._open.index, delta=arguments))
        return events

    def _close(self, status: str = "completed") -> list[Event]:
        opened, self._open = self._open, None
        if opened is None:
            return []
        where = {"item_id": opened.item["id"], "output_index": opened.index}
        if opened.kind == "function_call":
            item = call_item(opened.item["id"], opened.item["call_id"], opened.item["name"], opened.text, status)
            events = [self.event("response.function_call_arguments.done", **where, name=item["name"],
                                 arguments=opened.text)]
        elif opened.kind == "reasoning":
            item = reasoning_item(opened.item["id"], opened.text, status)
            events = [self.event("response.reasoning_text.done", **where, content_index=0, text=opened.text),
                      self.event("response.content_part.done", **where, content_index=0, part=item["content"][0])]
        else:
            item = message_item(opened.item["id"], opened.text, status)
            events = [self.event("response.output_text.done", **where, content_index=0, text=opened.text,
                                 logprobs=[]),
                      self.event("response.content_part.done", **where, content_index=0, part=item["content"][0])]
        self.items.append(item)
        events.append(self.event("response.output_item.done", output_index=opened.index, item=item))
        return events
